"""Getting batches onto the engine's device.

Device input
    CuPy arrays, objects exposing ``__cuda_array_interface__`` and DLPack
    tensors (PyTorch, JAX, ...) are *viewed*, never copied or converted:
    anything that would need a copy (another device, another dtype, a
    non-contiguous layout, host memory) is refused with a message saying
    which explicit conversion to make.

Host input
    NumPy batches go through pinned staging buffers and asynchronous copies
    on a dedicated copy stream. :class:`HostStager` keeps two slots, so that
    batch i+1 can be copied (host memcpy into pinned memory by a few threads,
    each chunk's DMA issued as soon as it is in pinned memory) while batch i
    is being solved. Memory that is already pinned is copied by DMA directly.
    The slots' pinned memory is leased from the process's pool of the device
    (:mod:`.host_pool`) and the copy threads are the process's, so that a
    fresh engine pays neither ``cudaHostAlloc`` nor thread start-up again.

Pinned pool
    :class:`PinnedPool` lets threads other than the engine's (the tasks that
    load chunks in the distributed walk) copy batches into reusable pinned
    buffers, so that the engine's own thread only queues DMA.
"""

from __future__ import annotations

import ctypes
import threading
import weakref
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

from rh_dask.exceptions import ValidationError
from rh_dask.validation import DLPACK_CUDA, DLPACK_DEVICE_NAMES

from .driver import DriverCalls
from .host_pool import (
    GiveBackLock,
    HostMemoryPool,
    PinnedLease,
    copy_executor,
    device_pool,
    prefetch_executor,
)

#: Rows of one staging chunk are sized to about this many bytes.
CHUNK_BYTES = 4 << 20
_MEMORY_TYPE_HOST = 1  # cudaMemoryTypeHost
#: cudaHostRegisterPortable (CuPy's runtime module names no register flags).
_HOST_REGISTER_PORTABLE = 1


def as_device_array(
    cp: ModuleType, obj: Any, name: str, device_id: int, dtype: np.dtype, ndim: int
) -> Any:
    """A zero-copy CuPy view of a CUDA array, validated for the engine.

    Call it with the engine's stream current: DLPack producers then order
    their pending work before that stream.

    Raises
    ------
    ValidationError
        When the array is not on ``device_id``, not of ``dtype``, not
        C-contiguous, or not ``ndim``-dimensional.
    """
    if isinstance(obj, cp.ndarray):
        arr = obj
    elif hasattr(obj, "__cuda_array_interface__"):
        arr = cp.asarray(obj)  # a view of the same memory
    elif hasattr(obj, "__dlpack_device__"):
        kind, index = (int(v) for v in obj.__dlpack_device__())
        if kind != DLPACK_CUDA:
            where = DLPACK_DEVICE_NAMES.get(kind, f"DLPack device type {kind}")
            raise ValidationError(
                f"{name} lives in {where} memory; the GPU engine takes CUDA device memory "
                "(pass a NumPy array for host data, or move the tensor to the GPU explicitly)"
            )
        if index != device_id:
            raise ValidationError(
                f"{name} is on cuda:{index}, but this engine runs on cuda:{device_id}; "
                f"move it explicitly (e.g. tensor.to('cuda:{device_id}'))"
            )
        try:
            arr = cp.from_dlpack(obj)
        except Exception as exc:  # e.g. a tensor that requires grad
            raise ValidationError(f"{name} cannot be viewed through DLPack: {exc}") from exc
    else:
        raise ValidationError(
            f"{name} must be a NumPy array or a CUDA array (CuPy, DLPack), "
            f"got {type(obj).__name__}"
        )
    if arr.device.id != device_id:
        raise ValidationError(
            f"{name} is on cuda:{arr.device.id}, but this engine runs on cuda:{device_id}; "
            "copy it to the engine's device explicitly"
        )
    if arr.dtype != dtype:
        raise ValidationError(
            f"{name} has dtype {arr.dtype}, but the engine computes in {np.dtype(dtype).name}; "
            "convert it explicitly (the engine never copies device data behind your back)"
        )
    if arr.ndim != ndim:
        raise ValidationError(f"{name} must be {ndim}-D, got shape {tuple(arr.shape)}")
    if not arr.flags.c_contiguous:
        raise ValidationError(
            f"{name} must be C-contiguous on the device (got strides {arr.strides}); "
            "call cupy.ascontiguousarray(...) or tensor.contiguous() explicitly"
        )
    return arr


def is_pinned(cp: ModuleType, arr: np.ndarray) -> bool:
    """Whether a host array lives in page-locked (CUDA-registered) memory."""
    if arr.size == 0:
        return False
    try:
        attrs = cp.cuda.runtime.pointerGetAttributes(arr.ctypes.data)
    except Exception:
        return False
    return int(getattr(attrs, "type", 0)) == _MEMORY_TYPE_HOST


class PinnedBuffer:
    """Page-locked host memory with a NumPy view, freed explicitly."""

    def __init__(self, cp: ModuleType, nbytes: int, mapped: bool = False) -> None:
        rt = cp.cuda.runtime
        flags = rt.hostAllocPortable | (rt.hostAllocMapped if mapped else 0)
        self._rt = rt
        self.nbytes = max(int(nbytes), 8)
        self.ptr = int(rt.hostAlloc(self.nbytes, flags))
        self._raw = (ctypes.c_char * self.nbytes).from_address(self.ptr)

    def view(self, dtype: np.dtype | type, count: int, offset: int = 0) -> np.ndarray:
        return np.frombuffer(self._raw, dtype=dtype, count=count, offset=offset)

    def free(self) -> None:
        if self.ptr:
            self._rt.freeHost(self.ptr)
            self.ptr = 0

    def __del__(self) -> None:  # pragma: no cover - interpreter shutdown order varies
        try:
            self.free()
        except Exception:
            pass


#: Pool buffers are sized in multiples of this, so that chunks of slightly
#: different lengths (DataFrame partitions) reuse the same buffers.
POOL_GRANULE = 1 << 20

#: A buffer of :class:`PinnedPool`: its own, or leased from the process's pool.
_Pinned = PinnedBuffer | PinnedLease


class PinnedPool:
    """Reusable page-locked host buffers that any thread copies batches into.

    A batch in pinned memory reaches the device by DMA alone: the engine's
    thread queues the copy and goes on, with no host memcpy of its own. Each
    buffer returns to the pool when the last array viewing it is garbage
    collected, so holders never release anything explicitly; the pool grows
    to the number of batches alive at once, which its caller bounds (the
    distributed walk keeps at most ``lookahead`` chunks loaded ahead).

    Parameters
    ----------
    cp : module
        CuPy.
    device_id : int
        The device whose context allocates the buffers.
    dtype : numpy.dtype
        The engine's dtype; batches must already have it.
    source : HostMemoryPool, optional
        Where buffers come from and go back to (the engine passes its
        device's process pool, so buffers outlive the engine); default:
        allocated and freed by this pool itself.
    """

    def __init__(
        self,
        cp: ModuleType,
        device_id: int,
        dtype: np.dtype,
        source: HostMemoryPool | None = None,
    ) -> None:
        self._cp = cp
        self._device_id = device_id
        self._dtype = np.dtype(dtype)
        self._source = source
        # Buffers come back from finalisers, possibly on a thread inside `with self._lock`.
        self._lock = GiveBackLock(self._take_back)
        self._idle: list[_Pinned] = []
        self._leased = 0
        self._closed = False
        self._growing = False
        self.allocated_bytes = 0

    @property
    def buffers(self) -> int:
        """Buffers held: idle ones plus those viewed by live batches."""
        with self._lock:
            return len(self._idle) + self._leased

    def copy_batch(
        self, X: np.ndarray, y: np.ndarray, w: np.ndarray | None, *, wait: bool = True
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None] | None:
        """Copies of ``X``, ``y`` and ``w`` in one pinned buffer (same shapes and dtype).

        With ``wait=False`` the call never allocates: when no idle buffer is
        large enough it returns ``None`` at once and a background thread adds
        one (pinning tens of megabytes takes milliseconds, which a loading
        pipeline should not wait for), so that later batches find it.

        Raises
        ------
        ValidationError
            When an array is not of the pool's dtype or the shapes disagree.
        """
        n, d = X.shape
        arrays = (X, y) if w is None else (X, y, w)
        if any(a.dtype != self._dtype for a in arrays):
            raise ValidationError(f"batches must be {self._dtype.name} to be pinned")
        if y.shape != (n,) or (w is not None and w.shape != (n,)):
            raise ValidationError(f"y and sample_weight must have shape ({n},)")
        count = n * (d + 1 + (w is not None))
        nbytes = max(count * self._dtype.itemsize, 8)
        buffer = self._take(nbytes) if wait else self._take_idle(nbytes)
        if buffer is None:
            return None
        raw = (ctypes.c_char * nbytes).from_address(buffer.ptr)
        # The buffer goes back once nothing views ``raw`` any more.
        weakref.finalize(raw, self._give, buffer)
        flat = np.frombuffer(raw, dtype=self._dtype, count=count)
        out_X = flat[: n * d].reshape(n, d)
        out_y = flat[n * d : n * (d + 1)]
        np.copyto(out_X, X)  # releases the GIL
        np.copyto(out_y, y)
        out_w = None
        if w is not None:
            out_w = flat[n * (d + 1) :]
            np.copyto(out_w, w)
        return out_X, out_y, out_w

    def _lease_idle(self, size: int) -> _Pinned | None:
        """The smallest idle buffer of at least ``size`` bytes, leased (call with the lock)."""
        if self._closed:
            raise RuntimeError("the pinned pool is closed")
        fitting = [b for b in self._idle if b.nbytes >= size]
        if not fitting:
            return None
        buffer = min(fitting, key=lambda b: b.nbytes)
        self._idle.remove(buffer)
        self._leased += 1
        return buffer

    def _take_idle(self, nbytes: int) -> _Pinned | None:
        """An idle buffer of at least ``nbytes``, or None (then one is added in the background)."""
        size = -(-nbytes // POOL_GRANULE) * POOL_GRANULE
        with self._lock:
            buffer = self._lease_idle(size)
            if buffer is not None or self._growing:
                return buffer
            self._growing = True
        threading.Thread(target=self._grow, args=(size,), name="rh-dask-pin", daemon=True).start()
        return None

    def _grow(self, size: int) -> None:
        try:
            buffer = self._allocate(size)
        except Exception:  # out of page-locked memory: batches keep arriving pageable
            with self._lock:
                self._growing = False
            return
        drop: _Pinned | None = buffer
        with self._lock:
            self._growing = False
            if not self._closed:
                # Replace an idle buffer too small for this batch size, if any.
                small = [b for b in self._idle if b.nbytes < size]
                drop = small[0] if small else None
                if drop is not None:
                    self._idle.remove(drop)
                    self.allocated_bytes -= drop.nbytes
                self._idle.append(buffer)
                self.allocated_bytes += buffer.nbytes
        if drop is not None:
            drop.free()

    def _take(self, nbytes: int) -> _Pinned:
        size = -(-nbytes // POOL_GRANULE) * POOL_GRANULE
        with self._lock:
            buffer = self._lease_idle(size)
            if buffer is not None:
                return buffer
            # Replace an idle buffer that is too small rather than hold both.
            stale = self._idle.pop() if self._idle else None
            if stale is not None:
                self.allocated_bytes -= stale.nbytes
            self._leased += 1
        if stale is not None:
            stale.free()
        try:
            buffer = self._allocate(size)
        except BaseException:
            with self._lock:
                self._leased -= 1
            raise
        with self._lock:
            self.allocated_bytes += buffer.nbytes
        return buffer

    def _allocate(self, size: int) -> _Pinned:
        if self._source is not None:
            return self._source.lease(size)  # its free() gives it back to the source
        with self._cp.cuda.Device(self._device_id):
            return PinnedBuffer(self._cp, size)

    def _give(self, buffer: _Pinned) -> None:
        """A batch's buffer comes back (from a finaliser: never waits for the lock)."""
        self._lock.put(buffer)

    def _take_back(self, buffer: _Pinned) -> Any:
        """Apply one return (with the lock); what to free afterwards, outside it."""
        self._leased -= 1
        if not self._closed:
            self._idle.append(buffer)
            return None
        self.allocated_bytes -= buffer.nbytes
        return buffer.free

    def register(self, address: int, nbytes: int) -> HostRegistration:
        """Page-lock ``nbytes`` of existing host memory at ``address`` for this device.

        Batches viewing that memory then reach the device by DMA straight
        from it (the engine's stager sees it as pinned), with no copy into
        this pool. The memory must stay mapped until the registration is
        closed. See :class:`HostRegistration`.

        Raises
        ------
        RuntimeError
            When CUDA refuses to lock the memory (out of lockable memory, a
            mapping it cannot lock).
        """
        return HostRegistration(self._cp, self._device_id, address, nbytes)

    def close(self) -> None:
        """Free idle buffers now; leased ones are freed when their batches die."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for buffer in idle:
            self.allocated_bytes -= buffer.nbytes
            buffer.free()


class HostRegistration:
    """Existing host memory page-locked for one device (``cudaHostRegister``).

    Parameters
    ----------
    cp : module
        CuPy.
    device_id : int
        The device whose context registers the memory.
    address, nbytes : int
        The memory (a mapping its owner keeps alive until :meth:`close`).

    Raises
    ------
    RuntimeError
        When CUDA refuses to lock it.

    Notes
    -----
    :meth:`close` waits for the whole device before it unlocks the memory,
    so no copy queued from it by any stream is still reading it.
    """

    def __init__(self, cp: ModuleType, device_id: int, address: int, nbytes: int) -> None:
        self._cp = cp
        self._device_id = device_id
        self.address = int(address)
        self.nbytes = int(nbytes)
        rt = cp.cuda.runtime
        try:
            with cp.cuda.Device(device_id):
                rt.hostRegister(self.address, self.nbytes, _HOST_REGISTER_PORTABLE)
        except Exception as exc:
            raise RuntimeError(
                f"cannot page-lock {self.nbytes / 2**20:.0f} MiB of host memory: {exc}"
            ) from exc
        self._lock = threading.Lock()
        self._open = True

    def covers(self, arr: np.ndarray | None) -> bool:
        """Whether the bytes of ``arr`` (``None``: nothing to cover) lie in this memory."""
        if arr is None or arr.size == 0:
            return True
        start = arr.ctypes.data
        return self.address <= start and start + arr.nbytes <= self.address + self.nbytes

    def close(self, synchronize: bool = True) -> None:
        """Wait for the device, then unlock the memory; idempotent.

        ``synchronize=False`` skips the wait, for a caller that has just
        waited for this device itself (closing many registrations at once).
        """
        with self._lock:
            if not self._open:
                return
            self._open = False
        cp = self._cp
        with cp.cuda.Device(self._device_id):
            if synchronize:
                cp.cuda.Device(self._device_id).synchronize()
            cp.cuda.runtime.hostUnregister(self.address)


class _Slot:
    """One staging slot: pinned host buffers, device buffers, and their events.

    The pinned buffer is leased from ``pool`` for as long as the slot keeps
    its size, and given back (fenced by ``copied``) when it grows or closes.
    """

    def __init__(self, cp: ModuleType, dtype: np.dtype, pool: HostMemoryPool) -> None:
        self.cp = cp
        self.dtype = np.dtype(dtype)
        self.pool = pool
        self.rows = 0
        self.cols = 0
        self.host: PinnedLease | None = None
        self.device: Any = None
        # DMA out of the pinned buffer done: the lease's fence, a new one per lease
        # (the pool destroys a fence once it has waited for it).
        self.copied: Any = None
        self.ready = cp.cuda.Event(disable_timing=True)  # device buffers hold the batch
        self.consumed = cp.cuda.Event(disable_timing=True)  # the engine has read them
        self.used = False
        self.epoch = 0  # incremented by every staging into this slot
        # Pinned arrays DMA'd straight from the caller's memory: kept alive until
        # the slot is reused (its copy is then over), so that a pool buffer they
        # view cannot be recycled while the copy still reads it.
        self.sources: tuple[Any, ...] = ()

    def ensure(self, n: int, d: int) -> None:
        if n <= self.rows and d == self.cols:
            return
        rows = max(n, self.rows if d == self.cols else 0)
        count = rows * (d + 2)  # X, then y, then w
        self.release()
        self.host = self.pool.lease(count * self.dtype.itemsize)
        factory = self.pool.fence_factory
        self.copied = factory() if factory is not None else self.cp.cuda.Event(disable_timing=True)
        # The pool waits for this event before anyone else writes the memory.
        self.host.fence = self.copied
        self.device = self.cp.empty(count, dtype=self.dtype)
        self.rows, self.cols = rows, d

    def release(self) -> None:
        """Give the pinned buffer back to the pool (its copies are fenced by ``copied``).

        The slot then holds no rows, so that the next :meth:`ensure` leases
        again (also after a lease that failed, e.g. out of page-locked memory).
        """
        host, self.host = self.host, None
        self.rows = self.cols = 0
        self.copied = None  # the pool's now: never recorded or waited for by this slot again
        if host is not None:
            host.free()


@dataclass
class StagedBatch:
    """A host batch on its way to (or already in) device buffers.

    ``X``, ``y`` and ``w`` are CuPy views of the slot's device buffers; they
    are valid once the engine's stream has waited for ``ready``.
    """

    X: Any
    y: Any
    w: Any | None
    n: int
    d: int
    slot: _Slot
    epoch: int


class HostStager:
    """Double-buffered, overlapped host-to-device staging of NumPy batches.

    Parameters
    ----------
    cp : module
        CuPy.
    device_id : int
        The engine's device.
    dtype : numpy.dtype
        The engine's dtype (host arrays must already have it).
    threads : int
        Threads copying pageable rows into pinned memory in parallel.
    calls : DriverCalls, optional
        Queues the copies and stream waits (the engine passes its own;
        default: a :class:`DriverCalls` that keeps the interpreter lock).
    pool : HostMemoryPool, optional
        Leases the slots' pinned memory (default: the process's pool of
        ``device_id``, :func:`.host_pool.device_pool`).

    Notes
    -----
    The copy threads and the prefetch threads are the process's
    (:func:`.host_pool.copy_executor`, :func:`.host_pool.prefetch_executor`),
    shared with every other engine; :meth:`close` waits for this stager's own
    work only.
    """

    def __init__(
        self,
        cp: ModuleType,
        device_id: int,
        dtype: np.dtype,
        threads: int = 4,
        calls: DriverCalls | None = None,
        pool: HostMemoryPool | None = None,
    ) -> None:
        self._cp = cp
        self._calls = calls if calls is not None else DriverCalls(cp)
        self._device_id = device_id
        self._dtype = np.dtype(dtype)
        self.pool = pool if pool is not None else device_pool(cp, device_id)
        with cp.cuda.Device(device_id):
            self.stream = cp.cuda.Stream(non_blocking=True)
            self._slots = [_Slot(cp, dtype, self.pool), _Slot(cp, dtype, self.pool)]
        self._next = 0
        self._lock = threading.Lock()
        self._threads = max(1, int(threads))
        # Prefetches submitted and not yet known to be over (close waits for them),
        # and those waiting for this stager's turn on the shared prefetch threads:
        # one task at a time drains them in submission order.
        self._inflight: list[Future[StagedBatch]] = []
        self._queue: deque[tuple[Future[StagedBatch], tuple[Any, ...]]] = deque()
        self._queue_lock = threading.Lock()
        self._draining = False
        self._pending: tuple[tuple[int, int, int], Any, tuple[Any, ...]] | None = None

    # -- staging --------------------------------------------------------------------
    def _in_place(self, arrays: tuple[np.ndarray | None, ...]) -> tuple[bool, ...]:
        """Which arrays can be DMA'd where they are (contiguous and page-locked)."""
        return tuple(
            a is not None and a.flags.c_contiguous and is_pinned(self._cp, a) for a in arrays
        )

    def stage(
        self,
        X: np.ndarray,
        y: np.ndarray,
        w: np.ndarray | None,
        in_place: tuple[bool, ...] | None = None,
    ) -> StagedBatch:
        """Copy one batch into the next slot's device buffers (asynchronously).

        Returns once the host side is done (pinned memory filled, DMA queued on
        the copy stream); the device side completes at ``slot.ready``.
        ``in_place`` is :meth:`_in_place` of ``(X, y, w)`` when the caller
        has it already.
        """
        cp = self._cp
        in_x, in_y, in_w = in_place or self._in_place((X, y, w))
        with self._lock, cp.cuda.Device(self._device_id):
            slot = self._slots[self._next]
            self._next ^= 1
            n, d = X.shape
            if slot.used:
                # The pinned buffer is rewritten below: its previous DMA must be over;
                # the device buffers too: the engine must have read them.
                if slot.copied is not None:  # None: the lease went back (fenced) already
                    self._calls.event_wait(slot.copied)
                self._calls.stream_wait(self.stream.ptr, slot.consumed.ptr)
                if n > slot.rows or d != slot.cols:
                    slot.consumed.synchronize()  # the old buffers are about to be freed
            # Only arrays DMA'd in place need to outlive this call (pageable ones
            # are copied into the slot before it returns): a caller's pageable
            # batch is never kept alive by the engine.
            slot.sources = tuple(
                a for a, direct in zip((X, y, w), (in_x, in_y, in_w), strict=True) if direct
            )
            slot.ensure(n, d)
            slot.epoch += 1
            item = self._dtype.itemsize
            host, dev = slot.host, slot.device
            assert host is not None
            x_host = host.view(self._dtype, n * d).reshape(n, d)
            offsets = (0, slot.rows * d, slot.rows * (d + 1))
            try:
                self._copy_rows(X, in_x, x_host, dev.data.ptr, host.ptr, item * d)
                y_host = host.view(self._dtype, n, offsets[1] * item)
                self._h2d_small(
                    y, in_y, y_host, dev.data.ptr + offsets[1] * item, host.ptr + offsets[1] * item
                )
                if w is not None:
                    w_host = host.view(self._dtype, n, offsets[2] * item)
                    self._h2d_small(
                        w,
                        in_w,
                        w_host,
                        dev.data.ptr + offsets[2] * item,
                        host.ptr + offsets[2] * item,
                    )
            finally:
                # Also after a failed copy: the DMA queued before it must be fenced
                # (the next staging and the pool wait for `copied` before the
                # pinned memory is written again or handed to another holder).
                slot.copied.record(self.stream)
                slot.used = True
            slot.ready.record(self.stream)
            return StagedBatch(
                X=dev[: n * d].reshape(n, d),
                y=dev[offsets[1] : offsets[1] + n],
                w=None if w is None else dev[offsets[2] : offsets[2] + n],
                n=n,
                d=d,
                slot=slot,
                epoch=slot.epoch,
            )

    def _h2d_small(
        self, src: np.ndarray, in_place: bool, pinned: np.ndarray, dst: int, pinned_ptr: int
    ) -> None:
        nbytes = src.size * src.itemsize
        if in_place:
            self._calls.copy_to_device(dst, src.ctypes.data, nbytes, self.stream.ptr)
            return
        np.copyto(pinned, src)
        self._calls.copy_to_device(dst, pinned_ptr, nbytes, self.stream.ptr)

    def _copy_rows(
        self,
        X: np.ndarray,
        in_place: bool,
        pinned: np.ndarray,
        dst: int,
        pinned_ptr: int,
        row_bytes: int,
    ) -> None:
        """X → pinned (parallel chunks) → device, each chunk's DMA queued when it is ready."""
        rt, calls = self._cp.cuda.runtime, self._calls
        n = X.shape[0]
        stream_ptr = self.stream.ptr
        if in_place:
            calls.copy_to_device(dst, X.ctypes.data, n * row_bytes, stream_ptr)
            return
        rows = max(1, CHUNK_BYTES // max(row_bytes, 1))
        bounds = [(s, min(s + rows, n)) for s in range(0, n, rows)]
        device_id = self._device_id

        def chunk(lo: int, hi: int) -> None:
            np.copyto(pinned[lo:hi], X[lo:hi])  # releases the GIL
            rt.setDevice(device_id)
            calls.copy_to_device(
                dst + lo * row_bytes,
                pinned_ptr + lo * row_bytes,
                (hi - lo) * row_bytes,
                stream_ptr,
            )

        if len(bounds) == 1 or self._threads == 1:
            for lo, hi in bounds:
                chunk(lo, hi)
            return
        executor = copy_executor(self._threads)
        futures = [executor.submit(chunk, lo, hi) for lo, hi in bounds]
        for future in futures:
            # Every chunk is waited for, even after one failed: none may still
            # write into the slot once this returns.
            try:
                future.result()
            except BaseException:
                for other in futures:
                    other.exception()
                raise

    # -- prefetch -------------------------------------------------------------------
    def prefetch(self, X: np.ndarray, y: np.ndarray, w: np.ndarray | None) -> None:
        """Start staging a batch in the background (see :meth:`take`).

        A batch already in pinned memory needs only DMA, which is queued at
        once on this thread: handing it to the prefetch thread would cost
        two thread switches (each a wait for the interpreter lock when other
        threads are busy) to save nothing. Only the latest prefetch is
        remembered; an earlier one that was never taken is simply dropped
        (its slot is reused later).
        """
        in_place = self._in_place((X, y, w))
        future: Future[StagedBatch]
        if all(direct for a, direct in zip((X, y, w), in_place, strict=True) if a is not None):
            future = Future()
            try:
                future.set_result(self.stage(X, y, w, in_place))
            except Exception as exc:  # re-raised by take(), as from the thread
                future.set_exception(exc)
        else:
            future = self._submit((X, y, w))
            self._inflight = [f for f in self._inflight if not f.done()]
            self._inflight.append(future)
        self._pending = ((id(X), id(y), id(w)), future, (X, y, w))

    def _submit(self, arrays: tuple[Any, ...]) -> Future[StagedBatch]:
        """Queue a staging for the process's prefetch threads, after this stager's earlier ones."""
        future: Future[StagedBatch] = Future()
        with self._queue_lock:
            self._queue.append((future, arrays))
            start, self._draining = not self._draining, True
        if start:
            try:
                prefetch_executor().submit(self._drain)
            except RuntimeError:  # interpreter shutdown: no new threads, stage here
                self._drain()
        return future

    def _drain(self) -> None:
        """Stage this stager's queued prefetches in order (one drain task at a time)."""
        while True:
            with self._queue_lock:
                if not self._queue:
                    self._draining = False
                    return
                future, arrays = self._queue.popleft()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(self.stage(*arrays))
            except BaseException as exc:  # re-raised by take()
                future.set_exception(exc)

    def take(self, X: np.ndarray, y: np.ndarray, w: np.ndarray | None) -> StagedBatch | None:
        """The prefetched staging of exactly these arrays, or None.

        A prefetch of other arrays stays pending for a later call.
        """
        pending = self._pending
        if pending is None or pending[0] != (id(X), id(y), id(w)):
            return None
        self._pending = None
        staged = pending[1].result()  # re-raises a staging error
        if staged.slot.epoch != staged.epoch:
            return None  # its slot was reused by later staging
        return staged

    def discard_pending(self) -> None:
        """Wait for and forget a prefetch that will not be used."""
        pending, self._pending = self._pending, None
        if pending is not None:
            try:
                pending[1].result()
            except Exception:
                pass

    def close(self) -> None:
        """Wait for this stager's copies and give its pinned memory back to the pool."""
        self.discard_pending()
        inflight, self._inflight = self._inflight, []
        for future in inflight:
            future.exception()  # waits; a dropped prefetch's error is of no use now
        for slot in self._slots:
            if slot.copied is not None:
                slot.copied.synchronize()
            slot.sources = ()
            slot.release()
