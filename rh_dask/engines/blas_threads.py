"""BLAS threads around the NumPy engine's calls, and the host's cores and cache.

``rh-dask.numpy.blas-threads`` is ``"auto"`` or a count of the threads that
run the engine's products (:mod:`rh_dask.engines.row_blocks`). Either way each
BLAS call runs on one thread (:func:`one_blas_thread`): BLAS's own threads sum
in an order that depends on their count, and they spin after each call
(measured: about 0.13 s on the dev box's OpenBLAS 0.3.31, one core each),
which cost the engine 1.9-24x whenever other work shared the cores. The
engine's own threads run fixed row blocks instead, so that their count, given
or measured, changes no bit.
"""

from __future__ import annotations

import functools
import os
import threading
import time
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from threadpoolctl import ThreadpoolController

from ..exceptions import ValidationError

__all__ = [
    "ProcessIdle",
    "blas_controller",
    "blas_threads_in_force",
    "cpu_caches",
    "last_level_cache_bytes",
    "one_blas_thread",
    "resolve_blas_threads",
    "usable_cores",
]


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


_SIZE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
#: Where Linux describes the CPUs.
SYSFS_CPUS = Path("/sys/devices/system/cpu")


def cpu_caches(cpu: int | None = None, sysfs: Path = SYSFS_CPUS) -> list[dict[str, Any]]:
    """The caches of ``cpu`` (default: this process's first usable core), from sysfs.

    Each as its ``level`` (int), ``type``, ``size`` and ``shared_cpu_list`` as
    sysfs writes them (``"32768K"``, ``"0-1"``); an empty list where the OS
    does not say (not Linux, or a container without sysfs).
    """
    if cpu is None:
        try:
            cpu = min(os.sched_getaffinity(0))
        except (AttributeError, OSError, ValueError):
            cpu = 0
    caches = []
    for index in sorted((sysfs / f"cpu{cpu}" / "cache").glob("index*")):
        try:
            entry: dict[str, Any] = {
                name: (index / name).read_text().strip()
                for name in ("level", "type", "size", "shared_cpu_list")
            }
        except OSError:
            continue
        entry["level"] = int(entry["level"])
        caches.append(entry)
    return caches


@functools.cache
def last_level_cache_bytes(sysfs: Path = SYSFS_CPUS) -> int | None:
    """Size of the largest data cache of this process's first usable core (:func:`cpu_caches`).

    ``None`` where the OS does not say. Read once per process (``sysfs``: the
    CPUs' directory, for tests).
    """
    sizes = []
    for cache in cpu_caches(sysfs=sysfs):
        text = cache["size"].upper()
        number = text.rstrip("KMG")
        if cache["type"] != "Instruction" and number.isdigit():
            sizes.append(int(number) * _SIZE_UNITS[text[len(number) :]])
    return max(sizes) if sizes else None


def resolve_blas_threads(setting: int | str) -> int | None:
    """The engine's thread count for ``setting`` (``None``: measured, ``"auto"``).

    Parameters
    ----------
    setting : int or "auto"
        ``rh-dask.numpy.blas-threads``: a count >= 1, or ``"auto"``.

    Raises
    ------
    ValidationError
        When ``setting`` is neither ``"auto"`` nor a whole number >= 1.
    """
    if isinstance(setting, str) and setting.strip().lower() == "auto":
        return None
    if isinstance(setting, bool) or not isinstance(setting, int) or setting < 1:
        raise ValidationError(
            f'blas_threads must be "auto" or a whole number >= 1, got {setting!r}'
        )
    return setting


def blas_threads_in_force() -> int:
    """The largest thread count of this process's BLAS libraries now (1 without any)."""
    counts = [int(lib["num_threads"]) for lib in blas_controller().select(user_api="blas").info()]
    return max(counts, default=1)


def _release_openblas_control() -> None:
    """Let any thread set OpenBLAS's thread count again (threadpoolctl >= 3.8).

    threadpoolctl 3.8 lets only one "controlling" thread set the count of an
    OpenBLAS on its own threads and ignores the others' calls, until that
    thread clears it. The engine's calls run on whichever thread the user, a
    Dask worker or the stream's consumer gives them, and must run BLAS on one
    thread there. This is the one place that reaches for it:
    ``OpenBLASController.clear_controlling_thread``; without it (older
    threadpoolctl) every thread may set the count, and nothing is needed.
    """
    import threadpoolctl

    clear = getattr(
        getattr(threadpoolctl, "OpenBLASController", None), "clear_controlling_thread", None
    )
    if clear is not None:
        clear(force=True)


class _OneThread:
    """Every BLAS library of the process on one thread while any thread is inside.

    BLAS thread counts are per process: a plain limit that one thread restores
    on exit would change the count under another thread still computing. So
    the first thread in sets the limit (taking the control threadpoolctl
    gives one thread, see :func:`_release_openblas_control`) and the last one
    out restores the counts in force before and gives the control back.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._inside = 0
        self._limiter: Any = None

    def __enter__(self) -> None:
        with self._lock:
            if self._inside == 0:
                limiter = blas_controller().limit(limits=1, user_api="blas")
                if blas_threads_in_force() != 1:  # another thread holds the control
                    _release_openblas_control()
                    limiter = blas_controller().limit(limits=1, user_api="blas")
                self._limiter = limiter
            self._inside += 1

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self._inside -= 1
            if self._inside == 0:
                limiter, self._limiter = self._limiter, None
                limiter.restore_original_limits()
                _release_openblas_control()


_ONE_THREAD = _OneThread()


def one_blas_thread() -> AbstractContextManager[None]:
    """A context in which the process's BLAS runs on one thread (see :class:`_OneThread`)."""
    return _ONE_THREAD


class ProcessIdle:
    """Waits until the BLAS threads a NumPy run woke have gone back to sleep.

    OpenBLAS's worker threads spin after each threaded call (measured: about
    0.13 s on the dev box's OpenBLAS 0.3.31, one core each), and
    ``threadpool_limits`` does not stop them. Work started meanwhile, such
    as a GPU stream whose host thread and copy threads need cores, shares
    the CPUs with them. This measures how many cores the whole process keeps
    busy while the calling thread sleeps one ``step``
    (:func:`time.process_time` over wall time), and :meth:`wait` sleeps until
    that is back at a baseline measured before.

    Parameters
    ----------
    step : float
        Seconds of one measurement.
    margin : float
        Cores above the baseline that still count as idle.
    cpu, wall, sleep : callable, optional
        The process's CPU seconds, wall seconds, and sleep (tests script them).
    """

    def __init__(
        self,
        step: float = 0.01,
        margin: float = 0.5,
        *,
        cpu: Any = time.process_time,
        wall: Any = time.perf_counter,
        sleep: Any = time.sleep,
    ) -> None:
        self.step, self.margin = step, margin
        self._cpu, self._wall, self._sleep = cpu, wall, sleep

    def busy(self) -> float:
        """Cores the process kept busy while this thread slept one step."""
        cpu, wall = self._cpu(), self._wall()
        self._sleep(self.step)
        elapsed = self._wall() - wall
        return (self._cpu() - cpu) / elapsed if elapsed > 0 else 0.0

    def wait(self, baseline: float, max_seconds: float) -> float:
        """Sleep until at most ``baseline + margin`` cores are busy; the seconds waited.

        Gives up after ``max_seconds`` (another thread of the process may be
        busy for its own reasons); ``max_seconds <= 0`` returns at once.
        """
        start = self._wall()
        while self._wall() - start < max_seconds:
            if self.busy() <= baseline + self.margin:
                break
        return self._wall() - start
