"""Process-wide host resources of the GPU engine: pinned staging memory and copy threads.

Page-locked memory is expensive to get and to give back: ``cudaHostAlloc``
pins every page and ``cudaFreeHost`` unpins them (together about a
millisecond per megabyte on the H200 host, as inferred from the shape
sweep's cold lifecycle, docs/gpu-engine.md). An engine that staged
its host batches through memory of its own paid both for every fresh
estimator. :class:`HostMemoryPool` keeps that memory for the process instead:
an engine *leases* its staging buffers from the pool of its device and gives
them back when it closes (or is collected); the next engine, or one that
runs beside it, leases them again.

Rules the pool keeps
    A leased buffer belongs to one holder until it is given back: two live
    engines never share one, and closing an engine returns only its own
    leases. A buffer is given back with a *fence* (an object with
    ``synchronize()``, the CUDA event recorded after its last copy), and the
    pool waits for the fence before it hands the buffer out again or frees
    it, so no DMA is ever pending on memory another holder writes. Idle
    buffers are bounded: beyond ``max_idle_bytes`` the longest-idle ones
    are freed (``rh-dask.gpu.pinned-idle-bytes``; 0 keeps none).

Fork and exit
    In a child made by ``fork`` the parent's CUDA context does not exist:
    the pools and thread pools are forgotten there without any CUDA call
    (``os.register_at_fork``), and buffers leased before the fork are
    dropped when given back. At interpreter exit the idle buffers are freed
    while CUDA is still up; buffers given back later (engines collected
    during shutdown) are left to the process's end.

The pool's allocator is two callables (allocate ``nbytes`` → address,
free address), so its bookkeeping runs without CUDA in tests.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from types import ModuleType
from typing import Any

import numpy as np

__all__ = [
    "PINNED_IDLE_BYTES",
    "GiveBackLock",
    "HostMemoryPool",
    "PinnedLease",
    "RawEvent",
    "copy_executor",
    "cuda_allocator",
    "device_pool",
    "prefetch_executor",
]

#: Idle pinned bytes a pool keeps by default (the packaged
#: ``rh-dask.gpu.pinned-idle-bytes``): a few engines' staging slots.
PINNED_IDLE_BYTES = 256 << 20

#: Leases are rounded up to a multiple of this, so that batches of slightly
#: different sizes reuse the same buffers.
LEASE_GRANULE = 1 << 20

#: Threads of the process-wide pool that stages prefetched batches.
PREFETCH_THREADS = 4


class GiveBackLock:
    """A lock, and give-backs that are applied under it without ever waiting for it.

    Buffers come back from finalisers (``__del__``, ``weakref.finalize``),
    which the garbage collector runs on whichever thread happens to allocate,
    possibly one that holds this very lock (an engine in a reference cycle,
    collected in the middle of a lease): a give-back that took the lock there
    would deadlock. :meth:`put` queues the item and applies the queue only if
    the lock is free; every holder applies what was queued meanwhile right
    after it lets the lock go, so nothing stays queued once the lock is idle.

    Parameters
    ----------
    apply : callable
        ``apply(item)``, called with the lock held; returns a callable to run
        after the lock is released (slow work such as freeing), or None.
    """

    def __init__(self, apply: Callable[[Any], Callable[[], None] | None]) -> None:
        self._lock = threading.Lock()
        self._apply = apply
        self._queued: deque[Any] = deque()  # append and popleft are atomic

    def __enter__(self) -> GiveBackLock:
        self._lock.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self._lock.release()
        self.flush()

    def put(self, item: Any) -> None:
        """Queue ``item`` and apply the queue now if nobody holds the lock."""
        self._queued.append(item)
        self.flush()

    def flush(self) -> None:
        """Apply queued items if the lock is free (never waits for it)."""
        while self._queued:
            if not self._lock.acquire(blocking=False):
                return  # its holder applies them when it lets go
            later = []
            try:
                while self._queued:
                    work = self._apply(self._queued.popleft())
                    if work is not None:
                        later.append(work)
            finally:
                self._lock.release()
            for work in later:
                work()


class RawEvent:
    """A CUDA event held by its integer handle, destroyed only by :meth:`close`.

    The fence of a pinned lease. Unlike ``cupy.cuda.Event`` it has no
    finaliser: when an engine in a reference cycle is collected, the
    collector may run the finalisers of the cycle's objects in any order, so
    a CuPy event could be destroyed before the lease that names it as its
    fence gives the memory back, and the pool would later wait on a dangling
    handle (a crash, or ``cudaErrorContextIsDestroyed``). The pool closes
    the fence once it has waited for it; one never closed costs only its
    handle.
    """

    __slots__ = ("_rt", "device_id", "ptr")

    def __init__(self, cp: ModuleType, device_id: int) -> None:
        self._rt = cp.cuda.runtime
        self.device_id = device_id
        with cp.cuda.Device(device_id):
            self.ptr = int(self._rt.eventCreateWithFlags(self._rt.eventDisableTiming))

    def record(self, stream: Any) -> None:
        """Record on ``stream`` (a ``cupy.cuda.Stream``)."""
        self._rt.eventRecord(self.ptr, stream.ptr)

    def synchronize(self) -> None:
        """Block until the work recorded before it is over."""
        if self.ptr:
            self._rt.eventSynchronize(self.ptr)

    def close(self) -> None:
        """Destroy the event (idempotent)."""
        ptr, self.ptr = self.ptr, 0
        if ptr:
            self._rt.eventDestroy(ptr)


class PinnedLease:
    """Page-locked host memory leased from a :class:`HostMemoryPool`.

    ``ptr`` and ``nbytes`` (at least the size asked for) describe it;
    :meth:`view` gives NumPy views of it, which must not outlive the lease;
    :meth:`free` gives it back (idempotent; also done when the lease is
    collected). Set :attr:`fence` to the event recorded after the last
    copy out of the memory before giving it back while a copy may be pending.
    """

    __slots__ = ("__weakref__", "_generation", "_pool", "_raw", "fence", "nbytes", "ptr")

    def __init__(self, pool: HostMemoryPool, ptr: int, nbytes: int, generation: int) -> None:
        self._pool: HostMemoryPool | None = pool
        self._generation = generation
        self.ptr = ptr
        self.nbytes = nbytes
        self._raw = (ctypes.c_char * nbytes).from_address(ptr)
        self.fence: Any = None

    def view(self, dtype: np.dtype | type, count: int, offset: int = 0) -> np.ndarray:
        """A NumPy array of ``count`` items of ``dtype`` at byte ``offset``."""
        if self._pool is None:
            raise RuntimeError("the pinned lease was given back")
        return np.frombuffer(self._raw, dtype=dtype, count=count, offset=offset)

    def free(self) -> None:
        """Give the memory back to the pool (it is not freed: the pool may keep it)."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool._give(self.ptr, self.nbytes, self.fence, self._generation)
            self.fence = None

    def __del__(self) -> None:  # pragma: no cover - interpreter shutdown order varies
        try:
            self.free()
        except Exception:
            pass


class HostMemoryPool:
    """Reusable page-locked host buffers, leased one holder at a time.

    Parameters
    ----------
    allocate : callable
        ``allocate(nbytes) -> int``: a new page-locked buffer's address.
    free : callable
        ``free(address)``: frees a buffer ``allocate`` returned.
    max_idle_bytes : int, default=PINNED_IDLE_BYTES
        The most bytes kept idle; the longest-idle buffers beyond it are freed.
    granule : int, default=LEASE_GRANULE
        Lease sizes are rounded up to a multiple of this.
    fence_factory : callable, optional
        ``fence_factory() -> fence``: a new fence for a holder to set on its
        lease (:class:`RawEvent` for the process's CUDA pools); None lets
        holders choose their own.

    Notes
    -----
    A lease takes the smallest idle buffer that is large enough, else
    allocates one; allocation and freeing run outside the pool's lock, so
    one holder's slow ``cudaHostAlloc`` never blocks another's lease of an
    idle buffer.
    """

    def __init__(
        self,
        allocate: Callable[[int], int],
        free: Callable[[int], None],
        *,
        max_idle_bytes: int = PINNED_IDLE_BYTES,
        granule: int = LEASE_GRANULE,
        fence_factory: Callable[[], Any] | None = None,
    ) -> None:
        self._allocate = allocate
        #: Makes a fence for a lease (None: the holder brings its own).
        self.fence_factory = fence_factory
        self._free = free
        self._granule = max(1, int(granule))
        self._max_idle = _check_bytes(max_idle_bytes)
        self._lock = GiveBackLock(self._take_back)
        # (address, size, fence), longest idle first.
        self._idle: list[tuple[int, int, Any]] = []
        self._generation = 0
        self._closed = False
        self._exiting = False
        #: Bytes held (idle and leased).
        self.allocated_bytes = 0
        #: Bytes leased now.
        self.leased_bytes = 0
        #: Buffers allocated and freed so far, and leases served by an idle buffer.
        self.allocations = 0
        self.frees = 0
        self.reuses = 0

    # -- observation -----------------------------------------------------------------
    @property
    def idle_bytes(self) -> int:
        """Bytes held idle, ready for the next lease."""
        with self._lock:
            return sum(size for _, size, _ in self._idle)

    @property
    def max_idle_bytes(self) -> int:
        """The most bytes kept idle (setting it frees the excess at once)."""
        return self._max_idle

    @max_idle_bytes.setter
    def max_idle_bytes(self, value: int) -> None:
        value = _check_bytes(value)
        with self._lock:
            self._max_idle = value
            drop = self._trim()
        self._release(drop)

    def stats(self) -> dict[str, int]:
        """The pool's counters, for benchmarks and tests."""
        with self._lock:
            idle = sum(size for _, size, _ in self._idle)
            return {
                "allocated_bytes": self.allocated_bytes,
                "leased_bytes": self.leased_bytes,
                "idle_bytes": idle,
                "idle_buffers": len(self._idle),
                "max_idle_bytes": self._max_idle,
                "allocations": self.allocations,
                "frees": self.frees,
                "reuses": self.reuses,
            }

    # -- leasing -----------------------------------------------------------------------
    def lease(self, nbytes: int) -> PinnedLease:
        """At least ``nbytes`` of page-locked memory, this caller's until it gives it back.

        Raises
        ------
        RuntimeError
            When the pool is closed (interpreter exit, or a forked child).
        """
        size = max(-(-max(int(nbytes), 1) // self._granule) * self._granule, self._granule)
        with self._lock:
            if self._closed:
                raise RuntimeError("the pinned host memory pool is closed")
            fitting = [i for i, (_, s, _) in enumerate(self._idle) if s >= size]
            picked = None
            if fitting:
                index = min(fitting, key=lambda i: self._idle[i][1])
                picked = self._idle.pop(index)
                self.leased_bytes += picked[1]
                self.reuses += 1
            generation = self._generation
        if picked is not None:
            ptr, size, fence = picked
            try:
                if fence is not None:
                    fence.synchronize()  # its last copy is over before anyone writes it
            except BaseException:
                self._give(ptr, size, fence, generation)
                raise
            _close_fence(fence)  # the new holder sets a fence of its own
            return PinnedLease(self, ptr, size, generation)
        ptr = int(self._allocate(size))  # outside the lock: pinning takes milliseconds
        with self._lock:
            if self._generation != generation:  # forked meanwhile: not this process's
                raise RuntimeError("the pinned host memory pool was reset by a fork")
            self.allocated_bytes += size
            self.leased_bytes += size
            self.allocations += 1
        return PinnedLease(self, ptr, size, generation)

    def _give(self, ptr: int, size: int, fence: Any, generation: int) -> None:
        """A lease comes back: kept idle (within the bound) or freed.

        Safe from a finaliser on a thread that holds the pool's lock: the
        return is then applied when that thread lets the lock go.
        """
        self._lock.put((ptr, size, fence, generation))

    def _take_back(self, entry: tuple[int, int, Any, int]) -> Callable[[], None] | None:
        """Apply one return (with the lock); what to free afterwards, outside it."""
        ptr, size, fence, generation = entry
        if generation != self._generation:
            return None  # leased before a fork: the parent's memory, never freed here
        self.leased_bytes -= size
        if self._closed:
            self.allocated_bytes -= size
            if self._exiting:
                return None  # the interpreter is going: the process's end releases it
            drop = [(ptr, size, fence)]
        else:
            self._idle.append((ptr, size, fence))
            drop = self._trim()
        return (lambda: self._release(drop)) if drop else None

    def _trim(self) -> list[tuple[int, int, Any]]:
        """Remove the longest-idle buffers beyond the bound (call with the lock)."""
        drop = []
        idle = sum(size for _, size, _ in self._idle)
        while self._idle and idle > self._max_idle:
            entry = self._idle.pop(0)
            idle -= entry[1]
            self.allocated_bytes -= entry[1]
            drop.append(entry)
        return drop

    def _release(self, entries: list[tuple[int, int, Any]]) -> None:
        """Free buffers (outside the lock), each once its last copy is over."""
        for ptr, _, fence in entries:
            if fence is not None:
                fence.synchronize()
            self._free(ptr)
            _close_fence(fence)
            with self._lock:
                self.frees += 1

    # -- lifetime ----------------------------------------------------------------------
    def clear(self) -> None:
        """Free every idle buffer now (leased ones are unaffected)."""
        with self._lock:
            drop, self._idle = self._idle, []
            for _, size, _ in drop:
                self.allocated_bytes -= size
        self._release(drop)

    def shutdown(self) -> None:
        """At interpreter exit: free the idle buffers; later returns are left to the exit."""
        with self._lock:
            self._closed = True
            self._exiting = True
            drop, self._idle = self._idle, []
            for _, size, _ in drop:
                self.allocated_bytes -= size
        for ptr, _, fence in drop:
            try:
                if fence is not None:
                    fence.synchronize()
                self._free(ptr)
                _close_fence(fence)
                self.frees += 1
            except Exception:  # CUDA already torn down: the exit releases it
                pass

    def forget(self) -> None:
        """In a forked child: drop everything without a CUDA call, refuse new leases."""
        self._lock = GiveBackLock(self._take_back)  # the parent may have held it at the fork
        self._generation += 1
        self._idle = []
        self._closed = True
        self._exiting = True
        self.allocated_bytes = self.leased_bytes = 0


def _close_fence(fence: Any) -> None:
    """Destroy a fence the pool has waited for, if it can be (:class:`RawEvent`)."""
    close = getattr(fence, "close", None)
    if close is not None:
        close()


def _check_bytes(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        from rh_dask.exceptions import ValidationError

        raise ValidationError(f"pinned idle bytes must be a whole number >= 0, got {value!r}")
    return int(value)


# -- the process's pools and threads ---------------------------------------------------------

_LOCK = threading.Lock()
_POOLS: dict[int, HostMemoryPool] = {}
_COPY_EXECUTORS: dict[int, ThreadPoolExecutor] = {}
_PREFETCH: list[ThreadPoolExecutor] = []
_EXIT_REGISTERED = False


def cuda_allocator(
    cp: ModuleType, device_id: int
) -> tuple[Callable[[int], int], Callable[[int], None]]:
    """``(allocate, free)`` of portable page-locked memory in ``device_id``'s context."""
    rt = cp.cuda.runtime
    flags = rt.hostAllocPortable

    def allocate(nbytes: int) -> int:
        with cp.cuda.Device(device_id):
            return int(rt.hostAlloc(nbytes, flags))

    def free(ptr: int) -> None:
        # In the device's context too: buffers are freed from whichever thread
        # gives them back last (a finaliser, the exit handler), where another
        # device may be current or none yet (cudaFreeHost would then create
        # device 0's primary context just to free host memory).
        with cp.cuda.Device(device_id):
            rt.freeHost(ptr)

    return allocate, free


def device_pool(cp: ModuleType, device_id: int) -> HostMemoryPool:
    """The process's pinned staging pool for ``device_id`` (created on first use).

    Its buffers are allocated portable (``cudaHostAllocPortable``) in that
    device's context (:func:`cuda_allocator`); its fences are :class:`RawEvent`.
    """
    global _EXIT_REGISTERED
    with _LOCK:
        pool = _POOLS.get(device_id)
        if pool is None:
            pool = HostMemoryPool(
                *cuda_allocator(cp, device_id), fence_factory=lambda: RawEvent(cp, device_id)
            )
            _POOLS[device_id] = pool
            if not _EXIT_REGISTERED:
                # Registered after CuPy is imported, so it runs before CuPy's own
                # exit handlers (atexit runs handlers last-in, first-out).
                atexit.register(_at_exit)
                _EXIT_REGISTERED = True
        return pool


def copy_executor(threads: int) -> ThreadPoolExecutor:
    """The process's threads that copy pageable rows into pinned memory (``threads`` of them).

    Shared by every engine asking for the same count: a copy task never
    waits on another task, so engines copying at once only interleave.
    """
    threads = max(1, int(threads))
    with _LOCK:
        executor = _COPY_EXECUTORS.get(threads)
        if executor is None:
            executor = ThreadPoolExecutor(threads, thread_name_prefix="rh-dask-stage")
            _COPY_EXECUTORS[threads] = executor
        return executor


def prefetch_executor() -> ThreadPoolExecutor:
    """The process's threads that stage prefetched batches (they wait on copy threads)."""
    with _LOCK:
        if not _PREFETCH:
            _PREFETCH.append(
                ThreadPoolExecutor(PREFETCH_THREADS, thread_name_prefix="rh-dask-prefetch")
            )
        return _PREFETCH[0]


def _at_exit() -> None:
    with _LOCK:
        pools = list(_POOLS.values())
    for pool in pools:
        pool.shutdown()


def _after_fork_in_child() -> None:
    """Forget the parent's pools and threads (no CUDA call: its context is the parent's)."""
    global _LOCK
    _LOCK = threading.Lock()
    for pool in _POOLS.values():
        pool.forget()
    _POOLS.clear()
    # The executors' threads do not exist in the child; new ones start on use.
    _COPY_EXECUTORS.clear()
    _PREFETCH.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
