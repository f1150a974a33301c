"""What a checkpoint holds: the model's state and, for a walk, where it stood.

These are the in-memory contents that :mod:`rh_dask.checkpoint` writes to and
reads from ``.npz`` files, and that :mod:`rh_dask.interop` builds from
renewable-huber's files. Both the file format and the foreign readers depend
on this module; it depends on neither.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ._version import __version__
from .config import HuberConfig
from .exceptions import ValidationError
from .state import HuberState
from .stream import BatchRecord, Recovery

__all__ = ["Checkpoint", "WalkPosition", "as_count", "as_number"]


def as_count(name: str, value: Any, minimum: int = 0) -> int:
    """``value`` as an int >= ``minimum`` (bools and floats refused)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValidationError(f"{name} is {value!r}, not an int")
    if value < minimum:
        raise ValidationError(f"{name} is {value}, need >= {minimum}")
    return int(value)


def as_number(name: str, value: Any, *, minimum: float | None = None) -> float:
    """``value`` as a finite float (>= ``minimum`` when given)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ValidationError(f"{name} is {value!r}, not a number")
    out = float(value)
    if not math.isfinite(out):
        raise ValidationError(f"{name} is {out}, need a finite number")
    if minimum is not None and out < minimum:
        raise ValidationError(f"{name} is {out}, need >= {minimum}")
    return out


@dataclass(frozen=True)
class WalkPosition:
    """Where a walk over a Dask stream stood when its checkpoint was taken.

    Attributes
    ----------
    next_chunk : int
        Index of the first chunk the state has not consumed: a resumed walk
        goes on from it (``n_chunks`` for a finished walk).
    n_chunks : int
        Chunks of the stream.
    n_empty : int
        Zero-row chunks skipped before ``next_chunk``.
    fingerprint : dict
        The input the walk read (see :func:`rh_dask.distributed.fingerprint.fingerprint`),
        held as the JSON it is written as (tuples become lists).

    Raises
    ------
    ValidationError
        When a count is not an int, ``next_chunk`` is not within
        ``0..n_chunks``, ``n_empty`` is not within ``0..next_chunk``, or the
        fingerprint is not a JSON object of finite values.
    """

    next_chunk: int
    n_chunks: int
    n_empty: int
    fingerprint: dict[str, Any]

    def __post_init__(self) -> None:
        n_chunks = as_count("n_chunks", self.n_chunks)
        next_chunk = as_count("next_chunk", self.next_chunk)
        n_empty = as_count("n_empty", self.n_empty)
        if next_chunk > n_chunks:
            raise ValidationError(f"next_chunk {next_chunk} exceeds n_chunks {n_chunks}")
        if n_empty > next_chunk:
            raise ValidationError(f"n_empty {n_empty} exceeds next_chunk {next_chunk}")
        if not isinstance(self.fingerprint, dict):
            raise ValidationError(f"fingerprint is {self.fingerprint!r}, not a dict")
        try:
            fingerprint = json.loads(json.dumps(self.fingerprint, allow_nan=False))
        except (TypeError, ValueError) as exc:
            raise ValidationError(f"fingerprint is not JSON of finite values: {exc}") from exc
        object.__setattr__(self, "next_chunk", next_chunk)
        object.__setattr__(self, "n_chunks", n_chunks)
        object.__setattr__(self, "n_empty", n_empty)
        object.__setattr__(self, "fingerprint", fingerprint)

    def to_dict(self) -> dict[str, Any]:
        return {
            "next_chunk": self.next_chunk,
            "n_chunks": self.n_chunks,
            "n_empty": self.n_empty,
            "fingerprint": self.fingerprint,
        }


@dataclass(frozen=True)
class Checkpoint:
    """The content of a checkpoint file.

    ``walk``, ``records`` and ``recoveries`` make it a *walk checkpoint*: a
    Dask stream part-way, with the batch records and recoveries of the walk
    so far. ``records`` and ``recoveries`` need ``walk``.
    """

    config: HuberConfig
    state: HuberState
    feature_names: np.ndarray | None
    engine: str
    library_version: str = __version__
    walk: WalkPosition | None = None
    records: tuple[BatchRecord, ...] = field(default=())
    recoveries: tuple[Recovery, ...] = field(default=())

    def __post_init__(self) -> None:
        object.__setattr__(self, "records", tuple(self.records))
        object.__setattr__(self, "recoveries", tuple(self.recoveries))
        if self.walk is None and (self.records or self.recoveries):
            raise ValidationError("batch records and recoveries belong to a walk checkpoint")
        if self.walk is not None and not isinstance(self.walk, WalkPosition):
            raise ValidationError(f"walk is a {type(self.walk).__name__}, not a WalkPosition")
