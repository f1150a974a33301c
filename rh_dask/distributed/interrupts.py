"""Holding Ctrl-C back while a walk's bookkeeping must stay consistent.

A ``KeyboardInterrupt`` arrives between any two bytecodes of the main
thread. Between a batch entering the stream and the walk noting which chunk
comes next, it would leave a state that holds chunk ``i`` beside a position
saying chunk ``i`` is still to come, and a checkpoint written from the two
would fit chunk ``i`` twice on resume. :func:`interrupts_deferred` keeps
such an interrupt until the block is done, then raises it.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def interrupts_deferred() -> Iterator[None]:
    """Raise a Ctrl-C that arrives inside the block only once the block is done.

    Acts in the main thread while SIGINT raises ``KeyboardInterrupt`` (Python's
    default handler); elsewhere, or under another handler, it does nothing.
    """
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield
        return
    pending: list[int] = []

    def hold(signum: int, frame: Any) -> None:
        pending.append(signum)

    previous = signal.signal(signal.SIGINT, hold)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if pending:
            raise KeyboardInterrupt
