"""The portable estimator state and the per-batch diagnostics.

These are plain NumPy containers: every engine exports to and imports from
them, checkpoints store them, and they cross process and device boundaries.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

from .exceptions import ValidationError


@dataclass
class HuberState:
    """Everything the renewable estimator retains after a batch: O(p²) numbers.

    Attributes
    ----------
    coefficients : ndarray of shape (p,)
        β, the intercept last when ``fit_intercept``.
    information : ndarray of shape (p, p)
        J, the accumulated (unnormalised) curvature information.
    n_samples_seen : int
        Rows consumed so far, zero-weight rows included.
    batch_count : int
        Batches consumed so far.
    previous_lambda : float
        Penalty level of the last batch (0 without a penalty).
    weight_sum : float
        Accumulated frequency weight W.
    n_features_in : int
        Number of features d (not parameters).
    fit_intercept : bool
        Whether the last parameter is an intercept.
    score_variance : ndarray of shape (p, p) or None
        K, the accumulated (unnormalised) score variance Σ w ψ(r)² z zᵀ, each
        batch's rows at that batch's final β, ordered like ``information``:
        the meat of the sandwich covariance J⁻¹ K J⁻¹. ``None`` when the
        stream's K was not accumulated (a format-1 checkpoint, an engine that
        does not accumulate it); such a state continues with ``None``.
    """

    coefficients: np.ndarray
    information: np.ndarray
    n_samples_seen: int = 0
    batch_count: int = 0
    previous_lambda: float = 0.0
    weight_sum: float = 0.0
    n_features_in: int = 0
    fit_intercept: bool = True
    score_variance: np.ndarray | None = None

    @classmethod
    def empty(
        cls,
        n_features: int,
        fit_intercept: bool,
        dtype: np.dtype | str,
        score_variance: bool = True,
    ) -> HuberState:
        """The state before the first batch: β = 0, J = 0, K = 0 (or None), counters 0.

        ``score_variance=False`` leaves K out (``None``), as a penalised
        stream does (:attr:`HuberConfig.keeps_score_variance`).
        """
        p = n_features + int(fit_intercept)
        return cls(
            coefficients=np.zeros(p, dtype=dtype),
            information=np.zeros((p, p), dtype=dtype),
            score_variance=np.zeros((p, p), dtype=dtype) if score_variance else None,
            n_features_in=int(n_features),
            fit_intercept=bool(fit_intercept),
        )

    @staticmethod
    def shapes(n_features: int, fit_intercept: bool) -> tuple[tuple[int], tuple[int, int]]:
        """Shapes of ``coefficients`` and ``information`` for ``n_features`` features."""
        p = int(n_features) + int(bool(fit_intercept))
        return (p,), (p, p)

    @property
    def n_params(self) -> int:
        return self.n_features_in + int(self.fit_intercept)

    def copy(self) -> HuberState:
        return HuberState(
            coefficients=np.array(self.coefficients, copy=True),
            information=np.array(self.information, copy=True),
            n_samples_seen=self.n_samples_seen,
            batch_count=self.batch_count,
            previous_lambda=self.previous_lambda,
            weight_sum=self.weight_sum,
            n_features_in=self.n_features_in,
            fit_intercept=self.fit_intercept,
            score_variance=None
            if self.score_variance is None
            else np.array(self.score_variance, copy=True),
        )

    def astype(self, dtype: np.dtype | str) -> HuberState:
        """A copy whose arrays are in ``dtype`` (moving a stream between precisions)."""
        out = self.copy()
        out.coefficients = out.coefficients.astype(dtype)
        out.information = out.information.astype(dtype)
        if out.score_variance is not None:
            out.score_variance = out.score_variance.astype(dtype)
        return out

    def for_engine(self, fit_intercept: bool, dtype: np.dtype | str) -> HuberState:
        """This state validated and cast to ``dtype``, for an engine to import.

        Parameters
        ----------
        fit_intercept : bool
            The importing engine's configuration.
        dtype : numpy.dtype or str
            The importing engine's compute dtype.

        Returns
        -------
        HuberState
            A copy in ``dtype``; ``self`` is not modified.

        Raises
        ------
        ValidationError
            When ``fit_intercept`` differs from the state's, or the state is
            malformed (see :meth:`validate`).
        """
        if self.fit_intercept != fit_intercept:
            raise ValidationError(
                f"state has fit_intercept={self.fit_intercept}, engine config has {fit_intercept}"
            )
        self.validate()
        return self.astype(dtype)

    def counters(self) -> dict[str, int | float | bool]:
        """The scalar fields, as JSON-friendly Python values."""
        return {
            "n_samples_seen": int(self.n_samples_seen),
            "batch_count": int(self.batch_count),
            "previous_lambda": float(self.previous_lambda),
            "weight_sum": float(self.weight_sum),
            "n_features_in": int(self.n_features_in),
            "fit_intercept": bool(self.fit_intercept),
        }

    def validate(self, dtype: np.dtype | str | None = None) -> None:
        """Check shapes, finiteness and counters; raise :class:`ValidationError`."""
        p = self.n_params
        beta = np.asarray(self.coefficients)
        info = np.asarray(self.information)
        if self.n_features_in < 1:
            raise ValidationError(f"state has n_features_in={self.n_features_in}, need >= 1")
        coef_shape, info_shape = self.shapes(self.n_features_in, self.fit_intercept)
        if beta.shape != coef_shape:
            raise ValidationError(f"state coefficients have shape {beta.shape}, expected ({p},)")
        if info.shape != info_shape:
            raise ValidationError(f"state information has shape {info.shape}, expected ({p}, {p})")
        arrays = [("coefficients", beta), ("information", info)]
        if self.score_variance is not None:
            meat = np.asarray(self.score_variance)
            if meat.shape != info_shape:
                raise ValidationError(
                    f"state score_variance has shape {meat.shape}, expected ({p}, {p})"
                )
            arrays.append(("score_variance", meat))
        for name, arr in arrays:
            if arr.dtype.kind != "f":
                raise ValidationError(f"state {name} must be floating point, got {arr.dtype}")
        if self.score_variance is not None and meat.dtype != info.dtype:
            raise ValidationError(
                f"state score_variance dtype {meat.dtype} differs from the information's "
                f"{info.dtype}"
            )
        for name, arr in arrays:
            if dtype is not None and arr.dtype != np.dtype(dtype):
                raise ValidationError(f"state {name} dtype {arr.dtype} differs from {dtype}")
            if not np.all(np.isfinite(arr)):
                raise ValidationError(f"state {name} contain non-finite values")
        if self.n_samples_seen < 0 or self.batch_count < 0:
            raise ValidationError("state counters must be non-negative")
        if not (np.isfinite(self.weight_sum) and self.weight_sum >= 0):
            raise ValidationError(
                f"state weight_sum must be finite and >= 0, got {self.weight_sum}"
            )
        if not (np.isfinite(self.previous_lambda) and self.previous_lambda >= 0):
            raise ValidationError(
                f"state previous_lambda must be finite and >= 0, got {self.previous_lambda}"
            )

    def equals(self, other: HuberState) -> bool:
        """Bit-for-bit equality of arrays and counters.

        ``score_variance`` takes part: ``None`` equals only ``None``.
        """
        meat, other_meat = self.score_variance, other.score_variance
        if (meat is None) != (other_meat is None):
            return False
        return (
            self.counters() == other.counters()
            and np.array_equal(self.coefficients, other.coefficients)
            and np.array_equal(self.information, other.information)
            and self.coefficients.dtype == other.coefficients.dtype
            and (
                meat is None
                or (np.array_equal(meat, other_meat) and meat.dtype == other_meat.dtype)
            )
        )


#: The optional fields of :class:`BatchDiagnostics` (None when an engine does not report them).
OPTIONAL_DIAGNOSTICS = ("mean_loss", "outlier_share", "residual_scale")


@dataclass(frozen=True)
class BatchDiagnostics:
    """What one batch's solve reports.

    Attributes
    ----------
    iterations : int
        Newton or LAMM iterations run on the batch.
    converged : bool
        Whether the step criterion was met within ``max_iter``.
    objective : float
        Surrogate objective at the batch's estimate (plus λ‖β‖₁ for L1).
    lambda_value : float
        Penalty level λ_b of the batch (0 without a penalty).
    bandwidth : float
        Smoothing bandwidth h of the batch.
    mean_loss : float or None, default=None
        Mean Huber loss Σ w ρ_τ(r) / Σ w of the batch's rows at its final β
        (not the surrogate ``objective``, which is normalised by all the rows
        seen so far and so falls like 1/N).
    outlier_share : float or None, default=None
        Weighted share of the batch's rows with |r| > τ at its final β.
    residual_scale : float or None, default=None
        1.4826 × the weighted MAD of the batch's residuals at its final β
        (:mod:`rh_dask.residuals`).

    The last three are None when the engine does not compute them.
    """

    iterations: int
    converged: bool
    objective: float
    lambda_value: float
    bandwidth: float
    mean_loss: float | None = None
    outlier_share: float | None = None
    residual_scale: float | None = None

    def to_dict(self) -> dict[str, int | bool | float | None]:
        return {f.name: getattr(self, f.name) for f in fields(self)}
