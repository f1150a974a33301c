"""Speed of the NumPy reference engine on whole streams (CPU), per BLAS setting.

Times one full stream (empty state → last batch) through ``NumpyEngine``,
engine reused and reset outside the timer, for a few shapes, both dtypes and
both penalties; optionally the same stream through renewable-huber's NumPy
backend as an opponent (a new estimator per repeat, at the process's BLAS
threads). With ``--threads`` the engine runs once per ``blas_threads``
setting given (``auto`` and counts): the measurement behind the per-shape
rule of ``rh-dask.numpy.blas-threads``. Every repeat runs each contender
once, in orders where each follows each other one equally often (a Williams
design), each started once the BLAS threads the one before it woke have
stopped spinning (``ProcessIdle``: they would otherwise take the cores of
whichever contender comes next); a short case gets more repeats, until each
contender ran ``--min-seconds``. With
``--no-skip-too`` each setting also runs with the LAMM's information test
switched off (every trial takes its Z e): the same bits, so what the test
saves. Writes schema-versioned JSON with every timing, the medians behind
``auto``'s thread counts per batch class (``auto_thread_medians_seconds``) and
what each class's one calibration cost (``auto_calibration_seconds``; it falls
in the first, untimed round).

    python benchmarks/numpy_engine.py --repeats 5 --opponent --threads auto 1 2 \\
        --output benchmarks/results/numpy_engine.json
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np
from common import SHAPES, environment, fingerprint, summarize, write_json

from rh_dask import HuberConfig, NumpyEngine
from rh_dask.datasets import StreamSpec
from rh_dask.engines import numpy_engine as numpy_engine_module
from rh_dask.engines.blas_threads import ProcessIdle
from rh_dask.engines.row_blocks import thread_chooser

SCHEMA = "rh-dask/bench/numpy-engine/3"


def make_stream(rows: int, features: int, batch: int, dtype: str):
    spec = StreamSpec(n_features=features, seed=7)
    X, y = spec.chunk(0, rows, "float64")
    X, y = X.astype(dtype), y.astype(dtype)
    return [(X[s : s + batch], y[s : s + batch]) for s in range(0, rows, batch)], X, y


class RhDask:
    def __init__(
        self,
        config: HuberConfig,
        threads: int | str,
        skip: bool = True,
    ) -> None:
        self.engine = NumpyEngine(config, blas_threads=threads)
        self.skip = skip

    def run(self, batches):
        self.engine.reset()
        check = numpy_engine_module._fails_on_information
        if not self.skip:
            numpy_engine_module._fails_on_information = lambda trial, total: False
        try:
            its = [self.engine.partial_fit(X, y).iterations for X, y in batches]
        finally:
            numpy_engine_module._fails_on_information = check
        return its, self.engine.coefficients()


class Opponent:
    def __init__(self, config: HuberConfig) -> None:
        import renewable_huber

        self.kwargs = {"penalty": config.penalty, "dtype": config.dtype, "backend": "numpy"}
        self.cls = renewable_huber.RenewableHuberRegressor

    def run(self, batches):
        model = self.cls(**self.kwargs)
        its = []
        for X, y in batches:
            model.partial_fit(X, y)
            its.append(int(model.diagnostics_.iterations))
        return its, np.asarray(model.state_.coefficients)


def f64_solution(rows: int, features: int, batch: int, config: HuberConfig) -> np.ndarray:
    """The coefficients of the same stream in float64 (the float32 answers' yardstick)."""
    batches, _, _ = make_stream(rows, features, batch, "float64")
    engine = NumpyEngine(HuberConfig(penalty=config.penalty, dtype="float64"))
    for X, y in batches:
        engine.partial_fit(X, y)
    return engine.coefficients()


def balanced_orders(n: int) -> list[list[int]]:
    """Orders of ``n`` contenders in which each follows each other one equally often.

    A Williams design: row i is 0, 1, n−1, 2, n−2, ... shifted by i (mod n),
    and for odd n each row's reverse too. A plain rotation keeps every
    contender behind the same one (measured: whatever ran right after
    renewable-huber's OpenBLAS took 1.2-1.4x its time on the dev box's 2-core
    latency cases, though the process was idle again by then).
    """
    first, low, high = [0], 1, n - 1
    while len(first) < n:
        first.append(low)
        low += 1
        if len(first) < n:
            first.append(high)
            high -= 1
    rows = [[(c + i) % n for c in first] for i in range(n)]
    if n % 2:
        rows += [row[::-1] for row in rows]
    return rows


#: The most repeats a short case is given to reach ``--min-seconds``.
MAX_REPEATS = 101


def time_case(
    contenders: dict, batches, repeats: int, min_seconds: float = 0.0
) -> tuple[dict, dict]:
    """Median stream seconds per contender, over ``repeats`` rounds or more.

    Each round runs every contender once, in the orders of :func:`balanced_orders`.

    A case whose slowest contender's stream is short gets more rounds, so that
    each contender is timed for at least ``min_seconds`` (at most
    :data:`MAX_REPEATS` rounds): five samples of a 2 ms stream on a shared
    machine rank contenders by noise.
    """
    names = list(contenders)
    samples: dict[str, list[float]] = {name: [] for name in names}
    idle, settled = ProcessIdle(), []
    out: dict[str, dict] = {}
    warm: list[float] = []
    i = 0
    orders = balanced_orders(len(names))
    while i <= repeats:  # the first round warms caches, workspaces and choices
        for name in (names[c] for c in orders[i % len(orders)]):
            # Untimed: wait for the BLAS threads the last contender woke to stop spinning,
            # so that no contender is timed against the one before it.
            settled.append(idle.wait(baseline=0.0, max_seconds=1.0))
            start = time.perf_counter()
            its, coef = contenders[name].run(batches)
            elapsed = time.perf_counter() - start
            if i:
                samples[name].append(elapsed)
            else:
                warm.append(elapsed)
            out[name] = {"iterations": its, "coef": coef}
        if i == 0 and min_seconds > 0:
            repeats = max(repeats, min(MAX_REPEATS, math.ceil(min_seconds / max(warm))))
        i += 1
    result = {}
    for name in names:
        result[name] = {
            "stream_seconds": samples[name],
            **summarize(samples[name]),
            "iterations": out[name]["iterations"],
        }
    return result, {name: out[name]["coef"] for name in names}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--dtypes", nargs="+", default=["float64", "float32"])
    parser.add_argument("--penalties", nargs="+", default=["none", "l1"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--min-seconds",
        type=float,
        default=0.5,
        help="more repeats for short cases, until each contender ran this long",
    )
    parser.add_argument(
        "--threads", nargs="+", default=["auto"], help="blas_threads settings: auto or counts"
    )
    parser.add_argument("--opponent", action="store_true", help="also time renewable-huber")
    parser.add_argument(
        "--no-skip-too",
        action="store_true",
        help="also run each setting without the LAMM's information test",
    )
    parser.add_argument("--output", default="benchmarks/results/numpy_engine.json")
    args = parser.parse_args(argv)
    settings = [t if t == "auto" else int(t) for t in args.threads]

    cases = []
    for shape in args.shapes:
        rows, features, batch = SHAPES[shape]
        for dtype in args.dtypes:
            batches, X, y = make_stream(rows, features, batch, dtype)
            for penalty in args.penalties:
                config = HuberConfig(penalty=penalty, dtype=dtype)
                contenders = {f"rh_dask_numpy[{t}]": RhDask(config, t) for t in settings}
                if args.no_skip_too and penalty == "l1":
                    for t in settings:
                        contenders[f"rh_dask_numpy[{t},no-skip]"] = RhDask(config, t, skip=False)
                if args.opponent:
                    contenders["renewable_huber_numpy"] = Opponent(config)
                results, coefs = time_case(contenders, batches, args.repeats, args.min_seconds)
                if dtype == "float32":
                    # How far each float32 answer lies from the float64 stream's, in units
                    # of the contract's float32 tolerance (<= 1: within it).
                    exact = f64_solution(rows, features, batch, config)
                    for name, coef in coefs.items():
                        bound = 3e-5 + 3e-4 * np.abs(exact)
                        results[name]["float64_error_in_tolerances"] = float(
                            np.max(np.abs(np.asarray(coef, np.float64) - exact) / bound)
                        )
                ours = f"rh_dask_numpy[{settings[0]}]"
                if args.opponent:
                    diff = np.max(np.abs(coefs["renewable_huber_numpy"] - coefs[ours]))
                    results["renewable_huber_numpy"]["max_abs_coef_diff"] = float(diff)
                case = {
                    "shape": shape,
                    "rows": rows,
                    "features": features,
                    "batch_rows": batch,
                    "batches": len(batches),
                    "dtype": dtype,
                    "penalty": penalty,
                    "dataset_sha256": fingerprint(X, y),
                    "results": results,
                }
                cases.append(case)
                line = f"{shape:9s} {dtype} {penalty:4s}"
                for name, res in results.items():
                    line += f" {name}={res['median'] * 1e3:.1f}ms"
                    if "float64_error_in_tolerances" in res:
                        line += f" (f64 error {res['float64_error_in_tolerances']:.2g} tol)"
                print(line, flush=True)
    medians = {
        str(key): {str(count): seconds for count, seconds in per_count.items()}
        for key, per_count in thread_chooser().medians().items()
    }
    payload = {
        "schema": SCHEMA,
        "environment": environment(),
        "settings": {
            "repeats": args.repeats,
            "min_seconds": args.min_seconds,
            "threads": settings,
            "opponent": args.opponent,
            "no_skip_too": args.no_skip_too,
        },
        "auto_thread_medians_seconds": medians,
        # What each batch class's one calibration cost beyond the batch's own commit.
        "auto_calibration_seconds": {
            str(key): seconds for key, seconds in thread_chooser().calibration_seconds().items()
        },
        "cases": cases,
    }
    write_json(args.output, payload)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
