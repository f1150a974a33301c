"""Built-in synthetic data: heavy-tailed, outlier-contaminated linear streams.

Used by the demo, the tests and the benchmarks, so that everyone measures on
the same kind of data. Generation is chunked and seeded per chunk, so any
chunk can be regenerated independently and in parallel.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class StreamSpec:
    """A reproducible synthetic regression stream.

    Parameters
    ----------
    n_features : int
        Number of features d.
    noise_df : float
        Degrees of freedom of the Student-t noise (heavy tails for small values).
    outlier_fraction : float
        Fraction of rows whose target is replaced by a gross outlier.
    outlier_scale : float
        Scale of the outliers (added to the clean target).
    intercept : float
        True intercept.
    seed : int
        Seed of the true coefficients and of every chunk.
    """

    n_features: int = 20
    noise_df: float = 2.0
    outlier_fraction: float = 0.05
    outlier_scale: float = 50.0
    intercept: float = 1.0
    seed: int = 0

    def coefficients(self) -> np.ndarray:
        """The true feature coefficients (a fixed draw per seed)."""
        rng = np.random.default_rng([self.seed, 0])
        return rng.normal(0.0, 1.0, size=self.n_features).round(3)

    def chunk(
        self, index: int, rows: int, dtype: np.dtype | str = "float64"
    ) -> tuple[np.ndarray, np.ndarray]:
        """Rows of chunk ``index``: (X, y), independent of every other chunk."""
        rng = np.random.default_rng([self.seed, 1, index])
        X = rng.standard_normal((rows, self.n_features))
        noise = rng.standard_t(self.noise_df, size=rows)
        y = X @ self.coefficients() + self.intercept + noise
        outliers = rng.random(rows) < self.outlier_fraction
        y[outliers] += self.outlier_scale * rng.choice([-1.0, 1.0], size=int(outliers.sum()))
        return X.astype(dtype, copy=False), y.astype(dtype, copy=False)
