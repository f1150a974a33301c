"""The distributed fit against its floors and its opponents, on one machine.

A dataset is first written to local disk as a NumPy stack (``X.npy``,
``y.npy``; rows × features float32 by default). Chunks are read with
``pread`` into fresh arrays (``--source pread``, like a decoder producing new
arrays) or taken as views of a memory map (``--source mmap``, as
``dask.array.from_npy_stack`` reads a stack). Then, for each chunk size, on
exactly the same chunks:

* ``rh_dask``: ``RenewableHuberRegressor(engine=...).fit(X, y)`` on a Dask
  cluster (LocalCUDACluster with ``resources={"GPU": 1}`` for the GPU engine,
  a LocalCluster otherwise), for each requested loader and look-ahead;
* ``incremental``: ``dask_ml.wrappers.Incremental`` around renewable-huber's
  estimator (``backend="cupy"`` or ``"numpy"``), ``shuffle_blocks=False``;
* ``client_loop``: a plain loop computing each chunk through the client and
  calling our engine's ``partial_fit`` in this process;
* ``engine_floor``: our engine alone on chunks already in this process's
  memory, as the engine stages ordinary (pageable) arrays itself;
* ``engine_floor_pinned`` (GPU): the same on chunks already in page-locked
  memory, so that only their DMA remains: the best the engine can do;
* ``load_floor``: reading every chunk with all cores, nothing else.

Reported per chunk size: wall times, rows/s, pipeline efficiency =
max(floors) / wall, peak host memory of the whole process tree (this process,
the nannies and the workers), and whether the coefficients equal those of the
single-process loop on the same engine. The opponents may run on a prefix of
the rows (``--opponent-rows``) to bound the benchmark's time (the client loop
on at most 2,097,152 rows); their rates are then per row and labelled so.
Every method but the client loop runs ``--repeats`` times; the median run is
reported, with all wall times. Each ``rh_dask`` run also times a fit of two
chunks (``two_chunk_fit_seconds``): the cost a fit pays whatever its size.

    # device (H200): 20M x 90 float32
    python benchmarks/distributed_fit.py --engine gpu --rows 20000000 \\
        --output benchmarks/results/distributed_fit-h200.json
    # CPU check at small scale
    python benchmarks/distributed_fit.py --engine numpy --rows 400000 \\
        --chunk-rows 16384,65536 --output benchmarks/results/distributed_fit-cpu.json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import dask.config
import numpy as np
import yaml
from common import environment, fit_chunks, write_json

from rh_dask import HuberConfig, RenewableHuberRegressor, make_engine
from rh_dask.datasets import StreamSpec
from rh_dask.distributed.consumer import STREAM_BLAS_THREADS, blas_limiter
from rh_dask.distributed.items import ChunkSpec
from rh_dask.distributed.loading import assemble_chunk

SCHEMA = "rh-dask/bench/distributed-fit/1"


# -- the dataset on disk -----------------------------------------------------------------
class NpyRows:
    """Rows of a ``.npy`` file read on demand with ``pread`` (pickles as its path).

    Dask slices it like an array; every slice is a fresh in-memory array, so
    a chunk's task really reads the disk (or the page cache).
    """

    def __init__(self, path: str) -> None:
        self.path = str(path)
        mapped = np.load(self.path, mmap_mode="r")  # reads the header only
        if not mapped.flags.c_contiguous:
            raise ValueError(f"{path} is not C-ordered")
        self.offset = int(mapped.offset)
        self.shape = tuple(mapped.shape)
        self.dtype = np.dtype(mapped.dtype)
        del mapped
        self.ndim = len(self.shape)

    def read_into(self, start: int, stop: int, out: np.ndarray) -> None:
        """Read rows ``start:stop`` into ``out`` (C-contiguous, the file's dtype)."""
        row_bytes = int(np.prod(self.shape[1:], dtype=np.int64)) * self.dtype.itemsize
        view = memoryview(out.reshape(-1).view(np.uint8))
        fd = os.open(self.path, os.O_RDONLY)
        try:
            done, total = 0, (stop - start) * row_bytes
            while done < total:
                got = os.preadv(fd, [view[done:]], self.offset + start * row_bytes + done)
                if got <= 0:
                    raise OSError(f"short read from {self.path}")
                done += got
        finally:
            os.close(fd)

    def __getitem__(self, key: Any) -> np.ndarray:
        key = key if isinstance(key, tuple) else (key,)
        rows = key[0]
        start, stop, step = rows.indices(self.shape[0])
        if step != 1:
            raise IndexError("row slices must be contiguous")
        out = np.empty((stop - start, *self.shape[1:]), dtype=self.dtype)
        self.read_into(start, stop, out)
        return out[(slice(None), *key[1:])] if len(key) > 1 else out


class NpyMap:
    """Rows of a ``.npy`` file as views of a read-only memory map (pickles as its path).

    This is how ``dask.array.from_npy_stack`` reads a NumPy stack: a chunk is
    a view, and its bytes are read from the page cache by whoever first
    touches them (for rh-dask, the copy into pinned memory or the engine's
    staging; for the floors, an explicit copy).
    """

    def __init__(self, path: str) -> None:
        self.path = str(path)
        self._map: np.memmap | None = None
        mapped = self._mapped()
        self.shape, self.dtype, self.ndim = tuple(mapped.shape), mapped.dtype, mapped.ndim

    def _mapped(self) -> np.memmap:
        if self._map is None:
            self._map = np.load(self.path, mmap_mode="r")
        return self._map

    def __getitem__(self, key: Any) -> np.ndarray:
        return self._mapped()[key]

    def __reduce__(self) -> tuple[Any, ...]:
        return (NpyMap, (self.path,))


#: How the benchmark reads the dataset: "pread" (NpyRows) or "mmap" (NpyMap).
SOURCE = {"kind": "pread"}


def open_rows(path: Path) -> NpyRows | NpyMap:
    return NpyMap(str(path)) if SOURCE["kind"] == "mmap" else NpyRows(str(path))


def in_memory(a: np.ndarray) -> np.ndarray:
    """The rows in this process's memory (a memory-map view is copied: that is its read)."""
    return np.array(a, copy=True) if SOURCE["kind"] == "mmap" else a


def write_dataset(directory: Path, rows: int, features: int, dtype: str) -> dict[str, Any]:
    """Write X.npy / y.npy (generated in parallel, seeded per block); reuse if present."""
    directory.mkdir(parents=True, exist_ok=True)
    meta_path = directory / "dataset.json"
    meta = {"rows": rows, "features": features, "dtype": dtype, "generator": "StreamSpec(seed=7)"}
    if meta_path.exists() and json.loads(meta_path.read_text()).get("spec") == meta:
        return json.loads(meta_path.read_text())
    spec = StreamSpec(n_features=features, seed=7)
    X_out = np.lib.format.open_memmap(directory / "X.npy", "w+", dtype, (rows, features))
    y_out = np.lib.format.open_memmap(directory / "y.npy", "w+", dtype, (rows,))
    block = 131_072
    starts = range(0, rows, block)

    def fill(start: int) -> None:
        n = min(block, rows - start)
        Xb, yb = spec.chunk(start // block, n, dtype)
        X_out[start : start + n] = Xb
        y_out[start : start + n] = yb

    t0 = time.perf_counter()
    with ThreadPoolExecutor(os.cpu_count()) as pool:
        list(pool.map(fill, starts))
    X_out.flush()
    y_out.flush()
    out = {
        "spec": meta,
        "path": str(directory),
        "bytes": rows * (features + 1) * np.dtype(dtype).itemsize,
        "write_seconds": time.perf_counter() - t0,
    }
    meta_path.write_text(json.dumps(out))
    return out


def dask_inputs(directory: Path, chunk_rows: int, rows: int | None = None):
    import dask.array as da

    Xs, ys = open_rows(directory / "X.npy"), open_rows(directory / "y.npy")
    n = Xs.shape[0] if rows is None else rows
    X = da.from_array(Xs, chunks=(chunk_rows, Xs.shape[1]), asarray=False, lock=False)[:n]
    y = da.from_array(ys, chunks=(chunk_rows,), asarray=False, lock=False)[:n]
    return X, y


def bounds(rows: int, chunk_rows: int) -> list[tuple[int, int]]:
    return [(s, min(s + chunk_rows, rows)) for s in range(0, rows, chunk_rows)]


# -- measuring ------------------------------------------------------------------------------
class PeakMemory:
    """Peak summed RSS of this process and all its descendants, sampled in a thread."""

    def __init__(self, interval: float = 0.05) -> None:
        import psutil

        self._psutil = psutil
        self._interval = interval
        self.baseline = self._sample()
        self.peak = self.baseline
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _sample(self) -> int:
        me = self._psutil.Process()
        total = 0
        for proc in [me, *me.children(recursive=True)]:
            try:
                total += proc.memory_info().rss
            except self._psutil.Error:
                pass
        return total

    def _loop(self) -> None:
        while not self._stop.wait(self._interval):
            self.peak = max(self.peak, self._sample())

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._sample())

    def report(self) -> dict[str, int]:
        return {"baseline_rss_bytes": self.baseline, "peak_rss_bytes": self.peak}


def measure(fn: Callable[[], Any]) -> tuple[float, Any, dict[str, int]]:
    with PeakMemory() as mem:
        start = time.perf_counter()
        value = fn()
        wall = time.perf_counter() - start
    return wall, value, mem.report()


#: Runs of each method; the median run is reported (``--repeats``).
REPEATS = {"n": 3}


def median_run(fn: Callable[[], dict[str, Any]], repeats: int) -> dict[str, Any]:
    """Run ``fn`` ``repeats`` times; the run with the median wall time, with every wall."""
    runs = [fn() for _ in range(max(1, repeats))]
    walls = [r["wall_seconds"] for r in runs]
    order = sorted(range(len(runs)), key=walls.__getitem__)
    chosen = dict(runs[order[len(order) // 2]])
    chosen["wall_seconds_runs"] = walls
    if "rows" in chosen:
        chosen["rows_per_second"] = chosen["rows"] / chosen["wall_seconds"]
    return chosen


def guarded(
    record: dict[str, Any], name: str, fn: Callable[[], dict[str, Any]], repeats: int | None = None
) -> None:
    """Run one method (median of repeats); a failure is recorded, not fatal to the benchmark."""
    try:
        record[name] = median_run(fn, REPEATS["n"] if repeats is None else repeats)
    except Exception as exc:  # keep the other methods' numbers
        record[name] = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}
        print(f"[{name}] failed: {exc}", file=sys.stderr, flush=True)


def state_of(coef: np.ndarray) -> dict[str, Any]:
    return {"coefficients": np.asarray(coef, dtype=np.float64).tolist()}


def compare(a: np.ndarray, b: np.ndarray) -> dict[str, Any]:
    a, b = np.asarray(a), np.asarray(b)
    return {
        "bitwise_equal": bool(a.dtype == b.dtype and a.tobytes() == b.tobytes()),
        "max_abs_diff": float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64)))),
    }


#: How the last cluster was started (reported in the JSON).
CLUSTER_KIND: dict[str, str] = {}


# -- the cluster ------------------------------------------------------------------------------
def start_cluster(engine: str, threads: int, cpu_workers: int, cpu_threads: int):
    """The engine's worker (GPU=1 for the GPU engine) plus optional CPU-only workers."""
    from distributed import Client, LocalCluster, Nanny

    cluster = None
    if engine == "gpu":
        try:
            from dask_cuda import LocalCUDACluster

            cluster = LocalCUDACluster(
                n_workers=1,
                threads_per_worker=threads,
                resources={"GPU": 1},
                dashboard_address=":0",
            )
            CLUSTER_KIND["kind"] = "LocalCUDACluster"
        except Exception as exc:  # keep measuring: a plain worker can host the GPU too
            CLUSTER_KIND["kind"] = f"LocalCluster (dask-cuda failed: {type(exc).__name__}: {exc})"
            print(CLUSTER_KIND["kind"], file=sys.stderr, flush=True)
    if cluster is None:
        cluster = LocalCluster(
            n_workers=1,
            threads_per_worker=threads,
            processes=True,
            dashboard_address=":0",
            resources={"GPU": 1} if engine == "gpu" else None,
        )
        CLUSTER_KIND.setdefault("kind", "LocalCluster")
    client = Client(cluster, direct_to_workers=True)
    extra = []
    if cpu_workers:

        async def start() -> list[Any]:
            env = {"CUDA_VISIBLE_DEVICES": ""}
            return [
                await Nanny(cluster.scheduler_address, nthreads=cpu_threads, env=env)
                for _ in range(cpu_workers)
            ]

        extra = client.sync(start)
        client.wait_for_workers(1 + cpu_workers)
    return cluster, client, extra


def stop_cluster(cluster: Any, client: Any, extra: list[Any]) -> None:
    async def stop() -> None:
        for nanny in extra:
            await nanny.close()

    if extra:
        client.sync(stop)
    client.close()
    cluster.close()


def parse_settings(text: str) -> dict[str, Any]:
    """``key=value,key=value`` as dask.config settings (values read as YAML scalars).

    Keys are dask.config keys, e.g. ``rh-dask.distributed.pin-max-bytes=0``
    or ``rh-dask.gpu.hold-gil=false``; ``lookahead`` is left to the caller.
    """
    pairs = [item.split("=", 1) for item in text.split(",") if item]
    bad = [item for item in pairs if len(item) != 2]
    if bad:
        raise SystemExit(f"a setting is KEY=VALUE, got {'='.join(bad[0])!r}")
    return {key: yaml.safe_load(value) for key, value in pairs}


@contextlib.contextmanager
def run_settings(settings: dict[str, Any], client: Any = None) -> Iterator[None]:
    """Set dask.config ``settings`` on the client for one run (checked on the way in).

    The fit reads them here and hands them to the engine's actor, so workers
    need no change. Engines parked on the cluster are closed on the way in
    and out when a setting decides how an engine is built (``rh-dask.gpu.*``),
    so that the run measures engines built with it.
    """
    from rh_dask.distributed import release_engines
    from rh_dask.settings import Settings

    fresh = client is not None and any(k.startswith("rh-dask.gpu.") for k in settings)
    with dask.config.set(settings):
        Settings.from_config()  # a malformed value stops here, before any run
        if fresh:
            release_engines(client)
        try:
            yield
        finally:
            if fresh:
                release_engines(client)


# -- the methods ------------------------------------------------------------------------------
def run_rh_dask(args, directory, chunk_rows, loader, lookahead, client) -> dict[str, Any]:
    from rh_dask.settings import Settings

    result = _run_rh_dask(args, directory, chunk_rows, loader, lookahead)
    result["settings"] = dataclasses.asdict(Settings.from_config())
    return result


def _run_rh_dask(args, directory, chunk_rows, loader, lookahead) -> dict[str, Any]:
    X, y = dask_inputs(directory, chunk_rows)
    params = dict(engine=args.engine, dtype=args.dtype, progress=False)
    small = dask_inputs(directory, chunk_rows, rows=min(2 * chunk_rows, X.shape[0]))
    # Warm-up: worker imports, engine start-up (CUDA context, kernel compilation).
    RenewableHuberRegressor(lookahead=lookahead, loader=loader, **params).fit(*small)
    # The cost every fit pays whatever its size: the same call on two chunks again.
    tick = time.perf_counter()
    RenewableHuberRegressor(lookahead=lookahead, loader=loader, **params).fit(*small)
    two_chunk_seconds = time.perf_counter() - tick
    model = RenewableHuberRegressor(lookahead=lookahead, loader=loader, **params)
    wall, _, mem = measure(lambda: model.fit(X, y))
    history = model.history_
    return {
        "wall_seconds": wall,
        "two_chunk_fit_seconds": two_chunk_seconds,
        "rows": int(X.shape[0]),
        "rows_per_second": X.shape[0] / wall,
        "engine_seconds_in_actor": float(history["seconds"].sum()),
        "engine_wait_seconds_in_actor": float(history["wait_seconds"].sum()),
        "engine_seconds_per_chunk_quantiles": {
            q: float(history["seconds"].quantile(float(q))) for q in ("0.1", "0.5", "0.9", "1.0")
        },
        "placement": model.placement_,
        "iterations_total": int(history["iterations"].sum()),
        **mem,
        "_coef": model.state_.coefficients,
        "_information": model.state_.information,
    }


def run_incremental(args, directory, chunk_rows, rows, client) -> dict[str, Any]:
    from dask_ml.wrappers import Incremental
    from renewable_huber import RenewableHuberRegressor as Opponent

    backend = "cupy" if args.engine == "gpu" else "numpy"

    def make():
        return Incremental(
            Opponent(backend=backend, dtype=args.dtype), shuffle_blocks=False, random_state=0
        )

    make().fit(*dask_inputs(directory, chunk_rows, rows=min(2 * chunk_rows, rows)))
    X, y = dask_inputs(directory, chunk_rows, rows=rows)
    model = make()
    wall, _, mem = measure(lambda: model.fit(X, y))
    est = model.estimator_
    # renewable-huber's CuPy backend keeps its coefficients on the device.
    coef_ = est.coef_.get() if hasattr(est.coef_, "get") else np.asarray(est.coef_)
    coef = np.concatenate([np.ravel(coef_), [float(est.intercept_)]])
    return {
        "wall_seconds": wall,
        "rows": rows,
        "rows_per_second": rows / wall,
        "backend": backend,
        **mem,
        "_coef": coef,
    }


def engine_result(engine: Any, wall: float, rows: int, mem: dict, **extra: Any) -> dict[str, Any]:
    """A method's record for a loop that fitted one engine in this process.

    ``_coef`` and ``_information`` are compared with the other methods' and
    left out of the JSON.
    """
    return {
        "wall_seconds": wall,
        "rows": rows,
        "rows_per_second": rows / wall,
        **extra,
        **mem,
        "_coef": engine.coefficients(),
        "_information": engine.export_state().information,
    }


def run_client_loop(args, directory, chunk_rows, rows, client, config) -> dict[str, Any]:
    import dask

    X, y = dask_inputs(directory, chunk_rows, rows=rows)
    engine = make_engine(args.engine, config)
    xb, yb = dask.compute(X.blocks[0], y.blocks[0])
    engine.partial_fit(xb, yb)  # warm-up
    engine.reset()

    def loop() -> None:
        with blas_limiter(STREAM_BLAS_THREADS)():
            for i in range(X.numblocks[0]):
                xb, yb = dask.compute(X.blocks[i], y.blocks[i])
                engine.partial_fit(xb, yb)

    wall, _, mem = measure(loop)
    return engine_result(engine, wall, rows, mem)


def run_load_floor(directory, chunk_rows, rows, dtype, validate: bool) -> dict[str, Any]:
    Xs, ys = open_rows(directory / "X.npy"), open_rows(directory / "y.npy")
    spec = ChunkSpec(index=0, dtype=dtype, n_features=Xs.shape[1], feature_names=None)

    def load(b: tuple[int, int]) -> int:
        xb, yb = in_memory(Xs[b[0] : b[1]]), in_memory(ys[b[0] : b[1]])
        if validate:
            assemble_chunk(xb, yb, None, spec)
        return xb.nbytes + yb.nbytes

    def run() -> int:
        with ThreadPoolExecutor(os.cpu_count()) as pool:
            return sum(pool.map(load, bounds(rows, chunk_rows)))

    wall, nbytes, mem = measure(run)
    return {
        "wall_seconds": wall,
        "rows": rows,
        "bytes": nbytes,
        "gb_per_second": nbytes / wall / 1e9,
        "threads": os.cpu_count(),
        **mem,
    }


def run_engine_floor(args, directory, chunk_rows, rows, config, pinned=False) -> dict[str, Any]:
    """The engine alone on chunks already in memory (``pinned``: page-locked memory)."""
    Xs, ys = open_rows(directory / "X.npy"), open_rows(directory / "y.npy")
    engine = make_engine(args.engine, config)
    pinned_pool = engine.pinned_pool if pinned else None  # created before the threads

    def load(b: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
        xb, yb = in_memory(Xs[b[0] : b[1]]), in_memory(ys[b[0] : b[1]])
        return pinned_pool.copy_batch(xb, yb, None)[:2] if pinned_pool else (xb, yb)

    with ThreadPoolExecutor(os.cpu_count()) as pool:
        chunks = list(pool.map(load, bounds(rows, chunk_rows)))
    engine.partial_fit(*chunks[0])  # warm-up
    engine.reset()

    def loop() -> str:
        # The same BLAS pin as every stream: this is the single-process reference.
        with blas_limiter(STREAM_BLAS_THREADS)():
            return fit_chunks(engine, chunks)

    wall, path, mem = measure(loop)
    return engine_result(engine, wall, rows, mem, path=path)


# -- main ------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--engine", choices=["gpu", "numpy"], default="gpu")
    p.add_argument("--rows", type=int, default=20_000_000)
    p.add_argument("--features", type=int, default=90)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--chunk-rows", default="65536,262144")
    p.add_argument("--data-dir", default=None, help="default: $TMPDIR/rh-dask-bench-<shape>")
    p.add_argument("--threads", type=int, default=None, help="threads of the engine's worker")
    p.add_argument("--lookahead", type=int, default=8)
    p.add_argument(
        "--loaders",
        default="actor,engine-worker",
        help="loaders to run (the first is the headline result)",
    )
    p.add_argument("--lookahead-sweep", default="", help="extra look-aheads (first chunk size)")
    p.add_argument("--opponent-rows", type=int, default=None, help="rows for the opponents")
    p.add_argument("--skip", default="", help="comma list of methods to skip")
    p.add_argument(
        "--loader-study",
        default="",
        help="ENGINE_THREADS,CPU_WORKERS,CPU_THREADS: after the main runs, a second cluster "
        "(engine worker + CPU-only workers) fits the first chunk size with each loader",
    )
    p.add_argument(
        "--variants",
        default="",
        help="extra runs of the headline loader with other dask.config settings, e.g. "
        "'rh-dask.distributed.pin-max-bytes=0;rh-dask.gpu.hold-gil=false' (';' between "
        "runs, ',' between settings of one run; 'lookahead=16' sets the estimator's "
        "look-ahead)",
    )
    p.add_argument(
        "--config",
        default="rh-dask.distributed.heap-for-chunks=true",
        help="dask.config settings of every run, KEY=VALUE,... (default: the engine's "
        "worker keeps chunks on malloc's heap, as in docs/performance.md's figures; "
        "'' for the packaged defaults)",
    )
    p.add_argument("--repeats", type=int, default=3, help="runs per method (median kept)")
    p.add_argument(
        "--source",
        choices=["pread", "mmap"],
        default="pread",
        help="read chunks with pread into fresh arrays, or as views of a memory map "
        "(as dask.array.from_npy_stack does)",
    )
    p.add_argument(
        "--free-affinity",
        action="store_true",
        help="let the workers' threads run on every CPU (undo dask-cuda's CPU affinity)",
    )
    p.add_argument("--output", default="benchmarks/results/distributed_fit.json")
    args = p.parse_args(argv)
    with dask.config.set(parse_settings(args.config)):
        return benchmark(args)


def benchmark(args: argparse.Namespace) -> int:
    """Every run of the benchmark (under the ``--config`` settings); writes the JSON."""
    cores = os.cpu_count() or 1
    threads = args.threads or max(1, cores - 4)
    sizes = [int(s) for s in args.chunk_rows.split(",") if s]
    sweep = [int(s) for s in args.lookahead_sweep.split(",") if s]
    skip = set(args.skip.split(",")) - {""}
    main_loader, *other_loaders = [s for s in args.loaders.split(",") if s]
    REPEATS["n"] = args.repeats
    SOURCE["kind"] = args.source
    tmp = Path(os.environ.get("TMPDIR", "/tmp"))
    directory = Path(args.data_dir or tmp / f"rh-dask-bench-{args.rows}x{args.features}")
    dataset = write_dataset(directory, args.rows, args.features, args.dtype)
    print(f"dataset ready: {dataset}", flush=True)
    config = HuberConfig(dtype=args.dtype)
    payload: dict[str, Any] = {
        "schema": SCHEMA,
        "environment": environment(),
        "arguments": vars(args) | {"threads": threads},
        "dataset": dataset,
        "results": [],
    }
    cluster, client, extra = start_cluster(args.engine, threads, 0, 0)
    if args.free_affinity:
        payload["affinity_freed_threads"] = client.run(free_affinity)
    payload["cluster"] = describe_cluster(client)
    try:
        for size in sizes:
            opp_rows = min(args.rows, args.opponent_rows or args.rows)
            opp_rows = max(size, opp_rows - opp_rows % size)
            entry: dict[str, Any] = {
                "chunk_rows": size,
                "n_chunks": -(-args.rows // size),
                "opponent_rows": opp_rows,
                "methods": {},
            }
            methods = entry["methods"]
            ks = [args.lookahead] + (
                [k for k in sweep if k != args.lookahead] if size == sizes[0] else []
            )
            for k in ks:
                name = f"rh_dask[{main_loader},K={k}]"
                run = partial(run_rh_dask, args, directory, size, main_loader, k, client)
                guarded(methods, name, run)
                print(name, methods[name].get("wall_seconds"), flush=True)
            for variant in [v for v in args.variants.split(";") if v]:
                name = f"rh_dask[{main_loader},K={args.lookahead},{variant}]"
                settings = parse_settings(variant)
                k = int(settings.pop("lookahead", args.lookahead))
                run = partial(run_rh_dask, args, directory, size, main_loader, k, client)
                with run_settings(settings, client):
                    guarded(methods, name, run)
                print(name, methods[name].get("wall_seconds"), flush=True)
            for loader in other_loaders:
                name = f"rh_dask[{loader},K={args.lookahead}]"
                run = partial(run_rh_dask, args, directory, size, loader, args.lookahead, client)
                guarded(methods, name, run)
                print(name, methods[name].get("wall_seconds"), flush=True)
            if "incremental" not in skip:
                run = partial(run_incremental, args, directory, size, opp_rows, client)
                guarded(methods, "incremental", run)
            if "client_loop" not in skip:
                run = partial(
                    run_client_loop,
                    args,
                    directory,
                    size,
                    min(opp_rows, 2_097_152),
                    client,
                    config,
                )
                guarded(methods, "client_loop", run, repeats=1)
            for name, validate in (("load_floor", False), ("load_validate_floor", True)):
                run = partial(run_load_floor, directory, size, args.rows, args.dtype, validate)
                guarded(methods, name, run)
            run = partial(run_engine_floor, args, directory, size, args.rows, config)
            guarded(methods, "engine_floor", run)
            if args.engine == "gpu" and "engine_floor_pinned" not in skip:
                run = partial(run_engine_floor, args, directory, size, args.rows, config, True)
                guarded(methods, "engine_floor_pinned", run)
            summarize_entry(entry, args.lookahead, main_loader)
            payload["results"].append(entry)
            write_json(args.output, strip_private(payload))
            print(json.dumps(entry["summary"], indent=1), flush=True)
    finally:
        stop_cluster(cluster, client, extra)
    if args.loader_study:
        payload["loader_study"] = loader_study(args, directory, sizes[0])
    write_json(args.output, strip_private(payload))
    return 0


def _affinity() -> dict[str, Any]:
    """CPUs each thread of this process may run on (dask-cuda pins workers near their GPU)."""
    cpus = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            cpus[tid] = sorted(os.sched_getaffinity(int(tid)))
        except OSError:  # the thread ended meanwhile
            pass
    distinct = sorted({tuple(c) for c in cpus.values()})
    return {"cpu_count": os.cpu_count(), "threads": len(cpus), "cpu_sets": distinct}


def free_affinity() -> int:
    """Let every thread of this process run on every CPU; returns the threads changed."""
    every = range(os.cpu_count() or 1)
    changed = 0
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):
            os.sched_setaffinity(int(tid), every)
            changed += 1
    return changed


def describe_cluster(client: Any) -> dict[str, Any]:
    workers = {
        addr: {"nthreads": w["nthreads"], "resources": w.get("resources", {})}
        for addr, w in client.scheduler_info(n_workers=-1)["workers"].items()
    }
    for addr, affinity in client.run(_affinity).items():
        workers[addr]["affinity"] = affinity
    return {"kind": CLUSTER_KIND.get("kind"), "workers": workers}


def loader_study(args: Any, directory: Path, size: int) -> dict[str, Any]:
    """Chunks loaded on the engine's worker versus on CPU-only workers (a copy each)."""
    engine_threads, cpu_workers, cpu_threads = (int(v) for v in args.loader_study.split(","))
    study: dict[str, Any] = {"chunk_rows": size, "methods": {}}
    cluster, client, extra = start_cluster(args.engine, engine_threads, cpu_workers, cpu_threads)
    try:
        study["cluster"] = describe_cluster(client)
        for loader in ("engine-worker", "cluster"):
            name = f"rh_dask[{loader},K={args.lookahead}]"
            run = partial(run_rh_dask, args, directory, size, loader, args.lookahead, client)
            guarded(study["methods"], name, run)
            print("loader study", name, study["methods"][name].get("wall_seconds"), flush=True)
    finally:
        stop_cluster(cluster, client, extra)
    return study


def summarize_entry(entry: dict[str, Any], lookahead: int, loader: str) -> None:
    m = entry["methods"]
    ours = m.get(f"rh_dask[{loader},K={lookahead}]", {})
    floor = m.get("engine_floor", {})
    load = m.get("load_floor", {})
    summary: dict[str, Any] = {}
    floors = [x["wall_seconds"] for x in (floor, load) if "wall_seconds" in x]
    if "wall_seconds" in ours and floors:
        summary["wall_seconds"] = ours["wall_seconds"]
        summary["max_floor_seconds"] = max(floors)
        summary["pipeline_efficiency"] = max(floors) / ours["wall_seconds"]
        summary["wall_over_max_floor"] = ours["wall_seconds"] / max(floors)
    if "rows_per_second" in ours:
        for other in ("incremental", "client_loop"):
            if "rows_per_second" in m.get(other, {}):
                summary[f"speedup_vs_{other}"] = (
                    ours["rows_per_second"] / m[other]["rows_per_second"]
                )
    if "_coef" in floor:
        for name, result in m.items():
            if "_coef" in result and name != "engine_floor":
                if result.get("rows", 0) == floor["rows"]:
                    result["coefficients_vs_engine_floor"] = compare(
                        result["_coef"], floor["_coef"]
                    )
                    if "_information" in result:
                        result["information_vs_engine_floor"] = compare(
                            result["_information"], floor["_information"]
                        )
        inc, loop = m.get("incremental", {}), m.get("client_loop", {})
        if "_coef" in inc and "_coef" in loop and inc.get("rows") == loop.get("rows"):
            m["incremental"]["coefficients_vs_client_loop"] = compare(
                m["incremental"]["_coef"], m["client_loop"]["_coef"]
            )
    summary["coefficients_identical_to_single_process"] = ours.get(
        "coefficients_vs_engine_floor", {}
    ).get("bitwise_equal")
    entry["summary"] = summary


def strip_private(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: strip_private(v) for k, v in value.items() if not str(k).startswith("_")}
    if isinstance(value, list):
        return [strip_private(v) for v in value]
    return value


if __name__ == "__main__":
    sys.exit(main())
