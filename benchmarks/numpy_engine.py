"""Speed of the NumPy reference engine on whole streams (CPU).

Times one full stream (empty state → last batch) through ``NumpyEngine``,
engine reused and reset outside the timer, for a few shapes, both dtypes and
both penalties; optionally the same stream through renewable-huber's NumPy
backend as an opponent. Writes schema-versioned JSON.

    python benchmarks/numpy_engine.py --repeats 5 --output benchmarks/results/numpy_engine.json
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from common import SHAPES, environment, fingerprint, summarize, write_json

from rh_dask import HuberConfig, NumpyEngine
from rh_dask.datasets import StreamSpec

SCHEMA = "rh-dask/bench/numpy-engine/1"


def make_stream(rows: int, features: int, batch: int, dtype: str):
    spec = StreamSpec(n_features=features, seed=7)
    X, y = spec.chunk(0, rows, "float64")
    X, y = X.astype(dtype), y.astype(dtype)
    return [(X[s : s + batch], y[s : s + batch]) for s in range(0, rows, batch)], X, y


def time_rh_dask(batches, config: HuberConfig, repeats: int):
    engine = NumpyEngine(config)
    samples, iterations = [], []
    for _ in range(repeats + 1):  # the first pass warms caches and allocates workspaces
        engine.reset()
        its = []
        start = time.perf_counter()
        for X, y in batches:
            its.append(engine.partial_fit(X, y).iterations)
        samples.append(time.perf_counter() - start)
        iterations.append(its)
    return samples[1:], iterations[-1], engine.coefficients()


def time_opponent(batches, config: HuberConfig, repeats: int):
    try:
        import renewable_huber
    except ImportError:
        return None
    samples, its = [], []
    for _ in range(repeats + 1):
        model = renewable_huber.RenewableHuberRegressor(
            penalty=config.penalty, dtype=config.dtype, backend="numpy"
        )
        start = time.perf_counter()
        its = []
        for X, y in batches:
            model.partial_fit(X, y)
            its.append(model.diagnostics_.iterations)
        samples.append(time.perf_counter() - start)
    return samples[1:], its, np.asarray(model.state_.coefficients)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--dtypes", nargs="+", default=["float64", "float32"])
    parser.add_argument("--penalties", nargs="+", default=["none", "l1"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--opponent", action="store_true", help="also time renewable-huber")
    parser.add_argument("--output", default="benchmarks/results/numpy_engine.json")
    args = parser.parse_args(argv)

    cases = []
    for shape in args.shapes:
        rows, features, batch = SHAPES[shape]
        for dtype in args.dtypes:
            batches, X, y = make_stream(rows, features, batch, dtype)
            for penalty in args.penalties:
                config = HuberConfig(penalty=penalty, dtype=dtype)
                samples, its, coef = time_rh_dask(batches, config, args.repeats)
                case = {
                    "shape": shape,
                    "rows": rows,
                    "features": features,
                    "batch_rows": batch,
                    "batches": len(batches),
                    "dtype": dtype,
                    "penalty": penalty,
                    "dataset_sha256": fingerprint(X, y),
                    "rh_dask_numpy": {
                        "stream_seconds": samples,
                        **summarize(samples),
                        "iterations": its,
                    },
                }
                line = (
                    f"{shape:9s} {dtype} {penalty:4s} rh-dask {np.median(samples) * 1e3:9.1f} ms"
                )
                if args.opponent:
                    result = time_opponent(batches, config, args.repeats)
                    if result is not None:
                        o_samples, o_its, o_coef = result
                        case["renewable_huber_numpy"] = {
                            "stream_seconds": o_samples,
                            **summarize(o_samples),
                            "iterations": o_its,
                            "max_abs_coef_diff": float(np.max(np.abs(o_coef - coef))),
                        }
                        ratio = np.median(o_samples) / np.median(samples)
                        line += f" | renewable-huber {np.median(o_samples) * 1e3:9.1f} ms"
                        line += f" ({ratio:.2f}x)"
                print(line, flush=True)
                cases.append(case)
    write_json(args.output, {"schema": SCHEMA, "environment": environment(), "cases": cases})
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
