"""Robust per-batch residual diagnostics: the share of rows beyond τ and a robust scale.

Both are computed by an engine at a batch's final estimate, from the batch's
residuals r = y − Zβ_b and its frequency weights, and reported in
:class:`~rh_dask.state.BatchDiagnostics`.

The scale is 1.4826 × MAD, the median absolute deviation of the residuals
from their median: it is consistent for the standard deviation of normal
errors, it ignores up to half of the rows being gross outliers (so a
contaminated chunk does not inflate it the way it inflates a standard
deviation), and it does not depend on τ, so τ / scale says how the chosen τ
sits against the noise (τ = 1.345 × scale is the classic 95%-efficiency
choice).
"""

from __future__ import annotations

import numpy as np

__all__ = ["MAD_CONSISTENCY", "outlier_share", "residual_scale", "weighted_median"]

#: 1 / Φ⁻¹(3/4): makes the MAD of normal errors estimate their standard deviation.
MAD_CONSISTENCY = 1.482602218505602


def weighted_median(values: np.ndarray, weights: np.ndarray | None = None) -> float:
    """The median of ``values`` with frequency ``weights``.

    With integer weights it equals :func:`numpy.median` of the values
    repeated by their weights (the two middle values are averaged when the
    cumulative weight reaches exactly half); zero-weight rows take no part.

    Parameters
    ----------
    values : ndarray of shape (n,)
    weights : ndarray of shape (n,) or None
        Non-negative, with a positive sum; None weighs every row 1.

    Returns
    -------
    float
    """
    if weights is None:
        return float(np.median(values))
    keep = weights > 0
    v, w = values[keep], weights[keep]
    order = np.argsort(v)
    return _sorted_weighted_median(v[order], w[order])


def _sorted_weighted_median(v: np.ndarray, w: np.ndarray) -> float:
    """:func:`weighted_median` of ascending ``v`` with positive weights ``w``."""
    cumulative = np.cumsum(w, dtype=np.float64)
    half = 0.5 * cumulative[-1]
    i = int(np.searchsorted(cumulative, half, side="left"))
    if cumulative[i] == half and i + 1 < v.size:
        return 0.5 * (float(v[i]) + float(v[i + 1]))
    return float(v[i])


def outlier_share(residuals: np.ndarray, tau: float, weights: np.ndarray | None = None) -> float:
    """The weighted share of rows with |r| > τ: the rows the Huber loss treats as outliers.

    Parameters
    ----------
    residuals : ndarray of shape (n,)
    tau : float
    weights : ndarray of shape (n,) or None
        Frequency weights with a positive sum; None weighs every row 1.

    Returns
    -------
    float
        In [0, 1].
    """
    beyond = np.abs(residuals) > tau
    if weights is None:
        return int(np.count_nonzero(beyond)) / beyond.size
    total = float(np.sum(weights, dtype=np.float64))
    return float(np.sum(weights[beyond], dtype=np.float64)) / total


def residual_scale(residuals: np.ndarray, weights: np.ndarray | None = None) -> float:
    """1.4826 × the (weighted) median absolute deviation of ``residuals`` from their median.

    Parameters
    ----------
    residuals : ndarray of shape (n,)
    weights : ndarray of shape (n,) or None
        Frequency weights with a positive sum; None weighs every row 1.

    Returns
    -------
    float
        Non-negative; 0 when more than half of the weight sits on one value.
    """
    if weights is None:
        centre = np.median(residuals)
        return MAD_CONSISTENCY * float(np.median(np.abs(residuals - centre)))
    keep = weights > 0
    v, w = residuals[keep], weights[keep]
    order = np.argsort(v)
    v, w = v[order], w[order]
    centre = v.dtype.type(_sorted_weighted_median(v, w))
    # The deviations of sorted values are two sorted runs (below the centre,
    # reversed, and above it): a stable sort (timsort) merges them in O(n).
    split = int(np.searchsorted(v, centre, side="left"))
    deviation = np.concatenate([centre - v[:split][::-1], v[split:] - centre])
    dev_weights = np.concatenate([w[:split][::-1], w[split:]])
    order = np.argsort(deviation, kind="stable")
    return MAD_CONSISTENCY * _sorted_weighted_median(deviation[order], dev_weights[order])
