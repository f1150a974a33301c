"""What the GPU engine computes at a committed batch besides J: K and the robust diagnostics.

Both need the batch's residuals at the committed β, which the solvers keep
only for their own steps. K's update recomputes them inside its row kernel
(:func:`add_score_gram`); the diagnostics take them from :func:`residuals`
(one GEMV) and run in CuPy on the engine's stream, ending with one small
device-to-host copy.

The robust diagnostics are those of :mod:`rh_dask.residuals` and the NumPy
engine, with the same conventions: the weighted share of rows with
|r| > τ, 1.4826 × the weighted median absolute deviation from the weighted
median (rows of zero weight take no part; the two middle values are
averaged when the cumulative weight reaches exactly half), and the mean
Huber loss Σ w ρ(r) / Σ w. The functions take the array module as an
argument, so the CPU tests run them on NumPy arrays against
:mod:`rh_dask.residuals`.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from rh_dask.residuals import MAD_CONSISTENCY

from . import layout
from .commit import allow_row_shared

__all__ = ["add_score_gram", "residuals", "robust_diagnostics"]


def residuals(ws: Any, n: int, p: int, dense: Any) -> tuple[Any, Any]:
    """The design's view (n × p) and r = y − Zβ at the committed β.

    Zβ goes through ``ws.r`` (free once the batch is committed) by the
    engine's own cuBLAS handle (``dense``, a :class:`~.solver.DenseSolver`).
    """
    Z = ws.Z[: n * ws.ldz].reshape(n, ws.ldz)[:, :p]
    dense.matvec(ws.Z, ws.ldz, ws.beta, ws.r, n, p)
    return Z, ws.y[:n] - ws.r[:n]


def add_score_gram(launcher: Any, dense: Any, kernels: Any, ws: Any, n: int) -> None:
    """K += SᵀS with S = |ψ(r)| √w ⊙ Z at the committed β (the sandwich's meat).

    ``rh_score_gram_rows`` writes S into ``ws.M`` (free once the batch is
    committed), then one GEMM on the engine's own cuBLAS handle adds SᵀS
    to K in place; both replayed as one captured graph per row count.
    """
    allow_row_shared(kernels, ws, ("rh_score_gram_rows",))

    def body() -> None:
        launcher.launch(
            ("score_gram_rows", n),
            "rh_score_gram_rows",
            launcher.grid(n),
            layout.ROW_THREADS,
            (ws.Z, ws.ldz, n, ws.p, ws.y, ws.w, ws.beta, ws.ctl, ws.M, ws.ldm),
            ws.p * ws.item,
        )
        dense.gram(ws.M, ws.ldm, ws.K, n, ws.p, accumulate=True)

    launcher.run(("score_gram", n), body)


def _sorted_weighted_median(cp: ModuleType, v: Any, w: Any) -> Any:
    """Weighted median of ascending ``v`` with positive weights ``w`` (a 1-element array)."""
    cumulative = cp.cumsum(w, dtype=cp.float64)
    half = 0.5 * cumulative[-1:]
    i = cp.minimum(cp.searchsorted(cumulative, half, side="left"), v.size - 1)
    nxt = cp.minimum(i + 1, v.size - 1)
    exact = (cumulative[i] == half) & (i + 1 < v.size)
    lo = v[i].astype(cp.float64)
    return cp.where(exact, 0.5 * (lo + v[nxt].astype(cp.float64)), lo)


def _median(cp: ModuleType, v: Any, w: Any | None) -> Any:
    """The (weighted) median of ``v`` as a 1-element float64 device array."""
    if w is None:
        return cp.median(v.astype(cp.float64)).reshape(1)
    order = cp.argsort(v)
    return _sorted_weighted_median(cp, v[order], w[order])


def robust_diagnostics(
    cp: ModuleType, r: Any, w: Any | None, tau: float, total_weight: float
) -> tuple[float, float, float]:
    """Mean Huber loss, weighted share with |r| > τ and 1.4826 × weighted MAD of ``r``.

    ``w``: the batch's weights, or ``None`` for an unweighted batch (every
    row weighs 1). ``total_weight``: the batch's weight sum (or its row count).
    """
    psi = r.clip(-tau, tau)
    rho = psi * (r - 0.5 * psi)
    beyond = abs(r) > tau
    if w is None:
        loss = cp.sum(rho, dtype=cp.float64)
        share = cp.count_nonzero(beyond) / r.size
        rows, weights = r, None
    else:
        loss = cp.sum(w * rho, dtype=cp.float64)
        share = cp.sum(cp.where(beyond, w, 0), dtype=cp.float64) / total_weight
        keep = w > 0
        rows, weights = r[keep], w[keep]
    centre = _median(cp, rows, weights).astype(rows.dtype)
    deviation = abs(rows - centre)
    scale = MAD_CONSISTENCY * _median(cp, deviation, weights)
    parts = (loss / total_weight, cp.asarray(share, cp.float64), scale)
    values = cp.concatenate([cp.asarray(x, cp.float64).reshape(1) for x in parts])
    values = cp.asnumpy(values) if hasattr(cp, "asnumpy") else values  # NumPy in CPU tests
    return float(values[0]), float(values[1]), float(values[2])
