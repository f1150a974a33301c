"""In-process demo: a heavy-tailed stream with outliers, fitted batch by batch.

Prints the coefficient error of the renewable Huber fit next to ordinary least
squares on the same rows. ``python -m rh_dask.demo --help`` for options.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import numpy as np

from .datasets import StreamSpec
from .estimator import RenewableHuberRegressor


@dataclass(frozen=True)
class DemoResult:
    rows: int
    batches: int
    seconds: float
    huber_error: float
    ols_error: float
    coef: np.ndarray


def run_local_demo(
    n_rows: int = 400_000,
    chunk_rows: int = 50_000,
    spec: StreamSpec | None = None,
    engine: str = "auto",
    dtype: str = "float64",
) -> DemoResult:
    """Stream ``n_rows`` rows in chunks through ``partial_fit``; compare with OLS.

    OLS is accumulated from the same chunks (XᵀX and Xᵀy), so the comparison
    uses exactly the rows the robust fit saw.
    """
    spec = spec or StreamSpec()
    model = RenewableHuberRegressor(engine=engine, dtype=dtype)
    p = spec.n_features + 1
    gram = np.zeros((p, p))
    moment = np.zeros(p)
    seconds = 0.0
    batches = 0
    for index, offset in enumerate(range(0, n_rows, chunk_rows)):
        X, y = spec.chunk(index, min(chunk_rows, n_rows - offset), dtype)
        tick = time.perf_counter()
        model.partial_fit(X, y)
        seconds += time.perf_counter() - tick
        Z = np.column_stack([X, np.ones(len(X))])
        gram += Z.T @ Z
        moment += Z.T @ y
        batches += 1
    truth = np.append(spec.coefficients(), spec.intercept)
    ols = np.linalg.solve(gram, moment)
    huber = np.append(model.coef_, model.intercept_)
    return DemoResult(
        rows=n_rows,
        batches=batches,
        seconds=seconds,
        huber_error=float(np.linalg.norm(huber - truth)),
        ols_error=float(np.linalg.norm(ols - truth)),
        coef=huber,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=400_000)
    parser.add_argument("--chunk-rows", type=int, default=50_000)
    parser.add_argument("--features", type=int, default=20)
    parser.add_argument("--engine", default="auto", choices=["auto", "numpy", "gpu"])
    parser.add_argument("--dtype", default="float64", choices=["float64", "float32"])
    args = parser.parse_args(argv)
    result = run_local_demo(
        args.rows, args.chunk_rows, StreamSpec(n_features=args.features), args.engine, args.dtype
    )
    print(
        f"fitted {result.rows:,} rows in {result.batches} batches "
        f"({result.rows / result.seconds:,.0f} rows/s)\n"
        f"coefficient error ‖β̂ − β‖₂: renewable Huber {result.huber_error:.4f}, "
        f"least squares {result.ols_error:.4f} "
        f"({result.ols_error / result.huber_error:.1f}x larger)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
