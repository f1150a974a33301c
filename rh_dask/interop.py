"""Reading checkpoints written by renewable-huber, so that its streams continue in rh-dask.

renewable-huber (the single-machine package rh-dask's numerical contract
shares its method with) saves a fitted model as an ``.npz`` archive of
exactly three members:

* ``coefficients`` (p,) and ``information`` (p, p): β with the intercept
  last and the unnormalised information J, in the model's dtype;
* ``metadata``: a 0-d unicode array holding JSON with ``format_version``,
  ``config`` (its estimator parameters), ``n_samples_seen``,
  ``batch_count``, ``previous_lambda``, ``n_features_in``,
  ``fit_intercept``, ``feature_names_in`` (a list of strings or null) and,
  from format version 2, ``weight_sum``. A version-1 file predates
  frequency weights: its weight sum is its ``n_samples_seen``.

Both versions map field for field onto :class:`~rh_dask.state.HuberState`
(with ``score_variance`` None: renewable-huber does not accumulate K) and
its statistical parameters onto :class:`~rh_dask.config.HuberConfig`. Its
execution parameters (``backend``, ``device``, ``n_jobs``,
``cuda_graphs``) do not change the numbers and are not carried over; the
one that does, ``cuda_fast_math=True``, has no rh-dask counterpart and is
refused. The archive is read like rh-dask's own: every member's ``.npy``
header is checked against the bytes the file holds before anything is
allocated, and nothing is unpickled.
"""

from __future__ import annotations

import json
import math
import zipfile
import zlib
from typing import Any

import numpy as np

from .checkpoint_content import Checkpoint, as_count, as_number
from .config import HuberConfig
from .exceptions import CheckpointError, ValidationError
from .state import HuberState

__all__ = [
    "RENEWABLE_HUBER_VERSIONS",
    "is_renewable_huber_archive",
    "renewable_huber_checkpoint",
]

#: The renewable-huber checkpoint format versions rh-dask reads.
RENEWABLE_HUBER_VERSIONS = (1, 2)
_MEMBERS = frozenset({"coefficients.npy", "information.npy", "metadata.npy"})
#: Parameters of renewable-huber's estimator that are rh-dask's HuberConfig fields.
_STATISTICAL = (
    "tau",
    "penalty",
    "lambda_scale",
    "bandwidth_scale",
    "fit_intercept",
    "max_iter",
    "tol",
    "ridge",
    "dtype",
)
#: Parameters that choose where and how renewable-huber computes, not what.
_EXECUTION = ("backend", "device", "n_jobs", "cuda_graphs")
_FAST_MATH = "cuda_fast_math"
_COUNTERS = ("n_samples_seen", "batch_count", "previous_lambda", "n_features_in", "fit_intercept")
_METADATA_KEYS = frozenset({"format_version", "config", "feature_names_in", "weight_sum"}) | set(
    _COUNTERS
)
_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))
#: Deflate expands data at most about 1032-fold: more bytes per stored byte is forged.
_MAX_INFLATION = 1100


def is_renewable_huber_archive(archive: zipfile.ZipFile) -> bool:
    """Whether ``archive`` has the members of a renewable-huber checkpoint, and only those.

    rh-dask's own checkpoints always hold a ``feature_names`` member, so the
    two layouts never match each other.
    """
    return {info.filename for info in archive.infolist()} == _MEMBERS


def renewable_huber_checkpoint(archive: zipfile.ZipFile, size: int, source: str) -> Checkpoint:
    """The rh-dask :class:`~rh_dask.checkpoint.Checkpoint` of a renewable-huber checkpoint.

    Parameters
    ----------
    archive : zipfile.ZipFile
        The open ``.npz`` archive (see :func:`is_renewable_huber_archive`).
    size : int
        The size of the file in bytes, the most any member may claim.
    source : str
        Where the file came from, named in error messages.

    Returns
    -------
    Checkpoint
        The state (``score_variance`` None), the configuration, the feature
        names, ``engine="auto"`` (the stream continues on the engine rh-dask
        picks) and ``library_version`` naming renewable-huber's format.

    Raises
    ------
    CheckpointError
        When a member is not what the format holds (an unknown metadata key,
        a version other than 1 or 2, an array of another dtype or shape, a
        counter of the wrong type or range, pickled data) or a parameter has
        no rh-dask counterpart; the message names ``source`` and the field.
    """
    where = f"{source} (a renewable-huber checkpoint)"
    try:
        metadata = _metadata(archive, size, where)
        version = metadata["format_version"]
        config = _config(metadata["config"], where)
        state = _state(archive, size, metadata, config, version, where)
        names = _feature_names(metadata.get("feature_names_in"), state.n_features_in, where)
    except ValidationError as exc:
        raise CheckpointError(f"{where} is inconsistent: {exc}") from exc
    return Checkpoint(
        config=config,
        state=state,
        feature_names=names,
        engine="auto",
        library_version=f"renewable-huber (checkpoint format {version})",
    )


def _member(archive: zipfile.ZipFile, name: str, size: int, where: str) -> np.ndarray:
    """Member ``name``'s array, its header checked against the file before it is read."""
    info = archive.getinfo(f"{name}.npy")
    stored = info.compress_type == zipfile.ZIP_STORED
    room = size if stored else _MAX_INFLATION * min(info.compress_size, size)
    if info.file_size > room:
        raise CheckpointError(
            f"{where} is inconsistent: {name} claims {info.file_size} bytes, more than a "
            f"{size}-byte file can hold"
        )
    try:
        return _read_member(archive, info, name, where)
    except (zlib.error, EOFError, zipfile.BadZipFile) as exc:
        raise CheckpointError(f"{where}: cannot read {name} (corrupted): {exc}") from exc


def _read_member(
    archive: zipfile.ZipFile, info: zipfile.ZipInfo, name: str, where: str
) -> np.ndarray:
    with archive.open(info) as fh:
        version = np.lib.format.read_magic(fh)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(fh)
        elif version == (2, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(fh)
        else:
            raise CheckpointError(f"{where}: {name} has .npy format version {version}")
        if dtype.hasobject:
            raise CheckpointError(
                f"{where} is inconsistent: {name} holds Python objects (pickled data), which "
                "rh-dask never loads"
            )
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes != info.file_size - fh.tell():
            raise CheckpointError(
                f"{where} is inconsistent: {name} declares a {dtype} array of shape {shape} "
                f"({nbytes} bytes) but holds {info.file_size - fh.tell()} bytes"
            )
        data = fh.read(nbytes)
    order = "F" if fortran else "C"
    return np.frombuffer(data, dtype=dtype).reshape(shape, order=order).copy(order="C")


def _metadata(archive: zipfile.ZipFile, size: int, where: str) -> dict[str, Any]:
    """The JSON record, with its keys and format version checked."""
    raw = _member(archive, "metadata", size, where)
    if raw.dtype.kind != "U" or raw.shape != ():
        raise CheckpointError(
            f"{where} is inconsistent: metadata is a {raw.dtype} array of shape {raw.shape}, "
            "not a JSON string"
        )
    try:
        record = json.loads(str(raw[()]))
    except ValueError as exc:
        raise CheckpointError(f"{where}: metadata is not valid JSON ({exc})") from exc
    if not isinstance(record, dict):
        raise CheckpointError(
            f"{where}: metadata is a JSON {type(record).__name__}, not an object"
        )
    version = record.get("format_version")
    if isinstance(version, bool) or version not in RENEWABLE_HUBER_VERSIONS:
        raise CheckpointError(
            f"{where} has format version {version!r}; rh-dask reads renewable-huber's "
            f"versions {', '.join(map(str, RENEWABLE_HUBER_VERSIONS))}"
        )
    required = {"config", *_COUNTERS} | ({"weight_sum"} if version >= 2 else set())
    allowed = _METADATA_KEYS if version >= 2 else _METADATA_KEYS - {"weight_sum"}
    missing = sorted(required - set(record))
    unknown = sorted(set(record) - allowed)
    if missing or unknown:
        raise CheckpointError(
            f"{where} is inconsistent: metadata of format version {version} "
            + "; ".join(
                part
                for part in (
                    f"lacks {missing}" if missing else "",
                    f"has keys rh-dask does not know: {unknown}" if unknown else "",
                )
                if part
            )
        )
    return record


def _config(raw: Any, where: str) -> HuberConfig:
    """rh-dask's configuration for renewable-huber's parameters ``raw``.

    A statistical parameter the file does not record takes renewable-huber's
    default, which is rh-dask's (the same method and defaults).
    """
    if not isinstance(raw, dict):
        raise CheckpointError(f"{where}: config is a JSON {type(raw).__name__}, not an object")
    unknown = sorted(set(raw) - set(_STATISTICAL) - set(_EXECUTION) - {_FAST_MATH})
    if unknown:
        raise CheckpointError(
            f"{where} has parameters rh-dask does not know: {unknown} (it reads "
            f"{list(_STATISTICAL)}, and ignores {list(_EXECUTION)}, which do not change "
            "the estimate)"
        )
    fast_math = raw.get(_FAST_MATH, False)
    if fast_math is not False:
        raise CheckpointError(
            f"{where} has {_FAST_MATH}={fast_math!r}: renewable-huber's approximate CUDA math "
            "has no rh-dask counterpart (every rh-dask engine computes exactly in the "
            "configured dtype); refit the stream, or save it from a model with "
            f"{_FAST_MATH}=False"
        )
    try:
        return HuberConfig(**{key: raw[key] for key in _STATISTICAL if key in raw})
    except ValidationError as exc:
        raise CheckpointError(f"{where} has a parameter rh-dask refuses: {exc}") from exc


def _state(
    archive: zipfile.ZipFile,
    size: int,
    metadata: dict[str, Any],
    config: HuberConfig,
    version: int,
    where: str,
) -> HuberState:
    """The state the file holds, in the configured dtype, checked."""
    d = as_count("n_features_in", metadata["n_features_in"], 1)
    fit_intercept = metadata["fit_intercept"]
    if not isinstance(fit_intercept, bool):
        raise ValidationError(f"fit_intercept is {fit_intercept!r}, not a bool")
    if fit_intercept != config.fit_intercept:
        raise ValidationError(
            f"the state has fit_intercept={fit_intercept}, its config {config.fit_intercept}"
        )
    n_seen = as_count("n_samples_seen", metadata["n_samples_seen"])
    batches = as_count("batch_count", metadata["batch_count"])
    weight_sum = float(n_seen)
    if version >= 2:
        weight_sum = as_number("weight_sum", metadata["weight_sum"], minimum=0.0)
    if n_seen > 0 and weight_sum == 0:
        raise ValidationError(f"weight_sum is 0 after {n_seen} samples")
    coef_shape, info_shape = HuberState.shapes(d, fit_intercept)
    arrays = {}
    for name, shape in (("coefficients", coef_shape), ("information", info_shape)):
        arr = _member(archive, name, size, where)
        if arr.dtype not in _FLOATS or arr.shape != shape:
            raise ValidationError(
                f"{name} is a {arr.dtype} array of shape {arr.shape}, the metadata says "
                f"float32 or float64 of shape {shape}"
            )
        arrays[name] = arr.astype(config.np_dtype)
    state = HuberState(
        coefficients=arrays["coefficients"],
        information=arrays["information"],
        n_samples_seen=n_seen,
        batch_count=batches,
        previous_lambda=as_number("previous_lambda", metadata["previous_lambda"], minimum=0.0),
        weight_sum=weight_sum,
        n_features_in=d,
        fit_intercept=fit_intercept,
        score_variance=None,
    )
    state.validate(config.np_dtype)
    return state


def _feature_names(raw: Any, d: int, where: str) -> np.ndarray | None:
    if raw is None:
        return None
    if not isinstance(raw, list) or len(raw) != d or not all(isinstance(n, str) for n in raw):
        raise ValidationError(
            f"feature_names_in is {raw!r}, not a list of {d} strings (one per feature) or null"
        )
    return np.asarray(raw, dtype=str)
