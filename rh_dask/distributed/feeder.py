"""Loading a stream's chunks inside the engine's own worker, without the scheduler.

With ``loader="actor"`` the coordinator sends the stream's chunk plan
(:class:`~.chunks.ChunkGraph`) to the engine actor once. A :class:`ChunkFeeder`
thread on that worker then computes chunk graphs on a few local threads
(:func:`~.local.compute_keys` per chunk) and drops each loaded batch into the
consumer's inbox, keeping at most ``lookahead`` chunks ahead of the engine.

Why: each Dask task costs the worker's event loop about a millisecond of
Python, on the same interpreter lock as the engine's thread, and a task per
chunk sends submission, completion and release messages. Here a chunk costs
no message at all, and the coordinator only long-polls the actor for
progress: on an H200 the GPU engine's fit is 1.2-2.1x as fast as with one
task per chunk (``docs/performance.md``, "Design choices, each measured with
and without in one run").

It needs a graph the worker can compute alone: a collection built from
files or in-memory data, not one referencing data persisted on the cluster
(:attr:`ChunkGraph.self_contained`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from .chunks import ChunkGraph
from .consumer import OrderedConsumer
from .items import BadChunk, ChunkItem
from .local import SharedKeys, load_chunk

Key = Any


class ChunkFeeder:
    """Compute every chunk of ``graph`` on local threads and deliver it to ``consumer``.

    Parameters
    ----------
    graph : ChunkGraph
        The stream's plan; its items are :class:`~.items.ChunkItem`.
    consumer : OrderedConsumer
        Receives the items (in any order; it consumes them in order).
    stream_id : str
        The stream the items belong to; delivery stops when it ends.
    lookahead : int
        Chunk ``i`` starts loading only once chunk ``i - lookahead`` was
        consumed, so at most ``lookahead`` chunks are loading or waiting.
    threads : int
        Loading threads.
    stage : callable
        Applied to each item on its loading thread before delivery (the
        actor's copy into pinned memory).
    """

    def __init__(
        self,
        graph: ChunkGraph,
        consumer: OrderedConsumer,
        stream_id: str,
        lookahead: int,
        threads: int,
        stage: Callable[[ChunkItem], ChunkItem],
    ) -> None:
        self._graph = graph
        self._consumer = consumer
        self._stream_id = stream_id
        self._lookahead = max(1, int(lookahead))
        self._stage = stage
        self._pool = ThreadPoolExecutor(max(1, int(threads)), thread_name_prefix="rh-dask-feed")
        self._thread = threading.Thread(target=self._run, name="rh-dask-feeder", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def _load(
        self, index: int, needs: list[tuple[Key, Future[Any]]]
    ) -> tuple[None, dict[Key, Any]]:
        """Load, stage and deliver one chunk; return the shared keys it computed.

        The result has :func:`~.local.load_chunk`'s shape without the item, so
        that later chunks read shared keys from it and the batch itself is
        held by the consumer alone.
        """
        try:
            item, shared = load_chunk(self._graph, index, needs)
        except Exception as exc:  # the stream stops in front of this chunk
            reason = f"{type(exc).__name__}: {exc}"
            self._consumer.deliver(
                self._stream_id, BadChunk(index, reason, exc, verb="could not be loaded")
            )
            raise
        self._consumer.deliver(self._stream_id, self._stage(item))
        return None, shared

    def _wait_window(self, index: int) -> bool:
        """Block until chunk ``index`` may start loading; False once the stream stopped."""
        target = index - self._lookahead + 1
        if target <= 0:
            return True
        ready = threading.Event()
        remove = self._consumer.add_waiter(target, ready.set)
        try:
            ready.wait()
        finally:
            remove()
        return self._consumer.active(self._stream_id) and self._consumer.consumed >= target

    def _run(self) -> None:
        shared = SharedKeys(self._graph)
        released = self._graph.start
        stopped = False
        try:
            for i in range(self._graph.start, self._graph.n_chunks):
                if not self._wait_window(i):
                    stopped = True
                    return
                # Held keys whose last user was consumed can go.
                while released < self._consumer.consumed:
                    shared.release_after(released)
                    released += 1
                shared.submit(self._pool, self._load, i)
        except BaseException:
            stopped = True
            raise
        finally:
            # Queued loads still run unless the stream stopped; loads under way
            # always finish (the consumer drops a stale delivery).
            self._pool.shutdown(wait=False, cancel_futures=stopped)
