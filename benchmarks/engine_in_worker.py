"""Is the engine slower inside a Dask worker process than in a plain process?

Separates the engine from the pipeline around it in a distributed fit. This
diagnostic removes the pipeline: it times the engine alone on
chunks already in memory, from a thread, (1) in this process and (2) inside
the engine's worker (``client.run``), reporting the worker's CPU affinity,
allocator-related environment and CuPy allocator, (3) in the worker again
after resetting its CPU affinity to every core, and (4) after also fixing
glibc's mmap threshold.

    python benchmarks/engine_in_worker.py --engine gpu --rows 4000000 \\
        --output benchmarks/results/engine_in_worker-h200.json
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from typing import Any

from common import environment, fit_chunks, write_json

SCHEMA = "rh-dask/bench/engine-in-worker/1"


def time_engine(
    engine_name: str,
    rows: int,
    chunk_rows: int,
    dtype: str,
    all_cores: bool = False,
    malloc_heap: bool = False,
) -> dict[str, Any]:
    """Time one stream through the engine on a separate thread (as in the actor).

    ``malloc_heap`` fixes glibc's mmap threshold at 1 GiB (``mallopt``), undoing
    the effect of the ``MALLOC_TRIM_THRESHOLD_`` Dask's nanny sets.
    """
    import ctypes

    import numpy as np

    if malloc_heap:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 1 << 30)  # M_MMAP_THRESHOLD
        libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD

    from rh_dask import HuberConfig, make_engine
    from rh_dask.datasets import StreamSpec

    if all_cores and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, range(os.cpu_count() or 1))
    spec = StreamSpec(n_features=90, seed=7)
    chunks = [spec.chunk(i, chunk_rows, dtype) for i in range(rows // chunk_rows)]
    out: dict[str, Any] = {}

    def work() -> None:
        engine = make_engine(engine_name, HuberConfig(dtype=dtype))
        engine.partial_fit(*chunks[0])  # warm-up
        engine.reset()
        start = time.perf_counter()
        fit_chunks(engine, chunks)
        out["seconds"] = time.perf_counter() - start
        out["coef0"] = float(engine.coefficients()[0])

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    try:
        import cupy

        allocator = repr(cupy.cuda.get_allocator())
    except Exception as exc:  # no CuPy: record why
        allocator = repr(exc)
    out.update(
        ms_per_chunk=1e3 * out["seconds"] / len(chunks),
        chunks=len(chunks),
        pid=os.getpid(),
        affinity=sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        switch_interval=sys.getswitchinterval(),
        env={
            k: v for k, v in os.environ.items() if k.startswith(("MALLOC", "OMP", "CUDA", "RMM"))
        },
        cupy_allocator=allocator,
        np_dtype=str(np.dtype(dtype)),
    )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--engine", choices=["gpu", "numpy"], default="gpu")
    p.add_argument("--rows", type=int, default=4_000_000)
    p.add_argument("--chunk-rows", type=int, default=65_536)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=12)
    p.add_argument("--output", default="benchmarks/results/engine_in_worker.json")
    args = p.parse_args(argv)

    sys.path.insert(0, os.path.dirname(__file__))
    from distributed_fit import describe_cluster, start_cluster

    job = (args.engine, args.rows, args.chunk_rows, args.dtype)
    payload: dict[str, Any] = {
        "schema": SCHEMA,
        "environment": environment(),
        "arguments": vars(args),
    }
    payload["this_process"] = time_engine(*job)
    print("this process", payload["this_process"]["ms_per_chunk"], flush=True)
    cluster, client, _ = start_cluster(args.engine, args.threads, 0, 0)
    try:
        payload["cluster"] = describe_cluster(client)
        variants = (
            ("worker", False, False),
            ("worker_all_cores", True, False),
            ("worker_malloc_heap", True, True),
        )
        for name, all_cores, heap in variants:
            result = next(iter(client.run(time_engine, *job, all_cores, heap).values()))
            payload[name] = result
            print(name, result["ms_per_chunk"], result["affinity"], flush=True)
    finally:
        client.close()
        cluster.close()
    write_json(args.output, payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
