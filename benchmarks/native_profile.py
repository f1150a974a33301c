"""What does the engine's thread wait for inside the worker? A native profile with py-spy.

``actor_profile.py`` samples Python frames from inside the worker, which
cannot tell a thread running a CUDA call from one waiting for the
interpreter lock afterwards. This diagnostic attaches ``py-spy record
--native`` (an external tool: ``pip install py-spy``; it needs permission to
ptrace the worker) to the engine's worker during distributed fits and sorts
the engine thread's samples into:

* ``gil_wait_after_cuda``: a CUDA runtime or driver call has returned and the
  thread waits (``pthread_cond_timedwait``) to take the interpreter lock back;
* ``in_cuda``: inside the CUDA libraries (work, synchronisation);
* ``other_wait``: a condition or lock of ours (waiting for chunks);
* ``python_other``: everything else.

It writes the counts, the Python call sites of the lock waits and the
command's settings as JSON (the raw py-spy output is large and stays out).

With ``--gil`` it records instead only the thread holding the interpreter
lock at each sample (``py-spy record --gil``), and reports which threads of
the worker hold it, for what share of the samples, and where.

    python benchmarks/native_profile.py --rows 20000000 --chunk-rows 65536 \\
        --source mmap --output benchmarks/results/native_profile-h200-mmap.json
    # or only sort an existing ``py-spy record --format raw`` file
    python benchmarks/native_profile.py --raw-input native.txt --output out.json
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import environment, write_json

SCHEMA = "rh-dask/bench/native-profile/1"
ENGINE_THREAD = "rh-dask-engine"


def classify(raw: Path, thread: str = ENGINE_THREAD, top: int = 16) -> dict[str, Any]:
    """Sort one thread's samples of a ``py-spy --format raw`` file into the kinds above."""
    kinds: collections.Counter[str] = collections.Counter()
    sites: collections.Counter[str] = collections.Counter()
    threads: collections.Counter[str] = collections.Counter()
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        n = int(count)
        head, *frames = stack.split(";")
        threads[head.split(": ", 1)[-1] if ": " in head else head] += n
        if thread not in head:
            continue
        tail = ";".join(frames[-4:])
        python = [f for f in frames if ".py:" in f]
        if "pthread_cond_timedwait" in tail and "check_status" in tail:
            kinds["gil_wait_after_cuda"] += n
            sites[python[-1] if python else "?"] += n
        elif "pthread_cond_timedwait" in tail or "PyThread_acquire_lock" in tail:
            kinds["other_wait"] += n
        elif "libcuda" in tail or "cuda" in tail.lower():
            kinds["in_cuda"] += n
        else:
            kinds["python_other"] += n
    total = sum(kinds.values())
    return {
        "thread": thread,
        "samples": total,
        "fractions": {k: v / total for k, v in kinds.most_common()} if total else {},
        "counts": dict(kinds),
        "gil_wait_sites": sites.most_common(top),
        "samples_per_thread": dict(threads.most_common(top)),
    }


def classify_gil(raw: Path, top: int = 6) -> dict[str, Any]:
    """Who holds the interpreter lock: samples per thread and each thread's top sites."""
    threads: collections.Counter[str] = collections.Counter()
    sites: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        n = int(count)
        parts = stack.split(";")
        # The thread's frame comes first, after the process's when py-spy adds one.
        at = next((i for i, f in enumerate(parts[:2]) if f.startswith("thread")), 0)
        head, frames = parts[at], parts[at + 1 :]
        name = head.split(": ", 1)[-1] if ": " in head else head
        threads[name] += n
        sites[name][";".join(frames[-2:]) or "?"] += n
    total = sum(threads.values())
    return {
        "samples": total,
        "threads": [
            {
                "thread": name,
                "share": count / total,
                "top_sites": [[site, c / count] for site, c in sites[name].most_common(top)],
            }
            for name, count in threads.most_common()
        ],
    }


def record(args: Any, raw: Path) -> dict[str, Any]:
    """Fit on a fresh cluster and record the engine's worker meanwhile."""
    from distributed_fit import SOURCE, dask_inputs, start_cluster, stop_cluster, write_dataset

    from rh_dask import RenewableHuberRegressor

    spy = shutil.which("py-spy")
    if spy is None:
        raise SystemExit("py-spy is not on PATH (pip install py-spy)")
    SOURCE["kind"] = args.source
    directory = Path(args.data_dir)
    write_dataset(directory, args.rows, args.features, args.dtype)
    cluster, client, extra = start_cluster("gpu", args.threads, 0, 0)
    try:
        pid = next(iter(client.run(os.getpid).values()))
        params = dict(engine="gpu", dtype=args.dtype, progress=False, lookahead=args.lookahead)
        small = dask_inputs(directory, args.chunk_rows, rows=2 * args.chunk_rows)
        RenewableHuberRegressor(**params).fit(*small)
        X, y = dask_inputs(directory, args.chunk_rows)
        RenewableHuberRegressor(**params).fit(X, y)  # warm: the engine is parked
        command = [
            spy, "record", "--pid", str(pid), "--rate", str(args.rate), "--threads",
            "--gil" if args.gil else "--native", "--format", "raw", "-o", str(raw),
            "--duration", str(args.seconds),
        ]  # fmt: skip
        spy_run = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        time.sleep(1.0)
        walls = []
        while spy_run.poll() is None:
            start = time.perf_counter()
            RenewableHuberRegressor(**params).fit(X, y)
            walls.append(time.perf_counter() - start)
        output = spy_run.stdout.read().decode(errors="replace") if spy_run.stdout else ""
        return {
            "command": command[1:],
            "fit_walls_while_recorded": walls,
            "py_spy": output[-2000:],
        }
    finally:
        stop_cluster(cluster, client, extra)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=20_000_000)
    p.add_argument("--features", type=int, default=90)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--chunk-rows", type=int, default=65536)
    p.add_argument("--threads", type=int, default=12)
    p.add_argument("--lookahead", type=int, default=8)
    p.add_argument("--source", choices=["pread", "mmap"], default="mmap")
    p.add_argument("--rate", type=int, default=1000, help="py-spy samples per second")
    p.add_argument("--seconds", type=int, default=5, help="how long py-spy records")
    p.add_argument("--data-dir", default="/tmp/rhbench")
    p.add_argument("--raw-input", default=None, help="only sort this py-spy raw file")
    p.add_argument("--raw-output", default=None, help="keep the py-spy raw file here")
    p.add_argument(
        "--gil", action="store_true", help="sample only the thread holding the interpreter lock"
    )
    p.add_argument(
        "--config",
        default="rh-dask.distributed.heap-for-chunks=true",
        help="dask.config settings of the fits, KEY=VALUE,... (e.g. rh-dask.gpu.hold-gil=false)",
    )
    p.add_argument("--output", default="benchmarks/results/native_profile.json")
    args = p.parse_args(argv)
    payload: dict[str, Any] = {"schema": SCHEMA, "arguments": vars(args)}
    if args.raw_input:
        raw = Path(args.raw_input)
    else:
        payload["environment"] = environment()
        raw = Path(args.raw_output or Path(tempfile.mkdtemp()) / "native.txt")
        import dask.config
        from distributed_fit import parse_settings

        with dask.config.set(parse_settings(args.config)):
            payload["recording"] = record(args, raw)
    if args.gil:
        payload["gil_holders"] = classify_gil(raw)
        if not args.raw_input:  # samples nobody held the lock for are not recorded
            possible = args.rate * args.seconds
            payload["gil_holders"]["held_fraction"] = payload["gil_holders"]["samples"] / possible
        write_json(args.output, payload)
        for entry in payload["gil_holders"]["threads"][:12]:
            print(f"{entry['share']:6.1%}  {entry['thread']}  {entry['top_sites'][:2]}")
        return 0
    payload["engine_thread"] = classify(raw)
    write_json(args.output, payload)
    for kind, share in payload["engine_thread"]["fractions"].items():
        print(f"{share:6.1%}  {kind}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
