"""The NumPy engine's products over a batch's rows, in fixed blocks spread over threads.

A product over the rows (``Z v``, ``Zᵀ u``, ``Zᵀ D Z``) is cut into row
blocks that depend on the shape alone (:func:`row_blocks`). Each block is one
BLAS call on one thread, and the blocks' partial sums are added in block
order. So a result has the same bits whatever number of threads runs the
blocks, and that number can be chosen while the stream runs, from measured
times (:class:`ThreadChooser`), without changing a result: unlike BLAS's own
threads, whose sums depend on their count.

Blocks run as tasks (:func:`run_tasks`) on the calling thread and on a
process-wide pool (:func:`block_pool`), whose threads wait on a queue between
products: nothing spins while the engine is not computing. Handing tasks to
another thread costs about 65 µs on the dev box, more than a GEMV of a
reference batch takes, so whether spreading pays is measured: the NumPy
engine calibrates a count per batch class.
"""

from __future__ import annotations

import functools
import itertools
import os
import statistics
import threading
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, TypeVar

from .blas_threads import usable_cores

__all__ = [
    "MAX_BLOCKS",
    "MIN_BLOCK_BYTES",
    "ThreadChooser",
    "block_pool",
    "row_blocks",
    "run_tasks",
    "thread_chooser",
    "thread_counts",
]

T = TypeVar("T")

#: Bytes of a product's operand per row block, at least (measured on the dev box:
#: below about 1 MiB the per-block call and hand-off cost more than a second core
#: gains on the sweep's shapes; docs/performance.md, NumPy engine).
MIN_BLOCK_BYTES = 1 << 20
#: Blocks per product, at most: the most threads a product can use. Fixed, not the
#: host's core count, so that a stream's bits are the same on every host.
MAX_BLOCKS = 16
#: Block boundaries fall on multiples of this many rows.
ROW_ALIGN = 64


def row_blocks(rows: int, cols: int, itemsize: int) -> tuple[tuple[int, int], ...]:
    """The row blocks ``(start, stop)`` of a ``rows × cols`` operand (shape only).

    As many blocks as whole :data:`MIN_BLOCK_BYTES` the operand holds, between
    1 and :data:`MAX_BLOCKS`, of near-equal rows, with inner boundaries on
    multiples of :data:`ROW_ALIGN`.
    """
    # Asked for at every product of every iteration: remembered per shape.
    return _row_blocks(rows, cols, itemsize, MIN_BLOCK_BYTES, MAX_BLOCKS, ROW_ALIGN)


@functools.lru_cache(maxsize=1024)
def _row_blocks(
    rows: int, cols: int, itemsize: int, min_bytes: int, max_blocks: int, align: int
) -> tuple[tuple[int, int], ...]:
    count = max(1, min(max_blocks, rows * cols * itemsize // min_bytes, rows // align))
    bounds = [0]
    for i in range(1, count):
        bounds.append(rows * i // count // align * align)
    bounds.append(rows)
    return tuple(itertools.pairwise(bounds))


@functools.cache
def block_pool() -> ThreadPoolExecutor:
    """The process's pool for row blocks: one thread fewer than its usable cores.

    Shared by every NumPy engine of the process (engines on several threads
    queue their blocks on it); made at the first use, and made afresh in a
    forked child (a pool's threads do not survive a fork).
    """
    return ThreadPoolExecutor(
        max_workers=max(1, usable_cores() - 1), thread_name_prefix="rh-dask-numpy-rows"
    )


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=block_pool.cache_clear)


def run_tasks(tasks: Sequence[Callable[[], T]], threads: int) -> list[T]:
    """``[task() for task in tasks]`` on ``threads`` threads; results in task order.

    The calling thread and ``threads - 1`` threads of :func:`block_pool` take
    the next task not yet taken until none is left, so tasks of unequal cost
    share the threads evenly. Returns only once every task taken has ended,
    whatever happened, so the caller's buffers are never left in use; the
    error of the first failed task, in task order, is raised.
    """
    threads = max(1, min(threads, len(tasks)))
    if threads == 1:
        return [task() for task in tasks]
    results: list[Any] = [None] * len(tasks)
    errors: list[BaseException | None] = [None] * len(tasks)
    taken = itertools.count()  # next() on a count is atomic under the GIL

    def work() -> None:
        while (i := next(taken)) < len(tasks):
            try:
                results[i] = tasks[i]()
            except BaseException as exc:  # raised below, in task order
                errors[i] = exc

    pool = block_pool()
    jobs: list[Future[None]] = [pool.submit(work) for _ in range(threads - 1)]
    try:
        work()
    finally:
        wait(jobs)
    for error in errors:
        if error is not None:
            raise error
    return results


def thread_counts(tasks: int, cores: int | None = None) -> tuple[int, ...]:
    """The thread counts worth trying for ``tasks`` tasks.

    Powers of two below the limit, and the limit: the smaller of the tasks and
    the process's usable cores.
    """
    limit = max(1, min(tasks, usable_cores() if cores is None else cores))
    counts = {limit}
    count = 1
    while count < limit:
        counts.add(count)
        count *= 2
    return tuple(sorted(counts))


class ThreadChooser:
    """A thread count per class of work, from the times of its recent runs.

    A class is first calibrated (:meth:`calibrated`, :meth:`add_calibration`:
    its caller times the same work at every count, in an order and its
    reverse). Until then, a class takes the largest count that has fewer than
    ``warmup`` samples. Then it takes the count with the lowest median of its
    last ``keep`` samples, except every ``probe_every``-th product, which tries
    a neighbour of it (the next smaller and the next larger in turn), so that a
    change of the host's load is seen. Safe to share between threads.

    Parameters
    ----------
    keep : int
        Samples kept per count and class.
    warmup : int
        Samples of a count before its median counts.
    probe_every : int
        Period of the products that try a neighbour of the count chosen.
    """

    def __init__(self, keep: int = 5, warmup: int = 2, probe_every: int = 12) -> None:
        self.keep, self.warmup, self.probe_every = keep, warmup, probe_every
        self._samples: dict[Hashable, dict[int, deque[float]]] = {}
        self._seen: dict[Hashable, int] = {}
        self._calibration: dict[Hashable, float] = {}
        self._lock = threading.Lock()

    def choose(self, key: Hashable, counts: Sequence[int]) -> int:
        """The thread count for the next product of class ``key``, one of ``counts``.

        ``counts`` ascending (as :func:`thread_counts` gives them).
        """
        if len(counts) == 1:
            return counts[0]
        with self._lock:
            samples = self._samples.setdefault(key, {})
            seen = self._seen[key] = self._seen.get(key, 0) + 1
            untried = [c for c in counts if len(samples.get(c, ())) < self.warmup]
            if untried:
                return untried[-1]
            medians = [statistics.median(samples[c]) for c in counts]
            at = medians.index(min(medians))
            if seen % self.probe_every:
                return counts[at]
            near = [counts[i] for i in (at - 1, at + 1) if 0 <= i < len(counts)]
            return near[(seen // self.probe_every) % len(near)]

    def calibrated(self, key: Hashable) -> bool:
        """Whether class ``key`` has been calibrated in this process."""
        with self._lock:
            return key in self._calibration

    def add_calibration(self, key: Hashable, seconds: float) -> None:
        """Class ``key`` is calibrated; ``seconds``: what its calibration cost."""
        with self._lock:
            self._calibration[key] = self._calibration.get(key, 0.0) + seconds

    def calibration_seconds(self) -> dict[Hashable, float]:
        """Per calibrated class: the seconds its calibration cost, beyond the work itself."""
        with self._lock:
            return dict(self._calibration)

    def record(self, key: Hashable, count: int, seconds: float) -> None:
        """The time a product of class ``key`` took on ``count`` threads."""
        with self._lock:
            ways = self._samples.setdefault(key, {})
            ways.setdefault(count, deque(maxlen=self.keep)).append(seconds)

    def medians(self) -> dict[Hashable, dict[int, float]]:
        """Per class and count: the median seconds of the samples kept."""
        with self._lock:
            return {
                key: {c: statistics.median(d) for c, d in sorted(ways.items()) if d}
                for key, ways in self._samples.items()
            }

    def chosen(self) -> dict[Hashable, int]:
        """Per class: the count of the lowest median now (among those with samples)."""
        return {
            key: min(medians, key=medians.__getitem__)
            for key, medians in self.medians().items()
            if medians
        }


@functools.cache
def thread_chooser() -> ThreadChooser:
    """The process's :class:`ThreadChooser` (the load it measures is the host's)."""
    return ThreadChooser()
