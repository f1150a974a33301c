"""``RenewableHuberRegressor``: the scikit-learn face of rh-dask.

The estimator is thin on purpose: it turns parameters into a
:class:`~rh_dask.config.HuberConfig`, validates each batch and hands it to
its :class:`~rh_dask.stream.Stream`, the one object holding the engine and
everything learnt since the last reset; every fitted attribute is read from
that stream. Dask collections are walked into the same stream by
:mod:`rh_dask.distributed`.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pandas as pd
from sklearn.base import BaseEstimator, RegressorMixin

from .checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from .config import HuberConfig
from .core import linear_predictor
from .engines import resolve_engine_name
from .exceptions import NotFittedError, ValidationError
from .inference import Summary, covariance, standard_errors, summarize
from .inference import confidence_intervals as _confidence_intervals
from .state import BatchDiagnostics, HuberState
from .stream import HISTORY_COLUMNS, BatchRecord, Stream, history_frame, recovery_frame
from .validation import (
    Batch,
    is_device_array,
    ravel_column_vector,
    validate_batch,
    validate_features,
)

__all__ = ["HISTORY_COLUMNS", "RenewableHuberRegressor"]


def _is_dask_collection(obj: Any) -> bool:
    try:
        from dask.base import is_dask_collection
    except ImportError:  # pragma: no cover - dask is a hard dependency
        return False
    return is_dask_collection(obj)


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
        decides once per stream, from its first batch, by
        :func:`rh_dask.engines.auto.choose_engine` (a CUDA ``device`` or a
        batch on the device: GPU; ``device="cpu"``: NumPy; otherwise a
        measured calibration), in this process or, for a Dask collection on a
        cluster, on the engine's worker; see ``engine_choice_``.
    device : str or int, default=None
        Device of the engine, e.g. ``"cuda:0"``.
    dtype : {"float64", "float32"}, default="float64"
        Precision of the whole computation.
    lookahead : int or "auto", default="auto"
        Dask streams only: how many chunks load ahead of the engine, in
        parallel, while it fits the current one. Look-ahead host memory is
        bounded by this many chunks. ``"auto"``: 8 where chunks load on the
        engine's worker; where they load off it (``loader`` ``"relay"`` or
        ``"cluster"``), twice the chunks the loading workers may have in
        flight (their task threads, or with ``"relay"`` over TCP the file
        sends they keep in flight where more), at least 8 and at most
        ``rh-dask.distributed.lookahead-max`` (32). The number a walk used
        is ``placement_["lookahead"]``. See ``docs/distributed.md`` for how
        it was measured.
    loader : {"auto", "actor", "engine-worker", "cluster", "relay"}, default="auto"
        Dask streams only: where chunks load. ``"actor"`` sends the chunk
        graphs to the worker holding the engine once, and that worker computes
        them on its own threads, with no scheduler task per chunk (it needs a
        collection that worker can compute alone: not one referencing data
        persisted on the cluster). ``"engine-worker"`` runs one Dask task per
        chunk on that worker; ``"cluster"`` computes chunks on any worker and
        moves each finished chunk to the engine's worker. ``"relay"`` computes
        chunks on the workers off the engine's node and hands each finished
        chunk to the engine through a relay worker on its node, in shared
        memory (``docs/distributed.md``, "Relays"). ``"auto"`` picks
        ``"relay"`` when the engine's node has workers advertising the
        ``relay`` resource and other workers exist to load, else ``"actor"``
        when possible, else ``"engine-worker"`` unless that worker has a
        single thread and other workers exist.
    worker : str, default=None
        Dask streams only: address of the worker that hosts the engine actor.
        ``None`` picks one: a worker advertising ``resources={"GPU": 1}`` for
        the GPU engine, any worker for the NumPy engine.
    progress : bool, default=None
        Dask streams only: show a progress bar (chunks/s, rows/s) while
        fitting. ``None`` shows it when stderr is a terminal.
    checkpoint_every : int, default=None
        Dask streams only: take a stream checkpoint (the state after a chunk,
        copied off the engine's worker to the client) after every this many
        chunks, so that a lost engine worker costs at most these chunks.
        ``None``: the ``rh-dask.checkpoint.every-chunks`` setting (also
        checkpointed by time: ``rh-dask.checkpoint.every-seconds``).
    checkpoint_dir : str or path, default=None
        Dask streams only: also write every stream checkpoint there (a local
        directory or an fsspec URL such as ``"s3://bucket/run"``), as
        ``stream.npz``, atomically, with the input's fingerprint, so that a
        fit whose client died or was interrupted goes on with
        ``fit(X, y, resume_from=checkpoint_dir)``. ``None``: checkpoints are
        only held in memory, for recovery.
    max_retries : int, default=None
        Dask streams only: how many times one call may lose the engine's
        worker and go on from the last stream checkpoint on another worker
        (waiting up to ``rh-dask.recovery.worker-timeout`` for one). ``None``:
        the ``rh-dask.recovery.max-retries`` setting; 0: the loss raises
        :class:`~rh_dask.exceptions.ActorLostError` at once.

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
    recoveries_ : pandas.DataFrame
        One row per time the stream went on after losing its engine's worker
        (``kind="worker-lost"``) or from a stream checkpoint
        (``kind="resume"``) since the last reset, with columns ``time``
        (UTC), ``kind``, ``lost_worker``, ``new_worker``, ``from_chunk`` (the
        chunk the stream went on from), ``chunks_replayed`` (chunks the lost
        engine had consumed since that checkpoint, as last reported),
        ``detect_seconds`` and ``recover_seconds``.
    cov_ : ndarray of shape (n_params, n_params)
        The sandwich covariance J⁻¹ K J⁻¹ of the coefficients followed by the
        intercept (the order of ``state_.coefficients``), on the scale of the
        coefficients, in float64. Raises
        :class:`~rh_dask.exceptions.InferenceError` for ``penalty="l1"``, for
        a stream without the score variance K (the GPU engine, a checkpoint
        older than format version 2) and for a singular J.
    bse_ : ndarray of shape (n_params,)
        Standard errors, √diag(``cov_``), in the same order.
    placement_ : dict or None
        Where the engine ran for the last call that consumed a batch, when
        that call walked a Dask collection on a ``distributed`` cluster: the
        keys ``worker`` (address), ``loader`` (``"actor"``,
        ``"engine-worker"``, ``"cluster"`` or ``"relay"``: ``"auto"``
        resolved), ``engine``, ``lookahead`` and ``engine_reused`` (whether
        the worker still held an idle engine from an earlier fit, see
        :func:`rh_dask.distributed.release_engines`); with ``"relay"`` also
        ``relays`` and ``loaders`` (worker addresses), ``relay_transport``
        (``"tcp"`` or ``"dask"``), ``relay_sendfile`` (whether chunks of
        :func:`rh_dask.read_npy` files were sent from the files) and
        ``relay_ring_reused`` (whether the stream took the shared-memory ring
        an earlier fit left with the parked engine, ``rh-dask.relay.keep-ring``).
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
        lookahead: int | str = "auto",
        loader: str = "auto",
        worker: str | None = None,
        progress: bool | None = None,
        checkpoint_every: int | None = None,
        checkpoint_dir: str | os.PathLike[str] | None = None,
        max_retries: int | None = None,
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
        self.checkpoint_every = checkpoint_every
        self.checkpoint_dir = checkpoint_dir
        self.max_retries = max_retries

    #: The stream being fitted (see :mod:`rh_dask.stream`); ``None`` until the first batch.
    _stream: Stream | None = None

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

    def _new_stream(self, config: HuberConfig, engine_name: str) -> Stream:
        """An unstarted stream that may reuse the current stream's engine."""
        if self._stream is None:
            return Stream(config, engine_name)
        return self._stream.successor(config, engine_name)

    def _continued_stream(self, config: HuberConfig) -> Stream | None:
        """The fitted stream a call continues (checked against the parameters), or ``None``."""
        stream = self._fitted_stream()
        if stream is not None:
            stream.check_continues(config, self.engine, self.device)
        return stream

    # -- fitting -------------------------------------------------------------------
    def reset(self) -> RenewableHuberRegressor:
        """Forget the stream (keeps the engine and its workspaces for reuse)."""
        self._stream = None if self._stream is None else self._stream.emptied()
        return self

    def fit(
        self,
        X: Any,
        y: Any,
        sample_weight: Any | None = None,
        *,
        resume_from: str | os.PathLike[str] | None = None,
    ) -> RenewableHuberRegressor:
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
        resume_from : str or path, default=None
            Dask streams only: go on from the stream checkpoint in this
            directory (or fsspec URL; or a ``stream.npz`` file), written by a
            fit of the same input with ``checkpoint_dir``: the state, history
            and recoveries it holds are restored and the walk continues from
            its next chunk, to the coefficients an uninterrupted fit gives. A
            checkpoint of a finished fit is its result. Later checkpoints go
            to ``checkpoint_dir``, or back to ``resume_from`` when that is
            ``None``. Raises :class:`~rh_dask.exceptions.CheckpointError`,
            with the model unchanged, when there is no stream checkpoint there,
            it is corrupted, or it was written for another input or with
            other parameters.

        Returns
        -------
        self
        """
        if resume_from is not None:
            if not any(_is_dask_collection(a) for a in (X, y, sample_weight)):
                raise ValidationError(
                    "resume_from continues a walk over a Dask collection; X is in memory"
                )
            return self._resume(X, y, sample_weight, resume_from)
        if any(_is_dask_collection(a) for a in (X, y, sample_weight)):
            return self._fit_collection(X, y, sample_weight, fresh=True)
        config = self._make_config()
        name = resolve_engine_name(self.engine, self.device)
        scan = self.engine == "numpy"
        batch = validate_batch(
            X,
            y,
            sample_weight,
            dtype=config.dtype,
            accept_device=name == "gpu" or self._auto_on_device(X),
            owner=type(self).__name__,
            # The GPU engine refuses non-finite values on the device, in its
            # first pass over the batch: the host scan would be a second read.
            # engine="auto" scans once its choice is not the GPU (Stream.consume).
            check_finite=scan,
        )
        self._consume(self._first_stream(config, name, batch), batch, scan)
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
            return self._fit_collection(X, y, sample_weight, fresh=False)
        config = self._make_config()
        stream = self._continued_stream(config)
        name = resolve_engine_name(self.engine, self.device)
        if stream is None:
            accept_device = name == "gpu" or self._auto_on_device(X)
            # engine="auto" scans once its choice is not the GPU (Stream.consume).
            scan = self.engine == "numpy"
        else:
            accept_device = stream.engine_name == "gpu"
            scan = not accept_device
        batch = validate_batch(
            X,
            y,
            sample_weight,
            dtype=config.dtype,
            n_features=None if stream is None else stream.n_features,
            feature_names=None if stream is None else stream.feature_names,
            fitted=stream is not None,
            accept_device=accept_device,
            owner=type(self).__name__,
            # The GPU engine refuses non-finite values on the device, in its
            # first pass over the batch: the host scan would be a second read.
            check_finite=scan,
        )
        self._consume(
            self._first_stream(config, name, batch) if stream is None else stream, batch, scan
        )
        return self

    def _auto_on_device(self, X: Any) -> bool:
        """Whether ``engine="auto"`` meets a first batch already on a CUDA device."""
        return self.engine == "auto" and self.device is None and is_device_array(X)

    def _first_stream(self, config: HuberConfig, name: str, batch: Batch) -> Stream:
        """A new stream for ``batch``; with ``engine="auto"`` its engine is chosen for it.

        The choice (:func:`rh_dask.engines.auto.choose_engine`: a rule, or a
        calibration on the batch's shape cached per process) is kept as the
        stream's ``auto_choice``, read back as ``engine_choice_``.
        """
        choice = None
        if self.engine == "auto":
            from .engines.auto import choose_engine

            rows, features = (int(n) for n in batch.X.shape)
            choice = choose_engine(
                config,
                rows,
                features,
                device=self.device,
                device_input=is_device_array(batch.X),
            )
            name = choice.engine
        stream = self._new_stream(config, name)
        stream.auto_choice = choice
        return stream

    def _consume(self, stream: Stream, batch: Batch, finite_checked: bool) -> None:
        """One validated batch into ``stream``, which becomes the model's once it has it.

        ``finite_checked=False``: the batch was validated without its NaN
        scan, which the stream runs unless its engine is the GPU engine.
        """
        stream.consume(
            batch.X,
            batch.y,
            batch.sample_weight,
            device=self.device,
            feature_names=batch.feature_names,
            finite_checked=finite_checked,
        )
        self._stream = stream

    def _walk_options(self, checkpoint_dir: Any = None) -> Any:
        from .distributed import WalkOptions

        return WalkOptions.from_params(
            self.lookahead,
            self.loader,
            self.worker,
            self.progress,
            self.checkpoint_every,
            self.checkpoint_dir if checkpoint_dir is None else checkpoint_dir,
            self.max_retries,
        )

    def _fit_collection(
        self, X: Any, y: Any, sample_weight: Any | None, *, fresh: bool
    ) -> RenewableHuberRegressor:
        """Walk a Dask collection's chunks into the stream (a new one for ``fit``).

        A new stream becomes the model's once it has consumed a batch, even
        when the walk fails later (the model then holds the state after the
        last good chunk); one that consumed nothing leaves the model as it was.
        """
        from .distributed import stream_fit

        options = self._walk_options()
        config = self._make_config()
        stream = None if fresh else self._continued_stream(config)
        if stream is None:
            stream = self._new_stream(config, resolve_engine_name(self.engine, self.device))
        try:
            stream_fit(
                stream,
                X,
                y,
                sample_weight,
                options,
                device=self.device,
                owner=type(self).__name__,
                auto=self.engine == "auto",
            )
        finally:
            if stream.started:
                self._stream = stream
        return self

    def _resume(
        self, X: Any, y: Any, sample_weight: Any | None, location: str | os.PathLike[str]
    ) -> RenewableHuberRegressor:
        """``fit(..., resume_from=location)``: the stream checkpoint there, walked on."""
        import time

        from .checkpoint_store import CheckpointStore
        from .distributed import stream_fit
        from .distributed.fit import ResumePoint, check_resume
        from .exceptions import CheckpointError
        from .stream import Recovery

        location = os.fspath(location)
        options = self._walk_options(self.checkpoint_dir or _directory_of(location))
        config = self._make_config()
        store = CheckpointStore(location)
        ckpt = store.read()
        if ckpt is None:
            raise CheckpointError(f"no stream checkpoint in {store.location}")
        if ckpt.walk is None:
            raise CheckpointError(
                f"{store.path} is a model checkpoint (save()), not a stream checkpoint of a "
                "walk: load it with RenewableHuberRegressor.load"
            )
        if ckpt.config != config:
            theirs, ours = ckpt.config.to_dict(), config.to_dict()
            differ = ", ".join(
                f"{k}={theirs[k]!r} there, {ours[k]!r} here"
                for k in ours
                if theirs.get(k) != ours[k]
            )
            raise CheckpointError(
                f"the stream checkpoint {store.path} was written with other parameters ({differ})"
            )
        # engine="auto" goes on with the engine the stream started with, never recalibrates.
        name = (
            ckpt.engine if self.engine == "auto" else resolve_engine_name(self.engine, self.device)
        )
        walk = ckpt.walk
        resumed = Recovery(
            time=time.time(),
            kind="resume",
            lost_worker="",
            new_worker="",
            from_chunk=walk.next_chunk,
            chunks_replayed=0,
            detect_seconds=float("nan"),
            recover_seconds=0.0,
        )
        stream = Stream.restored(
            config,
            name,
            ckpt.state,
            ckpt.feature_names,
            records=ckpt.records,
            n_empty=walk.n_empty,
            recoveries=(*ckpt.recoveries, resumed),
        )
        point = ResumePoint(walk.next_chunk, walk.fingerprint, store.path)
        # Refused for another input, the model is as it was; once the checkpoint
        # is accepted, the model holds the resumed stream, however far it gets.
        check_resume(X, y, sample_weight, point)
        try:
            stream_fit(
                stream,
                X,
                y,
                sample_weight,
                options,
                device=self.device,
                owner=type(self).__name__,
                resume=point,
            )
        finally:
            self._stream = stream
        return self

    # -- fitted views ------------------------------------------------------------
    def _fitted_stream(self) -> Stream | None:
        """The model's stream when it has started, else ``None``: "is fitted" is this test."""
        stream = self._stream
        return stream if stream is not None and stream.started else None

    def __sklearn_is_fitted__(self) -> bool:
        return self._fitted_stream() is not None

    def _require_fitted(self) -> Stream:
        stream = self._fitted_stream()
        if stream is None:
            raise NotFittedError(
                f"This {type(self).__name__} instance is not fitted yet. Call 'fit' or "
                "'partial_fit' with appropriate arguments before using this estimator."
            )
        return stream

    def _last_record(self, name: str) -> BatchRecord:
        records = self._require_fitted().records
        if not records:
            raise AttributeError(
                f"{name} describes the last consumed batch; this {type(self).__name__} "
                "was restored from a checkpoint and has consumed none since"
            )
        return records[-1]

    @property
    def n_features_in_(self) -> int:
        """Number of features seen during fit."""
        return self._require_fitted().n_features

    @property
    def feature_names_in_(self) -> np.ndarray:
        """Feature names, when the stream came as a DataFrame with string columns."""
        names = self._require_fitted().feature_names
        if names is None:
            raise AttributeError(
                f"this {type(self).__name__} was fitted without feature names "
                "(its stream did not come as DataFrames with string columns)"
            )
        return names

    @property
    def engine_(self) -> str:
        """The engine actually in use (``"numpy"`` or ``"gpu"``)."""
        return self._require_fitted().engine_name

    @property
    def engine_choice_(self) -> Any:
        """What ``engine="auto"`` chose for the stream and why.

        An :class:`~rh_dask.engines.auto.AutoChoice` (``engine``, ``reason``,
        the calibration's ``predicted_ratio``, ``ratios`` and
        ``calibration_seconds``, ``cached``, and ``fallback`` when the chosen
        GPU engine failed to start and the stream runs on NumPy); ``None`` for
        an explicitly named engine and for a stream restored from a checkpoint.
        """
        return self._require_fitted().auto_choice

    @property
    def diagnostics_(self) -> BatchDiagnostics:
        """Diagnostics of the last batch."""
        return self._last_record("diagnostics_").diagnostics

    @property
    def n_iter_(self) -> int:
        """Iterations used by the last batch."""
        return self._last_record("n_iter_").diagnostics.iterations

    @property
    def history_(self) -> pd.DataFrame:
        """Per-batch history since the last reset (see the class docstring)."""
        return history_frame(self._require_fitted().records)

    @property
    def coef_history_(self) -> np.ndarray:
        """β after each batch since the last reset, shape (n_batches, n_params), float64."""
        stream = self._require_fitted()
        records = stream.records
        if not records:
            n_params = stream.n_features + int(stream.config.fit_intercept)
            return np.empty((0, n_params), dtype=np.float64)
        return np.stack([r.coefficients for r in records])

    @property
    def n_empty_chunks_(self) -> int:
        """Zero-row chunks skipped since the last reset."""
        return self._require_fitted().n_empty

    @property
    def recoveries_(self) -> pd.DataFrame:
        return recovery_frame(self._require_fitted().recoveries)

    @property
    def placement_(self) -> dict[str, Any] | None:
        """Where the engine of the last batch ran on a cluster (see the class docstring)."""
        return self._require_fitted().placement

    @property
    def state_(self) -> HuberState:
        """A host (NumPy) copy of the portable state."""
        return self._require_fitted().state()

    @property
    def coef_(self) -> np.ndarray:
        """Feature coefficients, shape (n_features,)."""
        stream = self._require_fitted()
        return stream.coefficients()[: stream.n_features]

    @property
    def intercept_(self) -> float:
        """The intercept (0.0 without one)."""
        stream = self._require_fitted()
        beta = stream.coefficients()
        return float(beta[-1]) if stream.config.fit_intercept else 0.0

    @property
    def n_samples_seen_(self) -> int:
        """Rows consumed since the last reset."""
        return self._require_fitted().n_samples_seen

    # -- inference -----------------------------------------------------------------
    def _covariance(self) -> tuple[Stream, HuberState, np.ndarray]:
        stream = self._require_fitted()
        state = stream.state()
        cov = covariance(state, stream.config.penalty, engine=stream.engine_name)
        return stream, state, cov

    @property
    def cov_(self) -> np.ndarray:
        """Sandwich covariance J⁻¹ K J⁻¹ of (coefficients, intercept), float64 (see the class)."""
        return self._covariance()[2]

    @property
    def bse_(self) -> np.ndarray:
        """Standard errors of (coefficients, intercept): √diag(``cov_``)."""
        return standard_errors(self.cov_)

    def conf_int(self, alpha: float = 0.05) -> np.ndarray:
        """Normal confidence intervals at level 1 − ``alpha`` from the sandwich covariance.

        Parameters
        ----------
        alpha : float, default=0.05
            In (0, 1); 0.05 gives 95% intervals.

        Returns
        -------
        ndarray of shape (n_params, 2)
            Lower and upper bounds, the coefficients' rows then the intercept's.

        Raises
        ------
        NotFittedError
            Before any batch.
        InferenceError
            ``penalty="l1"``, a stream without K, or a singular J (see ``cov_``).
        ValidationError
            ``alpha`` outside (0, 1).
        """
        _, state, cov = self._covariance()
        return _confidence_intervals(state.coefficients, standard_errors(cov), alpha)

    def summary(self, alpha: float = 0.05) -> Summary:
        """A coefficient table: coef, std err, z, P>|z| and the (1 − ``alpha``) interval.

        Returns
        -------
        rh_dask.inference.Summary
            ``.table`` is a pandas DataFrame indexed by the feature names (or
            ``x0``, ``x1``, ...) then ``"intercept"``; ``str(summary)`` is the
            text form with the stream's rows, batches, τ, penalty and dtype.

        Raises
        ------
        NotFittedError, InferenceError, ValidationError
            As :meth:`conf_int`.
        """
        stream = self._require_fitted()
        config = stream.config
        return summarize(
            stream.state(),
            tau=config.tau,
            penalty=config.penalty,
            dtype=config.dtype,
            feature_names=stream.feature_names,
            engine=stream.engine_name,
            alpha=alpha,
        )

    # -- prediction ----------------------------------------------------------------
    def predict(self, X: Any) -> Any:
        """Predict ``Xβ + intercept``.

        Host input gives a NumPy array; a CUDA array given to a GPU-engine
        model gives a device array; a Dask collection gives a lazy Dask array.
        """
        stream = self._require_fitted()
        if _is_dask_collection(X):
            from .distributed import predict_dask

            return predict_dask(self, X)
        if is_device_array(X):
            # Refused before a restored stream's engine is started for it.
            engine = stream.live_engine(self.device) if stream.engine_name == "gpu" else None
            if engine is None or not engine.accepts_device_arrays:
                raise ValidationError(
                    "got a CUDA device array, but this model's engine takes host arrays"
                )
            return engine.predict(X)
        X_arr, _ = validate_features(
            X,
            dtype=stream.config.dtype,
            n_features=stream.n_features,
            feature_names=stream.feature_names,
            fitted=True,
            owner=type(self).__name__,
        )
        return linear_predictor(X_arr, stream.coefficients(), stream.config.fit_intercept)

    def score(self, X: Any, y: Any, sample_weight: Any | None = None) -> float:
        """Coefficient of determination R² (weighted when ``sample_weight`` is given).

        A column vector ``y`` of shape (n_samples, 1) is raveled with a
        :class:`~sklearn.exceptions.DataConversionWarning`, as in :meth:`fit`.
        """
        if _is_dask_collection(X) or _is_dask_collection(y):
            from .distributed import column_vector_target, score_dask

            return score_dask(self, X, column_vector_target(y), sample_weight)
        return super().score(X, ravel_column_vector(y), sample_weight=sample_weight)

    # -- persistence ---------------------------------------------------------------
    def save(self, path: str | os.PathLike[str]) -> os.PathLike[str]:
        """Write a portable checkpoint (``.npz``) of the fitted stream; returns its path."""
        stream = self._require_fitted()
        return save_checkpoint(
            path,
            Checkpoint(
                config=stream.config,
                state=stream.state(),
                feature_names=stream.feature_names,
                engine=stream.engine_name,
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
        name = resolve_engine_name(model.engine, model.device)
        model._stream = Stream.restored(config, name, ckpt.state, ckpt.feature_names)
        return model


def _directory_of(location: str) -> str:
    """Where a resumed walk writes: the directory itself, or the one holding a ``.npz`` file."""
    if not location.endswith(".npz"):
        return location
    if "://" in location:
        return location.rsplit("/", 1)[0]
    return os.path.dirname(os.path.abspath(location))
