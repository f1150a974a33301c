"""The one-machine cluster of ``start-cluster.sh``, started from Python.

    python deploy/local/cluster.py                 # a LocalCUDACluster, one GPU=1 worker per GPU
    python deploy/local/cluster.py --cpu-as-gpu    # rehearsal without a GPU (CPU workers, GPU=1)
    python deploy/local/cluster.py --host 0.0.0.0 --tls-dir certs   # other machines: mutual TLS

Listening beyond 127.0.0.1 needs ``--tls-dir DIR`` (the credentials of
``rh-dask certs DIR``, made there when DIR has none); the cluster then speaks
only TLS. A ``--dashboard`` without a host stays on 127.0.0.1.

It prints the scheduler address and keeps the cluster up until Ctrl-C; fit
from another shell with ``rh-dask fit --scheduler ADDRESS ...``. Inside your
own program, use the same cluster directly::

    from dask_cuda import LocalCUDACluster
    from distributed import Client
    import dask.dataframe as dd
    from rh_dask import RenewableHuberRegressor

    with LocalCUDACluster(resources={"GPU": 1}, threads_per_worker=8) as cluster, \\
            Client(cluster):
        frame = dd.read_parquet("data/*.parquet")
        model = RenewableHuberRegressor(engine="gpu").fit(frame, "y")
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import time

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def start(args: argparse.Namespace) -> object:
    """A LocalCUDACluster (GPU=1 per GPU worker), or CPU workers advertising GPU=1."""
    dashboard = args.dashboard
    if dashboard is not None and dashboard.startswith(":"):
        dashboard = "127.0.0.1" + dashboard  # host-less: every interface otherwise
    common: dict[str, object] = {
        "host": args.host,
        "scheduler_port": args.port,
        "dashboard_address": dashboard,
        "resources": {"GPU": 1},
    }
    if args.tls_dir is not None:
        from rh_dask.app.security import CA_FILE, cluster_security, write_credentials

        if not os.path.exists(os.path.join(args.tls_dir, CA_FILE)):
            write_credentials(args.tls_dir, hosts=[socket.gethostname()])
        common.update(protocol="tls://", security=cluster_security(args.tls_dir))
    if args.cpu_as_gpu:
        from distributed import LocalCluster

        return LocalCluster(n_workers=args.workers, threads_per_worker=args.threads, **common)
    from dask_cuda import LocalCUDACluster

    # Chunks load on the GPU worker's own threads: give it the machine's cores.
    threads = args.threads or max(1, (os.cpu_count() or 1) // max(1, args.workers or 1))
    return LocalCUDACluster(n_workers=args.workers, threads_per_worker=threads, **common)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8786)
    parser.add_argument("--dashboard", default=None, help="e.g. :8787, on 127.0.0.1 (needs bokeh)")
    parser.add_argument(
        "--tls-dir", default=None, help="mutual TLS with rh-dask certs' credentials in DIR"
    )
    parser.add_argument("--workers", type=int, default=None, help="default: one per GPU")
    parser.add_argument("--threads", type=int, default=None, help="threads per worker")
    parser.add_argument(
        "--cpu-as-gpu", action="store_true", help="no GPU: CPU workers advertising GPU=1"
    )
    args = parser.parse_args()
    if args.host not in LOOPBACK and args.tls_dir is None:
        parser.error(f"--host {args.host} listens beyond this machine: add --tls-dir DIR")
    # SIGTERM (kill, docker stop) shuts down as cleanly as Ctrl-C.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    with start(args) as cluster:
        print(f"rh-dask cluster: scheduler at {cluster.scheduler_address} (Ctrl-C stops it)")
        tls = "" if args.tls_dir is None else f" --tls-dir {args.tls_dir}"
        print(f"  connect: rh-dask fit --scheduler {cluster.scheduler_address}{tls} ...")
        sys.stdout.flush()
        try:
            while True:
                time.sleep(1)
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()
