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
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

from ..engines import Engine
from ..engines.blas_threads import one_blas_thread
from ..exceptions import ValidationError
from ..state import OPTIONAL_DIAGNOSTICS, BatchDiagnostics, HuberState
from ..stream import BatchRecord
from .items import BadChunk, ChunkItem, EmptyChunk, LoadedChunk


@dataclass(frozen=True)
class StreamSnapshot:
    """The stream's state after a chunk, copied off the engine on its thread.

    Attributes
    ----------
    consumed : int
        The next chunk to consume from this state (an absolute chunk index).
    n_empty : int
        Empty chunks skipped since the stream began on this consumer.
    n_records : int
        Records of this consumer's stream that led to this state.
    state : HuberState
        A host copy of the state.
    """

    consumed: int
    n_empty: int
    n_records: int
    state: HuberState


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
    checkpoint : StreamSnapshot or None
        The latest stream checkpoint, when it is newer than the one the
        caller said it has.
    choice : object, optional
        What the consumer's ``starter`` said about the engine it built at
        the first chunk (an :class:`~rh_dask.engines.auto.AutoChoice` for
        ``engine="auto"``); ``None`` for an engine built up front.
    """

    consumed: int
    records: list[BatchRecord]
    n_empty: int
    failure: BadChunk | None
    checkpoint: StreamSnapshot | None = None
    choice: Any = None


#: BLAS threads of every engine call of a stream (actor and in-process walk alike).
#:
#: The NumPy engine already runs each BLAS call on one thread and sums its
#: row blocks in a fixed order, so its bits do not depend on this. The pin
#: covers whatever else runs on the engine thread (``engine="auto"``'s
#: probes, host-side work of other engines) and keeps OpenBLAS's threads
#: from spinning after each call: a larger count in a worker that also loads
#: chunks slowed the NumPy engine down up to 15x on a 2-core machine. Not a
#: ``dask.config`` setting: a stream's results must not depend on where or
#: how it ran.
STREAM_BLAS_THREADS = 1


def blas_limiter(threads: int | None) -> Callable[[], AbstractContextManager[Any]]:
    """A context factory pinning BLAS to one thread (``threads=1``), or a no-op (``None``).

    The pin is :func:`~rh_dask.engines.blas_threads.one_blas_thread`, the
    engines' own: it holds while another thread of the process controls
    OpenBLAS's count (threadpoolctl >= 3.8 ignores the others' calls) and
    restores the count in force only when the last thread inside leaves.

    Raises
    ------
    ValueError
        For a count other than 1 or ``None``: the engines compute on one
        BLAS thread, so no other count is kept.
    """
    if threads is None:
        return nullcontext
    if threads != 1:
        raise ValueError(f"blas_threads must be 1 or None, got {threads!r}")
    return one_blas_thread


class OrderedConsumer:
    """Own an engine on a dedicated thread and feed it chunks in index order.

    Parameters
    ----------
    factory : callable or None
        Builds the engine; runs on the consumer's thread. ``None`` with a
        ``starter``: the engine is built at the stream's first batch.
    blas_threads : int or None
        1 to run engine calls with BLAS on one thread, ``None`` to leave it
        as it is; see :data:`STREAM_BLAS_THREADS` and :func:`blas_limiter`.
    starter : callable, optional
        ``starter(first, engine) -> (engine, choice)``: the engine of a
        stream that begins from the empty state, decided from its first
        loaded chunk (``engine="auto"`` decides on its shape), on the
        consumer's thread and under the BLAS limit of the engine calls.
        ``engine`` is the one the last stream used (``None`` at first), to
        keep when the decision is the same. ``choice`` is reported in
        :attr:`Progress.choice`. When it raises, the stream stops at that
        chunk with the error as the :class:`BadChunk`'s cause. The
        :attr:`starter` attribute may be replaced between streams.

    Raises
    ------
    Exception
        Whatever ``factory`` raises (e.g. ``EngineUnavailableError``).
    ValueError
        When neither or both of ``factory`` and ``starter`` are given, or
        ``blas_threads`` is neither 1 nor ``None``.
    """

    def __init__(
        self,
        factory: Callable[[], Engine] | None,
        blas_threads: int | None = None,
        *,
        starter: Callable[[LoadedChunk, Engine | None], tuple[Engine, Any]] | None = None,
    ) -> None:
        if (factory is None) == (starter is None):
            raise ValueError("OrderedConsumer needs exactly one of factory and starter")
        self._limit = blas_limiter(blas_threads)
        self.starter = starter
        self.choice: Any = None
        #: ``(ring, pinning)`` of the relay ring kept with this engine between
        #: streams (set and taken by :mod:`.actor`, closed by :mod:`.shelf`).
        self.kept_ring: tuple[Any, Any] | None = None
        self._decide = False  # the running stream's engine is decided at its first chunk
        self._cond = threading.Condition()
        self._commands: deque[tuple[Callable[[], Any], Future[Any]]] = deque()
        self._inbox: dict[int, ChunkItem] = {}
        self._stream: str | None = None
        self._next = 0
        self._records: list[BatchRecord] = []
        self._n_empty = 0
        self._failure: BadChunk | None = None
        self._waiters: list[tuple[int, int | None, Callable[[], None]]] = []
        self._every_chunks = 0
        self._every_seconds = 0.0
        self._checkpoint: StreamSnapshot | None = None
        self._checkpoint_from = 0
        self._checkpoint_time = 0.0
        self._closed = False
        self._waited = 0.0  # idle time of the engine thread since the last record
        self._thread = threading.Thread(target=self._run, name="rh-dask-engine", daemon=True)
        self._thread.start()
        self.engine: Engine | None = None
        if factory is not None:
            try:
                self.engine = self.call(factory)
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

    def begin(
        self,
        stream_id: str,
        state: HuberState | None,
        start: int = 0,
        every_chunks: int = 0,
        every_seconds: float = 0.0,
    ) -> None:
        """Start a stream from ``state`` (``None``: from the empty state) at chunk ``start``.

        After a chunk, the state is copied into a :class:`StreamSnapshot`
        (see :meth:`snapshot`) once ``every_chunks`` chunks were consumed
        since the last one, or ``every_seconds`` have passed (0: never by
        that rule).
        """

        def load() -> None:
            if self.engine is None:
                if state is not None:
                    raise ValueError(
                        "an engine decided at the first chunk starts from the empty state; "
                        "a stream going on from a state names its engine"
                    )
            elif state is None:
                self.engine.reset()
            else:
                self.engine.import_state(state)

        self.call(load)
        with self._cond:
            self._decide = self.starter is not None and state is None
            if self._decide:
                self.choice = None
            self._stream = stream_id
            self._inbox.clear()
            self._next = int(start)
            self._records = []
            self._n_empty = 0
            self._failure = None
            self._waited = 0.0
            self._every_chunks = int(every_chunks)
            self._every_seconds = float(every_seconds)
            self._checkpoint = None
            self._checkpoint_from = int(start)
            self._checkpoint_time = time.monotonic()

    def end(self, stream_id: str, n_records_seen: int = 0) -> tuple[HuberState | None, Progress]:
        """Stop the stream and drop undelivered chunks.

        Returns the engine's state and the final progress (records after the
        first ``n_records_seen``), both taken on the engine thread after the
        chunk in progress, so that they describe the same chunks.
        """
        with self._cond:
            if self._stream == stream_id:
                self._stream = None
            self._inbox.clear()
        self._wake_all()

        def final() -> tuple[HuberState | None, Progress]:
            engine = self.engine
            state = engine.export_state() if engine is not None and engine.batch_count else None
            return state, self.snapshot(n_records_seen)

        return self.call(final)

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

    @property
    def consumed(self) -> int:
        """Chunks of the current stream dealt with so far."""
        with self._cond:
            return self._next

    @property
    def failure(self) -> BadChunk | None:
        """The chunk that stopped the current (or last) stream, if one did."""
        with self._cond:
            return self._failure

    @property
    def running(self) -> bool:
        """Whether the engine thread is alive and not closed."""
        with self._cond:
            return not self._closed and self._thread.is_alive()

    def active(self, stream_id: str) -> bool:
        """Whether ``stream_id`` is the running stream and has not failed."""
        with self._cond:
            return self._stream == stream_id and self._failure is None and not self._closed

    def snapshot(self, n_records_seen: int = 0, checkpoint_after: int | None = None) -> Progress:
        """Progress since the caller's ``n_records_seen`` records.

        With ``checkpoint_after`` (the ``consumed`` of the newest checkpoint
        the caller holds, -1 for none), a newer checkpoint comes with it.
        """
        with self._cond:
            checkpoint = self._checkpoint
            if checkpoint_after is None or (
                checkpoint is not None and checkpoint.consumed <= checkpoint_after
            ):
                checkpoint = None
            return Progress(
                consumed=self._next,
                records=self._records[n_records_seen:],
                n_empty=self._n_empty,
                failure=self._failure,
                checkpoint=checkpoint,
                choice=self.choice,
            )

    def add_waiter(
        self, target: int, callback: Callable[[], None], checkpoint_after: int | None = None
    ) -> Callable[[], None]:
        """Call ``callback`` (from any thread) once ``target`` chunks are consumed.

        Also called at a failure, when the stream ends, and (with
        ``checkpoint_after``) once a checkpoint after that chunk exists.
        Returns a function removing the waiter.
        """
        entry = (target, checkpoint_after, callback)
        with self._cond:
            fire = self._due(target, checkpoint_after)
            if not fire:
                self._waiters.append(entry)
        if fire:
            callback()

        def remove() -> None:
            with self._cond:
                if entry in self._waiters:
                    self._waiters.remove(entry)

        return remove

    def _due(self, target: int, checkpoint_after: int | None) -> bool:
        """Whether a waiter for ``target`` is due (call with the lock held)."""
        if self._next >= target or self._failure is not None or self._stream is None:
            return True
        checkpoint = self._checkpoint
        return (
            checkpoint_after is not None
            and checkpoint is not None
            and checkpoint.consumed > checkpoint_after
        )

    def _notify(self) -> None:
        with self._cond:
            due = [w for w in self._waiters if self._due(w[0], w[1])]
            for w in due:
                self._waiters.remove(w)
        for *_, callback in due:
            callback()

    def _wake_all(self) -> None:
        with self._cond:
            due, self._waiters = self._waiters, []
        for *_, callback in due:
            callback()

    def _maybe_checkpoint(self) -> None:
        """Copy the state into a :class:`StreamSnapshot` when one is due (engine thread).

        The copy is p + p² numbers (a device-to-host copy for the GPU engine),
        made between two batches; a stream that has consumed no batch has
        nothing to keep yet.
        """
        with self._cond:
            since = self._next - self._checkpoint_from
            if since <= 0 or self.engine is None or not self.engine.batch_count:
                return
            chunks_due = self._every_chunks and since >= self._every_chunks
            now = time.monotonic()
            time_due = self._every_seconds and now - self._checkpoint_time >= self._every_seconds
            if not (chunks_due or time_due):
                return
            consumed, n_empty, n_records = self._next, self._n_empty, len(self._records)
        state = self.engine.export_state()
        with self._cond:
            self._checkpoint = StreamSnapshot(consumed, n_empty, n_records, state)
            self._checkpoint_from = consumed
            self._checkpoint_time = now

    # -- the engine thread ----------------------------------------------------------------
    def _ready(self) -> bool:
        """Whether the next chunk can be consumed now (call with the lock held)."""
        return self._stream is not None and self._failure is None and self._next in self._inbox

    def _run(self) -> None:
        while True:
            with self._cond:
                while not (self._commands or self._closed or self._ready()):
                    idle_from = time.perf_counter()
                    self._cond.wait()
                    if self._stream is not None:
                        self._waited += time.perf_counter() - idle_from
                if self._commands:
                    fn, future = self._commands.popleft()
                elif self._closed:
                    return
                else:
                    fn = None
            if fn is not None:
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(fn())
                    except BaseException as exc:
                        future.set_exception(exc)
                continue
            if self._decide:
                self._start_engine()  # then round again: the stream may have ended meanwhile
                self._notify()
                continue
            if callable(getattr(self.engine, "partial_fit_stream", None)):
                self._fit_run()
            else:
                with self._cond:
                    item = self._inbox.pop(self._next)
                self._consume(item)
                item = None  # drop the batch now: look-ahead memory stays bounded
                self._maybe_checkpoint()
            self._notify()

    def _start_engine(self) -> bool:
        """Decide the engine at the next chunk (``starter``); whether it was decided.

        Empty chunks before the first batch are skipped and a bad one stops
        the stream, as with an engine built up front; a ``starter`` that
        raises stops the stream at the chunk it was given.
        """
        with self._cond:
            item = self._inbox.get(self._next)
            if item is None:  # the stream ended meanwhile
                return False
            if not isinstance(item, LoadedChunk):
                del self._inbox[self._next]
        if not isinstance(item, LoadedChunk):
            self._consume(item)
            return False
        assert self.starter is not None
        try:
            with self._limit():
                engine, choice = self.starter(item, self.engine)
        except Exception as exc:
            with self._cond:
                self._inbox.pop(item.index, None)
                self._failure = BadChunk(
                    item.index,
                    f"{type(exc).__name__}: {exc}",
                    exc,
                    verb="could not start the engine",
                )
            return False
        with self._cond:
            self.engine, self.choice, self._decide = engine, choice, False
        return True

    def _record(self, item: LoadedChunk, diag: Any, seconds: float) -> None:
        """Record a batch the engine has finished; runs on the engine thread.

        β is read here, once the batch's diagnostics are out: for the GPU
        engine a copy of p numbers to the host after its solve (next to a ~1 ms
        batch), and inside ``partial_fit_stream`` only between two yields, so
        the copy of the next batch keeps overlapping its solve.
        """
        record = BatchRecord(
            batch=self.engine.batch_count - 1,
            chunk=item.index,
            rows=item.rows,
            diagnostics=BatchDiagnostics(
                iterations=int(diag.iterations),
                converged=bool(diag.converged),
                objective=float(diag.objective),
                lambda_value=float(diag.lambda_value),
                bandwidth=float(diag.bandwidth),
                **{
                    name: None if getattr(diag, name, None) is None else float(getattr(diag, name))
                    for name in OPTIONAL_DIAGNOSTICS
                },
            ),
            seconds=seconds,
            # A host copy in the engine's dtype: what crosses to the client is small.
            coefficients=self.engine.coefficients(),
            wait_seconds=self._waited,
        )
        self._waited = 0.0
        with self._cond:
            self._records.append(record)
            self._next += 1

    def _consume(self, item: ChunkItem) -> None:
        """One chunk through ``Engine.partial_fit``."""
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
            verb = "was refused" if isinstance(exc, ValidationError) else "failed in the engine"
            with self._cond:
                self._failure = BadChunk(
                    item.index, f"{type(exc).__name__}: {exc}", exc, verb=verb
                )
            return
        self._record(item, diag, time.perf_counter() - start)

    def _settle_empty(self, pending: deque[ChunkItem]) -> None:
        while pending and isinstance(pending[0], EmptyChunk):
            pending.popleft()
            with self._cond:
                self._n_empty += 1
                self._next += 1

    def _fit_run(self) -> None:
        """The chunks already delivered, through the engine's ``partial_fit_stream``.

        An engine offering ``partial_fit_stream`` (the GPU engine) copies batch
        ``i + 1`` to its device while it solves batch ``i``. It pulls the next
        batch before solving the current one, so the generator below only
        hands out chunks that are already here and ends the run otherwise:
        the engine never waits for a load with a solved-ready batch in hand.
        """
        pending: deque[ChunkItem] = deque()  # handed to the engine, not yet settled
        stopped: list[BadChunk] = []
        cursor = self._next

        def batches() -> Iterator[tuple[Any, Any, Any]]:
            nonlocal cursor
            while True:
                with self._cond:
                    if self._commands or self._closed or self._stream is None:
                        return
                    item = self._inbox.pop(cursor, None)
                if item is None:
                    return
                cursor += 1
                if isinstance(item, BadChunk):
                    stopped.append(item)
                    return
                pending.append(item)
                if isinstance(item, LoadedChunk):
                    yield item.X, item.y, item.sample_weight

        start = time.perf_counter()
        try:
            with self._limit():
                for diag in self.engine.partial_fit_stream(batches()):
                    now = time.perf_counter()
                    self._settle_empty(pending)
                    self._record(pending.popleft(), diag, now - start)  # type: ignore[arg-type]
                    self._maybe_checkpoint()
                    start = now
                    self._notify()
        except Exception:
            # The stream may have failed while staging the *next* batch: put the
            # unsettled chunks back and retry the oldest alone (engines are
            # atomic on failure), which names the chunk that really failed.
            self._settle_empty(pending)
            with self._cond:
                for item in [*pending, *stopped]:
                    self._inbox[item.index] = item
                retry = self._inbox.pop(self._next, None)
            if retry is not None:
                self._consume(retry)
            return
        self._settle_empty(pending)
        if stopped:
            with self._cond:
                self._failure = stopped[0]
