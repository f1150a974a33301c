"""The cluster a command runs on: a scheduler to connect to, or one started here.

``--scheduler`` of the command line takes

* an address (``tcp://host:8786``, ``host:8786``): connect, with a short
  timeout, and wait (briefly) for a first worker;
* ``local``: start a cluster on this machine bound to 127.0.0.1. With
  dask-cuda installed and a GPU visible it is a ``LocalCUDACluster`` (one
  worker per GPU, each advertising ``resources={"GPU": 1}``), else a CPU
  ``LocalCluster``;
* ``none``: no cluster. Chunks are computed in this process with dask's
  threaded scheduler, and the stream walks them with the local engine.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

from .exceptions import RhDaskError

__all__ = ["ClusterError", "ClusterSession", "gpu_count", "open_cluster"]

#: Resource name GPU workers advertise (``dask cuda worker --resources GPU=1``).
GPU_RESOURCE = "GPU"


class ClusterError(RhDaskError, RuntimeError):
    """The scheduler cannot be reached, or the cluster has no usable workers."""


@dataclass
class ClusterSession:
    """A client and, when this process started it, the cluster behind it.

    Attributes
    ----------
    kind : {"remote", "local", "local-cuda", "none"}
    client : distributed.Client or None
    cluster : distributed.deploy.Cluster or None
        Owned by the session (closed with it) when it was started here.
    """

    kind: str
    client: Any = None
    cluster: Any = None
    _closed: bool = field(default=False, repr=False)

    @property
    def address(self) -> str | None:
        return None if self.client is None else self.client.scheduler.address

    def workers(self) -> list[dict[str, Any]]:
        """Name, address, threads, memory limit and resources of every worker."""
        if self.client is None:
            return []
        info = self.client.scheduler_info(n_workers=-1)["workers"]
        return [
            {
                "address": address,
                "name": str(w.get("name", address)),
                "nthreads": int(w.get("nthreads", 0)),
                "memory_limit": int(w.get("memory_limit") or 0),
                "resources": dict(w.get("resources") or {}),
            }
            for address, w in sorted(info.items())
        ]

    def has_gpu_workers(self) -> bool:
        """Whether any worker advertises the ``GPU`` resource."""
        return any(w["resources"].get(GPU_RESOURCE, 0) >= 1 for w in self.workers())

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.client is not None:
            self.client.close()
        if self.cluster is not None:
            self.cluster.close()

    def __enter__(self) -> ClusterSession:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def gpu_count() -> int:
    """GPUs dask-cuda can see here (0 when dask-cuda or a GPU is missing)."""
    try:
        from dask_cuda.utils import get_n_gpus
    except ImportError:
        return 0
    try:
        return int(get_n_gpus())
    except Exception:  # no driver, no NVML: no GPU for our purposes
        return 0


def _start_local(
    n_workers: int | None, threads_per_worker: int | None, memory_limit: str | None
) -> tuple[str, Any]:
    quiet = {"silence_logs": logging.ERROR, "dashboard_address": None}
    gpus = gpu_count()
    if gpus > 0:
        from dask_cuda import LocalCUDACluster

        # LocalCUDACluster gives each GPU worker one thread by default; chunks
        # load on the engine worker's threads, so share the CPU cores out.
        threads = threads_per_worker or max(1, (os.cpu_count() or 1) // gpus)
        options: dict[str, Any] = {"resources": {GPU_RESOURCE: 1}, **quiet}
        if memory_limit is not None:
            options["memory_limit"] = memory_limit
        cluster = LocalCUDACluster(host="127.0.0.1", threads_per_worker=threads, **options)
        return "local-cuda", cluster
    from distributed import LocalCluster

    options = dict(quiet)
    if memory_limit is not None:
        options["memory_limit"] = memory_limit
    return "local", LocalCluster(
        host="127.0.0.1",
        n_workers=n_workers,
        threads_per_worker=threads_per_worker,
        processes=True,
        **options,
    )


def open_cluster(
    scheduler: str | None,
    *,
    scheduler_file: str | None = None,
    timeout: float = 10.0,
    n_workers: int | None = None,
    threads_per_worker: int | None = None,
    memory_limit: str | None = None,
) -> ClusterSession:
    """Connect to, or start, the cluster named by ``scheduler``.

    Parameters
    ----------
    scheduler : str or None
        An address, ``"local"`` or ``"none"`` (``None`` means ``"none"``).
    scheduler_file : str, optional
        A scheduler file (``dask scheduler --scheduler-file``) instead of an address.
    timeout : float
        Seconds to wait for the scheduler, then for its first worker.
    n_workers, threads_per_worker, memory_limit
        Shape of a ``local`` CPU cluster (dask's defaults when ``None``).

    Raises
    ------
    ClusterError
        When the scheduler does not answer within ``timeout`` or has no worker.
    """
    from distributed import Client

    if scheduler_file is not None:
        if not os.path.isfile(scheduler_file):
            raise ClusterError(f"no scheduler file at {scheduler_file!r}")
        target: dict[str, Any] = {"scheduler_file": scheduler_file}
        where = scheduler_file
    elif scheduler in (None, "none"):
        return ClusterSession("none")
    elif scheduler == "local":
        kind, cluster = _start_local(n_workers, threads_per_worker, memory_limit)
        try:
            return ClusterSession(kind, Client(cluster), cluster)
        except BaseException:
            cluster.close()
            raise
    else:
        target = {"address": scheduler}
        where = scheduler
    try:
        client = Client(**target, timeout=timeout)
    except (OSError, TimeoutError, ValueError) as exc:
        raise ClusterError(
            f"cannot connect to the Dask scheduler at {where} within {timeout:g} s: {exc}"
        ) from exc
    session = ClusterSession("remote", client)
    try:
        client.wait_for_workers(1, timeout=timeout)
    except TimeoutError as exc:
        session.close()
        raise ClusterError(
            f"the Dask scheduler at {where} has no workers (waited {timeout:g} s)"
        ) from exc
    return session
