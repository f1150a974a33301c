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

Where ``"auto"`` takes one thread on a host of at least two usable cores,
the engine may run products that do not depend on each other side by side
instead (:func:`side_executor`): each is the same one-thread BLAS call it
would be alone, so the bits do not depend on whether, or how much, they
overlap. Whether it pays depends on what else the host runs (a second core
that is idle halves the commit's two Grams; one that is busy made them up to
1.9x slower), so it is chosen by measurement, per shape class, while the
process runs (:class:`SideChooser`); the choice cannot change a result.
"""

from __future__ import annotations

import functools
import os
import statistics
import time
from collections import deque
from collections.abc import Hashable
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from threadpoolctl import ThreadpoolController

from ..exceptions import ValidationError

__all__ = [
    "SINGLE_THREAD_MAX_CORES",
    "ProcessIdle",
    "SideChooser",
    "blas_controller",
    "blas_limit",
    "blas_threads_in_force",
    "resolve_blas_threads",
    "side_by_side",
    "side_chooser",
    "side_executor",
    "usable_cores",
]

#: Usable cores up to which ``"auto"`` runs the engine's BLAS on one thread.
SINGLE_THREAD_MAX_CORES = 2


@functools.cache
def blas_controller() -> ThreadpoolController:
    """The process's thread pools, inspected once."""
    return ThreadpoolController()


@functools.cache
def side_executor() -> ThreadPoolExecutor:
    """The process's one extra thread for the NumPy engine's side-by-side products.

    One worker, shared by every engine of the process (engines on several
    threads queue their products on it); created at the first use.
    """
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="rh-dask-numpy-side")


class SideChooser:
    """Side by side or alone, per shape class, from the times of recent batches.

    Each shape class (a hashable key) is tried both ways until each has
    ``warmup`` samples; then the way with the lower median of its last
    ``keep`` samples is taken, except every ``probe_every``-th batch, which
    takes the other way, so that a change of the host's load is seen. Safe
    to share between threads (each update is a single dictionary or deque
    operation).

    Parameters
    ----------
    keep : int
        Samples kept per way and class.
    warmup : int
        Samples per way before the medians decide.
    probe_every : int
        Period of the batches that try the way not chosen.
    """

    def __init__(self, keep: int = 5, warmup: int = 2, probe_every: int = 12) -> None:
        self.keep, self.warmup, self.probe_every = keep, warmup, probe_every
        self._samples: dict[Hashable, tuple[deque[float], deque[float]]] = {}
        self._seen: dict[Hashable, int] = {}

    def _get(self, key: Hashable) -> tuple[deque[float], deque[float]]:
        found = self._samples.get(key)
        if found is None:
            found = self._samples.setdefault(
                key, (deque(maxlen=self.keep), deque(maxlen=self.keep))
            )
        return found

    def choose(self, key: Hashable) -> bool:
        """True: run the class's next batch side by side."""
        alone, beside = self._get(key)
        seen = self._seen[key] = self._seen.get(key, 0) + 1
        if len(alone) < self.warmup or len(beside) < self.warmup:
            return len(beside) <= len(alone)
        best = statistics.median(beside) <= statistics.median(alone)
        return best != (seen % self.probe_every == 0)

    def record(self, key: Hashable, side: bool, seconds: float) -> None:
        """The time a batch of class ``key`` took, run side by side or not."""
        self._get(key)[int(side)].append(seconds)

    def medians(self) -> dict[Hashable, tuple[float | None, float | None]]:
        """Per class: median seconds alone and side by side (None: no sample yet)."""
        return {
            key: tuple(statistics.median(d) if d else None for d in ways)  # type: ignore[misc]
            for key, ways in list(self._samples.items())
        }


@functools.cache
def side_chooser() -> SideChooser:
    """The process's :class:`SideChooser` (the load it measures is the host's)."""
    return SideChooser()


def side_by_side(setting: int | str, cores: int | None = None) -> bool:
    """Whether ``setting`` runs independent products side by side (see the module).

    True for ``"auto"`` where it takes one BLAS thread on a host of at least
    two usable cores; a count given explicitly is used as given, alone.
    """
    if not (isinstance(setting, str) and setting.strip().lower() == "auto"):
        return False
    cores = usable_cores() if cores is None else cores
    return cores >= 2 and resolve_blas_threads(setting, cores) == 1


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


def blas_threads_in_force() -> int:
    """The largest thread count of this process's BLAS libraries now (1 without any)."""
    counts = [int(lib["num_threads"]) for lib in blas_controller().select(user_api="blas").info()]
    return max(counts, default=1)


def blas_limit(threads: int | None) -> AbstractContextManager[Any]:
    """A context running BLAS on ``threads`` threads, restoring the count on exit."""
    if threads is None:
        return nullcontext()
    return blas_controller().limit(limits=threads, user_api="blas")


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
