"""A configuration grid walked on a Dask cluster: one actor per GPU worker.

The configurations of a :class:`~rh_dask.engines.grid.GridEngine` are split
contiguously over the cluster's GPU workers (those advertising the resource
``GPU``; sizes differ by at most one; never more actors than
configurations). On a cluster without GPU workers one actor on one worker
(chosen as :func:`~.placement.choose_worker` does) holds every
configuration. Each actor is a :class:`GridActor` holding a ``GridEngine``
of its share.

Every chunk is loaded once per pass, anywhere on the cluster, as one task of
the stream's :class:`~.chunks.ChunkGraph`. For every actor a small task
pinned to the actor's worker takes the loaded chunk as its dependency (so
Dask moves it once to each actor's worker) and drops it into the actor's
inbox (:func:`deliver_grid_chunk`); the actor's
:meth:`GridActor.consume` call for that chunk waits for it there. (A
future passed as an actor-call argument is not used: it is pickled as its
bare key and a worker process's client never asks the scheduler for it.)
Up to ``lookahead`` chunks are loading or being consumed at once. An actor
consumes chunk ``i`` only after chunk ``i - 1`` (calls and deliveries may
arrive out of order; they wait for their turn).

A refused chunk stops the walk: every actor is put back to its states
before that chunk (each keeps them until every actor has consumed the
chunk), and the walk raises :class:`~rh_dask.exceptions.BadChunkError`. A
lost actor worker raises :class:`~rh_dask.exceptions.ActorLostError` naming
the worker and its configurations; the states of that worker are gone, and
the caller's model keeps what it held before the walk. Any other failure of
an actor (a device fault) raises :class:`~rh_dask.exceptions.StreamError`
naming its worker, the model again as it was before the walk.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from distributed import Future, get_worker

from ..config import HuberConfig
from ..engines.grid import GridEngine, GridRecord
from ..exceptions import (
    ActorLostError,
    EngineUnavailableError,
    RhDaskError,
    StreamError,
    ValidationError,
)
from ..settings import Settings
from ..state import HuberState
from .chunks import ChunkGraph
from .items import BadChunk, EmptyChunk, chunk_error
from .placement import (
    WorkerInfo,
    choose_worker,
    cluster_workers,
    resolve_lookahead,
    scheduler_workers,
)

#: Seconds between checks that an actor's worker is alive while awaiting its answer.
_CHECK_SECONDS = 1.0

__all__ = ["GridActor", "GridWalk", "Share", "split_configs", "walk_grid"]


def split_configs(n_configs: int, n_actors: int) -> list[range]:
    """Contiguous shares of ``range(n_configs)`` for ``n_actors`` actors.

    The first ``n_configs % n_actors`` shares hold one configuration more;
    never an empty share (at most ``n_configs`` of them).
    """
    if n_configs < 1 or n_actors < 1:
        raise ValidationError(f"cannot split {n_configs} configurations over {n_actors} actors")
    k = min(n_configs, n_actors)
    base, extra = divmod(n_configs, k)
    out, start = [], 0
    for a in range(k):
        size = base + (a < extra)
        out.append(range(start, start + size))
        start += size
    return out


@dataclass(frozen=True)
class Share:
    """Which worker holds which configurations (rows of the grid)."""

    worker: str
    configs: range


def plan_shares(workers: list[WorkerInfo], engine: str, n_configs: int) -> list[Share]:
    """One share per GPU worker (sorted by address), or one on a chosen worker without any.

    Raises
    ------
    EngineUnavailableError
        No workers, or ``engine="gpu"`` without a GPU worker.
    """
    gpus = [w for w in workers if w.has_gpu]
    hosts = gpus or [choose_worker(workers, engine, None)]
    ranges = split_configs(n_configs, len(hosts))
    return [Share(h.address, r) for h, r in zip(hosts, ranges, strict=False)]


class GridActor:
    """A ``GridEngine`` of one share of the configurations, on one worker.

    Parameters
    ----------
    configs : sequence of HuberConfig
        This actor's configurations.
    engine : {"numpy", "gpu"}
    device : str, int or None
        The device of the engines (a dask-cuda worker sees its GPU as 0).
    reference_tau : float
    settings : Settings, optional
        The client's ``rh-dask`` settings (the engine options).
    states : sequence of HuberState, optional
        States to continue from (one per configuration).
    start : int
        The first chunk index the actor will be given.
    """

    def __init__(
        self,
        configs: Sequence[HuberConfig],
        engine: str,
        device: Any,
        reference_tau: float,
        settings: Settings | None = None,
        states: Sequence[HuberState] | None = None,
        start: int = 0,
    ) -> None:
        settings = Settings() if settings is None else settings
        self.grid = GridEngine(
            configs, engine, device, reference_tau=reference_tau, settings=settings
        )
        if states is not None:
            self.grid.import_states(states)
        self._next = int(start)
        self._records: list[GridRecord] = []
        # index -> (states before that chunk or None for an empty grid, records held)
        self._saved: dict[int, tuple[list[HuberState] | None, int]] = {}
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="rh-dask-grid")
        self._turn: asyncio.Condition | None = None
        self._busy = 0.0
        self._started = time.perf_counter()
        self._loop = get_worker().loop.asyncio_loop
        self._inbox: dict[int, asyncio.Future[Any]] = {}

    def _slot(self, index: int) -> asyncio.Future[Any]:
        slot = self._inbox.get(index)
        if slot is None:
            slot = self._inbox[index] = self._loop.create_future()
        return slot

    def _arrived(self, index: int, item: Any) -> None:
        slot = self._slot(index)
        if not slot.done():
            slot.set_result(item)

    def deliver(self, index: int, item: Any) -> None:
        """Hand over chunk ``index``'s loaded item (from a task thread of this worker)."""
        self._loop.call_soon_threadsafe(self._arrived, index, item)

    async def fail(self, index: int, reason: str, error: BaseException) -> None:
        """Chunk ``index`` could not be loaded: its ``consume`` answers ``("bad", ...)``."""
        self._arrived(index, BadChunk(index, reason, error, verb="could not be loaded"))

    async def consume(self, index: int, committed: int) -> tuple[str, Any]:
        """Consume chunk ``index`` once it is delivered, after chunk ``index - 1``.

        ``committed``: every actor consumed the chunks up to it; their saved
        states are dropped. Returns ``("ok", record)``, ``("empty", None)``,
        ``("bad", BadChunk)`` or ``("refused", ValidationError)``.
        """
        if self._turn is None:
            self._turn = asyncio.Condition()
        item = await self._slot(index)
        self._inbox.pop(index, None)
        async with self._turn:
            await self._turn.wait_for(lambda: self._next == index)
        try:
            for old in [i for i in self._saved if i <= committed]:
                del self._saved[old]
            held = None if self.grid.n_features_in is None else self.grid.export_states()
            self._saved[index] = (held, len(self._records))
            if isinstance(item, EmptyChunk):
                return "empty", None
            if isinstance(item, BadChunk):
                return "bad", item
            loop = asyncio.get_running_loop()
            began = time.perf_counter()
            try:
                record = await loop.run_in_executor(
                    self._thread, self._fit, item, self._delivered(index + 1)
                )
            except ValidationError as exc:
                return "refused", exc
            finally:
                self._busy += time.perf_counter() - began
            self._records.append(record)
            return "ok", record
        finally:
            async with self._turn:
                self._next = index + 1
                self._turn.notify_all()

    def _delivered(self, index: int) -> tuple[Any, ...] | None:
        """The arrays of chunk ``index`` if they are here already (the grid copies them ahead)."""
        slot = self._inbox.get(index)
        if slot is None or not slot.done() or slot.cancelled():
            return None
        item = slot.result()
        if isinstance(item, (EmptyChunk, BadChunk)):
            return None
        return item.X, item.y, item.sample_weight

    def _fit(self, item: Any, upcoming: tuple[Any, ...] | None) -> GridRecord:
        return self.grid.partial_fit(
            item.X, item.y, item.sample_weight, chunk=item.index, upcoming=upcoming
        )

    def rollback(self, index: int) -> None:
        """Put every configuration back to its states before chunk ``index``."""
        held, n_records = self._saved[index]
        if held is None:
            self.grid.reset()
        else:
            self.grid.import_states(held)
        del self._records[n_records:]
        self._saved.clear()
        self._inbox.clear()
        self._next = index

    def result(self) -> tuple[list[HuberState] | None, list[GridRecord], float, float]:
        """The states (``None`` before any batch), the records, busy and wall seconds."""
        states = None if self.grid.n_features_in is None else self.grid.export_states()
        return states, list(self._records), self._busy, time.perf_counter() - self._started

    def close(self) -> None:
        """Release the engines and the actor's thread."""
        self.grid.close()
        self._thread.shutdown(wait=False)


def deliver_grid_chunk(item: Any, actor_key: str, index: int) -> int:
    """Task pinned to an actor's worker: put chunk ``index``'s item into the actor's inbox.

    Returns the item's size in bytes (the actor holds the only reference).
    """
    try:
        actor = get_worker().state.actors[actor_key]
    except KeyError:
        raise RuntimeError(f"the grid actor {actor_key} is not on this worker") from None
    actor.deliver(index, item)
    return int(getattr(item, "nbytes", 0))


@dataclass
class GridWalk:
    """What a cluster walk produced, merged in configuration order.

    Attributes
    ----------
    states : list of HuberState or None
        Every configuration's state (``None`` when no batch was consumed).
    records : list of GridRecord
        One per consumed chunk, covering every configuration.
    empty : int
        Empty chunks skipped.
    shares : list of Share
    busy : list of float
        Seconds each actor spent fitting.
    wall : float
        Seconds of the walk.
    lookahead : int
        The chunks the walk kept in flight (``"auto"`` decided).
    error : StreamError or None
        What stopped the walk at a bad chunk (the states are those before it).
    """

    states: list[HuberState] | None
    records: list[GridRecord]
    empty: int
    shares: list[Share]
    busy: list[float]
    wall: float
    lookahead: int = 0
    error: Exception | None = None


def merge_records(parts: Sequence[Sequence[GridRecord]]) -> list[GridRecord]:
    """Records of the same chunks from each share, joined in configuration order."""
    import numpy as np

    out = []
    for group in zip(*parts, strict=True):
        first = group[0]
        out.append(
            GridRecord(
                batch=first.batch,
                chunk=first.chunk,
                rows=first.rows,
                weight=first.weight,
                huber_loss=np.concatenate([r.huber_loss for r in group]),
                mae=np.concatenate([r.mae for r in group]),
                diagnostics=tuple(d for r in group for d in r.diagnostics),
            )
        )
    return out


def _lost(client: Any, share: Share, index: int, exc: BaseException) -> ActorLostError:
    rows = f"{share.configs.start}..{share.configs.stop - 1}"
    err = ActorLostError(
        f"the worker {share.worker} holding grid configurations {rows} was lost at chunk "
        f"{index} ({type(exc).__name__}: {exc}); their states went with it and Dask does "
        "not recreate a lost actor: the model keeps what it held before this fit",
        index,
    )
    err.__cause__ = exc
    return err


def _failed(share: Share, index: int, exc: BaseException) -> StreamError:
    """An actor that is still there failed on chunk ``index`` (a device fault, a bug)."""
    rows = f"{share.configs.start}..{share.configs.stop - 1}"
    return StreamError(
        f"the grid actor on {share.worker} (configurations {rows}) failed at chunk {index}: "
        f"{type(exc).__name__}: {exc}; the model keeps what it held before this fit",
        index,
    )


def _alive(client: Any, address: str) -> bool:
    try:
        return address in scheduler_workers(client)
    except Exception:  # the scheduler itself is unreachable
        return False


def walk_grid(
    client: Any,
    graph: ChunkGraph,
    configs: Sequence[HuberConfig],
    engine: str,
    device: Any,
    reference_tau: float,
    states: Sequence[HuberState] | None,
    lookahead: int | str,
    settings: Settings | None = None,
) -> GridWalk:
    """Walk ``graph``'s chunks through one :class:`GridActor` per share of ``configs``.

    ``lookahead="auto"``: chunks load anywhere on the cluster, so twice its
    task threads (:func:`~.placement.auto_lookahead`, mode ``"cluster"``).

    Raises
    ------
    EngineUnavailableError
        When no worker can host the grid.
    ActorLostError
        When an actor's worker goes away.
    """
    settings = Settings() if settings is None else settings
    workers = cluster_workers(client)
    shares = plan_shares(workers, engine, len(configs))
    lookahead = resolve_lookahead(lookahead, "cluster", workers, settings.lookahead_max)
    began = time.perf_counter()
    actor_futures = [
        client.submit(
            GridActor,
            [configs[j] for j in s.configs],
            engine,
            device,
            reference_tau,
            settings,
            None if states is None else [states[j] for j in s.configs],
            graph.start,
            actor=True,
            workers=[s.worker],
            allow_other_workers=False,
            pure=False,
        )
        for s in shares
    ]
    try:
        actors = []
        for s, fut in zip(shares, actor_futures, strict=True):
            try:
                actors.append(fut.result())
            except RhDaskError:
                raise
            except Exception as exc:
                if _alive(client, s.worker):
                    raise EngineUnavailableError(
                        f"the grid actor could not start on {s.worker}: {exc}"
                    ) from exc
                raise _lost(client, s, graph.start, exc) from None
        return _drive(client, graph, shares, actors, lookahead, began)
    finally:
        for fut in actor_futures:
            fut.release()


def _drive(
    client: Any,
    graph: ChunkGraph,
    shares: list[Share],
    actors: list[Any],
    lookahead: int,
    began: float,
) -> GridWalk:
    n = graph.n_chunks
    inflight: deque[tuple[int, Future, list[Any]]] = deque()
    held: dict[Any, Future] = {}
    committed = graph.start - 1
    empty = 0
    error: Exception | None = None
    submitted = graph.start

    def submit(i: int) -> None:
        key = graph.keys[i]
        shared = graph.shared_owned(i)
        futures = client.get(graph.submission(i), [key, *shared], sync=False, priority=-i)
        for k, f in zip(shared, futures[1:], strict=True):
            held[k] = f
        handed = [
            client.submit(
                deliver_grid_chunk,
                futures[0],
                actor.key,
                i,
                workers=[share.worker],
                allow_other_workers=False,
                pure=False,
                priority=-i,
            )
            for share, actor in zip(shares, actors, strict=True)
        ]
        calls = [a.consume(i, committed) for a in actors]
        inflight.append((i, futures[0], [*calls, *handed]))

    def answers(i: int, item: Future, pending: list[Any]) -> list[tuple[str, Any]]:
        calls = pending[: len(actors)]
        out = []
        for share, call in zip(shares, calls, strict=True):
            while True:
                try:
                    out.append(call.result(timeout=_CHECK_SECONDS))
                    break
                except TimeoutError:
                    if not _alive(client, share.worker):
                        raise _lost(client, share, i, TimeoutError("no answer")) from None
                    if item.status == "error":  # the chunk's task failed: it never arrives
                        exc = item.exception()
                        reason = f"{type(exc).__name__}: {exc}"
                        for a in actors:
                            a.fail(i, reason, exc).result()
                except RhDaskError:
                    raise
                except Exception as exc:
                    if _alive(client, share.worker):
                        raise _failed(share, i, exc) from exc
                    raise _lost(client, share, i, exc) from exc
        for f in pending[len(actors) :]:
            f.release()
        return out

    try:
        while submitted < n and len(inflight) < lookahead:
            submit(submitted)
            submitted += 1
        while inflight:
            i, item_future, calls = inflight.popleft()
            results = answers(i, item_future, calls)
            item_future.release()
            for k in graph.release_after(i):
                f = held.pop(k, None)
                if f is not None:
                    f.release()
            kinds = [kind for kind, _ in results]
            if all(k == "ok" for k in kinds):
                committed = i
            elif all(k == "empty" for k in kinds):
                empty += 1
                committed = i
            else:
                error = _stop_error(i, results)
                for j, later_item, later in inflight:  # let every call in flight finish
                    answers(j, later_item, later)
                inflight.clear()
                for share, actor in zip(shares, actors, strict=True):
                    try:
                        actor.rollback(i).result()
                    except Exception as exc:
                        raise _lost(client, share, i, exc) from exc
                break
            if submitted < n:
                submit(submitted)
                submitted += 1
        parts = []
        for share, actor in zip(shares, actors, strict=True):
            try:
                parts.append(actor.result().result())
            except Exception as exc:
                raise _lost(client, share, n, exc) from exc
        for actor in actors:
            try:
                actor.close().result()
            except Exception:  # a failed release must not hide the walk's outcome
                pass
    finally:
        for _, f, pending in inflight:
            f.release()
            for p in pending[len(actors) :]:
                p.release()
        for f in held.values():
            f.release()
    fitted = parts[0][0] is not None
    states = [s for p in parts for s in p[0]] if fitted else None
    return GridWalk(
        states=states,
        records=merge_records([p[1] for p in parts]),
        empty=empty,
        shares=shares,
        busy=[p[2] for p in parts],
        wall=time.perf_counter() - began,
        lookahead=lookahead,
        error=error,
    )


def _stop_error(index: int, results: list[tuple[str, Any]]) -> Exception:
    """The stream error of the first actor that did not take chunk ``index``."""
    for kind, payload in results:
        if kind == "bad":
            return payload.exception()
        if kind == "refused":
            message = f"chunk {index} was refused: {type(payload).__name__}: {payload}"
            return chunk_error(index, payload, message)
    return chunk_error(index, ValidationError(f"the actors disagree about chunk {index}"))
