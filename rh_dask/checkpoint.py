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

import hashlib
import io
import json
import os
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ._version import __version__
from .config import HuberConfig
from .exceptions import CheckpointError, ValidationError
from .state import HuberState

FORMAT = "rh-dask-checkpoint"
FORMAT_VERSION = 1
_ARRAYS = ("coefficients", "information", "feature_names")


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
    """Write ``checkpoint`` to ``path`` atomically (write then rename)."""
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
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(buffer.getvalue())
    os.replace(tmp, path)
    return path


def load_checkpoint(path: str | os.PathLike[str]) -> Checkpoint:
    """Read and verify a checkpoint.

    Raises
    ------
    CheckpointError
        If the file is missing, not an rh-dask checkpoint, of an unsupported
        version, altered since it was written, or internally inconsistent.
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
        with np.load(path, allow_pickle=False) as npz:
            files = set(npz.files)
            expected = {"metadata", *_ARRAYS}
            if files != expected:
                raise CheckpointError(
                    f"{path} is not an rh-dask checkpoint (arrays {sorted(files)}, "
                    f"expected {sorted(expected)})"
                )
            raw = npz["metadata"]
            arrays = {name: npz[name] for name in _ARRAYS}
    except CheckpointError:
        raise
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as exc:
        raise CheckpointError(f"cannot read checkpoint {path}: {exc}") from exc
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
    digest = record.pop("digest", None)
    if digest != _digest(arrays, record):
        raise CheckpointError(f"{path} failed its integrity check (altered or corrupted)")
    try:
        config = HuberConfig.from_dict(record["config"])
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
        engine = str(record["engine"])
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{path} is inconsistent: {exc}") from exc
    return Checkpoint(
        config=config,
        state=state,
        feature_names=names,
        engine=engine,
        library_version=str(record.get("library_version", "")),
    )
