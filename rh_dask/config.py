"""The solver configuration shared by every engine.

A :class:`HuberConfig` is the frozen, validated form of the estimator's
statistical and solver parameters. Engines receive it once, when they are
created; the estimator, the actor and the checkpoints all speak it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Literal

import numpy as np

from .exceptions import ValidationError

Penalty = Literal["none", "l1"]
DTypeName = Literal["float64", "float32"]

PENALTIES: tuple[str, ...] = ("none", "l1")
DTYPES: tuple[str, ...] = ("float64", "float32")


@dataclass(frozen=True)
class HuberConfig:
    """Parameters of the renewable Huber estimator (see the numerical contract).

    Parameters
    ----------
    tau : float
        Huber robustification parameter, > 0.
    penalty : {"none", "l1"}
        ``"l1"`` selects the penalised estimator (RPSHE) and the LAMM solver.
    lambda_scale : float
        Multiplier of the L1 penalty level, >= 0.
    bandwidth_scale : float
        Multiplier of the curvature-smoothing bandwidth, > 0.
    fit_intercept : bool
        Append an intercept column (the last parameter).
    max_iter : int
        Iteration cap per batch, >= 1.
    tol : float
        Relative step tolerance, > 0.
    ridge : float
        Ridge added to the Newton system only (never to the information), >= 0.
    dtype : {"float64", "float32"}
        Precision every engine computes in.
    """

    tau: float = 1.345
    penalty: Penalty = "none"
    lambda_scale: float = 1.0
    bandwidth_scale: float = 1.0
    fit_intercept: bool = True
    max_iter: int = 100
    tol: float = 1e-6
    ridge: float = 1e-8
    dtype: DTypeName = "float64"

    def __post_init__(self) -> None:
        _positive_finite("tau", self.tau)
        _positive_finite("bandwidth_scale", self.bandwidth_scale)
        _positive_finite("tol", self.tol)
        _non_negative_finite("lambda_scale", self.lambda_scale)
        _non_negative_finite("ridge", self.ridge)
        if self.penalty not in PENALTIES:
            raise ValidationError(f"penalty must be one of {PENALTIES}, got {self.penalty!r}")
        if self.dtype not in DTYPES:
            raise ValidationError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if not isinstance(self.fit_intercept, (bool, np.bool_)):
            raise ValidationError(f"fit_intercept must be a bool, got {self.fit_intercept!r}")
        if (
            isinstance(self.max_iter, (bool, np.bool_))
            or not isinstance(self.max_iter, (int, np.integer))
            or self.max_iter < 1
        ):
            raise ValidationError(f"max_iter must be an integer >= 1, got {self.max_iter!r}")
        # Normalise numpy scalars so that equality and JSON round trips are exact.
        object.__setattr__(self, "tau", float(self.tau))
        object.__setattr__(self, "lambda_scale", float(self.lambda_scale))
        object.__setattr__(self, "bandwidth_scale", float(self.bandwidth_scale))
        object.__setattr__(self, "tol", float(self.tol))
        object.__setattr__(self, "ridge", float(self.ridge))
        object.__setattr__(self, "max_iter", int(self.max_iter))
        object.__setattr__(self, "fit_intercept", bool(self.fit_intercept))

    @property
    def np_dtype(self) -> np.dtype:
        """The NumPy dtype engines compute in."""
        return np.dtype(self.dtype)

    @property
    def penalised(self) -> bool:
        return self.penalty == "l1"

    @property
    def keeps_score_variance(self) -> bool:
        """Whether a stream of this configuration accumulates the score variance K.

        K is the sandwich covariance's meat and serves inference only, which
        a penalised fit does not have (:func:`rh_dask.inference.check_penalty`:
        no naive intervals for coefficients the lasso selected). So an L1
        stream leaves K out, a second Gram of every batch saved.
        """
        return not self.penalised

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict (checkpoints, reports)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> HuberConfig:
        """Rebuild a config, refusing unknown keys."""
        known = set(cls.__dataclass_fields__)
        unknown = set(data) - known
        if unknown:
            raise ValidationError(f"unknown configuration keys: {sorted(unknown)}")
        return cls(**data)


def _is_real(value: Any) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(
        value, (bool, np.bool_)
    )


def _positive_finite(name: str, value: Any) -> None:
    if not _is_real(value) or not math.isfinite(value) or value <= 0:
        raise ValidationError(f"{name} must be a finite number > 0, got {value!r}")


def _non_negative_finite(name: str, value: Any) -> None:
    if not _is_real(value) or not math.isfinite(value) or value < 0:
        raise ValidationError(f"{name} must be a finite number >= 0, got {value!r}")
