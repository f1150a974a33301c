"""as_row_major: column-major batches copied exactly into the engines' row-major layout."""

from __future__ import annotations

import numpy as np
import pytest

from rh_dask import row_major
from rh_dask.row_major import as_row_major


@pytest.fixture
def blocked(monkeypatch):
    """Limits small enough that small arrays take the copy by blocks of rows."""
    monkeypatch.setattr(row_major, "MIN_BYTES", 1)
    monkeypatch.setattr(row_major, "MIN_COLUMNS", 2)
    monkeypatch.setattr(row_major, "BLOCK_BYTES", 7 * 5 * 8)  # 7 rows of 5 float64


def test_a_row_major_array_is_returned_as_it_is():
    a = np.ones((4, 3), dtype=np.float32)
    assert as_row_major(a) is a


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize(
    "view",
    [
        lambda a: np.asfortranarray(a),
        lambda a: a[::2],
        lambda a: a[:, ::2],
        lambda a: np.asfortranarray(a)[3:40, 1:],
        lambda a: a[:, 0],
    ],
    ids=["fortran", "every-other-row", "every-other-column", "fortran-slice", "one-column"],
)
def test_copies_are_exact_by_blocks_and_otherwise(blocked, monkeypatch, dtype, view):
    rng = np.random.default_rng(3)
    a = view(rng.standard_normal((50, 5)).astype(dtype))
    expected = np.ascontiguousarray(a)
    for block_bytes in (row_major.BLOCK_BYTES, 8, 1 << 20):  # many blocks, one row, one block
        monkeypatch.setattr(row_major, "BLOCK_BYTES", block_bytes)
        out = as_row_major(a)
        assert out.flags.c_contiguous and out.dtype == a.dtype
        assert not np.shares_memory(out, a)
        np.testing.assert_array_equal(out, expected)


def test_large_fortran_batches_take_the_blocked_copy(monkeypatch):
    calls = []
    real = np.empty

    def recording_empty(*args, **kwargs):
        calls.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(row_major.np, "empty", recording_empty)
    a = np.asfortranarray(np.arange(70_000 * 64, dtype=np.float32).reshape(70_000, 64))
    assert a.nbytes >= row_major.MIN_BYTES
    np.testing.assert_array_equal(as_row_major(a), np.ascontiguousarray(a))
    assert calls == [(70_000, 64)]
    calls.clear()
    small = np.asfortranarray(np.ones((100, 64), np.float32))  # below MIN_BYTES: NumPy's copy
    assert as_row_major(small).flags.c_contiguous and calls == []
