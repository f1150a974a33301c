"""Data on disk as Dask collections: the readers and writers of the command line.

Inputs, by format (detected from the path, or given explicitly):

======== ======================================================= ===============================
format   what the path names                                     read with
======== ======================================================= ===============================
parquet  a file, a directory of files, or a glob                 :func:`rh_dask.read_parquet`
csv      a file or a glob                                        ``dask.dataframe.read_csv``
zarr     a store holding one 2-D array, or a group of arrays     :func:`rh_dask.read_zarr`
npy      a 2-D ``.npy`` file, a glob of them, or a directory     memory-mapped, one task a chunk
======== ======================================================= ===============================

Tables (Parquet, CSV) select columns by name and keep the feature names; 2-D
arrays select columns by position (``3``, ``-1``, ``0:20``); a Zarr group
selects arrays by name (a 2-D array contributes all its columns). The row
chunks of the result are the batches of the stream: the partitions of a
table, the chunks of a Zarr array, 65,536-row slices of ``.npy`` files, or
exactly ``chunk_rows`` rows when that is given.

Nothing is read here beyond metadata (every Parquet file's footer, checked
by the reader): every collection is lazy.
"""

from __future__ import annotations

import glob
import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from dask.utils import natural_sort_key

from ..exceptions import InputError
from ..readers import check_exclude, parquet_files, read_parquet, read_zarr
from ..readers import select_columns as _select_columns
from .extras import require

__all__ = [
    "DEFAULT_NPY_CHUNK_ROWS",
    "INPUT_FORMATS",
    "OUTPUT_FORMATS",
    "InputError",
    "NpyRows",
    "Table",
    "detect_format",
    "input_files",
    "open_table",
    "write_predictions",
]

INPUT_FORMATS = ("parquet", "csv", "zarr", "npy")
OUTPUT_FORMATS = {".parquet": "parquet", ".pq": "parquet", ".csv": "csv", ".npy": "npy"}
#: Rows per chunk of ``.npy`` input when ``chunk_rows`` is not given (a file has no chunks).
DEFAULT_NPY_CHUNK_ROWS = 65_536

_SUFFIXES = (
    (".parquet", "parquet"),
    (".pq", "parquet"),
    (".csv", "csv"),
    (".csv.gz", "csv"),
    (".csv.bz2", "csv"),
    (".zarr", "zarr"),
    (".npy", "npy"),
)
_ZARR_MARKERS = ("zarr.json", ".zarray", ".zgroup")


@dataclass
class Table:
    """Features, target and weights of one input, as lazy Dask collections.

    Attributes
    ----------
    X : dask.array.Array or dask.dataframe.DataFrame
        Features; its row chunks (partitions) are the batches.
    y : dask.array.Array, dask.dataframe.Series or None
        Target, chunked like ``X`` (``None`` when no target was asked for).
    sample_weight : like ``y``, or None
    feature_names : list of str
        Names for display: the columns of a table, ``x<j>`` for column ``j``
        of a 2-D array, ``<array>`` or ``<array>[j]`` for a Zarr group.
    named : bool
        Whether ``X`` carries ``feature_names`` itself (a DataFrame), so that
        a model fitted on it records them.
    description : dict
        JSON-ready facts for reports: format, paths, chunks, rows when known.
    frame : dask.dataframe.DataFrame or None
        For tables: features, target and weight in one DataFrame (see
        :meth:`fit_inputs`).
    """

    X: Any
    y: Any | None
    sample_weight: Any | None
    feature_names: list[str]
    named: bool
    description: dict[str, Any] = field(default_factory=dict)
    frame: Any | None = None

    @property
    def n_chunks(self) -> int:
        """Row chunks (partitions) of the stream."""
        return chunk_count(self.X)

    def fit_inputs(self) -> tuple[Any, Any, Any]:
        """``(X, y, sample_weight)`` to hand to ``fit``.

        A table gives one DataFrame holding the target (and weight) columns,
        with ``y``/``sample_weight`` as their names, so that each chunk is
        read once rather than once per collection. Arrays give the three
        slices of one array (they share its read tasks).
        """
        if self.frame is not None and self.y is not None:
            weight = None if self.sample_weight is None else self.sample_weight.name
            return self.frame, self.y.name, weight
        return self.X, self.y, self.sample_weight


def _is_array(collection: Any) -> bool:
    import dask.array as da

    return isinstance(collection, da.Array)


def chunk_count(collection: Any) -> int:
    """Row chunks of a Dask array, or partitions of a Dask DataFrame/Series."""
    if _is_array(collection):
        return int(collection.numblocks[0])
    return int(collection.npartitions)


# -- locating and recognising inputs ---------------------------------------------------------
def _is_url(path: str) -> bool:
    return "://" in path


def detect_format(path: str) -> str:
    """The input format of ``path`` from its suffix, or from what a directory holds.

    Raises
    ------
    InputError
        When neither the name nor the content says.
    """
    name = path.rstrip("/").lower()
    for suffix, fmt in sorted(_SUFFIXES, key=lambda s: -len(s[0])):
        if name.endswith(suffix):
            return fmt
    if not _is_url(path) and os.path.isdir(path):
        entries = os.listdir(path)
        if any(marker in entries for marker in _ZARR_MARKERS):
            return "zarr"
        for suffix, fmt in _SUFFIXES:
            if any(e.lower().endswith(suffix) for e in entries):
                return fmt
    raise InputError(
        f"cannot tell the format of {path!r} from its name; use --format "
        f"({', '.join(INPUT_FORMATS)})"
    )


def _local_paths(path: str, fmt: str) -> list[str]:
    """Files (or the store) that ``path`` names, globs expanded.

    Files come in natural order (``part.2`` before ``part.10``), the order in
    which dask itself lists datasets, so every format agrees. Parquet inputs
    are listed by :func:`rh_dask.readers.parquet_files` (dataset directories
    walked, URLs too).
    """
    if fmt == "parquet":
        return parquet_files(path)
    if _is_url(path):
        return [path]
    if glob.has_magic(path):
        matches = sorted(glob.glob(path), key=natural_sort_key)
        if not matches:
            raise InputError(f"no file matches {path!r}")
        return matches
    if not os.path.exists(path):
        raise InputError(f"no such file or directory: {path!r}")
    if fmt == "npy" and os.path.isdir(path):
        matches = sorted(glob.glob(os.path.join(path, "*.npy")), key=natural_sort_key)
        if not matches:
            raise InputError(f"no .npy files in directory {path!r}")
        return matches
    return [path]


def input_files(path: str | os.PathLike[str], fmt: str | None = None) -> list[str]:
    """The files an input is made of: globs expanded, Parquet directories listed.

    A Zarr store counts as one file, and so does a URL of another format
    than Parquet (it is not listed).

    Raises
    ------
    InputError
        When nothing matches, or the format cannot be told.
    """
    path = os.fspath(path)
    fmt = fmt or detect_format(path)
    return _local_paths(path, fmt)


# -- column selection ---------------------------------------------------------------------
def _check_numeric(frame: Any, columns: Sequence[str], where: str) -> None:
    import pandas as pd

    for name in columns:
        dtype = frame.dtypes[name]
        if not (pd.api.types.is_numeric_dtype(dtype) or pd.api.types.is_bool_dtype(dtype)):
            raise InputError(
                f"column {name!r} of {where} has dtype {dtype}, not numbers; "
                "choose the numeric columns with --features"
            )


# -- tables --------------------------------------------------------------------------------
def _pandas_major() -> int:
    import pandas as pd

    return int(pd.__version__.split(".")[0])


def _read_frame(paths: list[str], fmt: str, path: str, columns: list[str] | None) -> Any:
    # dask.dataframe itself needs pyarrow: check first, to say so in one line.
    require("pyarrow", "io", f"reading {'Parquet' if fmt == 'parquet' else 'CSV'}")
    import dask.dataframe as dd

    if fmt == "parquet":
        # The reader checks every file's footer, schema and the asked columns.
        return read_parquet(paths, columns)
    compressed = any(p.lower().endswith((".gz", ".bz2")) for p in paths)
    try:
        # assume_missing: integer-looking columns become float64 in every block,
        # so a block with a missing value cannot disagree with the inferred dtype.
        # Floats parsed exactly: before pandas 3 the default parser may miss the
        # written value by an ulp (pandas 3 parses exactly and deprecates the option).
        exact = {"float_precision": "round_trip"} if _pandas_major() < 3 else {}
        return dd.read_csv(
            paths, assume_missing=True, blocksize=None if compressed else "64MB", **exact
        )
    except (OSError, ValueError) as exc:
        raise InputError(f"cannot read {path!r} as CSV: {exc}") from exc


def _csv_has_rows(path: str) -> bool:
    """Whether a CSV file holds a row below its header (reads its first lines only)."""
    import pandas as pd

    try:
        return len(pd.read_csv(path, nrows=1)) > 0
    except pd.errors.EmptyDataError:  # not even a header
        return False


def _refuse_header_only(paths: list[str], path: str) -> None:
    """Say that the CSV input has no rows, when a non-numeric column comes from that.

    dask infers the column types from the first file; a file of a header
    alone gives text columns, which would otherwise be reported as "not
    numbers". Called only when a column is not numeric, so good inputs pay
    nothing for it.
    """
    if _is_url(paths[0]) or _csv_has_rows(paths[0]):
        return
    if len(paths) == 1:
        raise InputError(f"{paths[0]!r} has no rows: it holds a header only")
    if not any(_csv_has_rows(p) for p in paths[1:]):
        raise InputError(f"{path!r} has no rows: its {len(paths)} files hold a header only")
    raise InputError(
        f"{paths[0]!r}, the first file of {path!r}, has no rows (a header only), and the "
        "column types are read from the first file; leave it out of the input"
    )


def _frame_table(
    frame: Any,
    path: str,
    target: str | None,
    features: Sequence[str] | None,
    weight: str | None,
    exclude: Sequence[str],
    chunk_rows: int | None,
    paths: list[str],
    fmt: str,
) -> Table:
    columns = [str(c) for c in frame.columns]
    for role, name in (("target", target), ("weight", weight)):
        if name is not None and name not in columns:
            raise InputError(f"{role} column {name!r} is not in {path!r} (columns: {columns})")
    exclude = [str(c) for c in exclude]
    if features is None:
        skip = {target, weight, *exclude}
        features = [c for c in columns if c not in skip]
    else:
        features = [str(f) for f in features]
        missing = [f for f in features if f not in columns]
        if missing:
            raise InputError(f"feature columns {missing} are not in {path!r} (columns: {columns})")
    check_exclude(exclude, features, columns, repr(path))
    if not features:
        raise InputError(f"{path!r} has no feature columns left besides the target and weight")
    roles = [c for c in (target, weight) if c is not None]
    if set(roles) & set(features):
        raise InputError(f"the target and weight columns cannot also be features: {roles}")
    try:
        _check_numeric(frame, [*features, *roles], repr(path))
    except InputError:
        if fmt == "csv":
            _refuse_header_only(paths, path)
        raise
    if chunk_rows is not None:
        import dask.dataframe as dd

        # Exact row counts per batch: go through an array (partition lengths are
        # counted once) and come back to a frame so the feature names stay.
        selected = [*features, *roles]
        rows = frame[selected].to_dask_array(lengths=True).rechunk((chunk_rows, -1))
        frame = dd.from_dask_array(rows, columns=selected)
    selected = [*features, *roles]
    return Table(
        X=frame[features],
        y=None if target is None else frame[target],
        sample_weight=None if weight is None else frame[weight],
        feature_names=list(features),
        named=True,
        frame=frame[selected],
    )


# -- arrays --------------------------------------------------------------------------------
class NpyRows:
    """A ``.npy`` file as a lazily sliced array (what :func:`dask.array.from_array` reads).

    Only the path and the header travel with a task; each chunk memory-maps
    the file on the worker and copies out its rows, so reading never needs
    the whole file in memory and no data goes through the scheduler.
    """

    def __init__(self, path: str) -> None:
        try:
            mapped = np.load(path, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError) as exc:
            raise InputError(f"cannot read {path!r} as .npy: {exc}") from exc
        self.path = str(path)
        self.shape: tuple[int, ...] = tuple(mapped.shape)
        self.dtype = mapped.dtype
        self.ndim = mapped.ndim
        stat = os.stat(path)
        self._token = (self.path, stat.st_size, stat.st_mtime_ns)

    def __getitem__(self, key: Any) -> np.ndarray:
        return np.array(np.load(self.path, mmap_mode="r", allow_pickle=False)[key])

    def __dask_tokenize__(self) -> tuple[Any, ...]:
        return ("rh-dask-npy", *self._token)


def _npy_array(paths: list[str], chunk_rows: int | None) -> Any:
    import dask.array as da

    pieces = []
    width = None
    for path in paths:
        rows = NpyRows(path)
        if rows.ndim != 2 or rows.dtype.kind not in "biuf":
            raise InputError(
                f"{path!r} holds a {rows.ndim}-D {rows.dtype} array; .npy input must be 2-D "
                "numbers with the target as one of the columns"
            )
        if width is not None and rows.shape[1] != width:
            raise InputError(f"{path!r} has {rows.shape[1]} columns, the files before {width}")
        width = rows.shape[1]
        step = chunk_rows or DEFAULT_NPY_CHUNK_ROWS
        pieces.append(
            da.from_array(
                rows, chunks=(step, -1), meta=np.empty((0, 0), rows.dtype), inline_array=False
            )
        )
    array = pieces[0] if len(pieces) == 1 else da.concatenate(pieces, axis=0)
    if chunk_rows is not None and len(pieces) > 1:
        array = array.rechunk((chunk_rows, -1))
    return array


def _table(stream: Any) -> Table:
    return Table(
        X=stream.X,
        y=stream.y,
        sample_weight=stream.sample_weight,
        feature_names=list(stream.feature_names),
        named=False,
    )


def _matrix_table(
    array: Any,
    path: str,
    target: str | None,
    features: Sequence[str] | None,
    weight: str | None,
    exclude: Sequence[str],
    chunk_rows: int | None,
) -> Table:
    stream = _select_columns(
        array,
        path,
        target=target,
        features=features,
        weight=weight,
        exclude=exclude,
        chunk_rows=chunk_rows,
    )
    return _table(stream)


def _zarr_table(
    path: str,
    target: str | None,
    features: Sequence[str] | None,
    weight: str | None,
    exclude: Sequence[str],
    chunk_rows: int | None,
) -> Table:
    require("zarr", "io", "reading Zarr")
    stream = read_zarr(
        path,
        target=target,
        features=features,
        weight=weight,
        exclude=exclude,
        chunk_rows=chunk_rows,
    )
    return _table(stream)


# -- the entry point -----------------------------------------------------------------------
def open_table(
    path: str | os.PathLike[str],
    *,
    target: str | None = None,
    features: Sequence[str] | None = None,
    weight: str | None = None,
    exclude: Sequence[str] = (),
    chunk_rows: int | None = None,
    fmt: str | None = None,
) -> Table:
    """Open ``path`` lazily as features, target and weights.

    Parameters
    ----------
    path : str or path-like
        A file, a directory, a glob (quote it in a shell) or a URL that dask
        reads (``s3://...`` needs the matching fsspec package).
    target : str, optional
        Column name (tables, Zarr groups) or position (2-D arrays) of ``y``;
        ``None`` reads features only (prediction).
    features : sequence of str, optional
        Feature columns; default: every column that is not the target, the
        weight or in ``exclude``.
    weight : str, optional
        Column of frequency weights.
    exclude : sequence of str
        Columns left out of the default feature set (an id column, say).
        Every name must be a column of the input, and none may also be in
        ``features``.
    chunk_rows : int, optional
        Re-cut the stream into batches of exactly this many rows (the last one
        shorter). For tables this counts the rows of every partition first.
    fmt : {"parquet", "csv", "zarr", "npy"}, optional
        Override the format detected from ``path``.

    Raises
    ------
    InputError
        Missing files, unknown columns (features, target, weight or
        ``exclude``), non-numeric columns, a CSV input without rows, unknown
        format.
    MissingExtraError
        When the reader of the format is not installed.
    """
    path = os.fspath(path)
    if chunk_rows is not None and chunk_rows < 1:
        raise InputError(f"chunk_rows must be >= 1, got {chunk_rows}")
    fmt = fmt or detect_format(path)
    if fmt not in INPUT_FORMATS:
        raise InputError(f"unknown input format {fmt!r}; choose one of {INPUT_FORMATS}")
    paths = _local_paths(path, fmt)
    if fmt in ("parquet", "csv"):
        columns = None
        if features is not None:  # read only these columns
            named = [*features, target, weight]
            columns = list(dict.fromkeys(str(c) for c in named if c is not None))
        frame = _read_frame(paths, fmt, path, columns)
        table = _frame_table(
            frame, path, target, features, weight, exclude, chunk_rows, paths, fmt
        )
    elif fmt == "zarr":
        if len(paths) != 1:
            raise InputError(f"{path!r} matches {len(paths)} Zarr stores; give one store")
        table = _zarr_table(paths[0], target, features, weight, exclude, chunk_rows)
    else:
        table = _matrix_table(
            _npy_array(paths, chunk_rows), path, target, features, weight, exclude, chunk_rows
        )
    table.description = {
        "path": path,
        "format": fmt,
        "files": len(input_files(path, fmt)),
        "chunks": table.n_chunks,
        "chunk_rows": chunk_rows,
        "rows": _known_rows(table.X),
        "features": list(table.feature_names),
        "target": target,
        "weight": weight,
        "exclude": [str(c) for c in exclude],
    }
    return table


def _known_rows(X: Any) -> int | None:
    """Row count when the collection knows it without reading data."""
    if not _is_array(X):
        return None
    rows = X.shape[0]
    return None if rows is None or rows != rows else int(rows)  # NaN: unknown chunks


# -- writing predictions ----------------------------------------------------------------------
def output_format(path: str | os.PathLike[str]) -> str:
    """The prediction output format from ``path``'s suffix.

    Raises
    ------
    InputError
        For a suffix other than ``.parquet``/``.pq``, ``.csv`` or ``.npy``.
    """
    suffix = Path(path).suffix.lower()
    if suffix not in OUTPUT_FORMATS:
        raise InputError(
            f"cannot write predictions to {os.fspath(path)!r}: the name must end in one of "
            f"{', '.join(OUTPUT_FORMATS)}"
        )
    return OUTPUT_FORMATS[suffix]


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def write_predictions(
    predictions: Any,
    path: str | os.PathLike[str],
    *,
    column: str = "prediction",
    overwrite: bool = False,
    window: int = 4,
) -> dict[str, Any]:
    """Write a lazy 1-D Dask array of predictions, chunk by chunk, in row order.

    ``.parquet``/``.pq`` writes a Parquet dataset (a directory, one file per
    chunk); ``.csv`` one CSV file with a header; ``.npy`` one ``.npy`` file.
    Memory stays bounded by a few chunks whatever the length.

    Parameters
    ----------
    predictions : dask.array.Array
    path : str or path-like
    column : str
        Column name in Parquet and CSV output.
    overwrite : bool
        Replace an existing file or directory at ``path``.
    window : int
        Chunks computed at once when writing ``.npy``.

    Returns
    -------
    dict
        ``path``, ``format`` and ``rows`` written.
    """
    fmt = output_format(path)
    target = Path(path)
    if target.exists() and not overwrite:
        raise InputError(f"{os.fspath(path)!r} exists; pass --overwrite to replace it")
    if not target.parent.is_dir():
        raise InputError(f"the directory of {os.fspath(path)!r} does not exist")
    _remove(target)
    if fmt == "npy":
        rows = _write_npy(predictions, target, window)
    else:
        import dask.dataframe as dd

        frame = dd.from_dask_array(predictions, columns=column).to_frame()
        if fmt == "parquet":
            # Zero-padded names: readers that sort file names keep the row order.
            width = len(str(frame.npartitions))
            frame.to_parquet(
                target,
                write_index=False,
                name_function=lambda i: f"part-{i:0{width}d}.parquet",
            )
        else:
            frame.to_csv(target, single_file=True, index=False)
        rows = None
    return {"path": os.fspath(target), "format": fmt, "rows": rows}


def _write_npy(predictions: Any, path: Path, window: int) -> int:
    """Stream chunks to a raw file, then wrap it in a ``.npy`` header.

    The row count is only known once every chunk has been computed (tables
    have unknown partition lengths), and a ``.npy`` header states the shape
    up front: so the values go to a side file first and are copied behind
    the header in slices. The copy is one column, small next to the input.
    """
    import dask

    blocks = list(predictions.to_delayed().ravel())
    dtype = np.dtype(predictions.dtype)
    raw = path.with_name(path.name + ".part")
    rows = 0
    try:
        with open(raw, "wb") as sink:
            for start in range(0, len(blocks), max(1, window)):
                for block in dask.compute(*blocks[start : start + window]):
                    values = np.ascontiguousarray(block, dtype=dtype).reshape(-1)
                    sink.write(values.tobytes())
                    rows += values.size
        out = np.lib.format.open_memmap(path, mode="w+", dtype=dtype, shape=(rows,))
        source = np.memmap(raw, dtype=dtype, mode="r", shape=(rows,)) if rows else None
        step = 1 << 22
        for start in range(0, rows, step):
            out[start : start + step] = source[start : start + step]
        out.flush()
        del out, source
    finally:
        raw.unlink(missing_ok=True)
    return rows
