"""The client-driven fit against the detached fit of the same stream, on one LocalCluster.

The stream is generated on the workers (``dask.array`` random chunks and
``y = Xβ + t₃ noise`` built from them), so that neither mode ships data
from this process: the two differ only in where the walk is coordinated.

* ``client``: ``RenewableHuberRegressor(...).fit(X, y)`` from this process
  (the coordinator polls the engine's actor from here);
* ``detached``: ``submit_fit(model, X, y).result()``, the same fit
  coordinated by a seceded task on a worker, its fitted model sent back,
  then ``forget()``.

The two modes alternate within every repeat (which one goes first alternates
too), after one warm-up fit of each; the median of ``--repeats`` wall times is
reported for each, with every raw time, their ratio (detached / client) and
whether every detached fit's coefficients equal the client fit's bit for
bit. ``--small-chunks`` chunks of the same size are timed the same way: the
fixed cost a fit pays whatever its length.

    python benchmarks/detached.py --rows 2000000 --features 20 --chunks 64 \\
        --output benchmarks/results/detached-cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import dask.array as da
import numpy as np
from common import environment, summarize, write_json

from rh_dask import RenewableHuberRegressor
from rh_dask.distributed import submit_fit

SCHEMA = "rh-dask/bench/detached/1"


def stream(rows: int, features: int, chunks: int, seed: int) -> tuple[da.Array, da.Array]:
    """X and y as lazy Dask arrays of ``chunks`` row chunks, computed where they load."""
    chunk_rows = -(-rows // chunks)
    rng = da.random.default_rng(seed)
    X = rng.standard_normal((rows, features), chunks=(chunk_rows, features))
    beta = np.random.default_rng(seed + 1).normal(size=features)
    noise = rng.standard_t(3, size=rows, chunks=chunk_rows)
    return X, X @ beta + 0.5 + noise


def fit_client(params: dict[str, Any], X: da.Array, y: da.Array) -> tuple[float, Any]:
    start = time.perf_counter()
    model = RenewableHuberRegressor(**params).fit(X, y)
    return time.perf_counter() - start, model


def fit_detached(
    params: dict[str, Any], X: da.Array, y: da.Array, client: Any
) -> tuple[float, Any]:
    start = time.perf_counter()
    fit = submit_fit(RenewableHuberRegressor(**params), X, y, client=client)
    model = fit.result()
    seconds = time.perf_counter() - start
    fit.forget()
    return seconds, model


def same(a: Any, b: Any) -> bool:
    return bool(
        np.array_equal(a.coef_, b.coef_)
        and a.intercept_ == b.intercept_
        and np.array_equal(a.state_.information, b.state_.information)
    )


def measure(
    client: Any, params: dict[str, Any], X: da.Array, y: da.Array, repeats: int
) -> dict[str, Any]:
    """Alternating timed fits of both modes; medians, raw times, ratio, equality."""
    _, reference = fit_client(params, X, y)  # warm-up of each mode, not timed
    fit_detached(params, X, y, client)
    times: dict[str, list[float]] = {"client": [], "detached": []}
    equal = True
    for r in range(repeats):
        for mode in ("client", "detached") if r % 2 == 0 else ("detached", "client"):
            if mode == "client":
                seconds, model = fit_client(params, X, y)
            else:
                seconds, model = fit_detached(params, X, y, client)
            times[mode].append(seconds)
            equal = equal and same(model, reference)
    out: dict[str, Any] = {mode: summarize(t) | {"seconds": t} for mode, t in times.items()}
    out["ratio_detached_to_client"] = out["detached"]["median"] / out["client"]["median"]
    out["coefficients_equal"] = equal
    out["placement"] = reference.placement_
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=2_000_000)
    p.add_argument("--features", type=int, default=20)
    p.add_argument("--chunks", type=int, default=64)
    p.add_argument("--small-chunks", type=int, default=2, help="chunks of the fixed-cost fit")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--threads", type=int, default=None, help="threads per worker")
    p.add_argument("--engine", default="numpy")
    p.add_argument("--lookahead", type=int, default=8)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default="benchmarks/results/detached.json")
    args = p.parse_args(argv)

    from distributed import Client, LocalCluster

    threads = args.threads or max(1, (os.cpu_count() or 2) // args.workers)
    params = {"engine": args.engine, "lookahead": args.lookahead, "progress": False}
    payload: dict[str, Any] = {
        "schema": SCHEMA,
        "environment": environment(),
        "arguments": vars(args),
        "cluster": {"workers": args.workers, "threads_per_worker": threads, "processes": True},
        "load_average_before": os.getloadavg(),
    }
    chunk_rows = -(-args.rows // args.chunks)
    with (
        LocalCluster(
            n_workers=args.workers,
            threads_per_worker=threads,
            processes=True,
            dashboard_address=":0",
        ) as cluster,
        Client(cluster, direct_to_workers=True) as client,
    ):
        client.wait_for_workers(args.workers)
        X, y = stream(args.rows, args.features, args.chunks, args.seed)
        Xs, ys = stream(
            chunk_rows * args.small_chunks, args.features, args.small_chunks, args.seed
        )
        payload["dataset"] = {
            "rows": args.rows,
            "features": args.features,
            "chunks": args.chunks,
            "chunk_rows": chunk_rows,
            "dtype": "float64",
            "source": "dask.array.random on the workers",
        }
        payload["results"] = {
            "full": measure(client, params, X, y, args.repeats),
            "small": measure(client, params, Xs, ys, args.repeats),
        }
    payload["load_average_after"] = os.getloadavg()
    write_json(args.output, payload)
    summary = {
        k: {m: v[m]["median"] for m in ("client", "detached")}
        | {"ratio": v["ratio_detached_to_client"]}
        for k, v in payload["results"].items()
    }
    print(json.dumps(summary, indent=1), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
