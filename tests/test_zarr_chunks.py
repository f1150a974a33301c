"""rh_dask.read_zarr's direct decode of whole chunks (rh_dask.zarr_chunks)."""

from __future__ import annotations

import pickle
from pathlib import Path

import dask
import numpy as np
import pytest
from dask.base import tokenize

from rh_dask import InputError, RenewableHuberRegressor, StreamError, read_zarr, zarr_chunks
from rh_dask.distributed.chunks import align_stream
from rh_dask.distributed.fingerprint import fingerprint
from rh_dask.settings import SettingError

zarr = pytest.importorskip("zarr")
if int(zarr.__version__.split(".")[0]) < 3:
    pytest.skip("the direct decode needs zarr >= 3", allow_module_level=True)

from zarr.codecs import BloscCodec, GzipCodec, ZstdCodec  # noqa: E402

ROWS, FEATURES, CHUNK = 103, 4, 20  # a last, partial chunk of 3 rows

# (zarr format, compressors): zarr's default, none, and each compressor the decode maps.
CODECS = {
    "v3-default": (3, "auto"),
    "v3-none": (3, None),
    "v3-zstd": (3, ZstdCodec(level=3, checksum=True)),
    "v3-blosc": (3, BloscCodec()),
    "v3-gzip": (3, GzipCodec()),
    "v2-default": (2, "auto"),
    "v2-none": (2, None),
}


def _data(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((ROWS, FEATURES)).astype("float32")
    y = (X @ np.arange(1, FEATURES + 1, dtype="float32") + rng.standard_t(2, ROWS)).astype(
        "float32"
    )
    return X, y


def _store(path: Path, fmt: int, compressors, X: np.ndarray, y: np.ndarray, **kw) -> Path:
    group = zarr.open_group(str(path), mode="w", zarr_format=fmt)
    for name, values, chunks in (("X", X, (CHUNK, FEATURES)), ("y", y, (CHUNK,))):
        arr = group.create_array(
            name,
            shape=values.shape,
            chunks=kw.get("chunks", {}).get(name, chunks),
            dtype=kw.get("dtype", values.dtype),
            compressors=compressors,
            **{k: kw[k] for k in ("filters", "serializer") if k in kw},
        )
        arr[:] = values
    return path


@pytest.fixture
def no_zarr_reads(monkeypatch):
    """Fails any read through zarr's own indexing (the direct decode must do them all)."""

    def refuse(*args, **kwargs):
        raise AssertionError("read through zarr's indexing")

    monkeypatch.setattr(zarr_chunks, "_opened", refuse)


def _x_chunk_path(store: Path, chunk: int, fmt: int) -> Path:
    return store / "X" / "c" / str(chunk) / "0" if fmt == 3 else store / "X" / f"{chunk}.0"


@pytest.mark.parametrize("case", sorted(CODECS))
def test_whole_chunks_decode_directly_to_zarrs_own_bytes(tmp_path, case, no_zarr_reads):
    fmt, compressors = CODECS[case]
    X, y = _data()
    store = _store(tmp_path / "s.zarr", fmt, compressors, X, y)
    stream = read_zarr(store, target="y", features=["X"])
    assert stream.X.name.startswith("from-zarr-direct-")
    assert stream.X.chunks == ((20, 20, 20, 20, 20, 3), (FEATURES,))
    for i in range(stream.X.numblocks[0]):
        rows = slice(i * CHUNK, (i + 1) * CHUNK)
        block = stream.X.blocks[i].compute(scheduler="sync")
        assert block.dtype == np.float32 and block.flags.c_contiguous
        assert block.tobytes() == X[rows].tobytes()
        assert stream.y.blocks[i].compute(scheduler="sync").tobytes() == y[rows].tobytes()


def test_a_fit_on_directly_decoded_chunks_equals_the_loop_over_zarrs_reads(tmp_path):
    X, y = _data(1)
    store = _store(tmp_path / "s.zarr", 3, "auto", X, y)
    model = RenewableHuberRegressor(engine="numpy", progress=False, dtype="float32")
    model.fit(*(lambda s: (s.X, s.y))(read_zarr(store, target="y", features=["X"])))
    reference = RenewableHuberRegressor(engine="numpy", progress=False, dtype="float32")
    zx, zy = zarr.open_array(str(store / "X")), zarr.open_array(str(store / "y"))
    for start in range(0, ROWS, CHUNK):
        reference.partial_fit(zx[start : start + CHUNK], zy[start : start + CHUNK])
    assert model.coef_.tobytes() == reference.coef_.tobytes()
    assert model.intercept_ == reference.intercept_


@pytest.mark.parametrize(
    "kind",
    ["column-chunks", "big-endian-v2", "big-endian-v3", "filters", "sharded"],
)
def test_arrays_it_cannot_decode_go_through_zarr(tmp_path, kind):
    X, y = _data(2)
    kw: dict = {}
    if kind == "column-chunks":
        kw["chunks"] = {"X": (CHUNK, 2)}
    elif kind == "big-endian-v2":
        kw["dtype"] = ">f4"
    elif kind == "big-endian-v3":
        from zarr.codecs import BytesCodec

        kw["serializer"] = BytesCodec(endian="big")
    elif kind == "filters":
        from numcodecs import Shuffle

        kw["filters"] = [Shuffle(elementsize=4)]
    fmt = 2 if kind in ("filters", "big-endian-v2") else 3
    if kind == "sharded":
        group = zarr.open_group(str(tmp_path / "s.zarr"), mode="w", zarr_format=3)
        for name, values in (("X", X), ("y", y)):
            arr = group.create_array(
                name,
                shape=values.shape,
                chunks=(10, *values.shape[1:]),
                shards=(CHUNK, *values.shape[1:]),
                dtype=values.dtype,
            )
            arr[:] = values
        store = tmp_path / "s.zarr"
    else:
        store = _store(tmp_path / "s.zarr", fmt, "auto", X, y, **kw)
    array = zarr.open_array(str(store / "X"))
    assert zarr_chunks.direct_rows(array, str(store), "X", None) is None
    stream = read_zarr(store, target="y", features=["X"], chunk_rows=CHUNK)
    assert not stream.X.name.startswith("from-zarr-direct-")
    assert stream.X.compute().astype("float32").tobytes() == X.tobytes()


def test_only_whole_chunks_are_decoded_directly(tmp_path):
    X, y = _data(3)
    store = _store(tmp_path / "s.zarr", 3, "auto", X, y)
    rows = zarr_chunks.direct_rows(zarr.open_array(str(store / "X")), str(store), "X", None)
    assert rows is not None
    calls = []
    real = zarr_chunks._opened

    def counting(*args):
        calls.append(args)
        return real(*args)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(zarr_chunks, "_opened", counting)
        assert rows[20:40, :].tobytes() == X[20:40].tobytes() and not calls
        assert rows[100:103].tobytes() == X[100:].tobytes() and not calls  # the last, partial
        # Not one whole chunk: zarr's indexing.
        for index in (np.s_[5:25], np.s_[20:39], np.s_[20:40, 1:], np.s_[0:40], np.s_[0:20:2]):
            assert rows[index].tobytes() == np.ascontiguousarray(X[index]).tobytes()
        assert len(calls) == 5


def test_a_chunk_never_written_reads_the_fill_value(tmp_path, monkeypatch):
    group = zarr.open_group(str(tmp_path / "s.zarr"), mode="w", zarr_format=3)
    X = group.create_array("X", shape=(60, 2), chunks=(20, 2), dtype="f8", fill_value=7.0)
    y = group.create_array("y", shape=(60,), chunks=(20,), dtype="f8", fill_value=-1.0)
    X[:20], y[:20] = 1.0, 2.0
    stream = read_zarr(tmp_path / "s.zarr", target="y", features=["X"])
    assert stream.X.name.startswith("from-zarr-direct-")
    assert stream.X.compute().tolist() == [[1.0, 1.0]] * 20 + [[7.0, 7.0]] * 40
    assert stream.y.compute().tolist() == [2.0] * 20 + [-1.0] * 40


@pytest.mark.parametrize("fmt", [2, 3])
def test_a_corrupt_chunk_is_named_and_the_model_keeps_the_chunks_before_it(tmp_path, fmt):
    X, y = _data(5)
    store = _store(tmp_path / "bad.zarr", fmt, "auto", X, y)
    bad = _x_chunk_path(store, 2, fmt)
    assert bad.is_file()
    bad.write_bytes(b"not a compressed chunk" * 10)
    stream = read_zarr(store, target="y", features=["X"])
    with pytest.raises(InputError, match="could not be decoded") as caught:
        stream.X.blocks[2].compute(scheduler="sync")
    assert str(bad) in str(caught.value) and caught.value.path == str(bad)
    # In a fit: StreamError naming the chunk and the file (docs/api.md), the model
    # holding the state after the last good chunk, as for any chunk that fails to load.
    model = RenewableHuberRegressor(engine="numpy", progress=False, dtype="float32")
    with pytest.raises(StreamError, match=f"chunk 2 could not be loaded: .*{bad}") as failed:
        model.fit(stream.X, stream.y)
    assert isinstance(failed.value.__cause__, InputError) and failed.value.chunk_index == 2
    reference = RenewableHuberRegressor(engine="numpy", progress=False, dtype="float32")
    for start in (0, CHUNK):
        reference.partial_fit(X[start : start + CHUNK], y[start : start + CHUNK])
    assert model.n_samples_seen_ == 2 * CHUNK
    assert model.coef_.tobytes() == reference.coef_.tobytes()


def test_the_setting_off_reads_through_zarr_and_a_bad_value_is_refused(tmp_path):
    X, y = _data(6)
    store = _store(tmp_path / "s.zarr", 3, "auto", X, y)
    with dask.config.set({"rh-dask.readers.zarr-direct": False}):
        stream = read_zarr(store, target="y", features=["X"])
    assert stream.X.name.startswith("from-zarr-") and "direct" not in stream.X.name
    assert stream.X.compute().tobytes() == X.tobytes()
    with (
        dask.config.set({"rh-dask.readers.zarr-direct": "sometimes"}),
        pytest.raises(SettingError, match="zarr-direct"),
    ):
        read_zarr(store, target="y", features=["X"])


def test_the_reader_pickles_and_its_token_and_fingerprint_are_stable(tmp_path):
    X, y = _data(7)
    store = _store(tmp_path / "s.zarr", 3, "auto", X, y)
    rows = zarr_chunks.direct_rows(zarr.open_array(str(store / "X")), str(store), "X", None)
    assert pickle.loads(pickle.dumps(rows)) == rows
    assert tokenize(rows) == tokenize(pickle.loads(pickle.dumps(rows)))

    def token() -> str | None:
        s = read_zarr(store, target="y", features=["X"])
        return fingerprint(align_stream(s.X, s.y, None))["token"]

    first = token()
    assert first is not None and token() == first
    other = _store(tmp_path / "other.zarr", 3, "auto", X, y)
    s = read_zarr(other, target="y", features=["X"])
    assert fingerprint(align_stream(s.X, s.y, None))["token"] != first


def test_an_fsspec_url_decodes_directly(tmp_path, no_zarr_reads):
    X, y = _data(8)
    store = _store(tmp_path / "s.zarr", 3, "auto", X, y)
    stream = read_zarr(f"file://{store}", target="y", features=["X"])
    assert stream.X.name.startswith("from-zarr-direct-")
    assert stream.X.blocks[5].compute(scheduler="sync").tobytes() == X[100:].tobytes()


@pytest.mark.slow
@pytest.mark.parametrize("loader", ["cluster", "relay"])
def test_a_fit_on_a_local_cluster_decodes_on_the_workers_and_equals_the_loop(tmp_path, loader):
    from distributed import Client, LocalCluster

    X, y = _data(9)
    store = _store(tmp_path / "s.zarr", 3, "auto", X, y)
    stream = read_zarr(store, target="y", features=["X"])
    assert stream.X.name.startswith("from-zarr-direct-")
    with (
        LocalCluster(
            n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0"
        ) as lc,
        Client(lc),
    ):
        model = RenewableHuberRegressor(
            engine="numpy", progress=False, dtype="float32", loader=loader
        )
        model.fit(stream.X, stream.y)
    reference = RenewableHuberRegressor(engine="numpy", progress=False, dtype="float32")
    for start in range(0, ROWS, CHUNK):
        reference.partial_fit(X[start : start + CHUNK], y[start : start + CHUNK])
    assert model.coef_.tobytes() == reference.coef_.tobytes()
    assert model.intercept_ == reference.intercept_


def test_a_relative_path_reads_from_any_working_directory(tmp_path, monkeypatch):
    X, y = _data(10)
    _store(tmp_path / "s.zarr", 3, "auto", X, y)
    monkeypatch.chdir(tmp_path)
    stream = read_zarr("s.zarr", target="y", features=["X"])
    monkeypatch.chdir("/")
    assert stream.X.name.startswith("from-zarr-direct-")
    assert stream.X.blocks[1].compute(scheduler="sync").tobytes() == X[20:40].tobytes()


def test_storage_options_that_are_objects_leave_the_array_to_zarr(tmp_path):
    X, y = _data(11)
    store = _store(tmp_path / "s.zarr", 3, "auto", X, y)
    array = zarr.open_array(str(store / "X"))
    assert zarr_chunks.direct_rows(array, str(store), "X", {"auto_mkdir": True}) is not None
    assert zarr_chunks.direct_rows(array, str(store), "X", {"session": object()}) is None


@pytest.mark.parametrize("codec", ["zstd", "blosc", "gzip"])
@pytest.mark.parametrize("nbytes", [4, 200, 300, 70_000, 3_000_000])
def test_the_declared_size_of_a_frame_is_its_decoded_size(codec, nbytes):
    import numcodecs

    data = np.arange(nbytes, dtype=np.uint8)
    frame = numcodecs.get_codec({"id": codec}).encode(data)
    assert zarr_chunks.declared_size(codec, bytes(frame)) == nbytes
    with pytest.raises(ValueError):
        zarr_chunks.declared_size(codec, b"\x00\x01")


@pytest.mark.parametrize("case", ["v3-default", "v3-blosc", "v3-gzip", "v3-none"])
def test_a_chunk_of_another_size_is_named_not_half_filled(tmp_path, case):
    import numcodecs

    fmt, compressors = CODECS[case]
    X, y = _data(12)
    store = _store(tmp_path / "s.zarr", fmt, compressors, X, y)
    bad = _x_chunk_path(store, 1, fmt)
    short = X[:5].tobytes()  # a well-formed frame of 5 rows where the chunk has 20
    codec_id = {"v3-default": "zstd", "v3-blosc": "blosc", "v3-gzip": "gzip"}.get(case)
    bad.write_bytes(
        short if codec_id is None else numcodecs.get_codec({"id": codec_id}).encode(short)
    )
    stream = read_zarr(store, target="y", features=["X"])
    with pytest.raises(
        InputError, match=f"{bad}: chunk .* holds 80 bytes where the chunk has 320"
    ):
        stream.X.blocks[1].compute(scheduler="sync")
    assert stream.X.blocks[0].compute(scheduler="sync").tobytes() == X[:20].tobytes()
