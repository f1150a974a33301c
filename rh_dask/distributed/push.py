"""Pushing loaded chunks to relays over plain TCP, straight into the engine's ring.

The relay hand-over's second transport (``rh-dask.relay.transport: tcp``).
With Dask's comm, a loaded chunk travels to a relay as a task dependency and
the relay copies it into the ring; with this one, the loading worker's
hand-over task (:func:`push_chunk`) sends the chunk's bytes over a TCP
connection to the relay's :class:`PushServer`, which receives them straight
into the chunk's slot of the ring (``recv_into`` its mapping: no copy in
user space on either side) and sends the engine its note. Why: on the H200
plain TCP carried 3.0 GB/s into one receiving process and 12.2 GB/s into
four (``benchmarks/tcp_ceiling.py``), where the same relays received
3.1-3.9 GB/s in all over Dask's comm (``benchmarks/scale_out.py``).

Connections are authenticated with the ring's key (an HMAC challenge, the
key itself never crosses the network) but not encrypted: where Dask's comm
must be encrypted (``distributed.comm.require-encryption``, a ``tls://``
scheduler) the coordinator keeps the Dask comm transport.

A chunk that is byte ranges of ``.npy`` files (:func:`push_file_chunk`,
:mod:`.file_chunks`) goes the same way, its bytes sent from the loading
worker's page cache with ``sendfile``; the relay then validates what it
received, as a loader validates a chunk it loaded.

The protocol, per chunk on one connection: a header (``!Q`` length, then a
pickle of ``(index, kind, body, check)``; ``kind`` ``"arrays"`` with the
parts' ``(shape, dtype)`` or ``None``, or ``"item"`` with an empty or bad
chunk's item; ``check`` ``None``, or the :class:`~.items.ChunkSpec` the relay
validates the received arrays with), the arrays' bytes in order for
``"arrays"``, and the relay's answer (the same framing, ``("ok", nbytes)``
or ``("error", message)``).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import os
import pickle
import secrets
import select
import socket
import struct
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import distributed
import numpy as np

from ..exceptions import InputError, RingError
from .file_chunks import FileChunk, refusal
from .items import BadChunk, ChunkItem, LoadedChunk
from .ring import PartLayout, SlotNote, layout_of

__all__ = [
    "PushServer",
    "PushSpec",
    "file_sends_per_loader",
    "push_chunk",
    "push_file_chunk",
    "sends_allowed",
]

logger = logging.getLogger(__name__)

_FRAME = struct.Struct("!Q")
_CHALLENGE_BYTES = 32
#: Largest header a relay reads (a chunk's header is a few hundred bytes).
_MAX_HEADER = 1 << 20
#: Seconds a loader waits to connect to a relay, and for any one socket
#: operation after that. Not settings: a relay that does not answer within
#: them is treated as lost, and the chunk goes to another relay.
_CONNECT_SECONDS = 10.0
_IO_SECONDS = 120.0
#: Bytes a relay reads at a time when it must discard a chunk (a stale copy).
_DRAIN_BYTES = 1 << 22


#: File sends a loading worker keeps in flight per task thread under
#: ``rh-dask.relay.file-sends: auto`` (two doubled one loading core's rate on an
#: H100 machine; docs/performance.md, "Two sends in flight per loading core").
AUTO_FILE_SENDS_PER_THREAD = 2


@dataclass(frozen=True)
class PushSpec:
    """Where a loading worker sends the chunks of one stream.

    Attributes
    ----------
    ring_id : str
    authkey : bytes
        The ring's key: connections prove they know it.
    addresses : tuple of (str, int)
        The relays' push servers, in the stream's order.
    file_sends : int, default=1
        File chunks (:func:`push_file_chunk`) a loading worker's process
        keeps in flight at most.
    file_sends_per_thread : int or None, default=None
        Also at most this many per task thread of the worker (None: no
        such bound).
    """

    ring_id: str
    authkey: bytes
    addresses: tuple[tuple[str, int], ...]
    file_sends: int = 1
    file_sends_per_thread: int | None = None


def file_sends_per_loader(relays: int, loaders: int, setting: int | str) -> tuple[int, int | None]:
    """``(file_sends, file_sends_per_thread)`` of a stream's :class:`PushSpec`.

    A send of a file chunk mostly waits for its relay, whose one receiving
    core takes one stream at about the rate a loading core reads. So a
    loading worker keeps more than one send in flight only where each of
    them still gets a relay of its own: ``"auto"`` allows
    ``max(1, relays // loaders)`` per worker and at most
    :data:`AUTO_FILE_SENDS_PER_THREAD` per task thread; a number allows that
    many per worker, whatever its threads.
    """
    if setting == "auto":
        return max(1, relays // max(1, loaders)), AUTO_FILE_SENDS_PER_THREAD
    return int(setting), None


def sends_allowed(file_sends: int, per_thread: int | None, threads: int | None) -> int:
    """The file sends a loading worker with ``threads`` task threads may keep in flight.

    ``file_sends`` and ``per_thread`` are the pair of
    :func:`file_sends_per_loader`; ``threads`` None (not a Dask worker's
    task) leaves the per-thread bound out.
    """
    if per_thread is not None and threads is not None:
        return min(file_sends, per_thread * threads)
    return file_sends


def _digest(key: bytes, challenge: bytes) -> bytes:
    return hmac.new(key, challenge, hashlib.sha256).digest()


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from ``sock``; :class:`EOFError` if the peer closes first."""
    got, size = 0, len(view)
    while got < size:
        n = sock.recv_into(view[got:], size - got)
        if n == 0:
            raise EOFError("the connection closed in the middle of a chunk")
        got += n


def _send_frame(sock: socket.socket, payload: Any) -> None:
    data = pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(_FRAME.pack(len(data)) + data)


def _recv_frame(sock: socket.socket) -> Any:
    head = bytearray(_FRAME.size)
    _recv_exact(sock, memoryview(head))
    (size,) = _FRAME.unpack(head)
    if size > _MAX_HEADER:
        raise RingError(f"a header of {size} bytes is not a chunk's")
    body = bytearray(size)
    _recv_exact(sock, memoryview(body))
    return pickle.loads(body)


def _part_views(buffer: Any, base: int, parts: tuple[PartLayout | None, ...]) -> list[memoryview]:
    view = memoryview(buffer)
    return [view[base + p.offset : base + p.offset + p.nbytes] for p in parts if p is not None]


# -- the relay's side ------------------------------------------------------------------


class PushServer:
    """Accepts loading workers' connections in a relay and writes their chunks into the ring.

    Parameters
    ----------
    host : str
        The interface to listen on (the relay worker's own host).
    authkey : bytes
        The ring's key.
    write : callable
        ``write(index, parts, needed, fill)``: the ring writer's
        :meth:`~.ring.RingWriter.write_with`.
    send : callable
        ``send(message)``: hands a note (or an empty or bad chunk's item) to
        the engine's process.
    """

    def __init__(
        self,
        host: str,
        authkey: bytes,
        write: Callable[..., SlotNote | None],
        send: Callable[[Any], None],
    ) -> None:
        self._authkey = authkey
        self._write = write
        self._send = send
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._server = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._server.bind((host, 0))
            self._server.listen(64)
        except OSError as exc:
            self._server.close()
            raise RingError(f"cannot listen for chunks on {host!r}: {exc}") from exc
        self.address: tuple[str, int] = self._server.getsockname()[:2]
        self._lock = threading.Lock()
        self._conns: list[socket.socket] = []
        self._closed = False
        self._accepter = threading.Thread(
            target=self._accept, name="rh-dask-push-accept", daemon=True
        )
        self._accepter.start()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._server.accept()
            except OSError:  # closed
                return
            with self._lock:
                if self._closed:
                    sock.close()
                    return
                self._conns.append(sock)
            threading.Thread(
                target=self._serve, args=(sock,), name="rh-dask-push-read", daemon=True
            ).start()

    def _serve(self, sock: socket.socket) -> None:
        try:
            sock.settimeout(_IO_SECONDS)
            challenge = secrets.token_bytes(_CHALLENGE_BYTES)
            sock.sendall(challenge)
            answer = bytearray(hashlib.sha256().digest_size)
            _recv_exact(sock, memoryview(answer))
            if not hmac.compare_digest(bytes(answer), _digest(self._authkey, challenge)):
                logger.warning("a connection to push chunks was refused: wrong key")
                return
            sock.sendall(b"\x01")
            # Chunks come when the loaders have them: no timeout between them.
            while True:
                sock.settimeout(None)
                try:
                    header = _recv_frame(sock)
                except EOFError:
                    return
                sock.settimeout(_IO_SECONDS)
                _send_frame(sock, self._chunk(sock, header))
        except (OSError, EOFError, RingError, pickle.UnpicklingError) as exc:
            logger.debug("a chunk-push connection ended: %s", exc)
        except (ValueError, TypeError) as exc:  # a header of another rh-dask version
            logger.warning("a chunk-push connection sent a header this relay cannot read: %s", exc)
        finally:
            with self._lock:
                if sock in self._conns:
                    self._conns.remove(sock)
            with contextlib.suppress(OSError):
                sock.close()

    def _chunk(self, sock: socket.socket, header: Any) -> tuple[str, Any]:
        index, kind, body, check = header
        if kind == "item":
            self._send(body)
            return ("ok", 0)
        parts, needed = layout_of(body)
        received = []
        refused: list[BadChunk] = []

        def fill(buffer: Any, base: int) -> None:
            for view in _part_views(buffer, base, parts):
                _recv_exact(sock, view)
            received.append(True)
            if check is not None:
                bad = refusal(buffer, base, parts, check)
                if bad is not None:
                    refused.append(bad)

        try:
            note = self._write(index, parts, needed, fill)
        except RingError as exc:
            if not received:
                self._drain(sock, parts)
            return ("error", str(exc))
        if not received:  # a stale copy: the engine consumed this chunk already
            self._drain(sock, parts)
            return ("ok", 0)
        if refused:
            # The stream stops in front of this chunk: its slot is never read.
            if note is not None and note.overflow is not None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(note.overflow)
            self._send(refused[0])
            return ("ok", 0)
        try:
            self._send(note)
        except BaseException:
            if note.overflow is not None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(note.overflow)
            raise
        return ("ok", note.nbytes)

    @staticmethod
    def _drain(sock: socket.socket, parts: tuple[PartLayout | None, ...]) -> None:
        left = sum(p.nbytes for p in parts if p is not None)
        scratch = memoryview(bytearray(min(left, _DRAIN_BYTES) or 1))
        while left:
            n = min(left, len(scratch))
            _recv_exact(sock, scratch[:n])
            left -= n

    def close(self) -> None:
        """Stop accepting and close every connection."""
        with self._lock:
            self._closed = True
            conns, self._conns = self._conns, []
        with contextlib.suppress(OSError):
            self._server.shutdown(socket.SHUT_RDWR)
        self._server.close()
        for sock in conns:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()


# -- the loading worker's side ------------------------------------------------------------

_pool_lock = threading.Lock()
#: Idle authenticated connections of this process, by (ring, relay address).
_idle: dict[tuple[str, tuple[str, int]], list[socket.socket]] = {}


def _closed_by_peer(sock: socket.socket) -> bool:
    """Whether an idle connection was closed by its relay (readable with no data)."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
        return bool(readable) and sock.recv(1, socket.MSG_PEEK) == b""
    except (OSError, ValueError):
        return True


def _connect(spec: PushSpec, address: tuple[str, int]) -> socket.socket:
    with _pool_lock:
        # Relays close their connections when their stream ends: drop those.
        for key in list(_idle):
            keep = []
            for sock in _idle[key]:
                if _closed_by_peer(sock):
                    sock.close()
                else:
                    keep.append(sock)
            if keep:
                _idle[key] = keep
            else:
                del _idle[key]
        free = _idle.get((spec.ring_id, address))
        if free:
            return free.pop()
    sock = socket.create_connection(address, timeout=_CONNECT_SECONDS)
    try:
        sock.settimeout(_IO_SECONDS)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        challenge = bytearray(_CHALLENGE_BYTES)
        _recv_exact(sock, memoryview(challenge))
        sock.sendall(_digest(spec.authkey, bytes(challenge)))
        ok = bytearray(1)
        _recv_exact(sock, memoryview(ok))
    except BaseException:
        sock.close()
        raise
    return sock


def _give_back(spec: PushSpec, address: tuple[str, int], sock: socket.socket) -> None:
    with _pool_lock:
        _idle.setdefault((spec.ring_id, address), []).append(sock)


def forget_connections(ring_id: str | None = None) -> None:
    """Close this process's idle connections (of one ring, or all), and forget its send slots."""
    with _slots_lock:
        for key in [k for k in _slots if ring_id is None or k[0] == ring_id]:
            del _slots[key]
    with _pool_lock:
        keys = [k for k in _idle if ring_id is None or k[0] == ring_id]
        socks = [s for k in keys for s in _idle.pop(k)]
    for sock in socks:
        sock.close()


def _host_array(a: Any) -> np.ndarray | None:
    if a is None:
        return None
    get = getattr(a, "get", None)  # CuPy
    return np.ascontiguousarray(get() if callable(get) and not isinstance(a, np.ndarray) else a)


def _send_chunk(sock: socket.socket, item: ChunkItem) -> tuple[str, Any]:
    if not isinstance(item, LoadedChunk):
        _send_frame(sock, (item.index, "item", item, None))
        return _recv_frame(sock)
    arrays = [_host_array(a) for a in (item.X, item.y, item.sample_weight)]
    shapes = [None if a is None else (a.shape, a.dtype.str) for a in arrays]
    _send_frame(sock, (item.index, "arrays", shapes, None))
    for a in arrays:
        if a is not None and a.nbytes:
            sock.sendall(memoryview(a).cast("B"))
    return _recv_frame(sock)


def _push(index: int, send: Callable[[socket.socket], tuple[str, Any]], spec: PushSpec) -> int:
    """Send chunk ``index`` with ``send(sock)`` to the relays in turn, from ``index mod R``."""
    addresses = spec.addresses
    if not addresses:
        raise RingError(f"the stream of ring {spec.ring_id} has no relay to push to")
    first = index % len(addresses)
    failures = []
    for k in range(len(addresses)):
        address = addresses[(first + k) % len(addresses)]
        try:
            sock = _connect(spec, address)
        except (OSError, EOFError) as exc:
            failures.append(f"{address[0]}:{address[1]}: {exc}")
            continue
        try:
            status, value = send(sock)
        except (OSError, EOFError, RingError) as exc:
            sock.close()
            failures.append(f"{address[0]}:{address[1]}: {exc}")
            continue
        except BaseException:
            sock.close()  # the relay may hold part of a chunk: never reuse the connection
            raise
        _give_back(spec, address, sock)
        if status == "ok":
            return int(value)
        raise RingError(f"relay {address[0]}:{address[1]} refused chunk {index}: {value}")
    raise RingError(f"no relay took chunk {index}: {'; '.join(failures)}")


def push_chunk(item: ChunkItem, spec: PushSpec) -> int:
    """The hand-over task on a loading worker: send one loaded chunk to a relay.

    Tries the relays in turn, starting at ``index mod R``; returns the bytes
    the relay wrote (0 for an empty or refused chunk, and for a stale copy).

    Raises
    ------
    RingError
        When no relay takes the chunk (every one is lost, or the stream ended).
    """
    return _push(item.index, lambda sock: _send_chunk(sock, item), spec)


def _open_parts(chunk: FileChunk, files: contextlib.ExitStack) -> list[Any]:
    """The parts' files, open (closed with ``files``), each checked against its layout."""
    opened: list[Any] = []
    for part in chunk.parts:
        if part is None:
            opened.append(None)
            continue
        path = part.layout.path
        try:
            f = files.enter_context(open(path, "rb", buffering=0))
        except OSError as exc:
            raise InputError(f"cannot open {path!r}: {exc}", path=path) from exc
        part.check_file(f.fileno())
        opened.append(f)
    return opened


def _send_file_chunk(sock: socket.socket, chunk: FileChunk, files: list[Any]) -> tuple[str, Any]:
    shapes = [None if p is None else (p.shape, p.dtype.str) for p in chunk.parts]
    _send_frame(sock, (chunk.index, "arrays", shapes, chunk.spec))
    for part, f in zip(chunk.parts, files, strict=True):
        if part is None or not part.nbytes:
            continue
        sent = sock.sendfile(f, part.byte_offset, part.nbytes)
        if sent != part.nbytes:
            path = part.layout.path
            raise InputError(
                f"{path!r} ended before rows {part.start}:{part.stop} (changed while read)",
                path=path,
            )
    return _recv_frame(sock)


def push_file_chunk(chunk: FileChunk, spec: PushSpec) -> int:
    """The one task of a file chunk on a loading worker: send its byte ranges to a relay.

    The bytes go from the files to the relay's socket with ``sendfile``
    (the loading worker never reads them); the relay validates the chunk it
    received with ``chunk.spec``. Relays are tried as :func:`push_chunk`
    tries them. Returns the bytes the relay wrote (0 for a refused chunk or
    a stale copy).

    Raises
    ------
    InputError
        A part's file cannot be opened or changed size since it was opened.
    RingError
        When no relay takes the chunk.
    """
    with _file_send_slot(spec), contextlib.ExitStack() as stack:
        files = _open_parts(chunk, stack)
        return _push(chunk.index, lambda sock: _send_file_chunk(sock, chunk, files), spec)


_slots_lock = threading.Lock()
#: Per (ring, limit), newest last: the file sends this process may still start.
#: A kept ring serves stream after stream; the oldest entries are dropped.
_slots: dict[tuple[str, int], threading.BoundedSemaphore] = {}
_MAX_SLOT_ENTRIES = 64


@contextlib.contextmanager
def _file_send_slot(spec: PushSpec) -> Iterator[None]:
    """Hold one of this process's file sends of the stream; leave the task pool where it pays.

    In a Dask worker whose task threads are fewer than the sends it may keep
    in flight, the task secedes from the worker's thread pool once it holds
    its slot (:func:`distributed.secede`): the worker then starts the next
    chunk's task while this one waits for its relay. A task waiting for a
    slot keeps its thread.
    """
    threads = _task_threads()
    limit = sends_allowed(spec.file_sends, spec.file_sends_per_thread, threads)
    with _slots_lock:
        slots = _slots.get((spec.ring_id, limit))
        if slots is None:
            slots = _slots[(spec.ring_id, limit)] = threading.BoundedSemaphore(limit)
            while len(_slots) > _MAX_SLOT_ENTRIES:
                del _slots[next(iter(_slots))]
    with slots:
        if threads is not None and limit > threads:
            _secede()
        yield


def _secede() -> None:
    """Leave the worker's thread pool; where the task runs outside it, keep the thread."""
    try:
        distributed.secede()
    except (AttributeError, KeyError, ValueError) as exc:  # not one of distributed's pools
        logger.debug("a file send keeps its task thread: %s", exc)


def _task_threads() -> int | None:
    """The task threads of the Dask worker running this task (None: not in a worker's task)."""
    try:
        worker = distributed.get_worker()
    except ValueError:
        return None
    return int(worker.state.nthreads)
