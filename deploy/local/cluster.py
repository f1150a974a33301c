"""The one-machine cluster of ``start-cluster.sh``, started from Python.

    python deploy/local/cluster.py                 # a LocalCUDACluster, one GPU=1 worker per GPU
    python deploy/local/cluster.py --cpu-as-gpu    # rehearsal without a GPU (CPU workers, GPU=1)

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
import time


def start(args: argparse.Namespace) -> object:
    """A LocalCUDACluster (GPU=1 per GPU worker), or CPU workers advertising GPU=1."""
    common = {
        "host": args.host,
        "scheduler_port": args.port,
        "dashboard_address": args.dashboard,
        "resources": {"GPU": 1},
    }
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
    parser.add_argument("--dashboard", default=None, help="e.g. :8787 (needs bokeh)")
    parser.add_argument("--workers", type=int, default=None, help="default: one per GPU")
    parser.add_argument("--threads", type=int, default=None, help="threads per worker")
    parser.add_argument(
        "--cpu-as-gpu", action="store_true", help="no GPU: CPU workers advertising GPU=1"
    )
    args = parser.parse_args()
    # SIGTERM (kill, docker stop) shuts down as cleanly as Ctrl-C.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    with start(args) as cluster:
        print(f"rh-dask cluster: scheduler at {cluster.scheduler_address} (Ctrl-C stops it)")
        print(f"  connect: rh-dask fit --scheduler {cluster.scheduler_address} ...", flush=True)
        try:
            while True:
                time.sleep(1)
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()
