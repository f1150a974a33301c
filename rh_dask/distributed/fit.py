"""``stream_fit``: what ``partial_fit`` (and so ``fit``) does with Dask collections.

It checks the stream against the model, then walks the chunks in order,
either on the user's ``distributed`` cluster (an engine actor fed by
look-ahead loads, :mod:`.coordinator`) or, without a client, in this process
with the model's own engine (:mod:`.local`). Both give the state a loop of
``partial_fit`` over the same chunks would give.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import dask.array as da
import dask.dataframe as dd
import numpy as np

from ..engines import resolve_engine_name
from ..exceptions import ValidationError
from ..state import BatchDiagnostics
from ..validation import check_feature_names, ravel_column_vector, warn_column_vector
from .chunks import AlignedStream, ChunkGraph, align_stream
from .consumer import STREAM_BLAS_THREADS, blas_limiter
from .coordinator import LOADERS, ClusterWalk
from .items import BadChunk, ChunkItem, EmptyChunk, chunk_error
from .loading import assemble_chunk
from .local import run_local
from .progress import StreamProgress, progress_enabled

if TYPE_CHECKING:  # pragma: no cover
    from ..estimator import RenewableHuberRegressor


@dataclass(frozen=True)
class StreamOptions:
    """The estimator's distributed-walk parameters, validated."""

    lookahead: int
    loader: str
    worker: str | None
    progress: bool

    @classmethod
    def from_model(cls, model: Any) -> StreamOptions:
        lookahead = getattr(model, "lookahead", 8)
        if (
            isinstance(lookahead, (bool, np.bool_))
            or not isinstance(lookahead, (int, np.integer))
            or lookahead < 1
        ):
            raise ValidationError(f"lookahead must be an integer >= 1, got {lookahead!r}")
        loader = getattr(model, "loader", "auto")
        if loader not in LOADERS:
            raise ValidationError(f"loader must be one of {LOADERS}, got {loader!r}")
        worker = getattr(model, "worker", None)
        if worker is not None and not isinstance(worker, str):
            raise ValidationError(f"worker must be a worker address (str), got {worker!r}")
        return cls(
            int(lookahead), loader, worker, progress_enabled(getattr(model, "progress", None))
        )


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


def _check_against_model(stream: AlignedStream, model: Any, fitted: bool) -> None:
    """Width and feature names of the collection versus the stream so far."""
    owner = type(model).__name__
    if fitted and stream.n_features is not None and stream.n_features != model.n_features_in_:
        raise ValidationError(
            f"X has {stream.n_features} features, but {owner} is expecting "
            f"{model.n_features_in_} features as input."
        )
    names = None if stream.feature_names is None else np.asarray(stream.feature_names, object)
    check_feature_names(
        names, getattr(model, "feature_names_in_", None), fitted=fitted, owner=owner
    )


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
    model: RenewableHuberRegressor,
    X: Any,
    y: Any,
    sample_weight: Any | None = None,
    *,
    fresh: bool = False,
) -> RenewableHuberRegressor:
    """Continue ``model``'s stream over every chunk of ``X`` (Dask array or DataFrame).

    Parameters
    ----------
    model : RenewableHuberRegressor
    X : dask.array.Array or dask.dataframe.DataFrame
        Row chunks / partitions are the batches, in index order.
    y : Dask array or Series, in-memory vector cut at X's chunks, or a column name of X
    sample_weight : like ``y``, or None
    fresh : bool, default=False
        Start a new stream (``fit``) rather than continue the model's. The
        model's current stream is forgotten only once the new one has
        consumed a batch, so every refusal before that leaves it as it was.

    Returns
    -------
    model

    Raises
    ------
    ValidationError
        When the inputs do not fit together or the model, or every chunk is
        empty (nothing consumed, the model unchanged).
    StreamError
        When a chunk fails mid-stream (``chunk_index`` says which); the model
        then holds the state after the last good chunk and ``partial_fit`` can
        continue (a ``fit`` whose first chunk fails leaves the model as it
        was). :class:`~rh_dask.exceptions.BadChunkError`, a ``ValidationError``
        too, when the chunk's data was refused;
        :class:`~rh_dask.distributed.ActorLostError` when the engine's worker
        died (the model keeps its state from before the call).
    """
    # Every up-front check runs before the model changes in any way.
    options = StreamOptions.from_model(model)
    config = model._make_config()
    fitted = not fresh and hasattr(model, "n_features_in_")
    if not fresh:
        model._check_stream_config(config)
    engine = model.engine_ if fitted else resolve_engine_name(model.engine, model.device)
    stream = align_stream(X, column_vector_target(y), sample_weight)
    _check_row_chunks(stream)
    _check_against_model(stream, model, fitted)
    client = current_client()
    with StreamProgress(stream.n_chunks, options.progress) as bar:
        if client is None:
            n_batches = _fit_local(model, stream, config, engine, options, bar, fresh)
        else:
            n_batches = _fit_cluster(model, client, stream, config, engine, options, bar, fresh)
    if n_batches == 0 and not fitted:
        raise ValidationError(
            f"every one of the {stream.n_chunks} chunks is empty: there is nothing to fit"
        )
    return model


def _names(stream: AlignedStream) -> np.ndarray | None:
    return None if stream.feature_names is None else np.asarray(stream.feature_names, object)


def _fit_local(
    model: Any,
    stream: AlignedStream,
    config: Any,
    engine_name: str,
    options: StreamOptions,
    bar: StreamProgress,
    fresh: bool,
) -> int:
    """The single-process walk: the model's own engine, chunks computed here.

    Returns the number of batches consumed. Empty chunks are counted into the
    model only with a consumed batch, or at the end of a clean walk that
    continued a stream: a call that consumed nothing and raised changes
    nothing.
    """
    accept_device = engine_name == "gpu"
    graph = ChunkGraph(
        stream, assemble_chunk, lambda i: stream.spec(i, config.dtype, accept_device)
    )
    counts = {"batches": 0, "empty": 0}
    names = _names(stream)
    limit = blas_limiter(STREAM_BLAS_THREADS)
    continuing = not fresh and hasattr(model, "n_features_in_")

    def consume(item: ChunkItem, waited: float) -> None:
        if isinstance(item, EmptyChunk):
            counts["empty"] += 1
            bar.update(1, 0)
            return
        if isinstance(item, BadChunk):
            raise item.exception()
        try:
            engine, diagnostics, seconds = model._fit_batch(
                item.X,
                item.y,
                item.sample_weight,
                config,
                engine_name,
                fresh=fresh and counts["batches"] == 0,
                limit=limit,
            )
        except ValidationError as exc:
            message = f"chunk {item.index} was refused: {type(exc).__name__}: {exc}"
            raise chunk_error(item.index, exc, message) from exc
        model._record_batch(
            engine,
            config,
            diagnostics,
            item.X.shape[1],
            names,
            rows=item.rows,
            seconds=seconds,
            chunk=item.index,
            wait_seconds=waited,
        )
        counts["batches"] += 1
        bar.update(1, item.rows)

    try:
        run_local(graph, options.lookahead, consume)
    except BaseException:
        if counts["batches"] and counts["empty"]:
            model._count_empty_chunks(counts["empty"])
        raise
    if counts["empty"] and (counts["batches"] or continuing):
        model._count_empty_chunks(counts["empty"])
    return counts["batches"]


def _fit_cluster(
    model: Any,
    client: Any,
    stream: AlignedStream,
    config: Any,
    engine_name: str,
    options: StreamOptions,
    bar: StreamProgress,
    fresh: bool,
) -> int:
    """The distributed walk; adopts the remote state even when the walk failed.

    Returns the number of batches consumed; empty chunks are counted as in
    :func:`_fit_local`.
    """
    continuing = not fresh and hasattr(model, "n_features_in_")
    initial = model.state_ if continuing else None
    walk = ClusterWalk(
        client,
        stream,
        config,
        engine_name,
        model.device,
        initial,
        lookahead=options.lookahead,
        loader=options.loader,
        worker=options.worker,
        blas_threads=STREAM_BLAS_THREADS,
        progress=bar,
    )
    outcome = walk.run()
    records = [
        (
            r.chunk,
            r.rows,
            BatchDiagnostics(r.iterations, r.converged, r.objective, r.lambda_value, r.bandwidth),
            r.seconds,
            r.wait_seconds,
            r.coefficients,
        )
        for r in outcome.records
    ]
    adopted = outcome.state is not None and bool(records)
    if adopted:
        model._adopt_stream(
            config,
            engine_name,
            outcome.state,
            _names(stream),
            records,
            outcome.placement,
            fresh=fresh,
        )
    if outcome.n_empty and (adopted or (continuing and outcome.error is None)):
        model._count_empty_chunks(outcome.n_empty)
    if outcome.error is not None:
        raise outcome.error
    return len(records) if adopted else 0
