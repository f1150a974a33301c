"""``stream_fit``: what ``partial_fit`` (and so ``fit``) does with Dask collections.

It checks the collection against the model's :class:`~rh_dask.stream.Stream`,
then walks the chunks in order into that stream, either on the user's
``distributed`` cluster (an engine actor fed by look-ahead loads,
:mod:`.coordinator`, whose final state and records the stream adopts) or,
without a client, in this process with the stream's own engine
(:mod:`.local`). Both give the state a loop of ``partial_fit`` over the same
chunks would give. Nothing here knows the estimator: it hands over the
stream, the validated walk parameters (:class:`WalkOptions`) and the device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import dask.array as da
import dask.dataframe as dd
import numpy as np

from ..exceptions import ValidationError
from ..stream import Stream
from ..validation import (
    check_feature_names,
    check_n_features,
    ravel_column_vector,
    warn_column_vector,
)
from .chunks import AlignedStream, ChunkGraph, align_stream
from .consumer import STREAM_BLAS_THREADS, blas_limiter
from .coordinator import LOADERS, ClusterWalk
from .items import BadChunk, ChunkItem, EmptyChunk, chunk_error
from .loading import assemble_chunk
from .local import run_local
from .progress import StreamProgress, progress_enabled


@dataclass(frozen=True)
class WalkOptions:
    """How a Dask collection is walked: the estimator's walk parameters, validated.

    Attributes
    ----------
    lookahead : int
        Chunks loading ahead of the engine.
    loader : str
        One of :data:`~.coordinator.LOADERS`.
    worker : str or None
        Address of the worker for the engine actor (``None``: chosen).
    progress : bool
        Whether a progress bar is shown.
    """

    lookahead: int
    loader: str
    worker: str | None
    progress: bool

    @classmethod
    def from_params(
        cls, lookahead: Any = 8, loader: Any = "auto", worker: Any = None, progress: Any = None
    ) -> WalkOptions:
        """Check the estimator's parameters; raise :class:`ValidationError` naming the bad one.

        ``progress=None`` shows the bar when stderr is a terminal.
        """
        if (
            isinstance(lookahead, (bool, np.bool_))
            or not isinstance(lookahead, (int, np.integer))
            or lookahead < 1
        ):
            raise ValidationError(f"lookahead must be an integer >= 1, got {lookahead!r}")
        if loader not in LOADERS:
            raise ValidationError(f"loader must be one of {LOADERS}, got {loader!r}")
        if worker is not None and not isinstance(worker, str):
            raise ValidationError(f"worker must be a worker address (str), got {worker!r}")
        return cls(int(lookahead), loader, worker, progress_enabled(progress))


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

    Returns
    -------
    int
        The number of batches consumed.

    Raises
    ------
    ValidationError
        When the inputs do not fit together or the stream, or every chunk of
        an unstarted stream is empty (the stream unchanged).
    StreamError
        When a chunk fails mid-stream (``chunk_index`` says which); the stream
        then holds the state after the last good chunk and can continue (an
        unstarted stream whose first chunk fails stays unstarted).
        :class:`~rh_dask.exceptions.BadChunkError`, a ``ValidationError`` too,
        when the chunk's data was refused;
        :class:`~rh_dask.exceptions.ActorLostError` when the engine's worker
        died (the stream keeps its state from before the call).
    """
    # Every up-front check runs before the stream changes in any way.
    continuing = stream.started
    aligned = align_stream(X, column_vector_target(y), sample_weight)
    _check_row_chunks(aligned)
    if continuing:
        check_n_features(aligned.n_features, stream.n_features, owner)
        # Called from here, so that a warning's stacklevel reaches the estimator's method.
        check_feature_names(_names(aligned), stream.feature_names, fitted=True, owner=owner)
    client = current_client()
    with StreamProgress(aligned.n_chunks, options.progress) as bar:
        if client is None:
            n_batches = _fit_local(stream, aligned, device, options, bar)
        else:
            n_batches = _fit_cluster(stream, client, aligned, device, options, bar)
    if n_batches == 0 and not continuing:
        raise ValidationError(
            f"every one of the {aligned.n_chunks} chunks is empty: there is nothing to fit"
        )
    return n_batches


def _names(aligned: AlignedStream) -> np.ndarray | None:
    return None if aligned.feature_names is None else np.asarray(aligned.feature_names, object)


def _fit_local(
    stream: Stream,
    aligned: AlignedStream,
    device: Any,
    options: WalkOptions,
    bar: StreamProgress,
) -> int:
    """The single-process walk: the stream's own engine, chunks computed here.

    Returns the number of batches consumed. Empty chunks are counted into the
    stream only with a consumed batch, or at the end of a clean walk that
    continued it: a call that consumed nothing and raised changes nothing.
    """
    accept_device = stream.engine_name == "gpu"
    dtype = stream.config.dtype
    graph = ChunkGraph(aligned, assemble_chunk, lambda i: aligned.spec(i, dtype, accept_device))
    counts = {"batches": 0, "empty": 0}
    names = _names(aligned)
    limit = blas_limiter(STREAM_BLAS_THREADS)
    continuing = stream.started

    def consume(item: ChunkItem, waited: float) -> None:
        if isinstance(item, EmptyChunk):
            counts["empty"] += 1
            bar.update(1, 0)
            return
        if isinstance(item, BadChunk):
            raise item.exception()
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
        run_local(graph, options.lookahead, consume)
    except BaseException:
        if counts["batches"] and counts["empty"]:
            stream.count_empty(counts["empty"])
        raise
    if counts["empty"] and (counts["batches"] or continuing):
        stream.count_empty(counts["empty"])
    return counts["batches"]


def _fit_cluster(
    stream: Stream,
    client: Any,
    aligned: AlignedStream,
    device: Any,
    options: WalkOptions,
    bar: StreamProgress,
) -> int:
    """The distributed walk; the stream adopts the remote state even when the walk failed.

    Returns the number of batches consumed; empty chunks are counted as in
    :func:`_fit_local`.
    """
    continuing = stream.started
    walk = ClusterWalk(
        client,
        aligned,
        stream.config,
        stream.engine_name,
        device,
        stream.state() if continuing else None,
        lookahead=options.lookahead,
        loader=options.loader,
        worker=options.worker,
        blas_threads=STREAM_BLAS_THREADS,
        progress=bar,
    )
    outcome = walk.run()
    adopted = outcome.state is not None and bool(outcome.records)
    if adopted:
        stream.adopt(
            outcome.state,
            outcome.records,
            feature_names=_names(aligned),
            placement=outcome.placement,
        )
    if outcome.n_empty and (adopted or (continuing and outcome.error is None)):
        stream.count_empty(outcome.n_empty)
    if outcome.error is not None:
        raise outcome.error
    return len(outcome.records) if adopted else 0
