"""Where do the engine's worker threads spend a distributed fit? A sampling profile.

Compares the engine inside the engine actor's worker with a plain process fed
by loader threads (``pipeline_probe.py``). This diagnostic starts a fresh
cluster per variant (a variant may change Dask configuration, which worker
processes read at start-up), fits the on-disk dataset of
``distributed_fit.py`` once, and meanwhile samples every thread's innermost
frames inside the engine's worker every ``--interval`` seconds. It reports the
wall time, the engine's busy and idle time (``history_``) and, per thread
kind, the most frequent frames.

    python benchmarks/actor_profile.py --rows 20000000 --data-dir /tmp/rhbench \\
        --variants default,noprofile --output benchmarks/results/actor_profile-h200.json
"""

from __future__ import annotations

import argparse
import collections
import sys
import threading
import time
from pathlib import Path
from typing import Any

from common import environment, write_json
from distributed_fit import (
    SOURCE,
    dask_inputs,
    parse_settings,
    start_cluster,
    stop_cluster,
    write_dataset,
)

from rh_dask import RenewableHuberRegressor

SCHEMA = "rh-dask/bench/actor-profile/1"

#: Dask configuration of each variant (set before the cluster starts, and
#: during the fits; ``--config`` adds to every variant).
VARIANTS: dict[str, dict[str, Any]] = {
    "default": {},
    "noprofile": {"distributed.worker.profile.enabled": False},
}


def start_sampler(interval: float, dask_worker: Any = None) -> None:
    """Run on the worker: sample every thread's innermost frames until stopped."""
    counts: collections.Counter[tuple[str, str]] = collections.Counter()
    stop = threading.Event()
    me = threading.get_ident()

    def where(frame: Any, depth: int = 3) -> str:
        parts = []
        while frame is not None and len(parts) < depth:
            code = frame.f_code
            parts.append(f"{code.co_filename.rsplit('/', 2)[-1]}:{frame.f_lineno}:{code.co_name}")
            frame = frame.f_back
        return " < ".join(parts)

    def loop() -> None:
        while not stop.wait(interval):
            names = {t.ident: t.name for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                if ident != me:
                    name = names.get(ident, "?")
                    kind = "loader" if "Dask-Default-Threads" in name else name
                    kind = "feeder" if name.startswith("rh-dask-feed_") else kind
                    counts[(kind, where(frame))] += 1

    thread = threading.Thread(target=loop, name="rh-sampler", daemon=True)
    dask_worker._rh_sampler = dict(
        counts=counts, stop=stop, thread=thread, start=time.perf_counter()
    )
    thread.start()


def stop_sampler(top: int, dask_worker: Any = None) -> dict[str, Any]:
    """Run on the worker: stop sampling and return the most frequent frames per thread kind."""
    _SAMPLER = dask_worker._rh_sampler
    _SAMPLER["stop"].set()
    _SAMPLER["thread"].join()
    counts = _SAMPLER["counts"]
    kinds: dict[str, list[tuple[str, int]]] = collections.defaultdict(list)
    for (kind, frame), n in counts.most_common():
        if len(kinds[kind]) < top:
            kinds[kind].append((frame, n))
    totals = collections.Counter()
    for (kind, _), n in counts.items():
        totals[kind] += n
    return {
        "seconds": time.perf_counter() - _SAMPLER["start"],
        "samples_per_kind": dict(totals),
        "top": dict(kinds),
    }


def run_variant(args: Any, directory: Path, name: str) -> dict[str, Any]:
    import dask

    with dask.config.set({**parse_settings(args.config), **VARIANTS[name]}):
        return _run_variant(args, directory)


def _run_variant(args: Any, directory: Path) -> dict[str, Any]:
    cluster, client, extra = start_cluster(args.engine, args.threads, 0, 0)
    try:
        params = dict(
            engine=args.engine, dtype=args.dtype, progress=False, lookahead=args.lookahead
        )
        RenewableHuberRegressor(**params).fit(
            *dask_inputs(directory, args.chunk_rows, rows=2 * args.chunk_rows)
        )
        X, y = dask_inputs(directory, args.chunk_rows)
        out: dict[str, Any] = {"walls": []}
        for repeat in range(args.repeats):
            sample = repeat == args.repeats - 1
            if sample:
                client.run(start_sampler, args.interval)
            model = RenewableHuberRegressor(**params)
            start = time.perf_counter()
            model.fit(X, y)
            out["walls"].append(time.perf_counter() - start)
            if sample:
                (out["profile"],) = client.run(stop_sampler, args.top).values()
            history = model.history_
            out["engine_seconds"] = float(history["seconds"].sum())
            out["wait_seconds"] = float(history["wait_seconds"].sum())
        return out
    finally:
        stop_cluster(cluster, client, extra)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--engine", default="gpu")
    p.add_argument("--rows", type=int, default=20_000_000)
    p.add_argument("--features", type=int, default=90)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--chunk-rows", type=int, default=65536)
    p.add_argument("--threads", type=int, default=12)
    p.add_argument("--lookahead", type=int, default=8)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--interval", type=float, default=0.002)
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--variants", default="default,noprofile")
    p.add_argument(
        "--config",
        default="rh-dask.distributed.heap-for-chunks=true",
        help="dask.config settings of every variant, KEY=VALUE,...",
    )
    p.add_argument("--data-dir", default="/tmp/rhbench")
    p.add_argument("--source", choices=["pread", "mmap"], default="pread")
    p.add_argument("--output", default="benchmarks/results/actor_profile.json")
    args = p.parse_args(argv)
    SOURCE["kind"] = args.source
    directory = Path(args.data_dir)
    dataset = write_dataset(directory, args.rows, args.features, args.dtype)
    payload: dict[str, Any] = {
        "schema": SCHEMA,
        "environment": environment(),
        "arguments": vars(args),
        "dataset": dataset,
        "variants": {},
    }
    for name in args.variants.split(","):
        payload["variants"][name] = result = run_variant(args, directory, name)
        write_json(args.output, payload)
        print(name, result["walls"], result["engine_seconds"], result["wait_seconds"], flush=True)
        for kind, frames in result["profile"]["top"].items():
            print(f"  [{kind}] {result['profile']['samples_per_kind'][kind]} samples")
            for frame, n in frames[:8]:
                print(f"     {n:6d}  {frame}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
