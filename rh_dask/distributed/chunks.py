"""Turning Dask arrays and DataFrames into one task per chunk.

A stream is a Dask collection ``X`` (with ``y`` and optional weights) whose
row chunks (arrays) or partitions (DataFrames) are the batches. This module

1. aligns ``X``, ``y`` and ``sample_weight`` chunk by chunk
   (:func:`align_stream`): column chunks of an array are merged per row block,
   ``y`` is rechunked to ``X``'s rows when it can be, a DataFrame's ``y`` may be
   one of its columns;
2. materialises the optimised graph once and adds one task per chunk that
   produces that chunk's item (:class:`ChunkGraph`);
3. splits the graph into what each chunk owns, so that the coordinator can
   submit chunk ``i`` alone, and finds the keys several chunks share (a global
   mean, an overlapping rechunk, a literal source array). A shared key is
   computed once, with the first chunk that needs it, and held until the
   last chunk that needs it is done.

Nothing here talks to a cluster: the same plan serves the distributed
coordinator, the single-process path and out-of-core scoring.
"""

from __future__ import annotations

import contextlib
import math
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import dask
import dask.array as da
import dask.dataframe as dd
import numpy as np
from dask.base import is_dask_collection, tokenize
from dask.sizeof import sizeof

from ..exceptions import ValidationError
from ..validation import feature_names_of
from .graphs import DataNode, Task, TaskRef, dependencies, fuse, optimized_graph
from .items import ChunkSpec

Key = Any


@dataclass(frozen=True)
class AlignedStream:
    """``X``, ``y`` and weights as collections with the same chunk boundaries.

    Attributes
    ----------
    parts : tuple
        The Dask collections to load per chunk: ``X`` first, then ``y`` and
        the weights when they are separate collections.
    roles : tuple of {"X", "y", "w"}
        Which input each entry of ``parts`` is.
    n_chunks : int
        Number of row chunks (partitions).
    n_features : int or None
        Width of ``X`` as its metadata states it.
    feature_names : tuple of str or None
        DataFrame feature columns (all strings), else ``None``.
    target, weight : str or None
        Columns of ``X`` holding ``y`` / the weights.
    weight_value : float or None
        A scalar weight for every row.
    """

    parts: tuple[Any, ...]
    roles: tuple[str, ...]
    n_chunks: int
    n_features: int | None
    feature_names: tuple[str, ...] | None
    target: str | None = None
    weight: str | None = None
    weight_value: float | None = None

    def spec(self, index: int, dtype: str, accept_device: bool) -> ChunkSpec:
        """The loader's expectations for chunk ``index``.

        ``accept_device`` means the GPU engine consumes the chunks: CUDA
        arrays may pass, and the host skips the finiteness scan the engine
        does on the device anyway.
        """
        return ChunkSpec(
            index=index,
            dtype=dtype,
            n_features=self.n_features,
            feature_names=self.feature_names,
            target=self.target,
            weight=self.weight,
            accept_device=accept_device,
            weight_value=self.weight_value,
            check_finite=not accept_device,
        )


def _same_chunks(a: Sequence[float], b: Sequence[float]) -> bool:
    if len(a) != len(b):
        return False
    return all((math.isnan(x) and math.isnan(y)) or x == y for x, y in zip(a, b, strict=True))


def _known(chunks: Sequence[float]) -> bool:
    return not any(math.isnan(c) for c in chunks)


def _row_chunks(X: Any) -> tuple[float, ...] | None:
    return tuple(X.chunks[0]) if isinstance(X, da.Array) else None


def _n_chunks(X: Any) -> int:
    return X.numblocks[0] if isinstance(X, da.Array) else X.npartitions


def _align_vector(name: str, v: Any, X: Any) -> Any:
    """Return ``v`` (y or weights) as a collection with ``X``'s row chunks."""
    n = _n_chunks(X)
    rows = _row_chunks(X)
    if isinstance(v, (dd.DataFrame, da.Array)) and (
        (isinstance(v, dd.DataFrame) and len(v.columns) != 1)
        or (isinstance(v, da.Array) and v.ndim != 1)
    ):
        shape = v.shape if isinstance(v, da.Array) else ("?", len(v.columns))
        raise ValidationError(
            f"{name} must be 1-D, got shape {shape}; pass a 1-D array or a Series "
            "(only single-output regression is supported)"
        )
    if isinstance(v, dd.DataFrame):
        v = v[v.columns[0]]
    if isinstance(v, dd.Series):
        if v.npartitions != n:
            raise ValidationError(
                f"{name} has {v.npartitions} partitions but X has {n} chunks; "
                "they must be aligned chunk by chunk"
            )
        if (
            isinstance(X, dd.DataFrame)
            and X.known_divisions
            and v.known_divisions
            and tuple(X.divisions) != tuple(v.divisions)
        ):
            raise ValidationError(f"{name} and X have different index divisions")
        return v
    if isinstance(v, da.Array):
        if rows is not None and not _same_chunks(v.chunks[0], rows):
            if _known(v.chunks[0]) and _known(rows) and v.shape[0] == sum(rows):
                return v.rechunk({0: rows})
            if v.numblocks[0] != n:
                raise ValidationError(
                    f"{name} has row chunks {v.chunks[0]} that cannot be aligned with "
                    f"X's row chunks {rows}"
                )
        elif rows is None and v.numblocks[0] != n:
            raise ValidationError(
                f"{name} has {v.numblocks[0]} chunks but X has {n} partitions; "
                "they must be aligned chunk by chunk"
            )
        return v
    if is_dask_collection(v):
        raise ValidationError(f"{name} must be a Dask array or Series, got {type(v).__name__}")
    # An in-memory vector next to a Dask X: cut it at X's row boundaries.
    if rows is None or not _known(rows):
        raise ValidationError(
            f"{name} is in memory but X's chunk lengths are unknown; pass {name} as a "
            "Dask collection aligned with X (or a column name of X)"
        )
    arr = np.asarray(v)
    if arr.ndim != 1 or arr.shape[0] != sum(rows):
        raise ValidationError(
            f"{name} has shape {arr.shape}, expected ({int(sum(rows))},) to match X"
        )
    return da.from_array(arr, chunks=(rows,))


def align_stream(X: Any, y: Any, sample_weight: Any | None) -> AlignedStream:
    """Align a stream's inputs chunk by chunk.

    Parameters
    ----------
    X : dask.array.Array (2-D) or dask.dataframe.DataFrame
        Row chunks / partitions are the batches. Column chunks are merged.
    y : dask array or Series, in-memory vector, or str
        Targets; a string names a column of the DataFrame ``X``.
    sample_weight : same kinds as ``y``, a scalar, or None

    Raises
    ------
    ValidationError
        When the inputs cannot be aligned (the message says why).
    """
    if isinstance(X, da.Array):
        if X.ndim != 2:
            raise ValidationError(f"X must be 2-D, got a {X.ndim}-D Dask array")
        if X.numblocks[1] > 1:
            # Column chunks of one row block form one batch: merge, never drop.
            X = X.rechunk({1: -1})
        width = X.shape[1]
        n_features = None if math.isnan(width) else int(width)
        names = None
        target = weight = None
        if isinstance(y, str) or isinstance(sample_weight, str):
            raise ValidationError("column names for y/sample_weight need a DataFrame X")
    elif isinstance(X, dd.DataFrame):
        target = y if isinstance(y, str) else None
        weight = sample_weight if isinstance(sample_weight, str) else None
        for col in (target, weight):
            if col is not None and col not in X.columns:
                raise ValidationError(f"column {col!r} is not a column of X")
        meta = X._meta.drop(columns=[c for c in (target, weight) if c is not None])
        n_features = len(meta.columns)
        found = feature_names_of(meta)
        names = None if found is None else tuple(str(c) for c in found)
    else:
        raise ValidationError(
            "a Dask stream needs X as a 2-D Dask array or a Dask DataFrame, "
            f"got {type(X).__name__}"
        )
    if y is None:
        raise ValidationError("y must not be None: a regressor needs targets")
    parts: list[Any] = [X]
    roles = ["X"]
    if not isinstance(y, str):
        parts.append(_align_vector("y", y, X))
        roles.append("y")
    weight_value = None
    if np.isscalar(sample_weight) and not isinstance(sample_weight, str):
        weight_value = float(sample_weight)
    elif sample_weight is not None and not isinstance(sample_weight, str):
        parts.append(_align_vector("sample_weight", sample_weight, X))
        roles.append("w")
    return AlignedStream(
        parts=tuple(parts),
        roles=tuple(roles),
        n_chunks=_n_chunks(X),
        n_features=n_features,
        feature_names=names,
        target=target,
        weight=weight,
        weight_value=weight_value,
    )


@contextlib.contextmanager
def stable_partitions() -> Iterator[None]:
    """Keep a collection's partitions as the user sees them while graphs are built.

    Batches are the partitions (``npartitions``). Dask's optimiser may merge
    neighbouring Parquet partitions when only a few columns are read (its
    "tune" stage), which would silently change the batches, and could chunk X
    and a separately built y differently; the stage is off inside this block.
    """
    with dask.config.set({"optimization.tune.active": False}):
        yield


def _chunk_keys(keys: Any, n: int) -> list[Key]:
    """One key per row chunk from a collection's (possibly nested) key list."""
    out = []
    for k in keys:
        while isinstance(k, list):  # a 2-D array's row: one column block after merging
            k = k[0]
        out.append(k)
    if len(out) != n:
        raise ValidationError(f"expected {n} chunk keys, found {len(out)}")
    return out


#: Literals of at most this many bytes (``dask.sizeof``) are copied into each
#: chunk's tasks rather than held once and referenced (:meth:`ChunkGraph._split`).
#: Not a setting: a copy this small costs nothing beside a chunk's data, and a
#: larger literal (an in-memory array) must not be copied per chunk.
SMALL_LITERAL_BYTES = 64 * 1024


def _small_literal(node: Any) -> bool:
    if not isinstance(node, DataNode):
        return False
    try:
        return sizeof(node.value) <= SMALL_LITERAL_BYTES
    except Exception:  # an object sizeof cannot measure: keep it referenced
        return False


@dataclass
class ChunkGraph:
    """The stream's graph with one item task per chunk, split by owner.

    Parameters
    ----------
    stream : AlignedStream
    func : callable
        ``func(x_part, y_part, w_part, spec, *extra)`` builds a chunk's item.
    make_spec : callable
        ``make_spec(index) -> ChunkSpec``.
    extra : tuple
        Further arguments of ``func``, the same for every chunk.
    name : str
        Prefix of the item keys ``(name-token, i)``.
    start : int
        First chunk to load: a walk going on from a stream checkpoint. Chunks
        before it are never loaded; indices stay those of the whole collection.

    Attributes
    ----------
    keys : list
        The item key of every chunk.
    graph : dict
        Key → task for everything any chunk needs.
    """

    stream: AlignedStream
    func: Callable[..., Any]
    make_spec: Callable[[int], ChunkSpec]
    extra: tuple[Any, ...] = ()
    name: str = "rh-chunk"
    start: int = 0
    keys: list[Key] = field(init=False)
    graph: dict[Key, Any] = field(init=False)

    def __post_init__(self) -> None:
        with stable_partitions():
            graph, part_keys = optimized_graph(self.stream.parts)
        n = self.stream.n_chunks
        if not 0 <= self.start <= n:
            raise ValidationError(f"start must be a chunk index in [0, {n}], got {self.start}")
        per_role = {
            role: _chunk_keys(keys, n)
            for role, keys in zip(self.stream.roles, part_keys, strict=True)
        }
        # A fresh token per plan: items are delivered to one stream's actor, so
        # a result left in memory by another stream must never be reused.
        token = tokenize(self.name, list(per_role["X"]), uuid.uuid4().hex)
        self.keys = []
        for i in range(n):
            key = (f"{self.name}-{token}", i)
            refs = [TaskRef(per_role[r][i]) if r in per_role else None for r in ("X", "y", "w")]
            graph[key] = Task(key, self.func, *refs, self.make_spec(i), *self.extra)
            self.keys.append(key)
        self.graph = graph
        self._parts = per_role
        self._split()

    @property
    def n_chunks(self) -> int:
        return len(self.keys)

    @property
    def self_contained(self) -> bool:
        """Whether every key the chunks need is computed by the graph itself.

        False when the collection references data persisted on a cluster
        (keys held by futures): only that cluster can provide them, so the
        chunks cannot be computed by one worker on its own.
        """
        return all(d in self.graph for key in self.graph for d in dependencies(self.graph, key))

    def __getstate__(self) -> dict[str, Any]:
        # The plan travels to the engine's worker for loader="actor": the source
        # collections and the spec factory were only needed to build it.
        state = dict(self.__dict__)
        state["stream"] = None
        state["make_spec"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def _deps(self, key: Key) -> Any:
        """Dependencies inside the graph; keys of persisted data (already in the
        cluster's memory, held by the user's futures) are left out: they are
        referenced, never submitted."""
        return [d for d in dependencies(self.graph, key) if d in self.graph]

    def _split(self) -> None:
        """Decide, per chunk, which tasks to submit with it and which to reference.

        Three linear passes over the graph:

        A. give every key to the first chunk that needs it; a key a later chunk
           also needs is *shared*;
        B. a shared key that is itself an input of another shared computation
           (a raw chunk feeding a global mean) is *covered*: holding it would
           keep the whole dataset alive, so the later chunk recomputes it
           instead. Literals (data embedded in the graph) are never recomputed;
           small ones are copied into every chunk that uses them;
        C. walk each chunk again, referencing earlier keys that may be held
           (uncovered shared keys, literals) and recomputing the rest. A key
           referenced by a later chunk is held from the chunk that computes it
           until its last user is done.
        """
        shared: set[Key] = set()
        owner: dict[Key, int] = {}
        for i, root in enumerate(self.keys):
            if i < self.start:
                continue
            stack = [root]
            while stack:
                key = stack.pop()
                first = owner.get(key)
                if first is None:
                    owner[key] = i
                    stack.extend(self._deps(key))
                elif first != i:
                    shared.add(key)
        covered: set[Key] = set()
        for top in shared:
            if isinstance(self.graph[top], DataNode):
                continue
            stack = list(self._deps(top))
            while stack:
                key = stack.pop()
                if key not in covered:
                    covered.add(key)
                    stack.extend(self._deps(key))
        # A small literal (a file handle, an array's metadata: da.from_array's
        # "original-array") is copied into every chunk that uses it. Held once
        # and referenced instead, it would be a dependency of every chunk, and
        # the scheduler places a task where its dependencies are: every chunk
        # would load on the one or two workers holding it (measured: 2 of 8
        # loading workers busy, benchmarks/scale_out.py on the H200).
        small = {k for k, node in self.graph.items() if _small_literal(node)}
        literals = {k for k, node in self.graph.items() if isinstance(node, DataNode)}
        referable = (literals | (shared - covered)) - small

        made_by: dict[Key, int] = {}
        self._owned: list[list[Key]] = []
        self._refs: list[set[Key]] = []
        last_use: dict[Key, int] = {}
        for i, root in enumerate(self.keys):
            mine: list[Key] = []
            refs: set[Key] = set()
            if i < self.start:
                self._owned.append(mine)
                self._refs.append(refs)
                continue
            seen = {root}
            stack = [root]
            while stack:
                key = stack.pop()
                maker = made_by.get(key)
                if maker is not None and maker != i and key in referable:
                    refs.add(key)
                    last_use[key] = i
                    continue
                if maker is None:
                    made_by[key] = i
                mine.append(key)
                for dep in self._deps(key):
                    if dep not in seen:
                        seen.add(dep)
                        stack.append(dep)
            self._owned.append(mine)
            self._refs.append(refs)
        self._held_by: list[list[Key]] = [[] for _ in self.keys]
        self._released_at: list[list[Key]] = [[] for _ in self.keys]
        for key, last in last_use.items():
            self._held_by[made_by[key]].append(key)
            self._released_at[last].append(key)

    def part_keys(self, index: int) -> dict[str, Key]:
        """The keys of chunk ``index``'s parts, by role (``"X"``, ``"y"``, ``"w"``)."""
        return {role: keys[index] for role, keys in self._parts.items()}

    def subgraph(self, index: int) -> dict[Key, Any]:
        """Tasks to submit with chunk ``index`` (held keys of earlier chunks excluded)."""
        return {k: self.graph[k] for k in self._owned[index]}

    def submission(self, index: int) -> dict[Key, Any]:
        """What to submit for chunk ``index``: one fused task where possible.

        A worker spends about a millisecond of event-loop time per task, on
        the same GIL as the engine's thread, so a chunk goes as a single
        task (its tasks run inside it) unless some of them must stay
        addressable because later chunks reference them.
        """
        sub = self.subgraph(index)
        if self._held_by[index] or len(sub) == 1:
            return sub
        key = self.keys[index]
        return {key: fuse(list(sub.values()), key)}

    def shared_owned(self, index: int) -> list[Key]:
        """Keys computed with chunk ``index`` that later chunks reference: hold them."""
        return self._held_by[index]

    def shared_needed(self, index: int) -> list[Key]:
        """Held keys of earlier chunks that chunk ``index`` references."""
        return sorted(self._refs[index], key=str)

    def release_after(self, index: int) -> list[Key]:
        """Held keys whose last user is chunk ``index``."""
        return self._released_at[index]
