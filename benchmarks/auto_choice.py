"""What ``engine="auto"`` chooses per case, what its calibration costs, and what the choice buys.

For each case (the shapes of the issue's table) it runs a fresh calibration
(:class:`rh_dask.engines.auto.AutoCalibrator`, the packaged settings), then
times a fresh estimator's plain ``partial_fit`` loop over the same host
(NumPy) batches with ``engine="numpy"``, ``engine="gpu"`` and
``engine="auto"`` (the decision cached, so its calibration is not in the
loop: it is reported on its own, once per process). Prints one JSON object
per case.

    python benchmarks/auto_choice.py [--batches 4] [--repeats 3] [--cases latency,reference]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from rh_dask import HuberConfig, RenewableHuberRegressor
from rh_dask.engines.auto import AutoCalibrator, default_calibrator
from rh_dask.exceptions import EngineUnavailableError
from rh_dask.settings import Settings

CASES = {
    "latency": (4096, 16, "float32"),
    "reference": (100_000, 90, "float32"),
    "reference-f64": (100_000, 90, "float64"),
    "wide": (16_384, 256, "float32"),
    "streaming": (1_000_000, 32, "float32"),
}


def _batches(n: int, d: int, dtype: str, count: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    beta = rng.standard_normal(d)
    out = []
    for _ in range(count):
        X = rng.standard_normal((n, d)).astype(dtype)
        y = (X.astype(np.float64) @ beta + rng.standard_t(3.0, size=n)).astype(dtype)
        out.append((X, y))
    return out


def _stream_ms(engine: str, dtype: str, batches, repeats: int) -> float | None:
    """Best of ``repeats`` fresh-estimator loops, in milliseconds (None: engine unavailable)."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        model = RenewableHuberRegressor(engine=engine, dtype=dtype)
        try:
            for X, y in batches:
                model.partial_fit(X, y)
            model.coef_  # noqa: B018 -- the state is final when read
        except EngineUnavailableError:
            return None
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cases", default=",".join(CASES))
    args = parser.parse_args()
    settings = Settings.from_config()
    for name in args.cases.split(","):
        n, d, dtype = CASES[name]
        config = HuberConfig(dtype=dtype)
        choice = AutoCalibrator().choose(config, n, d, settings=settings)
        batches = _batches(n, d, dtype, args.batches)
        # Warm the process's cache so that the auto loop below does not calibrate.
        default_calibrator().choose(config, n, d, settings=settings)
        times = {
            engine: _stream_ms(engine, dtype, batches, args.repeats)
            for engine in ("numpy", "gpu", "auto")
        }
        known = [t for e, t in times.items() if e != "auto" and t is not None]
        print(
            json.dumps(
                {
                    "case": name,
                    "shape": [n, d],
                    "dtype": dtype,
                    "choice": choice.engine,
                    "reason": choice.reason,
                    "predicted_ratio": choice.predicted_ratio,
                    "ratios": [[r, round(q, 4)] for r, q in choice.ratios],
                    "probe_rows": list(choice.plan.rows) if choice.plan else None,
                    "calibration_s": round(choice.calibration_seconds, 4),
                    "stream_ms": {k: None if v is None else round(v, 2) for k, v in times.items()},
                    "auto_over_best": None
                    if not known or times["auto"] is None
                    else round(times["auto"] / min(known), 3),
                    "batches": args.batches,
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
