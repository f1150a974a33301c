"""What accumulating the score variance K (and the GPU's robust diagnostics) cost per batch.

For each engine (``numpy``, ``gpu`` where CuPy sees a device) and shape, one
engine with K on and one with K off (the GPU engine's ``score_variance=``;
the NumPy engine always accumulates, so its "off" column is a state imported
without K, which skips the Gram) fit the same batches; the per-batch time is
the median over ``--repeats`` passes over the stream, K-on and K-off passes
alternating. For the GPU engine a third pass computes the robust
diagnostics alone (``diagnostics=True``, K off; the other two have them
off). Device input (CuPy arrays) for the GPU engine, so the numbers
are the solve's own.

    python benchmarks/score_variance_cost.py --engines gpu,numpy \\
        --output benchmarks/results/score_variance_cost-h200.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

from common import environment, write_json

from rh_dask import HuberConfig, NumpyEngine
from rh_dask.datasets import StreamSpec

SCHEMA = "rh-dask/bench/score-variance-cost/1"
SHAPES = {"reference": (100_000, 90), "streaming": (1_000_000, 32), "wide": (16_384, 256)}


def _engine(name: str, config: HuberConfig, k_on: bool, diagnostics: bool) -> Any:
    if name == "gpu":
        from gpu_engine import GpuEngine

        return GpuEngine(config, score_variance=k_on, diagnostics=diagnostics)
    return NumpyEngine(config)


def _pass(
    name: str, config: HuberConfig, batches: list, k_on: bool, sync: Any, diagnostics: bool
) -> float:
    engine = _engine(name, config, k_on, diagnostics)
    engine.partial_fit(*batches[0])
    if name == "numpy" and not k_on:
        state = engine.export_state()
        state.score_variance = None
        engine.import_state(state)
    sync()
    start = time.perf_counter()
    for X, y in batches[1:]:
        engine.partial_fit(X, y)
    engine.coefficients()
    sync()
    seconds = (time.perf_counter() - start) / (len(batches) - 1)
    if hasattr(engine, "close"):
        engine.close()
    return seconds


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--engines", default="gpu,numpy")
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--dtype", default="float32")
    p.add_argument("--batches", type=int, default=9)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--output", required=True)
    args = p.parse_args(argv)
    config = HuberConfig(dtype=args.dtype)
    results = []
    for name in args.engines.split(","):
        for shape in args.shapes.split(","):
            rows, features = SHAPES[shape]
            batches_rows = rows if name == "gpu" else min(rows, 200_000)
            X, y = StreamSpec(n_features=features, seed=3).chunk(
                0, batches_rows * args.batches, args.dtype
            )
            batches = [
                (
                    X[i * batches_rows : (i + 1) * batches_rows],
                    y[i * batches_rows : (i + 1) * batches_rows],
                )
                for i in range(args.batches)
            ]
            sync = lambda: None  # noqa: E731
            if name == "gpu":
                import cupy as cp

                batches = [(cp.asarray(a), cp.asarray(b)) for a, b in batches]
                sync = cp.cuda.Device().synchronize
            # K on / off with the robust diagnostics off, and (GPU) the diagnostics alone.
            modes = {"on": (True, False), "off": (False, False)}
            if name == "gpu":
                modes["diagnostics"] = (False, True)
            runs: dict[str, list[float]] = {key: [] for key in modes}
            for r in range(args.repeats):
                order = list(modes) if r % 2 == 0 else list(reversed(modes))
                for key in order:
                    k_on, diag = modes[key]
                    runs[key].append(_pass(name, config, batches, k_on, sync, diag))
            on, off = statistics.median(runs["on"]), statistics.median(runs["off"])
            diag_ms = (
                statistics.median(runs["diagnostics"]) * 1e3 if "diagnostics" in runs else None
            )
            results.append(
                {
                    "engine": name,
                    "shape": shape,
                    "rows": batches_rows,
                    "features": features,
                    "dtype": args.dtype,
                    "ms_per_batch_k_on": on * 1e3,
                    "ms_per_batch_k_off": off * 1e3,
                    "ratio": on / off,
                    "ms_per_batch_diagnostics_only": diag_ms,
                    "runs_ms": {k: [x * 1e3 for x in v] for k, v in runs.items()},
                }
            )
            print(
                f"{name} {shape}: K on {on * 1e3:.3f} ms, off {off * 1e3:.3f} ms, "
                f"diagnostics only {diag_ms} ms",
                flush=True,
            )
    payload = {
        "schema": SCHEMA,
        "environment": environment(),
        "arguments": vars(args),
        "results": results,
    }
    print(write_json(args.output, payload))
    return 0


if __name__ == "__main__":
    sys.exit(main())
