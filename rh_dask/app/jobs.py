"""The fit job behind ``rh-dask fit`` and ``rh-dask demo``.

One job: take a :class:`~rh_dask.app.io.Table`, fit it with the estimator (on
the active ``distributed`` client, if any) in one call, and keep what a
report needs. The same job continues a stream checkpoint (``--resume``) and
collects a fit detached into the cluster (``rh-dask attach``).

Coefficient trajectories come from the estimator itself: the engine records
β after every batch (in the actor, for a cluster fit) and the model exposes
the rows as ``coef_history_``, aligned with ``history_``. So the trajectory
has one point per consumed batch and costs the fit nothing beyond a copy of
p numbers per batch.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from ..checkpoint import Checkpoint
from ..distributed.chunks import stable_partitions
from ..estimator import RenewableHuberRegressor
from ..exceptions import CheckpointError, EngineUnavailableError
from ..state import HuberState
from .io import Table

__all__ = [
    "FitOutcome",
    "Trajectory",
    "collect_detached",
    "fit_table",
    "peek_checkpoint",
    "recovery_notes",
    "stream_checkpoint",
    "walked_by",
]


@dataclass
class Trajectory:
    """Coefficients along the stream, one point per consumed batch.

    Attributes
    ----------
    after_chunk : ndarray of int
        Chunks of the stream dealt with (empty ones included) at each point:
        the batch's chunk index + 1.
    rows : ndarray of int
        Rows consumed at each point.
    engine_seconds : ndarray of float
        Engine time spent up to and including each batch (the cumulative
        ``seconds`` of ``history_``; loading and transfers not included).
    coefficients : ndarray of shape (n_points, n_params)
        β at each point, the intercept last when the model has one.
    """

    after_chunk: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))
    rows: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))
    engine_seconds: np.ndarray = field(default_factory=lambda: np.empty(0))
    coefficients: np.ndarray = field(default_factory=lambda: np.empty((0, 0)))

    @classmethod
    def from_model(cls, model: RenewableHuberRegressor) -> Trajectory:
        """The trajectory of ``model``'s stream since its last reset."""
        history = model.history_
        return cls(
            after_chunk=history["chunk"].to_numpy(dtype=np.int64) + 1,
            rows=np.cumsum(history["rows"].to_numpy(dtype=np.int64)),
            engine_seconds=np.cumsum(history["seconds"].to_numpy(dtype=np.float64)),
            coefficients=model.coef_history_,
        )


@dataclass
class FitOutcome:
    """A fitted model and the facts about how it got there.

    Attributes
    ----------
    model : RenewableHuberRegressor
    history : pandas.DataFrame
        ``history_`` (``chunk`` is the index in the whole stream: one call).
    trajectory : Trajectory
    seconds : float
        Wall-clock time of the fit.
    engine : str
        The engine that fitted the stream.
    placement : dict or None
        Where the engine ran when the fit ran on a cluster (``placement_``).
    notes : list of str
        Things the user should know (an ``auto`` engine falling back, a
        resume that found no checkpoint, a recovery from a lost worker).
    resumed_from : int or None
        The chunk this call went on from when it continued a stream
        checkpoint; ``None`` for a stream fitted from its first chunk.
    """

    model: RenewableHuberRegressor
    history: pd.DataFrame
    trajectory: Trajectory
    seconds: float
    engine: str
    placement: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)
    resumed_from: int | None = None

    @property
    def rows_this_call(self) -> int:
        """Rows this call consumed (all of them unless it resumed a checkpoint)."""
        return int(_this_call(self.history, self.resumed_from)["rows"].sum())

    @property
    def chunks_this_call(self) -> int:
        """Non-empty chunks this call consumed."""
        return len(_this_call(self.history, self.resumed_from))


def _this_call(history: pd.DataFrame, resumed_from: int | None) -> pd.DataFrame:
    if resumed_from is None or not len(history):
        return history
    return history[history["chunk"] >= resumed_from]


def stream_checkpoint(location: str | os.PathLike[str]) -> Checkpoint | None:
    """The stream checkpoint at ``location`` (a directory or URL), ``None`` when it holds none.

    Raises
    ------
    CheckpointError
        When the checkpoint there is corrupted, truncated or not a stream
        checkpoint (a model saved with ``save``, which holds no position).
    """
    from ..checkpoint_store import CheckpointStore

    store = CheckpointStore(location)
    ckpt = store.read()
    if ckpt is not None and ckpt.walk is None:
        raise CheckpointError(
            f"{store.path} is a saved model, not a stream checkpoint: it holds no position "
            "in a stream to resume from"
        )
    return ckpt


def peek_checkpoint(location: str | os.PathLike[str] | None) -> Checkpoint | None:
    """Like :func:`stream_checkpoint`, but ``None`` for anything that cannot be resumed.

    For messages only (what a stopped fit left behind); a fit that resumes
    reads the checkpoint with :func:`stream_checkpoint`, which refuses a
    damaged one.
    """
    if location is None:
        return None
    try:
        return stream_checkpoint(location)
    except (CheckpointError, OSError, ValueError):
        return None


def walked_by(after: Checkpoint | None, before: Checkpoint | None) -> Checkpoint | None:
    """``after`` when a fit that found ``before`` in its checkpoint directory wrote it.

    A checkpoint equal to the one found before (same position, same state)
    was not written by this fit: ``None``.
    """
    if after is None:
        return None
    if before is not None and after.walk == before.walk and after.state.equals(before.state):
        return None
    return after


def _fraction(ckpt: Checkpoint) -> str:
    return f"{ckpt.walk.next_chunk} of {ckpt.walk.n_chunks} chunks"


def fit_table(
    model: RenewableHuberRegressor,
    table: Table,
    *,
    fallback_engine: str | None = None,
    resume: bool = False,
) -> FitOutcome:
    """Fit ``model`` on ``table`` in one call, recording β after every batch.

    Parameters
    ----------
    model : RenewableHuberRegressor
        Reset first: the fit starts a new stream (or continues the one in
        its ``checkpoint_dir``, with ``resume``).
    table : Table
    fallback_engine : str, optional
        When the requested engine cannot start before any chunk of this
        fit was consumed, refit with this engine (how ``--engine auto``
        backs off from a GPU it cannot use) and say so in ``notes``. A model
        fitted before keeps its old stream when the engine cannot start, so
        "nothing consumed" means the model's state is the one it had before.
    resume : bool
        Continue the stream checkpoint in ``model.checkpoint_dir``
        (``fit(..., resume_from=...)``) when it holds one; when it holds
        none, fit from the first chunk and say so in ``notes``, so that the
        same command serves the first run of a job and its reruns.

    Returns
    -------
    FitOutcome

    Raises
    ------
    CheckpointError
        With ``resume``: the checkpoint is damaged, or was written for
        another input or another configuration (the model is unchanged).
    """
    notes: list[str] = []
    location = model.checkpoint_dir
    options: dict[str, Any] = {}
    resumed_from = None
    if resume:
        if location is None:
            raise ValueError("resume=True needs the model's checkpoint_dir")
        ckpt = stream_checkpoint(location)
        if ckpt is None:
            notes.append(f"no stream checkpoint in {location}: fitted from the first chunk")
        else:
            options["resume_from"] = location
            resumed_from = ckpt.walk.next_chunk
            if ckpt.walk.next_chunk >= ckpt.walk.n_chunks:
                notes.append(
                    f"the checkpoint in {location} is a finished fit ({_fraction(ckpt)}): "
                    "nothing was left to fit"
                )
    elif location is not None:
        found = peek_checkpoint(location)
        if found is not None:
            notes.append(
                f"replaced the stream checkpoint in {location} ({_fraction(found)} of an "
                "earlier fit); --resume continues one instead"
            )
    before = _stream_state(model)
    called = time.time()
    start = time.perf_counter()
    with stable_partitions():
        try:
            model.fit(*table.fit_inputs(), **options)
        except EngineUnavailableError as exc:
            if fallback_engine is None or _consumed_since(model, before):
                raise
            notes.append(f"engine {model.engine!r} unavailable ({exc}); used {fallback_engine!r}")
            model.set_params(engine=fallback_engine)
            start = time.perf_counter()
            model.fit(*table.fit_inputs(), **options)
    seconds = time.perf_counter() - start
    choice = model.engine_choice_
    if choice is not None and choice.fallback is not None:
        notes.append(
            f"engine 'auto' chose the GPU engine, which could not start ({choice.fallback}); "
            "used 'numpy'"
        )
    elif choice is not None:
        notes.append(f"engine 'auto' chose {choice.engine!r}: {choice.reason}")
    notes += recovery_notes(model, since=called)
    return FitOutcome(
        model=model,
        history=model.history_,
        trajectory=Trajectory.from_model(model),
        seconds=seconds,
        engine=model.engine_,
        placement=model.placement_,
        notes=notes,
        resumed_from=resumed_from,
    )


def recovery_notes(
    model: RenewableHuberRegressor, *, since: float | None = None, resumes: bool = False
) -> list[str]:
    """A line for each time the model's stream went on after losing its engine's worker.

    Parameters
    ----------
    model : RenewableHuberRegressor
    since : float, optional
        Only recoveries from this time on (POSIX seconds): those of one call,
        not those a resumed checkpoint brought along.
    resumes : bool
        Also a line for each time the stream was resumed from a checkpoint.
    """
    frame = getattr(model, "recoveries_", None)
    if frame is None or not len(frame):
        return []
    lines = []
    for row in frame.itertuples(index=False):
        if since is not None and row.time.timestamp() < since:
            continue
        if row.kind == "resume" and resumes:
            lines.append(f"resumed from a stream checkpoint at chunk {int(row.from_chunk)}")
        if row.kind != "worker-lost":
            continue
        replayed = int(row.chunks_replayed)
        lines.append(
            f"the engine's worker {row.lost_worker} was lost; the fit went on from chunk "
            f"{int(row.from_chunk)} on {row.new_worker} ({replayed} chunk"
            f"{'' if replayed == 1 else 's'} replayed; loss noticed in "
            f"{row.detect_seconds:.2f} s, recovered in {row.recover_seconds:.2f} s)"
        )
    return lines


def collect_detached(detached: Any, *, progress: bool) -> FitOutcome:
    """Wait for a detached fit (:class:`rh_dask.distributed.DetachedFit`) and take its model.

    Parameters
    ----------
    detached : DetachedFit
    progress : bool
        Draw a progress bar while waiting.

    Returns
    -------
    FitOutcome
        ``seconds`` is the walk's own time, measured in the cluster: the
        engine's time plus its waits for chunks (``history_``), since no
        process outside the cluster saw the whole fit. The rows and chunks
        are the whole stream's, a part fitted before a resume included.

    Raises
    ------
    Exception
        The fit's own error, as it was raised in the cluster.
    """
    detached.wait(progress=progress)
    model = detached.result()
    history = model.history_
    seconds = float(history["seconds"].sum() + history["wait_seconds"].sum())
    return FitOutcome(
        model=model,
        history=history,
        trajectory=Trajectory.from_model(model),
        seconds=seconds,
        engine=model.engine_,
        placement=model.placement_,
        notes=recovery_notes(model, resumes=True),
    )


def _stream_state(model: RenewableHuberRegressor) -> HuberState | None:
    """The state of the model's stream, ``None`` for a model not fitted."""
    return model.state_ if model.__sklearn_is_fitted__() else None


def _consumed_since(model: RenewableHuberRegressor, before: HuberState | None) -> bool:
    """Whether the model consumed a batch since its stream state was ``before``."""
    after = _stream_state(model)
    if after is None:
        return False
    return before is None or not after.equals(before)
