"""The distributed ordered walk: chunks load on the cluster, one actor consumes them.

Per stream the coordinator (running in the client's process)

1. places an :class:`~.actor.EngineActor` on one worker (see :mod:`.placement`)
   and starts the stream there from the model's state;
2. gets the chunks loaded, at most ``lookahead`` ahead of the engine:

   * ``loader="actor"`` (the default whenever possible): the chunk plan goes
     to the actor once, and the actor's worker computes the chunks itself on
     its own threads (:mod:`.feeder`): no task, message or copy per chunk;
   * ``loader="engine-worker"``: one small graph submission per chunk, ending
     in a task pinned to the actor's worker that drops the loaded batch into
     the actor's inbox;
   * ``loader="cluster"``: chunks load on any worker and only the finished
     batch travels, worker to worker, to the actor's worker;
   * ``loader="relay"``: chunks load on the workers that are neither the
     engine's nor relays, and each finished batch travels to a *relay*, a
     worker on the engine's node, which writes it into the engine's
     shared-memory ring (:mod:`.relay`): R relays receive over Dask's comm
     in R processes, and the engine's process handles no message per chunk;
3. long-polls the actor for progress (with tasks, one call per
   ``lookahead // 4`` consumed chunks, and releases consumed chunks' futures,
   so that look-ahead memory stays bounded by ``lookahead`` chunks);
4. receives a stream checkpoint (the state after a chunk, copied off the
   engine on its thread) every ``every_chunks`` chunks or ``every_seconds``,
   with the poll that follows it, and hands it to ``on_checkpoint``;
5. when the actor's worker disappears, waits (up to the
   ``rh-dask.recovery.worker-timeout`` setting) for a worker that may host
   the engine, starts a new actor there from the last checkpoint and walks on
   from the chunk after it: at most ``max_retries`` times per walk, then
   :class:`ActorLostError`, with the checkpoint's state handed back;
6. stops at the first chunk that fails (validation, a failing task, the
   engine refusing it) with a :class:`~rh_dask.exceptions.StreamError` naming
   it, after taking back the state of the last good chunk; and raises, rather
   than hangs, when the scheduler disappears
   (:class:`~rh_dask.exceptions.SchedulerLostError`, within about a second of
   the client losing its connection).

The engine consumes chunk ``i`` only after chunk ``i - 1``: order is decided
by the actor's inbox, never by which load finishes first. A recovered walk
consumes the chunks after its checkpoint from the checkpoint's exact state,
so it ends with the coefficients an uninterrupted walk gives, bit for bit.
"""

from __future__ import annotations

import functools
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import dask.array as da
import dask.config
import numpy as np
from dask.highlevelgraph import HighLevelGraph, MaterializedLayer
from distributed import Future, wait

from ..config import HuberConfig
from ..exceptions import (
    ActorLostError,
    EngineUnavailableError,
    SchedulerLostError,
    StreamError,
    ValidationError,
)
from ..settings import Settings
from ..state import HuberState
from ..stream import BatchRecord, Recovery
from .actor import EngineActor, deliver_chunk, load_and_deliver
from .chunks import AlignedStream, ChunkGraph
from .consumer import Progress, StreamSnapshot
from .file_chunks import file_chunk
from .graphs import Task, TaskRef
from .interrupts import interrupts_deferred
from .items import BadChunk, chunk_error
from .loading import assemble_chunk
from .placement import (
    WorkerInfo,
    advertised_relays,
    choose_worker,
    cluster_workers,
    loading_workers,
    relay_candidates,
    resolve_lookahead,
    scheduler_workers,
)
from .progress import StreamProgress
from .push import PushSpec, file_sends_per_loader, push_chunk, push_file_chunk, sends_allowed
from .relay import attach_relay, relay_chunk
from .ring import RingSpec

#: Extra time a poll's answer may take, beyond the poll interval, before the
#: actor's worker is checked. Not a setting: it only bounds how long a broken
#: connection goes unnoticed, and the liveness check that follows is exact.
_REPLY_GRACE_SECONDS = 5.0
#: Seconds between liveness checks while waiting for the actor to start. Not a
#: setting: a check is one scheduler call, and the start-up takes what it takes.
_START_CHECK_SECONDS = 1.0
#: Seconds between looks for a worker to host a recovered engine. Not a
#: setting: how long to look is (``rh-dask.recovery.worker-timeout``).
_WORKER_CHECK_SECONDS = 0.25

LOADERS = ("auto", "actor", "engine-worker", "cluster", "relay")
#: Slot size of a DataFrame stream's ring with ``rh-dask.relay.slot-bytes: auto``
#: (partition lengths are not known before loading).
FRAME_SLOT_BYTES = 128 << 20


def feeder_threads(nthreads: int) -> int:
    """Loading threads of ``loader="actor"`` on a worker of ``nthreads`` threads.

    Half the worker's threads, at least 2: the loading threads share the
    interpreter lock with the engine's thread (on the H200, 12 and 6 threads
    on a 12-thread worker fitted within noise of each other).
    """
    return max(2, nthreads // 2)


@dataclass(frozen=True)
class WalkCheckpoint:
    """A stream checkpoint of a walk, as the client holds it.

    Attributes
    ----------
    next_chunk : int
        The chunk the stream goes on from (an index of the whole collection).
    n_empty : int
        Empty chunks of this walk before ``next_chunk``.
    n_records : int
        How many of the walk's records (``ClusterOutcome.records``) led to
        ``state``.
    state : HuberState
    """

    next_chunk: int
    n_empty: int
    n_records: int
    state: HuberState


@dataclass
class ClusterOutcome:
    """What a distributed walk leaves behind for the estimator.

    Attributes
    ----------
    state : HuberState or None
        Engine state after the last consumed chunk (``None``: no batch was
        consumed, or the actor was lost and no checkpoint was taken). After
        an unrecovered loss, the last checkpoint's state.
    records : list of BatchRecord
        The records that led to ``state``.
    n_empty : int
    error : StreamError or None
        Raised by the caller after adopting the state.
    placement : dict
        Where the engine ran (at the end) and how chunks were loaded.
    next_chunk : int
        The chunk after those ``state`` holds: where the walk would go on.
    checkpoint : WalkCheckpoint or None
        The last stream checkpoint received.
    recoveries : list of Recovery
        Every loss of the engine's worker the walk went on after.
    choice : AutoChoice or None
        What ``engine="auto"`` chose on the engine's worker at the stream's
        first chunk (``None`` for a named engine, or before that chunk).
    """

    state: HuberState | None = None
    records: list[BatchRecord] = field(default_factory=list)
    n_empty: int = 0
    error: BaseException | None = None
    placement: dict[str, Any] = field(default_factory=dict)
    next_chunk: int = 0
    checkpoint: WalkCheckpoint | None = None
    recoveries: list[Recovery] = field(default_factory=list)
    choice: Any = None


def resolve_loader(
    loader: str,
    host: WorkerInfo,
    workers: list[WorkerInfo],
    self_contained: bool = True,
    relay_resource: str = "relay",
) -> str:
    """Map ``loader="auto"`` to where chunks load.

    Workers of the engine's node advertising ``relay_resource``, with
    loading workers elsewhere, mean a cluster built for relaying: ``"relay"``.
    Otherwise the engine's worker computing the chunks itself (``"actor"``)
    costs no task, no message and no copy per chunk; it needs a graph that
    worker can compute alone (no data persisted on the cluster). Otherwise
    tasks pinned to the engine's worker avoid a worker-to-worker copy per
    chunk (≈1 GB/s over TCP), which costs more than the load itself unless
    that worker has a single thread and other workers exist to share the work.

    Raises
    ------
    ValidationError
        For an unknown ``loader``, ``"actor"`` with a graph referencing
        persisted data, or ``"relay"`` with no other worker on the engine's node.
    """
    if loader not in LOADERS:
        raise ValidationError(f"loader must be one of {LOADERS}, got {loader!r}")
    if loader == "relay" and not relay_candidates(workers, host, relay_resource):
        raise ValidationError(
            f"loader='relay' needs a worker on the engine's node ({host.address}) besides the "
            f"engine's own, to relay its chunks (start one with `dask worker SCHEDULER "
            f"--resources {relay_resource}=1` on that node)"
        )
    if loader == "auto":
        relays = {w.address for w in advertised_relays(workers, host, relay_resource)}
        if relays and any(w.address not in relays | {host.address} for w in workers):
            return "relay"
    if loader == "actor" and not self_contained:
        raise ValidationError(
            "loader='actor' computes chunks on the engine's worker alone, but this "
            "collection references data persisted on the cluster; use loader='auto', "
            "'engine-worker' or 'cluster'"
        )
    if loader != "auto":
        return loader
    if self_contained:
        return "actor"
    if host.nthreads < 2 and len(workers) > 1:
        return "cluster"
    return "engine-worker"


def _scheduler_lost(client: Any, wait: float = 0.0) -> bool:
    """Whether ``client`` has lost its scheduler, watching for up to ``wait`` seconds.

    A client whose connection to the scheduler breaks stops ``"running"`` at
    once (it cancels every future and tries to reconnect), so its status
    tells a lost scheduler from a lost worker without asking the scheduler,
    which would wait out the connect timeout for an answer that cannot come.
    """
    deadline = time.monotonic() + wait
    while client.status == "running":
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def _scheduler_address(client: Any) -> str:
    address = getattr(getattr(client, "scheduler", None), "address", None)
    return str(address) if address else "(address unknown)"


def _scheduler_gone(address: str, consumed: int | None) -> SchedulerLostError:
    where = "" if consumed is None else f" after {consumed} chunk(s)"
    return SchedulerLostError(
        f"the connection to the Dask scheduler {address} was lost{where}; the engine's "
        "actor and the stream's tasks went with it (the model keeps its state from before "
        "this call). Restart the scheduler and its workers, then refit or resume from a "
        "checkpoint.",
        consumed,
        address,
    )


def _alive(client: Any, address: str) -> bool:
    try:
        return address in scheduler_workers(client)
    except Exception:  # the scheduler itself is unreachable: treat the worker as gone
        return False


def _lost(address: str, consumed: int | None) -> ActorLostError:
    where = "" if consumed is None else f" after {consumed} chunk(s)"
    return ActorLostError(
        f"the worker {address} holding the engine actor was lost{where}", consumed
    )


def _kept(checkpoint: WalkCheckpoint | None) -> str:
    """What the model holds after an unrecovered loss, for the error's message."""
    if checkpoint is None:
        return (
            "No stream checkpoint had been taken: the model keeps its state from before this call."
        )
    start = checkpoint.next_chunk
    return (
        f"The model holds the state of the last stream checkpoint, after chunk {start - 1}; "
        f"with a checkpoint_dir, fit(..., resume_from=checkpoint_dir) goes on from chunk {start}."
    )


class ClusterWalk:
    """One distributed stream: actor, look-ahead submissions, progress polling, recovery.

    Parameters
    ----------
    client : distributed.Client
    stream : AlignedStream
    config : HuberConfig
    engine : {"numpy", "gpu", "auto"}
        The engine; ``"auto"`` (a stream from the empty state only) is
        decided by the actor at the first chunk, and every actor the walk
        starts after that decision (a recovery) builds the engine chosen.
    device : Any
        Device argument of the engine.
    state : HuberState or None
        Where the stream starts (``None``: empty state).
    lookahead : int or "auto"
        Chunks kept loading ahead of the engine; ``"auto"`` is decided once
        the loader is (:func:`~.placement.auto_lookahead`) and kept for the
        whole walk, recoveries included.
    loader : {"auto", "engine-worker", "cluster"}
    worker : str or None
        Explicit worker address for the actor (a recovery then waits for a
        worker at that address).
    blas_threads : int or None
        BLAS threads for engine calls on the worker.
    progress : StreamProgress
    settings : Settings, optional
        The ``rh-dask`` settings of this walk (default: read from
        :mod:`dask.config` here, on the client, when the walk is built); the
        actor receives them as an argument, so they hold on the worker too.
    start : int, optional
        The first chunk to walk (a stream going on from a checkpoint).
    every_chunks : int, optional
        Chunks between stream checkpoints (default: the setting).
    max_retries : int, optional
        Recoveries from a lost engine worker (default: the setting).
    on_checkpoint : callable, optional
        ``on_checkpoint(checkpoint, outcome)``, called on this thread with each
        :class:`WalkCheckpoint` received (``outcome.records[:checkpoint.n_records]``
        are its records).

    Raises
    ------
    SettingError
        When a setting read from :mod:`dask.config` holds a value it cannot take.
    """

    def __init__(
        self,
        client: Any,
        stream: AlignedStream,
        config: HuberConfig,
        engine: str,
        device: Any,
        state: HuberState | None,
        *,
        lookahead: int | str,
        loader: str,
        worker: str | None,
        blas_threads: int | None,
        progress: StreamProgress,
        settings: Settings | None = None,
        start: int = 0,
        every_chunks: int | None = None,
        max_retries: int | None = None,
        on_checkpoint: Callable[[WalkCheckpoint, ClusterOutcome], None] | None = None,
    ) -> None:
        self.settings = Settings.from_config() if settings is None else settings
        self.client = client
        self.stream = stream
        self.config = config
        self.engine = engine
        self.device = device
        self.initial_state = state
        self.requested_lookahead = lookahead
        self.lookahead = 0  # the look-ahead in force, decided in run() once the loader is
        self.loader = loader
        self.worker = worker
        self.blas_threads = blas_threads
        self.progress = progress
        self.start = int(start)
        self.every_chunks = (
            self.settings.checkpoint_every_chunks if every_chunks is None else int(every_chunks)
        )
        self.max_retries = self.settings.max_retries if max_retries is None else int(max_retries)
        self.on_checkpoint = on_checkpoint
        self.outcome = ClusterOutcome(next_chunk=self.start)
        self._inflight: dict[int, Future] = {}
        self._shared: dict[Any, Future] = {}
        self._actor_future: Future | None = None
        self._actor: Any = None
        self.scheduler_address = _scheduler_address(client)
        self._consumed = self.start
        self._stream_id = ""
        self._mode = ""
        self._records_base = 0  # records of the walk before this actor's stream began
        self._empty_base = 0
        self._bar_at = self.start  # chunks the progress bar has counted
        self._last_answer = time.monotonic()
        self._ring: RingSpec | None = None
        self._relays: list[str] = []
        self._push: PushSpec | None = None
        self._loaders: list[str] = []

    # -- setup ---------------------------------------------------------------------------
    def _start_actor(self, host: WorkerInfo) -> None:
        self._actor_future = self.client.submit(
            EngineActor,
            self.engine,
            self.config,
            self.device,
            self.blas_threads,
            self.settings,
            actor=True,
            workers=[host.address],
            allow_other_workers=False,
            key=f"rh-dask-engine-{uuid.uuid4().hex}",
        )
        # Engine start-up (a GPU context, kernel compilation) may take a while;
        # keep checking that the worker is still there rather than wait blindly.
        while True:
            try:
                wait([self._actor_future], timeout=_START_CHECK_SECONDS)
                break
            except TimeoutError:
                self._check_scheduler()
                if not _alive(self.client, host.address):
                    raise _lost(host.address, self._consumed) from None
        self._check_scheduler()  # a lost scheduler cancels every future, this one too
        try:
            self._actor = self._actor_future.result()
        except Exception as exc:  # the worker died while the engine started
            if _scheduler_lost(self.client, 1.0) or _alive(self.client, host.address):
                raise
            raise _lost(host.address, self._consumed) from exc

    def _make_graph(self, mode: str, stream_id: str, start: int) -> ChunkGraph:
        auto = self.engine == "auto"
        accept_device = self.engine == "gpu" or auto

        def spec(i: int) -> Any:
            found = self.stream.spec(i, self.config.dtype, accept_device)
            # Undecided, the NumPy engine may take the chunk: host chunks are checked here.
            return replace(found, check_finite=True) if auto else found

        if mode == "engine-worker":
            return ChunkGraph(
                self.stream,
                load_and_deliver,
                spec,
                (self._actor.key, stream_id),
                "rh-load",
                start,
            )
        # "cluster", "relay" and "actor": the task's result is the item itself.
        return ChunkGraph(self.stream, assemble_chunk, spec, (), "rh-load", start)

    def _answer(self, call: Any, address: str, timeout: float | None = None) -> Any:
        """The result of an actor call; :class:`ActorLostError` when its worker died."""
        try:
            return call.result(timeout=timeout)
        except Exception as exc:
            if _scheduler_lost(self.client, 1.0) or _alive(self.client, address):
                raise
            raise _lost(address, self._consumed) from exc

    def _open(
        self, host: WorkerInfo, start: int, state: HuberState | None, graph: ChunkGraph | None
    ) -> ChunkGraph:
        """Start an actor on ``host`` whose stream begins at chunk ``start`` from ``state``.

        ``graph`` is an ``"actor"``-mode plan from ``start`` already built, if any.
        Returns the plan the walk submits (or that the actor loads).
        """
        self._start_actor(host)
        self._stream_id = uuid.uuid4().hex
        self._records_base = len(self.outcome.records)
        self._empty_base = self.outcome.n_empty
        every_seconds = self.settings.checkpoint_every_seconds
        begin = self._actor.begin(self._stream_id, state, start, self.every_chunks, every_seconds)
        reused = self._answer(begin, host.address)
        self.outcome.placement.setdefault("engine_reused", bool(reused))
        self.outcome.placement["worker"] = host.address
        if self._mode == "actor":
            if graph is None or graph.start != start:
                graph = self._make_graph("actor", "", start)
            threads = feeder_threads(host.nthreads)
            feed = self._actor.feed(self._stream_id, graph, self.lookahead, threads)
            self._answer(feed, host.address)
            self._last_answer = time.monotonic()
            return graph
        if self._mode == "relay":
            self._open_relays(host, start)
        if self._mode == "engine-worker" or graph is None or graph.start != start:
            graph = self._make_graph(self._mode, self._stream_id, start)
        self._last_answer = time.monotonic()
        return graph

    def _loading(self, host: WorkerInfo, workers: list[WorkerInfo]) -> list[WorkerInfo]:
        """The workers that load this walk's chunks (``"relay"``: off the engine's node)."""
        if self._mode == "relay":
            relays = relay_candidates(workers, host, self.settings.relay_resource)
            return loading_workers(workers, host, [w.address for w in relays])
        return workers  # "cluster" loads anywhere; the others on the engine's worker

    def _file_sends(
        self, host: WorkerInfo, workers: list[WorkerInfo], loaders: int
    ) -> Callable[[int], int] | None:
        """The file sends a loading worker may keep in flight, by its task threads.

        Only with ``"relay"`` over TCP (else None); counted from the relay
        candidates before any attaches, which is what ``lookahead="auto"``
        needs before the ring is made.
        """
        if self._mode != "relay" or self._relay_transport() != "tcp":
            return None
        relays = relay_candidates(workers, host, self.settings.relay_resource)
        pair = file_sends_per_loader(len(relays), loaders, self.settings.relay_file_sends)
        return functools.partial(sends_allowed, *pair)

    # -- relays --------------------------------------------------------------------------
    def _slot_bytes(self) -> int:
        """A ring slot's size: the setting, else the largest chunk an array stream holds."""
        if self.settings.relay_slot_bytes:
            return self.settings.relay_slot_bytes
        X = self.stream.parts[0]
        rows = tuple(X.chunks[0]) if isinstance(X, da.Array) else ()
        if not rows or any(r != r for r in rows) or self.stream.n_features is None:
            return FRAME_SLOT_BYTES
        itemsize = np.dtype(self.config.dtype).itemsize
        # X, y and a weight column, each padded to the ring's alignment.
        return int(max(rows)) * (int(self.stream.n_features) + 2) * itemsize + 3 * 64

    def _open_relays(self, host: WorkerInfo, start: int) -> None:
        """Make the engine's ring, attach the relays of its node, then seal it.

        Raises
        ------
        EngineUnavailableError
            When no worker of the engine's node could attach to the ring.
        """
        make = self._actor.open_relay(self._stream_id, start, self.lookahead, self._slot_bytes())
        self._ring = self._answer(make, host.address)
        workers = cluster_workers(self.client)
        candidates = relay_candidates(workers, host, self.settings.relay_resource)
        push = self._relay_transport() == "tcp"
        answers: dict[str, Any] = {}
        if candidates:
            answers = self.client.run(
                attach_relay,
                self._ring,
                push,
                workers=[w.address for w in candidates],
                on_error="return",
            )
        attached = {
            a: ok for a, ok in answers.items() if ok is True or (push and isinstance(ok, tuple))
        }
        self._relays = sorted(attached)
        self._loaders = [w.address for w in loading_workers(workers, host, self._relays)]
        self._push = None
        if push:
            self._push = PushSpec(
                self._ring.ring_id,
                self._ring.authkey,
                tuple(tuple(attached[a]) for a in self._relays),
                *file_sends_per_loader(
                    len(self._relays), len(self._loaders), self.settings.relay_file_sends
                ),
            )
        self._answer(self._actor.seal_relay(), host.address)
        if not self._relays:
            raise EngineUnavailableError(
                f"loader='relay': none of the {len(candidates)} other worker(s) on the engine's "
                f"node ({host.address}) could attach to its shared-memory ring in "
                f"{self._ring.path!r} (they do not share that node's memory, or cannot open "
                "the file; see rh-dask.relay.directory)"
            )
        self.outcome.placement["relays"] = list(self._relays)
        self.outcome.placement["loaders"] = list(self._loaders)
        self.outcome.placement["relay_transport"] = "tcp" if push else "dask"
        if self._push is not None:
            self.outcome.placement["relay_file_sends"] = self._push.file_sends
        self.outcome.placement["relay_ring_reused"] = self._ring.reused > 0
        self.outcome.placement.setdefault("relay_sendfile", False)

    def _relay_transport(self) -> str:
        """``rh-dask.relay.transport`` decided: ``"tcp"`` unless Dask's comm must be encrypted."""
        transport = self.settings.relay_transport
        if transport != "auto":
            return transport
        encrypted = bool(dask.config.get("distributed.comm.require-encryption", False))
        if encrypted or str(self.scheduler_address or "").startswith("tls://"):
            return "dask"
        return "tcp"

    def _check_relays(self) -> None:
        """Raise :class:`StreamError` once every relay of the stream is gone."""
        alive = scheduler_workers(self.client)
        if not any(r in alive for r in self._relays):
            raise StreamError(
                f"every relay worker of the engine's node was lost ({', '.join(self._relays)}); "
                "the chunks in flight cannot reach the engine. Restart them, then resume "
                "from the last checkpoint or refit with another loader",
                self._consumed,
            )

    # -- submissions -----------------------------------------------------------------
    def _submit(
        self, graph: ChunkGraph, chunks: range, mode: str, address: str, stream_id: str
    ) -> None:
        """Submit ``chunks`` in one graph: one layer per chunk, earlier chunks first.

        One submission per refill rather than per chunk: each costs the client
        and the scheduler a round of graph handling.
        """
        pinned = _restricted([address])
        loaders = _restricted(self._loaders) if mode == "relay" else {}
        # The task handing a loaded chunk over, where it runs, and its arguments:
        # onto the actor's worker ("cluster"), into the ring through a relay ("relay").
        relay = ("rh-relay", relay_chunk, (self._ring,), _restricted(self._relays))
        if self._push is not None:  # sent by the loading worker itself
            relay = ("rh-push", push_chunk, (self._push,), loaders)
        hand_over = {
            "cluster": ("rh-deliver", deliver_chunk, (self._actor.key, stream_id), pinned),
            "relay": relay,
        }.get(mode)
        # Chunks that are byte ranges of files go in one task each, by sendfile.
        by_file = mode == "relay" and self._push is not None and self.settings.relay_sendfile
        layers: dict[str, MaterializedLayer] = {}
        deps: dict[str, set[str]] = {}
        wanted: list[Any] = []
        outputs: list[tuple[int, Any, list[Any]]] = []
        for i in chunks:
            ranges = file_chunk(graph, i, graph.make_spec(i)) if by_file else None
            if ranges is not None:
                out = (f"rh-sendfile-{stream_id}", i)
                layer = f"rh-sendfile-{stream_id}-{i}"
                layers[layer] = MaterializedLayer(
                    {out: Task(out, push_file_chunk, ranges, self._push)},
                    annotations={"priority": -i, **loaders},
                )
                deps[layer] = set()
                self.outcome.placement["relay_sendfile"] = True
                wanted.append(out)
                outputs.append((i, out, []))
                continue
            item_key = graph.keys[i]
            shared = graph.shared_owned(i)
            # Earlier chunks load first; the engine's order never depends on it.
            load = {"priority": -i, **(pinned if mode == "engine-worker" else loaders)}
            name = f"rh-load-{stream_id}-{i}"
            layers[name] = MaterializedLayer(graph.submission(i), annotations=load)
            deps[name] = set(deps)  # may reference shared keys of earlier chunks here
            out = item_key
            if hand_over is not None:
                prefix, fn, args, where = hand_over
                out = (f"{prefix}-{stream_id}", i)
                layer = f"{prefix}-{stream_id}-{i}"
                layers[layer] = MaterializedLayer(
                    {out: Task(out, fn, TaskRef(item_key), *args)},
                    annotations={"priority": -i, **where},
                )
                deps[layer] = {name}
            wanted += [out, *shared]
            outputs.append((i, out, shared))
        futures = self.client.get(HighLevelGraph(layers, deps), wanted, sync=False)
        by_key = dict(zip(wanted, futures, strict=True))
        for i, out, shared in outputs:
            self._inflight[i] = by_key[out]
            for key in shared:
                self._shared[key] = by_key[key]

    def _release_through(self, graph: ChunkGraph, start: int, stop: int) -> None:
        for i in range(start, stop):
            fut = self._inflight.pop(i, None)
            if fut is not None:
                fut.release()
            for key in graph.release_after(i):
                held = self._shared.pop(key, None)
                if held is not None:
                    held.release()

    def _release_all(self) -> None:
        # Releasing (not cancelling) lets the scheduler forget queued loads
        # without touching keys other computations may share.
        for fut in [*self._inflight.values(), *self._shared.values()]:
            fut.release()
        self._inflight.clear()
        self._shared.clear()

    # -- progress ----------------------------------------------------------------------
    def _first_broken(self, consumed: int) -> int | None:
        """Lowest in-flight chunk whose loading failed (it will never arrive)."""
        broken = [
            i
            for i, f in self._inflight.items()
            # "lost" is not broken: Dask recomputes a chunk whose loading worker died.
            if i >= consumed and f.status in ("error", "cancelled")
        ]
        return min(broken) if broken else None

    def _load_failure(self, index: int) -> StreamError:
        fut = self._inflight[index]
        if fut.status == "error":
            return chunk_error(index, fut.exception())
        return StreamError(f"chunk {index} was {fut.status} before it reached the engine", index)

    def _check_scheduler(self, wait: float = 0.0) -> None:
        """Raise :class:`SchedulerLostError` if the client has lost its scheduler."""
        if _scheduler_lost(self.client, wait):
            raise _scheduler_gone(self.scheduler_address, self._consumed)

    def _poll(self, consumed: int, n_records: int, min_new: int, address: str) -> Progress:
        checkpoint = self.outcome.checkpoint
        after = -1 if checkpoint is None else checkpoint.next_chunk
        while True:
            self._check_scheduler()
            poll = self.settings.poll_interval
            call = self._actor.progress(consumed, n_records, min_new, poll, after)
            try:
                snap = call.result(timeout=poll + _REPLY_GRACE_SECONDS)
            except Exception as exc:  # timeout, closed comm, "worker holding Actor was lost"
                # A broken call may be the scheduler's loss seen first by the
                # worker (which then closes): give the client a second to see it.
                if _scheduler_lost(self.client, 0.0 if isinstance(exc, TimeoutError) else 1.0):
                    raise _scheduler_gone(self.scheduler_address, consumed) from exc
                if not _alive(self.client, address):
                    raise _lost(address, consumed) from exc
                if not isinstance(exc, (TimeoutError, OSError)):
                    raise
                continue
            self._last_answer = time.monotonic()
            return snap

    # -- the walk ----------------------------------------------------------------------
    def run(self) -> ClusterOutcome:
        """Walk the stream; never raises for chunk or worker failures (see ``outcome``).

        Raises
        ------
        SchedulerLostError
            When the client has no scheduler to start with.
        """
        self._check_scheduler()
        workers = cluster_workers(self.client)
        host = choose_worker(workers, self.engine, self.worker)
        graph = None
        if self.loader in ("auto", "actor"):
            graph = self._make_graph("actor", "", self.start)
        contained = graph is not None and graph.self_contained
        self._mode = resolve_loader(
            self.loader, host, workers, contained, self.settings.relay_resource
        )
        loading = self._loading(host, workers)
        self.lookahead = resolve_lookahead(
            self.requested_lookahead,
            self._mode,
            loading,
            self.settings.lookahead_max,
            self._file_sends(host, workers, len(loading)),
        )
        self.outcome.placement = {
            "worker": host.address,
            "loader": self._mode,
            "engine": self.engine,
            "lookahead": self.lookahead,
        }
        lost = False
        start, state = self.start, self.initial_state
        try:
            while True:
                try:
                    graph = self._open(host, start, state, graph)
                    if self.outcome.recoveries:
                        self._recovered()
                    self._walk(graph, host.address, start)
                    self._end(host.address)
                    break
                except ActorLostError as exc:
                    host, start, state = self._recover(host, exc)
                    graph = None
        except StreamError as exc:
            self.outcome.error = exc
            lost = isinstance(exc, (ActorLostError, SchedulerLostError))
        except BaseException as exc:  # KeyboardInterrupt too: still take the state back
            self.outcome.error = exc
            # An error of a call the lost scheduler broke (a cancelled future, a
            # closed connection) is the scheduler's loss; an interrupt stays one.
            failed = isinstance(exc, Exception)
            lost = _scheduler_lost(self.client, 1.0 if failed else 0.0)
            if lost and failed:
                self.outcome.error = _scheduler_gone(self.scheduler_address, self._consumed)
                self.outcome.error.__cause__ = exc
            elif not lost:
                lost = self._actor is not None and not _alive(self.client, host.address)
                if lost:
                    self._rewind()
        finally:
            self._release_all()
            self._finish(lost)
        return self.outcome

    def _walk(self, graph: ChunkGraph, address: str, start: int) -> None:
        n = graph.n_chunks
        mode = self._mode
        consumed = submitted = start
        # Polls gate the next submissions; with loader="actor" the actor loads
        # on its own and a poll only reports progress (one per poll interval).
        every = self.settings.refill_every
        step = max(1, self.lookahead // 4) if every == "auto" else int(every)
        step = n if mode == "actor" else step
        records = self.outcome.records
        while consumed < n:
            refill = 0 if mode == "actor" else min(n, consumed + self.lookahead)
            if refill > submitted:
                self._submit(graph, range(submitted, refill), mode, address, self._stream_id)
                submitted = refill
            broken = self._first_broken(consumed)
            if broken == consumed:
                raise self._load_failure(broken)
            want = min(step, n - consumed)
            if broken is not None:
                want = min(want, broken - consumed)
            snap = self._poll(consumed, len(records) - self._records_base, want, address)
            if mode == "relay" and snap.consumed == consumed:
                self._check_relays()
            self._release_through(graph, consumed, snap.consumed)
            records.extend(snap.records)
            self._count(snap)
            consumed = self._consumed = snap.consumed
            self.outcome.n_empty = self._empty_base + snap.n_empty
            self.outcome.next_chunk = consumed
            self._chosen(snap.choice)
            if snap.checkpoint is not None:
                self._take_checkpoint(snap.checkpoint)
            if snap.failure is not None:
                raise _chunk_failure(snap.failure)

    def _chosen(self, choice: Any) -> None:
        """Keep what ``engine="auto"`` chose on the worker; later actors build that engine."""
        if choice is None or self.outcome.choice is not None:
            return
        self.outcome.choice = choice
        self.engine = choice.engine
        self.outcome.placement["engine"] = choice.engine

    def _end(self, address: str) -> None:
        """End the walked stream: its final state and records, then the actor's close.

        A loss of the worker here is recovered like one during the walk.
        """
        seen = len(self.outcome.records) - self._records_base
        timeout = _REPLY_GRACE_SECONDS * 12
        state, final = self._answer(self._actor.end(self._stream_id, seen), address, timeout)
        with interrupts_deferred():  # state, records and position change together
            self._chosen(final.choice)
            self.outcome.state = state
            self.outcome.records.extend(final.records)
            self.outcome.n_empty = self._empty_base + final.n_empty
            self.outcome.next_chunk = final.consumed
        try:
            self._actor.close().result(timeout=timeout)
        except Exception:  # the state is back: a worker dying now costs nothing
            pass
        self._actor = None
        if self._actor_future is not None:
            self._actor_future.release()
            self._actor_future = None

    def _count(self, snap: Progress) -> None:
        """Move the progress bar over chunks it has not counted (replayed ones were)."""
        new = snap.consumed - self._bar_at
        if new > 0:
            rows = sum(r.rows for r in snap.records if r.chunk >= self._bar_at)
            self.progress.update(new, rows)
            self._bar_at = snap.consumed

    def _take_checkpoint(self, snap: StreamSnapshot) -> None:
        checkpoint = WalkCheckpoint(
            next_chunk=snap.consumed,
            n_empty=self._empty_base + snap.n_empty,
            n_records=self._records_base + snap.n_records,
            state=snap.state,
        )
        self.outcome.checkpoint = checkpoint
        if self.on_checkpoint is not None:
            self.on_checkpoint(checkpoint, self.outcome)

    # -- recovery ------------------------------------------------------------------------
    def _rewind(self) -> tuple[int, HuberState | None]:
        """Put the outcome back to the last checkpoint (or the walk's start).

        Returns the chunk and state a new engine goes on from.
        """
        checkpoint = self.outcome.checkpoint
        if checkpoint is None:
            start, state, n_records, n_empty = self.start, self.initial_state, 0, 0
            self.outcome.state = None
        else:
            start, state = checkpoint.next_chunk, checkpoint.state
            n_records, n_empty = checkpoint.n_records, checkpoint.n_empty
            self.outcome.state = checkpoint.state
        del self.outcome.records[n_records:]
        self.outcome.n_empty = n_empty
        self.outcome.next_chunk = start
        return start, state

    def _drop_actor(self) -> None:
        self._release_all()
        if self._actor_future is not None:
            self._actor_future.release()
        self._actor = self._actor_future = None

    def _recover(
        self, host: WorkerInfo, exc: ActorLostError
    ) -> tuple[WorkerInfo, int, HuberState | None]:
        """After losing ``host``: the new host, and the chunk and state to go on from.

        Raises
        ------
        ActorLostError
            When ``max_retries`` recoveries were made already, or no worker
            that may host the engine appears within the worker timeout; the
            outcome then holds the last checkpoint's state.
        """
        noticed = time.monotonic()
        detect = noticed - self._last_answer
        reached = self._consumed
        self._drop_actor()
        start, state = self._rewind()
        done = len(self.outcome.recoveries)
        if done >= self.max_retries:
            raise self._given_up(host.address, reached, start, done) from exc
        new = self._wait_for_worker(host.address, reached, start)
        self.outcome.recoveries.append(
            Recovery(
                time=time.time(),
                kind="worker-lost",
                lost_worker=host.address,
                new_worker=new.address,
                from_chunk=start,
                chunks_replayed=max(0, reached - start),
                detect_seconds=detect,
                recover_seconds=-noticed,  # completed by _recovered once the engine is up
            )
        )
        self._consumed = start
        return new, start, state

    def _recovered(self) -> None:
        """Complete the last recovery's ``recover_seconds`` once its engine is ready."""
        last = self.outcome.recoveries[-1]
        if last.recover_seconds < 0:
            took = time.monotonic() + last.recover_seconds
            self.outcome.recoveries[-1] = replace(last, recover_seconds=took)

    def _wait_for_worker(self, lost: str, reached: int, start: int) -> WorkerInfo:
        """A worker that may host the engine, waiting up to the worker timeout for one."""
        timeout = self.settings.worker_timeout
        deadline = time.monotonic() + timeout
        while True:
            self._check_scheduler()
            try:
                return choose_worker(cluster_workers(self.client), self.engine, self.worker)
            except EngineUnavailableError as exc:
                if time.monotonic() >= deadline:
                    error = ActorLostError(
                        f"the worker {lost} holding the engine actor was lost after {reached} "
                        f"chunk(s), and no worker that can host the {self.engine!r} engine "
                        f"appeared within {timeout:g} s ({exc}; rh-dask.recovery.worker-timeout). "
                        f"{_kept(self.outcome.checkpoint)}",
                        start,
                    )
                    raise error from None
            time.sleep(_WORKER_CHECK_SECONDS)

    def _given_up(self, lost: str, reached: int, start: int, done: int) -> ActorLostError:
        tries = (
            "recovery is off (max_retries=0)"
            if self.max_retries == 0
            else f"it was lost {done + 1} times, more than max_retries={self.max_retries}"
        )
        return ActorLostError(
            f"the worker {lost} holding the engine actor was lost after {reached} chunk(s); "
            f"{tries}. {_kept(self.outcome.checkpoint)}",
            start,
        )

    def _finish(self, lost: bool) -> None:
        if isinstance(self.outcome.error, SchedulerLostError):
            self.outcome.state = None  # as its message says: the model keeps its old state
        if self._actor is None:
            if self._actor_future is not None:
                self._actor_future.release()
                self._actor_future = None
            return
        if not lost and _scheduler_lost(self.client):
            # Nothing can come back from the engine: report the loss instead of
            # an error whose promise (the state after the last good chunk) it breaks.
            lost = True
            self._report_scheduler_loss()
        if not lost:
            try:
                # Chunks consumed after the last poll (an interrupted walk) are in
                # the state, so their records must come back with it.
                seen = len(self.outcome.records) - self._records_base
                state, final = self._actor.end(self._stream_id, seen).result(
                    timeout=_REPLY_GRACE_SECONDS * 12
                )
                with interrupts_deferred():  # state, records and position change together
                    self._chosen(final.choice)
                    self.outcome.state = state
                    self.outcome.records.extend(final.records)
                    self.outcome.n_empty = self._empty_base + final.n_empty
                    self.outcome.next_chunk = final.consumed
                self._actor.close().result(timeout=_REPLY_GRACE_SECONDS * 12)
            except Exception as exc:  # the worker (or the scheduler) died while we were finishing
                self._rewind()
                if _scheduler_lost(self.client, 1.0):
                    self.outcome.state = None
                    self._report_scheduler_loss(exc)
                elif self.outcome.error is None:
                    worker = self.outcome.placement["worker"]
                    self.outcome.error = _lost(worker, self.outcome.next_chunk)
                    self.outcome.error.__cause__ = exc
        self._actor = None
        self._actor_future.release()
        self._actor_future = None

    def _report_scheduler_loss(self, cause: BaseException | None = None) -> None:
        """Make the outcome's error a :class:`SchedulerLostError` (an interrupt stays)."""
        error = self.outcome.error
        if isinstance(error, SchedulerLostError) or not isinstance(error, (Exception, type(None))):
            return  # reported already, or an interrupt
        lost = _scheduler_gone(self.scheduler_address, self._consumed)
        lost.__cause__ = cause or error
        self.outcome.error = lost


def _restricted(addresses: Sequence[str]) -> dict[str, Any]:
    """Annotations keeping a task on ``addresses`` (none: anywhere)."""
    if not addresses:
        return {}
    return {"workers": list(addresses), "allow_other_workers": False}


def _chunk_failure(bad: BadChunk) -> BaseException:
    # An engine that could not start at the first chunk (engine="auto" by a rule,
    # e.g. device="cuda" without CuPy) is refused as a named engine is, not the chunk.
    if isinstance(bad.error, EngineUnavailableError):
        return bad.error
    return bad.exception()
