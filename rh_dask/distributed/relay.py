"""Relays: workers on the engine's node that receive loaded chunks for it.

With ``loader="relay"`` chunks load on the cluster's other workers, and each
finished chunk travels over Dask's comm to a *relay*: a worker process on the
engine's node, other than the engine's. The relay's task
(:func:`relay_chunk`) writes the chunk into the engine's shared-memory
:class:`~.ring.ChunkRing` and sends a note of a few hundred bytes to the
engine's process, whose :class:`RelayReceiver` turns it into an item for the
ordered consumer. Why: one process receives about 2 GB/s over Dask's TCP
comm (measured on the H200, ``docs/performance.md``), a seventh of what one
GPU engine consumes; R relays receive in R processes, and the engine's own
process handles no Dask message, no decode and no validation per chunk, only
one copy from the ring into its pinned pool (on the receiver's threads).

How a chunk reaches a relay is ``rh-dask.relay.transport``: as the
dependency of the relay's task over Dask's comm, or pushed by the loading
worker over a plain TCP connection straight into the ring (:mod:`.push`).

Every relay attaches once per stream (:func:`attach_relay`, run by the
coordinator with ``client.run``): it maps the ring and opens a connection to
the engine's listener (``multiprocessing.connection`` over ``AF_UNIX``, with
the ring's key). Then the ring's and the listener's names are removed
(:meth:`RelayReceiver.seal`). When the engine's side closes (the stream
ended, or its process died), each relay's watcher thread sees its connection
close and unmaps the ring, so nothing is left behind on either side.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
from collections.abc import Callable
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection, answer_challenge, deliver_challenge
from typing import Any

import numpy as np
from distributed.comm import get_address_host

from . import memory
from .items import BadChunk, ChunkItem, LoadedChunk
from .push import PushServer
from .ring import ChunkRing, RingError, RingSpec, RingWriter, SlotNote

__all__ = ["RelayReceiver", "attach_relay", "attached_rings", "detach_relay", "relay_chunk"]

logger = logging.getLogger(__name__)

#: Seconds between looks at whether the receiver stopped accepting relays.
_ACCEPT_POLL_SECONDS = 0.2

_lock = threading.Lock()
_attached: dict[str, _Relay] = {}
#: Attached rings that asked for chunk-sized allocations on the heap, and how
#: to restore this process's malloc once none does (see :mod:`.memory`).
_heap = {"users": 0, "restore": None}


class _Relay:
    """One ring attached in this (relay) process: its writer, its note connection and,
    for the TCP transport, the server loading workers push chunks to."""

    def __init__(self, spec: RingSpec, push_host: str | None = None) -> None:
        self.spec = spec
        self.writer = RingWriter.attach(spec)
        try:
            self.conn: Connection = Client(spec.socket, family="AF_UNIX", authkey=spec.authkey)
        except BaseException as exc:
            self.writer.close()
            raise RingError(f"cannot reach the engine's listener {spec.socket!r}: {exc}") from exc
        self._send_lock = threading.Lock()
        self.push: PushServer | None = None
        if push_host is not None:
            try:
                self.push = PushServer(push_host, spec.authkey, self.writer.write_with, self.send)
            except BaseException:
                self.close()
                raise
        self._watcher = threading.Thread(
            target=self._watch, name=f"rh-dask-relay-{spec.ring_id[:8]}", daemon=True
        )
        self._watcher.start()

    def _watch(self) -> None:
        """Wait for the engine's side to close the connection, then let the ring go."""
        try:
            self.conn.recv()
        except (EOFError, OSError):
            pass
        finally:
            detach_relay(self.spec.ring_id)

    def send(self, note: Any) -> None:
        with self._send_lock:
            self.conn.send(note)

    def close(self) -> None:
        if self.push is not None:
            self.push.close()
        self.writer.close()
        _shutdown(self.conn)


def _shutdown(conn: Connection) -> None:
    """Close ``conn`` and wake a thread blocked reading it (a plain close may not)."""
    try:
        sock = socket.socket(fileno=os.dup(conn.fileno()))
    except OSError:
        return  # closed already
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    finally:
        sock.close()
    try:
        conn.close()
    except OSError:
        pass


def attach_relay(
    spec: RingSpec, push: bool = False, dask_worker: Any = None
) -> bool | tuple[str, int]:
    """Attach this process to the ring ``spec``; False when it cannot see it.

    Run on every candidate relay with ``client.run`` at the start of a stream;
    idempotent. With ``push``, the relay also listens for chunks that loading
    workers send over TCP (:mod:`.push`) on its worker's host, and the
    answer is that server's ``(host, port)`` instead of True.
    """
    with _lock:
        if spec.ring_id in _attached:
            relay = _attached[spec.ring_id]
            return relay.push.address if relay.push is not None else True
    host = None
    if push:
        address = getattr(dask_worker, "address", None) or "tcp://127.0.0.1"
        host = get_address_host(address)
    try:
        relay = _Relay(spec, host)
    except (RingError, OSError) as exc:
        logger.debug("not a relay for ring %s: %s", spec.ring_id, exc)
        return False
    with _lock:
        if spec.ring_id in _attached:  # attached meanwhile by another thread
            relay.close()
            other = _attached[spec.ring_id]
            return other.push.address if other.push is not None else True
        _attached[spec.ring_id] = relay
        if spec.heap_for_chunks:
            _heap["users"] += 1
            if _heap["users"] == 1:
                _heap["restore"] = memory.heap_for_chunks()
    return relay.push.address if relay.push is not None else True


def detach_relay(ring_id: str) -> bool:
    """Let go of a ring in this process; False if it was not attached."""
    with _lock:
        relay = _attached.pop(ring_id, None)
        restore = None
        if relay is not None and relay.spec.heap_for_chunks:
            _heap["users"] -= 1
            if _heap["users"] == 0:
                restore, _heap["restore"] = _heap["restore"], None
    if relay is None:
        return False
    relay.close()
    if restore is not None:
        restore()
    return True


def attached_rings() -> list[str]:
    """The rings this process is attached to (tests, diagnostics)."""
    with _lock:
        return sorted(_attached)


def _host(a: Any) -> np.ndarray | None:
    """A host NumPy view or copy of a chunk's array (a device array is copied off)."""
    if a is None or isinstance(a, np.ndarray):
        return a
    get = getattr(a, "get", None)  # CuPy
    return np.asarray(get() if callable(get) else a)


def relay_chunk(item: ChunkItem, spec: RingSpec) -> int:
    """The task on a relay: put one loaded chunk into the engine's ring, send its note.

    Returns the bytes written (0 for an empty or refused chunk, whose item
    itself is the note, and for a stale copy of a chunk consumed already).

    Raises
    ------
    RingError
        When this worker is not attached to the ring (not on the engine's
        node, or the stream ended), or the write fails.
    """
    with _lock:
        relay = _attached.get(spec.ring_id)
    if relay is None:
        raise RingError(
            f"this worker holds no mapping of the engine's chunk ring {spec.ring_id}: it is "
            "not on the engine's node, or the stream has ended"
        )
    if not isinstance(item, LoadedChunk):
        relay.send(item)
        return 0
    arrays = [_host(item.X), _host(item.y), _host(item.sample_weight)]
    note = relay.writer.write(item.index, arrays)
    if note is None:
        return 0
    try:
        relay.send(note)
    except BaseException:
        if note.overflow is not None:  # nobody will map it: it must not stay in memory
            with contextlib.suppress(FileNotFoundError):
                os.unlink(note.overflow)
        raise
    return note.nbytes


class RelayReceiver:
    """The engine's side: accept relays, turn their notes into items, ``deliver`` them.

    Parameters
    ----------
    ring : ChunkRing
    deliver : callable
        ``deliver(item)``, called on one thread per relay connection with a
        :class:`~.items.LoadedChunk` whose arrays are views of ``ring``
        (valid until ``ring.release(item.index)``), or the
        :class:`~.items.EmptyChunk` / :class:`~.items.BadChunk` a relay sent.

    Raises
    ------
    RingError
        When the listener's socket cannot be made.
    """

    def __init__(self, ring: ChunkRing, deliver: Callable[[ChunkItem], None]) -> None:
        self._ring = ring
        self._deliver = deliver
        spec = ring.spec
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._server.bind(spec.socket)
            self._server.listen(64)
        except OSError as exc:
            self._server.close()
            raise RingError(f"cannot listen on {spec.socket!r}: {exc}") from exc
        # Accepting wakes up this often to notice seal() and close().
        self._server.settimeout(_ACCEPT_POLL_SECONDS)
        self._conns: list[Connection] = []
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._closed = False
        self._sealed = False
        self._accepter = threading.Thread(
            target=self._accept, name=f"rh-dask-relay-accept-{spec.ring_id[:8]}", daemon=True
        )

    def start(self) -> None:
        self._accepter.start()

    @property
    def connections(self) -> int:
        """Relays connected so far."""
        with self._lock:
            return len(self._conns)

    def _accept(self) -> None:
        while True:
            with self._lock:
                if self._closed or self._sealed:
                    return
            try:
                sock, _ = self._server.accept()
            except TimeoutError:
                continue
            except OSError:  # the listening socket was closed
                return
            sock.setblocking(True)
            conn = Connection(sock.detach())
            reader = threading.Thread(
                target=self._read, args=(conn,), name="rh-dask-relay-read", daemon=True
            )
            with self._lock:
                if self._closed:
                    _shutdown(conn)
                    return
                self._conns.append(conn)
                self._threads.append(reader)
            reader.start()

    def _read(self, conn: Connection) -> None:
        # The handshake of multiprocessing.connection.Listener, on this thread:
        # a peer that never answers holds up its own reader only.
        try:
            deliver_challenge(conn, self._ring.spec.authkey)
            answer_challenge(conn, self._ring.spec.authkey)
        except (AuthenticationError, EOFError, OSError) as exc:
            logger.warning("a connection to the chunk ring was refused: %s", exc)
            _shutdown(conn)
            return
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                return
            try:
                item = self._item(message)
            except Exception as exc:  # a chunk this side cannot map: the stream stops at it
                index = getattr(message, "index", None)
                if index is None:
                    logger.error("a relay sent a message that is not a note: %r", message)
                    continue
                reason = f"{type(exc).__name__}: {exc}"
                item = BadChunk(index, reason, exc, verb="could not be loaded")
            self._deliver(item)

    def _item(self, message: Any) -> ChunkItem:
        if isinstance(message, SlotNote):
            X, y, w = self._ring.parts(message)
            return LoadedChunk(message.index, X, y, w)
        return message

    def _stop_listening(self) -> None:
        self._server.close()
        address = self._ring.spec.socket
        if not address.startswith("\0"):  # an abstract address has no file
            try:
                os.unlink(address)
            except FileNotFoundError:
                pass

    def seal(self) -> None:
        """Stop accepting relays and remove the ring's and the listener's names."""
        with self._lock:
            if self._sealed:
                return
            self._sealed = True
        self._ring.seal()
        self._stop_listening()

    def close(self) -> None:
        """Close every relay's connection (their rings are let go) and the listener."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            sealed, self._sealed = self._sealed, True
            conns, self._conns = self._conns, []
            threads = list(self._threads)
        if not sealed:
            self._stop_listening()
        for conn in conns:
            _shutdown(conn)
        for thread in threads:
            thread.join(timeout=10)
