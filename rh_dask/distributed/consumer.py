"""The ordered consumer: one thread that owns one engine and eats chunks in order.

Loaded chunks arrive here in any order, from any thread (the tasks that load
them). The consumer's thread hands chunk ``i`` to the engine only once chunk
``i - 1`` was consumed, so a stream is fitted exactly as a single-process loop
would fit it. Nothing here knows about Dask: the actor (:mod:`.actor`) wraps it
for the cluster and tests can drive it directly.

Every engine call, creation included, happens on this one thread: a GPU
engine's CUDA context, streams and library handles then never hop threads.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

from ..engines import Engine
from ..state import HuberState
from .items import BadChunk, ChunkItem, EmptyChunk


@dataclass(frozen=True)
class BatchRecord:
    """What the history keeps of one consumed batch."""

    chunk: int
    rows: int
    iterations: int
    converged: bool
    objective: float
    lambda_value: float
    bandwidth: float
    seconds: float


@dataclass(frozen=True)
class Progress:
    """A snapshot of a stream, as the coordinator sees it.

    Attributes
    ----------
    consumed : int
        Chunks dealt with so far (fitted or skipped as empty); the next chunk
        the engine will take is ``consumed``.
    records : list of BatchRecord
        Records the caller has not seen yet.
    n_empty : int
        Empty chunks skipped so far.
    failure : BadChunk or None
        The chunk the stream stopped at, if it did.
    """

    consumed: int
    records: list[BatchRecord]
    n_empty: int
    failure: BadChunk | None


def blas_limiter(threads: int | None) -> Callable[[], Any]:
    """A context factory pinning BLAS to ``threads`` threads (no-op for ``None``).

    The summation order of multithreaded BLAS depends on its thread count, so
    a stream fitted with another count than the caller's process would differ
    in the last bits from the caller's own loop of ``partial_fit``.
    """
    if threads is None:
        return nullcontext
    from threadpoolctl import ThreadpoolController

    controller = ThreadpoolController()
    return lambda: controller.limit(limits=threads, user_api="blas")


class OrderedConsumer:
    """Own an engine on a dedicated thread and feed it chunks in index order.

    Parameters
    ----------
    factory : callable
        Builds the engine; runs on the consumer's thread.
    blas_threads : int or None
        BLAS thread count for engine calls (``None``: leave it as it is).

    Raises
    ------
    Exception
        Whatever ``factory`` raises (e.g. ``EngineUnavailableError``).
    """

    def __init__(self, factory: Callable[[], Engine], blas_threads: int | None = None) -> None:
        self._cond = threading.Condition()
        self._commands: deque[tuple[Callable[[], Any], Future[Any]]] = deque()
        self._inbox: dict[int, ChunkItem] = {}
        self._stream: str | None = None
        self._next = 0
        self._records: list[BatchRecord] = []
        self._n_empty = 0
        self._failure: BadChunk | None = None
        self._waiters: list[tuple[int, Callable[[], None]]] = []
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="rh-dask-engine", daemon=True)
        self._thread.start()
        self._limit = self.call(lambda: blas_limiter(blas_threads))
        try:
            self.engine: Engine = self.call(factory)
        except BaseException:
            self.close()
            raise

    # -- commands, run on the engine thread between chunks ----------------------------
    def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn()`` on the engine thread and return its result."""
        if threading.current_thread() is self._thread:
            return fn()
        future: Future[Any] = Future()
        with self._cond:
            if self._closed:
                raise RuntimeError("the engine thread is closed")
            self._commands.append((fn, future))
            self._cond.notify_all()
        return future.result()

    def begin(self, stream_id: str, state: HuberState | None) -> None:
        """Start a stream from ``state`` (``None``: from the empty state)."""

        def load() -> None:
            if state is None:
                self.engine.reset()
            else:
                self.engine.import_state(state)

        self.call(load)
        with self._cond:
            self._stream = stream_id
            self._inbox.clear()
            self._next = 0
            self._records = []
            self._n_empty = 0
            self._failure = None

    def end(self, stream_id: str) -> HuberState | None:
        """Stop the stream, drop undelivered chunks, return the engine's state."""
        with self._cond:
            if self._stream == stream_id:
                self._stream = None
            self._inbox.clear()
        self._wake_all()
        # Runs after the chunk in progress, if any: commands queue behind it.
        return self.call(lambda: self.engine.export_state() if self.engine.batch_count else None)

    def close(self) -> None:
        """Stop the thread (after the chunk in progress); idempotent."""
        with self._cond:
            self._closed = True
            self._stream = None
            self._inbox.clear()
            self._cond.notify_all()
        self._wake_all()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=60)

    # -- feeding and watching -----------------------------------------------------------
    def deliver(self, stream_id: str, item: ChunkItem) -> bool:
        """Hand over a loaded chunk (any thread, any order); False if stale."""
        with self._cond:
            if stream_id != self._stream or item.index < self._next:
                return False
            self._inbox[item.index] = item
            if item.index == self._next:
                self._cond.notify_all()
            return True

    def snapshot(self, n_records_seen: int = 0) -> Progress:
        with self._cond:
            return Progress(
                consumed=self._next,
                records=self._records[n_records_seen:],
                n_empty=self._n_empty,
                failure=self._failure,
            )

    def add_waiter(self, target: int, callback: Callable[[], None]) -> Callable[[], None]:
        """Call ``callback`` (from any thread) once ``target`` chunks are consumed.

        Also called at a failure or when the stream ends. Returns a function
        removing the waiter.
        """
        entry = (target, callback)
        with self._cond:
            fire = self._next >= target or self._failure is not None or self._stream is None
            if not fire:
                self._waiters.append(entry)
        if fire:
            callback()

        def remove() -> None:
            with self._cond:
                if entry in self._waiters:
                    self._waiters.remove(entry)

        return remove

    def _notify(self) -> None:
        with self._cond:
            stop = self._failure is not None or self._stream is None
            due = [w for w in self._waiters if stop or self._next >= w[0]]
            for w in due:
                self._waiters.remove(w)
        for _, callback in due:
            callback()

    def _wake_all(self) -> None:
        with self._cond:
            due, self._waiters = self._waiters, []
        for _, callback in due:
            callback()

    # -- the engine thread ----------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while True:
                    if self._commands:
                        fn, future = self._commands.popleft()
                        item = None
                        break
                    if self._closed:
                        return
                    if (
                        self._stream is not None
                        and self._failure is None
                        and self._next in self._inbox
                    ):
                        item = self._inbox.pop(self._next)
                        break
                    self._cond.wait()
            if item is None:
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(fn())
                    except BaseException as exc:
                        future.set_exception(exc)
                continue
            self._consume(item)
            item = None  # drop the batch now: look-ahead memory stays bounded
            self._notify()

    def _consume(self, item: ChunkItem) -> None:
        if isinstance(item, EmptyChunk):
            with self._cond:
                self._n_empty += 1
                self._next += 1
            return
        if isinstance(item, BadChunk):
            with self._cond:
                self._failure = item
            return
        start = time.perf_counter()
        try:
            with self._limit():
                diag = self.engine.partial_fit(item.X, item.y, item.sample_weight)
        except Exception as exc:  # the engine refused the batch; its state is unchanged
            with self._cond:
                self._failure = BadChunk(item.index, f"{type(exc).__name__}: {exc}", exc)
            return
        record = BatchRecord(
            chunk=item.index,
            rows=item.rows,
            iterations=int(diag.iterations),
            converged=bool(diag.converged),
            objective=float(diag.objective),
            lambda_value=float(diag.lambda_value),
            bandwidth=float(diag.bandwidth),
            seconds=time.perf_counter() - start,
        )
        with self._cond:
            self._records.append(record)
            self._next += 1
