"""Readers for the formats data is kept in: Parquet datasets, Zarr stores, ``.npy`` files.

Each returns lazy Dask collections whose row chunks are the batches of a
stream, ready for :meth:`RenewableHuberRegressor.fit
<rh_dask.RenewableHuberRegressor.fit>`:

* :func:`read_parquet` gives a Dask DataFrame, one partition per file or per
  run of row groups. Before it returns it reads every file's footer and
  refuses a dataset with a corrupt file, a file whose schema differs from
  the first file's, or a requested column missing from a file, naming the
  file, so that a bad dataset fails before any chunk is fitted.
* :func:`read_zarr` gives the features, target and weights of a Zarr store
  (v2 or v3) holding one 2-D array or a group of arrays, chunked along rows
  as the store is.
* :func:`read_npy` gives the arrays of local, row-major ``.npy`` files one
  after another in chunks of rows, each read with one ``pread``; a loading
  worker relaying such chunks over TCP sends them from the page cache with
  ``sendfile``.

Parquet and Zarr paths may be fsspec URLs (``s3://``, ``gs://``,
``memory://``, ``file://``); ``storage_options`` go to the filesystem.
Nothing beyond metadata is read.
"""

from __future__ import annotations

import glob as _glob
import importlib
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np
from dask.base import tokenize
from dask.utils import natural_sort_key, parse_bytes

from .exceptions import InputError, MissingExtraError

__all__ = [
    "DEFAULT_NPY_CHUNK_ROWS",
    "PARQUET_CHUNKS",
    "ArrayStream",
    "npy_files",
    "parquet_files",
    "read_npy",
    "read_parquet",
    "read_zarr",
    "select_columns",
]

#: The values of :func:`read_parquet`'s ``chunks``.
PARQUET_CHUNKS = ("auto", "file", "row-group")
#: Footers read at once (they are small reads, so latency bound on remote stores).
_FOOTER_THREADS = 16
#: Rows per chunk of :func:`read_npy` when ``chunk_rows`` is not given.
DEFAULT_NPY_CHUNK_ROWS = 65_536
#: Parquet files' extensions are not required: what is not data starts with these.
_HIDDEN = ("_", ".")


def _require(module: str, purpose: str) -> ModuleType:
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingExtraError(
            f"{purpose} needs {module}, which is not installed: pip install 'rh-dask[io]'"
        ) from exc


# -- Parquet: listing ------------------------------------------------------------------------
def _filesystem(path: str, storage_options: dict[str, Any] | None) -> tuple[Any, str]:
    import fsspec

    try:
        return fsspec.core.url_to_fs(path, **(storage_options or {}))
    except (ImportError, ValueError) as exc:  # an unknown protocol, or its package missing
        raise InputError(f"cannot open {path!r}: {exc}", path=path) from exc


def _is_local(fs: Any) -> bool:
    """Whether ``fs`` is the local filesystem."""
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    return protocol in ("file", "local")


def _shown(fs: Any, path: str) -> str:
    """The name a file is reported and read by: a URL unless it is a local file."""
    return path if _is_local(fs) else fs.unstrip_protocol(path)


def _dataset_members(fs: Any, root: str) -> list[str]:
    """Data files under a dataset directory (partition directories walked).

    A file or directory whose name starts with ``_`` or ``.`` is not data
    (``_metadata``, ``_SUCCESS``, ``.crc`` files), as in pyarrow's discovery.
    """
    base = root.rstrip("/")
    found = []
    for name in fs.find(base):
        relative = name[len(base) :].lstrip("/")
        if not any(part.startswith(_HIDDEN) for part in relative.split("/")):
            found.append(name)
    return found


def parquet_files(
    path: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    *,
    storage_options: dict[str, Any] | None = None,
) -> list[str]:
    """The data files of a Parquet input, in natural order of their names.

    Parameters
    ----------
    path : str, path-like or sequence of them
        A file, a dataset directory (partition subdirectories are walked;
        names starting with ``_`` or ``.`` are not data), a glob, or an fsspec
        URL of any of these; or a list of them.
    storage_options : dict, optional
        Options of the fsspec filesystem (credentials, endpoint).

    Returns
    -------
    list of str
        Local paths, or URLs for remote filesystems; ``part.2`` before
        ``part.10``.

    Raises
    ------
    InputError
        When a path does not exist, a glob matches nothing or a directory
        holds no data file.
    """
    entries = [path] if isinstance(path, (str, os.PathLike)) else list(path)
    if not entries:
        raise InputError("no Parquet path given")
    files: list[str] = []
    for entry in entries:
        entry = os.fspath(entry)
        fs, stripped = _filesystem(entry, storage_options)
        if _glob.has_magic(stripped):
            matches = [m for m in fs.glob(stripped) if not fs.isdir(m)]
            if not matches:
                raise InputError(f"no file matches {entry!r}", path=entry)
            files += [_shown(fs, m) for m in matches]
        elif fs.isdir(stripped):
            members = _dataset_members(fs, stripped)
            if not members:
                raise InputError(f"the directory {entry!r} holds no Parquet files", path=entry)
            files += [_shown(fs, m) for m in members]
        elif fs.exists(stripped):
            files.append(_shown(fs, stripped))
        else:
            raise InputError(f"no such file or directory: {entry!r}", path=entry)
    return sorted(dict.fromkeys(files), key=natural_sort_key)


# -- Parquet: footers ------------------------------------------------------------------------
@dataclass(frozen=True)
class _Footer:
    path: str
    fields: tuple[tuple[str, str], ...]  # (name, arrow type) of every column, in file order
    partition_keys: frozenset[str]  # hive partition keys in the path (key=value)
    row_group_bytes: tuple[dict[str, int], ...]  # uncompressed bytes per column, per group
    rows: int


def _partition_keys(path: str) -> frozenset[str]:
    return frozenset(
        part.split("=", 1)[0] for part in path.split("/")[:-1] if "=" in part.strip("=")
    )


def _read_footer(path: str, storage_options: dict[str, Any] | None) -> _Footer:
    import pyarrow as pa
    import pyarrow.parquet as pq

    fs, stripped = _filesystem(path, storage_options)
    try:
        with fs.open(stripped, "rb") as handle:
            meta = pq.read_metadata(handle)
        schema = meta.schema.to_arrow_schema()
    except (OSError, ValueError, pa.ArrowException) as exc:
        raise InputError(
            f"{path!r} is not a readable Parquet file (corrupt or truncated footer): {exc}",
            path=path,
        ) from exc
    groups = []
    for g in range(meta.num_row_groups):
        group = meta.row_group(g)
        sizes: dict[str, int] = {}
        for c in range(group.num_columns):
            column = group.column(c)
            top = column.path_in_schema.split(".", 1)[0]
            sizes[top] = sizes.get(top, 0) + int(column.total_uncompressed_size)
        groups.append(sizes)
    return _Footer(
        path=path,
        fields=tuple((f.name, str(f.type)) for f in schema),
        partition_keys=_partition_keys(path),
        row_group_bytes=tuple(groups),
        rows=int(meta.num_rows),
    )


def _footers(files: list[str], storage_options: dict[str, Any] | None) -> list[_Footer]:
    """Every file's footer, read on a small thread pool; the first bad file (in order) raises."""
    if len(files) == 1:
        return [_read_footer(files[0], storage_options)]
    with ThreadPoolExecutor(max_workers=min(_FOOTER_THREADS, len(files))) as pool:
        futures = [pool.submit(_read_footer, f, storage_options) for f in files]
        return [future.result() for future in futures]


def _schema_difference(first: _Footer, other: _Footer) -> str:
    mine, theirs = dict(first.fields), dict(other.fields)
    missing = [n for n in mine if n not in theirs]
    extra = [n for n in theirs if n not in mine]
    parts = []
    if missing:
        parts.append(f"it lacks columns {missing}")
    if extra:
        parts.append(f"it has columns {extra} the first file does not")
    for name in mine:
        if name in theirs and mine[name] != theirs[name]:
            parts.append(f"column {name!r} is {theirs[name]}, not {mine[name]}")
    return "; ".join(parts)


def _check_footers(footers: list[_Footer], columns: list[str] | None) -> None:
    """Refuse a requested column missing from a file, or a schema other than the first file's."""
    first = footers[0]
    for footer in footers:
        names = {name for name, _ in footer.fields} | footer.partition_keys
        missing = [c for c in columns or () if c not in names]
        if missing:
            raise InputError(
                f"{footer.path!r} has no column {missing[0]!r}"
                + (f" (nor {missing[1:]})" if len(missing) > 1 else "")
                + f"; its columns: {[n for n, _ in footer.fields]}",
                path=footer.path,
            )
        if dict(footer.fields) != dict(first.fields):
            raise InputError(
                f"{footer.path!r} has another schema than the first file {first.path!r}: "
                + _schema_difference(first, footer),
                path=footer.path,
            )


def _split_row_groups(
    footers: list[_Footer], columns: list[str] | None, chunks: str, chunk_bytes: int
) -> bool | int:
    """dask's ``split_row_groups`` for the ``chunks`` rule (see :func:`read_parquet`)."""
    if chunks == "file":
        return False
    if chunks == "row-group":
        return True

    def size(group: dict[str, int]) -> int:
        return sum(group.values()) if columns is None else sum(group.get(c, 0) for c in columns)

    large = [
        f
        for f in footers
        if len(f.row_group_bytes) > 1 and sum(size(g) for g in f.row_group_bytes) > chunk_bytes
    ]
    if not large:
        return False
    biggest = max(size(g) for f in footers for g in f.row_group_bytes)
    per_chunk = max(1, chunk_bytes // max(biggest, 1))
    return True if per_chunk == 1 else int(per_chunk)


def read_parquet(
    path: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    columns: Sequence[str] | None = None,
    *,
    storage_options: dict[str, Any] | None = None,
    chunks: str = "auto",
    chunk_bytes: int | str = "128MiB",
    index: str | bool | None = None,
) -> Any:
    """A Parquet dataset as a Dask DataFrame whose partitions are the stream's batches.

    Every file's footer is read first (on a small thread pool), and the
    dataset is refused, naming the file, when a footer is corrupt or cut
    short, when a requested column is missing from a file, or when a file's
    schema (column names and types; their order may differ) differs from the first file's. So a
    bad dataset fails here, before a fit has consumed anything.

    Parameters
    ----------
    path : str, path-like or sequence of them
        A file, a dataset directory, a glob, an fsspec URL (``s3://``,
        ``gs://``, ``memory://``, ``file://``), or a list of them. Files are
        taken in natural order of their names (``part.2`` before
        ``part.10``); see :func:`parquet_files`.
    columns : sequence of str, optional
        The columns to read (only these are read from the files); default
        all of them. Types are kept: float32 columns stay float32.
    storage_options : dict, optional
        Options of the fsspec filesystem (credentials, endpoint, ...).
    chunks : {"auto", "file", "row-group"}
        What one batch is. ``"file"``: one file. ``"row-group"``: one row
        group. ``"auto"``: one file, unless some file with several row groups
        holds more than ``chunk_bytes`` of the requested columns
        (uncompressed); then every file is cut into runs of whole row groups,
        as many per batch as fit in ``chunk_bytes`` by the largest row group
        (at least one). Batches never span two files.
    chunk_bytes : int or str
        The batch size ``"auto"`` aims at, in bytes (``"128MiB"``), as the
        footers state the uncompressed size.
    index : str, False or None
        As in :func:`dask.dataframe.read_parquet` (``None``: the index the
        pandas metadata names, if any).

    Returns
    -------
    dask.dataframe.DataFrame
        Lazy; its partitions are the batches when graphs are built with
        :func:`rh_dask.distributed.chunks.stable_partitions` (the distributed
        fit does so itself).

    Raises
    ------
    InputError
        No such file, a glob matching nothing, an unreadable footer, a
        missing column, a schema that differs from the first file's (the
        message and ``err.path`` name the file), or bad ``chunks`` /
        ``chunk_bytes``.
    MissingExtraError
        When pyarrow is not installed.
    """
    if chunks not in PARQUET_CHUNKS:
        raise InputError(f"chunks must be one of {PARQUET_CHUNKS}, got {chunks!r}")
    try:
        limit = parse_bytes(chunk_bytes) if isinstance(chunk_bytes, str) else int(chunk_bytes)
    except (TypeError, ValueError) as exc:
        raise InputError(f"chunk_bytes must be a size such as '128MiB': {exc}") from None
    if limit < 1:
        raise InputError(f"chunk_bytes must be at least 1 byte, got {chunk_bytes!r}")
    if isinstance(columns, str):
        raise InputError(f"columns must be a list of names, got the string {columns!r}")
    selected = None if columns is None else [str(c) for c in columns]
    _require("pyarrow", "reading Parquet")
    import dask.dataframe as dd

    files = parquet_files(path, storage_options=storage_options)
    footers = _footers(files, storage_options)
    _check_footers(footers, selected)
    split = _split_row_groups(footers, selected, chunks, limit)
    try:
        return dd.read_parquet(
            files if len(files) > 1 else files[0],
            columns=selected,
            index=index,
            storage_options=storage_options,
            split_row_groups=split,
            blocksize=None,
            ignore_metadata_file=True,
            parquet_file_extension=None,
        )
    except (OSError, ValueError) as exc:
        raise InputError(f"cannot read {os.fspath(files[0])!r} as Parquet: {exc}") from exc


# -- column selection of 2-D arrays ----------------------------------------------------------
@dataclass(frozen=True)
class ArrayStream:
    """Features, target and weights taken from arrays, chunked alike along rows.

    Attributes
    ----------
    X : dask.array.Array
        2-D features; its row chunks are the batches, columns in one chunk.
    y : dask.array.Array or None
        1-D target (``None`` when none was asked for).
    sample_weight : dask.array.Array or None
        1-D frequency weights.
    feature_names : list of str
        ``x<j>`` for column ``j`` of a 2-D array; ``<array>`` or
        ``<array>[j]`` for the arrays of a Zarr group.
    """

    X: Any
    y: Any | None
    sample_weight: Any | None
    feature_names: list[str]


def parse_position(spec: str | int, width: int) -> list[int]:
    """Column positions of ``spec`` (``3``, ``-1`` or ``"a:b"``), checked against ``width``."""
    text = str(spec).strip()
    try:
        if ":" in text:
            parts = [int(p) if p else None for p in text.split(":")]
            if len(parts) > 3:
                raise ValueError(text)
            return list(range(width))[slice(*parts)]
        index = int(text)
    except ValueError:
        raise InputError(
            f"column {text!r} of a 2-D array must be a position (3, -1) or a range (0:20)"
        ) from None
    if not -width <= index < width:
        raise InputError(f"column {index} is out of range for an array with {width} columns")
    return [index % width]


def _positions(specs: Sequence[str | int] | None, width: int) -> list[int] | None:
    if specs is None:
        return None
    out: list[int] = []
    for spec in specs:
        out.extend(parse_position(spec, width))
    return out


def check_exclude(
    exclude: Sequence[str], features: Sequence[str], columns: Sequence[str], where: str
) -> None:
    """Refuse excluded columns that are not columns, or that are also features."""
    missing = [c for c in exclude if c not in columns]
    if missing:
        raise InputError(
            f"columns to exclude {missing} are not in {where} (columns: {list(columns)})"
        )
    both = [c for c in exclude if c in features]
    if both:
        raise InputError(f"columns {both} are both features and excluded; choose one")


def select_columns(
    array: Any,
    where: str,
    *,
    target: str | int | None = None,
    features: Sequence[str | int] | None = None,
    weight: str | int | None = None,
    exclude: Sequence[str | int] = (),
    chunk_rows: int | None = None,
) -> ArrayStream:
    """Features, target and weights of a 2-D Dask array, chosen by column position.

    Parameters
    ----------
    array : dask.array.Array
        2-D, rows by columns.
    where : str
        The input's name, for messages.
    target, weight : int or str, optional
        Column positions (``3``, ``-1``).
    features : sequence of int or str, optional
        Positions or ranges (``"0:20"``); default every column that is not
        the target, the weight or excluded.
    exclude : sequence of int or str
        Positions left out of the default features.
    chunk_rows : int, optional
        Re-cut the rows into batches of exactly this many rows; default the
        array's own row chunks.

    Raises
    ------
    InputError
        A position out of range, a column both a feature and excluded, no
        feature left, or an array that is not 2-D.
    """
    if array.ndim != 2:
        raise InputError(f"{where!r} holds a {array.ndim}-D array; expected 2-D (rows, columns)")
    width = int(array.shape[1])
    array = array.rechunk((chunk_rows, -1)) if chunk_rows is not None else array.rechunk({1: -1})
    t = None if target is None else parse_position(target, width)[0]
    w = None if weight is None else parse_position(weight, width)[0]
    cols = _positions(features, width)
    excluded = _positions(exclude, width) or []
    if cols is None:
        skip = {t, w, *excluded}
        cols = [j for j in range(width) if j not in skip]
    elif set(cols) & set(excluded):
        both = sorted(set(cols) & set(excluded))
        raise InputError(f"columns {both} are both features and excluded; choose one")
    if not cols:
        raise InputError(f"{where!r} has no feature columns left besides the target and weight")
    return ArrayStream(
        X=array[:, cols],
        y=None if t is None else array[:, t],
        sample_weight=None if w is None else array[:, w],
        feature_names=[f"x{j}" for j in cols],
    )


# -- Zarr ------------------------------------------------------------------------------------
def _zarr_major(zarr: ModuleType) -> int:
    return int(str(zarr.__version__).split(".")[0])


def _open_zarr(store: str, storage_options: dict[str, Any] | None) -> tuple[ModuleType, Any]:
    zarr = _require("zarr", "reading Zarr")
    options = {"storage_options": storage_options} if storage_options else {}
    try:
        node = zarr.open(store=store, mode="r", **options)
    except Exception as exc:  # zarr raises several unrelated types for "not a store"
        hint = ""
        if _zarr_major(zarr) < 3:
            fs, stripped = _filesystem(store, storage_options)
            if fs.exists(f"{stripped.rstrip('/')}/zarr.json"):
                hint = f" (a Zarr v3 store needs zarr >= 3; installed: {zarr.__version__})"
        raise InputError(
            f"cannot open {store!r} as a Zarr store{hint}: {exc}", path=store
        ) from exc
    return zarr, node


def _zarr_dask(
    array: Any, store: str, component: str | None, storage_options: dict[str, Any] | None
) -> Any:
    """One Zarr array as a Dask array, its whole chunks decoded directly where they can be.

    With ``rh-dask.readers.zarr-direct`` on (the default) and an array that
    :func:`rh_dask.zarr_chunks.direct_rows` can read, each block decodes its
    chunk straight into the block (:mod:`rh_dask.zarr_chunks`); otherwise
    :func:`dask.array.from_zarr`.
    """
    import dask.array as da

    from .settings import zarr_direct
    from .zarr_chunks import direct_rows

    # A local store is named by its absolute path, made here where it was given:
    # loading workers may run elsewhere in the tree.
    fs, path = _filesystem(store, storage_options)
    where = path if _is_local(fs) else store
    rows = direct_rows(array, where, component, storage_options) if zarr_direct() else None
    if rows is None:
        options = {"storage_options": storage_options} if storage_options else {}
        if component is not None:
            options["component"] = component
        return da.from_zarr(store, **options)
    return da.from_array(
        rows,
        chunks=rows.chunks,
        name=f"from-zarr-direct-{tokenize(rows)}",
        asarray=True,
        fancy=False,
        meta=np.empty((0,) * rows.ndim, dtype=rows.dtype),
        inline_array=True,
    )


def read_zarr(
    store: str | os.PathLike[str],
    *,
    target: str | int | None = None,
    features: Sequence[str | int] | None = None,
    weight: str | int | None = None,
    exclude: Sequence[str | int] = (),
    chunk_rows: int | None = None,
    storage_options: dict[str, Any] | None = None,
) -> ArrayStream:
    """Features, target and weights of a Zarr store (v2 or v3), chunked along rows.

    A store holding one 2-D array selects columns by position (as
    :func:`select_columns`); a group selects arrays by name: ``target`` and
    ``weight`` are 1-D arrays (or one-column 2-D ones), and each feature is a
    1-D array or a 2-D array contributing all its columns. Dtypes are kept
    (a float32 store gives float32 batches); the batches are the store's
    chunks along rows (of the target array, for a group) unless
    ``chunk_rows`` re-cuts them.

    Parameters
    ----------
    store : str or path-like
        A local store directory or an fsspec URL (``s3://bucket/data.zarr``).
    target, weight : str or int, optional
        Array names (group) or column positions (2-D array). A group needs a
        target.
    features : sequence of str or int, optional
        Default: every array (column) that is neither the target, the weight
        nor excluded; in a group only the arrays with the target's rows.
    exclude : sequence of str or int
        Arrays (columns) left out of the default features.
    chunk_rows : int, optional
        Batches of exactly this many rows.
    storage_options : dict, optional
        Options of the fsspec filesystem.

    Returns
    -------
    ArrayStream

    Raises
    ------
    InputError
        Not a Zarr store (a v3 store with zarr 2 installed says so), unknown
        arrays or columns, arrays whose rows differ from the target's.
    MissingExtraError
        When zarr is not installed.
    """
    import dask.array as da

    store = os.fspath(store)
    if chunk_rows is not None and chunk_rows < 1:
        raise InputError(f"chunk_rows must be >= 1, got {chunk_rows}")
    zarr, node = _open_zarr(store, storage_options)
    if isinstance(node, zarr.Array):
        return select_columns(
            _zarr_dask(node, store, None, storage_options),
            store,
            target=target,
            features=features,
            weight=weight,
            exclude=exclude,
            chunk_rows=chunk_rows,
        )
    arrays = dict(node.arrays())
    names = sorted(arrays)
    for role, name in (("target", target), ("weight", weight)):
        if name is not None and name not in arrays:
            raise InputError(f"{role} array {name!r} is not in the Zarr group {store!r} ({names})")
    if target is None:
        raise InputError(f"choose the target array of the Zarr group {store!r} ({names})")
    n_rows = int(arrays[target].shape[0])
    exclude = [str(c) for c in exclude]
    if features is None:
        skip = {target, weight, *exclude}
        features = [n for n in names if n not in skip and arrays[n].shape[:1] == (n_rows,)]
    features = [str(f) for f in features]
    missing = [f for f in features if f not in arrays]
    if missing:
        raise InputError(f"feature arrays {missing} are not in the Zarr group {store!r} ({names})")
    check_exclude(exclude, features, names, f"the Zarr group {store!r}")
    if not features:
        raise InputError(f"the Zarr group {store!r} has no feature arrays of {n_rows} rows")

    def load(name: str) -> Any:
        arr = _zarr_dask(arrays[name], store, name, storage_options)
        if arr.shape[0] != n_rows or arr.ndim > 2:
            raise InputError(
                f"array {name!r} of {store!r} has shape {arr.shape}; expected {n_rows} rows "
                "and at most 2 dimensions"
            )
        return arr

    def column(arr: Any) -> Any:
        return arr.reshape(-1) if arr.ndim == 2 and arr.shape[1] == 1 else arr

    target_arr = load(target)
    rows = chunk_rows if chunk_rows is not None else target_arr.chunks[0]
    blocks, display = [], []
    for name in features:
        arr = load(name)
        blocks.append(arr[:, None] if arr.ndim == 1 else arr)
        display += [name] if arr.ndim == 1 else [f"{name}[{j}]" for j in range(arr.shape[1])]
    X = da.concatenate(blocks, axis=1).rechunk({0: rows, 1: -1})
    return ArrayStream(
        X=X,
        y=column(target_arr).rechunk({0: rows}),
        sample_weight=None if weight is None else column(load(weight)).rechunk({0: rows}),
        feature_names=display,
    )


# -- .npy ------------------------------------------------------------------------------------
def _local_path(path: str) -> str:
    if "://" in path and not path.startswith("file://"):
        raise InputError(
            f"read_npy reads local files only, not {path!r}; copy the file to local disk",
            path=path,
        )
    return path.removeprefix("file://")


def npy_files(path: str | os.PathLike[str] | Sequence[str | os.PathLike[str]]) -> list[str]:
    """The ``.npy`` files :func:`read_npy` reads, in order.

    A file; a directory (its ``*.npy`` files, in natural order of their
    names: ``2.npy`` before ``10.npy``, as ``dask.array.to_npy_stack``
    writes them); a glob (its matches, in natural order); or a list of
    these, in the order given.

    Raises
    ------
    InputError
        A URL, or a name that matches no file.
    """
    paths = [path] if isinstance(path, (str, os.PathLike)) else list(path)
    if not paths:
        raise InputError("read_npy needs at least one path")
    found: list[str] = []
    for entry in paths:
        name = _local_path(os.fspath(entry))
        if os.path.isdir(name):
            members = _glob.glob(os.path.join(_glob.escape(name), "*.npy"))
            if not members:
                raise InputError(f"no .npy files in directory {name!r}", path=name)
            found += sorted(members, key=natural_sort_key)
        elif _glob.has_magic(name):
            members = _glob.glob(name)
            if not members:
                raise InputError(f"no file matches {name!r}", path=name)
            found += sorted(members, key=natural_sort_key)
        else:
            found.append(name)
    return found


def read_npy(
    path: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    *,
    chunk_rows: int | None = None,
) -> Any:
    """The arrays of ``.npy`` files, one after another along rows, as a Dask array.

    Each chunk's task reads its rows with one ``pread``: no memory map, and
    nothing but the chunk in a worker's memory; a chunk never spans two
    files. With ``loader="relay"`` and the TCP transport, a loading worker
    sends a chunk of such arrays straight from the page cache to the relay
    with ``sendfile``, never reading it itself, when ``X``, ``y`` and
    ``sample_weight`` are :func:`read_npy` arrays used as they are (not
    sliced, not converted), of the stream's dtype and chunked alike
    (``docs/distributed.md``, "Relays"). Anything computed from them loads
    as any Dask array does. The files must be readable by every worker
    that loads chunks (local disks holding the same files, or a shared
    filesystem).

    Parameters
    ----------
    path : str, path-like, or a sequence of them
        A local ``.npy`` file, a directory of them, a glob, or a list of
        these (:func:`npy_files`). Each holds an array of numbers (1-D or
        more) saved row-major (``numpy.save`` of a C-ordered array); every
        file has the first one's dtype and shape past the rows.
    chunk_rows : int, optional
        Rows per chunk, the last chunk of each file holding the rest;
        default :data:`DEFAULT_NPY_CHUNK_ROWS` (65,536). Give ``X`` and
        ``y`` the same ``chunk_rows`` (and files of the same rows).

    Returns
    -------
    dask.array.Array
        Of the files' dtype, chunked along rows only.

    Raises
    ------
    InputError
        Naming the file: a URL or a file that is not a readable ``.npy``
        file of numbers, a Fortran-ordered array, a truncated file, a file
        whose dtype or shape past the rows differs from the first file's;
        also ``chunk_rows < 1``. A chunk whose file changed size since is
        refused when it is read.
    """
    import dask.array as da
    from dask.base import tokenize
    from dask.highlevelgraph import HighLevelGraph

    from .distributed.graphs import Task
    from .file_rows import FileRows, npy_layout

    step = DEFAULT_NPY_CHUNK_ROWS if chunk_rows is None else chunk_rows
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise InputError(f"chunk_rows must be an integer >= 1, got {chunk_rows!r}")
    layouts = [npy_layout(os.path.abspath(name)) for name in npy_files(path)]
    first = layouts[0]
    for layout in layouts[1:]:
        if layout.dtype != first.dtype or layout.shape[1:] != first.shape[1:]:
            raise InputError(
                f"{layout.path!r} holds a {np.dtype(layout.dtype)} array of shape "
                f"{layout.shape}; the first file, {first.path!r}, a {np.dtype(first.dtype)} "
                f"array of shape {first.shape}: every file needs the first one's dtype and "
                "shape past the rows",
                path=layout.path,
            )
    pieces = [
        (layout, a, min(a + step, layout.shape[0]))
        for layout in layouts
        for a in range(0, layout.shape[0], step)
    ] or [(first, 0, 0)]
    mtimes = [os.stat(layout.path).st_mtime_ns for layout in layouts]
    name = "read-npy-" + tokenize(layouts, mtimes, step)
    rest = first.shape[1:]
    tail = (0,) * len(rest)
    graph = {}
    for i, (layout, a, b) in enumerate(pieces):
        key = (name, i, *tail)
        graph[key] = Task(key, FileRows(layout, a, b))
    chunks = (tuple(b - a for _, a, b in pieces), *((m,) for m in rest))
    hlg = HighLevelGraph.from_collections(name, graph, dependencies=())
    dtype = np.dtype(first.dtype)
    return da.Array(hlg, name, chunks, dtype=dtype, meta=np.empty((0,) * (1 + len(rest)), dtype))
