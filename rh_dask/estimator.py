"""``RenewableHuberRegressor``: the scikit-learn face of rh-dask.

The estimator is thin on purpose: it turns parameters into a
:class:`~rh_dask.config.HuberConfig`, validates each batch, hands it to one
engine (see :mod:`rh_dask.engines`) and mirrors the engine's state into the
scikit-learn attributes. Dask collections are routed to the distributed
coordinator in :mod:`rh_dask.distributed`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import numpy as np
import pandas as pd
from sklearn.base import BaseEstimator, RegressorMixin

from .checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from .config import HuberConfig
from .engines import Engine, make_engine, resolve_engine_name
from .exceptions import NotFittedError, ValidationError
from .state import BatchDiagnostics, HuberState
from .validation import (
    Batch,
    is_device_array,
    ravel_column_vector,
    validate_batch,
    validate_features,
)

__all__ = ["HISTORY_COLUMNS", "RenewableHuberRegressor"]

#: Columns of ``RenewableHuberRegressor.history_``.
HISTORY_COLUMNS = (
    "batch",
    "chunk",
    "rows",
    "iterations",
    "converged",
    "objective",
    "seconds",
    "wait_seconds",
)
_HISTORY_DTYPES = ("int64", "int64", "int64", "int64", "bool", "float64", "float64", "float64")


def _is_dask_collection(obj: Any) -> bool:
    try:
        from dask.base import is_dask_collection
    except ImportError:  # pragma: no cover - dask is a hard dependency
        return False
    return is_dask_collection(obj)


def _nothing() -> None:
    """The undo of a step that changed nothing."""


def _float64_copy(beta: Any) -> np.ndarray:
    """A float64 host copy of β: exact for float32 engines, and never a view of engine memory."""
    return np.array(beta, dtype=np.float64, copy=True)


class RenewableHuberRegressor(RegressorMixin, BaseEstimator):
    """Renewable Huber regression: a robust linear model fitted batch by batch.

    Each call to :meth:`partial_fit` consumes one batch and retains only the
    coefficients and a p×p information matrix, so the stream may be far larger
    than memory. The method and its solver rules are those of the project's
    numerical contract (Jiang, Liang & Yu, EJS 2024): Newton with monotone
    backtracking for the unpenalised estimator, LAMM for the L1-penalised one.

    Parameters
    ----------
    tau : float, default=1.345
        Huber robustification parameter (residual scale at which the loss
        turns linear). Not estimated: standardise ``y`` or choose ``tau``.
    penalty : {"none", "l1"}, default="none"
        ``"l1"`` fits the penalised estimator with λ_b = lambda_scale · τ ·
        √(ln max(d, 2) / N).
    lambda_scale : float, default=1.0
        Multiplier of the L1 penalty level.
    bandwidth_scale : float, default=1.0
        Multiplier of the curvature-smoothing bandwidth.
    fit_intercept : bool, default=True
        Fit an intercept (kept as the last parameter of the state).
    max_iter : int, default=100
        Newton/LAMM iteration cap per batch.
    tol : float, default=1e-6
        Relative step tolerance of the per-batch solve.
    ridge : float, default=1e-8
        Ridge added to the Newton system only.
    engine : {"auto", "numpy", "gpu"}, default="auto"
        Computational engine. An explicit choice that cannot start raises
        :class:`~rh_dask.exceptions.EngineUnavailableError`; ``"auto"``
        currently picks the NumPy engine unless ``device`` names a GPU.
    device : str or int, default=None
        Device of the engine, e.g. ``"cuda:0"``.
    dtype : {"float64", "float32"}, default="float64"
        Precision of the whole computation.
    lookahead : int, default=8
        Dask streams only: how many chunks load ahead of the engine, in
        parallel, while it fits the current one. Look-ahead host memory is
        bounded by this many chunks. See ``docs/distributed.md`` for how the
        default was measured.
    loader : {"auto", "actor", "engine-worker", "cluster"}, default="auto"
        Dask streams only: where chunks load. ``"actor"`` sends the chunk
        graphs to the worker holding the engine once, and that worker computes
        them on its own threads, with no scheduler task per chunk (it needs a
        collection that worker can compute alone: not one referencing data
        persisted on the cluster). ``"engine-worker"`` runs one Dask task per
        chunk on that worker; ``"cluster"`` computes chunks on any worker and
        moves each finished chunk to the engine's worker. ``"auto"`` picks
        ``"actor"`` when possible, else ``"engine-worker"`` unless that worker
        has a single thread and other workers exist.
    worker : str, default=None
        Dask streams only: address of the worker that hosts the engine actor.
        ``None`` picks one: a worker advertising ``resources={"GPU": 1}`` for
        the GPU engine, any worker for the NumPy engine.
    progress : bool, default=None
        Dask streams only: show a progress bar (chunks/s, rows/s) while
        fitting. ``None`` shows it when stderr is a terminal.

    Attributes
    ----------
    coef_ : ndarray of shape (n_features,)
        Feature coefficients.
    intercept_ : float
        Intercept (0.0 when ``fit_intercept=False``).
    n_features_in_ : int
        Number of features seen during fit.
    feature_names_in_ : ndarray of shape (n_features,)
        Feature names, when the stream came as a DataFrame with string columns.
    n_iter_ : int
        Iterations used by the last batch.
    n_samples_seen_ : int
        Rows consumed since the last reset (zero-weight rows count).
    state_ : HuberState
        A host copy of the portable state.
    diagnostics_ : BatchDiagnostics
        Diagnostics of the last batch.
    engine_ : str
        The engine actually in use (``"numpy"`` or ``"gpu"``).
    history_ : pandas.DataFrame
        One row per consumed batch since the last reset, with columns
        ``batch`` (position in the stream), ``chunk`` (index of the chunk in
        the collection given to that call; 0 for an in-memory batch), ``rows``,
        ``iterations``, ``converged``, ``objective``, ``seconds`` (engine
        time of the batch) and ``wait_seconds`` (how long the engine sat idle
        waiting for this chunk to load; 0 for an in-memory batch). A large
        total ``wait_seconds`` means the fit is bound by loading, not by the
        engine.
    coef_history_ : ndarray of shape (n_batches, n_params)
        β after each consumed batch since the last reset, in float64: row
        ``b`` belongs to row ``b`` of ``history_`` and holds the coefficients
        followed by the intercept when ``fit_intercept`` (so ``n_params`` is
        ``n_features_in_ + fit_intercept``, and the last row equals ``coef_``
        and ``intercept_``). Recorded by the engine after each batch, in the
        actor for Dask streams. Not part of checkpoints: a model from
        :meth:`load` starts with an empty history (zero rows).
    n_empty_chunks_ : int
        Zero-row chunks of Dask streams skipped since the last reset.
    placement_ : dict or None
        Where the engine ran for the last call that consumed a batch, when
        that call walked a Dask collection on a ``distributed`` cluster: the
        keys ``worker`` (address), ``loader`` (``"actor"``,
        ``"engine-worker"`` or ``"cluster"``: ``"auto"`` resolved), ``engine``,
        ``lookahead`` and ``engine_reused`` (whether the worker still held an
        idle engine from an earlier fit, see
        :func:`rh_dask.distributed.release_engines`).
        ``None`` after an in-memory batch or a walk without a client.

    Examples
    --------
    >>> import numpy as np
    >>> from rh_dask import RenewableHuberRegressor
    >>> rng = np.random.default_rng(0)
    >>> X = rng.normal(size=(1000, 3))
    >>> y = X @ [1.0, -2.0, 0.5] + rng.standard_t(2, size=1000)
    >>> model = RenewableHuberRegressor()
    >>> for rows in np.array_split(np.arange(1000), 4):
    ...     model = model.partial_fit(X[rows], y[rows])
    >>> model.coef_.round(1)
    array([ 1. , -2. ,  0.5])
    """

    def __init__(
        self,
        *,
        tau: float = 1.345,
        penalty: str = "none",
        lambda_scale: float = 1.0,
        bandwidth_scale: float = 1.0,
        fit_intercept: bool = True,
        max_iter: int = 100,
        tol: float = 1e-6,
        ridge: float = 1e-8,
        engine: str = "auto",
        device: str | int | None = None,
        dtype: str = "float64",
        lookahead: int = 8,
        loader: str = "auto",
        worker: str | None = None,
        progress: bool | None = None,
    ) -> None:
        self.tau = tau
        self.penalty = penalty
        self.lambda_scale = lambda_scale
        self.bandwidth_scale = bandwidth_scale
        self.fit_intercept = fit_intercept
        self.max_iter = max_iter
        self.tol = tol
        self.ridge = ridge
        self.engine = engine
        self.device = device
        self.dtype = dtype
        self.lookahead = lookahead
        self.loader = loader
        self.worker = worker
        self.progress = progress

    # -- configuration ---------------------------------------------------------
    def _make_config(self) -> HuberConfig:
        return HuberConfig(
            tau=self.tau,
            penalty=self.penalty,
            lambda_scale=self.lambda_scale,
            bandwidth_scale=self.bandwidth_scale,
            fit_intercept=self.fit_intercept,
            max_iter=self.max_iter,
            tol=self.tol,
            ridge=self.ridge,
            dtype=self.dtype,
        )

    def _stream_engine(self) -> Engine | None:
        """The engine holding the stream, materialised from a pending state if needed."""
        engine = getattr(self, "_engine", None)
        pending = getattr(self, "_pending_state", None)
        if engine is None and pending is not None:
            engine = make_engine(self.engine_, self._config, self.device)
            engine.import_state(pending)
            self._engine = engine
            self._pending_state = None
        return engine

    # -- fitting -------------------------------------------------------------------
    def reset(self) -> RenewableHuberRegressor:
        """Forget the stream (keeps the engine and its workspaces for reuse)."""
        engine = getattr(self, "_engine", None)
        if engine is not None:
            engine.reset()
        self._forget_stream()
        return self

    def _forget_stream(self) -> None:
        """Drop every attribute of the stream; the engine is left as it is."""
        self._pending_state = None
        for name in (
            "n_features_in_",
            "feature_names_in_",
            "n_iter_",
            "diagnostics_",
            "engine_",
            "_config",
            "_history",
            "_coef_history",
            "_n_empty_chunks",
            "_placement",
        ):
            self.__dict__.pop(name, None)

    def fit(self, X: Any, y: Any, sample_weight: Any | None = None) -> RenewableHuberRegressor:
        """Start a new stream with ``X`` (the current one is forgotten once it has begun).

        In-memory ``X`` is one batch. A Dask array or DataFrame is walked chunk
        by chunk in order (each row chunk or partition one batch), see
        :mod:`rh_dask.distributed`. The current stream is forgotten only once
        the new one has consumed its first batch: a ``fit`` refused before
        that (bad parameters or data, an engine that cannot start, a first
        chunk that fails) leaves the model exactly as it was.

        Parameters
        ----------
        X : array-like of shape (n_samples, n_features), or a Dask collection
        y : array-like of shape (n_samples,), or a Dask collection
            A column vector of shape (n_samples, 1) is raveled with a
            :class:`~sklearn.exceptions.DataConversionWarning`.
        sample_weight : array-like of shape (n_samples,), default=None
            Frequency weights.

        Returns
        -------
        self
        """
        if any(_is_dask_collection(a) for a in (X, y, sample_weight)):
            from .distributed import stream_fit

            return stream_fit(self, X, y, sample_weight, fresh=True)
        config = self._make_config()
        name = resolve_engine_name(self.engine, self.device)
        batch = validate_batch(
            X,
            y,
            sample_weight,
            dtype=config.dtype,
            accept_device=name == "gpu",
            owner=type(self).__name__,
        )
        self._consume(batch, config, name, fresh=True)
        return self

    def partial_fit(
        self, X: Any, y: Any, sample_weight: Any | None = None
    ) -> RenewableHuberRegressor:
        """Consume one batch (or, for Dask collections, each of its chunks in order).

        A batch that fails validation raises
        :class:`~rh_dask.exceptions.ValidationError` and leaves the model
        exactly as it was.
        """
        if any(_is_dask_collection(a) for a in (X, y, sample_weight)):
            from .distributed import stream_fit

            return stream_fit(self, X, y, sample_weight)
        config = self._make_config()
        self._check_stream_config(config)
        name = resolve_engine_name(self.engine, self.device)
        fitted = hasattr(self, "n_features_in_")
        batch = validate_batch(
            X,
            y,
            sample_weight,
            dtype=config.dtype,
            n_features=getattr(self, "n_features_in_", None),
            feature_names=getattr(self, "feature_names_in_", None),
            fitted=fitted,
            accept_device=name == "gpu",
            owner=type(self).__name__,
        )
        self._consume(batch, config, name)
        return self

    def _consume(self, batch: Batch, config: HuberConfig, name: str, fresh: bool = False) -> None:
        """One validated batch through the stream's engine, then into the attributes."""
        engine, diagnostics, seconds = self._fit_batch(
            batch.X, batch.y, batch.sample_weight, config, name, fresh=fresh
        )
        self._record_batch(
            engine,
            config,
            diagnostics,
            int(batch.X.shape[1]),
            batch.feature_names,
            rows=int(batch.X.shape[0]),
            seconds=seconds,
        )

    def _fit_batch(
        self,
        X: Any,
        y: Any,
        sample_weight: Any | None,
        config: HuberConfig,
        name: str,
        *,
        fresh: bool = False,
        limit: Callable[[], AbstractContextManager[Any]] = nullcontext,
    ) -> tuple[Engine, BatchDiagnostics, float]:
        """Advance the stream by one batch, or change nothing at all.

        ``fresh`` starts a new stream with the batch (``fit``). The model's
        current stream, its attributes and its engine are given up only once
        the engine has consumed the batch: when creating the engine or the
        batch fails, the model (and its engine's state) is as it was. Returns
        the engine, the batch's diagnostics and the engine's seconds; the
        caller records the batch (:meth:`_record_batch`).
        """
        if fresh or not hasattr(self, "n_features_in_"):
            engine, undo = self._new_stream_engine(config, name)
        else:
            engine, undo = self._continuing_engine()
        start = time.perf_counter()
        try:
            with limit():
                diagnostics = engine.partial_fit(X, y, sample_weight)
        except BaseException:
            undo()
            raise
        seconds = time.perf_counter() - start
        if fresh or not hasattr(self, "n_features_in_"):
            self._forget_stream()
        self._engine = engine
        self._pending_state = None
        return engine, diagnostics, seconds

    def _new_stream_engine(
        self, config: HuberConfig, name: str
    ) -> tuple[Engine, Callable[[], None]]:
        """An engine at the empty state for a new stream, and how to undo taking it.

        The model's engine is reused (its workspaces, a GPU context) when its
        configuration and name fit; the stream it holds is kept aside so that
        a failing first batch puts it back. Otherwise a new engine is made,
        and only kept once it has consumed the batch.
        """
        engine = getattr(self, "_engine", None)
        if engine is None or engine.config != config or engine.name != name:
            return make_engine(name, config, self.device), _nothing
        held = engine.export_state() if engine.n_features_in is not None else None
        engine.reset()

        def undo() -> None:
            if held is None:
                engine.reset()
            else:
                engine.import_state(held)

        return engine, undo

    def _continuing_engine(self) -> tuple[Engine, Callable[[], None]]:
        """The engine of the stream under way (a restored stream gets one, kept on success)."""
        engine = getattr(self, "_engine", None)
        if engine is not None:
            return engine, _nothing
        engine = make_engine(self.engine_, self._config, self.device)
        engine.import_state(self._pending_state)
        return engine, _nothing

    def _check_stream_config(self, config: HuberConfig) -> None:
        """Refuse parameters that changed while a stream is under way."""
        if hasattr(self, "n_features_in_") and config != self._config:
            raise ValidationError(
                "the estimator's parameters changed since the stream started; "
                "call reset() or fit() to start a new stream with them"
            )
        if (
            hasattr(self, "n_features_in_")
            and self.engine != "auto"
            and resolve_engine_name(self.engine, self.device) != self.engine_
        ):
            # An explicitly requested engine is never silently replaced.
            raise ValidationError(
                f"engine={self.engine!r} was requested, but the stream runs on the "
                f"{self.engine_!r} engine; move it with save() and load(path, engine=...), "
                "or call reset() or fit() to start a new stream"
            )

    def _record_batch(
        self,
        engine: Engine,
        config: HuberConfig,
        diagnostics: BatchDiagnostics,
        n_features: int,
        feature_names: np.ndarray | None,
        *,
        rows: int,
        seconds: float,
        chunk: int = 0,
        wait_seconds: float = 0.0,
    ) -> None:
        """Mirror one consumed batch into the scikit-learn attributes and history."""
        self._start_attributes(config, engine.name, n_features, feature_names)
        # The batch ran on this process's engine, not on a cluster worker.
        self._placement = None
        self._append_record(
            engine.batch_count - 1,
            chunk,
            rows,
            diagnostics,
            seconds,
            wait_seconds,
            engine.coefficients(),
        )

    def _start_attributes(
        self,
        config: HuberConfig,
        engine_name: str,
        n_features: int,
        feature_names: np.ndarray | None,
    ) -> None:
        """Set the attributes fixed by a stream's first batch (no-op afterwards)."""
        if hasattr(self, "n_features_in_"):
            return
        self._config = config
        self.engine_ = engine_name
        self.n_features_in_ = n_features
        if feature_names is not None:
            self.feature_names_in_ = feature_names

    def _append_record(
        self,
        batch: int,
        chunk: int,
        rows: int,
        diagnostics: BatchDiagnostics,
        seconds: float,
        wait_seconds: float,
        coefficients: np.ndarray,
    ) -> None:
        """One consumed batch into ``history_``, ``coef_history_`` and ``diagnostics_``."""
        self._history_rows().append(
            (
                batch,
                chunk,
                rows,
                diagnostics.iterations,
                diagnostics.converged,
                diagnostics.objective,
                seconds,
                wait_seconds,
            )
        )
        self._coef_rows().append(_float64_copy(coefficients))
        self.diagnostics_ = diagnostics
        self.n_iter_ = diagnostics.iterations

    def _history_rows(self) -> list[tuple[Any, ...]]:
        if "_history" not in self.__dict__:
            self._history = []
        return self._history

    def _coef_rows(self) -> list[np.ndarray]:
        if "_coef_history" not in self.__dict__:
            self._coef_history = []
        return self._coef_history

    def _adopt_stream(
        self,
        config: HuberConfig,
        engine_name: str,
        state: HuberState,
        feature_names: np.ndarray | None,
        records: list[tuple[int, int, BatchDiagnostics, float, float, np.ndarray]],
        placement: dict[str, Any] | None = None,
        *,
        fresh: bool = False,
    ) -> None:
        """Take over the state a remote engine reached (see :mod:`rh_dask.distributed`).

        ``records`` are ``(chunk, rows, diagnostics, seconds, wait_seconds, coefficients)``
        of the batches that led there, in order; ``placement`` is where that
        engine ran (``placement_``). ``fresh``: the remote stream started from
        the empty state (``fit``), so the model's current stream is forgotten
        first. Without records nothing changes.
        """
        if not records:
            return
        engine = getattr(self, "_engine", None)
        if engine is not None and engine.config == config and engine.name == engine_name:
            engine.import_state(state)  # keeps the local engine's workspaces; atomic
            pending = None
        else:
            engine, pending = None, state
        if fresh:
            self._forget_stream()
        self._engine = engine
        self._pending_state = pending
        self._start_attributes(config, engine_name, state.n_features_in, feature_names)
        first = state.batch_count - len(records)
        for offset, record in enumerate(records):
            self._append_record(first + offset, *record)
        self._placement = None if placement is None else dict(placement)

    def _count_empty_chunks(self, count: int) -> None:
        self._n_empty_chunks = self.__dict__.get("_n_empty_chunks", 0) + int(count)

    @property
    def history_(self) -> pd.DataFrame:
        """Per-batch history since the last reset (see the class docstring)."""
        self._require_fitted()
        frame = pd.DataFrame(self.__dict__.get("_history", []), columns=list(HISTORY_COLUMNS))
        return frame.astype(dict(zip(HISTORY_COLUMNS, _HISTORY_DTYPES, strict=True)))

    @property
    def coef_history_(self) -> np.ndarray:
        """β after each batch since the last reset, shape (n_batches, n_params), float64."""
        self._require_fitted()
        n_params = self.n_features_in_ + int(self._config.fit_intercept)
        rows = self.__dict__.get("_coef_history", [])
        if not rows:
            return np.empty((0, n_params), dtype=np.float64)
        return np.stack(rows)

    @property
    def n_empty_chunks_(self) -> int:
        """Zero-row chunks skipped since the last reset."""
        self._require_fitted()
        return int(self.__dict__.get("_n_empty_chunks", 0))

    @property
    def placement_(self) -> dict[str, Any] | None:
        """Where the engine of the last batch ran on a cluster (see the class docstring)."""
        self._require_fitted()
        placement = self.__dict__.get("_placement")
        return None if placement is None else dict(placement)

    # -- fitted views ------------------------------------------------------------
    def __sklearn_is_fitted__(self) -> bool:
        return hasattr(self, "n_features_in_")

    def _require_fitted(self) -> None:
        if not hasattr(self, "n_features_in_"):
            raise NotFittedError(
                f"This {type(self).__name__} instance is not fitted yet. Call 'fit' or "
                "'partial_fit' with appropriate arguments before using this estimator."
            )

    @property
    def state_(self) -> HuberState:
        """A host (NumPy) copy of the portable state."""
        self._require_fitted()
        engine = getattr(self, "_engine", None)
        if engine is None:
            return self._pending_state.copy()
        return engine.export_state()

    def _coefficients(self) -> np.ndarray:
        self._require_fitted()
        engine = getattr(self, "_engine", None)
        if engine is None:
            return self._pending_state.coefficients.copy()
        return engine.coefficients()

    @property
    def coef_(self) -> np.ndarray:
        """Feature coefficients, shape (n_features,)."""
        return self._coefficients()[: self.n_features_in_]

    @property
    def intercept_(self) -> float:
        """The intercept (0.0 without one)."""
        beta = self._coefficients()
        return float(beta[-1]) if self._config.fit_intercept else 0.0

    @property
    def n_samples_seen_(self) -> int:
        """Rows consumed since the last reset."""
        self._require_fitted()
        engine = getattr(self, "_engine", None)
        return engine.n_samples_seen if engine is not None else self._pending_state.n_samples_seen

    # -- prediction ----------------------------------------------------------------
    def predict(self, X: Any) -> Any:
        """Predict ``Xβ + intercept``.

        Host input gives a NumPy array; a CUDA array given to a GPU-engine
        model gives a device array; a Dask collection gives a lazy Dask array.
        """
        self._require_fitted()
        if _is_dask_collection(X):
            from .distributed import predict_dask

            return predict_dask(self, X)
        if is_device_array(X):
            # Refused before a restored stream's engine is started for it.
            engine = self._stream_engine() if self.engine_ == "gpu" else None
            if engine is None or not engine.accepts_device_arrays:
                raise ValidationError(
                    "got a CUDA device array, but this model's engine takes host arrays"
                )
            return engine.predict(X)
        X_arr, _ = validate_features(
            X,
            dtype=self._config.dtype,
            n_features=self.n_features_in_,
            feature_names=getattr(self, "feature_names_in_", None),
            fitted=True,
            owner=type(self).__name__,
        )
        beta = self._coefficients()
        out = X_arr @ beta[: self.n_features_in_]
        if self._config.fit_intercept:
            out += beta[-1]
        return out

    def score(self, X: Any, y: Any, sample_weight: Any | None = None) -> float:
        """Coefficient of determination R² (weighted when ``sample_weight`` is given).

        A column vector ``y`` of shape (n_samples, 1) is raveled with a
        :class:`~sklearn.exceptions.DataConversionWarning`, as in :meth:`fit`.
        """
        if _is_dask_collection(X) or _is_dask_collection(y):
            from .distributed import score_dask
            from .distributed.fit import column_vector_target

            return score_dask(self, X, column_vector_target(y), sample_weight)
        return super().score(X, ravel_column_vector(y), sample_weight=sample_weight)

    # -- persistence ---------------------------------------------------------------
    def save(self, path: str | os.PathLike[str]) -> os.PathLike[str]:
        """Write a portable checkpoint (``.npz``) of the fitted stream; returns its path."""
        self._require_fitted()
        return save_checkpoint(
            path,
            Checkpoint(
                config=self._config,
                state=self.state_,
                feature_names=getattr(self, "feature_names_in_", None),
                engine=self.engine_,
            ),
        )

    @classmethod
    def load(
        cls,
        path: str | os.PathLike[str],
        engine: str | None = None,
        device: str | int | None = None,
    ) -> RenewableHuberRegressor:
        """Restore a model from a checkpoint, optionally onto another engine or device.

        The engine is created lazily, when the stream continues, so a checkpoint
        written by the GPU engine loads (and predicts on the host) anywhere;
        continuing it there needs ``engine="numpy"``.
        """
        ckpt = load_checkpoint(path)
        config = ckpt.config
        model = cls(
            tau=config.tau,
            penalty=config.penalty,
            lambda_scale=config.lambda_scale,
            bandwidth_scale=config.bandwidth_scale,
            fit_intercept=config.fit_intercept,
            max_iter=config.max_iter,
            tol=config.tol,
            ridge=config.ridge,
            engine=engine if engine is not None else ckpt.engine,
            device=device,
            dtype=config.dtype,
        )
        model._restore(config, ckpt.state, ckpt.feature_names)
        return model

    def _restore(
        self, config: HuberConfig, state: HuberState, feature_names: np.ndarray | None
    ) -> None:
        self._engine = None
        self._config = config
        self._pending_state = state
        self.engine_ = resolve_engine_name(self.engine, self.device)
        self.n_features_in_ = state.n_features_in
        if feature_names is not None:
            self.feature_names_in_ = feature_names

    def __getstate__(self) -> dict[str, Any]:
        # Pickle the portable state, never a (possibly device-resident) engine.
        data = dict(self.__dict__)
        engine = data.pop("_engine", None)
        if engine is not None and hasattr(self, "n_features_in_"):
            data["_pending_state"] = engine.export_state()
        data["_engine"] = None
        return data
