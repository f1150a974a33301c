"""``stream_fit``: what ``partial_fit`` (and so ``fit``) does with Dask collections.

It checks the collection against the model's :class:`~rh_dask.stream.Stream`,
then walks the chunks in order into that stream, either on the user's
``distributed`` cluster (an engine actor fed by look-ahead loads,
:mod:`.coordinator`, whose final state and records the stream adopts) or,
without a client, in this process with the stream's own engine
(:mod:`.local`). Both give the state a loop of ``partial_fit`` over the same
chunks would give. Nothing here knows the estimator: it hands over the
stream, the validated walk parameters (:class:`WalkOptions`) and the device.

With a ``checkpoint_dir``, both walks write stream checkpoints there
(:class:`CheckpointWriter`): the state after a chunk, the records that led
to it, the next chunk and the input's fingerprint, so that a walk stopped
in any way (a lost client, Ctrl-C) goes on from there with ``resume``
(:class:`ResumePoint`).

With ``auto`` (the estimator's ``engine="auto"``) an unstarted stream's
engine is decided at its first chunk, by the policy of in-memory fits
(:func:`~rh_dask.engines.auto.choose_engine`): in this process for the
local walk, on the engine's worker for the cluster walk, whose choice comes
back with the state and is recorded in every stream checkpoint, so that a
resumed walk goes on with the engine the stream started with.
"""

from __future__ import annotations

import math
import os
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import dask.array as da
import dask.dataframe as dd
import numpy as np

from ..exceptions import ValidationError
from ..settings import Settings
from ..state import HuberState
from ..stream import BatchRecord, Recovery, Stream, warn_fallback
from ..validation import (
    check_feature_names,
    check_lookahead,
    check_n_features,
    ravel_column_vector,
    warn_column_vector,
)
from .chunks import AlignedStream, ChunkGraph, align_stream
from .consumer import STREAM_BLAS_THREADS, blas_limiter
from .coordinator import LOADERS, ClusterOutcome, ClusterWalk, WalkCheckpoint
from .interrupts import interrupts_deferred
from .items import BadChunk, ChunkItem, EmptyChunk, chunk_error
from .loading import assemble_chunk
from .local import run_local
from .placement import resolve_lookahead
from .progress import StreamProgress, progress_enabled


@dataclass(frozen=True)
class WalkOptions:
    """How a Dask collection is walked: the estimator's walk parameters, validated.

    Attributes
    ----------
    lookahead : int or "auto"
        Chunks loading ahead of the engine (``"auto"``:
        :func:`~.placement.auto_lookahead`, decided where the walk knows its
        loader).
    loader : str
        One of :data:`~.coordinator.LOADERS`.
    worker : str or None
        Address of the worker for the engine actor (``None``: chosen).
    progress : bool
        Whether a progress bar is shown.
    checkpoint_every : int or None
        Chunks between stream checkpoints (``None``: the
        ``rh-dask.checkpoint.every-chunks`` setting).
    checkpoint_dir : str or None
        Where stream checkpoints are written (a path or an fsspec URL), if anywhere.
    max_retries : int or None
        Recoveries from a lost engine worker (``None``: the
        ``rh-dask.recovery.max-retries`` setting).
    """

    lookahead: int | str
    loader: str
    worker: str | None
    progress: bool
    checkpoint_every: int | None = None
    checkpoint_dir: str | None = None
    max_retries: int | None = None

    @classmethod
    def from_params(
        cls,
        lookahead: Any = "auto",
        loader: Any = "auto",
        worker: Any = None,
        progress: Any = None,
        checkpoint_every: Any = None,
        checkpoint_dir: Any = None,
        max_retries: Any = None,
    ) -> WalkOptions:
        """Check the estimator's parameters; raise :class:`ValidationError` naming the bad one.

        ``progress=None`` shows the bar when stderr is a terminal.
        """
        lookahead = check_lookahead(lookahead)
        if loader not in LOADERS:
            raise ValidationError(f"loader must be one of {LOADERS}, got {loader!r}")
        if worker is not None and not isinstance(worker, str):
            raise ValidationError(f"worker must be a worker address (str), got {worker!r}")
        if checkpoint_every is not None and not _whole(checkpoint_every, 1):
            raise ValidationError(
                f"checkpoint_every must be an integer >= 1 or None, got {checkpoint_every!r}"
            )
        if max_retries is not None and not _whole(max_retries, 0):
            raise ValidationError(
                f"max_retries must be an integer >= 0 or None, got {max_retries!r}"
            )
        if checkpoint_dir is not None:
            if not isinstance(checkpoint_dir, (str, os.PathLike)) or not os.fspath(checkpoint_dir):
                raise ValidationError(
                    "checkpoint_dir must be a directory path or an fsspec URL, "
                    f"got {checkpoint_dir!r}"
                )
            checkpoint_dir = os.fspath(checkpoint_dir)
        return cls(
            lookahead,
            loader,
            worker,
            progress_enabled(progress),
            None if checkpoint_every is None else int(checkpoint_every),
            checkpoint_dir,
            None if max_retries is None else int(max_retries),
        )


def local_lookahead(lookahead: int | str) -> int:
    """The look-ahead of a walk in this process (no cluster): ``"auto"`` is the base one."""
    return resolve_lookahead(lookahead, "local", [], Settings.read("lookahead_max"))


def _whole(value: Any, least: int) -> bool:
    """Whether ``value`` is an integer (not a bool) >= ``least``."""
    return (
        isinstance(value, (int, np.integer))
        and not isinstance(value, (bool, np.bool_))
        and value >= least
    )


@dataclass(frozen=True)
class ResumePoint:
    """Where a walk goes on from: a stream checkpoint's position and input fingerprint.

    Attributes
    ----------
    next_chunk : int
    fingerprint : dict
        :func:`~.fingerprint.fingerprint` of the input the checkpoint was written for.
    source : str
        Where the checkpoint was read, for messages.
    """

    next_chunk: int
    fingerprint: dict[str, Any]
    source: str


class CheckpointWriter:
    """Writes a walk's stream checkpoints to a :class:`~rh_dask.checkpoint_store.CheckpointStore`.

    Parameters
    ----------
    store : CheckpointStore or None
        ``None``: nothing is written (the cluster walk still keeps its
        checkpoints in memory for recovery).
    stream : Stream
        The stream being walked, before the walk: its records, skipped chunks
        and recoveries come first in every checkpoint.
    fingerprint : dict or None
    n_chunks : int
    feature_names : ndarray or None
        The walk's feature names (those of an unstarted stream are set by it).
    every_chunks, every_seconds
        When the local walk writes (the cluster walk writes every checkpoint
        its engine sends).
    """

    def __init__(
        self,
        store: Any,
        stream: Stream,
        fingerprint: dict[str, Any] | None,
        n_chunks: int,
        feature_names: np.ndarray | None,
        every_chunks: int,
        every_seconds: float,
    ) -> None:
        self.store = store
        self._stream = stream
        self._records = stream.records
        self._n_empty = stream.n_empty
        self._recoveries = stream.recoveries
        self._fingerprint = fingerprint
        self._n_chunks = n_chunks
        self._names = stream.feature_names if stream.started else feature_names
        self.every_chunks = every_chunks
        self.every_seconds = every_seconds
        self.written = -1  # next_chunk of the last checkpoint written
        self._written_recoveries = 0  # recoveries it holds
        self._last_time = time.monotonic()
        self._last_chunk = -1

    def due(self, next_chunk: int) -> bool:
        """Whether the local walk should write at ``next_chunk`` (chunks or time)."""
        if self.store is None:
            return False
        if self._last_chunk < 0:
            self._last_chunk = next_chunk - 1
        if next_chunk - self._last_chunk >= self.every_chunks:
            return True
        return bool(self.every_seconds) and (
            time.monotonic() - self._last_time >= self.every_seconds
        )

    def write(
        self,
        next_chunk: int,
        n_empty: int,
        state: HuberState,
        records: Sequence[BatchRecord],
        recoveries: Sequence[Recovery] = (),
        engine: str | None = None,
    ) -> None:
        """Write the checkpoint at ``next_chunk``; a failed write warns and keeps the last one.

        ``n_empty``, ``records`` and ``recoveries`` are the walk's own: the
        stream's from before the walk are added here. ``engine`` is the
        engine that reached ``state`` (default: the stream's), for a stream
        whose engine ``engine="auto"`` chose on the cluster.
        """
        self._last_chunk = next_chunk
        self._last_time = time.monotonic()
        known = len(self._recoveries) + len(recoveries)
        stale = next_chunk <= self.written and known <= self._written_recoveries
        if self.store is None or stale:
            return
        from ..checkpoint import Checkpoint, WalkPosition

        checkpoint = Checkpoint(
            config=self._stream.config,
            state=state,
            feature_names=self._names,
            engine=engine or self._stream.engine_name,
            walk=WalkPosition(
                next_chunk=next_chunk,
                n_chunks=self._n_chunks,
                n_empty=self._n_empty + n_empty,
                fingerprint=self._fingerprint or {},
            ),
            records=(*self._records, *records),
            recoveries=(*self._recoveries, *recoveries),
        )
        try:
            self.store.write(checkpoint)
        except ValidationError:  # records the format refuses: a bug, never hidden
            raise
        except Exception as exc:  # a full disk, a lost mount: the walk goes on
            warnings.warn(
                f"stream checkpoint at chunk {next_chunk} not written to {self.store.path} "
                f"({type(exc).__name__}: {exc}); the last one written stays",
                RuntimeWarning,
                stacklevel=2,
            )
            return
        self.written = next_chunk
        self._written_recoveries = known


def current_client() -> Any | None:
    """The ``distributed`` client in charge, or ``None`` (then the walk is local)."""
    try:
        from distributed import default_client
    except ImportError:  # pragma: no cover - distributed is a dependency
        return None
    try:
        return default_client()
    except ValueError:
        return None


def _check_row_chunks(stream: AlignedStream) -> None:
    """Refuse ``y`` or weights whose known row chunks differ from ``X``'s.

    :func:`~.chunks.align_stream` rechunks a vector of X's length to X's
    rows; a vector left with other known chunk lengths (e.g. one row short)
    would only fail at its first mismatching chunk, after earlier chunks
    were fitted, so it is refused here, before anything is consumed.
    """
    X = stream.parts[0]
    if not isinstance(X, da.Array) or not _known(X.chunks[0]):
        return
    rows = tuple(X.chunks[0])
    for role, part in zip(stream.roles[1:], stream.parts[1:], strict=True):
        if not isinstance(part, da.Array) or not _known(part.chunks[0]):
            continue
        if tuple(part.chunks[0]) != rows:
            name = "y" if role == "y" else "sample_weight"
            raise ValidationError(
                f"{name} has {int(sum(part.chunks[0]))} rows in chunks {part.chunks[0]}, but "
                f"X has {int(sum(rows))} rows in chunks {rows}: they must be aligned chunk "
                "by chunk"
            )


def _known(chunks: tuple[float, ...]) -> bool:
    return not any(math.isnan(c) for c in chunks)


def column_vector_target(y: Any) -> Any:
    """``y`` of shape (n, 1) (a Dask array, a one-column DataFrame, in memory) as 1-D.

    Raveled lazily, with scikit-learn's
    :class:`~sklearn.exceptions.DataConversionWarning`, as its estimators and
    the in-memory path do; anything else is returned as it is (and refused
    later when it is not a vector).
    """
    if isinstance(y, da.Array):
        if y.ndim == 2 and y.shape[1] == 1:
            warn_column_vector("y")
            return y[:, 0]
        return y
    if isinstance(y, dd.DataFrame):
        if len(y.columns) == 1:
            warn_column_vector("y")
            return y[y.columns[0]]
        return y
    if isinstance(y, dd.Series):
        return y
    return ravel_column_vector(y)


def stream_fit(
    stream: Stream,
    X: Any,
    y: Any,
    sample_weight: Any | None,
    options: WalkOptions,
    *,
    device: Any = None,
    owner: str = "RenewableHuberRegressor",
    resume: ResumePoint | None = None,
    auto: bool = False,
) -> int:
    """Walk every chunk of ``X`` (Dask array or DataFrame), in order, into ``stream``.

    Parameters
    ----------
    stream : Stream
        The stream to continue, or an unstarted one (``fit``, or a first
        ``partial_fit``) that the first consumed batch starts.
    X : dask.array.Array or dask.dataframe.DataFrame
        Row chunks / partitions are the batches, in index order.
    y : Dask array or Series, in-memory vector cut at X's chunks, or a column name of X
    sample_weight : like ``y``, or None
    options : WalkOptions
    device : Any, optional
        Device argument of an engine started for the stream.
    owner : str, optional
        The estimator's name, for error messages.
    resume : ResumePoint, optional
        Go on from a stream checkpoint: ``stream`` holds its state, and the
        walk starts at its next chunk once the input's fingerprint is the
        checkpoint's.
    auto : bool, optional
        ``engine="auto"``: an unstarted stream's engine is chosen at its first
        chunk (see the module's description); a started one keeps its engine.

    Returns
    -------
    int
        The number of batches consumed.

    Raises
    ------
    ValidationError
        When the inputs do not fit together or the stream, or every chunk of
        an unstarted stream is empty (the stream unchanged).
    CheckpointError
        When ``resume`` was written for another input (the stream unchanged).
    StreamError
        When a chunk fails mid-stream (``chunk_index`` says which); the stream
        then holds the state after the last good chunk and can continue (an
        unstarted stream whose first chunk fails stays unstarted).
        :class:`~rh_dask.exceptions.BadChunkError`, a ``ValidationError`` too,
        when the chunk's data was refused;
        :class:`~rh_dask.exceptions.ActorLostError` when the engine's worker
        died more often than ``max_retries`` allows, or no worker could take
        over (the stream then holds the last stream checkpoint's state, and
        ``chunk_index`` is the chunk after it).
    """
    # Every up-front check runs before the stream changes in any way.
    continuing = stream.started
    aligned = align_stream(X, column_vector_target(y), sample_weight)
    _check_row_chunks(aligned)
    if continuing:
        check_n_features(aligned.n_features, stream.n_features, owner)
        # Called from here, so that a warning's stacklevel reaches the estimator's method.
        check_feature_names(_names(aligned), stream.feature_names, fitted=True, owner=owner)
    found = None
    if resume is not None or options.checkpoint_dir is not None:
        from .fingerprint import check_fingerprint, fingerprint

        found = fingerprint(aligned)
    start = 0
    if resume is not None:
        check_fingerprint(resume.fingerprint, found, resume.source)
        start = resume.next_chunk
    writer = _writer(stream, aligned, options, found)
    client = current_client()
    with StreamProgress(aligned.n_chunks, options.progress, start) as bar:
        choose = auto and not continuing
        if client is None:
            n_batches = _fit_local(stream, aligned, device, options, bar, start, writer, choose)
        else:
            n_batches = _fit_cluster(
                stream, client, aligned, device, options, bar, start, writer, choose
            )
    if n_batches == 0 and not continuing:
        raise ValidationError(
            f"every one of the {aligned.n_chunks} chunks is empty: there is nothing to fit"
        )
    return n_batches


def check_resume(X: Any, y: Any, sample_weight: Any | None, resume: ResumePoint) -> None:
    """Refuse, with :class:`~rh_dask.exceptions.CheckpointError`, a checkpoint of another input."""
    from .fingerprint import check_fingerprint, fingerprint

    aligned = align_stream(X, column_vector_target(y), sample_weight)
    check_fingerprint(resume.fingerprint, fingerprint(aligned), resume.source)


def _writer(
    stream: Stream,
    aligned: AlignedStream,
    options: WalkOptions,
    found: dict[str, Any] | None,
) -> CheckpointWriter:
    settings = Settings.from_config()
    store = None
    if options.checkpoint_dir is not None:
        from ..checkpoint_store import CheckpointStore

        store = CheckpointStore(options.checkpoint_dir)
    every = options.checkpoint_every or settings.checkpoint_every_chunks
    return CheckpointWriter(
        store,
        stream,
        found,
        aligned.n_chunks,
        _names(aligned),
        every,
        settings.checkpoint_every_seconds,
    )


def _names(aligned: AlignedStream) -> np.ndarray | None:
    return None if aligned.feature_names is None else np.asarray(aligned.feature_names, object)


def _fit_local(
    stream: Stream,
    aligned: AlignedStream,
    device: Any,
    options: WalkOptions,
    bar: StreamProgress,
    start: int,
    writer: CheckpointWriter,
    choose: bool = False,
) -> int:
    """The single-process walk: the stream's own engine, chunks computed here.

    With ``choose``, ``engine="auto"`` decides the unstarted stream's engine
    at the first chunk with rows, under the walk's BLAS limit.

    Returns the number of batches consumed. Empty chunks are counted into the
    stream only with a consumed batch, or at the end of a clean walk that
    continued it: a call that consumed nothing and raised changes nothing.
    With a checkpoint directory, a stream checkpoint is written when one is
    due and when the walk stops, however it stops.
    """
    accept_device = stream.engine_name == "gpu" or choose
    dtype = stream.config.dtype

    def spec(i: int) -> Any:
        found = aligned.spec(i, dtype, accept_device)
        # Undecided, the NumPy engine may take the chunk: host chunks are checked here.
        return replace(found, check_finite=True) if choose else found

    graph = ChunkGraph(aligned, assemble_chunk, spec, start=start)
    counts = {"batches": 0, "empty": 0, "next": start}
    names = _names(aligned)
    limit = blas_limiter(STREAM_BLAS_THREADS)
    continuing = stream.started
    n_prior = len(stream.records)

    def checkpoint() -> None:
        if stream.started and writer.store is not None:
            records = stream.records[n_prior:]
            writer.write(counts["next"], counts["empty"], stream.state(), records)

    def consume(item: ChunkItem, waited: float) -> None:
        # The chunk and the position after it go in together (see .interrupts).
        with interrupts_deferred():
            consume_one(item, waited)
            counts["next"] = item.index + 1
        if writer.due(counts["next"]):
            checkpoint()

    def consume_one(item: ChunkItem, waited: float) -> None:
        if isinstance(item, EmptyChunk):
            counts["empty"] += 1
            bar.update(1, 0)
            return
        if isinstance(item, BadChunk):
            raise item.exception()
        if choose and not stream.started:
            _choose_local(stream, item, device, limit)
        try:
            stream.consume(
                item.X,
                item.y,
                item.sample_weight,
                device=device,
                feature_names=names,
                chunk=item.index,
                wait_seconds=waited,
                limit=limit,
            )
        except ValidationError as exc:
            message = f"chunk {item.index} was refused: {type(exc).__name__}: {exc}"
            raise chunk_error(item.index, exc, message) from exc
        counts["batches"] += 1
        bar.update(1, item.rows)

    try:
        run_local(graph, local_lookahead(options.lookahead), consume)
    except BaseException:
        checkpoint()
        if counts["batches"] and counts["empty"]:
            stream.count_empty(counts["empty"])
        raise
    checkpoint()
    if counts["empty"] and (counts["batches"] or continuing):
        stream.count_empty(counts["empty"])
    return counts["batches"]


def _choose_local(stream: Stream, item: ChunkItem, device: Any, limit: Any) -> None:
    """``engine="auto"`` for the local walk's first batch, as the actor decides it."""
    from ..engines.auto import choose_engine
    from ..validation import is_device_array

    rows, features = (int(n) for n in item.X.shape)
    with limit():
        choice = choose_engine(
            stream.config, rows, features, device=device, device_input=is_device_array(item.X)
        )
    stream.choose(choice)


def _fit_cluster(
    stream: Stream,
    client: Any,
    aligned: AlignedStream,
    device: Any,
    options: WalkOptions,
    bar: StreamProgress,
    start: int,
    writer: CheckpointWriter,
    choose: bool = False,
) -> int:
    """The distributed walk; the stream adopts the remote state even when the walk failed.

    With ``choose``, the actor decides ``engine="auto"`` at the first chunk
    (see :mod:`.actor`); the choice comes back in ``outcome.choice``.

    Returns the number of batches consumed; empty chunks are counted as in
    :func:`_fit_local`. Every stream checkpoint the engine sends is written
    (with a checkpoint directory), and one more at the end when the state
    moved since.
    """
    continuing = stream.started

    def engine_of(outcome: ClusterOutcome) -> str | None:
        return None if outcome.choice is None else outcome.choice.engine

    def on_checkpoint(checkpoint: WalkCheckpoint, outcome: ClusterOutcome) -> None:
        records = outcome.records[: checkpoint.n_records]
        writer.write(
            checkpoint.next_chunk,
            checkpoint.n_empty,
            checkpoint.state,
            records,
            outcome.recoveries,
            engine_of(outcome),
        )

    walk = ClusterWalk(
        client,
        aligned,
        stream.config,
        "auto" if choose else stream.engine_name,
        device,
        stream.state() if continuing else None,
        lookahead=options.lookahead,
        loader=options.loader,
        worker=options.worker,
        blas_threads=STREAM_BLAS_THREADS,
        progress=bar,
        start=start,
        every_chunks=options.checkpoint_every,
        max_retries=options.max_retries,
        on_checkpoint=on_checkpoint,
    )
    try:
        outcome = walk.run()
    finally:
        # An interrupt while the walk winds down still leaves its last state on disk.
        done = walk.outcome
        if done.state is not None and (continuing or done.records):
            writer.write(
                done.next_chunk,
                done.n_empty,
                done.state,
                done.records,
                done.recoveries,
                engine_of(done),
            )
    adopted = outcome.state is not None and bool(outcome.records)
    if adopted:
        stream.adopt(
            outcome.state,
            outcome.records,
            feature_names=_names(aligned),
            placement=outcome.placement,
            choice=outcome.choice,
        )
        stream.add_recoveries(outcome.recoveries)
        if outcome.choice is not None and outcome.choice.fallback is not None:
            warn_fallback(outcome.choice, stacklevel=6)
    if outcome.n_empty and (adopted or (continuing and outcome.error is None)):
        stream.count_empty(outcome.n_empty)
    if outcome.error is not None:
        raise outcome.error
    return len(outcome.records) if adopted else 0
