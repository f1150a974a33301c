"""``stream_fit``: what ``partial_fit`` (and so ``fit``) does with Dask collections.

It checks the stream against the model, then walks the chunks in order,
either on the user's ``distributed`` cluster (an engine actor fed by
look-ahead loads, :mod:`.coordinator`) or, without a client, in this process
with the model's own engine (:mod:`.local`). Both give the state a loop of
``partial_fit`` over the same chunks would give.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ..engines import resolve_engine_name
from ..exceptions import StreamError, ValidationError
from ..state import BatchDiagnostics
from ..validation import check_feature_names
from .chunks import AlignedStream, ChunkGraph, align_stream
from .consumer import STREAM_BLAS_THREADS, blas_limiter
from .coordinator import LOADERS, ClusterWalk
from .items import BadChunk, ChunkItem, EmptyChunk
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


def stream_fit(
    model: RenewableHuberRegressor, X: Any, y: Any, sample_weight: Any | None = None
) -> RenewableHuberRegressor:
    """Continue ``model``'s stream over every chunk of ``X`` (Dask array or DataFrame).

    Parameters
    ----------
    model : RenewableHuberRegressor
    X : dask.array.Array or dask.dataframe.DataFrame
        Row chunks / partitions are the batches, in index order.
    y : Dask array or Series, in-memory vector cut at X's chunks, or a column name of X
    sample_weight : like ``y``, or None

    Returns
    -------
    model

    Raises
    ------
    ValidationError
        When the inputs do not fit together or the model (nothing consumed).
    StreamError
        When a chunk fails mid-stream (``chunk_index`` says which); the model
        then holds the state after the last good chunk and ``partial_fit`` can
        continue. :class:`~rh_dask.distributed.ActorLostError` when the engine's
        worker died (the model keeps its state from before the call).
    """
    options = StreamOptions.from_model(model)
    config = model._make_config()
    model._check_stream_config(config)
    fitted = hasattr(model, "n_features_in_")
    engine = model.engine_ if fitted else resolve_engine_name(model.engine, model.device)
    stream = align_stream(X, y, sample_weight)
    _check_against_model(stream, model, fitted)
    client = current_client()
    with StreamProgress(stream.n_chunks, options.progress) as bar:
        if client is None:
            n_batches, _ = _fit_local(model, stream, config, engine, options, bar)
        else:
            n_batches, _ = _fit_cluster(model, client, stream, config, engine, options, bar)
    if n_batches == 0 and not hasattr(model, "n_features_in_"):
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
) -> tuple[int, int]:
    """The single-process walk: the model's own engine, chunks computed here."""
    accept_device = engine_name == "gpu"
    graph = ChunkGraph(
        stream, assemble_chunk, lambda i: stream.spec(i, config.dtype, accept_device)
    )
    counts = {"batches": 0, "empty": 0}
    names = _names(stream)
    limit = blas_limiter(STREAM_BLAS_THREADS)

    def consume(item: ChunkItem, waited: float) -> None:
        if isinstance(item, EmptyChunk):
            counts["empty"] += 1
            model._count_empty_chunks(1)
            bar.update(1, 0)
            return
        if isinstance(item, BadChunk):
            err = StreamError(item.message, item.index)
            raise err from item.error
        engine = model._engine_for(config, engine_name)
        start = time.perf_counter()
        try:
            with limit():
                diagnostics = engine.partial_fit(item.X, item.y, item.sample_weight)
        except ValidationError as exc:
            raise StreamError(
                f"chunk {item.index} was refused: {type(exc).__name__}: {exc}", item.index
            ) from exc
        seconds = time.perf_counter() - start
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

    run_local(graph, options.lookahead, consume)
    return counts["batches"], counts["empty"]


def _fit_cluster(
    model: Any,
    client: Any,
    stream: AlignedStream,
    config: Any,
    engine_name: str,
    options: StreamOptions,
    bar: StreamProgress,
) -> tuple[int, int]:
    """The distributed walk; adopts the remote state even when the walk failed."""
    initial = model.state_ if hasattr(model, "n_features_in_") else None
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
    if outcome.state is not None and records:
        model._adopt_stream(
            config, engine_name, outcome.state, _names(stream), records, outcome.placement
        )
    if outcome.n_empty and (records or hasattr(model, "n_features_in_")):
        model._count_empty_chunks(outcome.n_empty)
    if outcome.error is not None:
        raise outcome.error
    return len(records), outcome.n_empty
