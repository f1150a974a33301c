"""Portable checkpoints: one ``.npz`` holding the state and a JSON record.

Layout (format version 1):

* ``coefficients`` (p,), ``information`` (p, p): the state's arrays, in the
  stream's dtype;
* ``feature_names``: a unicode array (empty when the stream had none);
* ``metadata``: a 0-d unicode array holding JSON with ``format``,
  ``format_version``, ``library_version``, ``config``, ``counters``,
  ``engine``, ``has_feature_names`` and ``digest``, the SHA-256 of the arrays
  and of the canonical JSON of everything else.

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ._version import __version__
from .config import HuberConfig
from .engines import ENGINE_NAMES
from .exceptions import CheckpointError, ValidationError
from .state import HuberState

FORMAT = "rh-dask-checkpoint"
FORMAT_VERSION = 1
_ARRAYS = ("coefficients", "information", "feature_names")
#: Deflate expands data at most about 1032-fold: a compressed member claiming
#: more bytes per stored byte than this is forged.
_MAX_INFLATION = 1100


@dataclass(frozen=True)
class Checkpoint:
    """The content of a checkpoint file."""

    config: HuberConfig
    state: HuberState
    feature_names: np.ndarray | None
    engine: str
    library_version: str = __version__


def _digest(arrays: dict[str, np.ndarray], record: dict[str, Any]) -> str:
    h = hashlib.sha256()
    for name in _ARRAYS:
        arr = arrays[name]
        h.update(name.encode())
        h.update(str(arr.dtype.str).encode())
        h.update(repr(arr.shape).encode())
        h.update(np.ascontiguousarray(arr).tobytes())
    h.update(json.dumps(record, sort_keys=True, separators=(",", ":")).encode())
    return h.hexdigest()


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
    names = checkpoint.feature_names
    arrays = {
        "coefficients": np.ascontiguousarray(checkpoint.state.coefficients),
        "information": np.ascontiguousarray(checkpoint.state.information),
        "feature_names": np.asarray([] if names is None else [str(n) for n in names], dtype=str),
    }
    record = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "library_version": checkpoint.library_version,
        "config": checkpoint.config.to_dict(),
        "counters": checkpoint.state.counters(),
        "engine": checkpoint.engine,
        "has_feature_names": names is not None,
    }
    record["digest"] = _digest(arrays, {k: v for k, v in record.items()})
    buffer = io.BytesIO()
    np.savez(buffer, metadata=np.asarray(json.dumps(record, sort_keys=True)), **arrays)
    _write_atomically(path, buffer.getvalue())
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
    """Read and verify a checkpoint.

    Every array's declared dtype and shape are checked against the metadata
    (p from ``n_features_in`` and ``fit_intercept``, the configured dtype)
    and against the bytes the file really holds *before* anything is
    allocated, so a forged header cannot make the reader allocate more than
    the file's size.

    Raises
    ------
    CheckpointError
        If the file is missing, not an rh-dask checkpoint, of an unsupported
        version, altered since it was written, or internally inconsistent
        (shapes, dtypes, counters, an unknown engine name).
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"no checkpoint file at {path}")
    if not zipfile.is_zipfile(path):
        # Checked first: np.load would otherwise treat a plain .npy file as an
        # array, and any other file as a pickle it refuses to load.
        raise CheckpointError(
            f"{path} is not an rh-dask checkpoint: not a readable .npz archive "
            "(truncated, corrupted or another format)"
        )
    try:
        with zipfile.ZipFile(path) as archive:
            declared = _declared_arrays(path, archive)
            record = _read_record(path, archive, declared["metadata"])
            config = _check_declared(path, record, declared)
        with np.load(path, allow_pickle=False) as npz:
            arrays = {name: npz[name] for name in _ARRAYS}
    except CheckpointError:
        raise
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as exc:
        raise CheckpointError(f"cannot read checkpoint {path}: {exc}") from exc
    digest = record.pop("digest", None)
    if digest != _digest(arrays, record):
        raise CheckpointError(f"{path} failed its integrity check (altered or corrupted)")
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
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{path} is inconsistent: {exc}") from exc
    return Checkpoint(
        config=config,
        state=state,
        feature_names=names,
        engine=str(engine),
        library_version=str(record.get("library_version", "")),
    )


@dataclass(frozen=True)
class _Declared:
    """What an archive member's ``.npy`` header says it holds."""

    dtype: np.dtype
    shape: tuple[int, ...]


def _declared_arrays(path: Path, archive: zipfile.ZipFile) -> dict[str, _Declared]:
    """Read every member's ``.npy`` header (not its data) and check it against its size."""
    members = {info.filename: info for info in archive.infolist()}
    found = sorted(name.removesuffix(".npy") for name in members)
    expected = sorted(["metadata", *_ARRAYS])
    if found != expected or set(members) != {f"{name}.npy" for name in expected}:
        raise CheckpointError(
            f"{path} is not an rh-dask checkpoint (arrays {found}, expected {expected})"
        )
    size = path.stat().st_size
    declared = {}
    for member, info in members.items():
        name = member.removesuffix(".npy")
        stored = info.compress_type == zipfile.ZIP_STORED
        room = size if stored else _MAX_INFLATION * min(info.compress_size, size)
        if info.file_size > room:
            raise CheckpointError(
                f"{path} is inconsistent: {name} claims {info.file_size} bytes, more than "
                f"a {size}-byte file can hold"
            )
        with archive.open(info) as fh:
            version = np.lib.format.read_magic(fh)
            if version == (1, 0):
                shape, _, dtype = np.lib.format.read_array_header_1_0(fh)
            elif version == (2, 0):
                shape, _, dtype = np.lib.format.read_array_header_2_0(fh)
            else:
                raise CheckpointError(f"{path}: {name} has .npy format version {version}")
            offset = fh.tell()
        if dtype.hasobject:
            raise CheckpointError(
                f"{path} is inconsistent: {name} holds Python objects (pickled data), "
                "which rh-dask never loads (allow_pickle=False)"
            )
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes != info.file_size - offset:
            raise CheckpointError(
                f"{path} is inconsistent: {name} declares a {dtype} array of shape {shape} "
                f"({nbytes} bytes) but holds {info.file_size - offset} bytes"
            )
        declared[name] = _Declared(dtype, tuple(shape))
    return declared


def _read_record(path: Path, archive: zipfile.ZipFile, declared: _Declared) -> dict[str, Any]:
    """The metadata's JSON record, with its format and version checked."""
    if declared.dtype.kind != "U" or declared.shape != ():
        raise CheckpointError(f"{path}: metadata is not valid JSON (not a string)")
    with archive.open("metadata.npy") as fh:
        raw = np.lib.format.read_array(fh, allow_pickle=False)
    try:
        record = json.loads(str(raw[()]))
    except (ValueError, TypeError) as exc:
        raise CheckpointError(f"{path}: metadata is not valid JSON") from exc
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not an rh-dask checkpoint")
    version = record.get("format_version")
    if version != FORMAT_VERSION:
        raise CheckpointError(
            f"{path} has checkpoint format version {version!r}; this rh-dask "
            f"({__version__}) reads version {FORMAT_VERSION}"
        )
    return record


def _check_declared(
    path: Path, record: dict[str, Any], declared: dict[str, _Declared]
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
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{path} is inconsistent: {exc}") from exc
    coef_shape, info_shape = HuberState.shapes(d, fit_intercept)
    wanted = {
        "coefficients": (config.np_dtype, coef_shape),
        "information": (config.np_dtype, info_shape),
    }
    for name, (dtype, shape) in wanted.items():
        got = declared[name]
        if got.dtype != dtype or got.shape != shape:
            raise CheckpointError(
                f"{path} is inconsistent: {name} is a {got.dtype} array of shape "
                f"{got.shape}, the metadata says {dtype} of shape {shape}"
            )
    names = declared["feature_names"]
    names_shape = (d,) if has_names else (0,)
    if names.dtype.kind != "U" or names.shape != names_shape:
        raise CheckpointError(
            f"{path} is inconsistent: feature_names is a {names.dtype} array of shape "
            f"{names.shape}, the metadata says strings of shape {names_shape}"
        )
    return config
