"""Robust model-selection metrics: the mean Huber loss and its scikit-learn scorers.

R² (the estimator's ``score``) is a squared-error criterion: on data with
outliers in ``y`` it rewards the fit that chases the outliers, so choosing τ by
held-out R² drifts toward least squares. The mean Huber loss with a fixed,
small evaluation threshold scores every candidate by the same robust yardstick
whatever τ the candidate was fitted with.

The loss is the project's ρ (``docs/design.md``, the numerical contract):
ρ_τ(r) = r²/2 for |r| ≤ τ and τ|r| − τ²/2 beyond, written ψ(r)(r − ψ(r)/2)
with ψ(r) = clip(r, −τ, τ). Mean absolute error, the other robust choice, is
scikit-learn's own ``"neg_mean_absolute_error"`` scorer.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np
from sklearn.metrics import make_scorer

from .exceptions import ValidationError

__all__ = ["huber_loss", "huber_scorer", "neg_huber_loss"]

#: The evaluation threshold of :data:`neg_huber_loss`, the estimator's default τ.
DEFAULT_TAU = 1.345


def _check_tau(tau: Any) -> float:
    if isinstance(tau, bool) or not isinstance(tau, numbers.Real):
        raise ValidationError(f"tau must be a real number > 0, got {tau!r}")
    value = float(tau)
    if not math.isfinite(value) or value <= 0:
        raise ValidationError(f"tau must be finite and > 0, got {tau!r}")
    return value


def _as_vector(values: Any, name: str) -> np.ndarray:
    try:
        arr = np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise ValidationError(f"{name} must be numbers: {exc}") from None
    if arr.ndim == 2 and arr.shape[1] == 1:
        arr = arr[:, 0]
    if arr.ndim != 1:
        raise ValidationError(f"{name} must be 1-D (or a single column), got shape {arr.shape}")
    if not np.all(np.isfinite(arr)):
        raise ValidationError(f"{name} contains NaN or infinity")
    return arr


def huber_loss(
    y_true: Any,
    y_pred: Any,
    *,
    tau: float = DEFAULT_TAU,
    sample_weight: Any | None = None,
) -> float:
    """Mean Huber loss of the residuals ``y_true - y_pred``.

    Parameters
    ----------
    y_true, y_pred : array-like of shape (n_samples,) or (n_samples, 1)
        Observed and predicted targets; finite numbers of equal length.
    tau : float, default 1.345
        The threshold where ρ turns from quadratic to linear; finite and > 0.
        Use one value for every candidate compared (on the scale of ``y``).
    sample_weight : array-like of shape (n_samples,), optional
        Non-negative finite weights with a positive sum; the mean is then
        Σ wᵢ ρ(rᵢ) / Σ wᵢ.

    Returns
    -------
    float
        Σ wᵢ ρ_τ(rᵢ) / Σ wᵢ (all wᵢ = 1 without weights), in float64.

    Raises
    ------
    ValidationError
        For a non-positive or non-finite ``tau``, inputs that are not finite
        numbers, of mismatched lengths or empty, or invalid weights.
    """
    t = _check_tau(tau)
    yt = _as_vector(y_true, "y_true")
    yp = _as_vector(y_pred, "y_pred")
    if yt.shape != yp.shape:
        raise ValidationError(
            f"y_true and y_pred have different lengths: {yt.shape[0]} and {yp.shape[0]}"
        )
    if yt.shape[0] == 0:
        raise ValidationError("huber_loss needs at least one sample, got 0")
    r = yt - yp
    psi = np.clip(r, -t, t)
    rho = psi * (r - 0.5 * psi)
    if sample_weight is None:
        return float(np.mean(rho))
    w = _as_vector(sample_weight, "sample_weight")
    if w.shape != yt.shape:
        raise ValidationError(f"sample_weight has {w.shape[0]} entries for {yt.shape[0]} samples")
    if np.any(w < 0):
        raise ValidationError("sample_weight must be non-negative")
    total = float(np.sum(w))
    if total <= 0:
        raise ValidationError("sample_weight must have a positive sum")
    return float(np.dot(w, rho) / total)


def huber_scorer(tau: float = DEFAULT_TAU) -> Any:
    """A scikit-learn scorer of the negated mean Huber loss at threshold ``tau``.

    Greater is better, as ``GridSearchCV(scoring=...)`` expects. ``tau`` is the
    evaluation threshold, fixed across the candidates (it is not the τ a
    candidate is fitted with).

    Parameters
    ----------
    tau : float, default 1.345
        Finite and > 0.

    Returns
    -------
    callable
        ``scorer(estimator, X, y, sample_weight=None)``, made with
        :func:`sklearn.metrics.make_scorer`.

    Raises
    ------
    ValidationError
        For a non-positive or non-finite ``tau``.
    """
    return make_scorer(huber_loss, greater_is_better=False, tau=_check_tau(tau))


#: The negated mean Huber loss at τ = 1.345, for ``GridSearchCV(scoring=neg_huber_loss)``.
neg_huber_loss = huber_scorer(DEFAULT_TAU)
