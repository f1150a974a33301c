"""The engine's worker killed mid-walk on a GPU cluster: the fit recovers, bit for bit.

The kill test of ``tests/test_faults.py`` on the GPU engine. Two worker
processes under nannies advertise ``resources={"GPU": 1}`` and share the one
GPU (a ``LocalCUDACluster`` worker plus a second nanny-started worker on the
same device: :func:`faults.start_cluster`). The stream is 12 chunks of
``--chunk-rows`` × ``--features`` float32 rows, memory-mapped from a NumPy
stack under ``$TMPDIR``; ``engine="gpu"``, ``loader="actor"`` (chunks load on
the engine's worker), ``checkpoint_every=2``. For each kill point (chunk 3,
and the last chunk) the process loading that chunk SIGKILLs itself, once;
then the same collection is fitted uninterrupted. Checked: the fit finished;
``recoveries_`` has one ``"worker-lost"`` row, from a checkpoint (``from_chunk``
a multiple of 2), to another worker; coefficients, intercept and information
matrix are bit-identical to the uninterrupted fit; ``history_`` holds chunks
0..11 once each. Writes ``DIR/gpu_faults.json``; exits 1 when a check fails.

    python benchmarks/gpu_faults.py --out DIR
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import dask.config
from common import environment, write_json
from distributed_fit import SOURCE, dask_inputs, describe_cluster, write_dataset
from faults import fit, killed_at, killing, same_bits, start_cluster, stop_cluster, warm_up

SCHEMA = "rh-dask/bench/gpu-faults/1"
N_CHUNKS = 12
EVERY = 2


def kill_run(args: argparse.Namespace, client: Any, X: Any, y: Any, at: int, scratch: Path):
    """One fit whose chunk ``at`` kills the engine's worker, and its uninterrupted twin."""
    client.wait_for_workers(2, timeout=120)
    pids = {pid: address for address, pid in client.run(os.getpid).items()}
    marker, log = scratch / f"kill-{at}", scratch / f"kill-{at}.log"
    Xk = killing(X, at, marker, log)
    wall, model = fit(args, Xk, y, checkpoint_every=EVERY)
    pid, _ = killed_at(log)
    plain_wall, plain = fit(args, Xk, y, checkpoint_every=EVERY)
    rec = model.recoveries_
    rows = rec.to_dict("records")
    for row in rows:
        row["time"] = row["time"].timestamp()
    one = rows[0] if len(rows) == 1 else {}
    checks = {
        "one_recovery": len(rows) == 1,
        "kind_worker_lost": one.get("kind") == "worker-lost",
        "lost_worker_is_the_killed_one": one.get("lost_worker") == pids.get(pid),
        "new_worker_differs": bool(one.get("new_worker"))
        and one.get("new_worker") != one.get("lost_worker"),
        "from_a_checkpoint": one.get("from_chunk", -1) % EVERY == 0
        and 0 <= one.get("from_chunk", -1) <= at,
        "chunks_replayed_sensible": 0 <= one.get("chunks_replayed", -1) <= at,
        "bit_identical_to_uninterrupted": same_bits(model, plain),
        "coef_history_identical": model.coef_history_.tobytes() == plain.coef_history_.tobytes(),
        "history_chunks_in_order": model.history_["chunk"].tolist() == list(range(N_CHUNKS)),
        "uninterrupted_had_no_recovery": plain.recoveries_.empty,
    }
    return {
        "kill_at_chunk": at,
        "killed_worker": pids.get(pid),
        "wall_seconds": wall,
        "uninterrupted_wall_seconds": plain_wall,
        "recoveries": rows,
        "placement": model.placement_,
        "checks": checks,
        "passed": all(checks.values()),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="directory of gpu_faults.json")
    p.add_argument("--chunk-rows", type=int, default=65_536)
    p.add_argument("--features", type=int, default=90)
    p.add_argument("--threads", type=int, default=None, help="threads per worker")
    p.add_argument("--data-dir", default=None)
    p.add_argument(
        "--engine",
        choices=["gpu", "numpy"],
        default="gpu",
        help="numpy: the same test on CPU workers (a check of this script where there is no GPU)",
    )
    args = p.parse_args(argv)
    # What faults.fit reads of its arguments.
    args.dtype, args.loader, args.lookahead = "float32", "actor", 2
    SOURCE["kind"] = "mmap"
    rows = N_CHUNKS * args.chunk_rows
    tmp = Path(os.environ.get("TMPDIR", "/tmp"))
    directory = Path(args.data_dir or tmp / f"rh-dask-bench-{rows}x{args.features}")
    dataset = write_dataset(directory, rows, args.features, args.dtype)
    args.threads = args.threads or max(1, ((os.cpu_count() or 2) - 2) // 2)
    payload: dict[str, Any] = {
        "schema": SCHEMA,
        "environment": environment(),
        "arguments": vars(args),
        "dataset": dataset,
        "runs": [],
    }
    out = Path(args.out) / "gpu_faults.json"
    # Workers are killed more than once: see faults.main.
    dask.config.set({"distributed.deploy.lost-worker-timeout": "1h"})
    cluster, client, extra, kind = start_cluster(args.engine, args.threads)
    scratch = Path(tempfile.mkdtemp(prefix="rh-dask-gpu-faults-"))
    try:
        payload["cluster"] = describe_cluster(client) | {"kind": kind}
        X, y = dask_inputs(directory, args.chunk_rows)
        for at in (3, N_CHUNKS - 1):
            warm_up(args, client, directory, args.chunk_rows)
            try:
                run = kill_run(args, client, X, y, at, scratch)
            except Exception as exc:  # recorded: the JSON says what failed
                run = {"kill_at_chunk": at, "error": f"{type(exc).__name__}: {exc}"}
                run["passed"] = False
            payload["runs"].append(run)
            print(run, flush=True)
            write_json(out, payload)
    finally:
        stop_cluster(cluster, client, extra)
        shutil.rmtree(scratch, ignore_errors=True)
    payload["passed"] = all(r["passed"] for r in payload["runs"])
    write_json(out, payload)
    print(f"wrote {out}: {'passed' if payload['passed'] else 'FAILED'}", flush=True)
    return 0 if payload["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
