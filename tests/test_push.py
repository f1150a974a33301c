"""Pushing chunks to relays over TCP (``rh-dask.relay.transport: tcp``), without a cluster.

A ring is made in ``tmp_path`` and a :class:`~rh_dask.distributed.push.PushServer`
serves it from this process on 127.0.0.1, as a relay worker does on its
node; :func:`~rh_dask.distributed.push.push_chunk` is called as the loading
worker's hand-over task calls it. The notes the server would send the
engine are collected in a list.
"""

from __future__ import annotations

import os
import socket
import threading

import numpy as np
import pytest

from rh_dask.distributed import push as push_module
from rh_dask.distributed.file_chunks import FileChunk
from rh_dask.distributed.items import BadChunk, ChunkSpec, EmptyChunk, LoadedChunk
from rh_dask.distributed.push import PushServer, PushSpec, push_chunk, push_file_chunk
from rh_dask.distributed.ring import ChunkRing, RingError, RingWriter, SlotNote
from rh_dask.exceptions import InputError
from rh_dask.file_rows import FileRows, npy_layout
from rh_dask.settings import SettingError, Settings

pytestmark = pytest.mark.timeout(60)


def _chunk(index: int, rows: int = 300, d: int = 4, dtype: str = "float32", weights=True):
    rng = np.random.default_rng(index)
    X = rng.normal(size=(rows, d)).astype(dtype)
    y = rng.normal(size=rows).astype(dtype)
    w = rng.uniform(0.5, 2, size=rows).astype(dtype) if weights else None
    return LoadedChunk(index, X, y, w)


class _Relay:
    """A ring, its writer and a push server whose notes land in ``self.notes``."""

    def __init__(self, directory: str, n_slots: int = 2, slot_bytes: int = 1 << 16) -> None:
        self.ring = ChunkRing.create(directory, n_slots=n_slots, slot_bytes=slot_bytes)
        self.writer = RingWriter.attach(self.ring.spec)
        self.notes: list = []
        self.server = PushServer(
            "127.0.0.1", self.ring.spec.authkey, self.writer.write_with, self.notes.append
        )

    def spec(self, *more: tuple[str, int]) -> PushSpec:
        return PushSpec(
            self.ring.spec.ring_id, self.ring.spec.authkey, (self.server.address, *more)
        )

    def close(self) -> None:
        self.server.close()
        self.writer.close()
        self.ring.close()


@pytest.fixture
def relay(tmp_path):
    r = _Relay(str(tmp_path))
    yield r
    r.close()
    push_module.forget_connections()


def _same(got, want) -> None:
    assert (got is None) == (want is None)
    if want is not None:
        assert got.dtype == want.dtype and got.shape == want.shape
        assert got.tobytes() == want.tobytes()


@pytest.mark.parametrize("weights", [True, False])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_a_pushed_chunk_lands_in_its_slot_bit_for_bit(relay, dtype, weights):
    spec = relay.spec()
    for index in (0, 1):
        item = _chunk(index, dtype=dtype, weights=weights)
        written = push_chunk(item, spec)
        note = relay.notes[-1]
        assert isinstance(note, SlotNote) and note.index == index and note.slot == index % 2
        assert written == note.nbytes > 0
        X, y, w = relay.ring.parts(note)
        _same(X, item.X), _same(y, item.y), _same(w, item.sample_weight)
    # One connection per relay, reused chunk after chunk.
    assert len(push_module._idle[(spec.ring_id, relay.server.address)]) == 1


def test_a_chunk_larger_than_a_slot_goes_through_its_own_file(tmp_path):
    r = _Relay(str(tmp_path), slot_bytes=4096)
    try:
        item = _chunk(0, rows=2000)
        push_chunk(item, r.spec())
        note = r.notes[-1]
        assert note.slot == -1 and note.overflow is not None
        X, _, _ = r.ring.parts(note)
        _same(X, item.X)
    finally:
        r.close()
        push_module.forget_connections()


def test_empty_items_are_forwarded_and_a_stale_copy_is_drained(relay):
    spec = relay.spec()
    assert push_chunk(EmptyChunk(0, rows=0), spec) == 0
    assert relay.notes[-1] == EmptyChunk(0, rows=0)
    push_chunk(_chunk(1), spec)
    relay.ring.release(1)  # the engine consumed chunk 1: slot 1 now waits for chunk 3
    n = len(relay.notes)
    assert push_chunk(_chunk(1), spec) == 0  # a late duplicate: read and dropped
    assert len(relay.notes) == n
    # The connection is still in step: the next chunk arrives whole.
    item = _chunk(3)
    push_chunk(item, spec)
    _same(relay.ring.parts(relay.notes[-1])[0], item.X)


def test_a_wrong_key_is_refused_and_nothing_is_written(relay):
    spec = relay.spec()
    wrong = PushSpec(spec.ring_id, b"x" * 32, spec.addresses)
    with pytest.raises(RingError, match="no relay took chunk 0"):
        push_chunk(_chunk(0), wrong)
    assert relay.notes == []


def test_a_lost_relay_sends_the_chunk_to_the_next_and_none_left_raises(relay):
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))
    gone = dead.getsockname()[:2]
    dead.close()  # nobody listens there
    # Chunk 0 starts at relay 0 (the lost one), then goes to the live one.
    spec = PushSpec(relay.ring.spec.ring_id, relay.ring.spec.authkey, (gone, relay.server.address))
    item = _chunk(0)
    assert push_chunk(item, spec) > 0
    _same(relay.ring.parts(relay.notes[-1])[0], item.X)
    with pytest.raises(RingError, match="no relay took chunk 1"):
        push_chunk(_chunk(1), PushSpec(spec.ring_id, spec.authkey, (gone,)))
    with pytest.raises(RingError, match="no relay"):
        push_chunk(_chunk(1), PushSpec(spec.ring_id, spec.authkey, ()))


def test_a_closed_ring_is_an_error_from_the_relay(relay):
    spec = relay.spec()
    push_chunk(_chunk(0), spec)
    relay.writer.close()
    with pytest.raises(RingError, match=r"refused chunk 1.*closed"):
        push_chunk(_chunk(1), spec)


def test_a_loader_dying_mid_chunk_leaves_no_note_and_the_server_serving(relay):
    spec = relay.spec()
    sock = push_module._connect(spec, relay.server.address)
    item = _chunk(0)
    shapes = [(a.shape, a.dtype.str) for a in (item.X, item.y, item.sample_weight)]
    push_module._send_frame(sock, (0, "arrays", shapes, None))
    sock.sendall(item.X.tobytes()[:100])
    sock.close()  # the loading worker died half-way
    # Dask runs the task again (here: on this thread), through a fresh connection.
    done = threading.Event()

    def again() -> None:
        push_chunk(item, spec)
        done.set()

    threading.Thread(target=again, daemon=True).start()
    assert done.wait(10)
    assert [n.index for n in relay.notes] == [0]
    _same(relay.ring.parts(relay.notes[0])[0], item.X)


# -- chunks sent from files ------------------------------------------------------------------
def _file_chunk(tmp_path, index, rows=300, d=4, dtype="float32", weights=True, check=True):
    """Chunk ``index`` as rows 5.. of .npy files holding its arrays, and the arrays themselves."""
    item = _chunk(index, rows=rows, d=d, dtype=dtype, weights=weights)
    parts = []
    for name, a in zip("Xyw", (item.X, item.y, item.sample_weight), strict=True):
        if a is None:
            parts.append(None)
            continue
        path = tmp_path / f"{name}{index}.npy"
        np.save(path, np.concatenate([np.zeros((5, *a.shape[1:]), a.dtype), a]))
        parts.append(FileRows(npy_layout(path), 5, 5 + rows))
    spec = ChunkSpec(index, dtype, d, None, check_finite=check)
    return FileChunk(index, tuple(parts), spec), item


@pytest.mark.parametrize("weights", [True, False])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_a_file_chunk_is_sent_from_its_files_bit_for_bit(relay, tmp_path, dtype, weights):
    spec = relay.spec()
    for index in (0, 1):
        chunk, item = _file_chunk(tmp_path, index, dtype=dtype, weights=weights)
        assert push_file_chunk(chunk, spec) == relay.notes[-1].nbytes > 0
        note = relay.notes[-1]
        assert isinstance(note, SlotNote) and note.index == index
        X, y, w = relay.ring.parts(note)
        _same(X, item.X), _same(y, item.y), _same(w, item.sample_weight)
    assert len(push_module._idle[(spec.ring_id, relay.server.address)]) == 1


@pytest.mark.parametrize("check", [True, False])
def test_the_relay_refuses_a_bad_file_chunk_as_a_loader_would(relay, tmp_path, check):
    chunk, item = _file_chunk(tmp_path, 0, check=check)
    X = np.load(chunk.parts[0].layout.path)
    X[5 + 17, 2] = np.nan
    np.save(chunk.parts[0].layout.path, X)  # same size: the file is still the one planned
    w = np.load(chunk.parts[2].layout.path)
    w[5 + 3] = -1.0
    np.save(chunk.parts[2].layout.path, w)
    assert push_file_chunk(chunk, relay.spec()) == 0
    bad = relay.notes[-1]
    assert isinstance(bad, BadChunk) and bad.index == 0 and bad.refused
    # Weights are always checked; NaN only where the engine does not check on its device.
    assert ("NaN" in bad.reason) is check and ("sample_weight" in bad.reason) is not check
    assert bad.error.__traceback__ is None
    # The connection stays in step: the next chunk lands whole.
    good, item = _file_chunk(tmp_path, 1)
    push_file_chunk(good, relay.spec())
    _same(relay.ring.parts(relay.notes[-1])[0], item.X)


def test_a_file_chunk_larger_than_a_slot_and_a_refused_one_leave_no_file(tmp_path):
    r = _Relay(str(tmp_path), slot_bytes=4096)
    try:
        chunk, item = _file_chunk(tmp_path, 0, rows=2000)
        push_file_chunk(chunk, r.spec())
        note = r.notes[-1]
        assert note.slot == -1 and note.overflow is not None
        _same(r.ring.parts(note)[0], item.X)
        bad, _ = _file_chunk(tmp_path, 1, rows=2000)
        y = np.load(bad.parts[1].layout.path)
        y[-1] = np.inf
        np.save(bad.parts[1].layout.path, y)
        before = set(os.listdir(tmp_path))
        push_file_chunk(bad, r.spec())
        assert isinstance(r.notes[-1], BadChunk) and "infinity" in r.notes[-1].reason
        assert set(os.listdir(tmp_path)) == before
    finally:
        r.close()
        push_module.forget_connections()


def test_a_file_changed_or_gone_is_an_input_error_and_the_relay_keeps_serving(relay, tmp_path):
    chunk, _ = _file_chunk(tmp_path, 0)
    path = chunk.parts[1].layout.path
    np.save(path, np.zeros(10, dtype="float32"))
    with pytest.raises(InputError, match="changed since it was opened"):
        push_file_chunk(chunk, relay.spec())
    os.unlink(path)
    with pytest.raises(InputError, match="cannot open"):
        push_file_chunk(chunk, relay.spec())
    assert relay.notes == []
    good, item = _file_chunk(tmp_path, 1)
    push_file_chunk(good, relay.spec())
    _same(relay.ring.parts(relay.notes[-1])[0], item.X)


def test_a_header_of_another_version_closes_that_connection_only(relay):
    spec = relay.spec()
    sock = push_module._connect(spec, relay.server.address)
    push_module._send_frame(sock, (0, "arrays", [((3, 4), "<f4"), None, None]))  # 3 fields
    sock.settimeout(10)
    assert sock.recv(1) == b""  # the relay closed it, and wrote nothing
    sock.close()
    item = _chunk(0)
    push_chunk(item, spec)
    assert [n.index for n in relay.notes] == [0]


def test_the_transport_setting(monkeypatch):
    import dask.config

    assert Settings.from_config().relay_transport == "auto"
    with dask.config.set({"rh-dask.relay.transport": "DASK"}):
        assert Settings.from_config().relay_transport == "dask"
    with dask.config.set({"rh-dask.relay.transport": "udp"}):
        with pytest.raises(SettingError, match=r"rh-dask\.relay\.transport"):
            Settings.from_config()


@pytest.mark.parametrize(
    ("relays", "loaders", "setting", "expected"),
    [
        (4, 1, "auto", (4, 2)),  # one loading worker: at most 2 a task thread
        (4, 2, "auto", (2, 2)),
        (8, 4, "auto", (2, 2)),
        (4, 4, "auto", (1, 2)),  # one send a relay: one a loader
        (4, 8, "auto", (1, 2)),  # more loaders than relays: still one each
        (4, 0, "auto", (4, 2)),
        (2, 2, 3, (3, None)),  # a number: that many, whatever the threads
    ],
)
def test_file_sends_per_loader(relays, loaders, setting, expected):
    assert push_module.file_sends_per_loader(relays, loaders, setting) == expected


def test_file_sends_of_a_process_never_exceed_the_spec(tmp_path, slowed_file_sends):
    # Outside a Dask worker no thread count bounds the limit, and nothing secedes.
    sends = slowed_file_sends(0.05)
    relay = _Relay(str(tmp_path), n_slots=6)
    try:
        base = relay.spec()
        spec = PushSpec(base.ring_id, base.authkey, base.addresses, file_sends=2)
        chunks = [_file_chunk(tmp_path, i)[0] for i in range(6)]
        threads = [threading.Thread(target=push_file_chunk, args=(c, spec)) for c in chunks]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sends.most == 2
        assert sorted(n.index for n in relay.notes) == list(range(6))
    finally:
        relay.close()
        push_module.forget_connections()


def test_the_file_sends_setting():
    import dask.config

    assert Settings.from_config().relay_file_sends == "auto"
    with dask.config.set({"rh-dask.relay.file-sends": "3"}):
        assert Settings.from_config().relay_file_sends == 3


def test_a_send_that_cannot_leave_its_pool_keeps_its_thread(relay, tmp_path, monkeypatch):
    # A task thread that is not one of distributed's pools (here: no worker at
    # all, though a thread count says one) sends all the same.
    monkeypatch.setattr(push_module, "_task_threads", lambda: 1)
    base = relay.spec()
    spec = PushSpec(base.ring_id, base.authkey, base.addresses, file_sends=2)
    chunk, item = _file_chunk(tmp_path, 0)
    assert push_file_chunk(chunk, spec) == relay.notes[-1].nbytes > 0
    X, _, _ = relay.ring.parts(relay.notes[-1])
    _same(X, item.X)
