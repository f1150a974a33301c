"""The stream a model is fitting: its engine, its configuration and its records.

A :class:`Stream` is everything :class:`~rh_dask.RenewableHuberRegressor`
learns from its batches, in one object: the configuration and engine the
stream started with, the engine that holds it (or, for a stream restored from
a checkpoint or a pickle, the portable state waiting for one), one
:class:`BatchRecord` per consumed batch, the empty chunks it skipped and where
its last batch ran. The estimator derives every fitted attribute from it and
forgets a stream by dropping the object. The in-memory path and the Dask walk
(:mod:`rh_dask.distributed`) advance a stream through the same few public
methods, so both keep the same guarantees: a batch is consumed entirely or
not at all, and a stream that has consumed nothing replaces nothing.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import pandas as pd

from .config import HuberConfig
from .engines import Engine, make_engine, resolve_engine_name
from .exceptions import ValidationError
from .state import OPTIONAL_DIAGNOSTICS, BatchDiagnostics, HuberState
from .validation import check_finite_batch

__all__ = [
    "HISTORY_COLUMNS",
    "RECOVERY_COLUMNS",
    "BatchRecord",
    "Recovery",
    "Stream",
    "history_frame",
    "recovery_frame",
]

#: Columns of ``RenewableHuberRegressor.history_``, one row per :class:`BatchRecord`.
HISTORY_COLUMNS = (
    "batch",
    "chunk",
    "rows",
    "iterations",
    "converged",
    "objective",
    "seconds",
    "wait_seconds",
    "mean_loss",
    "outlier_share",
    "residual_scale",
)
_HISTORY_DTYPES = (
    ("int64", "int64", "int64", "int64", "bool") + ("float64",) * 3 + ("float64",) * 3
)


@dataclass(frozen=True)
class BatchRecord:
    """What a stream keeps of one consumed batch.

    Made where the engine ran (this process, or the actor of a Dask walk) and
    kept by the :class:`Stream` up to ``history_``.

    Attributes
    ----------
    batch : int
        Position of the batch in the stream (the engine's batch count after
        it, minus one).
    chunk : int
        Index of the chunk in the collection given to the call that consumed
        it (0 for an in-memory batch).
    rows : int
        Rows of the batch.
    diagnostics : BatchDiagnostics
        What the engine's solve reported.
    seconds : float
        Engine time of the batch.
    coefficients : ndarray of shape (n_params,)
        β after the batch (intercept last): the ``coef_history_`` row of the
        batch. In the engine's dtype where it was made; a :class:`Stream`
        keeps a float64 copy.
    wait_seconds : float, default=0.0
        How long the engine sat idle, during a Dask walk, before this batch
        arrived (0 for an in-memory batch).
    """

    batch: int
    chunk: int
    rows: int
    diagnostics: BatchDiagnostics
    seconds: float
    coefficients: np.ndarray
    wait_seconds: float = 0.0

    def history_row(self) -> tuple[Any, ...]:
        """The record's row of ``history_``, in the order of :data:`HISTORY_COLUMNS`."""
        d = self.diagnostics
        return (
            self.batch,
            self.chunk,
            self.rows,
            d.iterations,
            d.converged,
            d.objective,
            self.seconds,
            self.wait_seconds,
            *(_nan_if_none(getattr(d, name)) for name in OPTIONAL_DIAGNOSTICS),
        )


def _nan_if_none(value: float | None) -> float:
    """A diagnostic the engine did not report is NaN in ``history_``."""
    return float("nan") if value is None else float(value)


def history_frame(records: Sequence[BatchRecord]) -> pd.DataFrame:
    """``history_``: one row per record, the columns :data:`HISTORY_COLUMNS`."""
    frame = pd.DataFrame([r.history_row() for r in records], columns=list(HISTORY_COLUMNS))
    return frame.astype(dict(zip(HISTORY_COLUMNS, _HISTORY_DTYPES, strict=True)))


#: Columns of ``RenewableHuberRegressor.recoveries_``, one row per :class:`Recovery`.
RECOVERY_COLUMNS = (
    "time",
    "kind",
    "lost_worker",
    "new_worker",
    "from_chunk",
    "chunks_replayed",
    "detect_seconds",
    "recover_seconds",
)


@dataclass(frozen=True)
class Recovery:
    """One time a stream went on after losing its engine, or was resumed from a checkpoint.

    Attributes
    ----------
    time : float
        When the stream went on (POSIX seconds, UTC).
    kind : {"worker-lost", "resume"}
        ``"worker-lost"``: the engine's worker died during a Dask walk and a
        new actor continued from the last stream checkpoint; ``"resume"``:
        ``fit(..., resume_from=...)`` continued a checkpoint in a new call.
    lost_worker, new_worker : str
        Addresses of the worker that was lost and of the one that took over
        (empty for ``"resume"``).
    from_chunk : int
        The chunk the stream went on from (the checkpoint's next chunk).
    chunks_replayed : int
        Chunks the lost engine had consumed (as last reported to the client)
        that are consumed again: the work the loss cost.
    detect_seconds : float
        From the last answer of the lost engine to the client's noticing the
        loss (NaN for ``"resume"``).
    recover_seconds : float
        From noticing the loss to the new engine's being ready at ``from_chunk``.
    """

    time: float
    kind: str
    lost_worker: str
    new_worker: str
    from_chunk: int
    chunks_replayed: int
    detect_seconds: float
    recover_seconds: float


def recovery_frame(recoveries: Sequence[Recovery]) -> pd.DataFrame:
    """``recoveries_``: one row per recovery, the columns :data:`RECOVERY_COLUMNS`."""
    frame = pd.DataFrame(
        [[getattr(r, c) for c in RECOVERY_COLUMNS] for r in recoveries],
        columns=list(RECOVERY_COLUMNS),
    )
    frame["time"] = pd.to_datetime(frame["time"].astype("float64"), unit="s", utc=True)
    return frame.astype(
        {
            "kind": object,
            "lost_worker": object,
            "new_worker": object,
            "from_chunk": "int64",
            "chunks_replayed": "int64",
            "detect_seconds": "float64",
            "recover_seconds": "float64",
        }
    )


def _nothing() -> None:
    """The undo of a step that changed nothing."""


def warn_fallback(choice: Any, stacklevel: int = 2) -> None:
    """The :class:`RuntimeWarning` of a measured GPU choice that ran on NumPy (``fallback``)."""
    warnings.warn(
        f'engine="auto" chose the GPU engine ({choice.reason}), but it failed to start '
        f"({choice.fallback}); this stream runs on the NumPy engine",
        RuntimeWarning,
        stacklevel=stacklevel,
    )


def _float64_copy(beta: Any) -> np.ndarray:
    """A float64 host copy of β: exact for float32 engines, and never a view of engine memory."""
    return np.array(beta, dtype=np.float64, copy=True)


class Stream:
    """One stream of batches: engine, configuration, records, skipped chunks, placement.

    A stream is *started* once it has consumed a batch (or was restored, see
    :meth:`restored`); before that it holds only the configuration and engine
    name its first batch will use, and possibly a spare engine to reuse.

    Parameters
    ----------
    config : HuberConfig
        Configuration of the stream.
    engine_name : str
        Resolved engine name (``"numpy"`` or ``"gpu"``).
    spare : Engine, optional
        An engine the stream may take for its first batch (that of the
        stream it replaces): taken when its configuration and name are this
        stream's, after saving the state it holds so that a first batch that
        fails puts it back.
    """

    #: What ``engine="auto"`` chose for this stream (an
    #: :class:`~rh_dask.engines.auto.AutoChoice`), set by the estimator before the
    #: first batch; ``None`` for an explicitly named engine.
    auto_choice: Any = None

    def __init__(
        self, config: HuberConfig, engine_name: str, *, spare: Engine | None = None
    ) -> None:
        self._config = config
        self._engine_name = engine_name
        self._engine = spare
        self._pending: HuberState | None = None
        self._n_features: int | None = None
        self._feature_names: np.ndarray | None = None
        self._records: list[BatchRecord] = []
        self._n_empty = 0
        self._placement: dict[str, Any] | None = None
        self._recoveries: list[Recovery] = []

    @classmethod
    def restored(
        cls,
        config: HuberConfig,
        engine_name: str,
        state: HuberState,
        feature_names: np.ndarray | None,
        *,
        records: Sequence[BatchRecord] = (),
        n_empty: int = 0,
        recoveries: Sequence[Recovery] = (),
    ) -> Stream:
        """A started stream at ``state``; its engine starts when it continues.

        ``records``, ``n_empty`` and ``recoveries`` are what a stream
        checkpoint kept of the batches that led to ``state`` (a model
        checkpoint keeps none).
        """
        stream = cls(config, engine_name)
        stream._pending = state
        stream._start(state.n_features_in, feature_names)
        stream._records = [replace(r, coefficients=_float64_copy(r.coefficients)) for r in records]
        stream._n_empty = int(n_empty)
        stream._recoveries = list(recoveries)
        return stream

    def successor(self, config: HuberConfig, engine_name: str) -> Stream:
        """A new, unstarted stream that may reuse this one's engine; this one is unchanged."""
        return Stream(config, engine_name, spare=self._engine)

    def emptied(self) -> Stream:
        """An unstarted stream keeping this one's engine, reset, for reuse."""
        if self._engine is not None:
            self._engine.reset()
        return self.successor(self._config, self._engine_name)

    # -- what the stream holds ------------------------------------------------------------
    @property
    def started(self) -> bool:
        """Whether the stream has consumed a batch (or was restored)."""
        return self._n_features is not None

    @property
    def config(self) -> HuberConfig:
        return self._config

    @property
    def engine_name(self) -> str:
        return self._engine_name

    @property
    def engine(self) -> Engine | None:
        """The engine holding the stream (``None`` while a restored state waits for one).

        For an unstarted stream: the spare engine it may take, if any.
        """
        return self._engine

    @property
    def n_features(self) -> int | None:
        """Width of the stream's batches (``None`` before the stream starts)."""
        return self._n_features

    @property
    def feature_names(self) -> np.ndarray | None:
        """Column names of the stream, when it came as DataFrames with string columns."""
        return self._feature_names

    @property
    def records(self) -> tuple[BatchRecord, ...]:
        """One record per consumed batch, in order (coefficients in float64)."""
        return tuple(self._records)

    @property
    def n_empty(self) -> int:
        """Zero-row chunks skipped."""
        return self._n_empty

    @property
    def recoveries(self) -> tuple[Recovery, ...]:
        """Every time the stream went on after a lost engine or from a checkpoint, in order."""
        return tuple(self._recoveries)

    @property
    def placement(self) -> dict[str, Any] | None:
        """Where the engine of the last batch ran on a cluster (a copy), else ``None``."""
        return None if self._placement is None else dict(self._placement)

    def state(self) -> HuberState:
        """A host copy of the portable state."""
        if self._engine is None:
            return self._pending.copy()
        return self._engine.export_state()

    def coefficients(self) -> np.ndarray:
        """A host copy of β (intercept last), in the stream's dtype."""
        if self._engine is None:
            return self._pending.coefficients.copy()
        return self._engine.coefficients()

    @property
    def n_samples_seen(self) -> int:
        if self._engine is None:
            return self._pending.n_samples_seen
        return self._engine.n_samples_seen

    def live_engine(self, device: Any = None) -> Engine:
        """The stream's engine, started (on ``device``) from a restored state if needed."""
        if self._engine is None:
            engine = make_engine(self._engine_name, self._config, device)
            engine.import_state(self._pending)
            self._engine, self._pending = engine, None
        return self._engine

    # -- advancing ---------------------------------------------------------------------------
    def check_continues(self, config: HuberConfig, engine: str, device: Any) -> None:
        """Refuse to continue the stream with another configuration or engine.

        ``engine`` and ``device`` are the estimator's parameters: an explicitly
        requested engine (not ``"auto"``) is never silently replaced.
        """
        if config != self._config:
            raise ValidationError(
                "the estimator's parameters changed since the stream started; "
                "call reset() or fit() to start a new stream with them"
            )
        if engine != "auto" and resolve_engine_name(engine, device) != self._engine_name:
            raise ValidationError(
                f"engine={engine!r} was requested, but the stream runs on the "
                f"{self._engine_name!r} engine; move it with save() and load(path, engine=...), "
                "or call reset() or fit() to start a new stream"
            )

    def consume(
        self,
        X: Any,
        y: Any,
        sample_weight: Any | None = None,
        *,
        device: Any = None,
        feature_names: np.ndarray | None = None,
        chunk: int = 0,
        wait_seconds: float = 0.0,
        limit: Callable[[], AbstractContextManager[Any]] = nullcontext,
        finite_checked: bool = True,
    ) -> BatchRecord:
        """Advance the stream by one validated batch, or change nothing at all.

        The first batch of an unstarted stream also fixes its width and
        ``feature_names``. When creating the engine or the batch fails, the
        stream (and the engine it may have taken) is as it was. ``limit`` is a
        context factory entered around the engine call (a BLAS thread limit).
        ``finite_checked=False``: X and y were validated without their NaN
        and infinity scan, which runs here unless the engine is the GPU
        engine (it refuses such values on the device). Returns the batch's
        record.
        """
        engine, undo = self._engine_for_batch(device)
        start = time.perf_counter()
        try:
            if not finite_checked and engine.name != "gpu":
                check_finite_batch(X, y)
            with limit():
                diagnostics = engine.partial_fit(X, y, sample_weight)
        except BaseException:
            undo()
            raise
        seconds = time.perf_counter() - start
        if not self.started:
            self._start(int(X.shape[1]), feature_names)
        self._engine, self._pending = engine, None
        # The batch ran on this process's engine, not on a cluster worker.
        self._placement = None
        record = BatchRecord(
            batch=engine.batch_count - 1,
            chunk=chunk,
            rows=int(X.shape[0]),
            diagnostics=diagnostics,
            seconds=seconds,
            coefficients=_float64_copy(engine.coefficients()),
            wait_seconds=wait_seconds,
        )
        self._records.append(record)
        return record

    def adopt(
        self,
        state: HuberState,
        records: Sequence[BatchRecord],
        *,
        feature_names: np.ndarray | None = None,
        placement: dict[str, Any] | None = None,
        choice: Any = None,
    ) -> None:
        """Take over the state a remote engine reached (see :mod:`rh_dask.distributed`).

        ``records`` are those of the batches that led there from this
        stream's state, in order; ``placement`` is where that engine ran. An
        unstarted stream starts with ``state``'s width and ``feature_names``,
        and, with ``choice`` (what ``engine="auto"`` chose where the engine
        ran), on ``choice.engine``. Without records nothing changes.
        """
        if not records:
            return
        if choice is not None and not self.started:
            self.choose(choice)
        engine = self._engine
        if (
            engine is not None
            and engine.config == self._config
            and engine.name == self._engine_name
        ):
            engine.import_state(state)  # keeps the local engine's workspaces; atomic
            self._pending = None
        else:
            self._engine, self._pending = None, state
        if not self.started:
            self._start(state.n_features_in, feature_names)
        self._records.extend(
            replace(r, coefficients=_float64_copy(r.coefficients)) for r in records
        )
        self._placement = None if placement is None else dict(placement)

    def choose(self, choice: Any) -> None:
        """Give an unstarted stream the engine ``engine="auto"`` chose for it.

        ``choice`` is an :class:`~rh_dask.engines.auto.AutoChoice`; the
        stream's first batch then starts ``choice.engine`` (a measured GPU
        choice that cannot start falls back to NumPy, see
        :func:`~rh_dask.engines.auto.start_chosen`).

        Raises
        ------
        ValidationError
            When the stream has started: its engine is fixed for its life.
        """
        if self.started:
            raise ValidationError(
                f"the stream runs on the {self._engine_name!r} engine since its first batch; "
                "engine='auto' decides only for a stream's first batch"
            )
        self._engine_name = choice.engine
        self.auto_choice = choice

    def count_empty(self, count: int) -> None:
        """Add ``count`` skipped zero-row chunks."""
        self._n_empty += int(count)

    def add_recoveries(self, recoveries: Sequence[Recovery]) -> None:
        """Record recoveries of a walk whose state the stream has taken."""
        self._recoveries.extend(recoveries)

    # -- internals ---------------------------------------------------------------------------
    def _start(self, n_features: int, feature_names: np.ndarray | None) -> None:
        self._n_features = int(n_features)
        self._feature_names = feature_names

    def _engine_for_batch(self, device: Any) -> tuple[Engine, Callable[[], None]]:
        """The engine the next batch goes to, and how to undo taking it.

        A started stream continues on its engine (a restored one gets a new
        engine, kept only once it has consumed the batch). An unstarted one
        takes its spare engine when configuration and name fit, at the empty
        state, keeping the stream that engine held aside for the undo;
        otherwise it makes a new engine.
        """
        if self.started:
            if self._engine is not None:
                return self._engine, _nothing
            engine = make_engine(self._engine_name, self._config, device)
            engine.import_state(self._pending)
            return engine, _nothing
        engine = self._engine
        if engine is None or engine.config != self._config or engine.name != self._engine_name:
            return self._first_engine(device), _nothing
        held = engine.export_state() if engine.n_features_in is not None else None
        engine.reset()

        def undo() -> None:
            if held is None:
                engine.reset()
            else:
                engine.import_state(held)

        return engine, undo

    def _first_engine(self, device: Any) -> Engine:
        """A new engine for the first batch; a measured auto choice falls back to NumPy.

        Only a GPU engine chosen by ``engine="auto"``'s calibration falls back
        when it fails to start: the stream runs on the NumPy engine, says so
        in a :class:`RuntimeWarning` and in ``auto_choice.fallback``. An
        engine named by the user, or chosen by a rule (a CUDA device named,
        a batch on the device), raises.
        """
        try:
            return make_engine(self._engine_name, self._config, device)
        except Exception as exc:
            choice = self.auto_choice
            if choice is None or self._engine_name != "gpu" or not choice.measured:
                raise
            why = f"{type(exc).__name__}: {exc}"
        self.auto_choice = replace(choice, engine="numpy", fallback=why)
        warn_fallback(self.auto_choice, stacklevel=5)
        engine = make_engine("numpy", self._config, None)
        self._engine_name = "numpy"
        return engine

    def __getstate__(self) -> dict[str, Any]:
        # Pickle the portable state, never a (possibly device-resident) engine.
        data = dict(self.__dict__)
        if self._engine is not None and self.started:
            data["_pending"] = self._engine.export_state()
        data["_engine"] = None
        return data
