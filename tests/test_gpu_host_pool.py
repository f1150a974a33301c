"""The GPU engine on the process-wide pinned staging pool, on a real CUDA device.

Skipped where CuPy or a device is missing (CI); ``tests/test_host_pool.py``
covers the pool's bookkeeping on CPU. Here: a fresh engine reuses the
previous engine's pinned memory (the pool does not grow), results are the
same bits on reused (stale) and on fresh memory, and two live engines
interleaved give the same bits as each alone, whichever closes first.

    PYTHONPATH=. pytest -q tests/test_gpu_host_pool.py
"""

from __future__ import annotations

import gc

import numpy as np
import pytest

cp = pytest.importorskip("cupy", reason="the GPU engine needs CuPy")


def _device_count() -> int:
    try:
        return int(cp.cuda.runtime.getDeviceCount())
    except Exception:
        return 0


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(_device_count() == 0, reason="no CUDA device visible to CuPy"),
]

from gpu_engine import GpuEngine  # noqa: E402
from gpu_engine import engine as engine_module  # noqa: E402
from gpu_engine.host_pool import HostMemoryPool, cuda_allocator, device_pool  # noqa: E402
from rh_dask import HuberConfig, RenewableHuberRegressor  # noqa: E402
from rh_dask.datasets import StreamSpec  # noqa: E402
from rh_dask.exceptions import ValidationError  # noqa: E402

IDLE = 256 << 20


def _stream(features, sizes, dtype, seed, weights=False):
    X, y = StreamSpec(n_features=features, seed=seed).chunk(0, sum(sizes), "float64")
    X, y = np.ascontiguousarray(X, dtype=dtype), np.ascontiguousarray(y, dtype=dtype)
    out, start = [], 0
    rng = np.random.default_rng(seed)
    for n in sizes:
        w = rng.uniform(0.5, 2.0, n).astype(dtype) if weights else None
        out.append((X[start : start + n], y[start : start + n], w))
        start += n
    return out


def _run(engine, batches, *, stream=False):
    if stream:
        diags = list(engine.partial_fit_stream(batches))
    else:
        diags = [engine.partial_fit(X, y, w) for X, y, w in batches]
    return engine.export_state(), [(d.iterations, d.converged, d.objective) for d in diags]


def _leases(engine):
    return {slot.host.ptr for slot in engine._inputs.stager._slots if slot.host is not None}


def test_a_second_fresh_engine_reuses_the_pool_and_the_pool_does_not_grow():
    gc.collect()  # engines of earlier tests give their leases back now, not midway
    pool = device_pool(cp, 0)
    pool.clear()  # only this test's buffers idle from here on
    config = HuberConfig(dtype="float32")
    batches = _stream(30, [20000, 20000, 7000], "float32", seed=3)
    first = GpuEngine(config, pinned_idle_bytes=IDLE)
    _run(first, batches)
    held = _leases(first)
    assert len(held) == 2
    first.close()
    after_first = pool.stats()
    assert after_first["leased_bytes"] == 0 and after_first["idle_buffers"] == 2
    second = GpuEngine(config, pinned_idle_bytes=IDLE)
    _run(second, batches)
    during = pool.stats()
    assert _leases(second) == held  # the very buffers the first engine gave back
    assert during["allocations"] == after_first["allocations"]  # no new pinning
    assert during["allocated_bytes"] == after_first["allocated_bytes"]
    second.close()
    # The same through the estimator: fresh models one after the other.
    for _ in range(2):
        model = RenewableHuberRegressor(engine="gpu", dtype="float32")
        for X, y, _w in batches:
            model.partial_fit(X, y)
        del model
        gc.collect()
    assert pool.stats()["allocations"] == after_first["allocations"]
    assert pool.stats()["allocated_bytes"] == after_first["allocated_bytes"]


def test_an_engine_collected_without_close_gives_its_leases_back():
    pool = device_pool(cp, 0)
    engine = GpuEngine(HuberConfig(dtype="float64"), pinned_idle_bytes=IDLE)
    _run(engine, _stream(12, [5000, 5000], "float64", seed=4))
    leased = pool.stats()["leased_bytes"]
    assert leased > 0
    del engine
    gc.collect()
    assert pool.stats()["leased_bytes"] < leased


@pytest.mark.parametrize("rounds", [3])
def test_engines_collected_in_reference_cycles_leave_the_pool_usable(rounds):
    """The collector may finalise a cycle's CuPy events and stream before the engine.

    The pool must then neither wait on a destroyed event (a crash, or
    ``cudaErrorContextIsDestroyed``) nor have the engine synchronise a
    destroyed stream: the leases' fences are the pool's RawEvents and a
    collected engine waits for the device instead.
    """
    pool = device_pool(cp, 0)
    batches = _stream(20, [6000, 6000], "float32", seed=12)
    reference = GpuEngine(HuberConfig(dtype="float32"), pinned_idle_bytes=IDLE)
    expected = _run(reference, batches)
    reference.close()
    for _ in range(rounds):
        engine = GpuEngine(HuberConfig(dtype="float32"), pinned_idle_bytes=IDLE)
        engine.cycle = engine  # only the cyclic collector can free it
        _run(engine, batches)
        del engine
        gc.collect()
    pool.clear()  # waits on every idle buffer's fence
    again = GpuEngine(HuberConfig(dtype="float32"), pinned_idle_bytes=IDLE)
    got = _run(again, batches)
    again.close()
    assert got[0].equals(expected[0]) and got[1] == expected[1]


def test_results_are_the_same_bits_on_reused_stale_memory_and_on_a_fresh_pool(monkeypatch):
    config = HuberConfig(dtype="float32")
    target = _stream(24, [16000, 16000, 3001], "float32", seed=5, weights=True)
    gc.collect()
    device_pool(cp, 0).clear()  # the next engine gets the dirty engine's buffers
    # Leave other data in the process pool's buffers: a wider, unweighted stream.
    dirty = GpuEngine(config, pinned_idle_bytes=IDLE)
    _run(dirty, _stream(40, [16000, 16000], "float32", seed=6))
    dirty.close()
    reused = GpuEngine(config, pinned_idle_bytes=IDLE)
    reused_out = [_run(reused, target), None]
    reused.reset()
    reused_out[1] = _run(reused, target, stream=True)
    reused.close()
    fresh_pool = HostMemoryPool(*cuda_allocator(cp, 0))
    monkeypatch.setattr(engine_module, "device_pool", lambda _cp, _device: fresh_pool)
    fresh = GpuEngine(config)
    assert fresh._inputs.stager.pool is fresh_pool
    fresh_out = [_run(fresh, target), None]
    fresh.reset()
    fresh_out[1] = _run(fresh, target, stream=True)
    assert fresh_pool.stats()["allocations"] == 2  # its own two slots, on new memory
    fresh.close()
    for (s_reused, d_reused), (s_fresh, d_fresh) in zip(reused_out, fresh_out, strict=True):
        assert s_reused.equals(s_fresh)
        assert d_reused == d_fresh
    assert reused_out[0][0].equals(reused_out[1][0])  # plain loop and prefetch agree
    fresh_pool.clear()
    assert fresh_pool.stats()["allocated_bytes"] == 0


@pytest.mark.parametrize("feed", ["loop", "stream"])
def test_two_live_engines_interleaved_give_the_bits_of_each_alone(feed):
    config_a = HuberConfig(dtype="float32")
    config_b = HuberConfig(dtype="float32", penalty="l1")
    data_a = _stream(30, [12000, 12000, 12000, 500], "float32", seed=7)
    data_b = _stream(30, [12000, 9000, 12000, 12000], "float32", seed=8, weights=True)
    alone = []
    for config, data in ((config_a, data_a), (config_b, data_b)):
        engine = GpuEngine(config, pinned_idle_bytes=IDLE)
        alone.append(_run(engine, data))
        engine.close()
    a = GpuEngine(config_a, pinned_idle_bytes=IDLE)
    b = GpuEngine(config_b, pinned_idle_bytes=IDLE)
    diags_a, diags_b = [], []
    if feed == "loop":
        for (Xa, ya, wa), (Xb, yb, wb) in zip(data_a, data_b, strict=True):
            diags_a.append(a.partial_fit(Xa, ya, wa))
            diags_b.append(b.partial_fit(Xb, yb, wb))
            assert not _leases(a) & _leases(b)  # never the same pinned buffer
    else:
        for da, db in zip(a.partial_fit_stream(data_a), b.partial_fit_stream(data_b), strict=True):
            diags_a.append(da)
            diags_b.append(db)
            assert not _leases(a) & _leases(b)
    for engine, diags, (state, expected) in ((a, diags_a, alone[0]), (b, diags_b, alone[1])):
        assert engine.export_state().equals(state)
        assert [(d.iterations, d.converged, d.objective) for d in diags] == expected
    # A closes first; B goes on with a refused batch and a good one, unaffected.
    before = b.export_state()
    a.close()
    bad_X = data_b[0][0].copy()
    bad_X[5, 2] = np.nan
    with pytest.raises(ValidationError, match="finite"):
        b.partial_fit(bad_X, data_b[0][1])
    assert b.export_state().equals(before)
    b.partial_fit(*data_b[1][:2])
    twin = GpuEngine(config_b, pinned_idle_bytes=IDLE)
    _run(twin, data_b)
    twin.partial_fit(*data_b[1][:2])
    assert b.export_state().equals(twin.export_state())
    b.close()
    twin.close()


def test_a_zero_bound_keeps_no_idle_memory():
    gc.collect()
    pool = device_pool(cp, 0)
    engine = GpuEngine(HuberConfig(dtype="float32"), pinned_idle_bytes=0)
    assert pool.stats()["idle_bytes"] == 0
    _run(engine, _stream(16, [4000, 4000], "float32", seed=9))
    frees = pool.stats()["frees"]
    engine.close()
    stats = pool.stats()
    assert stats["idle_bytes"] == 0 and stats["frees"] == frees + 2
    GpuEngine(HuberConfig(dtype="float32"), pinned_idle_bytes=IDLE).close()  # restore
    assert pool.max_idle_bytes == IDLE


@pytest.mark.parametrize("feed", ["loop", "stream"])
def test_a_registered_shared_memory_ring_is_copied_from_in_place(feed):
    """Chunks in a page-locked ring (the relay path) fit to the bits of pageable copies.

    The ring is made where relays make it (``/dev/shm``): CUDA locks its
    sparse pages (a slot gets its memory at its first write) but refuses
    mappings of disk files.
    """
    from gpu_engine.transfer import is_pinned
    from rh_dask.distributed.ring import ChunkRing, RingWriter, default_directory

    batches = _stream(20, [3000, 2500, 3000, 1700], "float32", seed=7, weights=True)
    ring = ChunkRing.create(default_directory(), n_slots=2, slot_bytes=1 << 20)
    writer = RingWriter.attach(ring.spec)
    engine = GpuEngine(HuberConfig(dtype="float32"))
    reference = GpuEngine(HuberConfig(dtype="float32"))
    try:
        registration = engine.pinned_pool.register(*ring.address_range())
        views = []
        for i, (X, y, w) in enumerate(batches[:2]):
            views.append(ring.parts(writer.write(i, [X, y, w])))
        assert all(is_pinned(cp, a) for v in views for a in v)
        assert all(registration.covers(a) for v in views for a in v)
        _run(engine, [tuple(v) for v in views], stream=feed == "stream")
        del views
        for i in (0, 1):
            ring.release(i)
        views = [ring.parts(writer.write(i + 2, list(b))) for i, b in enumerate(batches[2:])]
        _run(engine, [tuple(v) for v in views], stream=feed == "stream")
        copies = [tuple(None if a is None else np.array(a) for a in b) for b in batches]
        _run(reference, copies)
        got, want = engine.export_state(), reference.export_state()
        assert got.coefficients.tobytes() == want.coefficients.tobytes()
        assert got.information.tobytes() == want.information.tobytes()
        registration.close()
        registration.close()
        assert not is_pinned(cp, views[0][0])
        del views
    finally:
        engine.close()
        reference.close()
        writer.close()
        ring.close()
