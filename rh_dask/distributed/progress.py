"""Progress reporting for long fits: a tqdm bar with chunks/s and rows/s."""

from __future__ import annotations

import sys
import time
from types import TracebackType

from tqdm.auto import tqdm


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
    """

    def __init__(self, total: int, enabled: bool) -> None:
        self.rows = 0
        self.chunks = 0
        self._start = time.perf_counter()
        self._bar = tqdm(
            total=total,
            unit="chunk",
            desc="rh-dask fit",
            disable=not enabled,
            dynamic_ncols=True,
        )

    def update(self, chunks: int, rows: int) -> None:
        """Record ``chunks`` more consumed chunks holding ``rows`` rows."""
        if chunks <= 0:
            return
        self.chunks += chunks
        self.rows += rows
        elapsed = max(time.perf_counter() - self._start, 1e-9)
        self._bar.set_postfix_str(f"{self.rows / elapsed:,.0f} rows/s", refresh=False)
        self._bar.update(chunks)

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
