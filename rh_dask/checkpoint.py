"""Portable checkpoints: one ``.npz`` holding the state and a JSON record.

Layout (format version 3):

* ``coefficients`` (p,), ``information`` (p, p): the state's arrays, in the
  stream's dtype;
* ``score_variance`` (p, p), in the stream's dtype: the state's K, the meat of
  the sandwich covariance, present exactly when the state accumulates it (a
  stream of an engine that does not, or one continued from a version-1 file,
  has no such member);
* ``feature_names``: a unicode array (empty when the stream had none);
* ``metadata``: a 0-d unicode array holding JSON with ``format``,
  ``format_version``, ``library_version``, ``config``, ``counters``,
  ``engine``, ``has_feature_names`` and ``digest``, the SHA-256 of the arrays
  and of the canonical JSON of everything else.

A *walk checkpoint* (a Dask stream part-way, see :class:`WalkPosition`) adds
a ``walk`` key to the JSON record (``next_chunk``, ``n_chunks``, ``n_empty``,
``n_records``, the input's ``fingerprint`` and the ``recoveries``) and two
members: ``history`` (float64, one row per batch record, the columns of
:data:`HISTORY_FIELDS`, every value exact in float64) and ``coef_history``
(float64, β after each record), and ``diagnostics_history`` (float64, one
row per record, the optional diagnostics
:data:`~rh_dask.state.OPTIONAL_DIAGNOSTICS`, NaN where the engine did not
report one). All three are covered by the digest. A checkpoint without a walk
has no ``walk`` key and none of them.

Version 2 is version 3 without ``diagnostics_history`` (its records read with
those diagnostics None); version 1 is version 2 without ``score_variance``
(its state reads with ``score_variance`` None). Both are read.

Files are read with ``allow_pickle=False`` and every field is validated, so a
checkpoint is safe to load from an untrusted source and loadable on a machine
without a GPU.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import math
import os
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ._version import __version__
from .checkpoint_content import Checkpoint, WalkPosition, as_count, as_number
from .config import HuberConfig
from .engines import ENGINE_NAMES
from .exceptions import CheckpointError, ValidationError
from .interop import is_renewable_huber_archive, renewable_huber_checkpoint
from .state import OPTIONAL_DIAGNOSTICS, BatchDiagnostics, HuberState
from .stream import RECOVERY_COLUMNS, BatchRecord, Recovery

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "HISTORY_FIELDS",
    "READ_VERSIONS",
    "Checkpoint",
    "WalkPosition",
    "checkpoint_bytes",
    "checkpoint_from_bytes",
    "load_checkpoint",
    "save_checkpoint",
]

FORMAT = "rh-dask-checkpoint"
FORMAT_VERSION = 3
#: Format versions this rh-dask reads (version 1 has no ``score_variance`` member,
#: versions 1 and 2 no ``diagnostics_history``).
READ_VERSIONS = (1, 2, 3)
_ARRAYS = ("coefficients", "information", "feature_names")
#: The member holding the state's K, when the state has it (from format version 2).
_SCORE_ARRAY = "score_variance"
#: Members only a walk checkpoint has.
_WALK_ARRAYS = ("history", "coef_history")
#: The walk member holding the optional per-batch diagnostics (from format version 3).
_DIAGNOSTICS_ARRAY = "diagnostics_history"
#: Columns of a walk checkpoint's ``history`` member, one row per batch record.
HISTORY_FIELDS = (
    "batch",
    "chunk",
    "rows",
    "iterations",
    "converged",
    "objective",
    "lambda_value",
    "bandwidth",
    "seconds",
    "wait_seconds",
)
_INTEGER_FIELDS = ("batch", "chunk", "rows", "iterations")
#: Integers above this are not exact in float64.
_MAX_EXACT = 2**53
_RECOVERY_KINDS = ("worker-lost", "resume")
#: Deflate expands data at most about 1032-fold: a compressed member claiming
#: more bytes per stored byte than this is forged.
_MAX_INFLATION = 1100


def _digest(arrays: dict[str, np.ndarray], record: dict[str, Any]) -> str:
    h = hashlib.sha256()
    names = (
        _ARRAYS
        + ((_SCORE_ARRAY,) if _SCORE_ARRAY in arrays else ())
        + (_WALK_ARRAYS if "walk" in record else ())
        + ((_DIAGNOSTICS_ARRAY,) if _DIAGNOSTICS_ARRAY in arrays else ())
    )
    for name in names:
        arr = arrays[name]
        h.update(name.encode())
        h.update(str(arr.dtype.str).encode())
        h.update(repr(arr.shape).encode())
        h.update(np.ascontiguousarray(arr).tobytes())
    h.update(json.dumps(record, sort_keys=True, separators=(",", ":")).encode())
    return h.hexdigest()


def checkpoint_bytes(checkpoint: Checkpoint) -> bytes:
    """The ``.npz`` file of ``checkpoint``, as bytes.

    Raises
    ------
    ValidationError
        When a walk checkpoint's records or recoveries are inconsistent with
        its position or state (the same checks as on reading): a file that
        would be refused is never written.
    """
    names = checkpoint.feature_names
    arrays = {
        "coefficients": np.ascontiguousarray(checkpoint.state.coefficients),
        "information": np.ascontiguousarray(checkpoint.state.information),
        "feature_names": np.asarray([] if names is None else [str(n) for n in names], dtype=str),
    }
    if checkpoint.state.score_variance is not None:
        arrays[_SCORE_ARRAY] = np.ascontiguousarray(checkpoint.state.score_variance)
    record = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "library_version": checkpoint.library_version,
        "config": checkpoint.config.to_dict(),
        "counters": checkpoint.state.counters(),
        "engine": checkpoint.engine,
        "has_feature_names": names is not None,
    }
    if checkpoint.walk is not None:
        _check_walk(checkpoint.walk, checkpoint.records, checkpoint.recoveries, checkpoint.state)
        arrays.update(_walk_arrays(checkpoint.records, checkpoint.state.n_params))
        record["walk"] = {
            **checkpoint.walk.to_dict(),
            "n_records": len(checkpoint.records),
            "recoveries": [_recovery_to_json(r) for r in checkpoint.recoveries],
        }
    record["digest"] = _digest(arrays, {k: v for k, v in record.items()})
    buffer = io.BytesIO()
    np.savez(buffer, metadata=np.asarray(json.dumps(record, sort_keys=True)), **arrays)
    return buffer.getvalue()


def save_checkpoint(path: str | os.PathLike[str], checkpoint: Checkpoint) -> Path:
    """Write ``checkpoint`` to ``path`` atomically (write, flush, then rename).

    Raises
    ------
    OSError
        When the file cannot be written; no partial file is left behind and
        an existing checkpoint at ``path`` stays as it was.
    """
    path = Path(path)
    if path.suffix != ".npz":
        path = path.with_suffix(path.suffix + ".npz") if path.suffix else path.with_suffix(".npz")
    _write_atomically(path, checkpoint_bytes(checkpoint))
    return path


def _write_atomically(path: Path, data: bytes) -> None:
    """Write ``data`` beside ``path``, flush it to disk, then rename it over ``path``.

    A failed write (a read-only directory, a full disk) raises its
    ``OSError`` and leaves neither a partial file nor a changed ``path``:
    the temporary file is removed and an existing file at ``path`` is
    untouched.
    """
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_bytes(data)
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise


def load_checkpoint(path: str | os.PathLike[str]) -> Checkpoint:
    """Read and verify a checkpoint file (see :func:`checkpoint_from_bytes`).

    Raises
    ------
    CheckpointError
        If the file is missing or unreadable, or refused by
        :func:`checkpoint_from_bytes`; the message names ``path``.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"no checkpoint file at {path}")
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise CheckpointError(f"cannot read checkpoint {path}: {exc}") from exc
    return checkpoint_from_bytes(data, str(path))


def checkpoint_from_bytes(data: bytes, source: str) -> Checkpoint:
    """Read and verify a checkpoint held in ``data``.

    Every array's declared dtype and shape are checked against the metadata
    (p from ``n_features_in`` and ``fit_intercept``, the configured dtype,
    the number of batch records of a walk checkpoint) and against the bytes
    really held *before* anything is allocated, so a forged header cannot
    make the reader allocate more than the data's size. A walk checkpoint's
    position, records and recoveries are then checked against each other
    and against the state.

    Parameters
    ----------
    data : bytes
        The ``.npz`` file's content.
    source : str
        Where ``data`` came from (a path or URL), named in error messages.

    Raises
    ------
    CheckpointError
        If ``data`` is neither an rh-dask checkpoint nor a renewable-huber one
        (formats 1 and 2, read by :mod:`rh_dask.interop`), of an unsupported version,
        altered since it was written, or internally inconsistent (shapes,
        dtypes, counters, an unknown engine name, a walk's records or
        recoveries that do not fit its position or state).
    """
    buffer = io.BytesIO(data)
    if not zipfile.is_zipfile(buffer):
        # Checked first: np.load would otherwise treat a plain .npy file as an
        # array, and any other file as a pickle it refuses to load.
        raise CheckpointError(
            f"{source} is not an rh-dask checkpoint: not a readable .npz archive "
            "(truncated, corrupted or another format)"
        )
    try:
        buffer.seek(0)
        with zipfile.ZipFile(buffer) as archive:
            if is_renewable_huber_archive(archive):
                return renewable_huber_checkpoint(archive, len(data), source)
            declared = _declared_arrays(source, archive, len(data))
            record = _read_record(source, archive, declared["metadata"])
            config = _check_declared(source, record, declared)
        buffer.seek(0)
        with np.load(buffer, allow_pickle=False) as npz:
            arrays = {name: npz[name] for name in declared if name != "metadata"}
    except CheckpointError:
        raise
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as exc:
        raise CheckpointError(f"cannot read checkpoint {source}: {exc}") from exc
    digest = record.pop("digest", None)
    if digest != _digest(arrays, record):
        raise CheckpointError(f"{source} failed its integrity check (altered or corrupted)")
    try:
        counters = record["counters"]
        state = HuberState(
            coefficients=arrays["coefficients"],
            information=arrays["information"],
            n_samples_seen=int(counters["n_samples_seen"]),
            batch_count=int(counters["batch_count"]),
            previous_lambda=float(counters["previous_lambda"]),
            weight_sum=float(counters["weight_sum"]),
            n_features_in=int(counters["n_features_in"]),
            fit_intercept=bool(counters["fit_intercept"]),
            score_variance=arrays.get(_SCORE_ARRAY),
        )
        state.validate(dtype=config.dtype)
        if state.fit_intercept != config.fit_intercept:
            raise ValidationError("fit_intercept of the state and the config differ")
        names = arrays["feature_names"].astype(object) if record["has_feature_names"] else None
        if names is not None and len(names) != state.n_features_in:
            raise ValidationError("feature_names length differs from n_features_in")
        engine = record["engine"]
        if engine not in ENGINE_NAMES:
            raise ValidationError(f"unknown engine {engine!r} (rh-dask knows {ENGINE_NAMES})")
        walk = records = recoveries = None
        if "walk" in record:
            walk, records, recoveries = _walk_from(record["walk"], arrays, state)
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{source} is inconsistent: {exc}") from exc
    return Checkpoint(
        config=config,
        state=state,
        feature_names=names,
        engine=str(engine),
        library_version=str(record.get("library_version", "")),
        walk=walk,
        records=records or (),
        recoveries=recoveries or (),
    )


# -- walk checkpoints ------------------------------------------------------------------------


def _walk_arrays(records: Sequence[BatchRecord], n_params: int) -> dict[str, np.ndarray]:
    """The ``history`` and ``coef_history`` members of ``records``."""
    history = np.empty((len(records), len(HISTORY_FIELDS)), dtype=np.float64)
    coef_history = np.empty((len(records), n_params), dtype=np.float64)
    diagnostics = np.empty((len(records), len(OPTIONAL_DIAGNOSTICS)), dtype=np.float64)
    for i, r in enumerate(records):
        d = r.diagnostics
        history[i] = (
            r.batch,
            r.chunk,
            r.rows,
            d.iterations,
            1.0 if d.converged else 0.0,
            d.objective,
            d.lambda_value,
            d.bandwidth,
            r.seconds,
            r.wait_seconds,
        )
        coef_history[i] = r.coefficients
        diagnostics[i] = [
            math.nan if v is None else v
            for v in (getattr(r.diagnostics, name) for name in OPTIONAL_DIAGNOSTICS)
        ]
    return {"history": history, "coef_history": coef_history, _DIAGNOSTICS_ARRAY: diagnostics}


def _recovery_to_json(r: Recovery) -> dict[str, Any]:
    """A recovery as JSON; a NaN ``detect_seconds`` (a resume) is written as null."""
    out = {name: getattr(r, name) for name in RECOVERY_COLUMNS}
    for name in ("time", "detect_seconds", "recover_seconds"):
        value = float(out[name])
        out[name] = None if math.isnan(value) else value
    for name in ("from_chunk", "chunks_replayed"):
        out[name] = int(out[name])
    return out


def _recovery_from_json(index: int, raw: Any) -> Recovery:
    """Rebuild recovery ``index`` of a walk record, checking every field's type."""
    where = f"recovery {index}"
    if not isinstance(raw, dict) or sorted(raw) != sorted(RECOVERY_COLUMNS):
        keys = sorted(raw) if isinstance(raw, dict) else type(raw).__name__
        raise ValidationError(f"{where} has fields {keys}, expected {sorted(RECOVERY_COLUMNS)}")
    for name in ("kind", "lost_worker", "new_worker"):
        if not isinstance(raw[name], str):
            raise ValidationError(f"{where}: {name} is {raw[name]!r}, not a string")
    detect = raw["detect_seconds"]
    return Recovery(
        time=as_number(f"{where}: time", raw["time"]),
        kind=raw["kind"],
        lost_worker=raw["lost_worker"],
        new_worker=raw["new_worker"],
        from_chunk=as_count(f"{where}: from_chunk", raw["from_chunk"]),
        chunks_replayed=as_count(f"{where}: chunks_replayed", raw["chunks_replayed"]),
        detect_seconds=math.nan
        if detect is None
        else as_number(f"{where}: detect_seconds", detect),
        recover_seconds=as_number(f"{where}: recover_seconds", raw["recover_seconds"]),
    )


def _records_from(
    history: np.ndarray, coef_history: np.ndarray, diagnostics: np.ndarray | None = None
) -> tuple[BatchRecord, ...]:
    """Rebuild the batch records, refusing values an int or bool column cannot hold.

    ``diagnostics`` (format version 3) holds the optional diagnostics, NaN for
    None; without it (versions 1 and 2) they are None.
    """
    columns = {name: history[:, j] for j, name in enumerate(HISTORY_FIELDS)}
    optional = [
        {
            name: None if diagnostics is None or math.isnan(v := float(diagnostics[i, j])) else v
            for j, name in enumerate(OPTIONAL_DIAGNOSTICS)
        }
        for i in range(history.shape[0])
    ]
    for name in _INTEGER_FIELDS:
        col = columns[name]
        bad = ~(np.isfinite(col) & (col == np.floor(col)) & (col >= 0) & (col < _MAX_EXACT))
        if bad.any():
            row = int(np.flatnonzero(bad)[0])
            raise ValidationError(
                f"history row {row}: {name} is {float(col[row])!r}, not a non-negative integer"
            )
    converged = columns["converged"]
    bad = ~np.isin(converged, (0.0, 1.0))
    if bad.any():
        row = int(np.flatnonzero(bad)[0])
        raise ValidationError(
            f"history row {row}: converged is {float(converged[row])!r}, not 0 or 1"
        )
    return tuple(
        BatchRecord(
            batch=int(columns["batch"][i]),
            chunk=int(columns["chunk"][i]),
            rows=int(columns["rows"][i]),
            diagnostics=BatchDiagnostics(
                iterations=int(columns["iterations"][i]),
                converged=bool(converged[i] == 1.0),
                objective=float(columns["objective"][i]),
                lambda_value=float(columns["lambda_value"][i]),
                bandwidth=float(columns["bandwidth"][i]),
                **optional[i],
            ),
            seconds=float(columns["seconds"][i]),
            coefficients=np.array(coef_history[i], dtype=np.float64, copy=True),
            wait_seconds=float(columns["wait_seconds"][i]),
        )
        for i in range(history.shape[0])
    )


def _walk_from(
    raw: dict[str, Any], arrays: dict[str, np.ndarray], state: HuberState
) -> tuple[WalkPosition, tuple[BatchRecord, ...], tuple[Recovery, ...]]:
    """The position, records and recoveries of a walk record, checked."""
    walk = WalkPosition(
        next_chunk=raw["next_chunk"],
        n_chunks=raw["n_chunks"],
        n_empty=raw["n_empty"],
        fingerprint=raw["fingerprint"],
    )
    entries = raw["recoveries"]
    if not isinstance(entries, list):
        raise ValidationError(f"recoveries is {type(entries).__name__}, not a list")
    recoveries = tuple(_recovery_from_json(i, r) for i, r in enumerate(entries))
    records = _records_from(
        arrays["history"], arrays["coef_history"], arrays.get(_DIAGNOSTICS_ARRAY)
    )
    _check_walk(walk, records, recoveries, state)
    return walk, records, recoveries


def _check_walk(
    walk: WalkPosition,
    records: Sequence[BatchRecord],
    recoveries: Sequence[Recovery],
    state: HuberState,
) -> None:
    """Check a walk's records and recoveries against its position and state.

    Records are in chunk and batch order, each chunk before ``next_chunk``
    consumed at most once, together no more batches and rows than the state
    counts; recoveries go on from a chunk no later than ``next_chunk``.
    """
    n = len(records)
    if n > state.batch_count:
        raise ValidationError(
            f"{n} batch records but the state counts {state.batch_count} batches"
        )
    if n + walk.n_empty > walk.next_chunk:
        raise ValidationError(
            f"{n} batch records and {walk.n_empty} empty chunks do not fit before "
            f"next_chunk {walk.next_chunk}"
        )
    p = state.n_params
    previous_batch = previous_chunk = -1
    rows = 0
    for i, r in enumerate(records):
        if not isinstance(r, BatchRecord):
            raise ValidationError(f"record {i} is a {type(r).__name__}, not a BatchRecord")
        where = f"record {i}"
        batch = as_count(f"{where}: batch", r.batch)
        chunk = as_count(f"{where}: chunk", r.chunk)
        rows += as_count(f"{where}: rows", r.rows)
        as_count(f"{where}: iterations", r.diagnostics.iterations)
        if batch <= previous_batch or batch >= state.batch_count:
            raise ValidationError(
                f"{where}: batch {batch} is out of order (after {previous_batch}, "
                f"the state counts {state.batch_count} batches)"
            )
        if chunk <= previous_chunk or chunk >= walk.next_chunk:
            raise ValidationError(
                f"{where}: chunk {chunk} is out of order (after {previous_chunk}, "
                f"next_chunk {walk.next_chunk})"
            )
        previous_batch, previous_chunk = batch, chunk
        as_number(f"{where}: seconds", r.seconds, minimum=0.0)
        as_number(f"{where}: wait_seconds", r.wait_seconds, minimum=0.0)
        as_number(f"{where}: lambda_value", r.diagnostics.lambda_value, minimum=0.0)
        as_number(f"{where}: bandwidth", r.diagnostics.bandwidth, minimum=0.0)
        for name in OPTIONAL_DIAGNOSTICS:
            value = getattr(r.diagnostics, name)
            if value is not None:
                as_number(f"{where}: {name}", value, minimum=0.0)
        beta = np.asarray(r.coefficients)
        if beta.shape != (p,) or not np.all(np.isfinite(beta)):
            raise ValidationError(
                f"{where}: coefficients of shape {beta.shape} (finite: "
                f"{bool(np.all(np.isfinite(beta)))}), expected {p} finite values"
            )
    if rows > state.n_samples_seen:
        raise ValidationError(
            f"batch records hold {rows} rows but the state has seen {state.n_samples_seen}"
        )
    for i, r in enumerate(recoveries):
        if not isinstance(r, Recovery):
            raise ValidationError(f"recovery {i} is a {type(r).__name__}, not a Recovery")
        where = f"recovery {i}"
        if r.kind not in _RECOVERY_KINDS:
            raise ValidationError(f"{where}: kind {r.kind!r} is not one of {_RECOVERY_KINDS}")
        from_chunk = as_count(f"{where}: from_chunk", r.from_chunk)
        if from_chunk > walk.next_chunk:
            raise ValidationError(
                f"{where}: from_chunk {from_chunk} is after next_chunk {walk.next_chunk}"
            )
        as_count(f"{where}: chunks_replayed", r.chunks_replayed)
        as_number(f"{where}: time", r.time)
        as_number(f"{where}: recover_seconds", r.recover_seconds, minimum=0.0)
        if not math.isnan(float(r.detect_seconds)):
            as_number(f"{where}: detect_seconds", r.detect_seconds, minimum=0.0)


# -- reading archive headers -----------------------------------------------------------------


@dataclass(frozen=True)
class _Declared:
    """What an archive member's ``.npy`` header says it holds."""

    dtype: np.dtype
    shape: tuple[int, ...]


def _declared_arrays(source: str, archive: zipfile.ZipFile, size: int) -> dict[str, _Declared]:
    """Read every member's ``.npy`` header (not its data) and check it against its size."""
    members = {info.filename: info for info in archive.infolist()}
    found = sorted(name.removesuffix(".npy") for name in members)
    plain = sorted(["metadata", *_ARRAYS])
    optional = {_SCORE_ARRAY, _DIAGNOSTICS_ARRAY, *_WALK_ARRAYS}
    expected = sorted(plain + [name for name in found if name in optional])
    has_walk = [name for name in _WALK_ARRAYS if name in found]
    if (
        found != expected
        or set(members) != {f"{name}.npy" for name in expected}
        or has_walk not in ([], list(_WALK_ARRAYS))
    ):
        raise CheckpointError(
            f"{source} is not an rh-dask checkpoint (arrays {found}, expected {plain}, "
            f"plus {_SCORE_ARRAY!r} for a state with a score variance and "
            f"{[*_WALK_ARRAYS, _DIAGNOSTICS_ARRAY]} for a walk checkpoint)"
        )
    declared = {}
    for member, info in members.items():
        name = member.removesuffix(".npy")
        stored = info.compress_type == zipfile.ZIP_STORED
        room = size if stored else _MAX_INFLATION * min(info.compress_size, size)
        if info.file_size > room:
            raise CheckpointError(
                f"{source} is inconsistent: {name} claims {info.file_size} bytes, more than "
                f"a {size}-byte file can hold"
            )
        with archive.open(info) as fh:
            version = np.lib.format.read_magic(fh)
            if version == (1, 0):
                shape, _, dtype = np.lib.format.read_array_header_1_0(fh)
            elif version == (2, 0):
                shape, _, dtype = np.lib.format.read_array_header_2_0(fh)
            else:
                raise CheckpointError(f"{source}: {name} has .npy format version {version}")
            offset = fh.tell()
        if dtype.hasobject:
            raise CheckpointError(
                f"{source} is inconsistent: {name} holds Python objects (pickled data), "
                "which rh-dask never loads (allow_pickle=False)"
            )
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes != info.file_size - offset:
            raise CheckpointError(
                f"{source} is inconsistent: {name} declares a {dtype} array of shape {shape} "
                f"({nbytes} bytes) but holds {info.file_size - offset} bytes"
            )
        declared[name] = _Declared(dtype, tuple(shape))
    return declared


def _read_record(source: str, archive: zipfile.ZipFile, declared: _Declared) -> dict[str, Any]:
    """The metadata's JSON record, with its format and version checked."""
    if declared.dtype.kind != "U" or declared.shape != ():
        raise CheckpointError(f"{source}: metadata is not valid JSON (not a string)")
    with archive.open("metadata.npy") as fh:
        raw = np.lib.format.read_array(fh, allow_pickle=False)
    try:
        record = json.loads(str(raw[()]))
    except (ValueError, TypeError) as exc:
        raise CheckpointError(f"{source}: metadata is not valid JSON") from exc
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        raise CheckpointError(f"{source} is not an rh-dask checkpoint")
    version = record.get("format_version")
    if isinstance(version, bool) or version not in READ_VERSIONS:
        raise CheckpointError(
            f"{source} has checkpoint format version {version!r}; this rh-dask "
            f"({__version__}) reads versions {', '.join(map(str, READ_VERSIONS))}"
        )
    return record


def _check_declared(
    source: str, record: dict[str, Any], declared: dict[str, _Declared]
) -> HuberConfig:
    """The record's configuration, once every array's header agrees with the record."""
    try:
        config = HuberConfig.from_dict(record["config"])
        counters = record["counters"]
        d = counters["n_features_in"]
        fit_intercept = counters["fit_intercept"]
        has_names = record["has_feature_names"]
        for key, value in (("n_features_in", d), ("fit_intercept", fit_intercept)):
            kind = bool if key == "fit_intercept" else int
            if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
                raise ValidationError(f"counter {key} is {value!r}, not {kind.__name__}")
        if d < 1:
            raise ValidationError(f"n_features_in is {d}, need >= 1")
        if not isinstance(has_names, bool):
            raise ValidationError(f"has_feature_names is {has_names!r}, not bool")
        walk = record.get("walk")
        if (walk is not None) != ("history" in declared):
            raise ValidationError(
                "the walk record and the history members must come together "
                f"(walk record: {walk is not None}, members: {'history' in declared})"
            )
        if walk is not None:
            if not isinstance(walk, dict):
                raise ValidationError(f"walk is {type(walk).__name__}, not an object")
            n_records = as_count("walk n_records", walk["n_records"])
        if _SCORE_ARRAY in declared and record["format_version"] == 1:
            raise ValidationError(
                f"a format version 1 checkpoint has no {_SCORE_ARRAY} member (added in version 2)"
            )
        diagnostics_expected = walk is not None and record["format_version"] >= 3
        if (_DIAGNOSTICS_ARRAY in declared) != diagnostics_expected:
            kind = "walk checkpoint" if walk is not None else "checkpoint without a walk"
            rule = "needs" if diagnostics_expected else "has no"
            raise ValidationError(
                f"a format version {record['format_version']} {kind} {rule} a "
                f"{_DIAGNOSTICS_ARRAY} member (walk checkpoints have one from version 3)"
            )
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{source} is inconsistent: {exc}") from exc
    coef_shape, info_shape = HuberState.shapes(d, fit_intercept)
    wanted = {
        "coefficients": (config.np_dtype, coef_shape),
        "information": (config.np_dtype, info_shape),
    }
    if _SCORE_ARRAY in declared:
        wanted[_SCORE_ARRAY] = (config.np_dtype, info_shape)
    if walk is not None:
        float64 = np.dtype(np.float64)
        wanted["history"] = (float64, (n_records, len(HISTORY_FIELDS)))
        wanted["coef_history"] = (float64, (n_records, coef_shape[0]))
        if diagnostics_expected:
            wanted[_DIAGNOSTICS_ARRAY] = (float64, (n_records, len(OPTIONAL_DIAGNOSTICS)))
    for name, (dtype, shape) in wanted.items():
        got = declared[name]
        if got.dtype != dtype or got.shape != shape:
            raise CheckpointError(
                f"{source} is inconsistent: {name} is a {got.dtype} array of shape "
                f"{got.shape}, the metadata says {dtype} of shape {shape}"
            )
    names = declared["feature_names"]
    names_shape = (d,) if has_names else (0,)
    if names.dtype.kind != "U" or names.shape != names_shape:
        raise CheckpointError(
            f"{source} is inconsistent: feature_names is a {names.dtype} array of shape "
            f"{names.shape}, the metadata says strings of shape {names_shape}"
        )
    return config
