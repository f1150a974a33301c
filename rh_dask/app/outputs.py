"""The paths a command writes, checked before it does any work.

A fit that runs for an hour and then cannot save its model has wasted the
hour; so each command checks every path it will write (the model, the report
directory and its files, predictions, the demo's data) before it opens a
cluster or reads data, and refuses with :class:`~rh_dask.app.io.InputError`
(exit code 3) and a one-line reason. The checks write nothing that stays: a
directory's writability is tested by creating and removing a temporary file
in it, which is the only test that also holds for root and for read-only
mounts.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

from .io import InputError

__all__ = ["check_dataset", "check_directory", "check_file", "model_path"]


def model_path(path: str | os.PathLike[str]) -> Path:
    """Where a model saved to ``path`` lands: ``.npz`` appended when it is not the suffix.

    This is the rule of :func:`rh_dask.checkpoint.save_checkpoint`.
    """
    path = Path(path)
    return path if path.suffix == ".npz" else path.with_name(path.name + ".npz")


def _show(path: Path) -> str:
    return repr(os.fspath(path))


def _writable(directory: Path, option: str, shown: Path) -> None:
    try:
        handle, probe = tempfile.mkstemp(prefix=".rh-dask-write-check-", dir=directory)
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise InputError(
            f"{option} {_show(shown)}: cannot write in {_show(directory)} ({reason})"
        ) from None
    os.close(handle)
    os.unlink(probe)


def _existing_ancestor(path: Path) -> Path:
    """``path`` itself or its nearest ancestor that exists (as anything)."""
    current = path
    while not current.exists() and current != current.parent:
        current = current.parent
    return current


def check_file(path: str | os.PathLike[str], option: str, *, overwrite: bool = True) -> Path:
    """Refuse ``path`` unless a file can be written there.

    Parameters
    ----------
    path : str or path-like
        The file the command will write (or replace).
    option : str
        The option that named it, for the message (``--output``).
    overwrite : bool
        Whether an existing file may be replaced; when false an existing
        path is refused with a hint to pass ``--overwrite``.

    Returns
    -------
    Path
        ``path``, user-expanded.

    Raises
    ------
    InputError
        ``path`` is a directory, exists (``overwrite=False``), or its
        directory is missing, not a directory, or not writable.
    """
    path = Path(path).expanduser()
    if path.is_dir():
        raise InputError(f"{option} {_show(path)} is a directory; give a file name")
    return check_dataset(path, option, overwrite=overwrite)


def check_dataset(path: str | os.PathLike[str], option: str, *, overwrite: bool) -> Path:
    """Refuse ``path`` unless a dataset directory (Parquet) can be written there.

    The directory itself is created by the writer, in an existing directory;
    an existing ``path`` (file or directory) is replaced only with
    ``overwrite``.

    Raises
    ------
    InputError
        ``path`` exists (``overwrite=False``), or its directory is missing,
        not a directory, or not writable.
    """
    path = Path(path).expanduser()
    if path.exists() and not overwrite:
        raise InputError(f"{option} {_show(path)} exists; pass --overwrite to replace it")
    parent = path.parent
    if not parent.exists():
        raise InputError(f"{option} {_show(path)}: the directory {_show(parent)} does not exist")
    if not parent.is_dir():
        raise InputError(f"{option} {_show(path)}: {_show(parent)} is not a directory")
    _writable(parent, option, path)
    return path


def check_directory(
    path: str | os.PathLike[str],
    option: str,
    *,
    files: Iterable[str] = (),
    empty: bool = False,
) -> Path:
    """Refuse ``path`` unless it is, or can be created as, a writable directory.

    Parameters
    ----------
    path : str or path-like
        A directory the command creates (with its parents) or writes into.
    option : str
        The option that named it, for the message (``--report``).
    files : iterable of str
        Names of the files the command writes in it; none may be a directory.
    empty : bool
        Refuse an existing directory that holds anything (the demo reads
        back every file of its data directory).

    Returns
    -------
    Path
        ``path``, user-expanded.

    Raises
    ------
    InputError
        ``path`` or one of its ancestors is a file, one of ``files`` is a
        directory, the directory is not empty (``empty=True``), or the
        directory it would be created in is not writable.
    """
    path = Path(path).expanduser()
    base = _existing_ancestor(path)
    if not base.is_dir():
        if base == path:
            raise InputError(f"{option} {_show(path)} is a file, not a directory")
        raise InputError(f"{option} {_show(path)} cannot be created: {_show(base)} is a file")
    if base == path:
        for name in files:
            if (path / name).is_dir():
                raise InputError(
                    f"{option} {_show(path)}: {_show(path / name)} is a directory, "
                    "where the command writes a file"
                )
        if empty and any(path.iterdir()):
            raise InputError(f"{option} {_show(path)} is not empty; give a new or empty directory")
    _writable(base, option, path)
    return path
