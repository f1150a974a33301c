"""``rh-dask demo``: the main job end to end on generated data.

Writes a heavy-tailed, outlier-contaminated stream (:class:`StreamSpec`) to
a Parquet dataset on disk, one file per chunk, so that the fit reads it back
out of core exactly as it would read a user's data; fits it through the
distributed fit; and compares the coefficients with the truth and with
ordinary least squares computed from the same rows.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from ..datasets import StreamSpec
from ..distributed.chunks import stable_partitions
from .io import Table

__all__ = ["DemoComparison", "compare", "least_squares", "write_stream"]


def _chunk_frame(spec: StreamSpec, index: int, rows: int, dtype: str) -> pd.DataFrame:
    X, y = spec.chunk(index, rows, dtype)
    frame = pd.DataFrame(X, columns=[f"x{j}" for j in range(spec.n_features)])
    frame["y"] = y
    return frame


def write_stream(
    spec: StreamSpec, rows: int, chunk_rows: int, path: str | Path, dtype: str = "float64"
) -> dict[str, Any]:
    """Write ``rows`` rows of ``spec`` as a Parquet dataset, one file per chunk.

    Chunks are generated and written in parallel by whatever dask scheduler
    is active (the cluster's workers under a ``distributed`` client).
    Feature columns are ``x0 .. x{d-1}``, the target ``y``.

    Returns
    -------
    dict
        ``path``, ``rows``, ``chunks`` and ``seconds`` taken.
    """
    import dask
    import dask.dataframe as dd

    start = time.perf_counter()
    sizes = [min(chunk_rows, rows - offset) for offset in range(0, rows, chunk_rows)]
    parts = [
        dask.delayed(_chunk_frame)(spec, i, n, dtype)
        for i, n in enumerate(sizes)  # chunk i is seeded by i alone
    ]
    meta = _chunk_frame(spec, 0, 0, dtype)
    # Zero-padded names keep the files in chunk order whatever sorts them.
    width = len(str(len(sizes)))
    dd.from_delayed(parts, meta=meta, verify_meta=False).to_parquet(
        path, write_index=False, name_function=lambda i: f"chunk-{i:0{width}d}.parquet"
    )
    return {
        "path": str(path),
        "rows": rows,
        "chunks": len(sizes),
        "seconds": time.perf_counter() - start,
    }


def _partition_moments(
    part: Any, features: list[str], target: str, fit_intercept: bool
) -> tuple[np.ndarray, np.ndarray]:
    Z = part[features].to_numpy(dtype=np.float64)
    y = part[target].to_numpy(dtype=np.float64)
    if fit_intercept:
        Z = np.column_stack([Z, np.ones(len(Z))])
    return Z.T @ Z, Z.T @ y


def least_squares(table: Table, fit_intercept: bool = True) -> np.ndarray:
    """Ordinary least squares over the same rows, out of core (normal equations).

    Each partition of the table contributes ZᵀZ and Zᵀy; only those p×p sums
    come back. Returns β with the intercept last.
    """
    import dask

    frame, target, _ = table.fit_inputs()
    if frame is None or not isinstance(target, str):
        raise ValueError("least_squares needs a table (Parquet or CSV) with a target column")
    features = list(table.feature_names)
    with stable_partitions():
        pieces = [
            dask.delayed(_partition_moments)(part, features, target, fit_intercept)
            for part in frame.to_delayed()
        ]
        moments = dask.compute(*pieces)
    gram = sum(m[0] for m in moments)
    moment = sum(m[1] for m in moments)
    return np.linalg.solve(gram, moment)


@dataclass(frozen=True)
class DemoComparison:
    """Coefficient errors ‖β̂ − β‖₂ against the truth (intercept included)."""

    huber_error: float
    ols_error: float
    truth: np.ndarray
    ols: np.ndarray

    def to_dict(self) -> dict[str, Any]:
        return {
            "huber_error": self.huber_error,
            "least_squares_error": self.ols_error,
            "truth": self.truth.tolist(),
            "least_squares": self.ols.tolist(),
        }


def compare(spec: StreamSpec, huber: np.ndarray, table: Table) -> DemoComparison:
    """Errors of the robust fit and of least squares against ``spec``'s truth."""
    truth = np.append(spec.coefficients(), spec.intercept)
    ols = least_squares(table)
    return DemoComparison(
        huber_error=float(np.linalg.norm(huber - truth)),
        ols_error=float(np.linalg.norm(ols - truth)),
        truth=truth,
        ols=ols,
    )
