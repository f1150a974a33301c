"""Copying a column-major batch into the row-major layout the engines take.

Columnar sources hand over a batch column by column: a pandas frame built
from Parquet holds its float columns as one ``(features, rows)`` block, so
its ``to_numpy()`` is a Fortran-ordered view. The engines take C-ordered
``X``, and NumPy's transposing copy of a batch larger than the CPU's caches
runs at a fraction of memory speed, because every element it writes reads
from another cache line. Copying one column at a time, in blocks of rows
whose row-major copy stays in a core's cache, writes each destination line
while it is cached and reads every source column contiguously.

Measured on the 2-core dev box (AMD EPYC, 8 MiB L3), median of 7, ms per
copy of a Fortran-ordered array: 65,536 × 90 float32 59.7 → 21.1,
float64 88.9 → 32.8; 262,144 × 90 float32 262 → 102; 32,768 × 256 float32
121 → 51. Where the array stays in cache (20,000 × 90 float32: 2.6 ms
against 7.0) or rows are short (500,000 × 10: 0.82-1.02×), NumPy's own
copy is as fast or faster; at 16,384 × 512 the gain was gone (float32
1.30×, float64 0.93×). Hence the limits below. The copy is exact either
way, so the choice never changes a result.
"""

from __future__ import annotations

import numpy as np

__all__ = ["BLOCK_BYTES", "MAX_COLUMNS", "MIN_BYTES", "MIN_COLUMNS", "as_row_major"]

#: Arrays of fewer bytes take NumPy's copy (they fit the last-level cache of common CPUs).
MIN_BYTES = 16 << 20
#: Column counts outside [MIN_COLUMNS, MAX_COLUMNS] take NumPy's copy (measured above).
MIN_COLUMNS = 16
MAX_COLUMNS = 256
#: Bytes of the row-major destination per block of rows.
BLOCK_BYTES = 1 << 20


def as_row_major(a: np.ndarray) -> np.ndarray:
    """``a`` as a C-ordered array: ``a`` itself when it is one, else an exact copy.

    Parameters
    ----------
    a : numpy.ndarray
        Any array; 2-D arrays of many rows are copied column by column in
        blocks of rows (see the module's notes), others with
        :func:`numpy.ascontiguousarray`.

    Returns
    -------
    numpy.ndarray
        C-contiguous, same dtype and values.
    """
    if a.flags.c_contiguous:
        return a
    if a.ndim != 2 or a.nbytes < MIN_BYTES or not MIN_COLUMNS <= a.shape[1] <= MAX_COLUMNS:
        return np.ascontiguousarray(a)
    n, d = a.shape
    out = np.empty((n, d), dtype=a.dtype)
    rows = max(1, BLOCK_BYTES // (d * a.itemsize))
    for start in range(0, n, rows):
        dst, src = out[start : start + rows], a[start : start + rows]
        for j in range(d):
            dst[:, j] = src[:, j]
    return out
