"""Walk checkpoints, the checkpoint store and the input fingerprint (issue 13)."""

from __future__ import annotations

import dataclasses
import io
import json
import math
import os
import pickle
import subprocess
import sys
import zipfile
from pathlib import Path

import dask.array as da
import dask.dataframe as dd
import numpy as np
import pandas as pd
import pytest

from rh_dask import CheckpointError, HuberConfig, NumpyEngine, ValidationError
from rh_dask import checkpoint as ckpt_module
from rh_dask.checkpoint import (
    HISTORY_FIELDS,
    Checkpoint,
    WalkPosition,
    checkpoint_bytes,
    checkpoint_from_bytes,
    load_checkpoint,
    save_checkpoint,
)
from rh_dask.checkpoint_store import STREAM_FILE, CheckpointStore
from rh_dask.distributed.chunks import align_stream
from rh_dask.distributed.fingerprint import check_fingerprint, fingerprint
from rh_dask.stream import BatchRecord, Recovery

SIZES = [40, 0, 55, 35, 60]  # chunk 1 is empty
FINGERPRINT = {
    "token": "abc123",
    "n_chunks": 7,
    "rows": [40, 0, 55, 35, 60, None, None],
    "n_features": 4,
    "roles": ["X", "y"],
}


def _walk_checkpoint(stream, *, dtype="float64", names=None, with_recoveries=True):
    """A walk checkpoint after the chunks of SIZES, out of 7, from a real engine."""
    config = HuberConfig(dtype=dtype, penalty="l1")
    engine = NumpyEngine(config)
    records = []
    start = 0
    for chunk, size in enumerate(SIZES):
        if size == 0:
            continue
        rows = slice(start, start + size)
        X, y = stream.X[rows].astype(dtype), stream.y[rows].astype(dtype)
        diagnostics = engine.partial_fit(X, y)
        records.append(
            BatchRecord(
                batch=engine.batch_count - 1,
                chunk=chunk,
                rows=size,
                diagnostics=diagnostics,
                seconds=0.001 * (chunk + 1) / 3,
                coefficients=np.array(engine.coefficients(), dtype=np.float64),
                wait_seconds=0.1 / 7 if chunk else 0.0,
            )
        )
        start += size
    recoveries = ()
    if with_recoveries:
        recoveries = (
            Recovery(
                time=1_780_000_000.123456,
                kind="worker-lost",
                lost_worker="tcp://10.0.0.1:4001",
                new_worker="tcp://10.0.0.2:4002",
                from_chunk=2,
                chunks_replayed=1,
                detect_seconds=0.25 / 3,
                recover_seconds=1.5 / 7,
            ),
            Recovery(
                time=1_780_000_100.5,
                kind="resume",
                lost_worker="",
                new_worker="",
                from_chunk=4,
                chunks_replayed=0,
                detect_seconds=math.nan,
                recover_seconds=0.0,
            ),
        )
    return Checkpoint(
        config=config,
        state=engine.export_state(),
        feature_names=names,
        engine="numpy",
        walk=WalkPosition(next_chunk=5, n_chunks=7, n_empty=1, fingerprint=dict(FINGERPRINT)),
        records=tuple(records),
        recoveries=recoveries,
    )


@pytest.fixture
def stream(make_stream):
    return make_stream(sum(SIZES), 4, seed=5, outlier_fraction=0.05)


@pytest.fixture
def walk_ckpt(stream):
    return _walk_checkpoint(stream)


def _assert_same_records(got, want):
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert (a.batch, a.chunk, a.rows, a.seconds, a.wait_seconds) == (
            b.batch,
            b.chunk,
            b.rows,
            b.seconds,
            b.wait_seconds,
        )
        assert a.diagnostics == b.diagnostics
        assert type(a.diagnostics.iterations) is int and type(a.diagnostics.converged) is bool
        assert a.coefficients.dtype == np.float64
        np.testing.assert_array_equal(a.coefficients, b.coefficients)


def _assert_same_recoveries(got, want):
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        for name in ("time", "kind", "lost_worker", "new_worker", "from_chunk"):
            assert getattr(a, name) == getattr(b, name)
        assert a.chunks_replayed == b.chunks_replayed
        assert a.recover_seconds == b.recover_seconds
        assert a.detect_seconds == b.detect_seconds or (
            math.isnan(a.detect_seconds) and math.isnan(b.detect_seconds)
        )


# -- the walk checkpoint file ---------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("named", [False, True])
def test_walk_checkpoint_round_trips_exactly(stream, tmp_path, dtype, named):
    names = np.asarray(["a", "b", "c", "d"], dtype=object) if named else None
    ckpt = _walk_checkpoint(stream, dtype=dtype, names=names)
    loaded = load_checkpoint(save_checkpoint(tmp_path / "walk.npz", ckpt))
    assert loaded.state.equals(ckpt.state)
    assert loaded.state.coefficients.dtype == np.dtype(dtype)
    assert loaded.config == ckpt.config and loaded.engine == "numpy"
    assert loaded.walk == ckpt.walk
    assert loaded.walk.fingerprint == FINGERPRINT
    _assert_same_records(loaded.records, ckpt.records)
    _assert_same_recoveries(loaded.recoveries, ckpt.recoveries)
    if named:
        assert list(loaded.feature_names) == ["a", "b", "c", "d"]
    # The records' last β is the state's, exactly (float32 widened exactly).
    np.testing.assert_array_equal(
        loaded.records[-1].coefficients, ckpt.state.coefficients.astype(np.float64)
    )


def test_bytes_and_files_hold_the_same_checkpoint(walk_ckpt, tmp_path):
    data = checkpoint_bytes(walk_ckpt)
    from_bytes = checkpoint_from_bytes(data, "memory://somewhere/stream.npz")
    path = tmp_path / "same.npz"
    path.write_bytes(data)
    from_file = load_checkpoint(path)
    for got in (from_bytes, from_file):
        assert got.state.equals(walk_ckpt.state) and got.walk == walk_ckpt.walk
        _assert_same_records(got.records, walk_ckpt.records)
    with pytest.raises(CheckpointError, match=r"memory://somewhere/stream\.npz"):
        checkpoint_from_bytes(data[: len(data) // 2], "memory://somewhere/stream.npz")


def test_walk_members_and_json_key(walk_ckpt, stream):
    assert walk_ckpt.state.score_variance is None  # an L1 stream keeps no K
    with zipfile.ZipFile(io.BytesIO(checkpoint_bytes(walk_ckpt))) as archive:
        assert sorted(archive.namelist()) == sorted(
            f"{n}.npy"
            for n in (
                "metadata",
                "coefficients",
                "information",
                "feature_names",
                "history",
                "coef_history",
                "diagnostics_history",
            )
        )
        record = json.loads(str(np.load(io.BytesIO(archive.read("metadata.npy")))[()]))
    walk = record["walk"]
    assert walk["next_chunk"] == 5 and walk["n_chunks"] == 7 and walk["n_empty"] == 1
    assert walk["n_records"] == 4 and walk["fingerprint"] == FINGERPRINT
    assert walk["recoveries"][1]["detect_seconds"] is None  # NaN is written as null
    assert len(HISTORY_FIELDS) == 10
    # A plain checkpoint has neither the key nor the members.
    with_k = dataclasses.replace(walk_ckpt.state, score_variance=np.eye(5))
    plain = Checkpoint(walk_ckpt.config, with_k, None, "numpy")
    with zipfile.ZipFile(io.BytesIO(checkpoint_bytes(plain))) as archive:
        assert sorted(archive.namelist()) == sorted(
            f"{n}.npy"
            for n in ("metadata", "coefficients", "information", "score_variance", "feature_names")
        )
        record = json.loads(str(np.load(io.BytesIO(archive.read("metadata.npy")))[()]))
    assert "walk" not in record
    assert load_checkpoint_bytes(checkpoint_bytes(plain)).walk is None


def load_checkpoint_bytes(data):
    return checkpoint_from_bytes(data, "plain")


def test_a_finished_walk_and_a_walk_without_records_round_trip(stream):
    ckpt = _walk_checkpoint(stream, with_recoveries=False)
    finished = Checkpoint(
        ckpt.config,
        ckpt.state,
        None,
        "numpy",
        walk=WalkPosition(7, 7, 3, {"token": None}),
        records=ckpt.records,
    )
    assert checkpoint_from_bytes(checkpoint_bytes(finished), "f").walk.next_chunk == 7
    fresh = Checkpoint(ckpt.config, ckpt.state, None, "numpy", walk=WalkPosition(0, 7, 0, {}))
    got = checkpoint_from_bytes(checkpoint_bytes(fresh), "f")
    assert got.records == () and got.recoveries == () and got.walk.next_chunk == 0


def test_walk_position_holds_json_and_refuses_bad_values():
    walk = WalkPosition(1, 2, 0, {"roles": ("X", "y"), "rows": (3, None)})
    assert walk.fingerprint == {"roles": ["X", "y"], "rows": [3, None]}
    bad = [
        ((3, 2, 0, {}), "exceeds n_chunks"),
        ((2, 2, 3, {}), "n_empty 3 exceeds"),
        ((-1, 2, 0, {}), "need >= 0"),
        ((1.0, 2, 0, {}), "not an int"),
        ((True, 2, 0, {}), "not an int"),
        ((1, 2, 0, ["X"]), "not a dict"),
        ((1, 2, 0, {"x": math.nan}), "not JSON"),
        ((1, 2, 0, {"x": object()}), "not JSON"),
    ]
    for args, message in bad:
        with pytest.raises(ValidationError, match=message):
            WalkPosition(*args)


def test_records_without_a_walk_are_refused(walk_ckpt):
    with pytest.raises(ValidationError, match="belong to a walk checkpoint"):
        Checkpoint(walk_ckpt.config, walk_ckpt.state, None, "numpy", records=walk_ckpt.records)
    with pytest.raises(ValidationError, match="belong to a walk checkpoint"):
        Checkpoint(
            walk_ckpt.config, walk_ckpt.state, None, "numpy", recoveries=walk_ckpt.recoveries
        )


def _replace(ckpt, **changes):
    fields = {
        "config": ckpt.config,
        "state": ckpt.state,
        "feature_names": ckpt.feature_names,
        "engine": ckpt.engine,
        "walk": ckpt.walk,
        "records": ckpt.records,
        "recoveries": ckpt.recoveries,
    }
    return Checkpoint(**{**fields, **changes})


def _record(ckpt, i, **changes):
    from dataclasses import replace

    records = list(ckpt.records)
    records[i] = replace(records[i], **changes)
    return tuple(records)


def test_an_inconsistent_walk_is_never_written(walk_ckpt):
    from dataclasses import replace

    r0 = walk_ckpt.recoveries[0]
    cases = [
        ({"records": _record(walk_ckpt, 3, chunk=5)}, "record 3: chunk 5 is out of order"),
        ({"records": _record(walk_ckpt, 2, chunk=1)}, "record 2: chunk 1 is out of order"),
        ({"records": _record(walk_ckpt, 1, batch=0)}, "record 1: batch 0 is out of order"),
        ({"records": _record(walk_ckpt, 3, batch=9)}, "record 3: batch 9 is out of order"),
        ({"records": _record(walk_ckpt, 0, rows=-1)}, "record 0: rows is -1"),
        ({"records": _record(walk_ckpt, 0, rows=10**6)}, "but the state has seen 190"),
        ({"records": _record(walk_ckpt, 0, coefficients=np.zeros(3))}, "of shape (3,)"),
        ({"records": _record(walk_ckpt, 0, seconds=math.inf)}, "record 0: seconds is inf"),
        ({"walk": WalkPosition(5, 7, 2, {})}, "do not fit before next_chunk 5"),
        ({"recoveries": (replace(r0, kind="crash"),)}, "kind 'crash' is not one of"),
        ({"recoveries": (replace(r0, from_chunk=6),)}, "from_chunk 6 is after next_chunk 5"),
        ({"recoveries": (replace(r0, recover_seconds=-1.0),)}, "recover_seconds is -1.0"),
    ]
    for changes, message in cases:
        with pytest.raises(ValidationError) as caught:
            checkpoint_bytes(_replace(walk_ckpt, **changes))
        assert message in str(caught.value)


# -- refusing forged walk files ---------------------------------------------------------------


def _members(data: bytes) -> tuple[dict, dict[str, np.ndarray]]:
    with np.load(io.BytesIO(data), allow_pickle=False) as npz:
        arrays = {name: npz[name] for name in npz.files}
    record = json.loads(str(arrays.pop("metadata")[()]))
    return record, arrays


def _pack(record: dict, arrays: dict[str, np.ndarray], *, redigest: bool) -> bytes:
    if redigest:
        record.pop("digest", None)
        complete = "walk" not in record or "history" in arrays
        # A walk record without its members cannot be digested; it is refused before.
        record["digest"] = ckpt_module._digest(arrays, record) if complete else "0" * 64
    buffer = io.BytesIO()
    np.savez(buffer, metadata=np.asarray(json.dumps(record)), **arrays)
    return buffer.getvalue()


def _edited(ckpt, edit, *, redigest=True) -> bytes:
    record, arrays = _members(checkpoint_bytes(ckpt))
    edit(record, arrays)
    return _pack(record, arrays, redigest=redigest)


def _set_history(row, field, value):
    def edit(record, arrays):
        history = arrays["history"].copy()
        history[row, HISTORY_FIELDS.index(field)] = value
        arrays["history"] = history

    return edit


def _set_walk(key, value):
    def edit(record, arrays):
        record["walk"][key] = value

    return edit


def _set_recovery(key, value):
    def edit(record, arrays):
        record["walk"]["recoveries"][0][key] = value

    return edit


def _drop_members(record, arrays):
    del arrays["history"], arrays["coef_history"]


def _drop_walk(record, arrays):
    del record["walk"]


def _short_coef_history(record, arrays):
    arrays["coef_history"] = arrays["coef_history"][:, :-1].copy()


def _more_records(record, arrays):
    record["walk"]["n_records"] = 5


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (_set_history(1, "chunk", 2.5), "chunk is 2.5, not a non-negative integer"),
        (_set_history(0, "rows", -40.0), "rows is -40.0"),
        (_set_history(0, "iterations", math.nan), "iterations is nan"),
        (_set_history(2, "converged", 0.5), "converged is 0.5, not 0 or 1"),
        (_set_history(3, "chunk", 5.0), "chunk 5 is out of order"),
        (_set_history(2, "chunk", 0.0), "chunk 0 is out of order"),
        (_set_history(0, "batch", 7.0), "batch 7 is out of order"),
        (_set_history(0, "seconds", -1.0), "seconds is -1.0"),
        (_set_history(0, "bandwidth", math.inf), "bandwidth is inf"),
        (_set_walk("next_chunk", 8), "next_chunk 8 exceeds n_chunks 7"),
        (_set_walk("n_empty", -1), "n_empty is -1"),
        (_set_walk("n_empty", 2), "do not fit before next_chunk 5"),
        (_set_walk("next_chunk", 3.0), "next_chunk is 3.0, not an int"),
        (_set_walk("fingerprint", "abc"), "fingerprint is 'abc', not a dict"),
        (_set_walk("recoveries", {}), "recoveries is dict, not a list"),
        (_set_walk("n_records", "4"), "n_records is '4', not an int"),
        (_set_recovery("kind", "crash"), "kind 'crash' is not one of"),
        (_set_recovery("from_chunk", 6), "from_chunk 6 is after next_chunk 5"),
        (_set_recovery("time", "noon"), "time is 'noon', not a number"),
        (_set_recovery("lost_worker", 3), "lost_worker is 3, not a string"),
        (_set_recovery("chunks_replayed", -2), "chunks_replayed is -2"),
        (lambda r, a: r["walk"]["recoveries"][0].pop("kind"), "recovery 0 has fields"),
        (_drop_members, "must come together"),
        (_drop_walk, "must come together"),
        (_short_coef_history, "coef_history is a float64 array of shape"),
        (_more_records, "history is a float64 array of shape"),
    ],
)
def test_a_digested_but_inconsistent_walk_is_refused(walk_ckpt, edit, message):
    data = _edited(walk_ckpt, edit)
    with pytest.raises(CheckpointError, match=r"forged\.npz") as caught:
        checkpoint_from_bytes(data, "forged.npz")
    assert message in str(caught.value)


@pytest.mark.parametrize(
    "edit",
    [
        _set_history(0, "objective", 1.0),
        _set_walk("next_chunk", 6),
        _set_recovery("new_worker", "tcp://elsewhere:1"),
        lambda r, a: a.__setitem__("coef_history", a["coef_history"] * 2),
        lambda r, a: r["walk"]["fingerprint"].__setitem__("token", "other"),
    ],
    ids=["history", "position", "recovery", "coef_history", "fingerprint"],
)
def test_an_altered_walk_fails_the_integrity_check(walk_ckpt, edit):
    data = _edited(walk_ckpt, edit, redigest=False)
    with pytest.raises(CheckpointError, match="failed its integrity check"):
        checkpoint_from_bytes(data, "altered.npz")


def test_a_forged_huge_history_is_refused_before_allocating(walk_ckpt):
    data = checkpoint_bytes(walk_ckpt)
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        contents = {name: archive.read(name) for name in archive.namelist()}
    raw = io.BytesIO(contents["history.npy"])
    np.lib.format.read_magic(raw)
    _, fortran, dtype = np.lib.format.read_array_header_1_0(raw)
    forged = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        forged, {"descr": dtype.str, "fortran_order": fortran, "shape": (10**9, 10)}
    )
    contents["history.npy"] = forged.getvalue() + raw.read()
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as archive:
        for name, blob in contents.items():
            archive.writestr(name, blob)
    with pytest.raises(CheckpointError, match=r"huge\.npz is inconsistent: history .*bytes"):
        checkpoint_from_bytes(out.getvalue(), "huge.npz")


# -- the checkpoint store ---------------------------------------------------------------------


def _tmp_files(root: Path) -> list[str]:
    return sorted(p.name for p in root.rglob("*") if "tmp" in p.name)


def test_local_store_writes_reads_and_replaces(walk_ckpt, stream, tmp_path):
    store = CheckpointStore(tmp_path / "run" / "ckpt")
    assert store.read() is None  # nothing there, the directory does not exist yet
    path = store.write(walk_ckpt)
    assert path == store.path == str(tmp_path / "run" / "ckpt" / STREAM_FILE)
    assert store.location == str(tmp_path / "run" / "ckpt")
    got = store.read()
    assert got.state.equals(walk_ckpt.state) and got.walk == walk_ckpt.walk
    later = _replace(walk_ckpt, walk=WalkPosition(6, 7, 2, dict(FINGERPRINT)))
    store.write(later)
    assert store.read().walk.next_chunk == 6
    assert os.listdir(tmp_path / "run" / "ckpt") == [STREAM_FILE]
    # A file:// URL is the same local directory.
    assert CheckpointStore(f"file://{tmp_path}/run/ckpt").read().walk.next_chunk == 6


def test_memory_store_writes_reads_and_leaves_no_temporary_object(walk_ckpt):
    import fsspec

    store = CheckpointStore("memory://rh-dask-tests/walk-a")
    assert store.read() is None
    path = store.write(walk_ckpt)
    assert path == store.path and path.endswith("/rh-dask-tests/walk-a/stream.npz")
    assert path.startswith("memory://")
    got = store.read()
    _assert_same_records(got.records, walk_ckpt.records)
    store.write(_replace(walk_ckpt, walk=WalkPosition(5, 7, 1, {"token": "second"})))
    assert store.read().walk.fingerprint == {"token": "second"}
    fs = fsspec.filesystem("memory")
    assert [Path(p).name for p in fs.ls("/rh-dask-tests/walk-a", detail=False)] == [STREAM_FILE]
    # The store pickles as its location (a detached fit's runner rebuilds it on a worker).
    again = pickle.loads(pickle.dumps(store))
    assert again.path == store.path and again.read().walk.fingerprint == {"token": "second"}


def test_object_stores_are_written_with_one_put(walk_ckpt, monkeypatch):
    from rh_dask import checkpoint_store

    store = CheckpointStore("memory://rh-dask-tests/object-store")
    monkeypatch.setattr(checkpoint_store, "_OBJECT_STORES", frozenset({"memory"}))
    moved = []
    monkeypatch.setattr(type(store._fs), "mv", lambda *a, **k: moved.append(a), raising=False)
    store.write(walk_ckpt)
    assert moved == []
    assert store.read().walk == walk_ckpt.walk


def _corrupt_truncated(data: bytes) -> bytes:
    return data[: len(data) * 2 // 3]


def _corrupt_flipped(data: bytes) -> bytes:
    raw = bytearray(data)
    raw[len(raw) // 2] ^= 0x04
    return bytes(raw)


@pytest.mark.parametrize("corrupt", [_corrupt_truncated, _corrupt_flipped])
@pytest.mark.parametrize("where", ["local", "memory"])
def test_a_damaged_stream_file_is_refused(walk_ckpt, tmp_path, corrupt, where):
    import fsspec

    location = (
        str(tmp_path / "d") if where == "local" else f"memory://rh-dask-tests/d-{id(corrupt)}"
    )
    store = CheckpointStore(location)
    store.write(walk_ckpt)
    if where == "local":
        target = Path(store.path)
        target.write_bytes(corrupt(target.read_bytes()))
    else:
        fs = fsspec.filesystem("memory")
        target = store.path.removeprefix("memory://")
        fs.pipe_file(target, corrupt(fs.cat_file(target)))
    with pytest.raises(CheckpointError, match=r"stream\.npz"):
        store.read()


def test_a_failed_local_write_keeps_the_previous_checkpoint(walk_ckpt, tmp_path, monkeypatch):
    store = CheckpointStore(tmp_path / "keep")
    store.write(walk_ckpt)
    before = Path(store.path).read_bytes()

    def refuse(src, dst):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(PermissionError):
        store.write(_replace(walk_ckpt, walk=WalkPosition(6, 7, 2, {})))
    monkeypatch.undo()
    assert os.listdir(tmp_path / "keep") == [STREAM_FILE]
    assert Path(store.path).read_bytes() == before


def test_a_read_only_directory_fails_cleanly(walk_ckpt, tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root writes into read-only directories")
    store = CheckpointStore(tmp_path / "locked")
    store.write(walk_ckpt)
    before = Path(store.path).read_bytes()
    (tmp_path / "locked").chmod(0o500)
    try:
        with pytest.raises(PermissionError):
            store.write(_replace(walk_ckpt, walk=WalkPosition(6, 7, 2, {})))
        assert os.listdir(tmp_path / "locked") == [STREAM_FILE]
        assert Path(store.path).read_bytes() == before
    finally:
        (tmp_path / "locked").chmod(0o700)


@pytest.mark.parametrize("failing", ["pipe_file", "mv"])
def test_a_failed_fsspec_write_keeps_the_previous_checkpoint(walk_ckpt, monkeypatch, failing):
    import fsspec

    store = CheckpointStore(f"memory://rh-dask-tests/fail-{failing}")
    store.write(walk_ckpt)
    fs = fsspec.filesystem("memory")
    target = store.path.removeprefix("memory://")
    before = fs.cat_file(target)
    original = getattr(type(fs), failing)

    def half_then_fail(self, path, *args, **kwargs):
        if failing == "pipe_file":
            original(self, path, args[0][:100])  # a partial object, then the failure
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(type(fs), failing, half_then_fail)
    with pytest.raises(OSError, match="No space left"):
        store.write(_replace(walk_ckpt, walk=WalkPosition(6, 7, 2, {})))
    monkeypatch.undo()
    assert fs.ls(target.rsplit("/", 1)[0], detail=False) == [target]
    assert fs.cat_file(target) == before


def test_an_existing_file_location_is_read_only(walk_ckpt, tmp_path):
    path = save_checkpoint(tmp_path / "walk.npz", walk_ckpt)
    store = CheckpointStore(path)
    assert store.path == str(path)
    assert store.read().walk == walk_ckpt.walk
    with pytest.raises(CheckpointError, match="read only"):
        store.write(walk_ckpt)
    memory = CheckpointStore("memory://rh-dask-tests/files/x.npz")
    memory._fs.pipe_file("/rh-dask-tests/files/x.npz", checkpoint_bytes(walk_ckpt))
    file_store = CheckpointStore("memory://rh-dask-tests/files/x.npz")
    assert file_store.read().walk == walk_ckpt.walk
    with pytest.raises(CheckpointError, match="read only"):
        file_store.write(walk_ckpt)
    assert memory.location.endswith("x.npz")


def test_bad_locations_are_refused():
    with pytest.raises(ValidationError, match="path or URL"):
        CheckpointStore(3)
    with pytest.raises(ValidationError, match="non-empty"):
        CheckpointStore("")
    with pytest.raises(CheckpointError, match="cannot open checkpoint location"):
        CheckpointStore("nosuchprotocol-rh://bucket/run")


# -- the input fingerprint ------------------------------------------------------------------


@pytest.fixture
def data():
    rng = np.random.default_rng(7)
    X = rng.normal(size=(120, 3))
    y = X @ np.array([1.0, -2.0, 0.5]) + rng.standard_t(3, size=120)
    frame = pd.DataFrame(X, columns=["a", "b", "c"]).assign(y=y, w=rng.uniform(0.5, 2, 120))
    return X, y, frame


def _array_fp(X, y, chunks=40, w=None):
    Xd = da.from_array(X, chunks=(chunks, X.shape[1]))
    yd = da.from_array(y, chunks=chunks)
    return fingerprint(align_stream(Xd, yd, w))


def test_the_same_array_stream_rebuilt_has_the_same_fingerprint(data):
    X, y, _ = data
    first, second = _array_fp(X, y), _array_fp(X.copy(), y.copy())
    assert first == second and first["token"] is not None
    assert first["rows"] == [40, 40, 40] and first["roles"] == ["X", "y"]
    assert first["n_chunks"] == 3 and first["n_features"] == 3
    check_fingerprint(first, second, "ckpt")
    assert json.loads(json.dumps(first)) == first


def test_other_array_inputs_are_refused_naming_the_difference(data):
    X, y, _ = data
    base = _array_fp(X, y)
    other_data = X.copy()
    other_data[5, 1] += 1e-9
    cases = {
        "the data differ": _array_fp(other_data, y),
        "n_chunks 3 != 4": _array_fp(X, y, chunks=30),
        "the data differ (token": _array_fp(X, y[::-1].copy()),
        "roles ['X', 'y'] != ['X', 'y', 'w']": _array_fp(X, y, w=da.ones(120, chunks=40)),
        "weight_value None != 2.0": _array_fp(X, y, w=2.0),
    }
    for message, got in cases.items():
        with pytest.raises(CheckpointError, match="was written for another input") as caught:
            check_fingerprint(base, got, "memory://run/stream.npz")
        assert message in str(caught.value) and "memory://run/stream.npz" in str(caught.value)
    rechunked = _array_fp(X, y, chunks=(50, 40, 30))
    with pytest.raises(CheckpointError, match="rows of chunk 0: 40 != 50"):
        check_fingerprint(base, rechunked, "ckpt")


def test_the_same_frame_rebuilt_has_the_same_fingerprint(data):
    _, _, frame = data
    a = fingerprint(align_stream(dd.from_pandas(frame, npartitions=4), "y", "w"))
    b = fingerprint(align_stream(dd.from_pandas(frame.copy(), npartitions=4), "y", "w"))
    assert a == b and a["token"] is not None
    assert a["rows"] == [None] * 4 and a["target"] == "y" and a["weight"] == "w"
    assert a["feature_names"] == ["a", "b", "c"]
    check_fingerprint(a, b, "ckpt")
    other_target = fingerprint(align_stream(dd.from_pandas(frame, npartitions=4), "w", "y"))
    with pytest.raises(CheckpointError, match="target 'y' != 'w'"):
        check_fingerprint(a, other_target, "ckpt")
    other_frame = frame.copy()
    other_frame.loc[3, "y"] = 0.0
    changed = fingerprint(align_stream(dd.from_pandas(other_frame, npartitions=4), "y", "w"))
    with pytest.raises(CheckpointError, match="the data differ"):
        check_fingerprint(a, changed, "ckpt")
    split = fingerprint(align_stream(dd.from_pandas(frame, npartitions=3), "y", "w"))
    with pytest.raises(CheckpointError, match="n_chunks 4 != 3"):
        check_fingerprint(a, split, "ckpt")


def test_a_parquet_read_has_the_same_fingerprint_until_the_files_change(data, tmp_path):
    _, _, frame = data
    where = tmp_path / "pq"
    dd.from_pandas(frame, npartitions=3).to_parquet(where)
    a = fingerprint(align_stream(dd.read_parquet(where), "y", None))
    b = fingerprint(align_stream(dd.read_parquet(str(where)), "y", None))
    assert a["token"] is not None and a == b
    check_fingerprint(a, b, "ckpt")
    changed = frame.copy()
    changed["y"] *= 2
    dd.from_pandas(changed, npartitions=3).to_parquet(where, overwrite=True)
    c = fingerprint(align_stream(dd.read_parquet(where), "y", None))
    with pytest.raises(CheckpointError, match="the data differ"):
        check_fingerprint(a, c, "ckpt")


def test_an_untokenizable_part_compares_the_structure_only(data):
    import threading

    X, y, _ = data
    lock = threading.Lock()
    Xd = da.from_array(X, chunks=(40, 3)).map_blocks(lambda b, lk: b, lock, dtype=float)
    blind = fingerprint(align_stream(Xd, da.from_array(y, chunks=40), None))
    assert blind["token"] is None
    base = _array_fp(X, y)
    check_fingerprint(blind, base, "ckpt")  # structure agrees, tokens not comparable
    check_fingerprint(base, blind, "ckpt")
    with pytest.raises(CheckpointError, match=r"n_chunks 3 != 4.*not comparable"):
        check_fingerprint(blind, _array_fp(X, y, chunks=30), "ckpt")


_SUBPROCESS = """
import json, sys
import numpy as np, dask.array as da, dask.dataframe as dd
from rh_dask.distributed.chunks import align_stream
from rh_dask.distributed.fingerprint import fingerprint
rng = np.random.default_rng(11)
X = rng.normal(size=(90, 4)); y = rng.normal(size=90)
Xd, yd = da.from_array(X, chunks=(30, 4)), da.from_array(y, chunks=30)
arrays = fingerprint(align_stream(Xd, yd, None))
parquet = fingerprint(align_stream(dd.read_parquet(sys.argv[1]), "y", None))
print(json.dumps([arrays, parquet]))
"""


def test_fingerprints_are_the_same_in_another_process(tmp_path):
    rng = np.random.default_rng(11)
    X, y = rng.normal(size=(90, 4)), rng.normal(size=90)
    frame = pd.DataFrame(X, columns=list("abcd")).assign(y=y)
    where = tmp_path / "pq"
    dd.from_pandas(frame, npartitions=3).to_parquet(where)
    here = [
        fingerprint(
            align_stream(da.from_array(X, chunks=(30, 4)), da.from_array(y, chunks=30), None)
        ),
        fingerprint(align_stream(dd.read_parquet(where), "y", None)),
    ]
    env = {**os.environ, "PYTHONPATH": str(Path(ckpt_module.__file__).parents[1])}
    out = subprocess.run(
        [sys.executable, "-c", _SUBPROCESS, str(where)],
        capture_output=True,
        text=True,
        env=env,
        check=True,
        timeout=120,
    )
    there = json.loads(out.stdout.strip().splitlines()[-1])
    assert here[0]["token"] is not None and here[1]["token"] is not None
    assert there == json.loads(json.dumps(here))
