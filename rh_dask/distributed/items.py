"""What one chunk becomes once it is loaded: the objects that travel to the engine.

Loading runs on the cluster (or in local threads); the engine only ever sees
one of these three outcomes, in chunk order. They are plain picklable
containers so that they can cross worker boundaries.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..exceptions import BadChunkError, StreamError, ValidationError


@dataclass(frozen=True)
class ChunkSpec:
    """What a loader needs to know to turn raw chunk parts into a batch.

    Attributes
    ----------
    index : int
        Position of the chunk in the collection (0-based); names errors.
    dtype : str
        The stream's dtype, batches are cast to it.
    n_features : int or None
        Width every chunk must have (``None`` when the collection does not say).
    feature_names : tuple of str or None
        Column names every DataFrame partition must carry, in order.
    target : str or None
        Column of the partition holding ``y`` (``y`` given as a column name).
    weight : str or None
        Column of the partition holding ``sample_weight``.
    weight_value : float or None
        A scalar ``sample_weight`` (the same weight for every row).
    accept_device : bool
        Whether CUDA arrays may pass validation (GPU engine).
    check_finite : bool
        Whether the loader scans X and y for NaN and infinity. The GPU engine
        refuses non-finite values on the device in its first pass over a
        batch, so its chunks skip this extra read on the host.
    """

    index: int
    dtype: str
    n_features: int | None
    feature_names: tuple[str, ...] | None
    target: str | None = None
    weight: str | None = None
    accept_device: bool = False
    weight_value: float | None = None
    check_finite: bool = True

    @property
    def has_expectations(self) -> bool:
        """Whether chunks are checked against a known width or names."""
        return self.n_features is not None or self.feature_names is not None

    @property
    def names_array(self) -> np.ndarray | None:
        if self.feature_names is None:
            return None
        return np.asarray(self.feature_names, dtype=object)


@dataclass(frozen=True)
class LoadedChunk:
    """A validated batch, ready for ``Engine.partial_fit``."""

    index: int
    X: Any
    y: Any
    sample_weight: Any | None

    @property
    def rows(self) -> int:
        return int(self.X.shape[0])

    @property
    def nbytes(self) -> int:
        parts = (self.X, self.y, self.sample_weight)
        return int(sum(getattr(p, "nbytes", 0) for p in parts if p is not None))


@dataclass(frozen=True)
class EmptyChunk:
    """A chunk with zero rows: skipped and counted, never given to the engine."""

    index: int
    rows: int = 0
    nbytes: int = 0


@dataclass(frozen=True)
class BadChunk:
    """A chunk the stream stops in front of: refused, or its loading failed.

    Attributes
    ----------
    index : int
        The chunk's position.
    reason : str
        Why it failed (the validation or loading message).
    error : BaseException
        The original exception, kept as the cause of the stream error; a
        :class:`~rh_dask.exceptions.ValidationError` means the chunk's data
        was refused (:attr:`refused`).
    verb : str
        What happened to the chunk, for the error message: ``"was refused"``
        (validation, the engine) or ``"could not be loaded"`` (computing it
        failed).
    """

    index: int
    reason: str
    error: BaseException
    rows: int = 0
    nbytes: int = 0
    verb: str = "was refused"

    @property
    def message(self) -> str:
        return f"chunk {self.index} {self.verb}: {self.reason}"

    @property
    def refused(self) -> bool:
        """Whether the chunk's data failed validation (not its task or the engine's device)."""
        return isinstance(self.error, ValidationError)

    def exception(self) -> StreamError:
        """The error the stream raises for this chunk (see :func:`chunk_error`)."""
        return chunk_error(self.index, self.error, self.message)


def chunk_error(index: int, cause: BaseException, message: str | None = None) -> StreamError:
    """The error that stops a stream at chunk ``index``, with ``cause`` chained.

    :class:`~rh_dask.exceptions.BadChunkError` (a ``ValueError`` too) when
    ``cause`` is a validation refusal of the chunk's data, by the loader or
    the engine; a plain :class:`~rh_dask.exceptions.StreamError` for any
    other failure (an I/O error in the chunk's task, a device fault).
    ``message`` defaults to one for a chunk whose loading raised ``cause``.
    """
    refused = isinstance(cause, ValidationError)
    if message is None:
        verb = "was refused" if refused else "could not be loaded"
        message = f"chunk {index} {verb}: {type(cause).__name__}: {cause}"
    err = (BadChunkError if refused else StreamError)(message, index)
    err.__cause__ = cause
    return err


ChunkItem = LoadedChunk | EmptyChunk | BadChunk
