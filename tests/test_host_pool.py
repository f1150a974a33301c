"""The process-wide pinned staging pool of the GPU engine, on CPU with a fake allocator.

``gpu_engine.host_pool.HostMemoryPool`` takes its allocate and free callbacks
as arguments, so leasing, reuse, the idle bound, fences, concurrent holders,
close order, fork and exit run here on malloc'd memory.
``tests/test_gpu_host_pool.py`` runs the engine on it with real pinned
memory.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import itertools
import os
import subprocess
import sys
import threading
import warnings
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from gpu_engine import host_pool
from gpu_engine.host_pool import LEASE_GRANULE, HostMemoryPool, device_pool
from gpu_engine.transfer import PinnedPool
from rh_dask.exceptions import ValidationError

MiB = 1 << 20


class FakeAllocator:
    """malloc'd memory standing in for ``cudaHostAlloc``/``cudaFreeHost``."""

    def __init__(self) -> None:
        self.live: dict[int, ctypes.Array] = {}
        self.allocated = 0
        self.freed: list[int] = []
        self.lock = threading.Lock()

    def allocate(self, nbytes: int) -> int:
        buf = ctypes.create_string_buffer(nbytes)
        with self.lock:
            self.live[ctypes.addressof(buf)] = buf
            self.allocated += 1
        return ctypes.addressof(buf)

    def free(self, ptr: int) -> None:
        with self.lock:
            del self.live[ptr]  # KeyError: a double free or a foreign address
            self.freed.append(ptr)


class Fence:
    """A CUDA event's stand-in: counts the waits for it."""

    def __init__(self) -> None:
        self.waits = 0

    def synchronize(self) -> None:
        self.waits += 1


@pytest.fixture
def alloc():
    return FakeAllocator()


def _pool(alloc, **kwargs):
    return HostMemoryPool(alloc.allocate, alloc.free, **kwargs)


def test_a_lease_given_back_is_reused_by_the_next_holder(alloc):
    pool = _pool(alloc)
    first = pool.lease(3 * MiB + 5)
    assert first.nbytes == 4 * MiB  # rounded up to the granule
    ptr = first.ptr
    first.view(np.uint8, 16)[:] = 7
    first.free()
    first.free()  # idempotent
    assert pool.stats()["idle_bytes"] == 4 * MiB and not alloc.freed
    second = pool.lease(4 * MiB)
    assert second.ptr == ptr and alloc.allocated == 1 and pool.reuses == 1
    assert pool.allocated_bytes == pool.leased_bytes == 4 * MiB
    with pytest.raises(RuntimeError, match="given back"):
        first.view(np.uint8, 1)
    second.free()


def test_the_smallest_fitting_idle_buffer_is_leased_and_small_ones_stay(alloc):
    pool = _pool(alloc)
    small, big = pool.lease(MiB), pool.lease(8 * MiB)
    small_ptr, big_ptr = small.ptr, big.ptr
    small.free()
    big.free()
    middle = pool.lease(2 * MiB)  # only the big one fits
    assert middle.ptr == big_ptr
    tiny = pool.lease(10)
    assert tiny.ptr == small_ptr and tiny.nbytes == LEASE_GRANULE
    other = pool.lease(MiB)  # nothing idle fits: a new buffer
    assert other.ptr not in (small_ptr, big_ptr) and alloc.allocated == 3
    for lease in (middle, tiny, other):
        lease.free()


def test_idle_memory_is_bounded_longest_idle_freed_first(alloc):
    pool = _pool(alloc, max_idle_bytes=3 * MiB)
    leases = [pool.lease(MiB) for _ in range(4)]
    ptrs = [lease.ptr for lease in leases]
    for lease in leases:
        lease.free()
    assert pool.idle_bytes == 3 * MiB and alloc.freed == [ptrs[0]]
    assert pool.allocated_bytes == 3 * MiB
    pool.max_idle_bytes = MiB  # lowering the bound frees at once
    assert alloc.freed == ptrs[:3] and pool.idle_bytes == MiB
    pool.max_idle_bytes = 0  # keep nothing: every lease given back is freed
    assert pool.idle_bytes == 0 and set(alloc.freed) == set(ptrs) and not alloc.live
    lease = pool.lease(5 * MiB)
    lease.free()
    assert not alloc.live and pool.allocated_bytes == 0
    with pytest.raises(ValidationError):
        pool.max_idle_bytes = -1


def test_a_buffer_larger_than_the_bound_is_freed_when_given_back(alloc):
    pool = _pool(alloc, max_idle_bytes=2 * MiB)
    lease = pool.lease(4 * MiB)
    lease.free()
    assert not alloc.live and pool.stats()["frees"] == 1


def test_the_fence_is_waited_for_before_reuse_and_before_freeing(alloc):
    pool = _pool(alloc, max_idle_bytes=MiB)
    lease = pool.lease(MiB)
    fence = Fence()
    lease.fence = fence
    lease.free()
    assert fence.waits == 0  # giving back never blocks
    again = pool.lease(MiB)
    assert fence.waits == 1  # the previous holder's copy is over before reuse
    other = pool.lease(MiB)
    late = Fence()
    again.fence, other.fence = fence, late
    again.free()
    other.free()  # beyond the bound: the longest idle (``again``) is freed
    assert fence.waits == 2 and late.waits == 0


def test_two_live_holders_never_share_memory_and_closing_one_spares_the_other(alloc):
    """Two engines' slots at once: distinct memory; one closing returns only its own."""
    pool = _pool(alloc)
    engine_a = [pool.lease(2 * MiB), pool.lease(2 * MiB)]
    engine_b = [pool.lease(2 * MiB), pool.lease(2 * MiB)]
    spans = sorted((lease.ptr, lease.ptr + lease.nbytes) for lease in engine_a + engine_b)
    assert all(end <= start for (_, end), (start, _) in itertools.pairwise(spans))
    for i, lease in enumerate(engine_b):
        lease.view(np.uint8, lease.nbytes)[:] = 100 + i
    for lease in engine_a:  # engine A closes first
        lease.free()
    assert not alloc.freed and pool.leased_bytes == 4 * MiB
    for i, lease in enumerate(engine_b):  # B's memory is untouched and still its own
        assert np.all(lease.view(np.uint8, lease.nbytes) == 100 + i)
    engine_c = [pool.lease(2 * MiB), pool.lease(2 * MiB)]  # a third engine reuses A's
    assert {lease.ptr for lease in engine_c} == {lease.ptr for lease in engine_a}
    assert alloc.allocated == 4
    for lease in engine_b + engine_c:
        lease.free()
    assert pool.leased_bytes == 0 and pool.idle_bytes == 8 * MiB


def test_concurrent_leases_from_many_threads_are_exclusive(alloc):
    pool = _pool(alloc, max_idle_bytes=6 * MiB)
    errors: list[str] = []
    start = threading.Barrier(6)

    def holder(tag: int) -> None:
        start.wait()
        for round_ in range(60):
            lease = pool.lease(MiB * (1 + (tag + round_) % 3))
            view = lease.view(np.uint8, lease.nbytes)
            view[:] = tag
            if round_ % 7 == 0:
                threading.Event().wait(0.001)  # let others run while it is held
            if not np.all(view == tag):
                errors.append(f"holder {tag} saw another holder's bytes")
            lease.free()

    threads = [threading.Thread(target=holder, args=(t,)) for t in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert pool.leased_bytes == 0 and pool.idle_bytes <= 6 * MiB
    assert pool.allocated_bytes == sum(len(b) for b in alloc.live.values())


def test_a_lease_dropped_without_free_goes_back(alloc):
    pool = _pool(alloc)
    lease = pool.lease(MiB)
    del lease
    gc.collect()
    assert pool.leased_bytes == 0 and pool.idle_bytes == MiB


def test_clear_and_shutdown_free_idle_memory_and_late_returns_are_left(alloc):
    pool = _pool(alloc)
    kept, idle = pool.lease(MiB), pool.lease(MiB)
    idle.free()
    pool.clear()
    assert len(alloc.freed) == 1 and pool.idle_bytes == 0
    back = pool.lease(MiB)
    back.free()
    pool.shutdown()  # interpreter exit
    assert len(alloc.freed) == 2
    kept.free()  # an engine collected during shutdown: nothing is freed any more
    assert len(alloc.freed) == 2
    with pytest.raises(RuntimeError, match="closed"):
        pool.lease(MiB)


def test_forget_in_a_forked_child_makes_no_free_call_and_drops_old_leases(alloc):
    pool = _pool(alloc)
    held, idle = pool.lease(MiB), pool.lease(MiB)
    idle.free()
    pool.forget()
    held.free()  # a parent's lease given back in the child
    assert not alloc.freed and pool.allocated_bytes == 0
    with pytest.raises(RuntimeError):
        pool.lease(MiB)


class _Cycle:
    """A holder in a reference cycle: only the cyclic garbage collector frees it."""

    def __init__(self, lease) -> None:
        self.lease = lease
        self.me = self


def _on_a_thread(fn) -> bool:
    """Run ``fn`` on a daemon thread; whether it returned (a deadlock keeps it waiting)."""
    done = threading.Event()

    def run() -> None:
        fn()
        done.set()

    threading.Thread(target=run, daemon=True).start()
    return done.wait(30)


def test_a_lease_collected_on_the_thread_that_holds_the_pool_lock_does_not_deadlock(alloc):
    """The collector runs finalisers on whichever thread allocates, even inside a lease."""
    pool = _pool(alloc)
    _Cycle(pool.lease(MiB))  # garbage now, freed by the next collection
    seen = {}

    def collect_while_locked() -> None:
        with pool._lock:
            gc.collect()  # the lease's __del__ gives it back here
            seen["leased inside"] = pool.leased_bytes
        seen["leased after"] = pool.leased_bytes

    assert _on_a_thread(collect_while_locked), "the give-back waited for its own thread's lock"
    assert seen == {"leased inside": MiB, "leased after": 0}  # applied when the lock went
    assert pool.idle_bytes == MiB and pool.lease(MiB).nbytes == MiB and alloc.allocated == 1


def test_a_pinned_batch_collected_while_its_pool_is_locked_goes_back_after(alloc):
    source = _pool(alloc)
    pool = PinnedPool(None, 0, np.float32, source=source)
    X = np.ones((64, 4), np.float32)
    y = np.ones(64, np.float32)
    batch = pool.copy_batch(X, y, None)
    holder = _Cycle(None)
    holder.batch = batch
    del batch, holder
    seen = {}

    def collect_while_locked() -> None:
        with pool._lock:
            gc.collect()  # the batch's buffer comes back through weakref.finalize
            seen["inside"] = len(pool._idle)
        seen["after"] = len(pool._idle)

    assert _on_a_thread(collect_while_locked), "the give-back waited for its own thread's lock"
    assert seen == {"inside": 0, "after": 1} and pool.buffers == 1


def test_the_cuda_allocator_frees_in_the_devices_context(alloc):
    current: list[int | None] = [None]
    calls = []

    @contextlib.contextmanager
    def device(device_id):
        before, current[0] = current[0], device_id
        try:
            yield
        finally:
            current[0] = before

    def host_alloc(nbytes, flags):
        calls.append(("alloc", current[0], flags))
        return alloc.allocate(nbytes)

    def free_host(ptr):
        calls.append(("free", current[0]))
        alloc.free(ptr)

    runtime = SimpleNamespace(hostAllocPortable=1, hostAlloc=host_alloc, freeHost=free_host)
    cp = SimpleNamespace(cuda=SimpleNamespace(runtime=runtime, Device=device))
    allocate, free = host_pool.cuda_allocator(cp, 3)
    free(allocate(MiB))
    assert calls == [("alloc", 3, 1), ("free", 3)]


def _fake_cp(alloc):
    runtime = SimpleNamespace(
        hostAllocPortable=1,
        hostAllocMapped=2,
        hostAlloc=lambda nbytes, flags: alloc.allocate(nbytes),
        freeHost=alloc.free,
    )
    return SimpleNamespace(
        cuda=SimpleNamespace(runtime=runtime, Device=lambda _id: contextlib.nullcontext())
    )


@pytest.fixture
def registry(monkeypatch):
    """The module's registries, emptied for the test and restored after it."""
    monkeypatch.setattr(host_pool, "_POOLS", {})
    monkeypatch.setattr(host_pool, "_COPY_EXECUTORS", {})
    monkeypatch.setattr(host_pool, "_PREFETCH", [])
    monkeypatch.setattr(host_pool, "_EXIT_REGISTERED", True)  # no atexit hook from a test
    yield host_pool


def test_one_pool_and_one_thread_pool_per_process(registry, alloc):
    cp = _fake_cp(alloc)
    assert device_pool(cp, 0) is device_pool(cp, 0)
    assert device_pool(cp, 1) is not device_pool(cp, 0)
    assert registry.copy_executor(4) is registry.copy_executor(4)
    assert registry.copy_executor(2) is not registry.copy_executor(4)
    assert registry.prefetch_executor() is registry.prefetch_executor()
    lease = device_pool(cp, 0).lease(MiB)
    assert lease.ptr in alloc.live
    lease.free()


def test_the_after_fork_hook_resets_pools_and_threads_without_freeing(registry, alloc):
    cp = _fake_cp(alloc)
    pool = device_pool(cp, 0)
    held, idle = pool.lease(MiB), pool.lease(MiB)
    idle.free()
    executor = registry.copy_executor(4)
    registry._after_fork_in_child()
    assert device_pool(cp, 0) is not pool and registry.copy_executor(4) is not executor
    held.free()
    assert not alloc.freed  # no CUDA call in a child: the parent's memory is left alone
    fresh = device_pool(cp, 0).lease(MiB)
    assert fresh.ptr not in (held.ptr, idle.ptr)
    fresh.free()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_real_fork_gives_the_child_a_fresh_pool(registry, alloc):
    cp = _fake_cp(alloc)
    parent = device_pool(cp, 0)
    held = parent.lease(MiB)
    registry.copy_executor(2).submit(int).result()  # a live thread at the fork
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads
        pid = os.fork()
    if pid == 0:  # the child: report through the exit status only
        status = 1
        try:
            child = host_pool.device_pool(cp, 0)
            ok = child is not parent and child.allocated_bytes == 0
            held.free()  # the parent's lease: dropped, not freed
            ok = ok and not alloc.freed
            ok = ok and host_pool.copy_executor(2).submit(int, 5).result() == 5
            status = 0 if ok else 2
        finally:
            os._exit(status)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert parent.leased_bytes == MiB  # the parent's pool is untouched
    held.free()


def test_interpreter_exit_with_live_leases_does_not_crash(tmp_path):
    script = tmp_path / "exit.py"
    script.write_text(
        "import ctypes, contextlib\n"
        "from types import SimpleNamespace\n"
        "from gpu_engine import host_pool\n"
        "live = {}\n"
        "def alloc(n, flags):\n"
        "    b = ctypes.create_string_buffer(n); live[ctypes.addressof(b)] = b\n"
        "    return ctypes.addressof(b)\n"
        "def free(p):\n"
        "    del live[p]; print('freed', flush=True)\n"
        "rt = SimpleNamespace(hostAllocPortable=1, hostAlloc=alloc, freeHost=free)\n"
        "cp = SimpleNamespace(cuda=SimpleNamespace(runtime=rt,\n"
        "    Device=lambda i: contextlib.nullcontext()))\n"
        "pool = host_pool.device_pool(cp, 0)\n"
        "kept = pool.lease(1 << 20)\n"
        "pool.lease(1 << 20).free()\n"
        "host_pool.copy_executor(4).submit(int).result()\n"
        "print('done', flush=True)\n"
    )
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root)}
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode == 0, out.stderr
    # The idle buffer is freed at exit; the one still leased is left to the exit.
    assert out.stdout.split() == ["done", "freed"]


def test_the_walks_pinned_pool_leases_from_the_process_pool(alloc):
    source = _pool(alloc)
    cp = _fake_cp(alloc)
    rng = np.random.default_rng(0)
    X = rng.normal(size=(5000, 8)).astype(np.float32)
    y = rng.normal(size=5000).astype(np.float32)
    first = PinnedPool(cp, 0, np.float32, source=source)
    copied = first.copy_batch(X, y, None)
    np.testing.assert_array_equal(copied[0], X)
    assert source.leased_bytes == first.allocated_bytes > 0
    del copied
    gc.collect()
    first.close()  # an engine closes: its buffers go back to the process pool
    assert source.leased_bytes == 0 and not alloc.freed
    second = PinnedPool(cp, 0, np.float32, source=source)
    again = second.copy_batch(X, y, None)
    assert alloc.allocated == 1 and source.reuses == 1  # the next engine's pool reuses it
    np.testing.assert_array_equal(again[1], y)
    del again
    gc.collect()
    second.close()


def test_the_engine_refuses_a_bad_idle_bound_before_touching_cuda():
    from gpu_engine import GpuEngine
    from rh_dask import HuberConfig

    for bad in (-1, 1.5, "1 MiB", True):
        with pytest.raises(ValidationError, match="pinned_idle_bytes"):
            GpuEngine(HuberConfig(), pinned_idle_bytes=bad)


# -- the stager on the pool, with a simulated CuPy (copies are synchronous memmoves) ------


class _DeviceArray(np.ndarray):
    """Host memory standing in for device memory: ``.data.ptr`` is its address."""

    @property
    def data(self):  # CuPy's MemoryPointer
        return SimpleNamespace(ptr=self.ctypes.data)


class _SimulatedCuda:
    """The part of CuPy the stager touches; every copy completes when it is queued."""

    def __init__(self, alloc: FakeAllocator) -> None:
        def memcpy(dst, src, nbytes, kind, stream):
            ctypes.memmove(dst, src, nbytes)

        def pointer_attributes(ptr):
            raise RuntimeError("not registered")  # no caller's array is pinned here

        self.runtime = SimpleNamespace(
            hostAllocPortable=1,
            hostAlloc=lambda nbytes, flags: alloc.allocate(nbytes),
            freeHost=alloc.free,
            memcpyAsync=memcpy,
            memcpyHostToDevice=1,
            streamWaitEvent=lambda stream, event: None,
            eventQuery=lambda event: 0,
            pointerGetAttributes=pointer_attributes,
            setDevice=lambda device: None,
        )
        self.driver = SimpleNamespace(launchKernel=None, CUDADriverError=RuntimeError)
        self.Device = lambda _id: contextlib.nullcontext()

        class Stream:
            ptr = 1

            def __init__(self, non_blocking=False):
                pass

        class Event:
            ptr = 2

            def __init__(self, disable_timing=False):
                self.synchronized = 0
                self.records = 0

            def record(self, stream=None):
                self.records += 1

            def synchronize(self):
                self.synchronized += 1

        self.Stream, self.Event = Stream, Event


def _simulated_cupy(alloc):
    cuda = _SimulatedCuda(alloc)

    def empty(count, dtype):
        return np.zeros(count, dtype=dtype).view(_DeviceArray)

    return SimpleNamespace(cuda=cuda, empty=empty)


def _stager(cp, pool, threads=4):
    from gpu_engine.driver import DriverCalls
    from gpu_engine.transfer import HostStager

    return HostStager(cp, 0, np.float32, threads, calls=DriverCalls(cp, hold_gil=False), pool=pool)


def _host_batch(n, d, seed, weights=True):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, d)).astype(np.float32)
    y = rng.normal(size=n).astype(np.float32)
    return X, y, (rng.uniform(size=n).astype(np.float32) if weights else None)


def _assert_staged(staged, X, y, w):
    np.testing.assert_array_equal(np.asarray(staged.X), X)
    np.testing.assert_array_equal(np.asarray(staged.y), y)
    if w is not None:
        np.testing.assert_array_equal(np.asarray(staged.w), w)


def test_stagers_lease_from_the_pool_return_on_close_and_the_next_one_reuses(alloc):
    cp = _simulated_cupy(alloc)
    pool = _pool(alloc)
    first = _stager(cp, pool)
    for seed in range(3):  # 3 chunks per batch: the shared copy threads run
        batch = _host_batch(30000, 90, seed)
        _assert_staged(first.stage(*batch), *batch)
    leased = {slot.host.ptr for slot in first._slots}
    assert len(leased) == 2 and pool.stats()["allocations"] == 2
    first.close()
    assert pool.leased_bytes == 0 and pool.stats()["idle_buffers"] == 2 and not alloc.freed
    second = _stager(cp, pool)
    batch = _host_batch(30000, 90, 9)
    _assert_staged(second.stage(*batch), *batch)  # on the first stager's stale memory
    _assert_staged(second.stage(*batch), *batch)
    assert {slot.host.ptr for slot in second._slots} == leased
    assert pool.stats()["allocations"] == 2
    # A wider batch grows the slot: its old lease goes back, fenced by the slot's event.
    wide = _host_batch(30000, 120, 10)
    _assert_staged(second.stage(*wide), *wide)
    assert pool.stats()["allocations"] == 3 and pool.stats()["idle_buffers"] == 1
    second.close()
    assert pool.leased_bytes == 0


def test_two_live_stagers_interleaved_stage_their_own_batches(alloc):
    cp = _simulated_cupy(alloc)
    pool = _pool(alloc)
    a, b = _stager(cp, pool), _stager(cp, pool)
    errors = []

    def feed(stager, seed):
        for i in range(12):
            batch = _host_batch(20000, 64, seed + i, weights=i % 2 == 0)
            stager.prefetch(*batch)
            staged = stager.take(*batch)
            try:
                _assert_staged(staged, *batch)
            except AssertionError as exc:
                errors.append(exc)

    threads = [threading.Thread(target=feed, args=(s, k)) for s, k in ((a, 0), (b, 100))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    mine = {slot.host.ptr for slot in a._slots}
    theirs = {slot.host.ptr for slot in b._slots}
    assert len(mine | theirs) == 4  # never one buffer in two engines
    a.close()  # A closes first: B's memory is still B's and still works
    assert pool.leased_bytes == sum(slot.host.nbytes for slot in b._slots)
    batch = _host_batch(20000, 64, 999)
    _assert_staged(b.stage(*batch), *batch)
    b.close()
    assert pool.leased_bytes == 0


def test_prefetches_of_one_stager_are_staged_in_order_on_the_shared_threads(alloc):
    cp = _simulated_cupy(alloc)
    stager = _stager(cp, _pool(alloc))
    order = []
    real_stage = stager.stage

    def recording(X, y, w, in_place=None):
        order.append(X.shape[0])
        return real_stage(X, y, w, in_place)

    stager.stage = recording
    batches = [_host_batch(5000 + i, 8, i) for i in range(6)]
    for batch in batches:
        stager.prefetch(*batch)  # only the last is kept pending; all are staged
    last = stager.take(*batches[-1])
    stager.close()
    assert order == [5000 + i for i in range(6)]
    assert last is not None and last.n == 5005


def test_a_failed_staging_still_fences_the_copies_it_queued(alloc):
    """A copy that fails after others were queued: `copied` is recorded after them."""
    cp = _simulated_cupy(alloc)
    stager = _stager(cp, _pool(alloc), threads=1)
    real = stager._calls.copy_to_device
    queued = []

    def failing(dst, src, nbytes, stream):
        if len(queued) == 1:  # X's DMA is queued, y's fails
            raise RuntimeError("copy refused")
        queued.append(nbytes)
        real(dst, src, nbytes, stream)

    stager._calls.copy_to_device = failing
    slot = stager._slots[0]
    with pytest.raises(RuntimeError, match="copy refused"):
        stager.stage(*_host_batch(100, 4, 0))
    assert queued and slot.copied.records == 1 and slot.used
    assert slot.ready.records == 0  # the batch never becomes ready
    stager._calls.copy_to_device = real
    batch = _host_batch(100, 4, 1)
    stager.stage(*batch)  # slot 1
    _assert_staged(stager.stage(*batch), *batch)  # slot 0 again, after its fence
    assert slot.copied.records == 2
    stager.close()


def test_a_slot_whose_lease_failed_leases_again_on_the_next_staging(alloc):
    cp = _simulated_cupy(alloc)
    real = alloc.allocate
    refused = []

    def allocate(nbytes):
        if len(refused) == 0 and nbytes > 2 * MiB:  # the grown slot's lease fails once
            refused.append(nbytes)
            raise MemoryError("out of page-locked memory")
        return real(nbytes)

    stager = _stager(cp, HostMemoryPool(allocate, alloc.free), threads=1)
    small = _host_batch(100, 4, 0)
    _assert_staged(stager.stage(*small), *small)  # slot 0 holds a small lease
    stager.stage(*small)  # slot 1
    big = _host_batch(40000, 16, 1)
    with pytest.raises(MemoryError):
        stager.stage(*big)  # slot 0 grows: its old lease went back, the new one failed
    assert refused and stager._slots[0].host is None
    stager.stage(*small)  # slot 1
    _assert_staged(stager.stage(*small), *small)  # slot 0, a size it held before: leases again
    stager.stage(*small)  # slot 1
    _assert_staged(stager.stage(*big), *big)  # slot 0 grows again, now granted
    stager.close()
