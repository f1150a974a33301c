"""The engine actor: one engine resident on one worker for a whole stream.

The actor is a ``dask.distributed`` Actor wrapping an :class:`OrderedConsumer`.
Chunks never reach it through actor calls (a Future passed to an actor method
arrives unresolved, and every call is a round trip). Either the actor's
worker computes them itself (``feed``: the chunk plan once, then a
:class:`~.feeder.ChunkFeeder`), or each chunk's own task, pinned to the
actor's worker, finds the actor in that worker's memory and drops the loaded
batch into its inbox (:func:`deliver_chunk`). The coordinator's calls are
``begin``, ``feed`` (with that loader), a long-polling ``progress`` and
``end``, then ``close``, which parks a cleanly stopped engine on the worker
for the next actor (:mod:`.shelf`). With ``loader="relay"`` chunks reach the
actor through the stream's shared-memory ring instead (``open_relay``,
``seal_relay``, :mod:`.relay`): relay workers on this node write them there.

When the engine offers a pinned pool (the GPU engine), the delivering task
copies its batch into page-locked memory before handing it over. The copy
then runs on the loading threads, in parallel, and the engine's own thread
only queues a DMA, instead of copying every batch through its staging
buffers itself.

With ``engine="auto"`` the actor builds its engine at the stream's first
chunk, on the engine's thread: :func:`~rh_dask.engines.auto.choose_engine`
decides from that chunk's shape, dtype and whether it is on a CUDA device,
with the client's settings and under the stream's BLAS limit, and a GPU
engine chosen by measurement that fails to start gives way to the NumPy
engine (:func:`~rh_dask.engines.auto.start_chosen`). The choice travels
back to the client in every :class:`~.consumer.Progress`.
"""

from __future__ import annotations

import asyncio
import logging
import mmap
from collections.abc import Callable
from typing import Any

import numpy as np
from distributed import get_worker

from ..config import HuberConfig
from ..engines import Engine, make_engine
from ..engines.auto import AutoChoice, choose_engine, start_chosen
from ..settings import Settings
from ..state import HuberState
from ..validation import is_device_array
from . import memory, shelf
from .chunks import ChunkGraph
from .consumer import OrderedConsumer, Progress
from .feeder import ChunkFeeder
from .items import ChunkItem, LoadedChunk
from .loading import assemble_chunk
from .relay import RelayReceiver
from .ring import ChunkRing, RingSpec, default_directory
from .ring_pinning import RingPinning, release_ring

logger = logging.getLogger(__name__)


class EngineActor:
    """Holds one engine on its worker and consumes delivered chunks in order.

    Parameters
    ----------
    engine : {"numpy", "gpu", "auto"}
        Engine to build on the worker; ``"auto"``: chosen here at the
        stream's first chunk (see the module's description). An ``"auto"``
        actor takes an engine parked by an earlier ``"auto"`` stream and keeps
        it when its own choice names the same engine.
    config : HuberConfig
        The stream's configuration.
    device : str, int or None
        Passed to :func:`rh_dask.engines.make_engine` (``None``: the worker's
        default device; a dask-cuda worker sees its GPU as device 0).
    blas_threads : int or None
        BLAS threads for engine calls (see
        :data:`~rh_dask.distributed.consumer.STREAM_BLAS_THREADS`).
    settings : Settings, optional
        The ``rh-dask`` settings the client read for this stream (default: the
        packaged defaults); this worker's own :mod:`dask.config` is not read.
        The actor uses ``pin_max_bytes`` and ``pin_mapped`` (which delivered
        chunks it copies into the engine's pinned pool, when it has one),
        ``engine_keep`` (how long the engine stays parked on this worker after
        a clean stream, see :mod:`.shelf`), ``heap_for_chunks`` (this worker's
        malloc keeps chunk-sized allocations on its heap while a stream runs,
        see :mod:`.memory`; restored when it ends) and the engine's options
        (:meth:`Settings.engine_options`).
    """

    def __init__(
        self,
        engine: str,
        config: HuberConfig,
        device: Any = None,
        blas_threads: int | None = None,
        settings: Settings | None = None,
    ) -> None:
        self.settings = Settings() if settings is None else settings
        self._restore_heap: Callable[[], None] | None = None
        self._config, self._device, self._blas_threads = config, device, blas_threads
        self._pool: Any = None
        self._shelf_key = self._key(engine)
        self._auto = engine == "auto"
        warm = shelf.take(self._shelf_key)
        self.reused = warm is not None
        if engine == "auto":
            self._consumer = warm or OrderedConsumer(
                None, blas_threads=blas_threads, starter=self._start_auto
            )
            # This stream's settings decide, not those of the stream that parked it.
            self._consumer.starter = self._start_auto
        else:
            self._consumer = warm or OrderedConsumer(
                lambda: make_engine(engine, config, device, settings=self.settings),
                blas_threads=blas_threads,
            )
            self._pool = getattr(self._consumer.engine, "pinned_pool", None)
        self._closed = False
        self._feeder: ChunkFeeder | None = None
        self._relay: tuple[ChunkRing, RelayReceiver] | None = None
        self._ring_pin: RingPinning | None = None
        # The ring an earlier stream left with this engine (keep-ring): taken
        # by the next relayed stream of its shape, else closed.
        self._kept: tuple[ChunkRing, RingPinning | None] | None = self._consumer.kept_ring
        self._consumer.kept_ring = None

    def _key(self, engine: str) -> tuple[Any, ...]:
        """The shelf key of this actor's engine when it is ``engine``."""
        # An "auto" engine may be the GPU engine: built with the GPU's options.
        options = self.settings.engine_options("gpu" if engine == "auto" else engine)
        # Workers of one process (a threaded LocalCluster) each keep their own;
        # an engine built with other options is never taken for this stream.
        return (
            _worker_address(),
            engine,
            self._config,
            self._device,
            self._blas_threads,
            tuple(sorted(options.items())),
        )

    def _start_auto(self, first: LoadedChunk, current: Engine | None) -> tuple[Engine, AutoChoice]:
        """``engine="auto"``: the engine chosen for the first chunk (on the engine thread).

        ``current``, the engine of the consumer's last stream, is kept when
        it is the one chosen; otherwise it is closed and the chosen one built.
        """
        rows, features = (int(n) for n in first.X.shape)
        choice = choose_engine(
            self._config,
            rows,
            features,
            device=self._device,
            device_input=is_device_array(first.X),
            settings=self.settings,
        )
        if current is not None and current.name == choice.engine:
            self._pool = getattr(current, "pinned_pool", None)
            return current, choice
        if current is not None and callable(getattr(current, "close", None)):
            current.close()
        engine, choice = start_chosen(choice, self._config, self._device, settings=self.settings)
        if choice.fallback is not None:
            logger.warning(
                'engine="auto" chose the GPU engine, but it failed to start (%s); '
                "this stream runs on the NumPy engine",
                choice.fallback,
            )
        self._pool = getattr(engine, "pinned_pool", None)
        return engine, choice

    def begin(
        self,
        stream_id: str,
        state: HuberState | None,
        start: int = 0,
        every_chunks: int = 0,
        every_seconds: float = 0.0,
    ) -> bool:
        """Start a stream from ``state`` (``None``: the empty state) at chunk ``start``.

        ``every_chunks`` and ``every_seconds`` say when the state is copied
        off the engine for the coordinator's stream checkpoints (see
        :meth:`OrderedConsumer.begin`). Returns whether the engine was taken
        warm from this worker's shelf.
        """
        self._consumer.begin(stream_id, state, start, every_chunks, every_seconds)
        if self.settings.heap_for_chunks and self._restore_heap is None:
            self._restore_heap = memory.heap_for_chunks()
        return self.reused

    def feed(self, stream_id: str, graph: ChunkGraph, lookahead: int, threads: int) -> None:
        """Load the stream's chunks on this worker (``loader="actor"``), see :mod:`.feeder`."""
        self._stop_feeder()
        self._feeder = ChunkFeeder(
            graph, self._consumer, stream_id, lookahead, threads, self._pinned
        )
        self._feeder.start()

    def open_relay(self, stream_id: str, start: int, n_slots: int, slot_bytes: int) -> RingSpec:
        """Make the stream's shared-memory ring and listen for relays (``loader="relay"``).

        Returns what relays attach with (:func:`~.relay.attach_relay`); the
        coordinator then calls :meth:`seal_relay`. See :mod:`.relay`.

        Raises
        ------
        RingError
            When the ring's directory (``rh-dask.relay.directory``) cannot hold it.
        """
        self._close_relay()
        directory = self.settings.relay_directory
        if directory == "auto":
            directory = default_directory()
        heap = self.settings.relay_heap_for_chunks
        ring, pin = self._kept_ring(directory, n_slots, slot_bytes, start)
        if ring is None:
            ring = ChunkRing.create(
                directory,
                n_slots,
                slot_bytes,
                start,
                heap_for_chunks=heap,
                keep=self.settings.relay_keep_ring,
            )
        try:
            receiver = RelayReceiver(ring, lambda item: self._relayed(stream_id, ring, item))
        except BaseException:
            if pin is not None:
                pin.close()
            ring.close()
            raise
        receiver.start()
        self._relay = (ring, receiver)
        if pin is None and self.settings.relay_pin_ring:
            pin = RingPinning(ring)
        self._ring_pin = pin
        if pin is not None:
            pin.start(self._pool)  # with engine="auto": at the first chunk
        return ring.spec

    def _kept_ring(
        self, directory: str, n_slots: int, slot_bytes: int, start: int
    ) -> tuple[ChunkRing | None, RingPinning | None]:
        """The kept ring renewed for this stream when its shape and settings fit, else none."""
        kept, self._kept = self._kept, None
        if kept is None:
            return None, None
        ring, pin = kept
        heap = self.settings.relay_heap_for_chunks
        fits = self.settings.relay_keep_ring and ring.fits(directory, n_slots, slot_bytes, heap)
        renewed = ring.renew(start) if fits else None
        if renewed is None:
            release_ring(ring, pin)
            return None, None
        if pin is not None and not self.settings.relay_pin_ring:
            release_ring(None, pin)  # this stream leaves the ring pageable
            pin = None
        return ring, pin

    def seal_relay(self) -> int:
        """Stop accepting relays; the ring leaves the filesystem. Returns the relays connected."""
        if self._relay is None:
            return 0
        _, receiver = self._relay
        receiver.seal()
        return receiver.connections

    def _relayed(self, stream_id: str, ring: ChunkRing, item: ChunkItem) -> None:
        """A chunk a relay put in the ring: staged, delivered, its slot freed once consumed."""
        index = item.index
        pin = self._ring_pin
        if pin is not None:
            pin.start(self._pool)
        if pin is None or not pin.holds(item):
            item = self._pinned(item)
        self._consumer.deliver(stream_id, item)
        # The slot may take a later chunk once the engine is done with this
        # one (or the stream stopped); the pinned copy, if made, needs it no more.
        self._consumer.add_waiter(index + 1, lambda: ring.release(index))

    def _close_relay(self, keep: bool = False) -> None:
        """End the stream's relaying; with ``keep``, the ring stays for the next stream."""
        if self._relay is not None:
            ring, receiver = self._relay
            pin, self._ring_pin = self._ring_pin, None
            self._relay = None
            receiver.close()
            if not (keep and ring.renewable):
                release_ring(ring, pin)
                return
            if pin is not None and (self._auto or pin.error is not None):
                # engine="auto" may close this engine (and its pinned pool) for the
                # next stream's choice: the ring is kept, its locking is not.
                release_ring(None, pin)
                pin = None
            self._kept = (ring, pin)

    def end(self, stream_id: str, n_records: int = 0) -> tuple[HuberState | None, Progress]:
        """Stop the stream; the state after the last consumed chunk and the final progress."""
        try:
            return self._consumer.end(stream_id, n_records)
        finally:
            self._stop_feeder()
            self._close_relay(keep=self._consumer.failure is None)
            self._restore_worker_settings()

    def _stop_feeder(self) -> None:
        # Ending the stream wakes the feeder, which then stops submitting.
        if self._feeder is not None:
            self._feeder.join(timeout=60)
            self._feeder = None

    def close(self) -> None:
        """Park the engine on this worker's shelf after a clean stream, else close it."""
        if self._closed:
            return
        self._closed = True
        self._restore_worker_settings()
        self._stop_feeder()
        self._close_relay()
        clean = self._consumer.failure is None and self._consumer.running
        keep = self.settings.engine_keep if clean else 0.0
        kept, self._kept = self._kept, None
        if kept is not None:
            if keep > 0:
                self._consumer.kept_ring = kept  # parked with the engine, closed with it
            else:
                release_ring(*kept)
        shelf.park(self._shelf_key, self._consumer, keep)

    def _restore_worker_settings(self) -> None:
        if self._restore_heap is not None:
            self._restore_heap()
            self._restore_heap = None

    def deliver(self, stream_id: str, item: ChunkItem) -> bool:
        """In-process hand-over from a chunk task on this worker (not an RPC)."""
        return self._consumer.deliver(stream_id, self._pinned(item))

    def _pinned(self, item: ChunkItem) -> ChunkItem:
        """The batch copied into the engine's pinned pool (on the calling thread)."""
        if self._pool is None or not isinstance(item, LoadedChunk):
            return item
        if not isinstance(item.X, np.ndarray):
            return item  # device arrays need no staging
        settings = self.settings
        if item.nbytes > settings.pin_max_bytes and not (settings.pin_mapped and _mapped(item.X)):
            return item
        try:
            # Never waits for pinned memory: while the pool grows (in the
            # background) a chunk goes as it is, and the engine stages it.
            pinned = self._pool.copy_batch(item.X, item.y, item.sample_weight, wait=False)
        except Exception as exc:  # a chunk the pool cannot take: the engine stages it
            logger.warning("chunk %d not copied to pinned memory (%s)", item.index, exc)
            return item
        return item if pinned is None else LoadedChunk(item.index, *pinned)

    async def progress(
        self,
        n_consumed: int,
        n_records: int,
        min_new: int,
        timeout: float,
        checkpoint_after: int | None = None,
    ) -> Progress:
        """Wait until ``n_consumed + min_new`` chunks are consumed (or failure/end/timeout).

        With ``checkpoint_after`` (the chunk of the caller's newest stream
        checkpoint, -1 for none) it also answers as soon as a newer
        checkpoint exists, and the answer carries it. Runs on the worker's
        event loop, not on the actor thread, so waiting here never blocks
        the engine or other calls.
        """
        loop = asyncio.get_running_loop()
        event = asyncio.Event()
        remove = self._consumer.add_waiter(
            n_consumed + max(min_new, 1),
            lambda: loop.call_soon_threadsafe(event.set),
            checkpoint_after,
        )
        try:
            await asyncio.wait_for(event.wait(), timeout)
        except asyncio.TimeoutError:
            pass
        finally:
            remove()
        return self._consumer.snapshot(n_records, checkpoint_after)


def _worker_address() -> str | None:
    try:
        return get_worker().address
    except ValueError:  # built outside a worker (tests)
        return None


def _mapped(a: np.ndarray) -> bool:
    """Whether ``a`` is a view of a memory-mapped file (its bytes not read yet).

    The ``mmap`` object itself is looked for: an ``np.memmap`` that travelled
    through pickle is still an ``np.memmap`` but holds its bytes in memory.
    """
    base: Any = a
    while base is not None:
        if isinstance(base, mmap.mmap):
            return True
        base = getattr(base, "base", None)
    return False


def _local_actor(actor_key: str) -> EngineActor:
    try:
        return get_worker().state.actors[actor_key]
    except KeyError:
        raise RuntimeError(f"the engine actor {actor_key} is not on this worker") from None


def deliver_chunk(item: ChunkItem, actor_key: str, stream_id: str) -> int:
    """Task pinned to the actor's worker: hand a loaded chunk to the actor.

    Returns the chunk's size in bytes; the batch itself is kept by the actor
    only, so Dask holds no second reference to it.
    """
    _local_actor(actor_key).deliver(stream_id, item)
    return int(item.nbytes)


def load_and_deliver(
    x_part: Any, y_part: Any, w_part: Any, spec: Any, actor_key: str, stream_id: str
) -> int:
    """Load, validate and deliver a chunk in one task on the actor's worker."""
    return deliver_chunk(assemble_chunk(x_part, y_part, w_part, spec), actor_key, stream_id)
