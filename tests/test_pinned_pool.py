"""The GPU engine's pinned pool, on CPU: page-locked allocation replaced by malloc.

The pool's bookkeeping (lease, return when the last view dies, growth in the
background, replacement of small buffers, close with batches still alive)
needs no device; ``tests/test_gpu_engine.py`` covers it with real pinned
memory and DMA.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import time
from types import SimpleNamespace

import numpy as np
import pytest

from gpu_engine.transfer import POOL_GRANULE, PinnedPool
from rh_dask.exceptions import ValidationError


class _Runtime:
    """``cupy.cuda.runtime`` for PinnedBuffer: host allocations by ctypes."""

    hostAllocPortable = 1
    hostAllocMapped = 2

    def __init__(self) -> None:
        self.live: dict[int, ctypes.Array] = {}
        self.allocations = 0
        self.fail = False

    def hostAlloc(self, nbytes: int, flags: int) -> int:  # CuPy's name
        if self.fail:
            raise MemoryError("no page-locked memory left")
        buf = ctypes.create_string_buffer(nbytes)
        self.live[ctypes.addressof(buf)] = buf
        self.allocations += 1
        return ctypes.addressof(buf)

    def freeHost(self, ptr: int) -> None:  # CuPy's name
        del self.live[ptr]


@pytest.fixture
def fake_cp():
    runtime = _Runtime()
    cuda = SimpleNamespace(runtime=runtime, Device=lambda _id: contextlib.nullcontext())
    return SimpleNamespace(cuda=cuda)


def _batch(n=1000, d=6, seed=0, weights=False):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, d)).astype(np.float32)
    y = rng.normal(size=n).astype(np.float32)
    w = rng.uniform(size=n).astype(np.float32) if weights else None
    return X, y, w


def test_copies_and_returns_buffers_when_the_last_view_dies(fake_cp):
    pool = PinnedPool(fake_cp, 0, np.float32)
    X, y, w = _batch(weights=True)
    Xp, yp, wp = pool.copy_batch(X, y, w)
    np.testing.assert_array_equal(Xp, X)
    np.testing.assert_array_equal(yp, y)
    np.testing.assert_array_equal(wp, w)
    assert pool.buffers == 1 and pool.allocated_bytes == POOL_GRANULE
    view = Xp[10:20]  # a view keeps the buffer leased
    del Xp, yp, wp
    gc.collect()
    second = pool.copy_batch(*_batch(seed=1))
    assert pool.buffers == 2  # the first buffer is still viewed
    del view, second
    gc.collect()
    again = pool.copy_batch(*_batch(seed=2))
    assert pool.buffers == 2 and fake_cp.cuda.runtime.allocations == 2  # reused
    del again
    pool.close()
    assert not fake_cp.cuda.runtime.live


def test_without_waiting_it_grows_in_the_background_and_replaces_small_buffers(fake_cp):
    pool = PinnedPool(fake_cp, 0, np.float32)
    small = _batch(n=100)
    assert pool.copy_batch(*small, wait=False) is None

    def settle(expected_buffers):
        deadline = time.monotonic() + 10
        while pool.buffers < expected_buffers and time.monotonic() < deadline:
            time.sleep(0.005)
        while pool._growing and time.monotonic() < deadline:
            time.sleep(0.005)

    settle(1)
    copied = pool.copy_batch(*small, wait=False)
    assert copied is not None
    del copied
    gc.collect()
    # A batch larger than every idle buffer: a bigger one replaces the small one.
    large = _batch(n=POOL_GRANULE // 4 // 7 + 1000, d=6)
    assert pool.copy_batch(*large, wait=False) is None
    time.sleep(0.2)
    settle(1)
    assert pool.buffers == 1 and pool.allocated_bytes > POOL_GRANULE
    assert pool.copy_batch(*large, wait=False) is not None
    pool.close()


def test_allocation_failure_in_the_background_leaves_batches_pageable(fake_cp):
    fake_cp.cuda.runtime.fail = True
    pool = PinnedPool(fake_cp, 0, np.float32)
    X, y, _ = _batch()
    assert pool.copy_batch(X, y, None, wait=False) is None
    deadline = time.monotonic() + 10
    while pool._growing and time.monotonic() < deadline:
        time.sleep(0.005)
    assert pool.copy_batch(X, y, None, wait=False) is None and pool.buffers == 0
    with pytest.raises(MemoryError):
        pool.copy_batch(X, y, None)  # waiting: the failure is the caller's
    assert pool.buffers == 0


def test_refuses_other_dtypes_and_shapes_and_frees_after_close(fake_cp):
    pool = PinnedPool(fake_cp, 0, np.float32)
    X, y, _ = _batch()
    with pytest.raises(ValidationError, match="float32"):
        pool.copy_batch(X.astype(np.float64), y, None)
    with pytest.raises(ValidationError, match="shape"):
        pool.copy_batch(X, y[:-1], None)
    alive = pool.copy_batch(X, y, None)
    pool.close()
    assert len(fake_cp.cuda.runtime.live) == 1  # still viewed by ``alive``
    del alive
    gc.collect()
    assert not fake_cp.cuda.runtime.live
    with pytest.raises(RuntimeError, match="closed"):
        pool.copy_batch(X, y, None)
