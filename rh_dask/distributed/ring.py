"""Shared-memory slots through which relay workers hand chunks to the engine's process.

A :class:`ChunkRing` is one file in a memory-backed directory (``/dev/shm``
by default, the ``rh-dask.relay.directory`` setting) that the engine's
process creates and every relay worker on the same node maps. It holds
``n_slots`` slots of ``slot_bytes`` each; chunk ``i`` goes into slot
``i % n_slots``. A small header holds, per slot, the one chunk index the
slot may take next (its *owner*): a relay writes chunk ``i`` only while the
owner is ``i``, and the engine's side moves the owner to ``i + n_slots``
once chunk ``i`` is consumed (:meth:`ChunkRing.release`). So a slot is
never written while the engine may still read it, and a stale copy of a
chunk (a task Dask ran twice) is dropped rather than written over a newer
one. Owner changes and writes hold a lock on the slot's header bytes
(``fcntl.lockf``, between processes).

A slot's memory is allocated by the first writer that uses it
(``posix_fallocate`` of the slot's bytes, then its pages faulted in at once),
not when the ring is made: zeroing and mapping a whole ring up front took
0.42 s for 8 slots of 95 MB and 1.47 s for 32 on the H200 host, all of it
before the stream's first chunk, where slot by slot it runs on the relays,
beside the loading. So a full ``/dev/shm`` fails a write with a
:class:`RingError`, never with a ``SIGBUS`` in a worker; making a ring checks
first that its directory has room for all of it (``statvfs``). A chunk larger
than a slot travels in a file of its own beside the ring, which the engine's
side unlinks as soon as it has mapped it.

A ring made with ``keep`` outlives its stream: the engine's worker keeps it
(with its engine, see :mod:`.shelf`) and :meth:`ChunkRing.renew` hands it to
the next stream of the same shape with a new token and key, so that stream's
relays write into memory that is already allocated (and, for a GPU engine,
page-locked): in fits on the H200 the first chunk into each fresh slot took
its relay 105-123 ms against 31-35 ms for the others. A kept ring keeps its
name, so relays of later streams can open it; its creator holds a shared
``flock`` on it for as long as it lives, and making a ring removes the names
of rings in the directory that nobody holds (their process died).

Nothing here knows about Dask: :mod:`.relay` moves the notes between
processes, and tests drive the ring directly.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import glob
import mmap
import os
import secrets
import sys
import tempfile
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ..exceptions import RingError

__all__ = [
    "ChunkRing",
    "PartLayout",
    "RingError",
    "RingSpec",
    "RingWriter",
    "SlotNote",
    "default_directory",
    "part_views",
    "slot_layout",
]

_HEADER_BYTES = 4096
_TOKEN_BYTES = 16
_OWNER_OFFSET = 64
_ALIGN = 64
#: Seconds between looks at a slot's owner while a relay waits for the engine
#: to release it.
_OWNER_POLL_SECONDS = 0.0005
#: How long a relay waits for its slot before writing the chunk to a file of
#: its own. The coordinator submits chunk ``i`` once chunk ``i - n_slots`` is
#: consumed, so a slot is busy only for the release's own latency; a relay
#: never blocks its thread longer (a blocked thread could hold up the very
#: chunk the slot waits for, queued behind it on the same relay).
_OWNER_WAIT_SECONDS = 0.05
#: How long :meth:`ChunkRing.renew` waits for a write of the last stream still
#: holding a slot (a relay receiving from a loader that stalled) before it
#: gives the ring up.
_RENEW_WAIT_SECONDS = 1.0
_RING_PREFIX = "rh-dask-ring-"
#: A ring file younger than this is never taken for an orphan.
_ORPHAN_MIN_AGE_SECONDS = 10.0
#: Kept rings open in this process: their names go when it exits.
_kept_rings: weakref.WeakSet[ChunkRing] = weakref.WeakSet()


@atexit.register
def _unlink_kept_rings() -> None:
    for ring in list(_kept_rings):
        with contextlib.suppress(OSError):
            ring._unlink_name()


def default_directory() -> str:
    """``/dev/shm`` where it exists (Linux), else the temporary directory."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


@dataclass(frozen=True)
class RingSpec:
    """What a relay needs to attach to a ring (picklable, sent with every relay task).

    Attributes
    ----------
    ring_id : str
    path : str
        The ring file (unlinked once every relay attached, see :meth:`ChunkRing.seal`).
    socket : str
        The engine's ``AF_UNIX`` listener for notes (:mod:`.relay`).
    n_slots, slot_bytes : int
    start : int
        The first chunk of the stream: slot ``s`` first takes the chunk
        ``i >= start`` with ``i % n_slots == s``.
    token : bytes
        Written at the start of the file; an attach checks it, so a worker
        that maps another node's file of the same name is not taken as a relay.
        A kept ring gets a new one for every stream, and a write checks it under
        the slot's lock, so a relay of an earlier stream never writes into it.
    authkey : bytes
        The listener's key (``multiprocessing.connection``).
    heap_for_chunks : bool
        Whether a relay keeps chunk-sized allocations on malloc's heap while
        it is attached (:func:`rh_dask.distributed.memory.heap_for_chunks`).
    reused : int
        How many streams used this ring's memory before this one (see
        :meth:`ChunkRing.renew`).
    """

    ring_id: str
    path: str
    socket: str
    n_slots: int
    slot_bytes: int
    start: int
    token: bytes
    authkey: bytes
    heap_for_chunks: bool = False
    reused: int = 0

    @property
    def size(self) -> int:
        return _HEADER_BYTES + self.n_slots * self.slot_bytes


@dataclass(frozen=True)
class PartLayout:
    """Where one array of a chunk lies in its slot (or overflow file)."""

    offset: int
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize


@dataclass(frozen=True)
class SlotNote:
    """A relay's message to the engine: chunk ``index`` is in ``slot``.

    Attributes
    ----------
    index : int
    slot : int
        The slot, or -1 for a chunk in a file of its own (``overflow``).
    parts : tuple of PartLayout or None
        ``X``, ``y`` and ``sample_weight`` (``None`` where absent).
    overflow : str or None
        The file holding a chunk larger than a slot.
    """

    index: int
    slot: int
    parts: tuple[PartLayout | None, ...]
    overflow: str | None = None

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts if p is not None)


def slot_layout(arrays: Sequence[np.ndarray | None]) -> tuple[tuple[PartLayout | None, ...], int]:
    """The layout of ``arrays`` packed one after the other, and the bytes it takes."""
    return layout_of([None if a is None else (a.shape, a.dtype.str) for a in arrays])


def layout_of(
    shapes: Sequence[tuple[Sequence[int], str] | None],
) -> tuple[tuple[PartLayout | None, ...], int]:
    """The layout of arrays of these ``(shape, dtype)``, packed in order, and its bytes."""
    parts: list[PartLayout | None] = []
    offset = 0
    for entry in shapes:
        if entry is None:
            parts.append(None)
            continue
        shape, dtype = entry
        part = PartLayout(offset, tuple(int(n) for n in shape), np.dtype(dtype).str)
        parts.append(part)
        offset += -(-part.nbytes // _ALIGN) * _ALIGN
    return tuple(parts), offset


def _socket_address(ring_id: str) -> str:
    """The engine's listener: Linux's abstract namespace, else a short path.

    An abstract address leaves nothing on the filesystem and has no path
    length limit to run into (108 bytes for a path); the listener's key,
    not the filesystem's permissions, decides who may connect.
    """
    if sys.platform.startswith("linux"):
        return f"\0rh-dask-{ring_id}"
    return os.path.join(tempfile.gettempdir(), f"rhd-{ring_id[:16]}.sock")


#: What every "no room for the ring" error suggests.
_ROOM_HINT = (
    "(make room in that directory, or set rh-dask.relay.directory or a smaller "
    "lookahead / rh-dask.relay.slot-bytes)"
)


def _allocate(fd: int, size: int, path: str, whole: int | None = None) -> None:
    """Give the file's first ``size`` bytes backing now (ENOSPC here, not SIGBUS later).

    ``whole``: the size the error names (the ring's, when only its header is
    allocated here).
    """
    try:
        if hasattr(os, "posix_fallocate"):
            os.posix_fallocate(fd, 0, size)
        else:  # macOS: sparse, as the platform offers nothing better
            os.ftruncate(fd, size)
    except OSError as exc:
        named = size if whole is None else whole
        raise RingError(
            f"cannot allocate {named / 2**20:.0f} MiB for the chunk ring {path!r}: {exc} "
            f"{_ROOM_HINT}"
        ) from exc


def _check_room(directory: str, size: int, path: str) -> None:
    """Refuse a ring its directory cannot hold now (its slots are allocated later)."""
    try:
        stat = os.statvfs(directory)
    except (OSError, AttributeError):
        return  # no statvfs here: the slots' own allocation reports it
    free = stat.f_bavail * stat.f_frsize
    if free < size:
        raise RingError(
            f"cannot allocate {size / 2**20:.0f} MiB for the chunk ring {path!r}: "
            f"{free / 2**20:.0f} MiB free there {_ROOM_HINT}"
        )


def _slot_size(slot_bytes: int) -> int:
    """A slot's size: ``slot_bytes`` rounded up to whole pages."""
    return -(-int(slot_bytes) // 4096) * 4096


def _first_owners(start: int, n_slots: int) -> list[int]:
    """Each slot's first chunk of a stream beginning at chunk ``start``."""
    return [start + (s - start) % n_slots for s in range(n_slots)]


def _remove_orphans(directory: str) -> None:
    """Remove the names of rings in ``directory`` that no live process holds.

    A ring's maker holds a shared ``flock`` on it while it lives; a kept ring
    whose process was killed keeps its name (and memory) until this runs.
    """
    for path in glob.glob(os.path.join(glob.escape(directory), _RING_PREFIX + "*")):
        if ".x" in os.path.basename(path):
            continue  # a chunk's overflow file: its reader unlinks it
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            if time.time() - st.st_mtime < _ORPHAN_MIN_AGE_SECONDS:
                continue  # perhaps made a moment ago, its maker about to lock it
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # held: a live ring
        else:
            with contextlib.suppress(OSError):
                os.unlink(path)
        finally:
            os.close(fd)


def _map(
    fd: int, size: int, prot: int = mmap.PROT_READ | mmap.PROT_WRITE, populate: bool = True
) -> mmap.mmap:
    """Map ``size`` bytes of ``fd`` shared; with ``populate``, its page tables filled at once.

    Touching a fresh mapping page by page costs a fault per 4 KiB: on the
    2-core dev box the first write of a 0.8 GB ring took 0.31 s that way and
    0.06 s after a populated mapping (0.06 s to map). Rings are mapped
    without it (their slots are faulted in one by one, see
    :meth:`_Mapped.prepare`); overflow files with it.
    """
    flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
    return mmap.mmap(fd, size, flags=flags, prot=prot)


#: Linux's ``MADV_POPULATE_WRITE`` (5.14 on): faults a range in, writable, in one call.
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)


def _populate(buffer: mmap.mmap, start: int, length: int) -> None:
    """Fault ``length`` bytes of ``buffer`` in at once where the kernel can (else lazily)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        buffer.madvise(_MADV_POPULATE_WRITE, start, length)
    except (OSError, ValueError, AttributeError):
        pass  # an older kernel: the pages fault in as they are written


def part_views(
    buffer: Any, base: int, parts: Sequence[PartLayout | None]
) -> list[np.ndarray | None]:
    """The arrays ``parts`` lay out in ``buffer`` from ``base``, as views (``None``: no part)."""
    out: list[np.ndarray | None] = []
    for p in parts:
        if p is None:
            out.append(None)
            continue
        count = int(np.prod(p.shape, dtype=np.int64))
        flat = np.frombuffer(buffer, dtype=np.dtype(p.dtype), count=count, offset=base + p.offset)
        out.append(flat.reshape(p.shape))
    return out


def _copy_into(
    buffer: Any, base: int, parts: Sequence[PartLayout | None], arrays: Sequence[Any]
) -> None:
    """Copy ``arrays`` into ``buffer`` where ``parts`` lays them out (no view outlives it)."""
    for dst, src in zip(part_views(buffer, base, parts), arrays, strict=True):
        if dst is not None:
            np.copyto(dst, src, casting="no")


class _Mapped:
    """An open, mapped ring file and its per-slot locks (both sides use one)."""

    def __init__(self, fd: int, spec: RingSpec) -> None:
        self.fd = fd
        self.spec = spec
        self.map = _map(fd, spec.size, populate=False)
        self.owner = np.frombuffer(self.map, np.int64, spec.n_slots, _OWNER_OFFSET)
        self._thread_locks = [threading.Lock() for _ in range(spec.n_slots)]
        # Slots this process has backed and faulted in (see prepare).
        self._prepared = [False] * spec.n_slots

    def slot_base(self, slot: int) -> int:
        return _HEADER_BYTES + slot * self.spec.slot_bytes

    def token(self) -> bytes:
        """The token of the stream the ring serves now (see :meth:`ChunkRing.renew`)."""
        return bytes(self.map[:_TOKEN_BYTES])

    def prepare(self, slot: int) -> None:
        """Give ``slot`` its memory before this process first writes it (hold its lock).

        Raises
        ------
        RingError
            When the ring's directory has no room left for the slot.
        """
        if self._prepared[slot]:
            return
        base, size = self.slot_base(slot), self.spec.slot_bytes
        if hasattr(os, "posix_fallocate"):
            try:
                os.posix_fallocate(self.fd, base, size)
            except OSError as exc:
                raise RingError(
                    f"cannot allocate slot {slot} ({size / 2**20:.0f} MiB) of the chunk ring "
                    f"{self.spec.path!r}: {exc} {_ROOM_HINT}"
                ) from exc
        _populate(self.map, base, size)
        self._prepared[slot] = True

    def locked(self, slot: int) -> _SlotLock:
        return _SlotLock(self, slot)

    def close(self) -> None:
        self.owner = None  # type: ignore[assignment]
        try:
            self.map.close()
        except BufferError:
            pass  # chunk views still in use keep the mapping; it goes with them
        os.close(self.fd)


class _SlotLock:
    """The slot's lock: a thread lock in this process, ``lockf`` between processes.

    ``lockf`` locks belong to the process, so threads of one process (a relay
    writing two chunks) also take a thread lock.
    """

    def __init__(self, mapped: _Mapped, slot: int) -> None:
        self._mapped = mapped
        self._slot = slot

    def __enter__(self) -> None:
        self._mapped._thread_locks[self._slot].acquire()
        try:
            fcntl.lockf(self._mapped.fd, fcntl.LOCK_EX, 8, _OWNER_OFFSET + 8 * self._slot)
        except BaseException:
            self._mapped._thread_locks[self._slot].release()
            raise

    def __exit__(self, *exc: object) -> None:
        try:
            fcntl.lockf(self._mapped.fd, fcntl.LOCK_UN, 8, _OWNER_OFFSET + 8 * self._slot)
        finally:
            self._mapped._thread_locks[self._slot].release()

    def acquire_by(self, deadline: float) -> bool:
        """Take the lock if that is possible before ``deadline`` (``time.monotonic``)."""
        lock = self._mapped._thread_locks[self._slot]
        if not lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            return False
        while True:
            try:
                fcntl.lockf(
                    self._mapped.fd,
                    fcntl.LOCK_EX | fcntl.LOCK_NB,
                    8,
                    _OWNER_OFFSET + 8 * self._slot,
                )
                return True
            except OSError:
                if time.monotonic() >= deadline:
                    lock.release()
                    return False
                time.sleep(_OWNER_POLL_SECONDS * 10)


class ChunkRing:
    """The engine's side of a ring: made, read, released (see the module's text).

    Build it with :meth:`create`.
    """

    def __init__(self, mapped: _Mapped, keep: bool = False) -> None:
        self._mapped = mapped
        self.spec = mapped.spec
        self.keep = keep
        self._sealed = False
        self._closed = False

    @classmethod
    def create(
        cls,
        directory: str,
        n_slots: int,
        slot_bytes: int,
        start: int = 0,
        heap_for_chunks: bool = False,
        keep: bool = False,
    ) -> ChunkRing:
        """Make a ring of ``n_slots`` slots of ``slot_bytes`` in ``directory``.

        ``heap_for_chunks`` goes to the relays with the ring's spec. With
        ``keep`` the ring can serve later streams (:meth:`renew`), and its
        name stays until :meth:`close`.

        Raises
        ------
        RingError
            When the directory cannot hold it (missing, no space).
        """
        if n_slots < 1 or slot_bytes < 1:
            raise ValueError(
                f"a ring needs n_slots >= 1 and slot_bytes >= 1, got {n_slots}, {slot_bytes}"
            )
        slot_bytes = _slot_size(slot_bytes)
        ring_id = uuid.uuid4().hex
        path = os.path.join(directory, f"{_RING_PREFIX}{ring_id}")
        spec = RingSpec(
            ring_id=ring_id,
            path=path,
            socket=_socket_address(ring_id),
            n_slots=int(n_slots),
            slot_bytes=slot_bytes,
            start=int(start),
            token=secrets.token_bytes(_TOKEN_BYTES),
            authkey=secrets.token_bytes(32),
            heap_for_chunks=bool(heap_for_chunks),
        )
        _remove_orphans(directory)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as exc:
            raise RingError(f"cannot make the chunk ring {path!r}: {exc}") from exc
        try:
            # Held while this process has the ring open: a ring nobody holds is an orphan.
            fcntl.flock(fd, fcntl.LOCK_SH)
            _check_room(directory, spec.size, path)
            _allocate(fd, _HEADER_BYTES, path, whole=spec.size)  # slots on first use
            os.ftruncate(fd, spec.size)
            mapped = _Mapped(fd, spec)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        mapped.map[:_TOKEN_BYTES] = spec.token
        mapped.owner[:] = _first_owners(start, n_slots)
        ring = cls(mapped, keep=keep)
        if keep:
            _kept_rings.add(ring)
        return ring

    @property
    def renewable(self) -> bool:
        """Whether :meth:`renew` may hand this ring to another stream."""
        return self.keep and not self._closed

    def fits(self, directory: str, n_slots: int, slot_bytes: int, heap_for_chunks: bool) -> bool:
        """Whether :meth:`create` with these arguments would make a ring like this one,
        so that :meth:`renew` can serve that stream instead."""
        spec = self.spec
        return (
            self.renewable
            and os.path.dirname(spec.path) == directory
            and spec.n_slots == n_slots
            and spec.slot_bytes == _slot_size(slot_bytes)
            and spec.heap_for_chunks == bool(heap_for_chunks)
        )

    def renew(self, start: int) -> RingSpec | None:
        """Hand the ring to the next stream: a new id, token, key and listener, the same memory.

        Waits for writes still under way in its slots (at most
        ``_RENEW_WAIT_SECONDS`` in all), then writes the new token, which every
        later write checks, so no relay of an earlier stream writes into it
        again. Returns the new spec, or ``None`` when a slot stayed held (then
        close this ring and make another).
        """
        if not self.renewable:
            raise RingError(f"the chunk ring {self.spec.ring_id} cannot serve another stream")
        self._remove_overflow()
        n = self.spec.n_slots
        deadline = time.monotonic() + _RENEW_WAIT_SECONDS
        held: list[_SlotLock] = []
        try:
            for slot in range(n):
                lock = self._mapped.locked(slot)
                if not lock.acquire_by(deadline):
                    return None
                held.append(lock)
            ring_id = uuid.uuid4().hex
            spec = replace(
                self.spec,
                ring_id=ring_id,
                socket=_socket_address(ring_id),
                start=int(start),
                token=secrets.token_bytes(_TOKEN_BYTES),
                authkey=secrets.token_bytes(32),
                reused=self.spec.reused + 1,
            )
            self._mapped.map[:_TOKEN_BYTES] = spec.token
            self._mapped.owner[:] = _first_owners(start, n)
            self._mapped.spec = self.spec = spec
            return spec
        finally:
            for lock in held:
                lock.__exit__()

    def parts(self, note: SlotNote) -> list[np.ndarray | None]:
        """``[X, y, sample_weight]`` of a noted chunk, as views of the ring (no copy).

        The views of a slot stay valid until :meth:`release` of the chunk; a
        chunk in an overflow file is mapped here and its file unlinked at once
        (the mapping lives as long as the views).
        """
        if note.overflow is None:
            return part_views(self._mapped.map, self._mapped.slot_base(note.slot), note.parts)
        fd = os.open(note.overflow, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            mapped = _map(fd, size, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
            os.unlink(note.overflow)
        return part_views(mapped, 0, note.parts)

    def address_range(self) -> tuple[int, int]:
        """``(address, nbytes)`` of this process's mapping of the whole ring."""
        if self._closed:
            raise RingError(f"the chunk ring {self.spec.ring_id} is closed")
        # A one-byte view gives the address; dropped at once, it holds no export.
        address = np.frombuffer(self._mapped.map, np.uint8, 1).ctypes.data
        return int(address), self.spec.size

    def slot_ranges(self) -> list[tuple[int, int]]:
        """``(address, nbytes)`` of each slot in this process's mapping, in slot order."""
        address, _ = self.address_range()
        size = self.spec.slot_bytes
        return [(address + self._mapped.slot_base(s), size) for s in range(self.spec.n_slots)]

    def release(self, index: int) -> None:
        """Chunk ``index`` is consumed: its slot may take chunk ``index + n_slots``."""
        if self._closed or index < self.spec.start:
            return
        slot = index % self.spec.n_slots
        with self._mapped.locked(slot):
            if self._mapped.owner[slot] == index:
                self._mapped.owner[slot] = index + self.spec.n_slots

    def seal(self) -> None:
        """Remove the ring's name: relays attached already keep their mapping.

        Once sealed, nothing of the ring stays on the filesystem, whatever
        happens to the processes that map it. A kept ring keeps its name
        until :meth:`close`, for the relays of later streams.
        """
        if not self._sealed:
            self._sealed = True
            if not self.keep:  # a kept ring's later relays open it by name (close removes it)
                self._unlink_name()

    def _unlink_name(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.spec.path)

    def close(self) -> None:
        """Unlink the ring (if not sealed) and unmap it; idempotent.

        Overflow files of notes that were never read (the stream stopped
        first) are removed too.
        """
        if self._closed:
            return
        _kept_rings.discard(self)
        self._sealed = True
        self._unlink_name()
        self._closed = True
        self._mapped.close()
        self._remove_overflow()

    def _remove_overflow(self) -> None:
        for path in glob.glob(glob.escape(self.spec.path) + ".x*"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


class RingWriter:
    """A relay's side of a ring: attach, then write chunks into their slots."""

    def __init__(self, mapped: _Mapped) -> None:
        self._mapped = mapped
        self.spec = mapped.spec
        self.closed = False

    @classmethod
    def attach(cls, spec: RingSpec) -> RingWriter:
        """Map the ring ``spec`` names.

        Raises
        ------
        RingError
            When this process cannot see the ring (another node), or the file
            of that name is not the ring (its token differs).
        """
        try:
            fd = os.open(spec.path, os.O_RDWR)
        except OSError as exc:
            raise RingError(f"cannot open the chunk ring {spec.path!r}: {exc}") from exc
        try:
            if os.fstat(fd).st_size != spec.size:
                raise RingError(
                    f"{spec.path!r} is not the chunk ring {spec.ring_id} (its size differs)"
                )
            mapped = _Mapped(fd, spec)
        except BaseException:
            os.close(fd)
            raise
        if bytes(mapped.map[:_TOKEN_BYTES]) != spec.token:
            mapped.close()
            raise RingError(
                f"{spec.path!r} is not the chunk ring {spec.ring_id} (its token differs)"
            )
        return cls(mapped)

    def write(self, index: int, arrays: Sequence[np.ndarray | None]) -> SlotNote | None:
        """Copy chunk ``index``'s arrays into its slot; ``None`` when it is stale.

        Waits briefly while the slot still holds an earlier chunk that the
        engine has not released, then writes the chunk to a file of its own.
        A stale chunk (one consumed already) is not written.

        Raises
        ------
        RingError
            When the ring was closed meanwhile (the stream ended), or an
            overflow file cannot be written.
        """
        parts, needed = slot_layout(arrays)

        def fill(buffer: Any, base: int) -> None:
            _copy_into(buffer, base, parts, arrays)

        return self.write_with(index, parts, needed, fill)

    def write_with(
        self,
        index: int,
        parts: tuple[PartLayout | None, ...],
        needed: int,
        fill: Callable[[Any, int], None],
    ) -> SlotNote | None:
        """Like :meth:`write`, with ``fill(buffer, base)`` writing the bytes ``parts`` lay out.

        ``fill`` is called at most once, with the slot's (or an overflow
        file's) mapping and the offset its parts are relative to; it is not
        called for a stale chunk. A relay receiving a chunk from a socket
        reads it straight into the mapping this way.
        """
        if needed > self.spec.slot_bytes:
            return self._write_overflow(index, parts, needed, fill)
        slot = index % self.spec.n_slots
        deadline = time.monotonic() + _OWNER_WAIT_SECONDS
        while True:
            owners = self._mapped.owner
            if self.closed or owners is None:
                raise RingError(
                    f"the chunk ring {self.spec.ring_id} was closed (the stream ended)"
                )
            owner = int(owners[slot])
            if owner > index:
                return None
            if owner == index:
                break
            if time.monotonic() >= deadline:
                return self._write_overflow(index, parts, needed, fill)
            time.sleep(_OWNER_POLL_SECONDS)
        with self._mapped.locked(slot):
            if self._mapped.token() != self.spec.token:
                raise RingError(
                    f"the chunk ring {self.spec.ring_id} serves another stream now "
                    "(this one ended)"
                )
            if int(self._mapped.owner[slot]) != index:
                return None
            self._mapped.prepare(slot)
            fill(self._mapped.map, self._mapped.slot_base(slot))
        return SlotNote(index, slot, parts)

    def _write_overflow(
        self,
        index: int,
        parts: tuple[PartLayout | None, ...],
        needed: int,
        fill: Callable[[Any, int], None],
    ) -> SlotNote:
        path = f"{self.spec.path}.x{index}.{uuid.uuid4().hex[:8]}"
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as exc:
            raise RingError(f"cannot make {path!r} for a chunk larger than a slot: {exc}") from exc
        try:
            _allocate(fd, max(needed, 1), path)
            mapped = _map(fd, max(needed, 1))
            try:
                fill(mapped, 0)
            finally:
                # A failed copy's traceback may still hold a view: the mapping
                # then goes with it.
                with contextlib.suppress(BufferError):
                    mapped.close()
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        os.close(fd)
        return SlotNote(index, -1, parts, overflow=path)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._mapped.close()
