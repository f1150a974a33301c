"""The NumPy engine's products over a batch's rows, in fixed blocks spread over threads.

A product over the rows (``Z v``, ``Zᵀ u``, ``Zᵀ D Z``) is cut into row
blocks that depend on the shape alone (:func:`row_blocks`). Each block is one
BLAS call on one thread, and the blocks' partial sums are added in block
order. So a result has the same bits whatever number of threads runs the
blocks, and that number can be chosen while the stream runs, from measured
times (:class:`ThreadChooser`), without changing a result: unlike BLAS's own
threads, whose sums depend on their count.

Blocks run as tasks (:func:`run_tasks`) on the calling thread and on a
process-wide team of kept threads (:func:`block_team`), each of which takes a
fixed contiguous share of the tasks and sleeps on a lock of its own between
products: nothing spins while the engine is not computing, and a product's
hand-over is one lock release per thread. A product that finds the team
busy (engines on several threads at once) runs on a process-wide pool
instead (:func:`block_pool`), whose threads take tasks from a queue. Handing
work to other threads still costs more than a GEMV of a small batch takes,
so whether spreading pays is measured: the NumPy engine calibrates a count
per batch class.
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
    "BlockTeam",
    "ThreadChooser",
    "block_pool",
    "block_team",
    "row_blocks",
    "run_on_pool",
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


class BlockTeam:
    """Threads kept to run the shares of one product's tasks at a time.

    Helper ``i`` runs share ``i + 1`` of a product: the tasks are cut into as
    many contiguous shares as threads take part, and the calling thread runs
    share 0. Each helper waits on a lock of its own and reports on another, so
    nothing queues and nothing spins between products. One product at a time:
    :meth:`run` returns None at once when another thread is using the team.

    Parameters
    ----------
    helpers : int
        Helper threads at most (made when a product first needs them).
    """

    def __init__(self, helpers: int) -> None:
        self.helpers = max(0, helpers)
        self._busy = threading.Lock()
        self._go: list[threading.Lock] = []
        self._done: list[threading.Lock] = []
        self._share: list[Callable[[], None] | None] = []
        #: A product interrupted while its helpers ran leaves the locks' pairing
        #: unknown: the team is then given up and :func:`block_team` makes another.
        self.broken = False

    def _grow(self, helpers: int) -> None:
        while len(self._go) < helpers:
            i = len(self._go)
            go, done = threading.Lock(), threading.Lock()
            go.acquire()
            done.acquire()
            self._go.append(go)
            self._done.append(done)
            self._share.append(None)
            threading.Thread(
                target=self._serve, args=(i,), daemon=True, name=f"rh-dask-numpy-rows-team-{i}"
            ).start()

    def _serve(self, i: int) -> None:
        go, done = self._go[i], self._done[i]
        while True:
            go.acquire()
            share = self._share[i]
            if share is not None:
                share()
            done.release()

    def run(self, tasks: Sequence[Callable[[], T]], threads: int) -> list[T] | None:
        """The tasks' results in task order on ``threads`` threads, or None if busy.

        Returns only once every share has ended; the error of the first failed
        task, in task order, is raised.
        """
        threads = max(1, min(threads, len(tasks), self.helpers + 1))
        if self.broken or not self._busy.acquire(blocking=False):
            return None
        try:
            results: list[Any] = [None] * len(tasks)
            errors: list[BaseException | None] = [None] * len(tasks)

            def share(j: int) -> Callable[[], None]:
                first, last = j * len(tasks) // threads, (j + 1) * len(tasks) // threads

                def run() -> None:
                    for i in range(first, last):
                        try:
                            results[i] = tasks[i]()
                        except BaseException as exc:  # raised below, in task order
                            errors[i] = exc

                return run

            self._grow(threads - 1)
            for i in range(threads - 1):
                self._share[i] = share(i + 1)
                self._go[i].release()
            try:
                share(0)()
            finally:
                try:
                    for i in range(threads - 1):
                        self._done[i].acquire()
                        self._share[i] = None
                except BaseException:
                    self.broken = True
                    raise
        finally:
            self._busy.release()
        for error in errors:
            if error is not None:
                raise error
        return results


@functools.cache
def _block_team() -> BlockTeam:
    return BlockTeam(usable_cores() - 1)


def block_team() -> BlockTeam:
    """The process's :class:`BlockTeam`: one helper fewer than its usable cores.

    Made at the first use, afresh in a forked child (a thread does not survive
    a fork) and after a product was interrupted while its helpers ran.
    """
    team = _block_team()
    if team.broken:
        _block_team.cache_clear()
        team = _block_team()
    return team


def _clear_after_fork() -> None:
    block_pool.cache_clear()
    _block_team.cache_clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_clear_after_fork)


def run_tasks(tasks: Sequence[Callable[[], T]], threads: int) -> list[T]:
    """``[task() for task in tasks]`` on ``threads`` threads; results in task order.

    The calling thread and ``threads - 1`` helpers of :func:`block_team` each
    run a contiguous share of the tasks (the row blocks of one product cost
    about the same). Where the team is busy with another thread's product,
    the calling thread and ``threads - 1`` threads of :func:`block_pool` take
    the next task not yet taken until none is left. Returns only once every
    task taken has ended, whatever happened, so the caller's buffers are never
    left in use; the error of the first failed task, in task order, is raised.
    """
    threads = max(1, min(threads, len(tasks)))
    if threads == 1:
        return [task() for task in tasks]
    got = block_team().run(tasks, threads)
    return run_on_pool(tasks, threads) if got is None else got


def run_on_pool(tasks: Sequence[Callable[[], T]], threads: int) -> list[T]:
    """:func:`run_tasks` on the calling thread and ``threads - 1`` of :func:`block_pool`.

    Each thread takes the next task not yet taken until none is left.
    """
    threads = max(1, min(threads, len(tasks)))
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
