"""Where a Dask stream's checkpoints are kept: a local directory or an fsspec URL.

A :class:`CheckpointStore` holds one file, ``stream.npz``, the latest walk
checkpoint of a stream (see :mod:`rh_dask.checkpoint`), and replaces it
atomically, so a reader finds either the previous checkpoint or the new one,
never a mix. Locations are local paths or any URL fsspec opens
(``"memory://run"``, ``"s3://bucket/run"``, ``"file:///tmp/run"``); a location
that is an existing file is that checkpoint file, read only.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from pathlib import Path
from typing import Any

from .checkpoint import (
    Checkpoint,
    _write_atomically,
    checkpoint_bytes,
    checkpoint_from_bytes,
    load_checkpoint,
)
from .exceptions import CheckpointError, ValidationError

__all__ = ["STREAM_FILE", "CheckpointStore"]

#: Name of the checkpoint file in a store's directory.
STREAM_FILE = "stream.npz"
#: fsspec protocols of object stores: an object appears whole on a single PUT,
#: and "moving" one is a copy then a delete, so the checkpoint is written directly.
_OBJECT_STORES = frozenset(
    {"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oss", "r2", "b2", "swift"}
)


def _is_url(location: str) -> bool:
    return "://" in location or "::" in location


class CheckpointStore:
    """The stream checkpoint kept at ``location``.

    Parameters
    ----------
    location : str or os.PathLike
        A directory (created on the first write) or an fsspec URL of one;
        ``stream.npz`` in it holds the checkpoint. An existing file is read
        as the checkpoint itself and cannot be written.

    Attributes
    ----------
    location : str
        ``location`` as given.
    path : str
        Where the checkpoint file lives (a local path, or a URL with its protocol).

    Raises
    ------
    CheckpointError
        When fsspec cannot open ``location`` (an unknown protocol, a
        filesystem package that is not installed).
    ValidationError
        When ``location`` is not a string or path.
    """

    def __init__(self, location: str | os.PathLike[str]) -> None:
        if not isinstance(location, (str, os.PathLike)):
            raise ValidationError(
                f"a checkpoint location is a path or URL string, got {type(location).__name__}"
            )
        text = os.fspath(location)
        if not isinstance(text, str) or not text:
            raise ValidationError(f"a checkpoint location is a non-empty string, got {text!r}")
        self._location = text
        self._fs: Any = None
        self._root: str = ""
        self._local: Path | None = None
        if _is_url(text):
            import fsspec
            from fsspec.implementations.local import LocalFileSystem

            try:
                fs, root = fsspec.core.url_to_fs(text)
            except (ImportError, ValueError, OSError) as exc:
                raise CheckpointError(f"cannot open checkpoint location {text}: {exc}") from exc
            if isinstance(fs, LocalFileSystem):
                self._local = Path(root)
            else:
                self._fs, self._root = fs, root.rstrip("/")
        else:
            self._local = Path(text).expanduser()
        if self._local is not None:
            self._is_file = self._local.is_file()
        else:
            try:
                self._is_file = bool(self._fs.isfile(self._root))
            except OSError as exc:
                raise CheckpointError(f"cannot open checkpoint location {text}: {exc}") from exc

    @property
    def location(self) -> str:
        return self._location

    @property
    def path(self) -> str:
        if self._local is not None:
            return str(self._local if self._is_file else self._local / STREAM_FILE)
        return str(self._fs.unstrip_protocol(self._target()))

    def _target(self) -> str:
        """The checkpoint file's path inside the fsspec filesystem."""
        return self._root if self._is_file else f"{self._root}/{STREAM_FILE}"

    def write(self, checkpoint: Checkpoint) -> str:
        """Replace the store's checkpoint with ``checkpoint`` atomically; return :attr:`path`.

        Locally the file is written beside ``stream.npz``, flushed and
        renamed over it; on an fsspec filesystem it is written as
        ``stream.npz.tmp-<uuid>`` and moved over it, except on object stores,
        whose single PUT already replaces an object whole. The directory is
        created when missing.

        Raises
        ------
        CheckpointError
            When the store is a checkpoint file (read only).
        OSError
            When the checkpoint cannot be written: the previous checkpoint is
            left as it was and no temporary file remains.
        """
        if self._is_file:
            raise CheckpointError(
                f"{self._location} is a checkpoint file, read only; give a directory to "
                "write stream checkpoints to"
            )
        data = checkpoint_bytes(checkpoint)
        if self._local is not None:
            self._local.mkdir(parents=True, exist_ok=True)
            _write_atomically(self._local / STREAM_FILE, data)
            return self.path
        fs, target = self._fs, self._target()
        fs.makedirs(self._root, exist_ok=True)
        protocols = {fs.protocol} if isinstance(fs.protocol, str) else set(fs.protocol)
        if protocols & _OBJECT_STORES:
            fs.pipe_file(target, data)
            return self.path
        tmp = f"{target}.tmp-{uuid.uuid4().hex}"
        try:
            fs.pipe_file(tmp, data)
            fs.mv(tmp, target)
        except BaseException:
            with contextlib.suppress(Exception):
                if fs.exists(tmp):
                    fs.rm(tmp)
            raise
        return self.path

    def read(self) -> Checkpoint | None:
        """The store's checkpoint, or ``None`` when it holds none.

        Raises
        ------
        CheckpointError
            When the checkpoint file cannot be read, or is corrupted,
            truncated or otherwise refused (see
            :func:`rh_dask.checkpoint.checkpoint_from_bytes`); nothing is returned.
        """
        if self._local is not None:
            target = Path(self.path)
            if not self._is_file and not target.exists():
                return None
            return load_checkpoint(target)
        fs, target = self._fs, self._target()
        try:
            if not fs.exists(target):
                if self._is_file:
                    raise CheckpointError(f"no checkpoint file at {self.path}")
                return None
            data = fs.cat_file(target)
        except OSError as exc:
            raise CheckpointError(f"cannot read checkpoint {self.path}: {exc}") from exc
        return checkpoint_from_bytes(bytes(data), self.path)

    def __reduce__(self) -> tuple[Any, ...]:
        # Rebuilt from the location where it is unpickled (a worker running a detached fit).
        return (CheckpointStore, (self._location,))

    def __repr__(self) -> str:
        return f"CheckpointStore({self._location!r})"
