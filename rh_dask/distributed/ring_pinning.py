"""Page-locking the relay ring in a GPU engine's process.

Relays write each chunk into a slot of the engine's shared-memory ring
(:mod:`.ring`); the engine's process then holds the chunk as views of that
slot. Were the ring ordinary memory, each chunk would be copied once more,
into the engine's pinned pool, before its DMA to the device (the GPU can
only copy asynchronously from page-locked memory). :class:`RingPinning`
page-locks the whole ring instead (through the engine's pinned pool,
``cudaHostRegister``), so the engine copies chunks to its device straight
from their slots and the engine's process copies no chunk bytes at all.

Locking a ring of several hundred megabytes takes a noticeable time (0.17-0.28 s
for 0.8-3 GB in a probe on the H200 host), so it runs on a thread of its own
as the stream starts, one slot at a time: the whole ring in one call held up
the engine's process, for a reason not pinned down (the first chunk's load
started 0.46-0.55 s into the fit against 0.05-0.06 s unlocked,
``benchmarks/results/scale_out-h200-pread-whole-ring-lock.json``). Chunks whose slot is
not locked yet take the pinned pool's copy, as do chunks that did not fit a
slot (they travel in files of their own). A slot is rewritten only after
the engine has consumed its chunk (:meth:`.ring.ChunkRing.release`), and by
then the chunk's DMA is over. :meth:`RingPinning.close` waits for the device
before it unlocks the ring.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from .items import ChunkItem, LoadedChunk
from .ring import ChunkRing

__all__ = ["RingPinning", "release_ring"]

logger = logging.getLogger(__name__)


class RingPinning:
    """Locks ``ring`` for a GPU engine once it knows the engine's pinned pool.

    Parameters
    ----------
    ring : ChunkRing
        The engine's side of the ring; it must stay open until :meth:`close`.
    """

    def __init__(self, ring: ChunkRing) -> None:
        self._ring = ring
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._registrations: list[Any] = []
        self._done = threading.Event()
        self._closed = False
        #: Why the ring could not be locked, if it could not.
        self.error: str | None = None
        #: Seconds the locking took, once done.
        self.seconds: float | None = None

    def start(self, pool: Any) -> None:
        """Begin locking the ring with ``pool.register`` (once; a no-op afterwards)."""
        with self._lock:
            if self._thread is not None or self._closed or pool is None:
                return
            self._thread = threading.Thread(
                target=self._register, args=(pool,), name="rh-dask-ring-pin", daemon=True
            )
            self._thread.start()

    def _register(self, pool: Any) -> None:
        started = time.perf_counter()
        try:
            for address, nbytes in self._ring.slot_ranges():
                with self._lock:
                    if self._closed:
                        return
                registration = pool.register(address, nbytes)
                with self._lock:
                    self._registrations.append(registration)
        except Exception as exc:  # the other slots' chunks keep going through the pinned pool
            self.error = str(exc)
            logger.warning("the chunk ring stays (partly) pageable: %s", exc)
        else:
            self.seconds = time.perf_counter() - started
            logger.debug("page-locked the chunk ring in %.3f s", self.seconds)
        finally:
            self._done.set()

    @property
    def locked(self) -> bool:
        """Whether every slot of the ring is page-locked now."""
        return self._done.is_set() and self.error is None and bool(self._registrations)

    def holds(self, item: ChunkItem) -> bool:
        """Whether ``item``'s arrays all lie in one locked slot (then it needs no copy)."""
        if not isinstance(item, LoadedChunk):
            return False
        arrays = (item.X, item.y, item.sample_weight)
        with self._lock:
            registrations = list(self._registrations)
        return any(all(r.covers(a) for a in arrays) for r in registrations)

    def close(self) -> None:
        """Stop locking, then unlock the slots (after their DMA); idempotent."""
        with self._lock:
            self._closed = True
            thread = self._thread
        if thread is not None:
            thread.join()
        with self._lock:
            registrations, self._registrations = self._registrations, []
        errors = []
        waited = False  # one wait for the device serves every slot after it
        for registration in registrations:
            try:
                registration.close(synchronize=not waited)
                waited = True
            except Exception as exc:  # unlock the others all the same
                errors.append(exc)
        if errors:
            raise errors[0]


def release_ring(ring: ChunkRing | None, pin: RingPinning | None) -> None:
    """Unlock ``pin`` (if any), then close ``ring`` (if any), even when unlocking fails."""
    try:
        if pin is not None:
            pin.close()  # before the ring is unmapped
    except Exception as exc:  # the ring goes all the same
        logger.warning("unlocking the chunk ring failed: %s", exc)
    finally:
        if ring is not None:
            ring.close()
