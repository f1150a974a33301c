"""The task that turns one chunk's raw parts into an engine-ready batch.

It runs wherever the chunk is loaded (a worker, or a local thread) so that
validation and dtype conversion happen in parallel, off the engine's thread.
It never raises for a bad chunk: a refusal travels as a :class:`BadChunk` so
that the stream can stop exactly in front of it, in order.
"""

from __future__ import annotations

from typing import Any

from ..exceptions import ValidationError
from ..validation import Batch, validate_batch
from .items import BadChunk, ChunkItem, ChunkSpec, EmptyChunk, LoadedChunk


def chunk_parts(x_part: Any, y_part: Any, w_part: Any, spec: ChunkSpec) -> tuple[Any, Any, Any]:
    """The chunk's ``(X, y, sample_weight)``, taking columns named in ``spec`` out of X."""
    if spec.weight_value is not None:
        w_part = spec.weight_value  # validate_batch broadcasts a scalar weight
    if spec.target is None and spec.weight is None:
        return x_part, y_part, w_part
    columns = getattr(x_part, "columns", ())
    for role, col in (("y", spec.target), ("sample_weight", spec.weight)):
        if col is not None and col not in columns:
            raise ValidationError(f"the partition has no column {col!r} (the {role} column)")
    y = x_part[spec.target] if spec.target is not None else y_part
    w = x_part[spec.weight] if spec.weight is not None else w_part
    # Dropping (not selecting by the expected names) keeps a partition whose
    # columns are wrong or reordered wrong, so that validation can refuse it.
    X = x_part.drop(columns=[c for c in (spec.target, spec.weight) if c is not None])
    return X, y, w


def validate_chunk(X: Any, y: Any, w: Any, spec: ChunkSpec) -> Batch:
    """:func:`rh_dask.validation.validate_batch` with the stream's expectations in ``spec``.

    They come from the collection's metadata, so every chunk, the first
    included, is checked against them.
    """
    return validate_batch(
        X,
        y,
        w,
        dtype=spec.dtype,
        n_features=spec.n_features,
        feature_names=spec.names_array,
        fitted=spec.has_expectations,
        accept_device=spec.accept_device,
        check_finite=spec.check_finite,
    )


def _row_count(part: Any) -> int | None:
    shape = getattr(part, "shape", None)
    if shape is None:
        return None if part is None else len(part)
    return int(shape[0]) if len(shape) else None


def assemble_chunk(x_part: Any, y_part: Any, w_part: Any, spec: ChunkSpec) -> ChunkItem:
    """Validate one chunk with :func:`rh_dask.validation.validate_batch`.

    Parameters
    ----------
    x_part, y_part, w_part
        The chunk's parts as the collection produced them (NumPy/CuPy blocks,
        pandas partitions); ``y_part``/``w_part`` may be ``None`` when they are
        columns of ``x_part`` (see ``spec.target``/``spec.weight``) or absent.
    spec : ChunkSpec
        What the stream expects of every chunk.

    Returns
    -------
    LoadedChunk, EmptyChunk or BadChunk
    """
    try:
        X, y_part, w_part = chunk_parts(x_part, y_part, w_part, spec)
        rows = _row_count(X)
        if rows == 0:
            y_rows = _row_count(y_part)
            if y_rows not in (0, None):
                reason = f"X has 0 rows but y has {y_rows}"
                return BadChunk(spec.index, reason, ValidationError(reason))
            return EmptyChunk(spec.index)
        batch = validate_chunk(X, y_part, w_part, spec)
    except Exception as exc:  # any failure of this chunk ends the stream here
        verb = "was refused" if isinstance(exc, ValidationError) else "could not be loaded"
        return BadChunk(spec.index, f"{type(exc).__name__}: {exc}", exc, verb=verb)
    return LoadedChunk(spec.index, batch.X, batch.y, batch.sample_weight)
