"""Where does a loading pipeline lose time, without Dask in the way?

Separates the loading pipeline of a distributed fit from Dask. This probe
rebuilds the same pipeline in one process with plain threads (loader
threads reading chunks of the on-disk dataset of ``distributed_fit.py``, an
engine thread consuming them strictly in order, at most ``lookahead`` chunks
loaded ahead), and varies only how a chunk reaches the engine:

* ``pageable``: a fresh NumPy array per chunk (what a Dask task returns); the
  engine copies it through its own pinned staging buffers;
* ``copy-pinned``: the fresh array is copied by the loader thread into a
  reusable pinned (page-locked) buffer; the engine copies it by DMA only;
* ``direct-pinned``: the loader reads the file straight into the pinned
  buffer (the lower bound: one copy per byte on the host).

Also timed: loading alone (fresh arrays, with and without host validation,
and straight into pinned buffers) and the engine alone on chunks already in
pageable or pinned memory.

    python benchmarks/pipeline_probe.py --rows 20000000 --data-dir /tmp/rhbench \\
        --output benchmarks/results/pipeline_probe-h200.json
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
from common import environment, write_json
from distributed_fit import NpyRows, bounds, write_dataset

from rh_dask import HuberConfig, make_engine
from rh_dask.distributed.items import ChunkSpec
from rh_dask.distributed.loading import assemble_chunk

SCHEMA = "rh-dask/bench/pipeline-probe/1"
MODES = ("pageable", "copy-pinned", "direct-pinned")


class PinnedPool:
    """``slots`` reusable pinned buffers of X and y rows, handed out and returned."""

    def __init__(self, slots: int, rows: int, features: int, dtype: np.dtype) -> None:
        import cupy as cp

        from gpu_engine.transfer import PinnedBuffer

        item = np.dtype(dtype).itemsize
        self._buffers = [PinnedBuffer(cp, rows * (features + 1) * item) for _ in range(slots)]
        self._free = list(range(slots))
        self._cond = threading.Condition()
        self.rows, self.features, self.dtype = rows, features, np.dtype(dtype)

    def take(self) -> int:
        with self._cond:
            while not self._free:
                self._cond.wait()
            return self._free.pop()

    def give(self, slot: int) -> None:
        with self._cond:
            self._free.append(slot)
            self._cond.notify()

    def views(self, slot: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        buf, d = self._buffers[slot], self.features
        X = buf.view(self.dtype, n * d).reshape(n, d)
        y = buf.view(self.dtype, n, self.rows * d * self.dtype.itemsize)
        return X, y

    def close(self) -> None:
        for buf in self._buffers:
            buf.free()


def timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def load_only(Xs: NpyRows, ys: NpyRows, spans: list, threads: int, how: str, pool=None) -> float:
    spec = ChunkSpec(index=0, dtype=str(Xs.dtype), n_features=Xs.shape[1], feature_names=None)

    def one(span: tuple[int, int]) -> None:
        lo, hi = span
        if how == "direct-pinned":
            slot = pool.take()
            X, y = pool.views(slot, hi - lo)
            Xs.read_into(lo, hi, X)
            ys.read_into(lo, hi, y)
            pool.give(slot)
            return
        X, y = Xs[lo:hi], ys[lo:hi]
        if how == "validate":
            assemble_chunk(X, y, None, spec)

    with ThreadPoolExecutor(threads) as ex:
        return timed(lambda: list(ex.map(one, spans)))


def engine_alone(engine: Any, chunks: list[tuple[np.ndarray, np.ndarray]]) -> float:
    engine.reset()
    return timed(lambda: [None for _ in engine.partial_fit_stream(chunks)])


def pipeline(
    engine: Any,
    Xs: NpyRows,
    ys: NpyRows,
    spans: list,
    threads: int,
    lookahead: int,
    mode: str,
    pool: PinnedPool | None,
) -> dict[str, float]:
    """Loader threads → in-order engine thread; returns wall and engine idle time."""
    n = len(spans)
    inbox: dict[int, tuple[np.ndarray, np.ndarray, int | None]] = {}
    cond = threading.Condition()
    permits = threading.Semaphore(lookahead)
    counter = itertools.count()
    order = threading.Lock()
    failures: list[BaseException] = []

    def loader() -> None:
        try:
            while True:
                permits.acquire()  # before taking an index: permits go out in index order
                with order:
                    i = next(counter)
                if i >= n:
                    permits.release()
                    return
                lo, hi = spans[i]
                slot = None
                if mode == "pageable":
                    X, y = Xs[lo:hi], ys[lo:hi]
                else:
                    slot = pool.take()
                    X, y = pool.views(slot, hi - lo)
                    if mode == "copy-pinned":
                        np.copyto(X, Xs[lo:hi])
                        np.copyto(y, ys[lo:hi])
                    else:
                        Xs.read_into(lo, hi, X)
                        ys.read_into(lo, hi, y)
                with cond:
                    inbox[i] = (X, y, slot)
                    cond.notify_all()
        except BaseException as exc:  # surface in the main thread
            failures.append(exc)
            with cond:
                cond.notify_all()

    idle = [0.0]
    held: list[int | None] = []

    def batches() -> Iterator[tuple[np.ndarray, np.ndarray]]:
        for i in range(n):
            start = time.perf_counter()
            with cond:
                while i not in inbox and not failures:
                    cond.wait()
                if failures:
                    raise failures[0]
                X, y, slot = inbox.pop(i)
            idle[0] += time.perf_counter() - start
            held.append(slot)
            yield X, y

    engine.reset()
    workers = [threading.Thread(target=loader, daemon=True) for _ in range(threads)]
    start = time.perf_counter()
    for t in workers:
        t.start()
    for _ in engine.partial_fit_stream(batches()):
        slot = held.pop(0)  # this batch is solved: its DMA is long done
        if slot is not None:
            pool.give(slot)
        permits.release()
    wall = time.perf_counter() - start
    for t in workers:
        t.join()
    return {"wall_seconds": wall, "engine_idle_seconds": idle[0]}


def probe_size(
    args: Any, engine: Any, Xs: NpyRows, ys: NpyRows, size: int, thread_counts: list[int]
) -> dict[str, Any]:
    import cupy as cp

    from gpu_engine.transfer import PinnedBuffer

    def median(fn: Callable[[], float]) -> dict[str, Any]:
        runs = [fn() for _ in range(args.repeats)]
        return {"median_seconds": statistics.median(runs), "runs": runs}

    spans = bounds(args.rows, size)
    pool = PinnedPool(args.lookahead + 2, size, args.features, Xs.dtype)
    entry: dict[str, Any] = {"chunk_rows": size, "n_chunks": len(spans)}
    cores = os.cpu_count() or 1
    entry["load"] = {
        how: median(lambda how=how: load_only(Xs, ys, spans, cores, how, pool))
        for how in ("fresh", "validate", "direct-pinned")
    }
    chunks = [(Xs[lo:hi], ys[lo:hi]) for lo, hi in spans]
    engine.partial_fit(*chunks[0])  # warm-up: graphs for this shape
    entry["engine_pageable"] = median(lambda: engine_alone(engine, chunks))
    reference = engine.coefficients()
    chunks.clear()
    big = PinnedBuffer(cp, args.rows * (args.features + 1) * Xs.dtype.itemsize)
    Xp = big.view(Xs.dtype, args.rows * args.features).reshape(args.rows, args.features)
    yp = big.view(Xs.dtype, args.rows, args.rows * args.features * Xs.dtype.itemsize)
    for lo, hi in spans:
        Xs.read_into(lo, hi, Xp[lo:hi])
        ys.read_into(lo, hi, yp[lo:hi])
    pinned = [(Xp[lo:hi], yp[lo:hi]) for lo, hi in spans]
    entry["engine_pinned"] = median(lambda: engine_alone(engine, pinned))
    same_pinned = bool(np.array_equal(engine.coefficients(), reference))
    entry["engine_pinned"]["coefficients_equal_pageable"] = same_pinned
    pinned.clear()
    del Xp, yp
    big.free()
    entry["pipeline"] = {}
    for mode in args.modes.split(","):
        for threads in thread_counts:
            runs = [
                pipeline(engine, Xs, ys, spans, threads, args.lookahead, mode, pool)
                for _ in range(args.repeats)
            ]
            walls = [r["wall_seconds"] for r in runs]
            entry["pipeline"][f"{mode},T={threads}"] = {
                "median_seconds": statistics.median(walls),
                "runs": runs,
                "coefficients_equal_engine_alone": bool(
                    np.array_equal(engine.coefficients(), reference)
                ),
            }
            print(size, mode, threads, statistics.median(walls), flush=True)
    pool.close()
    return entry


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=20_000_000)
    p.add_argument("--features", type=int, default=90)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--chunk-rows", default="65536,262144")
    p.add_argument("--threads", default="4,8,12")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument(
        "--heap", action="store_true", help="keep chunks on malloc's heap (rh_dask memory)"
    )
    p.add_argument("--lookahead", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--data-dir", default="/tmp/rhbench")
    p.add_argument("--output", default="benchmarks/results/pipeline_probe.json")
    args = p.parse_args(argv)
    directory = Path(args.data_dir)
    if args.heap:
        from rh_dask.distributed.memory import heap_for_chunks

        if heap_for_chunks() is None:
            raise SystemExit("--heap needs glibc")
    dataset = write_dataset(directory, args.rows, args.features, args.dtype)
    Xs, ys = NpyRows(str(directory / "X.npy")), NpyRows(str(directory / "y.npy"))
    thread_counts = [int(t) for t in args.threads.split(",")]
    engine = make_engine("gpu", HuberConfig(dtype=args.dtype))
    payload: dict[str, Any] = {
        "schema": SCHEMA,
        "environment": environment(),
        "arguments": vars(args),
        "malloc_env": {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")},
        "dataset": dataset,
        "results": [],
    }

    for size in (int(s) for s in args.chunk_rows.split(",")):
        entry = probe_size(args, engine, Xs, ys, size, thread_counts)
        payload["results"].append(entry)
        write_json(args.output, payload)
        print({k: v for k, v in entry.items() if k != "pipeline"}, flush=True)
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
