"""How many rows an input holds, from metadata alone.

``--scheduler auto`` runs a small job in this process, because starting a
local cluster costs seconds that a small fit does not need. Deciding must
itself be cheap, so nothing here reads data: arrays know their shape
(``.npy`` headers, Zarr metadata), Parquet files state their row count in
their footers, and an uncompressed CSV file's rows are estimated from its
size and the length of its first lines. A compressed CSV file or a URL has
no cheap count: the answer is "unknown", and the caller starts a cluster.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from .io import Table

__all__ = ["RowCount", "input_rows"]

#: Bytes read from the start of a CSV file to measure its line length.
_CSV_SAMPLE_BYTES = 1 << 16


@dataclass(frozen=True)
class RowCount:
    """Rows of an input.

    Attributes
    ----------
    rows : int
        The count; with ``limit`` reached, a lower bound.
    exact : bool
        Counted (array shapes, Parquet footers) rather than estimated (CSV).
    """

    rows: int
    exact: bool

    def __str__(self) -> str:
        return f"{self.rows:,}" if self.exact else f"about {self.rows:,}"


def _parquet_rows(files: list[str], limit: int | None) -> RowCount:
    import pyarrow.parquet as pq

    rows = 0
    for path in files:
        rows += pq.read_metadata(path).num_rows
        if limit is not None and rows >= limit:
            break
    return RowCount(rows, exact=True)


def _csv_rows(files: list[str]) -> RowCount | None:
    if any(p.lower().endswith((".gz", ".bz2", ".xz", ".zst", ".zip")) for p in files):
        return None
    with open(files[0], "rb") as handle:
        sample = handle.read(_CSV_SAMPLE_BYTES)
    whole = len(sample) == os.path.getsize(files[0])
    if not whole:  # the last line of the sample is cut: measure complete lines only
        sample = sample[: sample.rfind(b"\n") + 1]
    header, _, rows = sample.partition(b"\n")
    n_rows = sum(1 for line in rows.splitlines() if line.strip())
    body = sum(max(os.path.getsize(p) - len(header) - 1, 0) for p in files)
    if n_rows == 0:
        # A header alone, or lines longer than the sample: at least a sample per row.
        return RowCount(0 if whole and len(files) == 1 else body // _CSV_SAMPLE_BYTES, False)
    return RowCount(round(body * n_rows / len(rows)), exact=False)


def input_rows(table: Table, files: list[str], limit: int | None = None) -> RowCount | None:
    """The rows of ``table``'s input, or ``None`` when no cheap count exists.

    Parameters
    ----------
    table : Table
        The opened input (:func:`rh_dask.app.io.open_table`).
    files : list of str
        Its files (:func:`rh_dask.app.io.input_files`).
    limit : int, optional
        Stop counting Parquet footers once this many rows are reached.
    """
    known = table.description.get("rows")
    if known is not None:
        return RowCount(int(known), exact=True)
    if not files or any("://" in p for p in files):
        return None
    fmt = table.description.get("format")
    if fmt == "parquet":
        return _parquet_rows(files, limit)
    if fmt == "csv":
        return _csv_rows(files)
    return None
