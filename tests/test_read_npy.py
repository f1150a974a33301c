"""``rh_dask.read_npy``: a ``.npy`` file as a Dask array whose chunk tasks are byte ranges."""

from __future__ import annotations

import os

import numpy as np
import pytest

import rh_dask
from rh_dask import InputError
from rh_dask.distributed.graphs import bare_call, optimized_graph
from rh_dask.file_rows import FileRows, npy_layout


@pytest.mark.parametrize("shape", [(1_000, 7), (1_000,), (10, 3, 2)])
@pytest.mark.parametrize("dtype", ["float32", ">f8", "int16"])
def test_the_array_reads_back_bit_for_bit(tmp_path, shape, dtype):
    a = (np.arange(np.prod(shape)).reshape(shape) % 1_000).astype(dtype)
    path = tmp_path / "a.npy"
    np.save(path, a)
    arr = rh_dask.read_npy(path, chunk_rows=300)
    assert arr.shape == a.shape and arr.dtype == a.dtype
    assert arr.chunks[0] == tuple(min(300, a.shape[0] - s) for s in range(0, a.shape[0], 300))
    assert all(len(c) == 1 for c in arr.chunks[1:])
    got = arr.compute()
    assert got.dtype == a.dtype and got.tobytes() == a.tobytes()
    assert arr[3:7].compute().tobytes() == a[3:7].tobytes()


def test_default_chunks_and_a_file_url(tmp_path):
    a = np.ones((70_000, 2), dtype="float32")
    np.save(tmp_path / "a.npy", a)
    arr = rh_dask.read_npy(f"file://{tmp_path / 'a.npy'}")
    assert arr.chunks[0] == (rh_dask.readers.DEFAULT_NPY_CHUNK_ROWS, 70_000 - 65_536)


def test_an_empty_file_is_one_empty_chunk(tmp_path):
    np.save(tmp_path / "e.npy", np.empty((0, 4), dtype="float64"))
    arr = rh_dask.read_npy(tmp_path / "e.npy")
    assert arr.shape == (0, 4) and arr.compute().shape == (0, 4)


def test_each_chunk_is_one_bare_task_of_its_rows(tmp_path):
    np.save(tmp_path / "a.npy", np.zeros((10, 3), dtype="float32"))
    arr = rh_dask.read_npy(tmp_path / "a.npy", chunk_rows=4)
    graph, (keys,) = optimized_graph([arr])
    rows = [bare_call(graph[k[0]]) for k in keys]
    assert all(isinstance(r, FileRows) for r in rows)
    assert [(r.start, r.stop) for r in rows] == [(0, 4), (4, 8), (8, 10)]
    assert rows[1].byte_offset == rows[1].layout.offset + 4 * 3 * 4 and rows[1].nbytes == 48
    # Anything computed from it is no longer a bare read.
    graph, (keys,) = optimized_graph([arr * 2])
    assert bare_call(graph[keys[0][0]]) is None


def test_the_same_file_gives_the_same_name_and_a_rewritten_one_another(tmp_path):
    path = tmp_path / "a.npy"
    np.save(path, np.zeros((10, 3)))
    a, b = rh_dask.read_npy(path), rh_dask.read_npy(path)
    assert a.name == b.name
    np.save(path, np.zeros((12, 3)))
    assert rh_dask.read_npy(path).name != a.name


def test_bad_files_are_refused_naming_them(tmp_path):
    with pytest.raises(InputError, match="cannot read") as info:
        rh_dask.read_npy(tmp_path / "missing.npy")
    assert info.value.path.endswith("missing.npy")
    (tmp_path / "junk.npy").write_bytes(b"not an npy file at all")
    with pytest.raises(InputError, match=r"junk\.npy"):
        rh_dask.read_npy(tmp_path / "junk.npy")
    np.save(tmp_path / "f.npy", np.asfortranarray(np.ones((5, 3))))
    with pytest.raises(InputError, match="Fortran-ordered"):
        rh_dask.read_npy(tmp_path / "f.npy")
    np.save(tmp_path / "o.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(InputError, match="numbers are needed"):
        rh_dask.read_npy(tmp_path / "o.npy")
    np.save(tmp_path / "s.npy", np.float64(3.0))
    with pytest.raises(InputError, match="0-D"):
        rh_dask.read_npy(tmp_path / "s.npy")
    np.save(tmp_path / "t.npy", np.ones((100, 3)))
    with open(tmp_path / "t.npy", "r+b") as f:
        f.truncate(os.path.getsize(tmp_path / "t.npy") - 8)
    with pytest.raises(InputError, match="truncated"):
        rh_dask.read_npy(tmp_path / "t.npy")
    with pytest.raises(InputError, match="local files only"):
        rh_dask.read_npy("s3://bucket/a.npy")
    for bad in (0, -3, 2.5, True):
        with pytest.raises(InputError, match="chunk_rows"):
            rh_dask.read_npy(tmp_path / "f.npy", chunk_rows=bad)


def test_a_file_that_changed_since_it_was_opened_is_refused_when_read(tmp_path):
    path = tmp_path / "a.npy"
    np.save(path, np.ones((100, 3)))
    arr = rh_dask.read_npy(path, chunk_rows=50)
    np.save(path, np.ones((90, 3)))
    with pytest.raises(InputError, match="changed since it was opened"):
        arr.compute()


def test_layout_of_a_version_2_header(tmp_path):
    path = tmp_path / "v2.npy"
    a = np.arange(12, dtype="float32").reshape(4, 3)
    with open(path, "wb") as f:
        np.lib.format.write_array(f, a, version=(2, 0))
    layout = npy_layout(path)
    assert layout.shape == (4, 3) and layout.row_bytes == 12
    assert FileRows(layout, 1, 3)().tobytes() == a[1:3].tobytes()


def _parts(tmp_path, sizes, d=3, dtype="float32"):
    out, start = [], 0
    for k, n in enumerate(sizes):
        a = np.arange(start * d, (start + n) * d, dtype=dtype).reshape(n, d)
        np.save(tmp_path / f"{k}.npy", a)
        out.append(a)
        start += n
    return out


def test_several_files_in_natural_order_and_chunks_never_span_two(tmp_path):
    # 12 files, so that "10.npy" sorts after "2.npy" only in natural order.
    sizes = [70, 0, 30, 5, 64, 64, 1, 2, 3, 4, 50, 6]
    parts = _parts(tmp_path, sizes)
    whole = np.concatenate(parts)
    for path in (tmp_path, str(tmp_path / "*.npy"), [tmp_path / f"{k}.npy" for k in range(12)]):
        arr = rh_dask.read_npy(path, chunk_rows=32)
        assert arr.shape == whole.shape
        want = [min(32, n - s) for n in sizes for s in range(0, n, 32)]
        assert list(arr.chunks[0]) == want
        assert arr.compute().tobytes() == whole.tobytes()
    first = [str(tmp_path / f"{k}.npy") for k in range(3)]
    assert rh_dask.readers.npy_files(tmp_path)[:3] == first
    # A list keeps its own order.
    arr = rh_dask.read_npy([tmp_path / "2.npy", tmp_path / "0.npy"], chunk_rows=100)
    assert arr.compute().tobytes() == np.concatenate([parts[2], parts[0]]).tobytes()


def test_files_that_do_not_match_the_first_are_refused_naming_them(tmp_path):
    _parts(tmp_path, [10, 10])
    np.save(tmp_path / "2.npy", np.zeros((10, 4), dtype="float32"))
    with pytest.raises(InputError, match=r"2\.npy.*shape past the rows") as info:
        rh_dask.read_npy(tmp_path)
    assert info.value.path.endswith("2.npy")
    np.save(tmp_path / "2.npy", np.zeros((10, 3), dtype="float64"))
    with pytest.raises(InputError, match=r"2\.npy.*float64"):
        rh_dask.read_npy(tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(InputError, match=r"no \.npy files in directory"):
        rh_dask.read_npy(empty)
    with pytest.raises(InputError, match="no file matches"):
        rh_dask.read_npy(str(tmp_path / "nothing-*.npy"))
    with pytest.raises(InputError, match="at least one path"):
        rh_dask.read_npy([])
