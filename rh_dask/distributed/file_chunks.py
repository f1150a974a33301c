"""Chunks that are byte ranges of files: sent to a relay without the loading worker reading them.

A chunk whose ``X``, ``y`` and weights are each rows of a row-major ``.npy``
file (:func:`rh_dask.read_npy` arrays, used as they are) is, on disk, two or
three contiguous byte ranges already laid out as the engine takes them. With
the TCP relay transport the loading worker's one task for such a chunk
(:func:`~rh_dask.distributed.push.push_file_chunk`) hands those ranges to the
relay's socket with ``sendfile``: the bytes go from the page cache to the
socket and never through the worker's memory. On the 2-core dev box that
cost the sender 0.10-0.14 CPU-seconds per GB against 0.35-0.73 for reading
and sending (``docs/distributed.md``, "Relays").

What a loader would check on the host moves to where the bytes are next
read: the shapes and dtype are known from the files' headers when the plan
is made (a chunk that does not match them loads as a task, and is refused
there as any chunk is); the values (finite, weights non-negative) are
checked by the relay on the bytes it received, with the loader's own
validation (:func:`~rh_dask.distributed.loading.assemble_chunk`), so a
refused chunk stops the stream in front of it exactly as a loader's refusal
does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ..file_rows import FileRows
from .graphs import bare_call
from .items import BadChunk, ChunkSpec
from .loading import assemble_chunk
from .ring import PartLayout, part_views

if TYPE_CHECKING:
    from .chunks import ChunkGraph

__all__ = ["FileChunk", "file_chunk", "refusal"]


@dataclass(frozen=True)
class FileChunk:
    """One chunk as the byte ranges of its parts.

    Attributes
    ----------
    index : int
        The chunk's position in the stream.
    parts : tuple
        ``(X, y, sample_weight)`` as :class:`~rh_dask.file_rows.FileRows`
        (``sample_weight`` may be ``None``).
    spec : ChunkSpec
        The stream's expectations; the relay validates the received chunk
        with it.
    """

    index: int
    parts: tuple[FileRows | None, ...]
    spec: ChunkSpec


def file_chunk(plan: ChunkGraph, index: int, spec: ChunkSpec) -> FileChunk | None:
    """Chunk ``index`` of ``plan`` as byte ranges, or ``None`` when it must load as a task.

    It qualifies when its tasks are exactly the reads of its parts (nothing
    computed from them, nothing shared with other chunks), ``y`` is given,
    every part has the stream's dtype (native byte order), ``X`` is 2-D of
    the stream's width, ``y`` and the weights 1-D of ``X``'s rows, and the
    chunk has rows. Anything else (a slice, a cast, a column-vector ``y``, a
    scalar weight, a DataFrame) loads as before.
    """
    if spec.target is not None or spec.weight is not None or spec.weight_value is not None:
        return None
    if plan.shared_owned(index) or plan.shared_needed(index):
        return None
    keys = plan.part_keys(index)
    if set(plan.subgraph(index)) != {plan.keys[index], *keys.values()}:
        return None
    parts: list[FileRows | None] = []
    for role in ("X", "y", "w"):
        key = keys.get(role)
        rows = None if key is None else bare_call(plan.graph.get(key))
        if key is not None and not isinstance(rows, FileRows):
            return None
        parts.append(rows)
    X, y, w = parts
    if X is None or y is None:
        return None
    dtype = np.dtype(spec.dtype)
    if any(p.dtype != dtype or not p.dtype.isnative for p in parts if p is not None):
        return None
    n_rows = X.shape[0]
    if len(X.shape) != 2 or n_rows == 0:
        return None
    if spec.n_features is not None and X.shape[1] != spec.n_features:
        return None
    if any(p.shape != (n_rows,) for p in (y, w) if p is not None):
        return None
    return FileChunk(index, (X, y, w), spec)


def refusal(
    buffer: Any, base: int, parts: tuple[PartLayout | None, ...], spec: ChunkSpec
) -> BadChunk | None:
    """The relay's check of a file chunk it received: its :class:`BadChunk`, or ``None``.

    ``parts`` lay the chunk out in ``buffer`` from ``base`` (the slot, or the
    chunk's own file). The check is the loader's
    (:func:`~rh_dask.distributed.loading.assemble_chunk` with ``spec``), so
    the same chunk gives the same refusal whichever way it travelled. The
    arrays it looks at are views of ``buffer``: none is kept.
    """
    X, y, w = part_views(buffer, base, parts)
    item = assemble_chunk(X, y, w, spec)
    del X, y, w
    if not isinstance(item, BadChunk):
        return None
    # The traceback's frames hold views of the buffer, which must be unmapped.
    error = item.error.with_traceback(None)
    return BadChunk(item.index, item.reason, error, verb=item.verb)
