"""How the NumPy engine's matrix-vector products should use a host's cores.

The L1 (LAMM) streams spend most of their time in ``Z v`` and ``Zᵀ u`` over a
batch's rows. The engine runs them as fixed row blocks on its own thread pool,
BLAS on one thread per block (bits independent of the count); a peer lets
OpenBLAS thread each call. On 16 cores the row blocks did not scale (the GEMV
class took 1.6-1.9 ms at every count on reference float64,
``numpy_engine-h100-gemv-threads.json``). This probe times, per shape and dtype,
interleaved and in rotating order:

- ``blas[k]``: one call, OpenBLAS on ``k`` threads (``threadpool_limits``);
- ``rows[k]``: the engine's row blocks (:func:`rh_dask.engines.row_blocks.run_tasks`)
  on ``k`` threads, BLAS on one thread each;
- ``team[k]``: the same blocks on a team of ``k`` threads kept for the probe, each
  with a fixed contiguous share of the blocks, woken by a lock of its own (what
  the hand-over costs when no queue and no task objects stand between);
- ``span[k]`` (``Z v`` only): the team, one BLAS call per thread over its share's
  rows (fewer calls; its bits are recorded, as a row's dot product may be summed
  otherwise at a call's edge);

for ``Z v`` and ``Zᵀ u``, records whether ``blas[k]``'s result has the bits of one
thread's, and, with ``--streams``, whole L1 streams of the NumPy engine with the
fused LAMM pass on and off. ``--busy N`` runs N spinning processes beside the probe
(a host whose other cores are taken, as by Dask workers). Writes one JSON.

    python benchmarks/gemv_probe.py --output /tmp/gemv_probe.json
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing
import statistics
import threading
import time
from collections.abc import Callable

import numpy as np
from common import SHAPES, environment, summarize, write_json
from threadpoolctl import threadpool_limits

from rh_dask import HuberConfig, NumpyEngine
from rh_dask.datasets import StreamSpec
from rh_dask.engines import numpy_engine as numpy_engine_module
from rh_dask.engines.blas_threads import one_blas_thread, usable_cores
from rh_dask.engines.row_blocks import row_blocks, run_tasks, thread_counts


def _spin(stop: multiprocessing.synchronize.Event) -> None:  # type: ignore[name-defined]
    x = 0
    while not stop.is_set():
        for _ in range(10_000):
            x += 1


Way = Callable[[], tuple[np.ndarray, float]]


def _in_block_order(parts: list[np.ndarray]) -> np.ndarray:
    """The row blocks' partial products of ``Zᵀ u`` added in block order, as the engine does."""
    total = parts[0].copy()
    for part in parts[1:]:
        total += part
    return total


class _Team:
    """``k - 1`` threads kept between products; part ``j`` of a job runs on thread ``j``.

    Each thread sleeps on a lock of its own and reports on another, so a
    product's hand-over is ``k - 1`` lock releases and as many acquires.
    """

    def __init__(self, k: int) -> None:
        self.go = [threading.Lock() for _ in range(k - 1)]
        self.done = [threading.Lock() for _ in range(k - 1)]
        for lock in (*self.go, *self.done):
            lock.acquire()
        self.job: Callable[[int], None] | None = None
        self.threads = [
            threading.Thread(target=self._loop, args=(i,), daemon=True) for i in range(k - 1)
        ]
        for thread in self.threads:
            thread.start()

    def _loop(self, i: int) -> None:
        while True:
            self.go[i].acquire()
            job = self.job
            if job is None:
                return
            with one_blas_thread():
                job(i + 1)
            self.done[i].release()

    def run(self, job: Callable[[int], None]) -> None:
        self.job = job
        for lock in self.go:
            lock.release()
        job(0)
        for lock in self.done:
            lock.acquire()

    def close(self) -> None:
        self.job = None
        for lock in self.go:
            lock.release()
        for thread in self.threads:
            thread.join()


def _products(Z: np.ndarray, counts: tuple[int, ...], teams: dict[int, _Team]) -> dict[str, Way]:
    """Each way of taking Z v and Zᵀ u: callables returning the product and its seconds.

    The seconds leave out setting the BLAS thread count (``threadpool_limits``
    finds the libraries afresh at each use, milliseconds), as the engine sets it
    once per batch.
    """
    rng = np.random.default_rng(1)
    v = rng.normal(size=Z.shape[1]).astype(Z.dtype)
    u = rng.normal(size=Z.shape[0]).astype(Z.dtype)
    out = np.empty(Z.shape[0], Z.dtype)
    blocks = row_blocks(*Z.shape, Z.itemsize)
    ways: dict[str, Way] = {}

    def blas(k: int, op: str) -> Way:
        def run() -> tuple[np.ndarray, float]:
            with threadpool_limits(k):
                start = time.perf_counter()
                product = np.matmul(Z, v, out=out) if op == "Zv" else Z.T @ u
                return product, time.perf_counter() - start

        return run

    def rows(k: int, op: str) -> Way:
        def zv(a: int, b: int) -> None:
            np.matmul(Z[a:b], v, out=out[a:b])

        def ztu(a: int, b: int) -> np.ndarray:
            return Z[a:b].T @ u[a:b]

        def run() -> tuple[np.ndarray, float]:
            with one_blas_thread():
                start = time.perf_counter()
                if op == "Zv":
                    run_tasks([lambda a=a, b=b: zv(a, b) for a, b in blocks], k)
                    return out, time.perf_counter() - start
                parts = run_tasks([lambda a=a, b=b: ztu(a, b) for a, b in blocks], k)
                return _in_block_order(parts), time.perf_counter() - start

        return run

    def team(k: int, op: str) -> Way:
        shares = [blocks[j * len(blocks) // k : (j + 1) * len(blocks) // k] for j in range(k)]
        parts: list[np.ndarray] = [np.empty(0)] * len(blocks)

        def zv(j: int) -> None:
            for a, b in shares[j]:
                np.matmul(Z[a:b], v, out=out[a:b])

        def span(j: int) -> None:
            if shares[j]:
                a, b = shares[j][0][0], shares[j][-1][1]
                np.matmul(Z[a:b], v, out=out[a:b])

        def ztu(j: int) -> None:
            for n, (a, b) in enumerate(shares[j], start=j * len(blocks) // k):
                parts[n] = Z[a:b].T @ u[a:b]

        def run() -> tuple[np.ndarray, float]:
            with one_blas_thread():
                start = time.perf_counter()
                if op in ("Zv", "span"):
                    teams[k].run(zv if op == "Zv" else span)
                    return out, time.perf_counter() - start
                teams[k].run(ztu)
                return _in_block_order(parts), time.perf_counter() - start

        return run

    for op in ("Zv", "Ztu"):
        for k in counts:
            ways[f"{op} blas[{k}]"] = blas(k, op)
            ways[f"{op} rows[{k}]"] = rows(k, op)
            if k > 1 and len(blocks) > 1:
                ways[f"{op} team[{k}]"] = team(k, op)
                if op == "Zv":
                    ways[f"{op} span[{k}]"] = team(k, "span")
    return ways


def probe_products(
    name: str, dtype: str, counts: tuple[int, ...], rounds: int
) -> dict[str, object]:
    _, features, batch = SHAPES[name]
    X, _ = StreamSpec(n_features=features, seed=3).chunk(0, batch, "float64")
    Z = np.ascontiguousarray(np.column_stack([X, np.ones(batch)]), dtype=dtype)
    teams = {k: _Team(k) for k in counts if k > 1}
    try:
        return _probe(name, dtype, batch, features, Z, _products(Z, counts, teams), rounds)
    finally:
        for team in teams.values():
            team.close()


def _probe(
    name: str,
    dtype: str,
    batch: int,
    features: int,
    Z: np.ndarray,
    ways: dict[str, Way],
    rounds: int,
) -> dict[str, object]:
    first = {key: fn()[0].copy() for key, fn in ways.items()}  # also a warm-up
    same_bits = {
        key: bool(np.array_equal(first[key], first[f"{key.split()[0]} blas[1]"])) for key in ways
    }
    same_as_rows = {
        key: bool(np.array_equal(first[key], first[f"{key.split()[0]} rows[1]"])) for key in ways
    }
    samples: dict[str, list[float]] = {key: [] for key in ways}
    names = list(ways)
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        if r % 2:
            order.reverse()
        for key in order:
            samples[key].append(ways[key]()[1])
    medians = {key: statistics.median(s) for key, s in samples.items()}
    return {
        "shape": name,
        "rows": batch,
        "columns": features + 1,
        "dtype": dtype,
        "z_bytes": Z.nbytes,
        "row_blocks": len(row_blocks(*Z.shape, Z.itemsize)),
        "same_bits_as_one_thread": same_bits,
        "same_bits_as_rows": same_as_rows,
        "median_seconds": medians,
        "timings": {key: summarize(s) for key, s in samples.items()},
        "fastest": {
            op: min((k for k in medians if k.startswith(op + " ")), key=medians.__getitem__)
            for op in ("Zv", "Ztu")
        },
    }


def probe_streams(name: str, dtype: str, threads: list[str], repeats: int) -> dict[str, object]:
    """Whole L1 streams, fused LAMM pass on its default rule and off, per BLAS setting."""
    rows, features, batch = SHAPES[name]
    X, y = StreamSpec(n_features=features, seed=5).chunk(0, rows, "float64")
    X, y = X.astype(dtype), y.astype(dtype)
    chunks = [(X[s : s + batch], y[s : s + batch]) for s in range(0, rows, batch)]
    default_fused = numpy_engine_module.FUSED_MIN_BYTES
    contenders = list(itertools.product(threads, ("default", "off")))
    samples: dict[str, list[float]] = {f"{t} fused={f}": [] for t, f in contenders}
    coefficients: dict[str, np.ndarray] = {}
    try:
        for r in range(repeats + 1):  # the first round warms up (and calibrates "auto")
            order = contenders if r % 2 == 0 else contenders[::-1]
            for t, fused in order:
                numpy_engine_module.FUSED_MIN_BYTES = (
                    default_fused if fused == "default" else 1 << 62
                )
                config = HuberConfig(penalty="l1", dtype=dtype)
                start = time.perf_counter()
                engine = NumpyEngine(config, blas_threads=t if t == "auto" else int(t))
                for a, b in chunks:
                    engine.partial_fit(a, b)
                seconds = time.perf_counter() - start
                if r:
                    samples[f"{t} fused={fused}"].append(seconds)
                coefficients[f"{t} fused={fused}"] = engine.coefficients()
    finally:
        numpy_engine_module.FUSED_MIN_BYTES = default_fused
    reference = coefficients[f"{threads[0]} fused=off"]
    return {
        "shape": name,
        "dtype": dtype,
        "batches": len(chunks),
        "median_seconds": {k: statistics.median(s) for k, s in samples.items()},
        "timings": {k: summarize(s) for k, s in samples.items()},
        "max_abs_difference_from_first_unfused": {
            k: float(np.max(np.abs(c - reference))) for k, c in coefficients.items()
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["reference", "wide", "streaming"])
    parser.add_argument("--dtypes", nargs="+", default=["float64", "float32"])
    parser.add_argument("--rounds", type=int, default=41, help="timed rounds of the products")
    parser.add_argument("--streams", type=int, default=0, help="repeats of whole L1 streams")
    parser.add_argument("--stream-threads", nargs="+", default=["auto", "1"])
    parser.add_argument("--busy", type=int, default=0, help="spinning processes beside")
    parser.add_argument("--output", default="gemv_probe.json")
    args = parser.parse_args()

    counts = thread_counts(16)
    stop = multiprocessing.Event()
    spinners = [multiprocessing.Process(target=_spin, args=(stop,)) for _ in range(args.busy)]
    for proc in spinners:
        proc.start()
    products, streams = [], []
    try:
        for name, dtype in itertools.product(args.shapes, args.dtypes):
            found = probe_products(name, dtype, counts, args.rounds)
            products.append(found)
            med = found["median_seconds"]
            print(
                f"{name:10} {dtype:8} Zv: "
                + " ".join(f"{k.split()[1]}={med[k] * 1e3:.3f}" for k in med if k[:3] == "Zv ")
                + f"\n{'':19} Ztu: "
                + " ".join(f"{k.split()[1]}={med[k] * 1e3:.3f}" for k in med if k[:4] == "Ztu ")
                + f"\n{'':19} Zv's bits as one thread's: "
                + str(
                    {
                        k.split()[1]: s
                        for k, s in found["same_bits_as_one_thread"].items()
                        if k.startswith("Zv ") and ("blas" in k or "span" in k)
                    }
                )
                + f"\n{'':19} not the row blocks' bits: "
                + str([k for k, s in found["same_bits_as_rows"].items() if not s])
            )
            if args.streams:
                got = probe_streams(name, dtype, args.stream_threads, args.streams)
                streams.append(got)
                print(
                    f"{'':19} L1 streams ms: "
                    + " ".join(f"{k}={v * 1e3:.1f}" for k, v in got["median_seconds"].items())
                )
    finally:
        stop.set()
        for proc in spinners:
            proc.join()
    path = write_json(
        args.output,
        {
            "schema": "rh-dask/gemv-probe/1",
            "environment": environment(),
            "settings": {
                "rounds": args.rounds,
                "streams": args.streams,
                "stream_threads": args.stream_threads,
                "busy_processes": args.busy,
                "counts": counts,
                "usable_cores": usable_cores(),
            },
            "products": products,
            "streams": streams,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
