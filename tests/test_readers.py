"""The Parquet and Zarr readers (rh_dask.readers): projection, dtypes, order, chunks, bad files."""

from __future__ import annotations

import os
from pathlib import Path

import dask
import fsspec
import numpy as np
import pandas as pd
import pytest

import rh_dask
from rh_dask import InputError, RenewableHuberRegressor, read_parquet, read_zarr
from rh_dask.app import io as app_io
from rh_dask.app.cli import main
from rh_dask.app.demo import write_stream
from rh_dask.datasets import StreamSpec
from rh_dask.distributed.chunks import align_stream, stable_partitions
from rh_dask.distributed.fingerprint import fingerprint

pq = pytest.importorskip("pyarrow.parquet")

pytestmark = pytest.mark.timeout(120)

N_FEATURES = 4
FEATURES = [f"x{j}" for j in range(N_FEATURES)]


def _frame(index: int, rows: int, dtype: str = "float32") -> pd.DataFrame:
    X, y = StreamSpec(n_features=N_FEATURES, seed=3).chunk(index, rows, dtype)
    return pd.DataFrame(X, columns=FEATURES).assign(y=y, extra=np.arange(rows, dtype="int64"))


def _write(path: Path, frame: pd.DataFrame, row_group_size: int | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    frame.to_parquet(path, index=False, row_group_size=row_group_size)
    return path


@pytest.fixture
def dataset(tmp_path):
    """Files part.1, part.2, part.10 (written out of order), 3 row groups each, float32."""
    root = tmp_path / "ds"
    for i in (10, 2, 1):
        _write(root / f"part.{i}.parquet", _frame(i, 30), row_group_size=10)
    (root / "_SUCCESS").write_text("")
    return root


def _partition_lengths(frame) -> list[int]:
    with stable_partitions():
        return [len(p) for p in dask.compute(*frame.to_delayed())]


def test_files_in_natural_order_float32_kept_and_columns_projected(dataset):
    frame = read_parquet(dataset, ["x1", "y"])
    assert list(frame.columns) == ["x1", "y"]
    assert dict(frame.dtypes) == {"x1": np.dtype("float32"), "y": np.dtype("float32")}
    assert frame.npartitions == 3
    with stable_partitions():
        parts = dask.compute(*frame.to_delayed())
    for part, i in zip(parts, (1, 2, 10), strict=True):
        expected = _frame(i, 30)[["x1", "y"]]
        assert list(part.columns) == ["x1", "y"] and part.dtypes.eq(np.float32).all()
        assert part.to_numpy().tobytes() == expected.to_numpy().tobytes()
    assert [os.path.basename(p) for p in rh_dask.readers.parquet_files(dataset)] == [
        "part.1.parquet",
        "part.2.parquet",
        "part.10.parquet",
    ]


def test_only_the_asked_columns_are_read(dataset):
    # The projection reaches the reader itself, not a selection after reading.
    frame = read_parquet(dataset, ["x0"])
    (read,) = [e for e in frame.expr.walk() if type(e).__name__.startswith("ReadParquet")]
    assert list(read.operand("columns")) == ["x0"]


def test_chunk_rules(tmp_path):
    root = tmp_path / "mixed"
    _write(root / "a.parquet", _frame(0, 100), row_group_size=10)  # 10 row groups
    _write(root / "b.parquet", _frame(1, 25), row_group_size=10)  # 3 row groups
    assert _partition_lengths(read_parquet(root, chunks="file")) == [100, 25]
    assert _partition_lengths(read_parquet(root, chunks="row-group")) == [10] * 10 + [10, 10, 5]
    # auto: the files are small next to 128 MiB, one batch a file.
    assert _partition_lengths(read_parquet(root)) == [100, 25]
    # auto with a file over chunk_bytes: runs of whole row groups, never across files.
    group = pq.read_metadata(root / "a.parquet").row_group(0)
    x0 = next(
        group.column(c) for c in range(group.num_columns) if group.column(c).path_in_schema == "x0"
    )
    size = x0.total_uncompressed_size
    cut = read_parquet(root, ["x0"], chunk_bytes=3 * size + 1)
    assert _partition_lengths(cut) == [30, 30, 30, 10, 25]
    with pytest.raises(InputError, match="chunks must be one of"):
        read_parquet(root, chunks="rows")
    with pytest.raises(InputError, match="chunk_bytes"):
        read_parquet(root, chunk_bytes="lots")


def test_fsspec_urls_memory_and_file(dataset):
    fs = fsspec.filesystem("memory")
    for i in (1, 2, 10):
        fs.pipe(f"/rh-readers/ds/part.{i}.parquet", (dataset / f"part.{i}.parquet").read_bytes())
    try:
        for url in ("memory://rh-readers/ds", "memory://rh-readers/ds/part.*.parquet"):
            frame = read_parquet(url, ["x0", "y"], storage_options={})
            assert frame.npartitions == 3 and frame["x0"].dtype == np.float32
            local = read_parquet(dataset, ["x0", "y"]).compute()
            assert frame.compute().to_numpy().tobytes() == local.to_numpy().tobytes()
        fs.pipe("/rh-readers/ds/part.5.parquet", b"PAR1 not a footer")
        with pytest.raises(InputError, match=r"memory:///?rh-readers/ds/part\.5\.parquet"):
            read_parquet("memory://rh-readers/ds")
    finally:
        fs.rm("/rh-readers", recursive=True)
    assert read_parquet(f"file://{dataset}", ["y"]).npartitions == 3


def _bad_dataset(tmp_path: Path, kind: str) -> tuple[Path, Path]:
    root = tmp_path / kind
    for i in range(4):
        _write(root / f"part-{i}.parquet", _frame(i, 40))
    bad = root / "part-2.parquet"
    if kind == "corrupt":
        bad.write_bytes(bad.read_bytes()[:-20])  # the footer cut short
    elif kind == "schema":
        _write(bad, _frame(2, 40, dtype="float64"))
    else:  # a column missing
        _write(bad, _frame(2, 40).drop(columns=["x3"]))
    return root, bad


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("corrupt", "not a readable Parquet file"),
        ("schema", r"another schema than the first file .*'x0' is double, not float"),
        ("missing", "has no column 'x3'"),
    ],
)
def test_a_bad_file_is_named(tmp_path, kind, message):
    root, bad = _bad_dataset(tmp_path, kind)
    with pytest.raises(InputError, match=message) as caught:
        read_parquet(root, [*FEATURES, "y"])
    assert str(bad) in str(caught.value) and caught.value.path == str(bad)
    assert isinstance(caught.value, ValueError)


def test_schema_difference_without_asked_columns(tmp_path):
    root, _ = _bad_dataset(tmp_path, "missing")
    with pytest.raises(InputError, match=r"part-2\.parquet.*lacks columns \['x3'\]"):
        read_parquet(root)


def test_missing_paths(tmp_path):
    with pytest.raises(InputError, match="no such file or directory"):
        read_parquet(tmp_path / "absent")
    with pytest.raises(InputError, match="no file matches"):
        read_parquet(str(tmp_path / "*.parquet"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputError, match="holds no Parquet files"):
        read_parquet(tmp_path / "empty")


def test_app_input_error_is_the_library_error():
    assert app_io.InputError is rh_dask.InputError is rh_dask.exceptions.InputError


def _numpy_fit(frames: list[pd.DataFrame], **params) -> RenewableHuberRegressor:
    model = RenewableHuberRegressor(engine="numpy", progress=False, **params)
    for frame in frames:
        model.partial_fit(frame[FEATURES].to_numpy(), frame["y"].to_numpy())
    return model


def _assert_same_fit(model, reference) -> None:
    assert model.coef_.tobytes() == reference.coef_.tobytes()
    assert np.float64(model.intercept_).tobytes() == np.float64(reference.intercept_).tobytes()
    assert model.n_samples_seen_ == reference.n_samples_seen_


def test_fit_on_read_parquet_equals_the_numpy_loop(dataset):
    frames = [_frame(i, 30) for i in (1, 2, 10)]
    for dtype in ("float64", "float32"):
        model = RenewableHuberRegressor(engine="numpy", progress=False, dtype=dtype)
        model.fit(read_parquet(dataset, [*FEATURES, "y"]), "y")
        _assert_same_fit(model, _numpy_fit(frames, dtype=dtype))


def test_a_bad_file_leaves_a_fitted_model_and_its_file_as_they_were(
    dataset, tmp_path, snapshot, assert_unchanged, capsys
):
    model = RenewableHuberRegressor(engine="numpy", progress=False)
    model.fit(read_parquet(dataset, [*FEATURES, "y"]), "y")
    before = snapshot(model)
    root, bad = _bad_dataset(tmp_path, "corrupt")
    with pytest.raises(InputError, match=str(bad)):
        model.fit(read_parquet(root, [*FEATURES, "y"]), "y")
    assert_unchanged(before, snapshot(model))
    # The command line: exit code 3 naming the file, the model file untouched.
    saved = tmp_path / "model.npz"
    model.save(saved)
    content = saved.read_bytes()
    argv = ["fit", "--input", str(root), "--target", "y", "--output", str(saved)]
    assert main([*argv, "--scheduler", "none", "--no-progress"]) == 3
    assert saved.read_bytes() == content
    assert str(bad) in capsys.readouterr().err


def test_read_parquet_fingerprint_is_deterministic_and_follows_the_files(dataset):
    def token() -> str | None:
        return fingerprint(align_stream(read_parquet(dataset, [*FEATURES, "y"]), "y", None))[
            "token"
        ]

    first = token()
    assert first is not None and token() == first
    _write(dataset / "part.2.parquet", _frame(7, 30))
    assert token() != first


@pytest.mark.slow
def test_fit_on_read_parquet_on_a_local_cluster_equals_the_numpy_loop(dataset):
    from distributed import Client, LocalCluster

    frames = [_frame(i, 30) for i in (1, 2, 10)]
    with (
        LocalCluster(
            n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0"
        ) as lc,
        Client(lc),
    ):
        model = RenewableHuberRegressor(engine="numpy", progress=False)
        model.fit(read_parquet(dataset, [*FEATURES, "y"]), "y")
    _assert_same_fit(model, _numpy_fit(frames))


# -- the demo's data -------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_the_demo_writes_its_data_in_the_requested_dtype(tmp_path, dtype):
    with dask.config.set(scheduler="sync"):
        write_stream(StreamSpec(n_features=3), 100, 40, tmp_path / "demo", dtype)
    frame = read_parquet(tmp_path / "demo")
    assert frame.npartitions == 3
    assert set(frame.dtypes) == {np.dtype(dtype)}
    schema = pq.read_schema(rh_dask.readers.parquet_files(tmp_path / "demo")[0])
    assert {str(t) for t in schema.types} == {"float" if dtype == "float32" else "double"}


# -- Zarr ------------------------------------------------------------------------------------
zarr = pytest.importorskip("zarr")
ZARR_MAJOR = int(zarr.__version__.split(".")[0])
FORMATS = [
    2,
    pytest.param(
        3,
        marks=pytest.mark.skipif(
            ZARR_MAJOR < 3, reason=f"zarr {zarr.__version__} cannot read Zarr v3 stores"
        ),
    ),
]


def _zarr_array(path: Path, data: np.ndarray, chunks: tuple[int, int], fmt: int) -> None:
    if ZARR_MAJOR >= 3:
        arr = zarr.create_array(
            store=str(path), shape=data.shape, chunks=chunks, dtype=data.dtype, zarr_format=fmt
        )
    else:
        arr = zarr.open_array(
            str(path), mode="w", shape=data.shape, chunks=chunks, dtype=data.dtype
        )
    arr[:] = data


@pytest.mark.parametrize("fmt", FORMATS)
def test_zarr_array_keeps_dtype_and_row_chunks(tmp_path, fmt):
    data = np.arange(100 * 5, dtype="float32").reshape(100, 5)
    _zarr_array(tmp_path / "a.zarr", data, (30, 2), fmt)
    stream = read_zarr(tmp_path / "a.zarr", target=-1, exclude=[0])
    assert stream.X.dtype == np.float32 and stream.y.dtype == np.float32
    assert stream.X.chunks == ((30, 30, 30, 10), (3,))
    assert stream.feature_names == ["x1", "x2", "x3"]
    assert stream.X.compute().tobytes() == np.ascontiguousarray(data[:, 1:4]).tobytes()
    assert stream.y.compute().tobytes() == data[:, 4].tobytes()
    assert read_zarr(tmp_path / "a.zarr", chunk_rows=40).X.chunks[0] == (40, 40, 20)
    # An fsspec URL reads the same store.
    assert read_zarr(f"file://{tmp_path / 'a.zarr'}").X.compute().tobytes() == data.tobytes()


@pytest.mark.parametrize("fmt", FORMATS)
def test_zarr_group_selects_arrays_by_name(tmp_path, fmt):
    rows = 50
    X = np.random.default_rng(0).standard_normal((rows, 2)).astype("float32")
    store = tmp_path / "g.zarr"
    group = (
        zarr.open_group(str(store), mode="w", zarr_format=fmt)
        if ZARR_MAJOR >= 3
        else (zarr.open_group(str(store), mode="w"))
    )
    for name, values in (("X", X), ("b", X[:, 0] * 2), ("y", X[:, 1] + 1), ("w", np.ones(rows))):
        kwargs = {"shape": values.shape, "chunks": (20, *values.shape[1:]), "dtype": values.dtype}
        arr = (
            group.create_array(name, **kwargs) if ZARR_MAJOR >= 3 else group.create(name, **kwargs)
        )
        arr[:] = values
    stream = read_zarr(store, target="y", weight="w")
    assert stream.feature_names == ["X[0]", "X[1]", "b"]
    assert stream.X.chunks == ((20, 20, 10), (3,)) and stream.X.dtype == np.float32
    assert stream.sample_weight.dtype == np.float64
    model = RenewableHuberRegressor(engine="numpy", progress=False)
    model.fit(stream.X, stream.y, sample_weight=stream.sample_weight)
    reference = RenewableHuberRegressor(engine="numpy", progress=False)
    full = np.column_stack([X, X[:, 0] * 2])
    for start in range(0, rows, 20):
        part = slice(start, start + 20)
        reference.partial_fit(full[part], X[part, 1] + 1, sample_weight=np.ones(rows)[part])
    assert model.coef_.tobytes() == reference.coef_.tobytes()
    with pytest.raises(InputError, match="choose the target array"):
        read_zarr(store)
    with pytest.raises(InputError, match=r"feature arrays \['nope'\]"):
        read_zarr(store, target="y", features=["nope"])


def test_zarr_not_a_store(tmp_path):
    (tmp_path / "plain.zarr").mkdir()
    with pytest.raises(InputError, match=r"cannot open .* as a Zarr store") as caught:
        read_zarr(tmp_path / "plain.zarr")
    assert caught.value.path == str(tmp_path / "plain.zarr")
