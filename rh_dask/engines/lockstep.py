"""Several engines through one batch together, the host waiting for all of them at once.

An engine whose solve queues work on a device and waits for it (the GPU
engine: one wait per Newton iteration) can offer its ``partial_fit`` as a
generator, ``batch_steps(X, y, sample_weight)``: each ``yield`` hands out
something with a ``synchronize()`` method (the engine's CUDA stream) that
must complete before the generator is resumed (and, optionally, a ``done``
attribute that says so without waiting), and the generator returns the
batch's diagnostics. :func:`advance_together` keeps every engine's next step
queued: it resumes each engine as soon as its last step is over, and waits
only when none is. So every engine's work runs on the device side by side
while the host prepares the next steps.

Each engine queues exactly the work of its own ``partial_fit``, in the same
order, so its results are the same bits; only the moments the host waits
change. Engines that offer this also offer ``hold()`` and ``put_back(held)``
(a copy of the state, kept on the device, and a return to it), so that a
grid can put every engine back when one of them fails in the middle of a
batch.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Generator, Sequence
from typing import Any

__all__ = ["advance_together", "can_advance_together"]


def can_advance_together(engines: Sequence[Any]) -> bool:
    """Whether every engine offers ``batch_steps``, ``hold`` and ``put_back``."""
    return all(
        callable(getattr(e, name, None))
        for e in engines
        for name in ("batch_steps", "hold", "put_back")
    )


def advance_together(steps: Sequence[Generator[Any, None, Any]]) -> list[Any]:
    """Run ``batch_steps`` generators to their ends, each resumed once its wait is over.

    Every generator is started once, in order (each queues its first step
    and yields what to wait for). From then on the waits are polled in the
    order they were yielded: a generator whose wait is over (``done`` true,
    where the yielded object has that attribute) is resumed at once, so
    that the host prepares one engine's next step while the others still
    work; when none is over, the host waits (``synchronize()``) for the
    oldest and resumes that one.

    Parameters
    ----------
    steps : sequence of generators
        One per engine.

    Returns
    -------
    list
        Each generator's return value, in the order of ``steps``.

    Raises
    ------
    BaseException
        The first error met (a generator's, or a wait's), once every
        unfinished generator has been closed where it stood. Work they
        queued may still be running: the caller puts their engines back
        (``put_back``), which waits for it.
    """
    results: list[Any] = [None] * len(steps)
    waiting: deque[tuple[int, Any]] = deque()

    def resume(i: int) -> None:
        try:
            waiting.append((i, next(steps[i])))
        except StopIteration as stop:
            results[i] = stop.value

    try:
        for i in range(len(steps)):
            resume(i)
        while waiting:
            ready = [entry for entry in waiting if getattr(entry[1], "done", False)]
            if not ready:
                ready = [waiting[0]]
                ready[0][1].synchronize()
            for entry in ready:
                waiting.remove(entry)
                resume(entry[0])
    except BaseException:
        for generator in steps:
            generator.close()
        raise
    return results
