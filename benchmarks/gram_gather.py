"""When the NumPy engine's Gram should drop the rows with κ = 0 before its SYRK.

The weighted Gram Zᵀ diag(wκ) Z is one SYRK of √(wκ) ⊙ Z. Rows beyond τ + h
have κ = 0 and add nothing: gathering the others first costs a pass over Z
and saves p² multiply-adds per dropped row. This times, at one BLAS thread,
for several p and shares of dropped rows (about 2 M elements of Z each):

* ``full``: scale every row, SYRK over all of them;
* ``gather``: the engine's way, the kept rows gathered and scaled in row
  blocks of ``GATHER_BLOCK_BYTES``, SYRK over those;
* ``compress``: ``np.compress`` of Z and of the weights, then the scaling
  (the engine's earlier way).

The product (dropped share) × p at which ``gather`` and ``full`` are level is
what ``GATHER_MIN_SAVING`` in ``rh_dask/engines/numpy_engine.py`` reads.

    python benchmarks/gram_gather.py --output benchmarks/results/gram_gather-devbox.json
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from common import environment, summarize, write_json
from threadpoolctl import threadpool_limits

from rh_dask.engines.numpy_engine import (
    GATHER_BLOCK_BYTES,
    GATHER_MIN_SAVING,
    gather_scaled_rows,
)

SCHEMA = "rh-dask/bench/gram-gather/1"


def ways(Z: np.ndarray, k: np.ndarray) -> dict:
    n = Z.shape[0]
    active = k > 0
    rows = int(active.sum())
    scaled = np.empty_like(Z)
    spare = np.empty(n, Z.dtype)

    def full():
        np.multiply(Z, k[:, None], out=scaled)
        return scaled.T @ scaled

    def gather():
        keep = np.flatnonzero(active)
        weights = np.take(k, keep, out=spare[:rows])
        out = gather_scaled_rows(Z, keep, weights, scaled[:rows])
        return out.T @ out

    def compress():
        out = scaled[:rows]
        np.compress(active, Z, axis=0, out=out)
        out *= np.compress(active, k, out=spare[:rows])[:, None]
        return out.T @ out

    return {"full": full, "gather": gather, "compress": compress}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ps", type=int, nargs="+", default=[9, 17, 33, 49, 65, 91, 129, 257])
    parser.add_argument("--dropped", type=float, nargs="+", default=[0.2, 0.35, 0.5])
    parser.add_argument("--dtypes", nargs="+", default=["float64", "float32"])
    parser.add_argument("--elements", type=int, default=1 << 21, help="n × p per case")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--output", default="benchmarks/results/gram_gather.json")
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    cases = []
    with threadpool_limits(1, user_api="blas"):
        for p in args.ps:
            n = max(4096, args.elements // p)
            for dtype in args.dtypes:
                for dropped in args.dropped:
                    Z = rng.standard_normal((n, p)).astype(dtype)
                    k = rng.random(n).astype(dtype)
                    k[rng.random(n) < dropped] = 0
                    fns = ways(Z, k)
                    samples: dict[str, list[float]] = {name: [] for name in fns}
                    names = list(fns)
                    for i in range(args.repeats + 1):  # the first round warms up
                        for name in names[i % 3 :] + names[: i % 3]:
                            start = time.perf_counter()
                            fns[name]()
                            if i:
                                samples[name].append(time.perf_counter() - start)
                    timings = {name: summarize(s) for name, s in samples.items()}
                    share = float(np.mean(k == 0))
                    ratio = timings["gather"]["median"] / timings["full"]["median"]
                    engine_gathers = (n - int(np.count_nonzero(k))) * p >= GATHER_MIN_SAVING * n
                    cases.append(
                        {
                            "p": p,
                            "rows": n,
                            "dtype": dtype,
                            "dropped_share": share,
                            "dropped_share_times_p": share * p,
                            "timings": {
                                name: {**t, "samples": samples[name]}
                                for name, t in timings.items()
                            },
                            "gather_over_full": ratio,
                            "engine_gathers": engine_gathers,
                        }
                    )
                    way = "gathers" if engine_gathers else "full"
                    print(
                        f"p={p:3d} {dtype} dropped {share:.2f} (×p {share * p:5.1f}) "
                        + " ".join(f"{k}={v['median'] * 1e3:.2f}ms" for k, v in timings.items())
                        + f" gather/full {ratio:.2f} engine {way}",
                        flush=True,
                    )
    payload = {
        "schema": SCHEMA,
        "environment": environment(),
        "settings": {
            "repeats": args.repeats,
            "elements": args.elements,
            "blas_threads": 1,
            "gather_min_saving": GATHER_MIN_SAVING,
            "gather_block_bytes": GATHER_BLOCK_BYTES,
        },
        "cases": cases,
    }
    write_json(args.output, payload)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
