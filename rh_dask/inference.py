"""Inference from a renewable Huber state: the sandwich covariance and what follows from it.

The state holds the information J_b (the bread: Σ w κ(r) z zᵀ) and the score
variance K_b (the meat: Σ w ψ(r)² z zᵀ), both accumulated batch by batch at
each batch's final estimate, unnormalised. The covariance of β̂_b is
approximated by the sandwich

    Cov(β̂_b) ≈ J_b⁻¹ K_b J_b⁻¹

on the scale of the coefficients (no division by N: J and K are sums, so the
1/N of the textbook form cancels), the intercept last as in the state.
Intervals and p-values use the normal approximation. Everything here is
computed in float64 from the state's arrays, whatever their dtype.

No valid naive intervals exist for coefficients an L1 penalty selected, so
every function that takes a penalty refuses ``"l1"`` with
:class:`~rh_dask.exceptions.InferenceError`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
from scipy import special

from .exceptions import InferenceError, ValidationError
from .state import HuberState

__all__ = [
    "COVARIANCE_LABEL",
    "INTERCEPT_NAME",
    "Summary",
    "check_penalty",
    "confidence_intervals",
    "covariance",
    "interval_columns",
    "normal_quantile",
    "p_values",
    "parameter_names",
    "sandwich",
    "standard_errors",
    "summarize",
    "z_values",
]

#: How the covariance of a summary is described in its header.
COVARIANCE_LABEL = "sandwich J⁻¹ K J⁻¹ (renewable, per-batch estimates)"

#: Row name of the intercept in a summary table.
INTERCEPT_NAME = "intercept"


def check_penalty(penalty: str) -> None:
    """Refuse inference for a penalised fit.

    Parameters
    ----------
    penalty : str
        The fit's ``penalty`` (``"none"`` or ``"l1"``).

    Raises
    ------
    InferenceError
        For ``"l1"``: the lasso chooses which coefficients are non-zero from
        the same data, and a sandwich interval ignores that selection, so its
        coverage is not the nominal one (and a coefficient shrunk to zero has
        no meaningful standard error).
    """
    if penalty == "l1":
        raise InferenceError(
            'no covariance for penalty="l1": the lasso selects the coefficients from the '
            "same data, and the sandwich ignores that selection, so its intervals would "
            'not have their nominal coverage; fit with penalty="none" for inference'
        )


def _missing_meat_message(engine: str | None) -> str:
    if engine == "gpu":
        why = (
            "it was fitted by the GPU engine with rh-dask.gpu.score-variance off, so it "
            "carries no score variance K (the sandwich's meat)"
        )
    else:
        why = (
            "its state carries no score variance K (the sandwich's meat): it comes from, "
            "or continues, a checkpoint older than format version 2 or a GPU engine run "
            "with rh-dask.gpu.score-variance off, and K cannot be rebuilt without the rows "
            "already consumed"
        )
    return (
        f"no covariance for this model: {why}; a fresh fit (either engine, the "
        "setting on) gives it"
    )


def sandwich(state: HuberState, *, engine: str | None = None) -> np.ndarray:
    """The sandwich covariance J⁻¹ K J⁻¹ of a state's coefficients.

    Parameters
    ----------
    state : HuberState
        A state with at least one batch and its score variance K.
    engine : str, optional
        The engine that produced ``state`` (``"numpy"``, ``"gpu"``), only to
        say why K is missing when it is.

    Returns
    -------
    ndarray of shape (p, p), float64
        Symmetric; the intercept last when ``state.fit_intercept``.

    Raises
    ------
    InferenceError
        When ``state.score_variance`` is ``None`` (K was not accumulated:
        the message says where such a state comes from) or J is singular
        (no batch yet, collinear features, all weights zero).
    ValidationError
        When K's shape differs from J's.
    """
    meat = state.score_variance
    if meat is None:
        raise InferenceError(_missing_meat_message(engine))
    bread = np.asarray(state.information)
    meat = np.asarray(meat)
    if meat.shape != bread.shape:
        raise ValidationError(
            f"state score_variance has shape {meat.shape}, information {bread.shape}"
        )
    inverse = _inverse_information(bread)
    cov = inverse @ meat.astype(np.float64) @ inverse
    return (cov + cov.T) / 2.0


def _inverse_information(bread: np.ndarray) -> np.ndarray:
    """J⁻¹ in float64 from the symmetric J, refusing a J singular at its dtype's precision."""
    dtype = bread.dtype if bread.dtype.kind == "f" else np.dtype(np.float64)
    j = bread.astype(np.float64)
    j = (j + j.T) / 2.0
    values, vectors = np.linalg.eigh(j)
    largest = float(values[-1]) if values.size else 0.0
    threshold = 10 * max(j.shape[0], 1) * float(np.finfo(dtype).eps) * largest
    if not (largest > 0.0) or float(values[0]) <= threshold:
        raise InferenceError(
            "no covariance: the information matrix J is singular "
            f"(eigenvalues from {float(values[0]):.3g} to {largest:.3g}); collinear or "
            "constant features, or too few rows with a positive weight inside ±tau"
        )
    return (vectors / values) @ vectors.T


def covariance(state: HuberState, penalty: str, *, engine: str | None = None) -> np.ndarray:
    """The covariance of a fit: :func:`check_penalty`, then :func:`sandwich`."""
    check_penalty(penalty)
    return sandwich(state, engine=engine)


def standard_errors(cov: np.ndarray) -> np.ndarray:
    """√diag(cov): the standard error of each coefficient."""
    return np.sqrt(np.clip(np.diag(np.asarray(cov, dtype=np.float64)), 0.0, None))


def _check_alpha(alpha: float) -> float:
    try:
        value = float(alpha)
    except (TypeError, ValueError):
        raise ValidationError(f"alpha must be a number in (0, 1), got {alpha!r}") from None
    if not (0.0 < value < 1.0):
        raise ValidationError(f"alpha must be in (0, 1), got {alpha!r}")
    return value


def normal_quantile(alpha: float = 0.05) -> float:
    """The two-sided normal critical value z_{1−α/2} (1.959964 for α = 0.05).

    Raises
    ------
    ValidationError
        When ``alpha`` is not a number in (0, 1).
    """
    return float(special.ndtri(1.0 - _check_alpha(alpha) / 2.0))


def confidence_intervals(
    coefficients: np.ndarray, bse: np.ndarray, alpha: float = 0.05
) -> np.ndarray:
    """Normal (1 − α) intervals β ± z_{1−α/2}·se, shape (p, 2): lower, upper."""
    z = normal_quantile(alpha)
    beta = np.asarray(coefficients, dtype=np.float64)
    se = np.asarray(bse, dtype=np.float64)
    return np.column_stack([beta - z * se, beta + z * se])


def z_values(coefficients: np.ndarray, bse: np.ndarray) -> np.ndarray:
    """β / se (infinite where se is 0 and β is not, NaN where both are)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.asarray(coefficients, dtype=np.float64) / np.asarray(bse, dtype=np.float64)


def p_values(z: np.ndarray) -> np.ndarray:
    """Two-sided normal p-values 2·Φ(−|z|), accurate far in the tail."""
    return 2.0 * special.ndtr(-np.abs(np.asarray(z, dtype=np.float64)))


def interval_columns(alpha: float = 0.05) -> tuple[str, str]:
    """The interval bounds' column names, statsmodels' style: ``"[0.025"``, ``"0.975]"``."""
    a = _check_alpha(alpha)
    return f"[{a / 2:g}", f"{1 - a / 2:g}]"


def parameter_names(
    n_features: int, fit_intercept: bool, feature_names: Sequence[Any] | None = None
) -> list[str]:
    """Parameter names: the feature names (else ``x0``, ``x1``, ...), then ``"intercept"``."""
    if feature_names is None:
        names = [f"x{j}" for j in range(n_features)]
    else:
        names = [str(n) for n in feature_names]
        if len(names) != n_features:
            raise ValidationError(f"{len(names)} feature names for {n_features} features")
    return names + ([INTERCEPT_NAME] if fit_intercept else [])


@dataclass(frozen=True)
class Summary:
    """A coefficient table with the sandwich standard errors, and the fit it belongs to.

    Attributes
    ----------
    table : pandas.DataFrame
        One row per parameter (feature names, then ``"intercept"``), columns
        ``coef``, ``std err``, ``z``, ``P>|z|`` and the interval bounds (named
        by :func:`interval_columns`, ``"[0.025"`` and ``"0.975]"`` for α = 0.05).
    cov : ndarray of shape (p, p)
        The covariance the table comes from (float64, the intercept last).
    alpha : float
        1 − the intervals' confidence level.
    n_samples_seen, batch_count : int
        Rows and batches of the stream.
    tau : float
        The Huber τ of the fit.
    penalty : str
        The fit's penalty.
    dtype : str
        The fit's compute dtype.
    engine : str or None
        The engine that fitted it, when known.
    covariance_type : str
        How the covariance was estimated (:data:`COVARIANCE_LABEL`).
    """

    table: pd.DataFrame
    cov: np.ndarray
    alpha: float
    n_samples_seen: int
    batch_count: int
    tau: float
    penalty: str
    dtype: str
    engine: str | None = None
    covariance_type: str = COVARIANCE_LABEL

    def header(self) -> list[tuple[str, str]]:
        """The header's (label, value) pairs, in the order the text shows them."""
        pairs = [
            ("rows seen", f"{self.n_samples_seen:,}"),
            ("batches", f"{self.batch_count:,}"),
            ("tau", f"{self.tau:g}"),
            ("penalty", self.penalty),
            ("dtype", self.dtype),
        ]
        if self.engine is not None:
            pairs.append(("engine", self.engine))
        pairs += [
            ("confidence", f"{100 * (1 - self.alpha):g}% (normal)"),
            ("covariance", self.covariance_type),
        ]
        return pairs

    def as_text(self) -> str:
        """A readable fixed-width table under a header, in the manner of statsmodels."""
        body = _format_table(self.table)
        width = max(len(line) for line in body)
        labels = self.header()
        label_width = max(len(k) for k, _ in labels)
        head = [f"{k + ':':<{label_width + 1}} {v}" for k, v in labels]
        width = max(width, *(len(line) for line in head))
        title = "Renewable Huber regression"
        rule, thin = "=" * width, "-" * width
        return "\n".join([title, rule, *head, rule, body[0], thin, *body[1:], rule])

    def __str__(self) -> str:
        return self.as_text()

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly: the header fields and one mapping per table row."""
        rows = [
            {"name": name, **{col: _json_number(v) for col, v in row.items()}}
            for name, row in self.table.iterrows()
        ]
        return {
            "n_samples_seen": int(self.n_samples_seen),
            "batch_count": int(self.batch_count),
            "tau": float(self.tau),
            "penalty": self.penalty,
            "dtype": self.dtype,
            "engine": self.engine,
            "alpha": float(self.alpha),
            "covariance_type": self.covariance_type,
            "parameters": rows,
        }


def _json_number(value: Any) -> float | None:
    value = float(value)
    return value if math.isfinite(value) else None


def _format_column(values: np.ndarray, kind: str) -> list[str]:
    """Text of one numeric column: fixed 4 decimals unless the magnitudes call for exponents."""
    if kind == "p":
        return [f"{v:.3f}" if math.isfinite(v) else "nan" for v in values]
    finite = np.abs(values[np.isfinite(values)])
    nonzero = finite[finite > 0]
    fixed = nonzero.size == 0 or (nonzero.min() >= 1e-3 and nonzero.max() < 1e6)
    if kind == "z":
        fixed = finite.size == 0 or finite.max() < 1e6
        return [f"{v:.2f}" if fixed else f"{v:.3e}" for v in values]
    return [f"{v:.4f}" if fixed else f"{v:.4e}" for v in values]


def _format_table(table: pd.DataFrame) -> list[str]:
    kinds = {"z": "z", "P>|z|": "p"}
    names = [str(n) for n in table.index]
    columns = [
        (str(col), _format_column(table[col].to_numpy(dtype=np.float64), kinds.get(col, "")))
        for col in table.columns
    ]
    name_width = max(len(n) for n in names)
    widths = [max(len(col), *(len(c) for c in cells)) for col, cells in columns]
    lines = [
        " " * name_width
        + "".join(f"  {col:>{w}}" for (col, _), w in zip(columns, widths, strict=True))
    ]
    for i, name in enumerate(names):
        lines.append(
            f"{name:<{name_width}}"
            + "".join(f"  {cells[i]:>{w}}" for (_, cells), w in zip(columns, widths, strict=True))
        )
    return lines


def summarize(
    state: HuberState,
    *,
    tau: float,
    penalty: str,
    dtype: str,
    feature_names: Sequence[Any] | None = None,
    engine: str | None = None,
    alpha: float = 0.05,
) -> Summary:
    """The :class:`Summary` of a state: coefficients, sandwich standard errors, z, p, intervals.

    Parameters
    ----------
    state : HuberState
        The fitted state (with K).
    tau, penalty, dtype : float, str, str
        The fit's configuration, for the header (``penalty="l1"`` is refused).
    feature_names : sequence of str, optional
        Names of the features; ``x0``, ``x1``, ... without.
    engine : str, optional
        The engine that fitted the state (for the header and the error message).
    alpha : float, default=0.05
        Intervals at confidence 1 − α.

    Raises
    ------
    InferenceError
        ``penalty="l1"``, K missing, or J singular (see :func:`sandwich`).
    ValidationError
        ``alpha`` not in (0, 1), or as many names as features.
    """
    alpha = _check_alpha(alpha)
    index = parameter_names(state.n_features_in, state.fit_intercept, feature_names)
    cov = covariance(state, penalty, engine=engine)
    beta = np.asarray(state.coefficients, dtype=np.float64)
    bse = standard_errors(cov)
    z = z_values(beta, bse)
    lower, upper = confidence_intervals(beta, bse, alpha).T
    low_name, high_name = interval_columns(alpha)
    table = pd.DataFrame(
        {
            "coef": beta,
            "std err": bse,
            "z": z,
            "P>|z|": p_values(z),
            low_name: lower,
            high_name: upper,
        },
        index=pd.Index(index, name="parameter"),
    )
    return Summary(
        table=table,
        cov=cov,
        alpha=alpha,
        n_samples_seen=int(state.n_samples_seen),
        batch_count=int(state.batch_count),
        tau=float(tau),
        penalty=str(penalty),
        dtype=str(dtype),
        engine=engine,
    )
