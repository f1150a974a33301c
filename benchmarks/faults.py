"""Fault tolerance: what stream checkpoints cost, and what losing the engine's worker costs.

The dataset is distributed_fit.py's (``X.npy``/``y.npy``, float32 by default,
written once under ``$TMPDIR``), read as views of a memory map by default
(``--source mmap``, as ``dask.array.from_npy_stack`` reads a NumPy stack) in
``--n-chunks`` row chunks. The cluster has two worker processes under nannies
that can both host the engine: for the NumPy engine a ``LocalCluster``; for
the GPU engine a ``LocalCUDACluster`` worker plus a second nanny-started
worker advertising ``GPU=1`` on the same GPU (see :func:`start_cluster`).
Both workers fit two chunks first (imports, engine start-up, kernels), so the
measurements below see warm processes. Measured:

* **checkpoint overhead**: the fit's wall time with ``checkpoint_every`` in
  ``--every`` (by chunks only: ``rh-dask.checkpoint.every-seconds=0``), held
  by the client only and also written to a ``checkpoint_dir`` on local disk,
  as ratios to the baseline: ``checkpoint_every`` larger than the stream and
  ``every-seconds=0``, so that the only stream checkpoint is the one taken when
  the walk ends (there is no way to take none). The packaged defaults are
  measured too. Runs are interleaved (each repeat runs every setting once);
  medians of ``--repeats``. Apart, the seconds to encode one stream
  checkpoint of the whole stream and to write it to local disk;
* **a lost engine worker**: the process loading chunk ``--kill-at`` (with
  ``loader="actor"``, the engine's worker) SIGKILLs itself, once per run, with
  ``checkpoint_every=--kill-every`` (default: the packaged setting; the
  default chunk leaves the engine half-way between two checkpoints). From
  ``recoveries_``: ``detect_seconds`` (last answer of the lost engine to the
  loss noticed), ``recover_seconds`` (to the new engine ready at the
  checkpoint), ``chunks_replayed`` (those the client had heard of: the
  engine reports every poll interval); ``chunks_replayed_at_least``, from the
  feeder's rule (chunk ``i`` starts loading once chunk ``i - lookahead`` is
  consumed); from the killed process's own clock, the time from the kill to
  its detection; the fit's wall time against the same
  collection's uninterrupted fit; and whether the coefficients are
  bit-identical. Medians of ``--kill-repeats``;
* **no eligible worker**: the same kill with the fit pinned to the killed
  worker's address (which its nanny never restarts it at), for each
  ``--worker-timeouts`` value: the time from the kill to ``ActorLostError``.

    # CPU, this machine's scale
    python benchmarks/faults.py --engine numpy --rows 1000000 \\
        --output benchmarks/results/faults-cpu.json
    # device (H200): 20M x 90 float32 in 64 chunks
    python benchmarks/faults.py --engine gpu --rows 20000000 \\
        --output benchmarks/results/faults-h200.json
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

import dask.config
import numpy as np
from common import environment, summarize, write_json
from distributed_fit import SOURCE, dask_inputs, describe_cluster, stop_cluster, write_dataset

from rh_dask import RenewableHuberRegressor
from rh_dask.checkpoint import checkpoint_bytes
from rh_dask.checkpoint_store import CheckpointStore
from rh_dask.distributed.placement import scheduler_workers

SCHEMA = "rh-dask/bench/faults/1"

#: ``checkpoint_every`` of the baseline: larger than any stream (only the walk's end checkpoints).
NEVER = 1 << 40


# -- the cluster -----------------------------------------------------------------------------
def start_cluster(engine: str, threads: int) -> tuple[Any, Any, list[Any], str]:
    """Two worker processes under nannies that can both host ``engine``.

    Returns ``(cluster, client, extra nannies, description)``. For the GPU
    engine both advertise ``resources={"GPU": 1}`` and use the same device:
    ``LocalCUDACluster`` names its workers by device and refuses a second
    worker on one (``CUDA_VISIBLE_DEVICES=[0, 0]`` stops at "Can not scale
    beyond visible devices"), so it starts one worker and a plain ``Nanny``
    with ``CUDA_VISIBLE_DEVICES`` set to the same device adds the other.
    Without dask-cuda both are ``LocalCluster`` workers.
    """
    from distributed import Client, LocalCluster, Nanny

    cluster, kind = None, "LocalCluster(n_workers=2)"
    resources = {"GPU": 1} if engine == "gpu" else None
    if engine == "gpu":
        try:
            from dask_cuda import LocalCUDACluster

            cluster = LocalCUDACluster(
                n_workers=1,
                threads_per_worker=threads,
                resources=resources,
                dashboard_address=":0",
            )
            kind = "LocalCUDACluster(n_workers=1) + Nanny(resources GPU=1, same device)"
        except Exception as exc:  # plain workers can host the GPU engine too
            kind = f"LocalCluster(n_workers=2; dask-cuda failed: {type(exc).__name__}: {exc})"
            print(kind, file=sys.stderr, flush=True)
    if cluster is None:
        cluster = LocalCluster(
            n_workers=2,
            threads_per_worker=threads,
            processes=True,
            dashboard_address=":0",
            resources=resources,
        )
    client = Client(cluster, direct_to_workers=True, set_as_default=True)
    extra: list[Any] = []
    if len(scheduler_workers(client)) < 2:
        device = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or "0"

        async def start() -> list[Any]:
            env = {"CUDA_VISIBLE_DEVICES": device}
            return [
                await Nanny(
                    cluster.scheduler_address, nthreads=threads, resources=resources, env=env
                )
            ]

        extra = client.sync(start)
    client.wait_for_workers(2, timeout=120)
    return cluster, client, extra, kind


def worker_addresses(client: Any) -> list[str]:
    return sorted(scheduler_workers(client))


# -- the kill ----------------------------------------------------------------------------------
def die_loading(
    block: np.ndarray, *, at: int, marker: str, log: str, block_info: dict | None = None
) -> np.ndarray:
    """Chunk function: the first process to load chunk ``at`` logs the time and SIGKILLs itself.

    ``marker`` is created atomically before dying, so the kill fires once
    (the chunk's reload after the recovery passes); ``log`` gets the pid and
    the POSIX time of the kill.
    """
    if block_info is None or block_info[0]["chunk-location"][0] != at:
        return block
    try:
        fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return block
    os.close(fd)
    with open(log, "a") as fh:
        fh.write(f"{os.getpid()} {time.time()!r}\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.kill(os.getpid(), signal.SIGKILL)
    return block  # not reached


def killing(X: Any, at: int, marker: Path, log: Path) -> Any:
    """``X`` whose chunk ``at`` kills the process loading it (the chunk's values unchanged)."""
    meta = np.empty((0, 0), X.dtype)
    return X.map_blocks(
        die_loading, at=at, marker=str(marker), log=str(log), dtype=X.dtype, meta=meta
    )


def killed_at(log: Path) -> tuple[int, float]:
    pid, when = log.read_text().split()
    return int(pid), float(when)


# -- one fit -----------------------------------------------------------------------------------
def fit(args: argparse.Namespace, X: Any, y: Any, **params: Any) -> tuple[float, Any]:
    """``(wall seconds, fitted model)`` of one fit with the benchmark's estimator parameters."""
    model = RenewableHuberRegressor(
        engine=args.engine,
        dtype=args.dtype,
        loader=args.loader,
        lookahead=args.lookahead,
        progress=False,
        **params,
    )
    start = time.perf_counter()
    model.fit(X, y)
    return time.perf_counter() - start, model


def same_bits(a: Any, b: Any) -> bool:
    return bool(
        a.coef_.tobytes() == b.coef_.tobytes()
        and np.float64(a.intercept_).tobytes() == np.float64(b.intercept_).tobytes()
        and a.state_.information.tobytes() == b.state_.information.tobytes()
    )


def warm_up(args: argparse.Namespace, client: Any, directory: Path, chunk_rows: int) -> None:
    """Two chunks fitted on each worker: imports, engine start-up and kernels, before timing."""
    small = dask_inputs(directory, chunk_rows, rows=2 * chunk_rows)
    for address in worker_addresses(client):
        fit(args, *small, worker=address)


# -- the measurements ------------------------------------------------------------------------
def overhead(args: argparse.Namespace, X: Any, y: Any, scratch: Path) -> dict[str, Any]:
    """Fit wall times per checkpoint setting, interleaved, against the baseline."""
    n_chunks = X.numblocks[0]
    every = sorted({min(int(k), n_chunks) for k in args.every.split(",") if k})
    # name -> (estimator parameters, dask.config settings)
    settings: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
        "baseline": ({"checkpoint_every": NEVER}, {"rh-dask.checkpoint.every-seconds": 0}),
        "defaults": ({}, {}),
    }
    for k in every:
        by_chunks = {"rh-dask.checkpoint.every-seconds": 0}
        settings[f"every={k}"] = ({"checkpoint_every": k}, by_chunks)
        settings[f"every={k},dir"] = (
            {"checkpoint_every": k, "checkpoint_dir": str(scratch / f"every-{k}")},
            by_chunks,
        )
    # One full fit first: the page cache and the engines parked on the workers are warm.
    fit(args, X, y)
    walls: dict[str, list[float]] = {name: [] for name in settings}
    identical: dict[str, bool] = {}
    reference = None
    for repeat in range(args.repeats):
        for name, (params, config) in settings.items():
            if "checkpoint_dir" in params:
                shutil.rmtree(params["checkpoint_dir"], ignore_errors=True)
            with dask.config.set(config):
                wall, model = fit(args, X, y, **params)
            walls[name].append(wall)
            if reference is None:
                reference = model
            identical[name] = identical.get(name, True) and same_bits(model, reference)
            print(f"overhead {name} repeat {repeat}: {wall:.3f} s", flush=True)
    writes = checkpoint_writes(
        CheckpointStore(settings["every=1,dir"][0]["checkpoint_dir"]), scratch / "writes"
    )
    base = statistics.median(walls["baseline"])
    out: dict[str, Any] = {"n_chunks": n_chunks, "settings": {}, "one_checkpoint": writes}
    for name, (params, config) in settings.items():
        median = statistics.median(walls[name])
        out["settings"][name] = {
            "estimator": {
                k: (v if k != "checkpoint_dir" else "<local dir>") for k, v in params.items()
            },
            "config": config,
            "wall_seconds": summarize(walls[name]),
            "wall_seconds_runs": walls[name],
            "ratio_to_baseline": median / base,
            "overhead_percent": 100.0 * (median / base - 1.0),
            "coefficients_identical_to_baseline": identical[name],
        }
    return out


def checkpoint_writes(source: Any, scratch: Path, repeats: int = 21) -> dict[str, Any]:
    """Seconds to serialise one stream checkpoint and to write it to a local directory.

    ``source`` holds the checkpoint of a finished fit (all its records, the
    largest a walk writes); it is encoded (``checkpoint_bytes``) and written
    (``CheckpointStore.write``: temporary file, fsync, rename) ``repeats`` times.
    """
    ckpt = source.read()
    store = CheckpointStore(scratch)
    encode, write = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        data = checkpoint_bytes(ckpt)
        encode.append(time.perf_counter() - start)
        start = time.perf_counter()
        store.write(ckpt)
        write.append(time.perf_counter() - start)
    return {
        "bytes": len(data),
        "n_records": len(ckpt.records),
        "encode_seconds": summarize(encode),
        "write_seconds": summarize(write),
    }


def recovery(
    args: argparse.Namespace, client: Any, X: Any, y: Any, scratch: Path, warm: Any
) -> dict[str, Any]:
    """Kill the engine's worker at chunk ``--kill-at`` once per run; what the recovery cost.

    ``warm()`` runs before each kill, once the killed worker of the run
    before is back, so that every run starts from two warm workers.
    """
    runs: list[dict[str, Any]] = []
    failures: list[str] = []
    for repeat in range(args.kill_repeats):
        try:
            client.wait_for_workers(2, timeout=120)
        except Exception as exc:  # a worker that did not come back ends the runs, not the JSON
            failures.append(f"before repeat {repeat}: {type(exc).__name__}: {exc}")
            print(failures[-1], file=sys.stderr, flush=True)
            break
        warm()
        pids = {pid: address for address, pid in client.run(os.getpid).items()}
        marker, log = scratch / f"kill-{repeat}", scratch / f"kill-{repeat}.log"
        Xk = killing(X, args.kill_at, marker, log)
        params = {"checkpoint_every": args.kill_every}
        wall, model = fit(args, Xk, y, **params)
        pid, kill_time = killed_at(log)
        # The marker exists: the same collection, uninterrupted.
        plain_wall, plain = fit(args, Xk, y, **params)
        rows = model.recoveries_.to_dict("records")
        for row in rows:
            row["time"] = row["time"].timestamp()
            detected = row["time"] - row["recover_seconds"]
            row["kill_to_detect_seconds"] = detected - kill_time
            # The feeder starts loading chunk i once chunk i - lookahead is
            # consumed: the lost engine had consumed at least that many.
            reached = args.kill_at - args.lookahead if args.loader == "actor" else 0
            row["chunks_replayed_at_least"] = max(0, reached - row["from_chunk"])
        runs.append(
            {
                "wall_seconds": wall,
                "uninterrupted_wall_seconds": plain_wall,
                "loss_cost_seconds": wall - plain_wall,
                "killed_worker": pids.get(pid),
                "recoveries": rows,
                "coefficients_identical_to_uninterrupted": same_bits(model, plain),
                "history_chunks_in_order": model.history_["chunk"].tolist()
                == list(range(X.numblocks[0])),
            }
        )
        print(f"recovery repeat {repeat}: {rows}", flush=True)
    one = [r["recoveries"][0] for r in runs if len(r["recoveries"]) == 1]
    keys = (
        "detect_seconds",
        "kill_to_detect_seconds",
        "recover_seconds",
        "chunks_replayed",
        "chunks_replayed_at_least",
    )
    return {
        "kill_at_chunk": args.kill_at,
        "checkpoint_every": args.kill_every,
        "runs": runs,
        "failures": failures,
        "one_recovery_each": len(one) == len(runs),
        "all_identical": all(r["coefficients_identical_to_uninterrupted"] for r in runs),
        "medians": {k: statistics.median(r[k] for r in one) for k in keys} if one else {},
        "loss_cost_seconds_median": (
            statistics.median(r["loss_cost_seconds"] for r in runs) if runs else None
        ),
    }


def no_eligible_worker(
    args: argparse.Namespace, client: Any, X: Any, y: Any, scratch: Path
) -> dict[str, Any]:
    """How soon ``ActorLostError`` comes when no worker may take over, per worker timeout.

    The fit is pinned to one worker (``worker=``); its process is killed
    loading chunk ``--kill-at`` and its nanny restarts it at another address,
    so no eligible worker ever appears.
    """
    from rh_dask import ActorLostError

    runs = []
    for timeout in args.worker_timeouts:
        client.wait_for_workers(2, timeout=120)
        victim = worker_addresses(client)[0]
        marker, log = scratch / f"pinned-{timeout}", scratch / f"pinned-{timeout}.log"
        Xk = killing(X, args.kill_at, marker, log)
        run: dict[str, Any] = {"worker_timeout_seconds": timeout}
        with dask.config.set({"rh-dask.recovery.worker-timeout": timeout}):
            try:
                fit(args, Xk, y, worker=victim, checkpoint_every=args.kill_every)
                run["error"] = None
            except ActorLostError as exc:
                raised = time.time()
                run["error"] = str(exc)
                run["kill_to_error_seconds"] = raised - killed_at(log)[1]
                run["chunk_index"] = exc.chunk_index
        runs.append(run)
        print(f"no eligible worker, timeout {timeout} s: {run}", flush=True)
    return {"kill_at_chunk": args.kill_at, "runs": runs}


# -- main --------------------------------------------------------------------------------------
def default_kill_at(n_chunks: int, every: int, lookahead: int) -> int:
    """The chunk whose load kills: the engine is then half-way between two checkpoints.

    The feeder starts loading chunk ``i`` about ``lookahead`` chunks before
    the engine reaches it, so the engine is near ``i - lookahead`` when the
    process dies; that point is put ``every // 2`` chunks after a checkpoint
    near the middle of the stream.
    """
    engine_at = (n_chunks // 2 // every) * every + every // 2
    return max(0, min(n_chunks - 1, engine_at + lookahead))


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--engine", choices=["gpu", "numpy"], default="gpu")
    p.add_argument("--rows", type=int, default=20_000_000)
    p.add_argument("--features", type=int, default=90)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--n-chunks", type=int, default=64, help="row chunks of the stream")
    p.add_argument("--data-dir", default=None, help="default: $TMPDIR/rh-dask-bench-<shape>")
    p.add_argument("--source", choices=["pread", "mmap"], default="mmap")
    p.add_argument("--threads", type=int, default=None, help="threads per worker")
    p.add_argument("--loader", default="actor")
    p.add_argument("--lookahead", type=int, default=8)
    p.add_argument("--every", default="1,4,16,64", help="checkpoint_every values (and n_chunks)")
    p.add_argument("--repeats", type=int, default=5, help="runs per checkpoint setting")
    p.add_argument("--kill-at", type=int, default=None, help="default: default_kill_at()")
    p.add_argument("--kill-every", type=int, default=None, help="default: the packaged setting")
    p.add_argument("--kill-repeats", type=int, default=3)
    p.add_argument(
        "--worker-timeouts",
        default="1,5",
        help="rh-dask.recovery.worker-timeout values (seconds) for the no-eligible-worker runs",
    )
    p.add_argument("--skip", default="", help="comma list: overhead, recovery, no-worker")
    p.add_argument("--output", default="benchmarks/results/faults.json")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from rh_dask.settings import Settings

    args = parse(argv)
    args.worker_timeouts = [float(t) for t in args.worker_timeouts.split(",") if t]
    SOURCE["kind"] = args.source
    skip = set(args.skip.split(",")) - {""}
    cores = os.cpu_count() or 1
    # Two workers share the machine; the client needs a core too.
    args.threads = args.threads or max(1, (cores - 2) // 2)
    chunk_rows = -(-args.rows // args.n_chunks)
    if args.kill_every is None:
        args.kill_every = Settings.from_config().checkpoint_every_chunks
    if args.kill_at is None:
        args.kill_at = default_kill_at(args.n_chunks, args.kill_every, args.lookahead)
    args.every = f"{args.every},{args.n_chunks}"
    tmp = Path(os.environ.get("TMPDIR", "/tmp"))
    directory = Path(args.data_dir or tmp / f"rh-dask-bench-{args.rows}x{args.features}")
    dataset = write_dataset(directory, args.rows, args.features, args.dtype)
    print(f"dataset ready: {dataset}", flush=True)
    payload: dict[str, Any] = {
        "schema": SCHEMA,
        "environment": environment(),
        "arguments": vars(args) | {"chunk_rows": chunk_rows},
        "dataset": dataset,
    }
    # A LocalCluster closes a worker's nanny when, lost-worker-timeout (15 s)
    # after a loss, no worker of its name is registered: a worker killed again
    # at that moment would be gone for good.
    dask.config.set({"distributed.deploy.lost-worker-timeout": "1h"})
    cluster, client, extra, kind = start_cluster(args.engine, args.threads)
    scratch = Path(tempfile.mkdtemp(prefix="rh-dask-faults-"))
    try:
        payload["cluster"] = describe_cluster(client) | {"kind": kind}
        warm_up(args, client, directory, chunk_rows)
        X, y = dask_inputs(directory, chunk_rows)
        if "overhead" not in skip:
            payload["overhead"] = overhead(args, X, y, scratch)
            write_json(args.output, payload)
        if "recovery" not in skip:
            warm = partial(warm_up, args, client, directory, chunk_rows)
            payload["recovery"] = recovery(args, client, X, y, scratch, warm)
            write_json(args.output, payload)
        if "no-worker" not in skip:
            payload["no_eligible_worker"] = no_eligible_worker(args, client, X, y, scratch)
    finally:
        stop_cluster(cluster, client, extra)
        shutil.rmtree(scratch, ignore_errors=True)
    write_json(args.output, payload)
    print(f"wrote {args.output}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
