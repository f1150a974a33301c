"""The shared-memory chunk ring and the relay's note channel, without a Dask cluster.

A :class:`~rh_dask.distributed.ring.ChunkRing` is made in ``tmp_path`` (any
directory works; ``/dev/shm`` is only the default), and the writer side
attaches to it from this process, as a relay worker on the engine's node
does from its own. Waits that must block are run on threads with a bounded
join, so a ring that fails to block (or to wake) fails the test instead of
hanging it.
"""

from __future__ import annotations

import errno
import os
import queue
import shutil
import socket
import tempfile
import threading
import time
from dataclasses import replace
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client

import numpy as np
import pytest

from rh_dask.distributed import relay
from rh_dask.distributed import ring as ring_module
from rh_dask.distributed.items import BadChunk, EmptyChunk, LoadedChunk
from rh_dask.distributed.relay import RelayReceiver, attach_relay, attached_rings, relay_chunk
from rh_dask.distributed.ring import ChunkRing, RingError, RingWriter, SlotNote, slot_layout
from rh_dask.exceptions import RhDaskError, ValidationError

pytestmark = pytest.mark.timeout(60)

#: How long a write that must wait is given to (wrongly) finish.
BLOCKED_SECONDS = 0.3


def _chunk(rows: int, d: int, dtype: str, seed: int = 0, weights: bool = True):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(rows, d)).astype(dtype)
    y = rng.normal(size=rows).astype(dtype)
    w = rng.uniform(0.5, 2.0, size=rows).astype(dtype) if weights else None
    return X, y, w


def _same(got, want) -> None:
    """Equal arrays with the same dtype and shape, bit for bit (or both None)."""
    assert (got is None) == (want is None)
    if want is None:
        return
    assert got.dtype == want.dtype and got.shape == want.shape
    assert np.ascontiguousarray(got).tobytes() == np.ascontiguousarray(want).tobytes()


def _names(directory) -> list[str]:
    return sorted(os.listdir(directory))


@pytest.fixture
def made(tmp_path):
    """A 2-slot ring in ``tmp_path`` and a writer attached to it; both closed after."""
    r = ChunkRing.create(str(tmp_path), n_slots=2, slot_bytes=1 << 16)
    w = RingWriter.attach(r.spec)
    yield r, w
    w.close()
    r.close()


def _writing(writer: RingWriter, index: int, arrays) -> tuple[threading.Thread, list]:
    """Start ``writer.write(index, arrays)`` on a thread; its outcome lands in the list."""
    out: list = []

    def run() -> None:
        try:
            out.append(writer.write(index, arrays))
        except BaseException as exc:
            out.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


# -- round trips ---------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("weights", [True, False])
def test_write_then_parts_round_trip(made, dtype, weights):
    r, w = made
    for index in range(4):  # both slots, twice
        X, y, sw = _chunk(300 + index, 6, dtype, seed=index, weights=weights)
        note = w.write(index, [X, y, sw])
        assert note is not None and note.index == index and note.slot == index % 2
        assert note.overflow is None
        assert note.nbytes == X.nbytes + y.nbytes + (0 if sw is None else sw.nbytes)
        got = r.parts(note)
        assert len(got) == 3
        for part, want in zip(got, [X, y, sw], strict=True):
            _same(part, want)
        assert got[1].ndim == 1
        assert got[0].flags.c_contiguous
        r.release(index)


def test_non_contiguous_sources_are_packed(made):
    r, w = made
    base, ybase, _ = _chunk(400, 10, "float64", seed=3, weights=False)
    X = base[::2, ::3]  # strided rows and columns
    y = ybase[::2]
    sw = np.asfortranarray(base[:200, :2])[:, 1]  # a column of a Fortran array
    assert not X.flags.c_contiguous and not y.flags.c_contiguous
    note = w.write(0, [X, y, sw])
    got = r.parts(note)
    for part, want in zip(got, [X, y, sw], strict=True):
        _same(part, want)
        assert part.flags.c_contiguous


def test_parts_of_a_slot_are_views_of_the_ring_until_release(made):
    r, w = made
    X, y, _ = _chunk(100, 3, "float64", weights=False)
    note = w.write(0, [X, y, None])
    first = r.parts(note)
    again = r.parts(note)
    # No copy: both reads see the same memory.
    assert np.shares_memory(first[0], again[0])
    assert not np.shares_memory(first[0], X)


# -- slot ownership ---------------------------------------------------------------------------
@pytest.fixture
def long_wait(monkeypatch):
    """A relay waits for its slot long enough for a test to release it by hand."""
    monkeypatch.setattr(ring_module, "_OWNER_WAIT_SECONDS", 30.0)


def test_a_chunk_whose_slot_stays_held_goes_to_a_file_of_its_own(made):
    # A relay never blocks its thread for long: the slot's chunk may be the one
    # queued behind it on the same relay. The held slot is never written over.
    r, w = made
    X, y, _ = _chunk(50, 2, "float64", weights=False)
    first = w.write(0, [X, y, None])
    w.write(1, [X + 1, y, None])
    start = time.monotonic()
    note = w.write(2, [X + 2, y, None])
    assert time.monotonic() - start < 5
    assert note.index == 2 and note.slot == -1 and os.path.exists(note.overflow)
    _same(r.parts(note)[0], X + 2)
    assert not os.path.exists(note.overflow)
    _same(r.parts(first)[0], X)  # chunk 0 untouched in its slot


def test_a_chunk_waits_for_the_release_of_the_one_before_it_in_its_slot(made, long_wait):
    r, w = made
    X, y, _ = _chunk(50, 2, "float64", weights=False)
    assert w.write(0, [X, y, None]).slot == 0
    assert w.write(1, [X + 1, y, None]).slot == 1
    thread, out = _writing(w, 2, [X + 2, y, None])
    thread.join(BLOCKED_SECONDS)
    assert thread.is_alive() and not out, "chunk 2 was written over unreleased chunk 0"
    r.release(0)
    thread.join(5)
    assert not thread.is_alive()
    note = out[0]
    assert note.index == 2 and note.slot == 0
    _same(r.parts(note)[0], X + 2)


def test_release_of_an_index_that_does_not_own_its_slot_changes_nothing(made, long_wait):
    r, w = made
    X, y, _ = _chunk(50, 2, "float64", weights=False)
    w.write(1, [X, y, None])
    thread, out = _writing(w, 3, [X, y, None])  # slot 1 after chunk 1
    # Not slot 1's owner: a later chunk, an earlier one, and one before the stream.
    for index in (3, 5, -1):
        r.release(index)
    thread.join(BLOCKED_SECONDS)
    assert thread.is_alive() and not out
    r.release(1)
    r.release(1)  # twice: the second moves nothing (chunk 5 must still wait)
    thread.join(5)
    assert out[0].index == 3
    late, late_out = _writing(w, 5, [X, y, None])
    late.join(BLOCKED_SECONDS)
    assert late.is_alive() and not late_out
    r.release(3)
    late.join(5)
    assert late_out[0].index == 5


def test_a_stale_write_is_dropped_and_leaves_the_slot_alone(made):
    r, w = made
    X, y, _ = _chunk(50, 2, "float64", weights=False)
    w.write(0, [X, y, None])
    r.release(0)  # chunk 0 consumed; slot 0 now takes chunk 2
    note2 = w.write(2, [X * 3, y, None])
    before = r.parts(note2)[0].copy()
    # A second copy of chunk 0 (a task Dask ran twice) arrives late.
    assert w.write(0, [X * 7, y * 7, None]) is None
    _same(r.parts(note2)[0], before)


def test_a_ring_starting_later_in_the_stream(tmp_path, long_wait):
    r = ChunkRing.create(str(tmp_path), n_slots=3, slot_bytes=4096, start=5)
    w = RingWriter.attach(r.spec)
    try:
        assert r.spec.start == 5
        X, y, _ = _chunk(10, 2, "float64", weights=False)
        # Chunks 5, 6, 7 take their slots at once, in any order.
        for index in (7, 5, 6):
            assert w.write(index, [X, y, None]).slot == index % 3
        # A chunk before the start is stale.
        assert w.write(4, [X, y, None]) is None
        thread, out = _writing(w, 8, [X, y, None])
        thread.join(BLOCKED_SECONDS)
        assert thread.is_alive()
        r.release(5)
        thread.join(5)
        assert out[0].slot == 8 % 3
    finally:
        w.close()
        r.close()


def test_a_writer_waiting_for_a_slot_raises_once_closed(made, long_wait):
    _r, w = made
    X, y, _ = _chunk(20, 2, "float64", weights=False)
    w.write(0, [X, y, None])
    thread, out = _writing(w, 2, [X, y, None])
    thread.join(BLOCKED_SECONDS)
    assert thread.is_alive()
    w.close()
    thread.join(5)
    assert not thread.is_alive()
    assert isinstance(out[0], RingError) and "closed" in str(out[0])


# -- chunks larger than a slot --------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_a_chunk_larger_than_a_slot_goes_through_a_file_that_parts_unlinks(tmp_path, dtype):
    r = ChunkRing.create(str(tmp_path), n_slots=2, slot_bytes=4096)
    w = RingWriter.attach(r.spec)
    try:
        X, y, sw = _chunk(2_000, 5, dtype, seed=4)
        assert X.nbytes > r.spec.slot_bytes
        note = w.write(3, [X, y, sw])
        assert note.slot == -1 and note.index == 3
        assert os.path.dirname(note.overflow) == str(tmp_path)
        assert os.path.exists(note.overflow)
        got = r.parts(note)
        assert not os.path.exists(note.overflow)
        for part, want in zip(got, [X, y, sw], strict=True):
            _same(part, want)
        # The slots were never used: a chunk of slot 0 still goes in at once.
        small = _chunk(10, 2, dtype, weights=False)
        assert w.write(0, [small[0], small[1], None]).slot == 0
        del got, part
    finally:
        w.close()
        r.close()
    assert _names(tmp_path) == []


# -- making and attaching -----------------------------------------------------------------------
def test_create_in_a_missing_directory_is_a_ring_error(tmp_path):
    missing = tmp_path / "no-such-dir"
    with pytest.raises(RingError, match="no-such-dir") as info:
        ChunkRing.create(str(missing), n_slots=2, slot_bytes=4096)
    assert isinstance(info.value, OSError) and isinstance(info.value, RhDaskError)
    assert _names(tmp_path) == []


def test_bad_ring_sizes_are_refused(tmp_path):
    for n_slots, slot_bytes in ((0, 4096), (2, 0)):
        with pytest.raises(ValueError, match="n_slots >= 1 and slot_bytes >= 1"):
            ChunkRing.create(str(tmp_path), n_slots=n_slots, slot_bytes=slot_bytes)
    assert _names(tmp_path) == []


def _no_space(fd, offset, length):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_full_directory_fails_at_create_and_leaves_no_file(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "posix_fallocate", _no_space, raising=False)
    with pytest.raises(RingError) as info:
        ChunkRing.create(str(tmp_path), n_slots=4, slot_bytes=64 << 20)
    text = str(info.value)
    assert str(tmp_path) in text and "256 MiB" in text
    assert "rh-dask.relay.directory" in text
    assert isinstance(info.value.__cause__, OSError)
    assert info.value.__cause__.errno == errno.ENOSPC
    assert _names(tmp_path) == []


def test_a_directory_without_room_for_the_whole_ring_refuses_it(tmp_path, monkeypatch):
    real = os.statvfs(str(tmp_path))

    class _Full:
        f_frsize = real.f_frsize
        f_bavail = (100 << 20) // real.f_frsize  # 100 MiB free

    monkeypatch.setattr(os, "statvfs", lambda path: _Full())
    with pytest.raises(RingError, match=r"256 MiB .* 100 MiB free"):
        ChunkRing.create(str(tmp_path), n_slots=4, slot_bytes=64 << 20)
    assert _names(tmp_path) == []
    ChunkRing.create(str(tmp_path), n_slots=1, slot_bytes=64 << 20).close()


def test_slots_get_their_memory_at_their_first_write(tmp_path, monkeypatch):
    r = ChunkRing.create(str(tmp_path), n_slots=2, slot_bytes=1 << 20)
    w = RingWriter.attach(r.spec)
    try:
        st = os.stat(r.spec.path)
        assert st.st_size == r.spec.size and st.st_blocks * 512 < (1 << 20)  # sparse
        X, y, _ = _chunk(1_000, 8, "float64", weights=False)
        note = w.write(0, [X, y, None])
        assert os.stat(r.spec.path).st_blocks * 512 >= (1 << 20)  # slot 0 backed
        _same(r.parts(note)[0], X)
        # A full directory fails the first write of a slot with an error, not SIGBUS,
        # and the slot stays free for that chunk.
        monkeypatch.setattr(os, "posix_fallocate", _no_space, raising=False)
        with pytest.raises(RingError, match="cannot allocate slot 1"):
            w.write(1, [X, y, None])
        r.release(0)  # slot 0 is backed already: chunk 2 goes in with no allocation
        _same(r.parts(w.write(2, [X[:7], y[:7], None]))[0], X[:7])
        monkeypatch.undo()
        note = w.write(1, [X[:5], y[:5], None])
        assert note.slot == 1
        _same(r.parts(note)[0], X[:5])
    finally:
        w.close()
        r.close()


def test_a_full_directory_fails_an_overflow_write_and_leaves_no_file(tmp_path, monkeypatch):
    r = ChunkRing.create(str(tmp_path), n_slots=1, slot_bytes=4096)
    w = RingWriter.attach(r.spec)
    try:
        r.seal()
        monkeypatch.setattr(os, "posix_fallocate", _no_space, raising=False)
        X, y, _ = _chunk(1_000, 4, "float64", weights=False)
        with pytest.raises(RingError, match="cannot allocate"):
            w.write(0, [X, y, None])
        assert _names(tmp_path) == []
        monkeypatch.undo()
        # The slot was not taken: a chunk that fits still goes in.
        assert w.write(0, [X[:10], y[:10], None]).slot == 0
    finally:
        w.close()
        r.close()


def test_seal_removes_the_name_and_attached_writers_still_work(tmp_path):
    r = ChunkRing.create(str(tmp_path), n_slots=2, slot_bytes=1 << 14)
    w = RingWriter.attach(r.spec)
    try:
        assert _names(tmp_path) == [os.path.basename(r.spec.path)]
        r.seal()
        r.seal()
        assert _names(tmp_path) == []
        X, y, sw = _chunk(100, 4, "float32")
        note = w.write(0, [X, y, sw])
        for part, want in zip(r.parts(note), [X, y, sw], strict=True):
            _same(part, want)
        # A latecomer cannot attach any more.
        with pytest.raises(RingError, match="cannot open"):
            RingWriter.attach(r.spec)
    finally:
        w.close()
        r.close()
    assert _names(tmp_path) == []


# -- a ring kept for later streams -----------------------------------------------------
def test_a_kept_ring_renewed_takes_the_next_stream_in_the_same_memory(tmp_path):
    r = ChunkRing.create(str(tmp_path), n_slots=2, slot_bytes=1 << 14, keep=True)
    old = RingWriter.attach(r.spec)
    try:
        first = r.spec
        assert r.renewable and first.reused == 0
        X, y, sw = _chunk(100, 4, "float32")
        held = r.parts(old.write(0, [X, y, sw]))
        r.release(0)
        r.seal()  # a kept ring keeps its name for the next stream's relays
        assert _names(tmp_path) == [os.path.basename(first.path)]
        address = r.address_range()
        spec = r.renew(start=5)
        assert spec is not None and spec is r.spec and spec.reused == 1
        assert spec.path == first.path and r.address_range() == address
        for field in ("ring_id", "socket", "token", "authkey"):
            assert getattr(spec, field) != getattr(first, field)
        assert spec.start == 5 and list(r._mapped.owner) == [6, 5]
        # A relay of the ended stream writes nothing into it any more.
        with pytest.raises(RingError, match="serves another stream"):
            old.write(6, [X, y, sw])
        # One of the new stream attaches by the same name and writes.
        new = RingWriter.attach(spec)
        try:
            X2, y2, sw2 = _chunk(120, 4, "float32", seed=3)
            note = new.write(5, [X2, y2, sw2])
            assert note is not None and note.slot == 1
            for part, want in zip(r.parts(note), [X2, y2, sw2], strict=True):
                _same(part, want)
            # The old stream's note, still held, was not touched (slot 0).
            for part, want in zip(held, [X, y, sw], strict=True):
                _same(part, want)
        finally:
            new.close()
        # An old spec cannot attach: its token is gone.
        with pytest.raises(RingError, match="token differs"):
            RingWriter.attach(first)
    finally:
        old.close()
        r.close()
    assert _names(tmp_path) == []  # close removes the kept name


def test_a_ring_not_kept_cannot_be_renewed(tmp_path):
    r = ChunkRing.create(str(tmp_path), n_slots=2, slot_bytes=4096)
    try:
        assert not r.renewable
        with pytest.raises(RingError, match="cannot serve another stream"):
            r.renew(0)
    finally:
        r.close()
    kept = ChunkRing.create(str(tmp_path), n_slots=2, slot_bytes=4096, keep=True)
    kept.close()
    assert not kept.renewable


def test_renew_gives_up_on_a_slot_a_write_still_holds(tmp_path, monkeypatch):
    monkeypatch.setattr(ring_module, "_RENEW_WAIT_SECONDS", 0.1)
    r = ChunkRing.create(str(tmp_path), n_slots=2, slot_bytes=4096, keep=True)
    try:
        before = r.spec
        held, go = threading.Event(), threading.Event()

        def hold() -> None:
            with r._mapped.locked(1):
                held.set()
                go.wait(5)

        thread = threading.Thread(target=hold, daemon=True)
        thread.start()
        assert held.wait(5)
        assert r.renew(3) is None
        assert r.spec is before and list(r._mapped.owner) == [0, 1]  # unchanged
        go.set()
        thread.join(5)
        assert r.renew(3) is not None
    finally:
        r.close()


def test_making_a_ring_removes_orphaned_rings_only(tmp_path):
    d = str(tmp_path)
    orphan = tmp_path / "rh-dask-ring-orphan"
    young = tmp_path / "rh-dask-ring-young"
    held = tmp_path / "rh-dask-ring-held"
    overflow = tmp_path / "rh-dask-ring-orphan.x3.abcd"
    other = tmp_path / "not-a-ring"
    for f in (orphan, young, held, overflow, other):
        f.write_bytes(b"x" * 64)
    past = time.time() - 3600
    for f in (orphan, held, overflow, other):
        os.utime(f, (past, past))
    fd = os.open(held, os.O_RDONLY)
    try:
        import fcntl

        fcntl.flock(fd, fcntl.LOCK_SH)  # a live ring's maker holds it
        r = ChunkRing.create(d, n_slots=1, slot_bytes=4096, keep=True)
        r.close()
    finally:
        os.close(fd)
    assert _names(tmp_path) == sorted(
        ["not-a-ring", "rh-dask-ring-held", "rh-dask-ring-orphan.x3.abcd", "rh-dask-ring-young"]
    )


def test_attach_refuses_a_file_that_is_not_the_ring(tmp_path):
    r = ChunkRing.create(str(tmp_path), n_slots=2, slot_bytes=4096)
    try:
        other = replace(r.spec, token=os.urandom(len(r.spec.token)))
        assert other.size == r.spec.size
        with pytest.raises(RingError, match="token differs"):
            RingWriter.attach(other)
        with pytest.raises(RingError, match="size differs"):
            RingWriter.attach(replace(r.spec, n_slots=3))
        with pytest.raises(RingError, match="cannot open"):
            RingWriter.attach(replace(r.spec, path=str(tmp_path / "elsewhere")))
    finally:
        r.close()


def test_close_twice_is_fine(tmp_path):
    r = ChunkRing.create(str(tmp_path), n_slots=2, slot_bytes=4096)
    w = RingWriter.attach(r.spec)
    X, y, _ = _chunk(10, 2, "float64", weights=False)
    held = r.parts(w.write(0, [X, y, None]))  # views alive over the close
    w.close()
    w.close()
    r.close()
    r.close()
    r.release(0)  # after the close: nothing to move, no error
    _same(held[0], X)
    assert _names(tmp_path) == []


# -- the note channel -------------------------------------------------------------------------
@pytest.fixture
def short_dir():
    """A directory with a short path: the listener's socket path must fit ``AF_UNIX``'s limit."""
    path = tempfile.mkdtemp(prefix="rh-ring-", dir="/tmp" if os.path.isdir("/tmp") else None)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def receiving(short_dir):
    """A started receiver on a fresh ring; what it delivers goes to a queue."""
    r = ChunkRing.create(short_dir, n_slots=2, slot_bytes=1 << 16)
    got: queue.Queue = queue.Queue()
    rec = RelayReceiver(r, got.put)
    rec.start()
    yield r, rec, got
    rec.close()
    relay.detach_relay(r.spec.ring_id)
    r.close()


def test_a_client_with_the_wrong_authkey_is_refused(receiving):
    r, _rec, got = receiving
    with pytest.raises(AuthenticationError):
        Client(r.spec.socket, family="AF_UNIX", authkey=b"not the ring's key")
    # Nor does a peer that skips the handshake get anything unpickled.
    raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    raw.connect(r.spec.socket)
    raw.sendall(b"\x00\x00\x00\x10not a handshake!")
    raw.close()
    time.sleep(0.3)
    assert got.empty()
    # A relay with the key still gets through afterwards.
    assert attach_relay(r.spec)
    X, y, _ = _chunk(20, 3, "float64", weights=False)
    relay_chunk(LoadedChunk(0, X, y, None), r.spec)
    item = got.get(timeout=5)
    assert isinstance(item, LoadedChunk) and item.index == 0
    assert got.empty()


def test_relay_notes_arrive_as_items(receiving):
    r, rec, got = receiving
    assert attach_relay(r.spec)
    assert attach_relay(r.spec)  # idempotent
    assert r.spec.ring_id in attached_rings()
    rec.seal()
    assert not os.path.exists(r.spec.path) and not os.path.exists(r.spec.socket)
    assert rec.connections == 1
    X, y, sw = _chunk(64, 4, "float32", seed=9)
    assert relay_chunk(LoadedChunk(0, X, y, sw), r.spec) == X.nbytes + y.nbytes + sw.nbytes
    assert relay_chunk(EmptyChunk(1), r.spec) == 0
    bad = BadChunk(2, "NaN in X", ValidationError("NaN in X"))
    assert relay_chunk(bad, r.spec) == 0
    loaded = got.get(timeout=5)
    assert isinstance(loaded, LoadedChunk) and loaded.index == 0
    for part, want in zip([loaded.X, loaded.y, loaded.sample_weight], [X, y, sw], strict=True):
        _same(part, want)
    empty = got.get(timeout=5)
    assert isinstance(empty, EmptyChunk) and empty.index == 1
    refused = got.get(timeout=5)
    assert isinstance(refused, BadChunk) and refused.index == 2 and refused.refused
    assert "chunk 2 was refused: NaN in X" == refused.message
    # A copy of chunk 0 consumed already writes nothing and sends nothing.
    r.release(0)
    assert relay_chunk(LoadedChunk(0, X, y, sw), r.spec) == 0
    time.sleep(0.2)
    assert got.empty()


def test_a_chunk_larger_than_a_slot_is_relayed_through_a_file(receiving, short_dir):
    r, rec, got = receiving
    assert attach_relay(r.spec)
    rec.seal()
    X, y, sw = _chunk(5_000, 4, "float64", seed=2)
    assert X.nbytes > r.spec.slot_bytes
    relay_chunk(LoadedChunk(0, X, y, sw), r.spec)
    item = got.get(timeout=5)
    for part, want in zip([item.X, item.y, item.sample_weight], [X, y, sw], strict=True):
        _same(part, want)
    assert _names(short_dir) == []


def test_a_process_not_attached_cannot_relay(receiving, tmp_path):
    r, _rec, _got = receiving
    X, y, _ = _chunk(10, 2, "float64", weights=False)
    with pytest.raises(RingError, match="holds no mapping"):
        relay_chunk(LoadedChunk(0, X, y, None), r.spec)
    # A worker that cannot see the ring is no relay.
    assert attach_relay(replace(r.spec, path=str(tmp_path / "other-node"))) is False
    assert r.spec.ring_id not in attached_rings()


def test_closing_the_receiver_detaches_the_relays(receiving, short_dir):
    r, rec, got = receiving
    assert attach_relay(r.spec)
    rec.seal()
    X, y, _ = _chunk(10, 2, "float64", weights=False)
    relay_chunk(LoadedChunk(0, X, y, None), r.spec)
    got.get(timeout=5)
    rec.close()
    rec.close()
    deadline = time.monotonic() + 1.0
    while r.spec.ring_id in attached_rings() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert r.spec.ring_id not in attached_rings()
    with pytest.raises(RingError, match="holds no mapping"):
        relay_chunk(LoadedChunk(1, X, y, None), r.spec)
    r.close()
    assert _names(short_dir) == []


def test_a_relay_waiting_for_a_slot_is_freed_when_the_engine_side_closes(receiving, long_wait):
    r, rec, _got = receiving
    assert attach_relay(r.spec)
    rec.seal()
    X, y, _ = _chunk(10, 2, "float64", weights=False)
    relay_chunk(LoadedChunk(0, X, y, None), r.spec)
    out: list = []

    def late() -> None:  # chunk 2 waits for slot 0, which is never released
        try:
            out.append(relay_chunk(LoadedChunk(2, X, y, None), r.spec))
        except BaseException as exc:
            out.append(exc)

    thread = threading.Thread(target=late, daemon=True)
    thread.start()
    thread.join(BLOCKED_SECONDS)
    assert thread.is_alive()
    rec.close()
    thread.join(5)
    assert not thread.is_alive()
    assert isinstance(out[0], RingError)


def test_a_note_that_cannot_be_sent_leaves_no_overflow_file(receiving, short_dir, monkeypatch):
    # The engine's side closed (its stream ended, its process died) while a
    # relay wrote a chunk larger than a slot: nobody will map and unlink that
    # file, so the relay must remove it (a /dev/shm file holds memory until
    # it is removed).
    r, rec, _got = receiving
    assert attach_relay(r.spec)
    rec.seal()

    def gone(note):
        raise BrokenPipeError("the engine's side closed")

    monkeypatch.setattr(relay._attached[r.spec.ring_id], "send", gone)
    X, y, _ = _chunk(5_000, 4, "float64", weights=False)
    with pytest.raises(OSError):
        relay_chunk(LoadedChunk(0, X, y, None), r.spec)
    assert _names(short_dir) == []


def test_a_note_whose_chunk_cannot_be_mapped_becomes_a_bad_chunk(receiving, short_dir):
    # The engine's consumer waits for every chunk in order: a note dropped
    # here would leave it waiting for that chunk for good (the stream hangs).
    r, rec, got = receiving
    assert attach_relay(r.spec)
    rec.seal()
    X, y, _ = _chunk(100, 3, "float64", weights=False)
    parts, _ = slot_layout([X, y, None])
    vanished = os.path.join(short_dir, "vanished")
    relay._attached[r.spec.ring_id].send(SlotNote(0, -1, parts, overflow=vanished))
    try:
        item = got.get(timeout=5)
    except queue.Empty:
        pytest.fail("a note whose chunk could not be mapped was dropped: chunk 0 never arrives")
    assert isinstance(item, BadChunk) and item.index == 0


def test_a_receiver_on_a_taken_socket_is_a_ring_error(short_dir):
    r = ChunkRing.create(short_dir, n_slots=1, slot_bytes=4096)
    taken = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        taken.bind(r.spec.socket)  # the listener's address is in use
        with pytest.raises(RingError, match="cannot listen"):
            RelayReceiver(r, lambda item: None)
    finally:
        taken.close()
        if not r.spec.socket.startswith("\0"):
            os.unlink(r.spec.socket)
        r.close()


def test_a_ring_directory_with_a_long_path_can_take_relays(tmp_path):
    # AF_UNIX paths hold at most 107 bytes (Linux); a ring directory such as
    # a user's scratch directory may be longer than that leaves for the
    # listener's socket name beside the ring.
    deep = tmp_path / ("d" * 60)
    deep.mkdir()
    r = ChunkRing.create(str(deep), n_slots=1, slot_bytes=4096)
    try:
        rec = RelayReceiver(r, lambda item: None)
        rec.close()
    finally:
        r.close()


def test_relays_keep_chunks_on_the_heap_while_attached_and_restore_after(tmp_path, monkeypatch):
    # Process-wide: the first ring asking for it switches malloc, the last
    # one to go restores it.
    calls: list[str] = []

    def switch():
        calls.append("on")
        return lambda: calls.append("off")

    monkeypatch.setattr(relay.memory, "heap_for_chunks", switch)
    rings = [ChunkRing.create(str(tmp_path), 1, 4096, heap_for_chunks=True) for _ in range(2)]
    receivers = [RelayReceiver(r, lambda item: None) for r in rings]
    try:
        for rec in receivers:
            rec.start()
        assert attach_relay(rings[0].spec) and attach_relay(rings[1].spec)
        assert calls == ["on"]
        relay.detach_relay(rings[0].spec.ring_id)
        assert calls == ["on"]
        relay.detach_relay(rings[1].spec.ring_id)
        assert calls == ["on", "off"]
    finally:
        for rec, r in zip(receivers, rings, strict=True):
            rec.close()
            r.close()
