"""Engines kept on a worker between streams, so that the next fit skips start-up.

Starting an engine is not free: the GPU engine creates its CUDA stream and
library handles, captures CUDA graphs for each batch shape and allocates its
pinned buffers as chunks arrive. A fit or ``partial_fit`` on the cluster
starts a fresh engine actor, which would pay that every time. When an
actor's stream ends cleanly, it parks its engine (with the engine's thread)
here for the setting ``rh-dask.distributed.engine-keep`` (60 s; the actor
gets it from the client with its :class:`~rh_dask.settings.Settings`); the next
actor on that worker process with the same engine, configuration and device
takes it instead of building one. A parked engine keeps its memory (device
workspace, pinned host buffers, and the relay ring of its last stream with
``rh-dask.relay.keep-ring``) until it is taken, its time runs out, or
:func:`release_engines` closes it.

Only the engine is reused, never a model: a stream always starts from the
state the coordinator sends (``begin``), so results do not depend on it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Hashable
from typing import Any

from .consumer import OrderedConsumer
from .ring_pinning import release_ring

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_parked: dict[Hashable, tuple[OrderedConsumer, threading.Timer]] = {}


def take(key: Hashable) -> OrderedConsumer | None:
    """The parked engine for ``key``, removed from the shelf (``None``: none parked)."""
    with _lock:
        entry = _parked.pop(key, None)
    if entry is None:
        return None
    entry[1].cancel()
    return entry[0]


def park(key: Hashable, consumer: OrderedConsumer, seconds: float) -> None:
    """Keep ``consumer`` for ``seconds``, then close it; replaces one parked under ``key``."""
    if seconds <= 0:
        _close(consumer)
        return
    timer = threading.Timer(seconds, _expire, args=(key, consumer))
    timer.daemon = True
    with _lock:
        previous = _parked.pop(key, None)
        _parked[key] = (consumer, timer)
    timer.start()
    if previous is not None:
        previous[1].cancel()
        _close(previous[0])


def clear() -> int:
    """Close every engine parked in this process; returns how many there were."""
    with _lock:
        entries = list(_parked.values())
        _parked.clear()
    for consumer, timer in entries:
        timer.cancel()
        _close(consumer)
    return len(entries)


def parked() -> int:
    """How many engines this process holds parked."""
    with _lock:
        return len(_parked)


def _expire(key: Hashable, consumer: OrderedConsumer) -> None:
    with _lock:
        entry = _parked.get(key)
        if entry is None or entry[0] is not consumer:
            return  # taken or replaced meanwhile
        del _parked[key]
    _close(consumer)


def _close(consumer: OrderedConsumer) -> None:
    """Release the engine's resources on its own thread, then stop that thread."""
    close = getattr(consumer.engine, "close", None)
    try:
        # A kept relay ring first: its page-locking belongs to the engine's pool.
        release_kept_ring(consumer)
        if close is not None:
            consumer.call(close)
    except Exception as exc:  # a broken engine must not keep the others parked
        logger.warning("closing a parked engine failed: %s", exc)
    finally:
        consumer.close()


def release_kept_ring(consumer: OrderedConsumer) -> None:
    """Close the relay ring kept with ``consumer``'s engine, if any (:mod:`.actor`)."""
    kept, consumer.kept_ring = consumer.kept_ring, None
    if kept is None:
        return
    release_ring(*kept)


def release_engines(client: Any) -> dict[str, int]:
    """Close the engines parked on every worker of ``client``'s cluster.

    Parameters
    ----------
    client : distributed.Client

    Returns
    -------
    dict
        Worker address to the number of engines it closed.
    """
    return client.run(clear)
