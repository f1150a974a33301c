"""Progress reporting for long fits: a tqdm bar with chunks/s and rows/s.

:func:`watch_progress` lets other code in the same thread follow every
update of the fits it starts (the detached runner publishes them on the
scheduler).
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import TracebackType

from tqdm.auto import tqdm

#: ``callback(chunks_done, n_chunks, rows_done)``.
ProgressCallback = Callable[[int, int, int], None]

_watchers = threading.local()


def _callbacks() -> list[ProgressCallback]:
    found = getattr(_watchers, "callbacks", None)
    if found is None:
        found = _watchers.callbacks = []
    return found


@contextmanager
def watch_progress(callback: ProgressCallback) -> Iterator[None]:
    """Call ``callback(chunks_done, n_chunks, rows_done)`` on every progress update.

    Only :class:`StreamProgress` counters of this thread report to it, while
    the context is active: once when a counter starts and after every update.
    An exception raised by the callback propagates out of the update, into the
    walk that reported it (which stops as it would at an interrupt).

    Parameters
    ----------
    callback : callable
        Called with the chunks consumed so far, the stream's chunk count and
        the rows consumed so far.
    """
    callbacks = _callbacks()
    callbacks.append(callback)
    try:
        yield
    finally:
        callbacks.remove(callback)


def progress_enabled(flag: bool | None) -> bool:
    """``None`` means: on when stderr is a terminal (interactive use), else off."""
    if flag is None:
        return bool(getattr(sys.stderr, "isatty", lambda: False)())
    return bool(flag)


class StreamProgress:
    """Counts consumed chunks and rows; draws a bar only when enabled.

    Parameters
    ----------
    total : int
        Chunks in the stream.
    enabled : bool
        Draw the bar (the counters run either way).
    initial : int, optional
        Chunks dealt with before this walk (a stream resumed from a checkpoint).
    """

    def __init__(self, total: int, enabled: bool, initial: int = 0) -> None:
        self.rows = 0
        self.chunks = initial
        self.total = total
        self._start = time.perf_counter()
        self._bar = tqdm(
            total=total,
            initial=initial,
            unit="chunk",
            desc="rh-dask fit",
            disable=not enabled,
            dynamic_ncols=True,
        )
        try:
            self._notify()
        except BaseException:
            self._bar.close()
            raise

    def update(self, chunks: int, rows: int) -> None:
        """Record ``chunks`` more consumed chunks holding ``rows`` rows."""
        if chunks <= 0:
            return
        self.chunks += chunks
        self.rows += rows
        elapsed = max(time.perf_counter() - self._start, 1e-9)
        self._bar.set_postfix_str(f"{self.rows / elapsed:,.0f} rows/s", refresh=False)
        self._bar.update(chunks)
        self._notify()

    def _notify(self) -> None:
        for callback in list(_callbacks()):
            callback(self.chunks, self.total, self.rows)

    def close(self) -> None:
        self._bar.close()

    def __enter__(self) -> StreamProgress:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
