"""Keeping chunk-sized allocations on malloc's heap while a stream runs (glibc only).

A Dask nanny starts its worker with ``MALLOC_TRIM_THRESHOLD_`` set (64 KiB by
default), which also freezes glibc's mmap threshold at 128 KiB. Every chunk a
loading thread allocates is then a fresh ``mmap``: the kernel zeroes it page
by page on first touch, and ``munmap`` interrupts every core running one of
the worker's threads (the engine's too) to flush its TLB. What that costs a
loading pipeline is measured in ``docs/performance.md`` ("The pipeline without
Dask").

When the setting ``rh-dask.distributed.heap-for-chunks`` asks for it (it is
off by default: the change is the whole worker process's), the engine's actor
calls :func:`heap_for_chunks` while a stream runs. It stops malloc from using ``mmap``
(``M_MMAP_MAX=0``: glibc caps the mmap threshold at 32 MiB, below a chunk of
262,144 × 90 float32) and raises the trim threshold, so that freed chunks stay
in the heap and are reused. Afterwards it restores the process's settings and
returns the free memory to the system (``malloc_trim``). The setting is the
process's: two streams on one worker share it, and the first to end restores
it (the other one then only loses speed).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from collections.abc import Callable

_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
#: glibc's defaults, used when the environment does not set them.
_DEFAULT_THRESHOLD = 128 << 10
_DEFAULT_MMAP_MAX = 65536


def _glibc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.mallopt  # noqa: B018 - present in glibc only
        libc.malloc_trim  # noqa: B018
    except (OSError, AttributeError):
        return None
    return libc


def heap_for_chunks(trim_bytes: int = 1 << 30) -> Callable[[], None] | None:
    """Serve every allocation from the heap and keep freed memory there.

    Parameters
    ----------
    trim_bytes : int
        Free memory the heap may keep at its top before returning it.

    Returns
    -------
    callable or None
        Restores the settings the environment gave the process (glibc's
        defaults otherwise) and trims the heap; ``None`` where malloc is not
        glibc's (nothing was changed).
    """
    libc = _glibc()
    if libc is None:
        return None

    def restore() -> None:
        env = os.environ
        libc.mallopt(_M_MMAP_MAX, int(env.get("MALLOC_MMAP_MAX_", _DEFAULT_MMAP_MAX)))
        libc.mallopt(_M_TRIM_THRESHOLD, int(env.get("MALLOC_TRIM_THRESHOLD_", _DEFAULT_THRESHOLD)))
        libc.malloc_trim(0)

    if not (libc.mallopt(_M_MMAP_MAX, 0) and libc.mallopt(_M_TRIM_THRESHOLD, int(trim_bytes))):
        restore()
        return None

    return restore
