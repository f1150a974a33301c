"""Page-locking the relay ring in the engine's process, with a stand-in for CUDA.

The GPU side (``PinnedPool.register``, ``cudaHostRegister``) is tested on the
device in ``tests/test_gpu_host_pool.py``; here a fake pool records what
would be locked, so the rules run on any machine: which chunks skip the
pinned pool's copy, when locking starts, and that the ring is unlocked
before it is unmapped.
"""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from rh_dask.distributed.items import EmptyChunk, LoadedChunk
from rh_dask.distributed.ring import ChunkRing, RingWriter
from rh_dask.distributed.ring_pinning import RingPinning

pytestmark = pytest.mark.timeout(60)


class _Registration:
    def __init__(self, address: int, nbytes: int, log: list) -> None:
        self.address, self.nbytes, self._log = address, nbytes, log

    def covers(self, arr) -> bool:
        if arr is None or arr.size == 0:
            return True
        start = arr.ctypes.data
        return self.address <= start and start + arr.nbytes <= self.address + self.nbytes

    def close(self, synchronize: bool = True) -> None:
        if synchronize:
            self._log.append("synchronize")
        self._log.append("unregister")


class _Pool:
    def __init__(self, fail: bool = False, gate: threading.Event | None = None) -> None:
        self.log: list = []
        self.fail = fail
        self.gate = gate
        self.entered = threading.Event()  # set once a register call has begun
        self.copied: list[int] = []

    def register(self, address: int, nbytes: int) -> _Registration:
        self.entered.set()
        if self.gate is not None:
            self.gate.wait(10)
        if self.fail:
            raise RuntimeError("cudaErrorHostMemoryAlreadyRegistered")
        self.log.append(("register", address, nbytes))
        return _Registration(address, nbytes, self.log)

    def copy_batch(self, X, y, w, wait=True):
        self.copied.append(int(X.shape[0]))
        return X.copy(), y.copy(), None if w is None else w.copy()


def _ring_chunk(ring: ChunkRing, writer: RingWriter, index: int, rows: int = 64) -> LoadedChunk:
    rng = np.random.default_rng(index)
    X = rng.normal(size=(rows, 5)).astype("float32")
    arrays = [X, rng.normal(size=rows).astype("float32")]
    note = writer.write(index, [*arrays, None])
    X, y, w = ring.parts(note)
    np.testing.assert_array_equal(X, arrays[0])
    return LoadedChunk(index, X, y, w)


@pytest.fixture
def made(tmp_path):
    ring = ChunkRing.create(str(tmp_path), n_slots=2, slot_bytes=1 << 16)
    writer = RingWriter.attach(ring.spec)
    yield ring, writer
    writer.close()
    ring.close()


def test_chunks_in_the_locked_ring_need_no_copy_and_others_do(made):
    ring, writer = made
    pin = RingPinning(ring)
    item = _ring_chunk(ring, writer, 0)
    assert not pin.holds(item)  # not started: no pool yet (engine="auto" before its first chunk)
    pin.start(None)
    assert not pin.holds(item)
    pool = _Pool()
    pin.start(pool)
    pin.start(pool)  # once only
    pin._done.wait(10)
    assert pin.locked and pin.error is None
    address, nbytes = ring.address_range()
    slots = ring.slot_ranges()
    assert pool.log == [("register", a, n) for a, n in slots]  # one slot at a time
    assert len(slots) == 2 and all(n == ring.spec.slot_bytes for _, n in slots)
    assert address < slots[0][0] and slots[1][0] + slots[1][1] <= address + nbytes
    assert pin.holds(item)
    elsewhere = LoadedChunk(1, np.ones((4, 5), "float32"), np.ones(4, "float32"), None)
    assert not pin.holds(elsewhere)
    half = LoadedChunk(2, item.X, np.ones(64, "float32"), None)  # y outside the ring
    assert not pin.holds(half)
    assert not pin.holds(EmptyChunk(3))
    pin.close()
    pin.close()
    # One wait for the device, before the first slot is unlocked, serves both.
    assert pool.log[-3:] == ["synchronize", "unregister", "unregister"]
    assert pool.log.count("unregister") == 2 and pool.log.count("synchronize") == 1
    assert not pin.holds(item)


def test_a_slot_that_fails_to_unlock_leaves_the_wait_to_the_next(made):
    ring, _ = made
    pool = _Pool()
    pin = RingPinning(ring)
    pin.start(pool)
    pin._done.wait(10)
    first = pin._registrations[0]

    def refuse(synchronize=True):
        raise RuntimeError("cudaErrorHostMemoryNotRegistered")

    first.close = refuse
    with pytest.raises(RuntimeError, match="NotRegistered"):
        pin.close()
    # The first slot's close failed before its wait: the second still waits.
    assert pool.log[-2:] == ["synchronize", "unregister"]


def test_a_chunk_in_a_file_of_its_own_is_not_held(tmp_path):
    ring = ChunkRing.create(str(tmp_path), n_slots=2, slot_bytes=4096)
    writer = RingWriter.attach(ring.spec)
    try:
        pin = RingPinning(ring)
        pin.start(_Pool())
        pin._done.wait(10)
        big = _ring_chunk(ring, writer, 0, rows=1024)  # 24 kB: larger than a slot
        assert pin.locked and not pin.holds(big)
        del big
        pin.close()
    finally:
        writer.close()
        ring.close()


def test_a_ring_that_cannot_be_locked_keeps_copying(made, caplog):
    ring, writer = made
    pin = RingPinning(ring)
    pin.start(_Pool(fail=True))
    pin._done.wait(10)
    assert not pin.locked and "AlreadyRegistered" in pin.error and not pin._registrations
    assert not pin.holds(_ring_chunk(ring, writer, 0))
    assert "stays (partly) pageable" in caplog.text
    pin.close()


def test_slots_locked_before_a_failure_stay_locked_and_are_unlocked_at_close(made):
    ring, writer = made
    pool = _Pool()
    real = pool.register

    def second_fails(address, nbytes):
        if pool.log:
            raise RuntimeError("out of lockable memory")
        return real(address, nbytes)

    pool.register = second_fails
    pin = RingPinning(ring)
    pin.start(pool)
    pin._done.wait(10)
    assert not pin.locked and "lockable" in pin.error
    first, second = _ring_chunk(ring, writer, 0), _ring_chunk(ring, writer, 1)
    assert pin.holds(first) and not pin.holds(second)
    del first, second
    pin.close()
    assert pool.log[-2:] == ["synchronize", "unregister"] and pool.log.count("unregister") == 1


def test_close_waits_for_the_locking_then_unlocks(made):
    ring, _ = made
    gate = threading.Event()
    pool = _Pool(gate=gate)
    pin = RingPinning(ring)
    pin.start(pool)
    assert pool.entered.wait(10)  # the first slot is locking (else close may come first)
    closer = threading.Thread(target=pin.close)
    closer.start()
    closer.join(0.2)
    assert closer.is_alive()  # still locking
    gate.set()
    closer.join(10)
    assert not closer.is_alive()
    # Closed while the first slot was locking: the second is never locked.
    steps = ["register", "synchronize", "unregister"]
    assert [e if isinstance(e, str) else e[0] for e in pool.log] == steps
    pin.start(pool)  # closed: never starts again
    assert [e if isinstance(e, str) else e[0] for e in pool.log] == steps


@pytest.mark.parametrize("pin_ring", [True, False])
def test_the_actor_skips_the_pinned_copy_for_chunks_in_a_locked_ring(tmp_path, pin_ring):
    from rh_dask.config import HuberConfig
    from rh_dask.distributed.actor import EngineActor
    from rh_dask.settings import Settings

    settings = Settings(relay_directory=str(tmp_path), relay_pin_ring=pin_ring)
    actor = EngineActor("numpy", HuberConfig(), settings=settings)
    pool = _Pool()
    actor._pool = pool
    delivered: list = []
    actor._consumer.deliver = lambda stream_id, item: delivered.append(item) or True
    actor._consumer.add_waiter = lambda *a, **k: lambda: None
    try:
        spec = actor.open_relay("s", 0, 2, 1 << 16)
        ring, _ = actor._relay
        if pin_ring:
            actor._ring_pin._done.wait(10)
        writer = RingWriter.attach(spec)
        try:
            item = _ring_chunk(ring, writer, 0)
            actor._relayed("s", ring, item)
            assert (delivered[-1] is item) == pin_ring
            assert pool.copied == ([] if pin_ring else [64])
            outside = LoadedChunk(1, np.ones((8, 5), "float32"), np.ones(8, "float32"), None)
            actor._relayed("s", ring, outside)
            assert pool.copied[-1] == 8  # not in the ring: copied as before
        finally:
            writer.close()
        del item, delivered[:]
        actor._close_relay()
        assert ("unregister" in pool.log) == pin_ring
    finally:
        actor.close()


def test_a_kept_ring_stays_locked_for_the_next_stream_of_its_shape(tmp_path):
    from rh_dask.config import HuberConfig
    from rh_dask.distributed import shelf
    from rh_dask.distributed.actor import EngineActor
    from rh_dask.settings import Settings

    settings = Settings(relay_directory=str(tmp_path), engine_keep=30.0)
    pool = _Pool()

    def actor() -> EngineActor:
        made = EngineActor("numpy", HuberConfig(), settings=settings)
        made._pool = pool
        return made

    shelf.clear()
    first = actor()
    try:
        spec = first.open_relay("s1", 0, 2, 1 << 16)
        first._ring_pin._done.wait(10)
        registered = [e for e in pool.log if e[0] == "register"]
        assert len(registered) == 2 and spec.reused == 0
        first._close_relay(keep=True)
        first.close()  # parked with its engine, the ring with it
        assert shelf.parked() == 1 and pool.log.count("unregister") == 0
        assert len(os.listdir(tmp_path)) == 1

        second = actor()
        assert second.reused
        renewed = second.open_relay("s2", 4, 2, 1 << 16)
        assert renewed.reused == 1 and renewed.path == spec.path
        assert renewed.ring_id != spec.ring_id and renewed.token != spec.token
        # The same locked memory: nothing registered again, chunks need no copy.
        assert [e for e in pool.log if e[0] == "register"] == registered
        ring, _ = second._relay
        writer = RingWriter.attach(renewed)
        try:
            item = _ring_chunk(ring, writer, 4)
            assert second._ring_pin.holds(item)
        finally:
            writer.close()
        del item
        second._close_relay(keep=True)
        second.close()

        # Another shape: the kept ring is closed (unlocked first), a new one made.
        third = actor()
        other = third.open_relay("s3", 0, 3, 1 << 16)
        # Locking runs on a thread of its own; closing stops it part way, so
        # wait for all three slots before counting what is unlocked at the end.
        third._ring_pin._done.wait(10)
        assert len([e for e in pool.log if e[0] == "register"]) == 5
        assert other.reused == 0 and other.path != spec.path
        assert pool.log.count("unregister") == 2
        assert os.listdir(tmp_path) == [os.path.basename(other.path)]
        third._close_relay(keep=True)
        third.close()
    finally:
        shelf.clear()  # closes the parked engine and the ring kept with it
    assert os.listdir(tmp_path) == []
    assert pool.log.count("unregister") == 5


def test_a_stream_that_failed_keeps_no_ring(tmp_path):
    from rh_dask.config import HuberConfig
    from rh_dask.distributed import shelf
    from rh_dask.distributed.actor import EngineActor
    from rh_dask.settings import Settings

    shelf.clear()
    for keep_ring in (True, False):
        settings = Settings(
            relay_directory=str(tmp_path), engine_keep=30.0, relay_keep_ring=keep_ring
        )
        actor = EngineActor("numpy", HuberConfig(), settings=settings)
        try:
            actor.open_relay("s", 0, 2, 1 << 16)
            actor._close_relay(keep=not keep_ring)  # a failed stream passes keep=False
            assert os.listdir(tmp_path) == []
        finally:
            actor.close()
            shelf.clear()


def test_a_kept_ring_drops_its_locking_where_the_next_engine_may_differ(tmp_path):
    from rh_dask.config import HuberConfig
    from rh_dask.distributed import shelf
    from rh_dask.distributed.actor import EngineActor
    from rh_dask.settings import Settings

    shelf.clear()
    settings = Settings(relay_directory=str(tmp_path), engine_keep=30.0)
    try:
        # engine="auto" may close its engine (and pool) at the next choice.
        auto = EngineActor("auto", HuberConfig(), settings=settings)
        auto._pool = _Pool()
        auto.open_relay("a", 0, 2, 1 << 16)
        auto._ring_pin._done.wait(10)
        auto._close_relay(keep=True)
        ring, pin = auto._kept
        assert pin is None and ring.renewable
        assert auto._pool.log.count("unregister") == 2
        auto.close()
        shelf.clear()

        # A kept, locked ring taken by a stream that leaves rings pageable: unlocked, reused.
        pool = _Pool()
        first = EngineActor("numpy", HuberConfig(), settings=settings)
        first._pool = pool
        spec = first.open_relay("s1", 0, 2, 1 << 16)
        first._ring_pin._done.wait(10)
        first._close_relay(keep=True)
        first.close()
        pageable = Settings(relay_directory=str(tmp_path), engine_keep=30.0, relay_pin_ring=False)
        second = EngineActor("numpy", HuberConfig(), settings=pageable)
        second._pool = pool
        renewed = second.open_relay("s2", 0, 2, 1 << 16)
        assert renewed.reused == 1 and renewed.path == spec.path
        assert second._ring_pin is None and pool.log.count("unregister") == 2
        second._close_relay(keep=True)
        second.close()
    finally:
        shelf.clear()
    assert os.listdir(tmp_path) == []
