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

A local cluster's dashboard is off unless asked for; its scheduler still
serves its small HTTP API (health, metrics), on a free port of 127.0.0.1.

Ctrl-C belongs to this process. A terminal sends SIGINT to the whole
process group, and a local cluster's worker processes are in that group:
left alone, each would die of the signal mid-task, printing tracebacks, and
the scheduler would wait for them to time out. So the workers are started
with SIGINT blocked (a blocked signal stays pending and is never delivered;
the mask is inherited by every process the cluster's event loop spawns), and
this process, interrupted, closes them itself, quietly, within a few seconds
(:meth:`ClusterSession.close`). A Ctrl-C while the cluster starts takes
effect once it has started.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

from ..distributed.placement import GPU_RESOURCE
from ..exceptions import CertificateError, ClusterError

__all__ = ["ClusterError", "ClusterSession", "gpu_count", "open_cluster"]

#: Seconds an interrupted command gives a local cluster to close; its worker
#: processes also exit when this process does.
INTERRUPTED_CLOSE_SECONDS = 3.0


@dataclass
class ClusterSession:
    """A client and, when this process started it, the cluster behind it.

    Attributes
    ----------
    kind : {"remote", "local", "local-cuda", "none"}
    client : distributed.Client or None
    cluster : distributed.deploy.Cluster or None
        Owned by the session (closed with it) when it was started here.
    dashboard : bool
        Whether the dashboard was asked for (see :attr:`dashboard_link`).
    """

    kind: str
    client: Any = None
    cluster: Any = None
    dashboard: bool = False
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

    @property
    def dashboard_link(self) -> str | None:
        """The dashboard's address when it was asked for and the scheduler serves one."""
        if not self.dashboard or self.client is None:
            return None
        return self.client.dashboard_link or None

    def has_gpu_workers(self) -> bool:
        """Whether any worker advertises the ``GPU`` resource."""
        return any(w["resources"].get(GPU_RESOURCE, 0) >= 1 for w in self.workers())

    def close(self, *, interrupted: bool = False) -> None:
        """Close the client, and the cluster when this ClusterSession started it.

        Parameters
        ----------
        interrupted : bool
            The command was interrupted: close within
            :data:`INTERRUPTED_CLOSE_SECONDS`, with distributed's logging and
            warnings silenced (workers being stopped mid-task report it).
        """
        if self._closed:
            return
        self._closed = True
        if not interrupted:
            if self.client is not None:
                self.client.close()
            if self.cluster is not None:
                self.cluster.close()
            return
        with _silenced():
            if self.client is not None:
                with contextlib.suppress(Exception):
                    self.client.close(timeout=INTERRUPTED_CLOSE_SECONDS)
            if self.cluster is not None:
                with contextlib.suppress(Exception):
                    self.cluster.close(timeout=INTERRUPTED_CLOSE_SECONDS)

    def __enter__(self) -> ClusterSession:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close(interrupted=exc_type is not None and issubclass(exc_type, KeyboardInterrupt))


@contextlib.contextmanager
def _silenced() -> Iterator[None]:
    """No log records and no warnings from this process while the block runs."""
    previous = logging.root.manager.disable
    logging.disable(logging.CRITICAL)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.disable(previous)


@contextlib.contextmanager
def _sigint_deferred() -> Iterator[None]:
    """Start a cluster inside: its processes never see SIGINT, this one sees it after.

    SIGINT is blocked in this thread, so the cluster's event loop thread,
    created in the block, and the threads it creates to spawn worker
    processes inherit the blocked signal, and so do the processes
    (``fork`` and ``exec`` keep the mask). Multiprocessing's resource
    tracker unblocks SIGINT in the thread that first starts it, so it is
    started before the block. A Ctrl-C during the block is recorded and
    raised as :class:`KeyboardInterrupt` when the block ends, once the
    cluster can be closed as a whole.
    """
    if not hasattr(signal, "pthread_sigmask"):  # Windows: no process groups to guard
        yield
        return
    with contextlib.suppress(Exception):  # no multiprocessing semaphores: nothing to start
        from multiprocessing import resource_tracker

        resource_tracker.ensure_running()
    interrupted = []
    handler = None
    if threading.current_thread() is threading.main_thread():
        handler = signal.signal(signal.SIGINT, lambda signum, frame: interrupted.append(signum))
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
        if handler is not None:
            signal.signal(signal.SIGINT, handler)
    if interrupted:
        raise KeyboardInterrupt


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


def _dashboard_options(dashboard: str | None) -> dict[str, Any]:
    """LocalCluster options for a dashboard at ``dashboard``, or for none.

    Without a dashboard the scheduler still starts its HTTP server (health
    and metrics routes); at distributed's default port 8787 it warns on every
    run when that port is taken, so it gets a free port of 127.0.0.1 instead.
    """
    if dashboard is None:
        return {
            "dashboard_address": None,
            "scheduler_kwargs": {"dashboard": False, "dashboard_address": "127.0.0.1:0"},
        }
    if dashboard.startswith(":") or dashboard.isdigit():
        # distributed serves a host-less address on every interface: keep it local.
        dashboard = "127.0.0.1:" + dashboard.lstrip(":")
    return {"dashboard_address": dashboard}


def _connect_error(where: str, timeout: float, security: Any, exc: Exception) -> ClusterError:
    """The one-line error for a failed connect, naming TLS when TLS is the problem."""
    text = " ".join(str(exc).split())
    if "certificate" in text.lower() or "ssl" in text.lower():
        return CertificateError(
            f"the TLS scheduler at {where} and this client did not accept each other's "
            "certificates (a certificate of another CA, expired, or none): "
            f"{text.split(' Check your security settings')[0]}"
        )
    if security is None and "reset by peer" in text:
        return ClusterError(
            f"the Dask scheduler at {where} closed the connection: {text} (a scheduler "
            "that requires TLS refuses plain tcp://; use tls:// and --tls-dir DIR)"
        )
    return ClusterError(
        f"cannot connect to the Dask scheduler at {where} within {timeout:g} s: {text}"
    )


def _start_local(
    n_workers: int | None,
    threads_per_worker: int | None,
    memory_limit: str | None,
    dashboard: str | None = None,
) -> tuple[str, Any]:
    # Only critical records: a command reports its own failures in one line, and
    # workers stopped by an interrupted command log the comms they lose.
    quiet = {"silence_logs": logging.CRITICAL, **_dashboard_options(dashboard)}
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
    dashboard: str | None = None,
    security: Any = None,
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
    dashboard : str, optional
        Serve a ``local`` cluster's dashboard at this address
        (``127.0.0.1:8787``); ``None``: no dashboard. For a remote scheduler
        any value asks for its dashboard's link (:attr:`ClusterSession.dashboard_link`).
        An address without a host (``:8787``) is bound to 127.0.0.1; name
        the host (``0.0.0.0:8787``) to serve it beyond this machine.
    security : distributed.security.Security, optional
        TLS credentials for a ``tls://`` scheduler
        (:func:`rh_dask.app.security.client_security`).

    Raises
    ------
    ClusterError
        When the scheduler does not answer within ``timeout`` or has no worker;
        :class:`~rh_dask.app.security.CertificateError` (a ClusterError) when
        a TLS scheduler and this client do not accept each other's certificates.
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
        session = None
        try:
            with _sigint_deferred():
                kind, cluster = _start_local(
                    n_workers, threads_per_worker, memory_limit, dashboard
                )
                session = ClusterSession(kind, cluster=cluster, dashboard=dashboard is not None)
                session.client = Client(cluster)
        except BaseException as exc:  # a Ctrl-C during the start arrives as the block ends
            if session is not None:
                session.close(interrupted=isinstance(exc, KeyboardInterrupt))
            raise
        return session
    else:
        target = {"address": scheduler}
        where = scheduler
    if security is not None:
        target["security"] = security
    try:
        client = Client(**target, timeout=timeout)
    except (OSError, TimeoutError, ValueError, TypeError, RuntimeError) as exc:
        raise _connect_error(where, timeout, security, exc) from exc
    session = ClusterSession("remote", client, dashboard=dashboard is not None)
    try:
        client.wait_for_workers(1, timeout=timeout)
    except TimeoutError as exc:
        session.close()
        raise ClusterError(
            f"the Dask scheduler at {where} has no workers (waited {timeout:g} s)"
        ) from exc
    return session
