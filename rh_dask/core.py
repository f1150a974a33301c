"""Scalar rules of the numerical contract, shared by every engine.

Nothing here solves a batch: these are the per-batch schedule (cumulative
weight, bandwidth, penalty level, history term), the numerical policy of
the Newton solve ladder, and the linear predictor Xβ + b. Keeping them in
one place is what lets the NumPy reference and the GPU engine agree to the
last bit on every decision that does not depend on the data.

Two implementation rules refine the contract without changing it (see
``docs/design.md``):

* Line-search and LAMM acceptance tests compare objective *differences*, not
  objective values. With e = c − β and the exact identity

      F(c) − F(β) − gᵀe = [Σ_i w_i R_i + ½ eᵀ J_{b-1} e] / N,
      R_i = ρ(r_i + δ_i) − ρ(r_i) − ψ(r_i) δ_i,   δ = −Z e,

  the tests "F(β − tD) > F(β)" and "F(c) ≤ F(β) + gᵀe + φ/2‖e‖² + 1e-12"
  are decided from quantities of the size of the step, not of F. Comparing
  two rounded values of F would let rounding noise (eps·F) decide whether a
  step of size 1e-8 is accepted; the difference form is accurate to eps
  relative to the step itself, so every engine makes the same decisions.
  With o = r − ψ(r), u = clip(o + δ, −τ − ψ, τ − ψ) and δ' = o + δ, the
  remainder is R = u (δ' − u/2) exactly (the integral of ψ(s) − ψ(r)).
* The solve ladder calls a system singular when a Cholesky pivot loses all
  but ``singular_rtol`` of its diagonal (L_ii² ≤ rtol · H_ii: column i is
  numerically a combination of the earlier ones). The test is invariant to
  feature scaling.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from .config import HuberConfig
from .state import HuberState

#: Line-search halving stops below this step (contract).
MIN_STEP = 1e-8
#: LAMM doubles φ at most this many times per iteration (contract).
LAMM_MAX_TRIALS = 40
#: Floor of φ after an accepted LAMM step (contract).
LAMM_MIN_PHI = 1e-8
#: Slack added to the LAMM majorisation test (contract).
LAMM_SLACK = 1e-12


def singular_rtol(dtype: np.dtype | str, n_params: int) -> float:
    """Relative pivot (and singular value) below which a system is singular."""
    return float(max(n_params, 10) * np.finfo(np.dtype(dtype)).eps)


@dataclass(frozen=True)
class BatchSchedule:
    """Data-independent quantities of one batch.

    Attributes
    ----------
    total_weight : float
        N = W_{b-1} + Σ w_b, the cumulative weight including this batch.
    bandwidth : float
        h = min(bandwidth_scale / (√N · ln max(d, 2)), τ).
    lambda_value : float
        λ_b (0 without a penalty).
    history_scale : float
        (W_{b-1}/N) · λ_{b-1} when the L1 history term is active, else 0.
    """

    total_weight: float
    bandwidth: float
    lambda_value: float
    history_scale: float


def batch_schedule(config: HuberConfig, state: HuberState, batch_weight: float) -> BatchSchedule:
    """Compute the batch schedule in float64 (engines round it to their dtype)."""
    if not (batch_weight > 0 and math.isfinite(batch_weight)):
        raise ValueError(f"batch weight must be finite and > 0, got {batch_weight}")
    total = float(state.weight_sum) + float(batch_weight)
    log_d = math.log(max(state.n_features_in, 2))
    bandwidth = min(config.bandwidth_scale / (math.sqrt(total) * log_d), config.tau)
    lam = 0.0
    history = 0.0
    if config.penalised:
        lam = config.lambda_scale * config.tau * math.sqrt(log_d / total)
        if state.n_samples_seen > 0:
            history = (float(state.weight_sum) / total) * float(state.previous_lambda)
    return BatchSchedule(total, bandwidth, lam, history)


def sum_weights(sample_weight: np.ndarray) -> float:
    """Σ w of one batch, correctly rounded to float64.

    A batch's weight enters ``weight_sum``, a counter that must be equal on
    every engine, so it is defined independently of summation order: the
    float64 nearest to the exact sum (ties to even), as :func:`math.fsum`
    gives. The GPU engine's double-double reduction returns the same value
    (but for a sum within about 2⁻¹⁰⁰ of a rounding tie).

    Parameters
    ----------
    sample_weight : numpy.ndarray, shape (n,)
        Finite, non-negative float32 or float64 weights.

    Returns
    -------
    float
        The correctly rounded sum (``inf`` when it overflows).

    Raises
    ------
    ValueError
        If a weight is negative or not finite.

    Notes
    -----
    When every weight is a multiple of a unit q and n · max(w) < 2⁵³ q, every
    partial sum is exact and ``np.sum`` is used: q is the smallest positive
    weight's unit in the last place (float32 weights of a moderate range, for
    instance) or 1 (whole-number weights). Otherwise the sum is taken exactly
    by error-free extraction (:func:`_exact_sum`; two passes of four array
    operations for weights of one binade or a few; 2.7 ms for 262,144 float64
    weights on the dev box, against 0.1 ms for ``np.sum`` and 90 ms for the
    engine's batch of 32 features).
    """
    w = np.asarray(sample_weight).ravel()
    if w.dtype != np.float32:
        w = w.astype(np.float64, copy=False)
    if w.size == 0:
        return 0.0
    # NaN reaches both extremes, so the two bounds also refuse it.
    largest = float(np.max(w))
    if not (float(np.min(w)) >= 0 and math.isfinite(largest)):
        raise ValueError("weights must be finite and non-negative")
    info = np.finfo(w.dtype)
    smallest = float(np.min(w, where=w > 0, initial=np.inf))
    if not math.isfinite(smallest):
        return 0.0
    quantum = math.ldexp(1.0, max(math.frexp(smallest)[1] - 1, info.minexp) - info.nmant)
    if largest / quantum * w.size < 2.0**53:
        return float(np.sum(w, dtype=np.float64))
    if largest * w.size < 2.0**53 and bool(np.all(np.trunc(w) == w)):
        return float(np.sum(w, dtype=np.float64))  # whole numbers: exact sums too
    return _exact_sum(w)


def _exact_sum(w: np.ndarray) -> float:
    """Correctly rounded Σ w of finite floats, by error-free extraction.

    With max|r| < 2ᵉ, 2ᵍ > len(r) and σ = 2^(e + g + 1), q = (σ + r) − σ and
    r − q are exact, the q are multiples of 2⁻⁵³ σ whose every partial sum
    stays below σ, so ``np.sum(q)`` is exact in any order, and the new
    residuals are at least 2^(51 − g) times smaller (Rump, Ogita and Oishi's
    extraction). Repeated until no residual is left, Σ w is a short list of
    exact doubles, which :func:`math.fsum` rounds once.
    """
    r = w.astype(np.float64, copy=True)
    q = np.empty_like(r)
    growth = (r.size + 1).bit_length()
    terms = []
    while True:
        largest = float(np.max(np.abs(r)))
        if largest == 0:
            break
        exponent = math.frexp(largest)[1] + growth + 1
        if exponent > 1023:  # σ would overflow: weights near the float64 limit
            try:
                return math.fsum(w.astype(np.float64).tolist())
            except OverflowError:
                return math.inf
        sigma = math.ldexp(1.0, exponent)
        np.add(r, sigma, out=q)
        q -= sigma
        terms.append(float(np.sum(q)))
        r -= q
    return math.fsum(terms)


def penalty_mask(n_features: int, fit_intercept: bool, dtype: np.dtype | str) -> np.ndarray:
    """m: 1 for every feature coefficient, 0 for the intercept."""
    mask = np.ones(n_features + int(fit_intercept), dtype=dtype)
    if fit_intercept:
        mask[-1] = 0
    return mask


def soft_threshold(x: np.ndarray, threshold: np.ndarray) -> np.ndarray:
    """S(x, t) = sign(x) · max(|x| − t, 0), elementwise."""
    return np.sign(x) * np.maximum(np.abs(x) - threshold, 0)


def linear_predictor(X: Any, beta: Any, fit_intercept: bool) -> Any:
    """Xβ, plus the intercept (β's last entry) when ``fit_intercept``.

    Parameters
    ----------
    X : array of shape (n, d)
        Validated input, in the array library of ``beta`` (NumPy, or CuPy
        for a device array).
    beta : array of shape (d + fit_intercept,)
        The coefficients, the intercept last.
    fit_intercept : bool
        Whether ``beta`` ends with an intercept.

    Returns
    -------
    array of shape (n,)
        In the library and dtype of ``X @ beta``.
    """
    d = X.shape[1]
    out = X @ beta[:d]
    if fit_intercept:
        out += beta[d]
    return out


def step_converged(step_norm: float, new_norm: float, tol: float) -> bool:
    """‖β_new − β_old‖ ≤ tol · (1 + ‖β_new‖)."""
    return bool(step_norm <= tol * (1.0 + new_norm))
