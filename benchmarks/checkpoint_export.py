"""What one stream checkpoint costs the engine: ``export_state`` between two batches.

During a Dask walk the engine's thread copies the state off the engine after
every ``checkpoint_every`` chunks (:meth:`OrderedConsumer._maybe_checkpoint`),
between two batches; everything else a checkpoint costs (sending it with the
next poll, encoding and writing it) happens on the worker's event loop and
on the client, while the engine goes on. This times that copy against the
batch it follows, so the engine-side overhead of a checkpoint cadence is
``export / (checkpoint_every * batch)``: a bound the whole-fit timings of
``faults.py`` cannot resolve, their runs spreading by several per cent.

    python benchmarks/checkpoint_export.py --engine gpu \\
        --output benchmarks/results/checkpoint-export-h200.json
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from common import environment, summarize, write_json

from rh_dask.config import HuberConfig
from rh_dask.engines import make_engine

SCHEMA = "rh-dask/bench/checkpoint-export/1"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine", choices=["gpu", "numpy"], default="gpu")
    p.add_argument("--rows", type=int, default=312_500, help="rows of one batch")
    p.add_argument("--features", type=int, default=90)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--output", default="benchmarks/results/checkpoint-export.json")
    args = p.parse_args(argv)
    engine = make_engine(args.engine, HuberConfig(dtype=args.dtype))
    rng = np.random.default_rng(0)
    X = rng.normal(size=(args.rows, args.features)).astype(args.dtype)
    y = (X[:, :5].sum(axis=1) + rng.standard_t(2, args.rows)).astype(args.dtype)
    for _ in range(3):  # start-up: kernels, workspaces
        engine.partial_fit(X, y)
    batch, export = [], []
    for _ in range(args.repeats):
        start = time.perf_counter()
        engine.partial_fit(X, y)
        batch.append(time.perf_counter() - start)
        start = time.perf_counter()
        engine.export_state()
        export.append(time.perf_counter() - start)
    b, e = float(np.median(batch)), float(np.median(export))
    payload = {
        "schema": SCHEMA,
        "environment": environment(),
        "arguments": vars(args),
        "batch_seconds": summarize(batch),
        "export_state_seconds": summarize(export),
        "export_per_batch": e / b,
        "engine_overhead_percent": {str(n): 100 * e / (n * b) for n in (1, 4, 16, 64)},
    }
    write_json(args.output, payload)
    overhead = payload["engine_overhead_percent"]
    print(f"batch {b * 1e3:.2f} ms, export_state {e * 1e6:.0f} us; overhead % {overhead}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
