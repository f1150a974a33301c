"""How many BLAS threads the NumPy engine runs its own calls with.

``rh-dask.numpy.blas-threads`` is ``"auto"`` or a count. A count is used as
given. ``"auto"`` is a rule from measurements of the engine on the sweep's
shapes (docs/performance.md, NumPy engine): on a host of at most
:data:`SINGLE_THREAD_MAX_CORES` usable cores one thread was as fast or faster
on every shape class, and a second thread cost 1.9-24x whenever any other
work shared the cores (OpenBLAS's spinning threads compete with it), so the
engine takes one thread there. On larger hosts the rule has not been
measured, and ``"auto"`` leaves the count in force (the caller's or the
process's).

The count is fixed per engine, never per batch: multithreaded BLAS sums in
an order that depends on the thread count, and a stream is reproducible bit
for bit only with one count throughout.
"""

from __future__ import annotations

import functools
import os
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from threadpoolctl import ThreadpoolController

from ..exceptions import ValidationError

__all__ = [
    "SINGLE_THREAD_MAX_CORES",
    "blas_controller",
    "blas_limit",
    "resolve_blas_threads",
    "usable_cores",
]

#: Usable cores up to which ``"auto"`` runs the engine's BLAS on one thread.
SINGLE_THREAD_MAX_CORES = 2


@functools.cache
def blas_controller() -> ThreadpoolController:
    """The process's thread pools, inspected once."""
    return ThreadpoolController()


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def resolve_blas_threads(setting: int | str, cores: int | None = None) -> int | None:
    """The engine's BLAS thread count for ``setting`` (``None``: leave it as it is).

    Parameters
    ----------
    setting : int or "auto"
        ``rh-dask.numpy.blas-threads``: a count >= 1, or ``"auto"``.
    cores : int, optional
        Usable cores of the host (default: :func:`usable_cores`).

    Raises
    ------
    ValidationError
        When ``setting`` is neither ``"auto"`` nor a whole number >= 1.
    """
    if isinstance(setting, str) and setting.strip().lower() == "auto":
        cores = usable_cores() if cores is None else cores
        return 1 if cores <= SINGLE_THREAD_MAX_CORES else None
    if isinstance(setting, bool) or not isinstance(setting, int) or setting < 1:
        raise ValidationError(
            f'blas_threads must be "auto" or a whole number >= 1, got {setting!r}'
        )
    return setting


def blas_limit(threads: int | None) -> AbstractContextManager[Any]:
    """A context running BLAS on ``threads`` threads, restoring the count on exit."""
    if threads is None:
        return nullcontext()
    return blas_controller().limit(limits=threads, user_api="blas")
