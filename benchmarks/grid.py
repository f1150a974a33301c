"""One configuration against a grid of τ values over the same stream, in one process.

The stream (``--rows`` × ``--features``, ``--dtype``, chunks of
``--chunk-rows``) is generated into host memory first (seeded chunks of
:class:`rh_dask.datasets.StreamSpec`). Then, engine warmed up by one untimed
pass and reset between passes:

* ``single_partial_fit``: one engine at ``--single-tau``, one ``partial_fit``
  per chunk;
* ``single_stream``: the same engine fed through ``partial_fit_stream`` where
  the engine has it (the GPU engine overlaps each chunk's copy with the
  previous solve), else the same loop;
* ``grid``: :class:`rh_dask.engines.grid.GridEngine` over ``--taus`` (8
  values by default) through ``partial_fit_stream``, each chunk scored at
  every configuration then fitted by every configuration; for the GPU
  engine each host chunk is copied to the device once (the next one while
  this one is solved) and shared, and the engines advance side by side
  (``grid``) or one after the other (``grid_sequential``).

With ``--distributed N`` the grid also runs on a cluster of N workers, one
:class:`~rh_dask.distributed.grid_walk.GridActor` per worker, through
:class:`rh_dask.RenewableHuberGridRegressor` (``walk="cluster"``): a
``dask_cuda.LocalCUDACluster`` of N GPUs for ``--engine gpu`` (the script
says so and exits when dask_cuda is not installed), else a ``LocalCluster``
of N workers advertising ``GPU=1`` running the NumPy engine (a CPU smoke
run). The workers generate the same seeded chunks themselves, each chunk
loaded once per pass. Reported for it: wall times (a warm-up pass first),
rows per second, each actor's busy fraction and configurations, and whether
every configuration's state and prequential scores are bit-identical to
the in-process grid's.

Reported: every wall time, medians, the ratio grid / single (issue 15's
target: at most 2 on the 20M × 90 float32 stream with the GPU engine), rows
per second, and whether every configuration's coefficients are bit-identical
to its own single fit on the same chunks (``--no-check`` skips those
untimed fits).

    # device (H200)
    python benchmarks/grid.py --engine gpu --rows 20000000 \\
        --output benchmarks/results/grid-h200.json
    # CPU, small
    python benchmarks/grid.py --rows 200000 --engine numpy
    # spread over two workers (GPUs with --engine gpu)
    python benchmarks/grid.py --rows 200000 --engine numpy --distributed 2
"""

from __future__ import annotations

import argparse
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
from common import environment, fit_chunks, summarize, write_json

from rh_dask import HuberConfig, make_engine
from rh_dask.datasets import StreamSpec
from rh_dask.engines.grid import GridEngine

SCHEMA = "rh-dask/bench/grid/1"
DEFAULT_TAUS = "0.5,0.75,1.0,1.345,2.0,3.0,5.0,10.0"


def make_chunks(rows: int, features: int, chunk_rows: int, dtype: str) -> list[tuple[Any, Any]]:
    """The stream's chunks in host memory, generated on all cores."""
    spec = StreamSpec(n_features=features, seed=15)
    starts = list(range(0, rows, chunk_rows))
    sizes = [min(chunk_rows, rows - s) for s in starts]
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        return list(pool.map(lambda a: spec.chunk(a[0], a[1], dtype), enumerate(sizes)))


def sync(engine: Any) -> np.ndarray:
    """β on the host: waits for the device, so a timer stopped after it is honest."""
    return engine.coefficients()


def time_single(engine: Any, chunks: list, repeats: int, stream: bool) -> list[float]:
    samples = []
    for _ in range(repeats + 1):  # the first pass warms workspaces, graphs, pinned buffers
        engine.reset()
        start = time.perf_counter()
        if stream:
            fit_chunks(engine, chunks)
        else:
            for X, y in chunks:
                engine.partial_fit(X, y)
        sync(engine)
        samples.append(time.perf_counter() - start)
    return samples[1:]


def time_grid(grid: GridEngine, chunks: list, repeats: int) -> list[float]:
    samples = []
    for _ in range(repeats + 1):
        grid.reset()
        start = time.perf_counter()
        for _ in grid.partial_fit_stream(chunks):
            pass
        grid.coefficients()
        samples.append(time.perf_counter() - start)
    return samples[1:]


def check_identity(grid: GridEngine, engine_name: str, device: Any, chunks: list) -> list[bool]:
    """Whether each configuration's state is bit-identical to its own single fit."""
    out = []
    for config, state in zip(grid.configs, grid.export_states(), strict=True):
        single = make_engine(engine_name, config, device)
        for X, y in chunks:
            single.partial_fit(X, y)
        out.append(bool(single.export_state().equals(state)))
        close = getattr(single, "close", None)
        if close is not None:
            close()
    return out


def stream_collection(rows: int, features: int, chunk_rows: int, dtype: str) -> tuple[Any, Any]:
    """The chunks of :func:`make_chunks` as Dask arrays generated where they load."""
    import dask
    import dask.array as da

    spec = StreamSpec(n_features=features, seed=15)
    np_dtype = np.dtype(dtype)
    xs, ys = [], []
    for i, start in enumerate(range(0, rows, chunk_rows)):
        size = min(chunk_rows, rows - start)
        pair = dask.delayed(spec.chunk, pure=True)(i, size, dtype)
        xs.append(da.from_delayed(pair[0], (size, features), dtype=np_dtype))
        ys.append(da.from_delayed(pair[1], (size,), dtype=np_dtype))
    return da.concatenate(xs), da.concatenate(ys)


def start_cluster(engine: str, n: int) -> Any:
    """N GPU workers (dask_cuda) for the GPU engine, else N CPU workers advertising GPU=1.

    Each worker gets an equal share of the host's cores as threads: the chunks
    are generated on the workers, and dask-cuda's default of one thread per
    worker made that generation, not the grid, the bound (3% actor busy).
    """
    threads = max(1, (os.cpu_count() or 1) // n)
    if engine == "gpu":
        from dask_cuda import LocalCUDACluster

        return LocalCUDACluster(
            n_workers=n,
            threads_per_worker=threads,
            resources={"GPU": 1},
            dashboard_address=None,
        )
    from distributed import LocalCluster

    return LocalCluster(
        n_workers=n,
        threads_per_worker=threads,
        resources={"GPU": 1},
        dashboard_address=None,
    )


def time_distributed(args: Any, taus: list[float], grid: GridEngine) -> dict[str, Any]:
    """The grid over a cluster of ``args.distributed`` workers, against the in-process grid."""
    from distributed import Client

    from rh_dask import RenewableHuberGridRegressor

    X, y = stream_collection(args.rows, args.features, args.chunk_rows, args.dtype)
    samples, placements = [], []
    with start_cluster(args.engine, args.distributed) as cluster, Client(cluster):
        for _ in range(args.repeats + 1):  # the first pass starts the engines on the workers
            model = RenewableHuberGridRegressor(
                taus=taus,
                reference_tau=args.reference_tau,
                engine=args.engine,
                dtype=args.dtype,
                walk="cluster",
                lookahead=args.lookahead,
            )
            start = time.perf_counter()
            model.fit(X, y)
            samples.append(time.perf_counter() - start)
            placements.append(model.placement_)
    states = model._grid.export_states()
    identical_states = [
        bool(a.equals(b)) for a, b in zip(states, grid.export_states(), strict=True)
    ]
    local = grid.records
    walked = model._grid.records
    identical_scores = len(local) == len(walked) and all(
        a.huber_loss.tobytes() == b.huber_loss.tobytes() and a.mae.tobytes() == b.mae.tobytes()
        for a, b in zip(local, walked, strict=True)
    )
    timed = samples[1:]
    med = float(np.median(timed))
    return {
        "workers": args.distributed,
        "cluster": type(cluster).__name__,
        "seconds": summarize(timed),
        "raw_seconds": timed,
        "warmup_seconds": samples[0],
        "rows_per_second": args.rows / med,
        "placement": placements[1:],
        "busy_fraction": [
            float(np.median([p[a]["busy_fraction"] for p in placements[1:]]))
            for a in range(len(placements[-1]))
        ],
        "states_identical_to_in_process_grid": identical_states,
        "prequential_identical_to_in_process_grid": bool(identical_scores),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", default="numpy", choices=["numpy", "gpu"])
    parser.add_argument("--device", default=None)
    parser.add_argument("--rows", type=int, default=20_000_000)
    parser.add_argument("--features", type=int, default=90)
    parser.add_argument("--chunk-rows", type=int, default=65_536)
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    parser.add_argument("--taus", default=DEFAULT_TAUS, help="comma-separated τ values")
    parser.add_argument("--single-tau", type=float, default=1.345)
    parser.add_argument("--reference-tau", type=float, default=1.345)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-check", action="store_true", help="skip the bit-identity fits")
    parser.add_argument(
        "--distributed",
        type=int,
        default=0,
        metavar="N",
        help="also run the grid over N cluster workers (GPUs with --engine gpu)",
    )
    parser.add_argument(
        "--lookahead", type=int, default=8, help="chunks in flight (--distributed)"
    )
    parser.add_argument("--output", default="benchmarks/results/grid.json")
    args = parser.parse_args(argv)
    if args.distributed < 0:
        parser.error("--distributed must be >= 1 (0: not at all)")
    if args.distributed and args.engine == "gpu":
        try:
            import dask_cuda  # noqa: F401
        except ImportError:
            print("--distributed with --engine gpu needs dask_cuda, which is not installed here")
            return 2

    taus = [float(t) for t in args.taus.split(",")]
    t0 = time.perf_counter()
    chunks = make_chunks(args.rows, args.features, args.chunk_rows, args.dtype)
    generate_seconds = time.perf_counter() - t0
    base = {"dtype": args.dtype}
    engine = make_engine(args.engine, HuberConfig(tau=args.single_tau, **base), args.device)
    single_pf = time_single(engine, chunks, args.repeats, stream=False)
    single_stream = time_single(engine, chunks, args.repeats, stream=True)
    stream_path = "partial_fit_stream" if hasattr(engine, "partial_fit_stream") else "partial_fit"
    close = getattr(engine, "close", None)
    if close is not None:
        close()
    configs = [HuberConfig(tau=t, **base) for t in taus]
    # The GPU grid both ways: one engine after the other (the default) and side by side
    # (rh-dask.grid.concurrent); "grid" in the JSON is the side-by-side run where the
    # engines allow it (GPU), else the same sequential path again.
    sequential = GridEngine(
        configs, args.engine, args.device, reference_tau=args.reference_tau, concurrent=False
    )
    sequential_samples = time_grid(sequential, chunks, args.repeats)
    sequential_states = sequential.export_states()
    sequential.close()
    grid = GridEngine(
        configs, args.engine, args.device, reference_tau=args.reference_tau, concurrent=True
    )
    grid_samples = time_grid(grid, chunks, args.repeats)
    concurrent_same_bits = all(
        a.equals(b) for a, b in zip(grid.export_states(), sequential_states, strict=True)
    )
    identical = None if args.no_check else check_identity(grid, args.engine, args.device, chunks)
    distributed = time_distributed(args, taus, grid) if args.distributed else None
    scored = [r for r in grid.records if r.scored]
    huber = None
    if scored:
        weights = np.array([r.weight for r in scored])
        losses = weights @ np.stack([r.huber_loss for r in scored]) / weights.sum()
        huber = dict(zip(map(str, taus), losses.tolist(), strict=True))
    grid.close()

    med_grid = float(np.median(grid_samples))
    med_pf = float(np.median(single_pf))
    med_stream = float(np.median(single_stream))
    result = {
        "schema": SCHEMA,
        "environment": environment(),
        "parameters": {
            **vars(args),
            "taus": taus,
            "n_chunks": len(chunks),
            "single_stream_path": stream_path,
        },
        "generate_seconds": generate_seconds,
        "seconds": {
            "single_partial_fit": summarize(single_pf),
            "single_stream": summarize(single_stream),
            "grid": summarize(grid_samples),
            "grid_sequential": summarize(sequential_samples),
        },
        "raw_seconds": {
            "single_partial_fit": single_pf,
            "single_stream": single_stream,
            "grid": grid_samples,
            "grid_sequential": sequential_samples,
        },
        "grid_concurrent": grid.concurrent,
        "grid_concurrent_same_bits_as_sequential": concurrent_same_bits,
        "ratio_grid_to_single": {
            "partial_fit": med_grid / med_pf,
            "stream": med_grid / med_stream,
            "sequential_over_stream": float(np.median(sequential_samples)) / med_stream,
        },
        "rows_per_second": {
            "single_partial_fit": args.rows / med_pf,
            "single_stream": args.rows / med_stream,
            "grid": args.rows / med_grid,
            "grid_configuration_rows": len(taus) * args.rows / med_grid,
        },
        "prequential_huber_loss": huber,
        "coefficients_identical_to_single_fits": identical,
        "distributed": distributed,
    }
    path = write_json(args.output, result)
    print(
        f"{args.engine}: {args.rows} x {args.features} {args.dtype}, {len(chunks)} chunks; "
        f"single {med_pf:.3f} s (partial_fit) / {med_stream:.3f} s ({stream_path}), "
        f"grid of {len(taus)} {med_grid:.3f} s (concurrent {grid.concurrent}; one after the "
        f"other {float(np.median(sequential_samples)):.3f} s, same bits {concurrent_same_bits}): "
        f"ratio {med_grid / med_pf:.2f} / {med_grid / med_stream:.2f}; identical: {identical}; "
        f"wrote {path}"
    )
    if distributed is not None:
        print(
            f"distributed over {args.distributed} workers ({distributed['cluster']}): "
            f"{distributed['seconds']['median']:.3f} s, "
            f"{distributed['rows_per_second']:.3g} rows/s, busy "
            f"{[round(b, 2) for b in distributed['busy_fraction']]}, states identical: "
            f"{all(distributed['states_identical_to_in_process_grid'])}, prequential "
            f"identical: {distributed['prequential_identical_to_in_process_grid']}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
