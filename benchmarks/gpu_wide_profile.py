"""Where a Newton iteration's time goes on wide designs (p = 512-2048), on the GPU engine.

For each width d (features; p = d + 1 parameters with the intercept), dtype
and a stream of 4 batches of max(4d, 8192) rows (CuPy input), this times:

* ``ops``: every kernel launch and library call of one Newton iteration, as
  the engine queues them (its own launch list, run eagerly with graphs off),
  each between two CUDA events on the engine's stream; the control block's
  flags are reset before each repeat so that every gated kernel does its
  work. ``commit_ops`` the same for the commit (the solve marked done).
* ``score_variance``: the K update of a committed batch.
* ``gemm``: the Gram + gradient GEMM alone (2·n·p·(p+1) FLOP) and
  ``potrf``/``potrs`` alone (p³/3 and 2p² FLOP), with FLOP/s against the
  device's measured dense peak (a square ``cupy.matmul`` in the same dtype)
  and the H200's nominal figures.
* ``stream``: the whole stream from an empty state with graphs on (the
  engine's default, device loop where the driver has it), graphs off, and
  graphs on without K; iterations per batch.

All device times are medians of the repeats, in milliseconds; every raw
sample is kept. Runs in well under two minutes on an H200:

    python benchmarks/gpu_wide_profile.py --output benchmarks/results/gpu_wide_profile.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from common import environment, fingerprint, write_json

from rh_dask import HuberConfig
from rh_dask.datasets import StreamSpec

SCHEMA = "rh-dask/bench/gpu-wide-profile/1"

#: NVIDIA's H200 SXM figures (dense, TFLOP/s): what the measured peak is read against.
NOMINAL_H200_TFLOPS = {
    "float64_vector": 34.0,
    "float64_tensor_core": 67.0,
    "float32_vector": 67.0,
}

WIDTHS = (512, 1024, 2048)


def batch_rows(d: int) -> int:
    """The issue's batch size for width d: max(4d, 8192) rows."""
    return max(4 * d, 8192)


def make_batches(d: int, dtype: str, batches: int = 4) -> tuple[list[tuple[Any, Any]], str]:
    """The stream as CuPy arrays (the sweep's data: StreamSpec, seed 7) and its fingerprint."""
    import cupy as cp

    rows = batch_rows(d)
    X, y = StreamSpec(n_features=d, seed=7).chunk(0, rows * batches, "float64")
    X, y = np.ascontiguousarray(X, dtype=dtype), np.ascontiguousarray(y, dtype=dtype)
    digest = fingerprint(X, y)
    out = [
        (cp.asarray(X[i * rows : (i + 1) * rows]), cp.asarray(y[i * rows : (i + 1) * rows]))
        for i in range(batches)
    ]
    return out, digest


def _median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1e3


class EventLog:
    """CUDA events around every launch and library call an engine queues (graphs off)."""

    def __init__(self, cp: Any, engine: Any) -> None:
        self._cp = cp
        parts = engine._newton._parts
        self.parts = parts
        self.stream = parts.stream
        self.records: list[tuple[str, Any, Any]] = []
        launcher, dense = parts.launcher, parts.dense
        launch, gemm, chol = launcher.launch, dense.gram_and_gradient, dense.cholesky_solve

        def timed_launch(key, name, *args, **kwargs):
            label = name if key[0] != "wide_symv" else f"{name}[{key[1]}]"
            self._around(label, lambda: launch(key, name, *args, **kwargs))

        launcher.launch = timed_launch
        dense.gram_and_gradient = lambda *a: self._around(
            "gemm (Gram + gradient)", lambda: gemm(*a)
        )
        dense.cholesky_solve = lambda *a: self._around("potrf + potrs", lambda: chol(*a))

    def close(self) -> None:
        """Put the engine's own launch and library calls back."""
        del self.parts.launcher.launch
        del self.parts.dense.gram_and_gradient
        del self.parts.dense.cholesky_solve

    def _around(self, label: str, call: Callable[[], None]) -> None:
        start, stop = self._cp.cuda.Event(), self._cp.cuda.Event()
        start.record(self.stream)
        call()
        stop.record(self.stream)
        self.records.append((label, start, stop))

    def collect(self) -> list[tuple[str, float]]:
        self.stream.synchronize()
        out = [(lab, self._cp.cuda.get_elapsed_time(a, b)) for lab, a, b in self.records]
        self.records.clear()
        return out


def set_flags(cp: Any, ws: Any, **values: int) -> None:
    """Write int32 fields of the device control block (on the engine's stream)."""
    from gpu_engine import layout

    ints = ws.ctl.view(cp.int32)
    base = layout.N_DOUBLE * 2
    for name, value in values.items():
        ints[base + getattr(layout, f"I_{name}")] = value


def profile_ops(cp: Any, engine: Any, n: int, repeats: int) -> dict[str, Any]:
    """Per-op device time of one iteration and of the commit (engine already holds a batch)."""
    from gpu_engine.commit import commit_finish

    log = EventLog(cp, engine)
    ws, newton = log.parts.ws, engine._newton
    open_flags = {"DONE": 0, "COMMITTED": 0, "ITER": 0, "FALLBACK": 0, "TICKET": 0}

    def run(body: Callable[[], None], flags: dict[str, int]) -> dict[str, list[float]]:
        samples: dict[str, list[float]] = {}
        for i in range(repeats + 1):
            with log.stream:
                set_flags(cp, ws, **flags)
            body()
            ops = log.collect()
            if i == 0:
                continue  # warm-up
            seen: dict[str, int] = {}
            for label, ms in ops:
                seen[label] = seen.get(label, 0) + 1
                key = label if seen[label] == 1 else f"{label} #{seen[label]}"
                samples.setdefault(key, []).append(ms)
        return samples

    def summary(samples: dict[str, list[float]]) -> dict[str, Any]:
        ops = {k: {"median_ms": statistics.median(v), "samples_ms": v} for k, v in samples.items()}
        total = sum(o["median_ms"] for o in ops.values())
        for o in ops.values():
            o["share"] = o["median_ms"] / total if total else None
        return {"ops": ops, "sum_of_medians_ms": total}

    with log.stream:
        step = run(lambda: newton._step(n), open_flags)
        commit = run(
            lambda: commit_finish(log.parts.launcher, ws),
            {**open_flags, "DONE": 1},
        )
    log.close()
    return {"iteration": summary(step), "commit": summary(commit)}


def time_device(cp: Any, stream: Any, call: Callable[[], None], repeats: int) -> list[float]:
    """Device milliseconds of ``call`` per repeat (after one warm-up), CUDA events."""
    out = []
    for i in range(repeats + 1):
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        start.record(stream)
        call()
        stop.record(stream)
        stop.synchronize()
        if i:
            out.append(cp.cuda.get_elapsed_time(start, stop))
    return out


def profile_dense(cp: Any, engine: Any, n: int, repeats: int) -> dict[str, Any]:
    """The GEMM, potrf and potrs alone on the engine's buffers, with their FLOP rates."""
    from cupy_backends.cuda.libs import cublas

    from gpu_engine import layout

    parts = engine._newton._parts
    ws, dense, stream = parts.ws, parts.dense, parts.stream
    p = ws.p
    lower = cublas.CUBLAS_FILL_MODE_LOWER
    with stream:
        gemm = time_device(
            cp,
            stream,
            lambda: dense.gram_and_gradient(ws.Z, ws.ldz, ws.M, ws.ldm, ws.C, n, p),
            repeats,
        )

        def potrf():
            dense._potrf(
                dense.lapack,
                lower,
                p,
                ws.H.data.ptr,
                p,
                dense._work.data.ptr,
                dense._lwork,
                ws.int_ptr(layout.I_INFO),
            )

        potrf_ms = []
        for i in range(repeats + 1):
            ws.H[...] = ws.Hs  # the assembled matrix, factorised in place
            start, stop = cp.cuda.Event(), cp.cuda.Event()
            start.record(stream)
            potrf()
            stop.record(stream)
            stop.synchronize()
            if i:
                potrf_ms.append(cp.cuda.get_elapsed_time(start, stop))
        info = int(ws.ctl.view(cp.int32)[layout.N_DOUBLE * 2 + layout.I_INFO].get())

        def potrs():
            dense._potrs(
                dense.lapack,
                lower,
                p,
                1,
                ws.H.data.ptr,
                p,
                ws.D.data.ptr,
                p,
                ws.int_ptr(layout.I_INFO_SOLVE),
            )

        potrs_ms = time_device(cp, stream, potrs, repeats)
    gemm_flop = 2.0 * n * p * (p + 1)
    potrf_flop = p**3 / 3.0
    potrs_flop = 2.0 * p * p

    def rate(flop: float, samples: list[float]) -> dict[str, Any]:
        ms = statistics.median(samples)
        return {"median_ms": ms, "samples_ms": samples, "flop": flop, "tflops": flop / ms / 1e9}

    return {
        "gemm": {**rate(gemm_flop, gemm), "m": p, "n": p + 1, "k": n},
        "potrf": {**rate(potrf_flop, potrf_ms), "info": info},
        "potrs": rate(potrs_flop, potrs_ms),
    }


def profile_score_variance(cp: Any, engine: Any, n: int, repeats: int) -> dict[str, Any]:
    """The commit's K update (residuals at β, then K += SᵀS)."""
    from gpu_engine.diagnostics import add_score_gram

    parts = engine._newton._parts
    ws, stream = parts.ws, parts.stream

    def body():
        add_score_gram(parts.launcher, parts.dense, parts.kernels, ws, n)

    with stream:
        samples = time_device(cp, stream, body, repeats)
    return {"median_ms": statistics.median(samples), "samples_ms": samples}


def measured_peak(cp: Any, dtype: str, size: int = 8192, repeats: int = 3) -> dict[str, Any]:
    """TFLOP/s of a square cupy.matmul (``size``³, IEEE: CuPy's default, no TF32)."""
    a = cp.random.default_rng(0).standard_normal((size, size), dtype=cp.float64).astype(dtype)
    pair = [a, a.T.copy()]
    stream = cp.cuda.get_current_stream()
    samples = time_device(cp, stream, lambda: cp.matmul(pair[0], pair[1]), repeats)
    pair.clear()
    a = None
    cp.get_default_memory_pool().free_all_blocks()
    ms = min(samples)
    return {"size": size, "samples_ms": samples, "tflops": 2.0 * size**3 / ms / 1e9}


def time_stream(
    cp: Any, engine: Any, batches: list[tuple[Any, Any]], repeats: int
) -> dict[str, Any]:
    """Wall time of the whole stream from an empty state (ends with a device sync)."""
    samples, its = [], []
    for i in range(repeats + 1):
        engine.reset()
        cp.cuda.Device().synchronize()
        start = time.perf_counter()
        its = [engine.partial_fit(X, y).iterations for X, y in batches]
        cp.cuda.Device().synchronize()
        if i:
            samples.append(time.perf_counter() - start)
    return {
        "median_ms": _median_ms(samples),
        "samples_ms": [s * 1e3 for s in samples],
        "iterations_per_batch": its,
        "graphs": engine.graphs,
        "graph_error": engine.graph_error,
        "device_loop": getattr(engine._newton, "device_loop", None),
    }


def profile_case(
    cp: Any, d: int, dtype: str, repeats: int, wide_kernels: bool = True
) -> dict[str, Any]:
    from gpu_engine import GpuEngine, layout

    batches, digest = make_batches(d, dtype)
    n = int(batches[0][0].shape[0])
    config = HuberConfig(dtype=dtype)
    case: dict[str, Any] = {
        "features": d,
        "parameters": d + 1,
        "batch_rows": n,
        "batches": len(batches),
        "dtype": dtype,
        "penalty": "none",
        "dataset_sha256": digest,
        "wide_kernels": wide_kernels and d + 1 >= layout.WIDE_MIN_P,
    }
    eager = GpuEngine(config, graphs=False, wide_kernels=wide_kernels)
    case["stream_eager"] = time_stream(cp, eager, batches, repeats)
    # the engine now holds the last batch and its state: profile an iteration there
    case["per_iteration"] = profile_ops(cp, eager, n, repeats)
    case["dense"] = profile_dense(cp, eager, n, repeats)
    case["score_variance"] = profile_score_variance(cp, eager, n, repeats)
    eager.close()
    engine = GpuEngine(config, wide_kernels=wide_kernels)
    case["stream_graphs"] = time_stream(cp, engine, batches, repeats)
    engine.close()
    no_k = GpuEngine(config, score_variance=False, wide_kernels=wide_kernels)
    case["stream_graphs_no_k"] = time_stream(cp, no_k, batches, repeats)
    no_k.close()
    del batches
    cp.get_default_memory_pool().free_all_blocks()
    return case


def derive(case: dict[str, Any], peak: dict[str, Any]) -> dict[str, Any]:
    """Fractions of the measured and nominal peaks; the iteration against GEMM + potrf."""
    dense = case["dense"]
    it = case["per_iteration"]["iteration"]
    its = sum(case["stream_graphs"]["iterations_per_batch"])
    floor_ms = dense["gemm"]["median_ms"] + dense["potrf"]["median_ms"]
    nominal = (
        NOMINAL_H200_TFLOPS["float64_tensor_core"]
        if case["dtype"] == "float64"
        else NOMINAL_H200_TFLOPS["float32_vector"]
    )
    return {
        "gemm_fraction_of_measured_peak": dense["gemm"]["tflops"] / peak["tflops"],
        "potrf_fraction_of_measured_peak": dense["potrf"]["tflops"] / peak["tflops"],
        "gemm_fraction_of_nominal_peak": dense["gemm"]["tflops"] / nominal,
        "potrf_fraction_of_nominal_peak": dense["potrf"]["tflops"] / nominal,
        "nominal_peak_tflops": nominal,
        "iteration_sum_of_ops_ms": it["sum_of_medians_ms"],
        "gemm_plus_potrf_ms": floor_ms,
        "iteration_over_gemm_plus_potrf": it["sum_of_medians_ms"] / floor_ms,
        "stream_ms_per_iteration_graphs": case["stream_graphs"]["median_ms"] / its
        if its
        else None,
        "top_ops": sorted(
            ((k, v["median_ms"]) for k, v in it["ops"].items()), key=lambda kv: -kv[1]
        )[:5],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", nargs="+", type=int, default=list(WIDTHS))
    parser.add_argument("--dtypes", nargs="+", default=["float64", "float32"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--no-wide-kernels",
        dest="wide_kernels",
        action="store_false",
        help="profile the one-block p-space kernels (GpuEngine(wide_kernels=False), the default)",
    )
    parser.add_argument("--output", default="benchmarks/results/gpu_wide_profile.json")
    args = parser.parse_args(argv)

    import cupy as cp

    started = time.perf_counter()
    peaks = {dtype: measured_peak(cp, dtype) for dtype in args.dtypes}
    cases = []
    for dtype in args.dtypes:
        for d in args.widths:
            case = profile_case(cp, d, dtype, args.repeats, args.wide_kernels)
            case["derived"] = derive(case, peaks[dtype])
            cases.append(case)
            dv = case["derived"]
            print(
                f"d={d} {dtype}: stream {case['stream_graphs']['median_ms']:.1f} ms "
                f"(eager {case['stream_eager']['median_ms']:.1f}, no K "
                f"{case['stream_graphs_no_k']['median_ms']:.1f}), its "
                f"{case['stream_graphs']['iterations_per_batch']}, iteration ops "
                f"{dv['iteration_sum_of_ops_ms']:.2f} ms vs GEMM+potrf "
                f"{dv['gemm_plus_potrf_ms']:.2f} ms; GEMM {case['dense']['gemm']['tflops']:.1f} "
                f"TFLOP/s ({dv['gemm_fraction_of_measured_peak']:.0%} of measured peak), "
                f"potrf {case['dense']['potrf']['tflops']:.2f} TFLOP/s; top {dv['top_ops'][:3]}",
                flush=True,
            )
            write_json(args.output, _payload(args, peaks, cases, started, complete=False))
    write_json(args.output, _payload(args, peaks, cases, started, complete=True))
    print(f"wrote {args.output} in {time.perf_counter() - started:.0f} s")
    return 0


def _payload(args, peaks, cases, started, complete):
    return {
        "schema": SCHEMA,
        "complete": complete,
        "environment": environment(),
        "settings": {
            "widths": args.widths,
            "dtypes": args.dtypes,
            "repeats": args.repeats,
            "batch_rows": "max(4 d, 8192)",
            "batches": 4,
            "input": "cupy",
            "nominal_h200_tflops": NOMINAL_H200_TFLOPS,
        },
        "measured_peak": peaks,
        "elapsed_seconds": time.perf_counter() - started,
        "cases": cases,
    }


if __name__ == "__main__":
    raise SystemExit(main())
