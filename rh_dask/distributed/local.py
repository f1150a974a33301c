"""The single-process walk, used when no ``distributed.Client`` is around.

Chunks are computed in this process (each chunk's tasks in dependency order
on one thread, :func:`~.graphs.compute_keys`), up to ``lookahead`` of them at
once on a small thread pool, and handed to the caller's consumer strictly in
index order. Keys shared by several chunks are
computed once, with the first chunk that needs them (see
:class:`~.chunks.ChunkGraph`), and live as long as a later chunk may need them.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import closing
from typing import Any

from .chunks import ChunkGraph
from .graphs import DataNode, compute_keys
from .items import ChunkItem, chunk_error

Key = Any


def load_chunk(
    graph: ChunkGraph, index: int, needs: list[tuple[Key, Future[Any]]]
) -> tuple[ChunkItem, dict[Key, Any]]:
    """Compute chunk ``index`` here (:func:`~.graphs.compute_keys`).

    ``needs`` are the held keys of earlier chunks it references, with the
    futures of the jobs that computed them (whose results have this
    function's shape). Returns the chunk's item and the shared keys it
    computed for later chunks.
    """
    dsk = graph.subgraph(index)
    for key, owner in needs:
        dsk[key] = DataNode(key, owner.result()[1][key])
    shared = graph.shared_owned(index)
    values = compute_keys(dsk, [graph.keys[index], *shared])
    return values[0], dict(zip(shared, values[1:], strict=True))


class SharedKeys:
    """Which loading job computes each key later chunks share, while they need it.

    A chunk's job is handed the jobs owning the shared keys it references
    (see :func:`load_chunk`). Jobs start in submission (index) order, so an
    awaited job is always already running.
    """

    def __init__(self, graph: ChunkGraph) -> None:
        self._graph = graph
        self._owners: dict[Key, Future[Any]] = {}

    def submit(
        self,
        pool: ThreadPoolExecutor,
        load: Callable[[int, list[tuple[Key, Future[Any]]]], Any],
        index: int,
    ) -> Future[Any]:
        """Submit ``load(index, needs)`` and record the shared keys it computes."""
        needs = [(k, self._owners[k]) for k in self._graph.shared_needed(index)]
        job = pool.submit(load, index, needs)
        for key in self._graph.shared_owned(index):
            self._owners[key] = job
        return job

    def release_after(self, index: int) -> None:
        """Forget the keys whose last user is chunk ``index``."""
        for key in self._graph.release_after(index):
            self._owners.pop(key, None)


def iter_local(graph: ChunkGraph, lookahead: int) -> Iterator[ChunkItem]:
    """Yield every chunk's item from ``graph.start`` on, in index order, loading ahead on threads.

    Raises
    ------
    StreamError
        When computing a chunk fails (naming the chunk; the cause is chained):
        a :class:`~rh_dask.exceptions.BadChunkError` when the failure is a
        validation refusal (see :func:`~.items.chunk_error`).
    """
    n = graph.n_chunks
    threads = max(1, min(lookahead, os.cpu_count() or 1))
    pool = ThreadPoolExecutor(threads, thread_name_prefix="rh-dask-load")
    jobs: dict[int, Future[Any]] = {}
    shared = SharedKeys(graph)
    load = functools.partial(load_chunk, graph)
    submitted = graph.start
    try:
        for i in range(graph.start, n):
            while submitted < n and submitted <= i + lookahead - 1:
                jobs[submitted] = shared.submit(pool, load, submitted)
                submitted += 1
            try:
                item, _ = jobs.pop(i).result()
            except Exception as exc:
                raise chunk_error(i, exc) from exc
            shared.release_after(i)
            yield item
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


def run_local(
    graph: ChunkGraph, lookahead: int, consume: Callable[[ChunkItem, float], None]
) -> None:
    """Feed ``consume`` every chunk in order (it raises to stop the stream).

    ``consume`` also gets the seconds spent waiting for that chunk to load.
    """
    with closing(iter_local(graph, lookahead)) as items:
        while True:
            start = time.perf_counter()
            item = next(items, None)
            if item is None:
                return
            consume(item, time.perf_counter() - start)
