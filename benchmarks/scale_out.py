"""Scale-out on one machine: the engine's worker fed by N loading workers, node by node.

Emulates the nodes of a cluster with separate processes, each confined to its
own cores (CPU affinity, ``taskset``): a scheduler, the engine's worker
(``--resources GPU=1``), R relay workers (``--resources relay=1``) and N
loading workers of c cores each, one ``dask worker`` process (no nanny) per
role. A fresh cluster is started for every N. The dataset (rows × features
float32 and a target) is written once to local disk in three forms: the
NumPy stack read with ``pread`` (``distributed_fit.py``'s ``NpyRows``),
Parquet (float32 columns, row groups of ``--chunk-rows``, several files) and
Zarr v3 (row chunks of ``--chunk-rows``).

Recorded per N and source: the fit's wall time for each loader (``relay``,
``cluster``, ``actor``; median of ``--repeats`` after a warm-up), rows/s,
engine busy fraction (engine seconds of ``history_`` over the wall), peak RSS
per process and role (sampled), and whether the coefficients equal, bit for
bit, a single-process loop of ``engine.partial_fit`` over the same chunks.
The per-worker load floor: the source decoded into C-contiguous float32
arrays in one process on c cores, no Dask, measured before the fits and again
before each N's on the first loader's cores; the targets divide by the median
of those samples (each N's ratio to the sample right before it is recorded
too). Once: the engine floor (the
engine alone on preloaded chunks, pinned for the GPU engine), and the host's
copy rate (chunk-sized memory copies in 1, 2, 4, 8 and all-but-one processes
at once). Per N: the load floor on all N loading workers' cores at once (each
process on other chunks, timed together: what the host's cores decode side by
side, beside N × the one-process floor the targets use) and the
transfer ceilings into the engine's node, over Dask's comm (N senders holding
chunk-sized arrays, the engine's worker running tasks that depend on them)
and over the relay path (the same senders, R relays, the shared-memory ring,
a counting receiver in the engine's process). The issue's targets are
computed from these: throughput / min(N × load floor, engine floor) (target
≥ 0.8) and, at the largest N, throughput / (N × throughput at N = 1)
(target ≥ 0.7 until the engine bound).

Writes ``--output`` (JSON) and a scaling plot next to it (PNG; ``--plot-only
A.json [B.json ...]`` draws one from earlier results).

    # device (H200, 16 cores): the cheap source, N = 1, 2, 4, 8 (relays and the
    # loaders' task threads per N: relays_and_threads)
    python benchmarks/scale_out.py --engine gpu --sources pread \\
        --output benchmarks/results/scale_out-h200-pread.json
    # dev box (2 cores), NumPy engine, tiny sizes, cores shared
    python benchmarks/scale_out.py --engine numpy --rows 200000 --chunk-rows 16384 \\
        --loaders 1,2 --relays 1 --engine-cores 1 --allow-overlap --repeats 1 \\
        --output benchmarks/results/scale_out-devbox.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import dask.config
import numpy as np
from common import environment, write_json
from dask.utils import key_split
from distributed import get_task_stream
from distributed_fit import (
    REPEATS,
    NpyRows,
    bounds,
    compare,
    dask_inputs,
    guarded,
    median_run,
    parse_settings,
    run_engine_floor,
    strip_private,
    write_dataset,
)

SCHEMA = "rh-dask/bench/scale-out/1"
SOURCES = ("pread", "parquet", "zarr")
#: Loaders to fit with: "relay" takes the default transport (TCP into the ring),
#: "relay-dask" the relay over Dask's comm (``rh-dask.relay.transport: dask``).
#: "relay-copy" the TCP relay with the ring left pageable (``rh-dask.relay.pin-ring:
#: false``: each chunk copied into the engine's pinned pool), to compare.
#: "relay-pread" the TCP relay with ``rh-dask.relay.sendfile: false``: the ``pread``
#: source's chunks are read into the loading worker and sent from there, where
#: "relay" sends them from the page cache with ``sendfile``. "relay-fresh" the TCP
#: relay with ``rh-dask.relay.keep-ring: false``: every fit makes its own ring, where
#: "relay" takes the one the previous fit left with the parked engine. "relay-one-send"
#: the TCP relay with ``rh-dask.relay.file-sends: 1``: a loading worker sends one file
#: chunk at a time per task thread, where "relay" keeps as many in flight as
#: ``rh-dask.relay.file-sends: auto`` allows. Any of these with ``-L<n>`` appended
#: ("relay-L8") fits with look-ahead ``n`` in place of ``--lookahead``; a ``#tag``
#: after a name ("relay#2") fits the same loader again under another name, so
#: that one run can alternate two of them.
FIT_LOADERS = ("relay", "relay-dask", "cluster", "actor")
RELAY_CONFIG = {
    "relay": {"rh-dask.relay.transport": "tcp"},
    "relay-pread": {"rh-dask.relay.transport": "tcp", "rh-dask.relay.sendfile": False},
    "relay-dask": {"rh-dask.relay.transport": "dask"},
    "relay-copy": {"rh-dask.relay.transport": "tcp", "rh-dask.relay.pin-ring": False},
    "relay-fresh": {"rh-dask.relay.transport": "tcp", "rh-dask.relay.keep-ring": False},
    "relay-one-send": {"rh-dask.relay.transport": "tcp", "rh-dask.relay.file-sends": 1},
}
LOOKAHEAD_SUFFIX = re.compile(r"^(?P<base>.+?)(-L(?P<lookahead>[0-9]+))?(#\w+)?$")
BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent


# -- the dataset in three forms ---------------------------------------------------------------
def _cached(meta_path: Path, spec: dict[str, Any]) -> dict[str, Any] | None:
    if meta_path.exists():
        meta = json.loads(meta_path.read_text())
        if meta.get("spec") == spec:
            return meta
    return None


def write_parquet(
    directory: Path, npy_dir: Path, chunk_rows: int, files: int, compression: str
) -> dict[str, Any]:
    """Parquet files ``part-NNNNN.parquet`` of whole row groups of ``chunk_rows`` rows.

    Columns ``x0 .. x{p-1}`` and ``y``, in the stack's dtype. Every file but
    the last holds the same number of whole row groups, so the row groups
    are exactly the stack's chunks of ``chunk_rows`` rows.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    X = np.load(npy_dir / "X.npy", mmap_mode="r")
    y = np.load(npy_dir / "y.npy", mmap_mode="r")
    rows, features = X.shape
    spec = {
        "source": str(npy_dir),
        "rows": rows,
        "features": features,
        "chunk_rows": chunk_rows,
        "files": files,
        "compression": compression,
    }
    meta_path = directory.with_name(directory.name + ".json")  # beside: not a member
    if (meta := _cached(meta_path, spec)) is not None:
        return meta
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    groups_per_file = math.ceil(math.ceil(rows / chunk_rows) / files)
    rows_per_file = groups_per_file * chunk_rows
    names = [f"x{j}" for j in range(features)] + ["y"]

    def write(i: int) -> int:
        a, b = i * rows_per_file, min(rows, (i + 1) * rows_per_file)
        if a >= b:
            return 0
        columns = np.ascontiguousarray(X[a:b].T)
        arrays = [pa.array(columns[j]) for j in range(features)] + [pa.array(np.asarray(y[a:b]))]
        table = pa.Table.from_arrays(arrays, names=names)
        path = directory / f"part-{i:05d}.parquet"
        pq.write_table(table, path, row_group_size=chunk_rows, compression=compression)
        return path.stat().st_size

    t0 = time.perf_counter()
    with ThreadPoolExecutor(min(files, os.cpu_count() or 1)) as pool:
        sizes = list(pool.map(write, range(files)))
    meta = {
        "spec": spec,
        "path": str(directory),
        "files": sum(1 for s in sizes if s),
        "row_groups_per_file": groups_per_file,
        "bytes_on_disk": sum(sizes),
        "write_seconds": time.perf_counter() - t0,
    }
    meta_path.write_text(json.dumps(meta))
    return meta


def write_zarr(directory: Path, npy_dir: Path, chunk_rows: int) -> dict[str, Any]:
    """A Zarr v3 group of arrays ``X`` (rows × features) and ``y``, row chunks of ``chunk_rows``.

    zarr's default codecs (zstd).
    """
    import zarr

    X = np.load(npy_dir / "X.npy", mmap_mode="r")
    y = np.load(npy_dir / "y.npy", mmap_mode="r")
    rows, features = X.shape
    spec = {
        "source": str(npy_dir),
        "rows": rows,
        "features": features,
        "chunk_rows": chunk_rows,
        "zarr": zarr.__version__,
    }
    meta_path = directory.with_name(directory.name + ".json")
    if (meta := _cached(meta_path, spec)) is not None:
        return meta
    shutil.rmtree(directory, ignore_errors=True)
    group = zarr.open_group(str(directory), mode="w", zarr_format=3)
    zx = group.create_array("X", shape=X.shape, chunks=(chunk_rows, features), dtype=X.dtype)
    zy = group.create_array("y", shape=y.shape, chunks=(chunk_rows,), dtype=y.dtype)

    def write(b: tuple[int, int]) -> None:
        zx[b[0] : b[1]] = np.asarray(X[b[0] : b[1]])
        zy[b[0] : b[1]] = np.asarray(y[b[0] : b[1]])

    t0 = time.perf_counter()
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        list(pool.map(write, bounds(rows, chunk_rows)))
    on_disk = sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())
    meta = {
        "spec": spec,
        "path": str(directory),
        "bytes_on_disk": on_disk,
        "write_seconds": time.perf_counter() - t0,
    }
    meta_path.write_text(json.dumps(meta))
    return meta


def parquet_files(directory: Path) -> list[Path]:
    return sorted(directory.glob("part-*.parquet"))


def fit_inputs(
    source: str, dirs: dict[str, Path], chunk_rows: int, rows: int
) -> tuple[Any, Any, str]:
    """``(X, y, reader)`` to fit: the first ``rows`` rows (whole chunks) of ``source``.

    Parquet and Zarr go through ``rh_dask.read_parquet`` / ``rh_dask.read_zarr``
    where the package has them, else through Dask's own readers (``reader``
    says which).
    """
    import rh_dask

    n_chunks = -(-rows // chunk_rows)
    if source == "pread":
        read = getattr(rh_dask, "read_npy", None)
        if read is None:
            X, y = dask_inputs(dirs["npy"], chunk_rows, rows=rows)
            return X, y, "distributed_fit.NpyRows (pread)"
        X = read(str(dirs["npy"] / "X.npy"), chunk_rows=chunk_rows)
        y = read(str(dirs["npy"] / "y.npy"), chunk_rows=chunk_rows)
        if rows < X.shape[0]:  # a slice: its chunks load as tasks (pread), never by sendfile
            return X[:rows], y[:rows], "rh_dask.read_npy, sliced (pread)"
        return X, y, "rh_dask.read_npy (pread; sendfile when relayed over TCP)"
    if source == "parquet":
        read = getattr(rh_dask, "read_parquet", None)
        if read is not None:
            frame = read(str(dirs["parquet"]), chunks="row-group")
            reader = "rh_dask.read_parquet(chunks='row-group')"
        else:
            import dask.dataframe as dd

            frame = dd.read_parquet(str(dirs["parquet"]), split_row_groups=True)
            reader = "dask.dataframe.read_parquet(split_row_groups=True)"
        if n_chunks < frame.npartitions:
            frame = frame.partitions[:n_chunks]
        return frame, "y", reader
    if source == "zarr":
        read = getattr(rh_dask, "read_zarr", None)
        if read is not None:
            stream = read(str(dirs["zarr"]), target="y", features=["X"])
            X, y, reader = stream.X, stream.y, "rh_dask.read_zarr"
        else:
            import dask.array as da

            X = da.from_zarr(str(dirs["zarr"]), component="X")
            y = da.from_zarr(str(dirs["zarr"]), component="y")
            reader = "dask.array.from_zarr"
        return X[:rows], y[:rows], reader
    raise ValueError(f"unknown source {source!r}")


# -- the per-worker load floor (a subprocess on one loader's cores) --------------------------
def _decode_chunks(
    source: str, dirs: dict[str, Path], chunk_rows: int, rows: int, skip: int = 0
) -> list:
    """Callables, one per chunk of ``rows`` rows, each decoding it to arrays.

    The chunks start ``skip`` chunks into the source and wrap around its end,
    so that floors measured together read different chunks, as loaders do.
    """
    jobs = _all_chunks(source, dirs, chunk_rows)
    count = min(len(jobs), -(-rows // chunk_rows))
    return [jobs[(skip + k) % len(jobs)] for k in range(count)]


def _all_chunks(source: str, dirs: dict[str, Path], chunk_rows: int) -> list:
    """Every chunk of ``source`` as a callable decoding it to arrays (X, y)."""
    Xs, ys = NpyRows(str(dirs["npy"] / "X.npy")), NpyRows(str(dirs["npy"] / "y.npy"))
    total = Xs.shape[0]
    if source == "copy":  # no reading: a chunk's bytes copied in memory, the host's copy rate
        # Four chunks each way, so that the copies come from memory, not a large L3.
        src = np.ones((4, chunk_rows, Xs.shape[1] + 1), dtype=Xs.dtype)
        dst = np.empty_like(src)

        def copy(k: int) -> tuple[np.ndarray, np.ndarray]:
            np.copyto(dst[k], src[k])
            return dst[k], dst[k, :0, 0]

        return [partial(copy, k % 4) for k in range(-(-total // chunk_rows))]
    if source == "pread":
        return [lambda a=a, b=b: (Xs[a:b], ys[a:b]) for a, b in bounds(total, chunk_rows)]
    if source == "parquet":
        import pyarrow.parquet as pq

        def group(path: Path, g: int) -> tuple[np.ndarray, np.ndarray]:
            table = pq.ParquetFile(path).read_row_group(g, use_threads=False)
            cols = [c.to_numpy() for c in table.columns]
            return np.stack(cols[:-1], axis=1), cols[-1]

        jobs = []
        for path in parquet_files(dirs["parquet"]):
            for g in range(pq.ParquetFile(path).num_row_groups):
                jobs.append(lambda p=path, g=g: group(p, g))
        return jobs
    if source in ("zarr", "zarr-direct"):
        import zarr

        zx = zarr.open_array(str(dirs["zarr"] / "X"), mode="r")
        zy = zarr.open_array(str(dirs["zarr"] / "y"), mode="r")
        if source == "zarr-direct":  # rh_dask.read_zarr's own decode, no Dask
            from rh_dask.zarr_chunks import direct_rows

            store = str(dirs["zarr"])
            zx, zy = direct_rows(zx, store, "X", None), direct_rows(zy, store, "y", None)
            if zx is None or zy is None:
                raise ValueError("the Zarr store's arrays cannot be decoded directly")
        return [lambda a=a, b=b: (zx[a:b], zy[a:b]) for a, b in bounds(total, chunk_rows)]
    raise ValueError(f"unknown source {source!r}")


def floor_main(args: argparse.Namespace) -> int:
    """Decode ``--floor-rows`` rows of one source with ``--floor-threads`` threads; JSON out.

    With ``--floor-barrier DIR`` the process is one of several measured
    together: after its warm-up it writes ``DIR/ready-PID`` and times nothing
    until ``DIR/go`` exists.
    """
    dirs = {k: Path(v) for k, v in json.loads(args.floor_dirs).items()}
    jobs = _decode_chunks(args.floor, dirs, args.chunk_rows, args.floor_rows, args.floor_skip)

    def decode(job: Callable[[], tuple[np.ndarray, np.ndarray]]) -> tuple[int, int]:
        X, y = job()
        X = np.ascontiguousarray(X)
        return int(X.shape[0]), int(X.nbytes + y.nbytes)

    def once() -> dict[str, Any]:
        t0 = time.perf_counter()
        with ThreadPoolExecutor(args.floor_threads) as pool:
            done = list(pool.map(decode, jobs))
        wall = time.perf_counter() - t0
        return {
            "wall_seconds": wall,
            "rows": sum(r for r, _ in done),
            "bytes": sum(b for _, b in done),
        }

    once()  # warm-up: page cache, imports
    if args.floor_barrier:
        barrier = Path(args.floor_barrier)
        (barrier / f"ready-{os.getpid()}").touch()
        deadline = time.monotonic() + 600
        while not (barrier / "go").exists():
            if time.monotonic() > deadline:
                raise TimeoutError("no go from the benchmark within 600 s")
            time.sleep(0.001)
    result = median_run(once, args.repeats)
    result["gb_per_second"] = result["bytes"] / result["wall_seconds"] / 1e9
    result["threads"] = args.floor_threads
    result["cpus"] = sorted(os.sched_getaffinity(0))
    print(json.dumps(result), flush=True)
    return 0


def _floor_command(
    source: str, dirs: dict[str, Path], cores: list[int], rows: int, *options: str
) -> list[str]:
    """The floor subprocess's command line, confined to ``cores`` (``options`` appended)."""
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--floor",
        source,
        "--floor-dirs",
        json.dumps({k: str(v) for k, v in dirs.items()}),
        "--floor-rows",
        str(rows),
        "--floor-threads",
        str(len(set(cores))),
        *options,
    ]
    return confined(cmd, cores)


def load_floor(
    source: str, dirs: dict[str, Path], cores: list[int], args: argparse.Namespace
) -> dict[str, Any]:
    """The floor subprocess, confined to ``cores``."""
    rows = min(args.floor_rows, args.fit_rows)
    options = ("--chunk-rows", str(args.chunk_rows), "--repeats", str(args.repeats))
    proc = subprocess.run(
        _floor_command(source, dirs, cores, rows, *options),
        capture_output=True,
        text=True,
        env=process_env(len(set(cores))),
    )
    if proc.returncode != 0:
        raise RuntimeError(f"load floor of {source} failed: {proc.stderr[-2000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["rows_per_second"] = out["rows"] / out["wall_seconds"]
    return out


def load_floors_together(
    source: str, dirs: dict[str, Path], cores: list[list[int]], args: argparse.Namespace
) -> dict[str, Any]:
    """The floor on every loading worker's cores at once: what this host's cores give together.

    One floor subprocess per entry of ``cores``, each on other chunks of the
    source; their timed runs start together once all have warmed up. The
    per-worker rate is the mean (the sum over N), so N × it is what the N
    cores decoded together; a host whose cores share memory bandwidth or
    physical cores gives less than N × the one-process floor.
    """
    rows = min(args.floor_rows, args.fit_rows, args.together_rows)
    n_chunks = -(-args.rows // args.chunk_rows)
    with tempfile.TemporaryDirectory(prefix="rh-floor-") as barrier:
        procs = []
        for k, own in enumerate(cores):
            options = (
                "--chunk-rows",
                str(args.chunk_rows),
                "--floor-skip",
                str(k * n_chunks // len(cores)),
                "--floor-barrier",
                barrier,
                "--repeats",
                "1",
            )
            env = process_env(len(set(own)))
            procs.append(
                subprocess.Popen(
                    _floor_command(source, dirs, own, rows, *options),
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                    env=env,
                )
            )
        try:
            deadline = time.monotonic() + 600
            while len(list(Path(barrier).glob("ready-*"))) < len(procs):
                if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
                    break
                time.sleep(0.005)
            (Path(barrier) / "go").touch()
            outs = [p.communicate(timeout=600) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
    runs = []
    for p, (stdout, stderr) in zip(procs, outs, strict=True):
        if p.returncode != 0:
            raise RuntimeError(f"together floor of {source} failed: {stderr[-2000:]}")
        run = json.loads(stdout.strip().splitlines()[-1])
        run["rows_per_second"] = run["rows"] / run["wall_seconds"]
        runs.append(run)
    rates = [r["rows_per_second"] for r in runs]
    return {
        "processes": len(runs),
        "rows_per_second": sum(rates) / len(rates),
        "sum_rows_per_second": sum(rates),
        "min_rows_per_second": min(rates),
        "max_rows_per_second": max(rates),
        "gb_per_second": sum(r["gb_per_second"] for r in runs),
        "runs": runs,
        # median_run's interface: the benchmark's guarded() takes the median of these
        "wall_seconds": max(r["wall_seconds"] for r in runs),
    }


# -- cores and processes ----------------------------------------------------------------------
def auto_or_int(text: str) -> str | int:
    return "auto" if text == "auto" else int(text)


#: Relays with ``--relays auto``, at least: the count every run before had.
MIN_RELAYS = 4


def relays_and_threads(n: int, args: argparse.Namespace, cpus: int) -> tuple[int, int]:
    """Relay workers and task threads per loading core for N loading workers.

    ``auto`` follows what H100 runs measured (docs/performance.md, "Two sends
    in flight per loading core"): a chunk sent with ``sendfile`` spends most
    of its task waiting for its relay to receive it (one relay core takes one
    stream at about 4 GB/s), so a loading worker of the cheap source
    delivers about 1.4x more with two sends in flight per core, provided that
    every send in flight has a relay of its own (with two per core and four
    relays N = 4 was slower than with one, with eight relays faster). The
    library keeps those sends in flight itself (``rh-dask.relay.file-sends:
    auto``: relays // loaders, at most two per task thread), so loading
    workers get one task thread per core, and the relays are one per send
    the library may keep in flight (at least :data:`MIN_RELAYS`) as far as
    the cores allow, leaving one core idle for the host (a fifth relay
    beside eight single-core loaders, which left none, made N = 8 slower).
    Only sources sent from files keep more than one send in flight.
    """
    from rh_dask.distributed.push import AUTO_FILE_SENDS_PER_THREAD

    free = cpus - args.control_cores - args.engine_cores - n * args.cores_per_loader - 1
    sent_from_files = set(args.sources) <= {"pread"}
    threads = 1 if args.loader_threads == "auto" else int(args.loader_threads)
    if args.relays != "auto":
        return int(args.relays), threads
    per_core = AUTO_FILE_SENDS_PER_THREAD if sent_from_files else 1
    sends = n * args.cores_per_loader * max(threads, per_core)
    return max(1, min(max(MIN_RELAYS, sends), free)), threads


def plan_cores(
    cpus: list[int],
    *,
    control: int,
    engine: int,
    relays: int,
    loaders: int,
    per_loader: int,
    allow_overlap: bool,
) -> dict[str, Any] | str:
    """Which CPUs each role gets, or why ``loaders`` loading workers do not fit.

    Roles take consecutive CPUs: the control (scheduler and this process),
    the engine's worker, each relay (one CPU), each loading worker. With
    ``allow_overlap`` the CPUs are dealt round-robin when there are too few.
    """
    need = control + engine + relays + loaders * per_loader
    if need > len(cpus) and not allow_overlap:
        return (
            f"needs {need} CPUs ({control} control + {engine} engine + {relays} relays + "
            f"{loaders} x {per_loader} loading), {len(cpus)} available"
        )
    position = 0

    def take(k: int) -> list[int]:
        nonlocal position
        got = sorted({cpus[(position + i) % len(cpus)] for i in range(k)})
        position += k
        return got

    return {
        "control": take(control),
        "engine": take(engine),
        "relays": [take(1) for _ in range(relays)],
        "loaders": [take(per_loader) for _ in range(loaders)],
        "cpus_needed": need,
        "cpus_available": len(cpus),
        "overlapping": need > len(cpus),
    }


def confined(cmd: list[str], cores: list[int]) -> list[str]:
    """``cmd`` started under ``taskset`` on ``cores`` (affinity set after start without it)."""
    if shutil.which("taskset"):
        return ["taskset", "-c", ",".join(map(str, sorted(set(cores)))), *cmd]
    return cmd


def process_env(threads: int, gpu: bool = True) -> dict[str, str]:
    env = dict(os.environ)
    path = [str(REPO_ROOT), str(BENCH_DIR)]
    if env.get("PYTHONPATH"):
        path.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(path)
    for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        env[name] = str(threads)
    if not gpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def thread_affinity(pid: int) -> list[list[int]]:
    """The distinct CPU sets of the threads of process ``pid``."""
    sets = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            sets.add(tuple(sorted(os.sched_getaffinity(int(tid)))))
        except OSError:
            pass
    return [list(s) for s in sorted(sets)]


class ProcessCluster:
    """A scheduler and ``dask worker`` processes, each confined to its cores."""

    def __init__(self, plan: dict[str, Any], args: argparse.Namespace, workdir: Path) -> None:
        self.plan, self.args, self.workdir = plan, args, workdir
        self.procs: dict[str, tuple[str, subprocess.Popen]] = {}  # name -> (role, process)
        self.client: Any = None
        self.address = ""

    def _spawn(self, name: str, role: str, cmd: list[str], cores: list[int], env: dict) -> None:
        with open(self.workdir / f"{name}.log", "w") as log:
            proc = subprocess.Popen(
                confined(cmd, cores), env=env, stdout=log, stderr=subprocess.STDOUT
            )
        if not shutil.which("taskset"):
            os.sched_setaffinity(proc.pid, cores)
        self.procs[name] = (role, proc)

    def start(self) -> ProcessCluster:
        from distributed import Client

        sched_file = self.workdir / "scheduler.json"
        cmd = [sys.executable, "-m", "distributed.cli.dask_scheduler", "--host", "127.0.0.1"]
        cmd += ["--port", "0", "--no-dashboard", "--scheduler-file", str(sched_file)]
        self._spawn("scheduler", "scheduler", cmd, self.plan["control"], process_env(1))
        deadline = time.monotonic() + 60
        while not sched_file.exists():
            if time.monotonic() > deadline or self.procs["scheduler"][1].poll() is not None:
                raise RuntimeError(f"the scheduler did not start: see {self.workdir}")
            time.sleep(0.1)
        time.sleep(0.2)  # the file is written whole before the scheduler listens
        self.address = json.loads(sched_file.read_text())["address"]
        # GPU=1 whatever the engine: the fits name this worker, the resource tells its role.
        self._worker("engine", "engine", self.plan["engine"], {"GPU": 1}, gpu=True)
        for i, cores in enumerate(self.plan["loaders"]):
            threads = self.plan["loader_threads"] * len(cores)
            self._worker(f"loader-{i}", "loader", cores, {}, gpu=False, threads=threads)
        self.client = Client(self.address, direct_to_workers=True)
        self.client.wait_for_workers(1 + len(self.plan["loaders"]), timeout=120)
        return self

    def _worker(
        self,
        name: str,
        role: str,
        cores: list[int],
        resources: dict,
        gpu: bool,
        threads: int | None = None,
    ) -> None:
        # Task threads; the BLAS/OpenMP pools stay at one per core.
        tasks = threads or len(cores)
        cmd = [sys.executable, "-m", "distributed.cli.dask_worker", self.address]
        cmd += ["--name", name, "--nthreads", str(tasks), "--no-nanny"]
        cmd += ["--memory-limit", "0", "--host", "127.0.0.1", "--no-dashboard"]
        cmd += ["--local-directory", str(self.workdir / name)]
        if resources:
            cmd += ["--resources", ",".join(f"{k}={v}" for k, v in resources.items())]
        self._spawn(name, role, cmd, cores, process_env(len(cores), gpu=gpu))

    def add_relays(self) -> None:
        resource = dask.config.get("rh-dask.relay.resource", "relay")
        for i, cores in enumerate(self.plan["relays"]):
            self._worker(f"relay-{i}", "relay", cores, {resource: 1}, gpu=False)
        n = 1 + len(self.plan["loaders"]) + len(self.plan["relays"])
        self.client.wait_for_workers(n, timeout=120)

    def addresses(self) -> dict[str, str]:
        """Worker name -> address."""
        from rh_dask.distributed.placement import scheduler_workers

        info = scheduler_workers(self.client)
        return {str(w.get("name")): addr for addr, w in info.items()}

    def describe(self) -> dict[str, Any]:
        out = {}
        addresses = self.addresses()
        for name, (role, proc) in self.procs.items():
            out[name] = {
                "role": role,
                "pid": proc.pid,
                "address": addresses.get(name),
                "thread_cpu_sets": thread_affinity(proc.pid) if proc.poll() is None else None,
            }
        return out

    def pids(self) -> dict[str, tuple[str, int]]:
        named = {name: (role, proc.pid) for name, (role, proc) in self.procs.items()}
        named["client"] = ("client", os.getpid())
        return named

    def close(self) -> None:
        if self.client is not None:
            try:
                self.client.close(timeout=10)
            except Exception:  # the processes are ended below either way
                pass
        order = sorted(self.procs.items(), key=lambda item: item[1][0] == "scheduler")
        for _, (_, proc) in order:
            if proc.poll() is None:
                proc.terminate()
        for _, (_, proc) in order:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


class RoleMemory:
    """Peak RSS of each named process, sampled in a thread (``with`` one window)."""

    def __init__(self, pids: dict[str, tuple[str, int]], interval: float = 0.05) -> None:
        import psutil

        self._procs = {}
        for name, (role, pid) in pids.items():
            try:
                self._procs[name] = (role, psutil.Process(pid))
            except psutil.Error:
                pass
        self._error = psutil.Error
        self._interval = interval
        self.peak: dict[str, int] = {}

    def _sample(self) -> None:
        for name, (_, proc) in self._procs.items():
            try:
                self.peak[name] = max(self.peak.get(name, 0), proc.memory_info().rss)
            except self._error:
                pass

    @contextmanager
    def window(self) -> Iterator[dict[str, Any]]:
        self.peak = {}
        report: dict[str, Any] = {}
        stop = threading.Event()

        def loop() -> None:
            while not stop.wait(self._interval):
                self._sample()

        thread = threading.Thread(target=loop, daemon=True)
        self._sample()
        thread.start()
        try:
            yield report
        finally:
            stop.set()
            thread.join()
            self._sample()
            report.update(self.by_role())

    def by_role(self) -> dict[str, Any]:
        roles: dict[str, dict[str, int]] = {}
        for name, peak in self.peak.items():
            roles.setdefault(self._procs[name][0], {})[name] = peak
        return {
            role: {
                "max_peak_rss_bytes": max(named.values()),
                "sum_peak_rss_bytes": sum(named.values()),
                "processes": named,
            }
            for role, named in roles.items()
        }


# -- transfer ceilings ------------------------------------------------------------------------
def _make_block(rows: int, cols: int, dtype: str, value: int) -> np.ndarray:
    return np.full((rows, cols), value, dtype=dtype)


def _nbytes(block: Any) -> int:
    return int(getattr(block, "nbytes", 0))


def comm_ceiling(
    client: Any,
    senders: list[str],
    receiver: str,
    chunk_rows: int,
    cols: int,
    dtype: str,
    n_chunks: int,
    maker: Callable[..., Any] = _make_block,
) -> dict[str, Any]:
    """Bytes/s into ``receiver`` over Dask's comm: tasks there depending on blocks elsewhere.

    ``maker(rows, cols, dtype, i)`` builds block ``i`` on its sender (round
    robin); the blocks exist before the clock starts. A block is released as
    soon as its task on the receiver is done, so the receiver holds at most
    what is in flight.
    """
    from distributed import as_completed, wait

    blocks = [
        client.submit(
            maker, chunk_rows, cols, dtype, i, workers=[senders[i % len(senders)]], pure=False
        )
        for i in range(n_chunks)
    ]
    wait(blocks)
    t0 = time.perf_counter()
    tasks = {
        client.submit(_nbytes, b, workers=[receiver], allow_other_workers=False, pure=False): b
        for b in blocks
    }
    total = 0
    for task in as_completed(tasks):
        total += task.result()
        tasks[task].release()
        task.release()
    wall = time.perf_counter() - t0
    del blocks
    return {
        "senders": len(senders),
        "chunks": n_chunks,
        "chunk_bytes": total // n_chunks,
        "bytes": total,
        "wall_seconds": wall,
        "gb_per_second": total / wall / 1e9,
        "rows_per_second": n_chunks * chunk_rows / wall,
    }


def _make_item(rows: int, cols: int, dtype: str, index: int) -> Any:
    """A loaded chunk of ``rows`` × ``cols - 1`` features plus a target, as a relay gets it."""
    from rh_dask.distributed.items import LoadedChunk

    X = np.full((rows, cols - 1), index % 7, dtype=dtype)
    y = np.full(rows, index % 5, dtype=dtype)
    return LoadedChunk(index=index, X=X, y=y, sample_weight=None)


def _relay_receiver_open(
    directory: str, n_slots: int, slot_bytes: int, dask_worker: Any = None
) -> Any:
    """On the engine's worker: a ring and a receiver that counts what it is handed."""
    from rh_dask.distributed.items import LoadedChunk
    from rh_dask.distributed.relay import RelayReceiver
    from rh_dask.distributed.ring import ChunkRing, default_directory

    ring = ChunkRing.create(
        default_directory() if directory == "auto" else directory, n_slots, slot_bytes
    )
    state: dict[str, Any] = {"count": 0, "bytes": 0, "rows": 0, "last": None, "other": []}
    lock = threading.Lock()

    def deliver(item: Any) -> None:
        with lock:
            if isinstance(item, LoadedChunk):
                state["bytes"] += item.nbytes
                state["rows"] += item.rows
            else:
                state["other"].append(repr(item)[:200])
            state["count"] += 1
            state["last"] = time.perf_counter()
        ring.release(item.index)

    receiver = RelayReceiver(ring, deliver)
    receiver.start()
    dask_worker._rh_scale_out_relay = (ring, receiver, state)
    return ring.spec


def _relay_receiver_seal(dask_worker: Any = None) -> None:
    dask_worker._rh_scale_out_relay[1].seal()


def _relay_receiver_state(dask_worker: Any = None) -> dict[str, Any]:
    state = dict(dask_worker._rh_scale_out_relay[2])
    state["clock"] = time.perf_counter()
    return state


def _relay_receiver_close(dask_worker: Any = None) -> None:
    ring, receiver, _ = dask_worker.__dict__.pop("_rh_scale_out_relay")
    receiver.close()
    ring.close()


def relay_ceiling(
    client: Any,
    senders: list[str],
    relays: list[str],
    receiver: str,
    chunk_rows: int,
    cols: int,
    dtype: str,
    n_chunks: int,
    n_slots: int,
) -> dict[str, Any]:
    """Bytes/s from ``senders`` through ``relays`` and the ring into the engine's process.

    Chunk ``i`` is written by relay ``i mod R``; the clock stops when the
    receiver in the engine's process has been handed every chunk.
    """
    from distributed import as_completed, wait

    from rh_dask.distributed.relay import attach_relay, detach_relay, relay_chunk

    itemsize = np.dtype(dtype).itemsize
    slot_bytes = chunk_rows * cols * itemsize + (1 << 20)
    directory = dask.config.get("rh-dask.relay.directory", "auto")
    items = [
        client.submit(
            _make_item, chunk_rows, cols, dtype, i, workers=[senders[i % len(senders)]], pure=False
        )
        for i in range(n_chunks)
    ]
    wait(items)
    spec = client.run(_relay_receiver_open, directory, n_slots, slot_bytes, workers=[receiver])[
        receiver
    ]
    try:
        attached = client.run(attach_relay, spec, workers=relays)
        client.run(_relay_receiver_seal, workers=[receiver])
        ok = [r for r in relays if attached.get(r)]
        if not ok:
            raise RuntimeError(f"no relay attached to the ring: {attached}")
        t0_remote = client.run(_relay_receiver_state, workers=[receiver])[receiver]["clock"]
        t0 = time.perf_counter()

        # At most n_slots chunks in flight, as the fit's walk keeps them: chunk
        # i is sent once chunk i - n_slots has been handed over.
        def send(i: int) -> Any:
            return client.submit(
                relay_chunk,
                items[i],
                spec,
                workers=[ok[i % len(ok)]],
                allow_other_workers=False,
                pure=False,
            )

        tasks = [send(i) for i in range(min(n_slots, n_chunks))]
        pending = as_completed(list(tasks))
        for _ in pending:
            if len(tasks) < n_chunks:
                task = send(len(tasks))
                tasks.append(task)
                pending.add(task)
        wait(tasks)
        while True:
            state = client.run(_relay_receiver_state, workers=[receiver])[receiver]
            if state["count"] >= n_chunks or time.perf_counter() - t0 > 600:
                break
            time.sleep(0.002)
        wall = time.perf_counter() - t0
        remote_wall = (state["last"] or state["clock"]) - t0_remote
        errors = [t.exception() for t in tasks if t.status == "error"]
    finally:
        client.run(detach_relay, spec.ring_id, workers=relays)
        client.run(_relay_receiver_close, workers=[receiver])
    return {
        "senders": len(senders),
        "relays": len(ok),
        "attached": attached,
        "chunks": n_chunks,
        "received_chunks": state["count"],
        "not_loaded": state["other"][:5],
        "task_errors": [repr(e) for e in errors[:5]],
        "bytes": state["bytes"],
        "wall_seconds": wall,
        "receiver_wall_seconds": remote_wall,
        "gb_per_second": state["bytes"] / wall / 1e9,
        "rows_per_second": state["rows"] / wall,
        "ring_slots": n_slots,
        "slot_bytes": slot_bytes,
    }


# -- fits ------------------------------------------------------------------------------------
class References:
    """Coefficients of a single-process ``partial_fit`` loop, per chunk layout (cached)."""

    def __init__(self, args: argparse.Namespace, npy_dir: Path) -> None:
        self.args, self.npy_dir = args, npy_dir
        self._cache: dict[tuple[int, ...], tuple[np.ndarray, float]] = {}

    def coefficients(self, rows: list[int]) -> tuple[np.ndarray, float]:
        """(coefficients, seconds) after one ``partial_fit`` per chunk of ``rows`` rows."""
        key = tuple(rows)
        if key not in self._cache:
            from rh_dask import HuberConfig, make_engine
            from rh_dask.distributed.consumer import STREAM_BLAS_THREADS, blas_limiter

            Xs = NpyRows(str(self.npy_dir / "X.npy"))
            ys = NpyRows(str(self.npy_dir / "y.npy"))
            engine = make_engine(self.args.engine, HuberConfig(dtype=self.args.dtype))
            t0, start = time.perf_counter(), 0
            with blas_limiter(STREAM_BLAS_THREADS)():
                for n in rows:
                    engine.partial_fit(Xs[start : start + n], ys[start : start + n])
                    start += n
            self._cache[key] = (engine.coefficients(), time.perf_counter() - t0)
        return self._cache[key]


def lookahead_for(args: argparse.Namespace, loader: str = "") -> int | str:
    """The look-ahead ``loader`` fits with: its ``-L<n>`` suffix, else ``--lookahead``.

    ``--lookahead`` is a number, or ``auto``, the library's
    ``lookahead="auto"``: with ``relay``, twice the chunks the loading
    workers may have in flight (task threads, or file sends where more), at
    least 8. The number a fit used is its ``placement_["lookahead"]``.
    """
    match = LOOKAHEAD_SUFFIX.match(loader)
    if match is not None and match["lookahead"] is not None:
        return int(match["lookahead"])
    return "auto" if args.lookahead == "auto" else int(args.lookahead)


def base_loader(loader: str) -> str:
    """``loader`` without its ``-L<n>`` and ``#tag`` suffixes."""
    match = LOOKAHEAD_SUFFIX.match(loader)
    return match["base"] if match is not None else loader


def relay_config_of(loader: str) -> dict[str, Any] | None:
    """The settings of a relayed ``loader`` (its suffixes aside), else None."""
    return RELAY_CONFIG.get(base_loader(loader))


def run_fit(
    args: argparse.Namespace,
    inputs: tuple[Any, Any],
    small: tuple[Any, Any],
    loader: str,
    worker: str,
    memory: RoleMemory,
) -> dict[str, Any]:
    """One timed fit (after a warm-up fit of two chunks) with ``loader``."""
    from rh_dask import RenewableHuberRegressor

    relay_config = relay_config_of(loader)
    params = dict(
        engine=args.engine,
        dtype=args.dtype,
        loader="relay" if relay_config is not None else base_loader(loader),
        lookahead=lookahead_for(args, loader),
        worker=worker,
        progress=False,
    )
    config = relay_config or {}
    with dask.config.set(config):
        RenewableHuberRegressor(**params).fit(*small)
        model = RenewableHuberRegressor(**params)
        with memory.window() as mem, get_task_stream() as stream:
            t0, clock0 = time.perf_counter(), time.time()
            model.fit(*inputs)
            wall = time.perf_counter() - t0
    history = model.history_
    rows = int(history["rows"].sum())
    engine_seconds = float(history["seconds"].sum())
    return {
        "wall_seconds": wall,
        "rows": rows,
        "rows_per_second": rows / wall,
        "chunks": len(history),
        "engine_seconds": engine_seconds,
        "engine_wait_seconds": float(history["wait_seconds"].sum()),
        "engine_busy_fraction": engine_seconds / wall,
        "placement": model.placement_,
        "peak_rss": mem,
        "task_stream": task_breakdown(stream.data, wall, clock0),
        "chunk_timeline": chunk_timeline(
            stream.data,
            history["seconds"].to_numpy(),
            history["wait_seconds"].to_numpy(),
            model.placement_["lookahead"],
            clock0,
        ),
        "_coef": model.state_.coefficients,
        "_rows": [int(r) for r in history["rows"]],
    }


_HAND_OVER = ("rh-sendfile", "rh-push", "rh-relay", "rh-deliver")


def _chunk_index(key: Any) -> int | None:
    if isinstance(key, tuple) and key and isinstance(key[-1], int):
        return key[-1]
    match = re.search(r"(\d+)\)?$", str(key))
    return int(match.group(1)) if match else None


def chunk_timeline(
    records: list[dict[str, Any]],
    seconds: np.ndarray,
    waits: np.ndarray,
    lookahead: int,
    clock0: float,
) -> dict[str, Any]:
    """Where a chunk's round trip goes: hand-over task, wait for its turn, refill gap.

    Each chunk's hand-over task (``rh-sendfile``, ``rh-push``, ...) gives its
    start and stop from the task stream. The engine's consumption of chunk
    ``k`` is placed from ``history_``: it starts after the waits and engine
    times of the chunks before it, anchored so that no chunk is consumed
    before its hand-over ended (the tightest chunk, where the engine waited,
    fixes the anchor; its note's latency is the error). Per chunk ``i``:
    ``send`` (the task's span), ``turn`` (from the task's end to the start of
    its consumption: the chunk waits in the ring for the ones before it) and,
    for ``i >= lookahead``, ``refill`` (from the end of chunk ``i - lookahead``'s
    consumption, which frees the window, to the start of chunk ``i``'s task:
    the poll, the submission, the scheduler and the loader's queue).
    Milliseconds, median and 90th percentile. ``in_flight``: the chunks in
    their hand-over task and waiting for their turn, on average over the
    stream (from the first task's start to the last chunk consumed), to set
    against the look-ahead.
    """
    spans: dict[int, tuple[float, float, str]] = {}
    for record in records:
        key = record.get("key", "?")
        if not any(name in str(key) for name in _HAND_OVER):
            continue
        index = _chunk_index(key)
        parts = [p for p in record.get("startstops", ()) if p.get("action") == "compute"]
        if index is None or not parts:
            continue
        spans[index] = (
            float(parts[0]["start"]) - clock0,
            float(parts[-1]["stop"]) - clock0,
            str(record.get("worker", "?")),
        )
    n = len(seconds)
    if not spans or n == 0:
        return {}
    begin = np.cumsum(waits) + np.concatenate([[0.0], np.cumsum(seconds)[:-1]])
    anchor = max(spans[i][1] - begin[i] for i in spans if i < n)
    consume_start = anchor + begin
    consume_end = consume_start + seconds
    send, turn, refill, starts = [], [], [], []
    for i, (start, stop, _) in sorted(spans.items()):
        if i >= n:
            continue
        starts.append(start)
        send.append(stop - start)
        turn.append(consume_start[i] - stop)
        if i >= lookahead:
            refill.append(start - consume_end[i - lookahead])

    def summary(values: list[float]) -> dict[str, float] | None:
        if not values:
            return None
        v = np.asarray(values) * 1e3
        return {"median_ms": float(np.median(v)), "p90_ms": float(np.percentile(v, 90))}

    span = float(consume_end[-1] - min(starts)) if starts else 0.0
    in_flight = (
        {"send": sum(send) / span, "turn": sum(turn) / span, "lookahead": int(lookahead)}
        if span > 0
        else None
    )
    return {
        "chunks": len(send),
        "in_flight": in_flight,
        "send": summary(send),
        "turn": summary(turn),
        "refill": summary(refill),
        "engine": summary(list(seconds)),
        "engine_start_seconds": float(anchor),
        "per_chunk_ms": {
            "send": [round(v * 1e3, 2) for v in send],
            "turn": [round(v * 1e3, 2) for v in turn],
            "refill": [round(v * 1e3, 2) for v in refill],
        },
    }


def chunk_timeline_line(timeline: dict[str, Any]) -> str:
    """`` send 30/41 turn ...``: median/p90 ms of each part of :func:`chunk_timeline`."""
    parts = []
    for name in ("send", "turn", "refill", "engine"):
        v = timeline.get(name)
        if v:
            parts.append(f"{name} {v['median_ms']:.1f}/{v['p90_ms']:.1f}")
    line = (" ms " + " ".join(parts)) if parts else ""
    held = timeline.get("in_flight")
    if held:
        line += (
            f"; in flight {held['send']:.1f} sending, {held['turn']:.1f} waiting"
            f" of {held['lookahead']}"
        )
    return line


def task_breakdown(
    records: list[dict[str, Any]], wall: float, clock0: float | None = None
) -> dict[str, Any]:
    """Where the cluster's time went: per task prefix and action, and per worker.

    From the scheduler's task stream (``distributed.get_task_stream``): for each
    task-name prefix and action (``compute``, ``transfer``, ...) the count and the
    total and median seconds; for each worker the seconds it spent computing and
    receiving, and that as a fraction of the fit's wall time. With ``clock0``
    (the fit's start, ``time.time()``; every process here shares the clock): the
    seconds from the start to the first task and from the last task to the end
    (the stream's set-up and wind-down), and each prefix's first start and last
    stop.
    """
    spans: dict[str, list[float]] = {}
    workers: dict[str, dict[str, float]] = {}
    edges: dict[str, list[float]] = {}
    for record in records:
        prefix = key_split(record.get("key", "?"))
        busy = workers.setdefault(record.get("worker", "?"), {})
        for part in record.get("startstops", ()):
            seconds = float(part["stop"] - part["start"])
            action = part.get("action", "?")
            spans.setdefault(f"{prefix}/{action}", []).append(seconds)
            busy[action] = busy.get(action, 0.0) + seconds
            edge = edges.setdefault(prefix, [math.inf, -math.inf])
            edge[0] = min(edge[0], float(part["start"]))
            edge[1] = max(edge[1], float(part["stop"]))
    timeline: dict[str, Any] = {}
    if clock0 is not None and edges:
        first = min(e[0] for e in edges.values()) - clock0
        last = max(e[1] for e in edges.values()) - clock0
        timeline = {
            "first_task_seconds": first,
            "after_last_task_seconds": wall - last,
            "by_prefix": {k: [e[0] - clock0, e[1] - clock0] for k, e in sorted(edges.items())},
        }
    return {
        "timeline": timeline,
        "by_prefix": {
            name: {
                "count": len(values),
                "total_seconds": float(np.sum(values)),
                "median_seconds": float(np.median(values)),
            }
            for name, values in sorted(spans.items())
        },
        "by_worker": {
            worker: {
                **{f"{k}_seconds": v for k, v in busy.items()},
                **{f"{k}_fraction": v / wall for k, v in busy.items()},
            }
            for worker, busy in sorted(workers.items())
        },
    }


def fits_for(
    entry: dict[str, Any],
    args: argparse.Namespace,
    loaders: list[str],
    dirs: dict[str, Path],
    engine_addr: str,
    memory: RoleMemory,
    refs: References,
) -> None:
    for source in args.sources:
        inputs = fit_inputs(source, dirs, args.chunk_rows, args.fit_rows)
        small = fit_inputs(source, dirs, args.chunk_rows, min(2 * args.chunk_rows, args.fit_rows))
        methods = entry["sources"].setdefault(source, {"reader": inputs[2], "loaders": {}})
        if args.full_warm_up and loaders:
            # The first whole fit on a fresh cluster ran 2-3 s slower than the next
            # ones whichever loader it used (every H200 run of this benchmark):
            # it is not timed.
            run_fit(args, inputs[:2], small[:2], loaders[0], engine_addr, memory)
        for loader in loaders:
            record = methods["loaders"]
            run = partial(run_fit, args, inputs[:2], small[:2], loader, engine_addr, memory)
            guarded(record, loader, run)
            result = record[loader]
            line = chunk_timeline_line(result.get("chunk_timeline") or {})
            print(
                f"N={entry['n_loaders']} {source} {loader}: {result.get('wall_seconds')}{line}",
                flush=True,
            )


def check_coefficients(entry: dict[str, Any], refs: References) -> None:
    """Each fit's coefficients against the single-process loop over the same chunks."""
    for block in entry.get("sources", {}).values():
        for result in block["loaders"].values():
            if "_coef" in result:
                coef, seconds = refs.coefficients(result.pop("_rows"))
                result["coefficients_vs_single_process"] = compare(result.pop("_coef"), coef)
                result["single_process_loop_seconds"] = seconds


def floor_rate(floors: dict[str, Any], source: str) -> float | None:
    """The one-process load floor the targets divide by: the median of its samples.

    The floor is measured once before the fits and again before each N's fits
    (:func:`benchmark`), on the same cores: on the H100 machines one process's
    ``pread`` floor moved from 10.3 to 14.4 M rows/s between two calls four
    minutes apart, more than the fits did, so one sample decided which side of
    a target a fit fell on.
    """
    record = floors.get(source, {})
    samples = record.get("samples_rows_per_second") or []
    if samples:
        return float(np.median(samples))
    return record.get("rows_per_second")


def add_floor_sample(floors: dict[str, Any], source: str, sample: dict[str, Any]) -> None:
    """Record one more one-process floor of ``source`` (a :func:`load_floor` result)."""
    rate = sample.get("rows_per_second")
    record = floors.setdefault(source, {})
    if rate is None:
        # A copy: the first sample is the record itself, which must not hold itself.
        failed = {k: v for k, v in sample.items() if k != "failed_samples"}
        record.setdefault("failed_samples", []).append(failed)
        return
    record.setdefault("samples_rows_per_second", []).append(rate)
    record["median_rows_per_second"] = floor_rate(floors, source)


def summarize_entry(
    entry: dict[str, Any], floors: dict[str, Any], engine_rps: float | None
) -> None:
    n = entry["n_loaders"]
    for source, block in entry["sources"].items():
        floor = floor_rate(floors, source)
        # The sample taken right before this N's fits, beside the median.
        adjacent = entry.get("floor_before", {}).get(source, {}).get("rows_per_second")
        for result in block["loaders"].values():
            if "rows_per_second" not in result or floor is None:
                continue
            bound = n * floor if engine_rps is None else min(n * floor, engine_rps)
            result["n_times_load_floor_rows_per_second"] = n * floor
            result["bound_rows_per_second"] = bound
            result["throughput_over_bound"] = result["rows_per_second"] / bound
            result["target_ratio"] = result["rows_per_second"] / (0.8 * bound)
            result["meets_target"] = result["target_ratio"] >= 1.0
            result["load_floor_rows_per_second"] = floor
            if adjacent:
                near = n * adjacent if engine_rps is None else min(n * adjacent, engine_rps)
                result["throughput_over_bound_adjacent_floor"] = result["rows_per_second"] / near
            # The bound leaves the network out; on one host emulating nodes the
            # relay path's measured ceiling (the same senders, relays and ring, no
            # loading) is that network. Reported beside it, never instead of it.
            # The same bound from the floor every loader's cores gave at once (this
            # host's cores together), beside the one-process floor.
            together = entry.get("floors_together", {}).get(source, {}).get("rows_per_second")
            if together:
                both = n * together if engine_rps is None else min(n * together, engine_rps)
                result["together_floor_rows_per_second"] = together
                result["bound_together_rows_per_second"] = both
                result["throughput_over_together_bound"] = result["rows_per_second"] / both
                result["meets_target_together"] = result["rows_per_second"] >= 0.8 * both
            ceiling = entry.get("transfer", {}).get("relay", {}).get("rows_per_second")
            if ceiling:
                with_net = min(bound, ceiling)
                result["transfer_ceiling_rows_per_second"] = ceiling
                result["bound_with_transfer_rows_per_second"] = with_net
                rate = result["rows_per_second"]
                result["throughput_over_bound_with_transfer"] = rate / with_net


def print_ratios(payload: dict[str, Any]) -> None:
    """One line per N, source and loader: rows/s against N × the floor's median and sample."""
    for source, record in payload.get("floors", {}).items():
        samples = record.get("samples_rows_per_second") or []
        if samples:
            listed = ", ".join(f"{s / 1e6:.2f}" for s in samples)
            print(
                f"floor {source}: median {floor_rate(payload['floors'], source) / 1e6:.2f} "
                f"M rows/s of {listed}",
                flush=True,
            )
    for entry in payload["results"]:
        for source, block in entry.get("sources", {}).items():
            for loader, result in block["loaders"].items():
                if "throughput_over_bound" not in result:
                    continue
                adjacent = result.get("throughput_over_bound_adjacent_floor")
                print(
                    f"N={entry['n_loaders']} {source} {loader}: "
                    f"{result['rows_per_second'] / 1e6:.2f} M rows/s, "
                    f"{result['throughput_over_bound']:.2f} of the bound with the median floor"
                    + (f", {adjacent:.2f} with the floor before it" if adjacent else ""),
                    flush=True,
                )


def summarize_scaling(payload: dict[str, Any]) -> dict[str, Any]:
    """At the largest N: throughput / (N × throughput at N = 1), per source and loader."""
    done = [e for e in payload["results"] if "sources" in e]
    engine_rps = payload.get("engine_floor", {}).get("rows_per_second")
    out: dict[str, Any] = {}
    if not done:
        return out
    first = next((e for e in done if e["n_loaders"] == 1), None)
    last = max(done, key=lambda e: e["n_loaders"])
    n = last["n_loaders"]
    for source, block in last["sources"].items():
        for loader, result in block["loaders"].items():
            one = (first or {}).get("sources", {}).get(source, {}).get("loaders", {}).get(loader)
            if "rows_per_second" not in result or not one or "rows_per_second" not in one:
                continue
            ideal = n * one["rows_per_second"]
            capped = ideal if engine_rps is None else min(ideal, engine_rps)
            out[f"{source}/{loader}"] = {
                "n_loaders": n,
                "rows_per_second": result["rows_per_second"],
                "rows_per_second_at_1": one["rows_per_second"],
                "scaling": result["rows_per_second"] / ideal,
                "scaling_engine_capped": result["rows_per_second"] / capped,
                "meets_target": result["rows_per_second"] / capped >= 0.7,
            }
            # How the host's own floor scaled: N processes decoding at once against
            # N × one process alone (1.0 when the cores do not slow each other).
            solo = floor_rate(payload.get("floors", {}), source)
            together = last.get("floors_together", {}).get(source, {}).get("rows_per_second")
            if solo and together:
                out[f"{source}/{loader}"]["host_floor_scaling"] = together / solo
    four = next((e for e in done if e["n_loaders"] == 4), None)
    relay4 = (four or {}).get("sources", {}).get("pread", {}).get("loaders", {}).get("relay", {})
    if "rows_per_second" in relay4:
        out["pread_relay_n4_rows_per_second"] = relay4["rows_per_second"]
        out["pread_relay_n4_meets_18M"] = relay4["rows_per_second"] >= 18e6
    return out


# -- the plot ---------------------------------------------------------------------------------
def plot(payloads: list[dict[str, Any]], path: Path) -> Path | None:
    """rows/s against N per source and loader, with the ideal line capped at the engine floor."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (use --plot-only elsewhere)", file=sys.stderr)
        return None
    fig, ax = plt.subplots(figsize=(8, 4.8))
    colors = {"pread": "tab:blue", "parquet": "tab:orange", "zarr": "tab:green"}
    styles = {
        "relay": ("-", "o"),
        "relay-dask": ("--", "D"),
        "cluster": ("-.", "s"),
        "actor": (":", "^"),
    }
    # One line per source and loader; a source measured by several files keeps the last.
    lines: dict[tuple[str, str], dict[int, float]] = {}
    engine_rps = None
    for payload in payloads:
        engine_rps = payload.get("engine_floor", {}).get("rows_per_second") or engine_rps
        for entry in payload["results"]:
            for source, block in entry.get("sources", {}).items():
                for loader, result in block["loaders"].items():
                    if "rows_per_second" in result:
                        lines.setdefault((source, loader), {})[entry["n_loaders"]] = result[
                            "rows_per_second"
                        ]
    for (source, loader), points in sorted(lines.items()):
        ns = sorted(points)
        ls, marker = styles.get(loader, ("-", "x"))
        color = colors.get(source)
        ax.plot(
            ns,
            [points[n] / 1e6 for n in ns],
            ls=ls,
            marker=marker,
            color=color,
            label=f"{source}, {loader}",
        )
        if loader == "relay" and 1 in points:
            ideal = [n * points[1] for n in ns]
            if engine_rps:
                ideal = [min(v, engine_rps) for v in ideal]
            ax.plot(
                ns,
                [v / 1e6 for v in ideal],
                ls="--",
                lw=0.8,
                color=color,
                alpha=0.6,
                label=f"{source}, ideal (N x relay at N=1)",
            )
    if engine_rps:
        ax.axhline(engine_rps / 1e6, color="k", lw=0.8, ls=":", label="engine floor")
    ax.set_xlabel("loading workers N")
    ax.set_ylabel("fit throughput (M rows/s)")
    ax.set_xscale("log", base=2)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# -- main -------------------------------------------------------------------------------------
def ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--engine", choices=["gpu", "numpy"], default="gpu")
    p.add_argument("--rows", type=int, default=20_000_000)
    p.add_argument("--features", type=int, default=90)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--chunk-rows", type=int, default=262_144)
    p.add_argument("--fit-rows", type=int, default=None, help="rows each fit covers (a prefix)")
    p.add_argument("--data-dir", default=None, help="default: $TMPDIR/rh-dask-scale-out")
    p.add_argument("--sources", default="pread,parquet,zarr")
    p.add_argument("--loaders", default="1,2,4,8", help="numbers N of loading workers")
    p.add_argument("--cores-per-loader", type=int, default=1)
    p.add_argument(
        "--loader-threads",
        type=auto_or_int,
        default="auto",
        help="task threads per core of a loading worker (auto: 1, see relays_and_threads)",
    )
    p.add_argument(
        "--relays",
        type=auto_or_int,
        default="auto",
        help="relay workers, one core each (auto: relays_and_threads)",
    )
    p.add_argument("--engine-cores", type=int, default=2)
    p.add_argument("--control-cores", type=int, default=1, help="scheduler and this process")
    p.add_argument("--allow-overlap", action="store_true", help="share CPUs when too few")
    p.add_argument("--compare", default=",".join(FIT_LOADERS), help="loaders to fit with")
    p.add_argument(
        "--lookahead",
        default="8",
        help="chunks ahead of the engine, or auto: the library's (with relay, twice the "
        "loaders' chunks in flight, at least 8)",
    )
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--no-full-warm-up",
        dest="full_warm_up",
        action="store_false",
        help="skip the untimed whole fit per cluster and source before the timed ones",
    )
    p.add_argument("--parquet-files", type=int, default=8)
    p.add_argument("--parquet-compression", default="snappy")
    p.add_argument("--floor-rows", type=int, default=4_194_304, help="rows of a load floor")
    p.add_argument(
        "--together-rows",
        type=int,
        default=2_097_152,
        help="rows per process of the floors measured on all N loaders' cores at once",
    )
    p.add_argument("--transfer-chunks", type=int, default=48, help="chunks per ceiling")
    p.add_argument("--ring-slots", type=int, default=8)
    p.add_argument(
        "--skip",
        default="",
        help="comma list of: comm,relay-ceiling,floors,floor-repeat,floors-together,host-copy",
    )
    p.add_argument("--config", default="", help="dask.config settings KEY=VALUE,...")
    p.add_argument("--quick", action="store_true", help="smoke run: 1 repeat, few chunks")
    p.add_argument("--plot-only", nargs="+", default=None, metavar="JSON")
    p.add_argument("--output", default="benchmarks/results/scale_out.json")
    # The load-floor subprocess (internal).
    p.add_argument("--floor", default=None, help=argparse.SUPPRESS)
    p.add_argument("--floor-dirs", default=None, help=argparse.SUPPRESS)
    p.add_argument("--floor-threads", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--floor-skip", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--floor-barrier", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.repeats = 1
        args.transfer_chunks = min(args.transfer_chunks, 8)
        args.floor_rows = min(args.floor_rows, 4 * args.chunk_rows)
        args.together_rows = min(args.together_rows, 2 * args.chunk_rows)
        args.fit_rows = min(args.fit_rows or args.rows, 16 * args.chunk_rows)
    args.fit_rows = min(args.fit_rows or args.rows, args.rows)
    if isinstance(args.sources, str):
        args.sources = [s for s in args.sources.split(",") if s]
    bad = set(args.sources) - set(SOURCES)
    if bad:
        p.error(f"unknown sources {sorted(bad)}; choose from {SOURCES}")
    return args


def _terminated(signum: int, frame: Any) -> None:
    raise SystemExit(f"stopped by signal {signum}")  # so that the clusters' processes end


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _terminated)
    if args.floor:
        return floor_main(args)
    if args.plot_only:
        payloads = [json.loads(Path(f).read_text()) for f in args.plot_only]
        out = plot(payloads, Path(args.output).with_suffix(".png"))
        print(f"plot: {out}")
        return 0
    with dask.config.set(parse_settings(args.config)):
        return benchmark(args)


def benchmark(args: argparse.Namespace) -> int:
    from rh_dask import HuberConfig

    REPEATS["n"] = args.repeats
    skip = set(args.skip.split(",")) - {""}
    loaders = [s for s in args.compare.split(",") if s]
    root = Path(args.data_dir or Path(os.environ.get("TMPDIR", "/tmp")) / "rh-dask-scale-out")
    npy_dir = root / f"npy-{args.rows}x{args.features}-{args.dtype}"
    dirs = {"npy": npy_dir}
    dataset = {"npy": write_dataset(npy_dir, args.rows, args.features, args.dtype)}
    tag = f"{args.rows}x{args.features}-{args.dtype}-c{args.chunk_rows}"
    if "parquet" in args.sources:
        dirs["parquet"] = root / f"parquet-{tag}"
        dataset["parquet"] = write_parquet(
            dirs["parquet"], npy_dir, args.chunk_rows, args.parquet_files, args.parquet_compression
        )
    if "zarr" in args.sources:
        dirs["zarr"] = root / f"zarr-{tag}"
        dataset["zarr"] = write_zarr(dirs["zarr"], npy_dir, args.chunk_rows)
    print(f"datasets ready: {json.dumps(dataset)}", flush=True)
    cpus = sorted(os.sched_getaffinity(0))
    payload: dict[str, Any] = {
        "schema": SCHEMA,
        "environment": environment(),
        "arguments": vars(args),
        "dataset": dataset,
        "cpus": cpus,
        "floors": {},
        "reader_floors": {},
        "host_copy": {},
        "results": [],
    }
    output = Path(args.output)
    # The engine alone on preloaded chunks (pinned for the GPU engine), the whole machine free.
    floor_record: dict[str, Any] = {}
    run = lambda: run_engine_floor(  # noqa: E731
        args,
        npy_dir,
        args.chunk_rows,
        args.fit_rows,
        HuberConfig(dtype=args.dtype),
        pinned=args.engine == "gpu",
    )
    guarded(floor_record, "engine_floor", run)
    payload["engine_floor"] = strip_private(floor_record["engine_floor"])
    engine_rps = payload["engine_floor"].get("rows_per_second")
    print(f"engine floor: {engine_rps} rows/s", flush=True)
    # Per-worker load floors on the first loading worker's cores of the smallest plan.
    plan1 = plan_cores(
        cpus,
        control=args.control_cores,
        engine=args.engine_cores,
        relays=relays_and_threads(1, args, len(cpus))[0],
        loaders=1,
        per_loader=args.cores_per_loader,
        allow_overlap=args.allow_overlap,
    )
    if "floors" not in skip and isinstance(plan1, dict):
        for source in args.sources:
            guarded(
                payload["floors"],
                source,
                lambda s=source: load_floor(s, dirs, plan1["loaders"][0], args),
                repeats=1,
            )
            add_floor_sample(payload["floors"], source, payload["floors"][source])
            print(
                f"load floor {source}: {payload['floors'][source].get('rows_per_second')}",
                flush=True,
            )
        if "zarr" in args.sources:
            # rh_dask.read_zarr decodes whole chunks itself (rh_dask.zarr_chunks): what
            # that costs alone, beside the floor of zarr's own indexing the ratios use.
            guarded(
                payload["reader_floors"],
                "zarr-direct",
                lambda: load_floor("zarr-direct", dirs, plan1["loaders"][0], args),
                repeats=1,
            )
            print(
                "reader floor zarr-direct: "
                f"{payload['reader_floors']['zarr-direct'].get('rows_per_second')}",
                flush=True,
            )
    if "host-copy" not in skip:
        # Chunk-sized memory copies in K processes on K cores at once: the host's own
        # bound on moving bytes, which every stage of the relay path spends.
        counts = sorted({k for k in (1, 2, 4, 8, len(cpus) - 1) if 1 <= k < len(cpus)})
        for k in counts:
            cores = [[c] for c in cpus[1 : 1 + k]]
            guarded(
                payload["host_copy"],
                str(k),
                lambda cores=cores: load_floors_together("copy", dirs, cores, args),
                repeats=1,
            )
            print(
                f"host copy, {k} processes: "
                f"{payload['host_copy'][str(k)].get('gb_per_second')} GB/s",
                flush=True,
            )
    refs = References(args, npy_dir)
    workdir = Path(tempfile.mkdtemp(prefix="rh-scale-out-"))
    try:
        for n in ints(args.loaders):
            relays, threads = relays_and_threads(n, args, len(cpus))
            plan = plan_cores(
                cpus,
                control=args.control_cores,
                engine=args.engine_cores,
                relays=relays,
                loaders=n,
                per_loader=args.cores_per_loader,
                allow_overlap=args.allow_overlap,
            )
            if isinstance(plan, dict):
                plan["loader_threads"] = threads
            entry: dict[str, Any] = {
                "n_loaders": n,
                "cores_per_loader": args.cores_per_loader,
                "relays": relays,
                "loader_threads_per_core": threads,
            }
            if isinstance(plan, str):
                entry["skipped"] = plan
                payload["results"].append(entry)
                print(f"N={n} skipped: {plan}", flush=True)
                continue
            entry.update(cores=plan, sources={}, transfer={}, floors_together={}, floor_before={})
            if "floors" not in skip and "floor-repeat" not in skip:
                # The one-process floor again, on the first loader's cores, right before
                # these fits: the targets divide by the median of every sample.
                for source in args.sources:
                    guarded(
                        entry["floor_before"],
                        source,
                        partial(load_floor, source, dirs, plan["loaders"][0], args),
                        repeats=1,
                    )
                    add_floor_sample(payload["floors"], source, entry["floor_before"][source])
                    print(
                        f"N={n} load floor {source}: "
                        f"{entry['floor_before'][source].get('rows_per_second')} "
                        f"(median so far {floor_rate(payload['floors'], source)})",
                        flush=True,
                    )
            if "floors-together" not in skip:
                own = plan["loaders"]
                for source in args.sources:
                    guarded(
                        entry["floors_together"],
                        source,
                        partial(load_floors_together, source, dirs, own, args),
                        repeats=1,
                    )
                    together = entry["floors_together"][source]
                    print(
                        f"N={n} floor {source} together: "
                        f"{together.get('rows_per_second')} per worker "
                        f"({together.get('min_rows_per_second')}-"
                        f"{together.get('max_rows_per_second')})",
                        flush=True,
                    )
            run_cluster(entry, args, plan, loaders, dirs, refs, workdir / f"n{n}", skip)
            payload["results"].append(entry)
            # Every N against the floor's median so far (a new sample moves it).
            for done in payload["results"]:
                if "sources" in done:
                    summarize_entry(done, payload["floors"], engine_rps)
            payload["scaling"] = summarize_scaling(payload)
            write_json(output, strip_private(payload))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    payload["scaling"] = summarize_scaling(payload)
    write_json(output, strip_private(payload))
    print_ratios(payload)
    print(json.dumps(payload["scaling"], indent=1), flush=True)
    picture = plot([strip_private(payload)], output.with_suffix(".png"))
    print(f"wrote {output}" + (f" and {picture}" if picture else ""), flush=True)
    return 0


def run_cluster(
    entry: dict[str, Any],
    args: argparse.Namespace,
    plan: dict[str, Any],
    loaders: list[str],
    dirs: dict[str, Path],
    refs: References,
    workdir: Path,
    skip: set[str],
) -> None:
    """One N: a fresh cluster, its transfer ceilings and fits (relays join for the relay runs)."""
    workdir.mkdir(parents=True)
    own = os.sched_getaffinity(0)
    os.sched_setaffinity(0, plan["control"])  # the client shares the scheduler's CPUs
    cluster = ProcessCluster(plan, args, workdir)
    cols = args.features + 1
    try:
        cluster.start()
        names = cluster.addresses()
        engine_addr = names["engine"]
        senders = [names[f"loader-{i}"] for i in range(len(plan["loaders"]))]
        client = cluster.client
        if "comm" not in skip:
            guarded(
                entry["transfer"],
                "dask_comm",
                lambda: comm_ceiling(
                    client,
                    senders,
                    engine_addr,
                    args.chunk_rows,
                    cols,
                    args.dtype,
                    args.transfer_chunks,
                ),
            )
        relayed = [name for name in loaders if relay_config_of(name) is not None]
        others = [name for name in loaders if relay_config_of(name) is None]
        memory = RoleMemory(cluster.pids())
        fits_for(entry, args, others, dirs, engine_addr, memory, refs)
        if relayed or "relay-ceiling" not in skip:
            cluster.add_relays()
            names = cluster.addresses()
            relays = [names[f"relay-{i}"] for i in range(len(plan["relays"]))]
            if "relay-ceiling" not in skip:
                guarded(
                    entry["transfer"],
                    "relay",
                    lambda: relay_ceiling(
                        client,
                        senders,
                        relays,
                        engine_addr,
                        args.chunk_rows,
                        cols,
                        args.dtype,
                        args.transfer_chunks,
                        args.ring_slots,
                    ),
                )
            if relayed:
                memory = RoleMemory(cluster.pids())
                fits_for(entry, args, relayed, dirs, engine_addr, memory, refs)
        entry["processes"] = cluster.describe()
    except Exception as exc:  # keep the other N's numbers
        entry["error"] = f"{type(exc).__name__}: {exc}"
        entry["trace"] = traceback.format_exc()
        print(f"N={entry['n_loaders']} failed: {exc}", file=sys.stderr, flush=True)
    finally:
        cluster.close()
        os.sched_setaffinity(0, own)
    check_coefficients(entry, refs)


if __name__ == "__main__":
    sys.exit(main())
