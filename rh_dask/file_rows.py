"""Rows of a C-ordered ``.npy`` file as byte ranges: the chunk tasks of :func:`~rh_dask.read_npy`.

A chunk of such a file is one contiguous run of bytes, so it can be read
with one ``pread`` (no memory map, nothing but the chunk in memory) or, on a
loading worker that relays chunks over TCP, handed to the socket straight
from the page cache with ``sendfile`` without entering the worker's memory
(``rh_dask.distributed.push``). This module knows files and bytes only: no
Dask, no sockets.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from .exceptions import InputError

__all__ = ["FileRows", "NpyLayout", "npy_layout"]


@dataclass(frozen=True)
class NpyLayout:
    """Where a ``.npy`` file's array lies in it.

    Attributes
    ----------
    path : str
    offset : int
        Bytes of the header: the array's first byte.
    shape : tuple of int
    dtype : str
        The array's dtype (``numpy.dtype.str``, byte order included).
    file_bytes : int
        The file's size when it was opened: a file whose size changed since
        is refused when read.
    """

    path: str
    offset: int
    shape: tuple[int, ...]
    dtype: str
    file_bytes: int

    @property
    def row_bytes(self) -> int:
        return int(np.prod(self.shape[1:], dtype=np.int64)) * np.dtype(self.dtype).itemsize


def npy_layout(path: str | os.PathLike[str]) -> NpyLayout:
    """Read the header of a ``.npy`` file.

    Raises
    ------
    InputError
        Not a readable ``.npy`` file, a Fortran-ordered array, an object or
        structured dtype, a 0-D array, or a file shorter than its header says.
    """
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            version = np.lib.format.read_magic(f)
            if version == (1, 0):
                shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
            else:
                shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
            offset = f.tell()
            size = os.fstat(f.fileno()).st_size
    except (OSError, ValueError) as exc:
        raise InputError(f"cannot read {path!r} as .npy: {exc}", path=path) from exc
    if fortran and len(shape) > 1:
        raise InputError(
            f"{path!r} holds a Fortran-ordered array: its rows are not contiguous in the "
            "file. Save it row-major (numpy.save(path, numpy.ascontiguousarray(a))) or read "
            "it with dask.array.from_array(numpy.load(path, mmap_mode='r'))",
            path=path,
        )
    if dtype.hasobject or dtype.fields is not None or dtype.subdtype is not None:
        raise InputError(f"{path!r} holds a {dtype} array; numbers are needed", path=path)
    if len(shape) == 0:
        raise InputError(f"{path!r} holds a 0-D array; rows are needed", path=path)
    layout = NpyLayout(path, int(offset), tuple(int(n) for n in shape), dtype.str, int(size))
    needed = offset + shape[0] * layout.row_bytes
    if size < needed:
        raise InputError(
            f"{path!r} is truncated: its header describes {needed} bytes, the file has {size}",
            path=path,
        )
    return layout


@dataclass(frozen=True)
class FileRows:
    """Rows ``start:stop`` of the array in a ``.npy`` file; calling it reads them.

    One task of a :func:`~rh_dask.read_npy` array. Small and picklable: only
    the path and the numbers travel with the task.

    Attributes
    ----------
    layout : NpyLayout
    start, stop : int
    """

    layout: NpyLayout
    start: int
    stop: int

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.stop - self.start, *self.layout.shape[1:])

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.layout.dtype)

    @property
    def byte_offset(self) -> int:
        """Offset of the first row's first byte in the file."""
        return self.layout.offset + self.start * self.layout.row_bytes

    @property
    def nbytes(self) -> int:
        return (self.stop - self.start) * self.layout.row_bytes

    def check_file(self, fd: int) -> None:
        """Refuse a file whose size changed since the array was opened (:class:`InputError`)."""
        size = os.fstat(fd).st_size
        if size != self.layout.file_bytes:
            raise InputError(
                f"{self.layout.path!r} changed since it was opened: {size} bytes, "
                f"{self.layout.file_bytes} then",
                path=self.layout.path,
            )

    def __call__(self) -> np.ndarray:
        out = np.empty(self.shape, dtype=self.dtype)
        view = memoryview(out.reshape(-1).view(np.uint8))
        path = self.layout.path
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as exc:
            raise InputError(f"cannot open {path!r}: {exc}", path=path) from exc
        try:
            self.check_file(fd)
            done, total = 0, self.nbytes
            while done < total:
                got = os.preadv(fd, [view[done:]], self.byte_offset + done)
                if got <= 0:
                    raise InputError(f"{path!r} ended before rows {self.start}:{self.stop}")
                done += got
        finally:
            os.close(fd)
        return out
