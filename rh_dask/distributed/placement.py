"""Choosing the worker that hosts the engine actor.

* an explicit ``worker`` address wins (it must be a worker of the cluster);
* ``engine="gpu"`` needs a worker advertising ``resources={"GPU": 1}`` (what
  ``dask cuda worker --resources GPU=1`` and ``LocalCUDACluster(resources=...)``
  start);
* the NumPy engine takes any worker, preferring one without a GPU and with
  the most threads (they load chunks next to the engine).
* ``engine="auto"`` takes the GPU worker with the most threads when there is
  one, where the actor decides GPU or NumPy; otherwise it is placed as the
  NumPy engine is.

A request no worker can host raises
:class:`~rh_dask.exceptions.EngineUnavailableError` saying what was looked for.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from distributed.comm import get_address_host

from ..exceptions import EngineUnavailableError

#: The resource a GPU worker advertises (``dask cuda worker --resources GPU=1``).
GPU_RESOURCE = "GPU"


@dataclass(frozen=True)
class WorkerInfo:
    """The facts placement needs about one worker."""

    address: str
    nthreads: int
    resources: dict[str, float]

    @property
    def has_gpu(self) -> bool:
        return self.resources.get(GPU_RESOURCE, 0) >= 1


def scheduler_workers(client: Any) -> dict[str, dict[str, Any]]:
    """Every worker the scheduler knows now: address -> what it reports of it.

    Asked of the scheduler directly: ``client.scheduler_info()`` answers from
    a copy that the client's periodic refresh also rewrites, with no worker
    listed in distributed 2026.x, so a call racing that refresh may see none.
    """
    return client.sync(client.scheduler.identity, n_workers=-1)["workers"]


def cluster_workers(client: Any) -> list[WorkerInfo]:
    """The cluster's workers, freshly asked of the scheduler."""
    info = scheduler_workers(client)
    return [
        WorkerInfo(addr, int(w.get("nthreads", 1)), dict(w.get("resources") or {}))
        for addr, w in sorted(info.items())
    ]


def choose_worker(workers: list[WorkerInfo], engine: str, worker: str | None) -> WorkerInfo:
    """Pick the worker for ``engine``.

    Parameters
    ----------
    workers : list of WorkerInfo
    engine : {"numpy", "gpu", "auto"}
        The engine; ``"auto"`` takes a GPU worker when there is one (the
        actor then decides GPU or NumPy there), else a worker as NumPy does.
    worker : str or None
        An explicit address (or worker name as the scheduler reports it).

    Raises
    ------
    EngineUnavailableError
        When there are no workers, the address is unknown, or no worker
        advertises a GPU for ``engine="gpu"``.
    """
    if not workers:
        raise EngineUnavailableError("the Dask cluster has no workers to host the engine")
    if worker is not None:
        for w in workers:
            if w.address == worker or w.address.split("://")[-1] == worker:
                return w
        known = ", ".join(w.address for w in workers)
        raise EngineUnavailableError(f"worker {worker!r} is not in the cluster (workers: {known})")
    if engine == "gpu":
        gpus = [w for w in workers if w.has_gpu]
        if not gpus:
            raise EngineUnavailableError(
                "engine='gpu' needs a worker advertising resources {'GPU': 1} (start it "
                "with `dask cuda worker --resources GPU=1`, or LocalCUDACluster("
                "resources={'GPU': 1})), or an explicit worker=ADDRESS; no worker of "
                f"this cluster does ({len(workers)} workers)"
            )
        return max(gpus, key=lambda w: w.nthreads)
    if engine == "auto":
        gpus = [w for w in workers if w.has_gpu]
        if gpus:
            return max(gpus, key=lambda w: w.nthreads)
    # NumPy engine: keep GPU workers free for GPU streams when there is a choice.
    return max(workers, key=lambda w: (not w.has_gpu, w.nthreads))


def node_of(address: str) -> str:
    """The host part of a worker's address (``tcp://10.0.0.5:4321`` -> ``10.0.0.5``)."""
    try:
        return get_address_host(address)
    except ValueError:  # an inproc address of another process: its host part
        return address.split("://", 1)[-1].split("/", 1)[0]


def _node_peers(workers: list[WorkerInfo], host: WorkerInfo) -> list[WorkerInfo]:
    """The workers on ``host``'s node other than ``host`` (addresses compared)."""
    node = node_of(host.address)
    return [w for w in workers if w.address != host.address and node_of(w.address) == node]


def relay_candidates(
    workers: list[WorkerInfo], host: WorkerInfo, resource: str
) -> list[WorkerInfo]:
    """The workers that may relay chunks to the engine on ``host`` (``loader="relay"``).

    The workers on the engine's node other than its own: those advertising
    ``resource`` when any worker of the cluster does, else all of them. Only
    the address is compared here; attaching to the engine's ring confirms
    that a candidate shares the node's memory (:mod:`.relay`).
    """
    if any(w.resources.get(resource, 0) > 0 for w in workers):
        return advertised_relays(workers, host, resource)
    return _node_peers(workers, host)


def advertised_relays(
    workers: list[WorkerInfo], host: WorkerInfo, resource: str
) -> list[WorkerInfo]:
    """The workers of the engine's node that advertise ``resource`` (``loader="auto"``)."""
    return [w for w in _node_peers(workers, host) if w.resources.get(resource, 0) > 0]


def loading_workers(
    workers: list[WorkerInfo], host: WorkerInfo, relays: list[str]
) -> list[WorkerInfo]:
    """Where a relayed stream's chunks load: neither the engine's worker nor a relay.

    When no such worker exists, the relays themselves load.
    """
    taken = {host.address, *relays}
    others = [w for w in workers if w.address not in taken]
    return others or [w for w in workers if w.address in relays]


#: ``lookahead="auto"`` where chunks load on the engine's worker, and the least elsewhere:
#: with a task per chunk on that worker, 16 and 32 were no faster than 8 (docs/distributed.md).
BASE_LOOKAHEAD = 8


def auto_lookahead(mode: str, in_flight: int, most: int) -> int:
    """``lookahead="auto"``: the chunks a walk keeps ahead of the engine.

    Where chunks load off the engine's worker (``mode`` ``"relay"`` or
    ``"cluster"``), twice ``in_flight``, the chunks the loading workers may
    load or send at once, so that each has a chunk queued behind the one in
    flight (measured in docs/performance.md, "Scale-out"); at least
    :data:`BASE_LOOKAHEAD`, at most ``most``
    (``rh-dask.distributed.lookahead-max``). Elsewhere
    :data:`BASE_LOOKAHEAD`, capped the same way.
    """
    if mode in ("relay", "cluster"):
        return min(max(BASE_LOOKAHEAD, 2 * int(in_flight)), int(most))
    return min(BASE_LOOKAHEAD, int(most))


def chunks_in_flight(loading: list[WorkerInfo], sends: Callable[[int], int] | None = None) -> int:
    """The chunks ``loading`` workers may have in hand at once.

    One per task thread; where a relayed stream's file chunks go out with
    more sends than threads, the sends a worker may keep in flight:
    ``sends(task_threads)`` (:func:`rh_dask.distributed.push.sends_allowed`
    for the stream).
    """
    return sum(max(w.nthreads, 0 if sends is None else sends(w.nthreads)) for w in loading)


def resolve_lookahead(
    lookahead: int | str,
    mode: str,
    loading: list[WorkerInfo],
    most: int,
    sends: Callable[[int], int] | None = None,
) -> int:
    """The look-ahead a walk runs with: ``lookahead`` itself, or ``"auto"`` decided.

    ``loading`` are the workers that load its chunks (none in the client's
    process), ``sends`` the file sends each may keep in flight where chunks
    are relayed over TCP; see :func:`auto_lookahead` and
    :func:`chunks_in_flight`.
    """
    if isinstance(lookahead, str) and lookahead == "auto":
        return auto_lookahead(mode, chunks_in_flight(loading, sends), most)
    return int(lookahead)
