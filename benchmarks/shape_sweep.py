"""Shape sweep: rh-dask's engines against renewable-huber 0.7.1, per stream and per batch.

For each shape (latency, reference, wide, streaming) × dtype × penalty, one
whole stream (empty state → last batch) is timed through:

* ``rh_numpy``        rh-dask NumPy engine
* ``rh_gpu_device``   rh-dask GPU engine, CuPy input already on the device
* ``rh_gpu_eager``    the same without CUDA graphs (do graphs pay?)
* ``rh_gpu_blocked``  the same with ``cholesky="blocked"`` (the one-block blocked factorisation;
                      unpenalised only)
* ``rh_gpu_columns``  the same with ``cholesky="columns"`` (the factor's columns in registers,
                      p ≤ 128; unpenalised only)
* ``rh_gpu_tiles``    the same with ``cholesky="tiles"`` (32-column tiles factored in one warp's
                      registers; unpenalised only)
* ``rh_gpu_hostloop`` the same with the Newton iterations driven by the host, one
                      synchronisation per iteration (``device_loop="off"``; unpenalised
                      only: does the device loop pay? It differs from ``rh_gpu_device`` only
                      when ``--gpu-option device_loop=auto`` turns the loop on there)
* ``rh_gpu_cusolver`` / ``rh_gpu_kernel`` the same with the Newton system forced
                      through cuSOLVER potrf/potrs or through the fused one-block
                      Cholesky kernel (unpenalised only: which pays where?)
* ``rh_gpu_host``     GPU engine, NumPy input fed back to back (``partial_fit_stream``:
                      the copy of batch i+1 overlaps the solve of batch i)
* ``rh_gpu_host_serial`` GPU engine, NumPy input, plain ``partial_fit`` loop (no overlap)
* ``rh_gpu_pinned``   GPU engine, NumPy input already in pinned memory, back to back
* ``rh_numpy_opp``    renewable-huber ``backend="numpy"``
* ``rh_cupy_opp_host`` / ``rh_cupy_opp_device`` renewable-huber ``backend="cupy"``
* ``rh_auto``         rh-dask ``engine="auto"``, fresh estimator per stream (cold lifecycle
                      only): the engine it chose, its calibration's cost (paid once per process,
                      in the warm-up run) and its time against the faster of ``rh_numpy`` and
                      ``rh_gpu_host`` cold; then ``--auto-pairs`` rounds of one cold stream
                      each of auto and those engines back to back, each order in turn
                      (``paired``: the same ratio without the drift between blocks)

``--gpu-option NAME=VALUE`` passes a ``GpuEngine`` keyword to every steady GPU mode (e.g.
``device_loop=auto``, ``wide_kernels=true``: options that are off by default).

Lifecycles: ``steady`` (engine or estimator warm, state reset outside the
timer) and ``cold`` (a new estimator created inside the timer, fed by a plain
``partial_fit`` loop and dropped inside it, so its engine's start-up and
close are both timed; first compilation is excluded by a warm-up in the same
process, as a long-running service would see it). The cold ``rh_gpu_device``
loop converts each batch with ``cupy.asarray`` inside the timer, the cold
``rh_gpu_host`` loop passes the NumPy batch; their ratio is the issue's
"host cold" target (at most 1.5). GPU timings end with a device
synchronisation.

    python benchmarks/shape_sweep.py --engines rh_gpu_device rh_gpu_host --cold \
        --shapes reference streaming --output cold.json

Every raw timing is kept; summaries give the median and the minimum. Slow
CPU-bound opponents may get fewer repeats within ``--cpu-budget`` seconds per
case; the JSON records how many each one got.

    python benchmarks/shape_sweep.py --quick --output benchmarks/results/shape_sweep.json
    python benchmarks/shape_sweep.py --markdown benchmarks/results/shape_sweep.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from common import SHAPES, WIDE_SHAPES, environment, fingerprint, summarize, write_json

from rh_dask import HuberConfig, NumpyEngine, RenewableHuberRegressor
from rh_dask.datasets import StreamSpec

SCHEMA = "rh-dask/bench/shape-sweep/1"

#: Every shape the sweep knows: issue 3's four (the default) and issue 16's wide designs.
ALL_SHAPES = {**SHAPES, **WIDE_SHAPES}


#: Competitor's native CUDA engine (v0.6.1), H200 medians per whole stream from an
#: empty state, unpenalised, device input, ms (from the issue; it cannot run here).
NATIVE_CUDA_MS = {
    ("latency", "float32"): 1.76,
    ("latency", "float64"): 1.94,
    ("reference", "float32"): 6.10,
    ("reference", "float64"): 6.67,
    ("wide", "float32"): 15.5,
    ("wide", "float64"): 10.3,
    ("streaming", "float32"): 13.3,
    ("streaming", "float64"): 11.3,
}

#: Device-to-device copy bandwidth measured on the H200 (bytes read + written per s).
COPY_BANDWIDTH = 4.2e12


def make_stream(shape: str, dtype: str) -> tuple[list[tuple[np.ndarray, np.ndarray]], str]:
    rows, features, batch = ALL_SHAPES[shape]
    X, y = StreamSpec(n_features=features, seed=7).chunk(0, rows, "float64")
    X, y = np.ascontiguousarray(X, dtype=dtype), np.ascontiguousarray(y, dtype=dtype)
    batches = [(X[s : s + batch], y[s : s + batch]) for s in range(0, rows, batch)]
    return batches, fingerprint(X, y)


def _sync() -> None:
    try:
        import cupy

        cupy.cuda.Device().synchronize()
    except ImportError:
        pass


class Runner:
    """Times one stream repeatedly: warm-up runs, then samples, within a budget."""

    def __init__(self, repeats: int, warmup: int, budget: float | None) -> None:
        self.repeats = repeats
        self.warmup = warmup
        self.budget = budget

    def __call__(
        self, setup: Callable[[], Any], run: Callable[[Any], list[int]]
    ) -> dict[str, Any]:
        samples: list[float] = []
        iterations: list[int] = []
        first = None
        spent = 0.0
        for i in range(self.warmup + self.repeats):
            ctx = setup()
            _sync()
            start = time.perf_counter()
            its = run(ctx)
            _sync()
            elapsed = time.perf_counter() - start
            spent += elapsed
            if i == 0:
                first = elapsed
            if i >= self.warmup:
                samples.append(elapsed)
                iterations = its
            if self.budget is not None and spent > self.budget and len(samples) >= 1:
                break
        out = summarize(samples)
        out["stream_seconds"] = samples
        out["first_run_seconds"] = first
        out["warmup_runs"] = min(self.warmup, len(samples) + self.warmup)
        out["iterations_per_batch"] = iterations
        return out


# -- engine runners -------------------------------------------------------------------------


def rh_numpy_steady(config, batches, runner):
    engine = NumpyEngine(config)

    def setup():
        engine.reset()
        return engine

    def run(e):
        return [e.partial_fit(X, y).iterations for X, y in batches]

    return runner(setup, run)


def fit_fresh(engine, params, batches, to_input=None):
    """A fresh estimator's plain ``partial_fit`` loop: the model and each batch's iterations."""
    model = RenewableHuberRegressor(engine=engine, **params)
    its = []
    for X, y in batches:
        if to_input is not None:
            X, y = to_input(X, y)
        model.partial_fit(X, y)
        its.append(model.n_iter_)
    return model, its


def rh_estimator_cold(config, batches, runner, engine, to_input=None):
    params = config.to_dict()

    def setup():
        return None

    def run(_):
        return fit_fresh(engine, params, batches, to_input)[1]

    return runner(setup, run)


def rh_auto_cold(config, batches, runner):
    """A fresh ``engine="auto"`` estimator per stream; its choice and calibration recorded.

    The process's calibration cache is emptied first, so the first run (a
    warm-up, outside the medians) calibrates; the timed runs reuse the
    decision, as every later stream of the process would. The calibration's
    own cost is reported beside the timings.
    """
    from rh_dask.engines.auto import default_calibrator

    default_calibrator().forget()
    params = config.to_dict()
    seen: dict[str, Any] = {}

    def run(_):
        model, its = fit_fresh("auto", params, batches)
        choice = model.engine_choice_
        if "engine" not in seen:  # the run that calibrated
            seen["engine"] = model.engine_
            if choice is not None:
                seen["reason"] = choice.reason
                seen["calibration_seconds"] = choice.calibration_seconds
                seen["settle_seconds"] = choice.settle_seconds
                seen["predicted_ratio"] = choice.predicted_ratio
                seen["ratios"] = [list(r) for r in choice.ratios]
                seen["fallback"] = choice.fallback
        seen["later_runs_cached"] = bool(choice is not None and choice.cached)
        seen["later_engine"] = model.engine_
        return its

    out = runner(lambda: None, run)
    out["auto_choice"] = seen
    return out


def auto_paired(config, batches, engines: list[str], pairs: int) -> dict[str, Any]:
    """``engine="auto"`` and the explicit ``engines``, fresh estimators, timed together.

    The blocked timings of ``rh_auto`` and the explicit engines run minutes
    apart in one process, so a drift of the host (clocks, other processes,
    BLAS threads winding down) lands on one side. Here every round times one
    stream of each, back to back, each order of them in turn (over a
    multiple of n! rounds every engine follows every other equally often: a
    NumPy stream's BLAS threads still spin during the next one). The medians
    compare ``engine="auto"`` with the faster explicit engine, and with the
    one it chose (what it costs itself per stream; its decision is cached
    by then: the blocked run calibrated).
    """
    params = config.to_dict()
    chosen: set[str] = set()

    def stream(name: str) -> float:
        _sync()
        start = time.perf_counter()
        model, _ = fit_fresh(name, params, batches)
        _sync()
        elapsed = time.perf_counter() - start
        if name == "auto":
            chosen.add(model.engine_)
        return elapsed

    names = ["auto", *engines]
    for name in names:  # warm: each the same as its timed streams
        stream(name)
    times: dict[str, list[float]] = {name: [] for name in names}
    orders = list(itertools.permutations(names))
    for k in range(pairs):
        for name in orders[k % len(orders)]:
            times[name].append(stream(name))
    medians = {name: statistics.median(t) for name, t in times.items()}
    best = min(engines, key=medians.__getitem__)
    engine = chosen.pop() if len(chosen) == 1 else None
    out: dict[str, Any] = {
        "rounds": pairs,
        "seconds": times,
        "medians": medians,
        "chosen": engine,
        "best_explicit": best,
        "auto_over_best": medians["auto"] / medians[best],
    }
    if engine in medians:
        out["auto_over_chosen"] = medians["auto"] / medians[engine]
    return out


def rh_gpu_steady(config, batches, runner, mode, gpu_options=None):
    import cupy as cp

    from gpu_engine import GpuEngine

    options = {**(gpu_options or {}), "graphs": mode != "eager"}
    if mode == "cusolver":
        options["cholesky"] = "cusolver"
    elif mode == "kernel":
        options["cholesky"] = "kernel"
    elif mode == "hostloop":
        options["device_loop"] = "off"
    elif mode in ("blocked", "columns", "tiles"):
        options["cholesky"] = mode
    engine = GpuEngine(config, **options)
    if mode in (
        "device",
        "eager",
        "cusolver",
        "kernel",
        "hostloop",
        "blocked",
        "columns",
        "tiles",
    ):
        data = [(cp.asarray(X), cp.asarray(y)) for X, y in batches]
    elif mode == "pinned":
        data = []
        for X, y in batches:
            px = cp.cuda.alloc_pinned_memory(X.nbytes)
            py = cp.cuda.alloc_pinned_memory(y.nbytes)
            hx = np.frombuffer(px, X.dtype, X.size).reshape(X.shape)
            hy = np.frombuffer(py, y.dtype, y.size)
            hx[...] = X
            hy[...] = y
            data.append((hx, hy))
    else:
        data = batches

    def setup():
        engine.reset()
        return engine

    def run(e):
        if mode in ("host", "pinned"):
            return [d.iterations for d in e.partial_fit_stream(data)]
        return [e.partial_fit(X, y).iterations for X, y in data]

    result = runner(setup, run)
    result["graphs"] = engine.graphs
    result["graph_error"] = engine.graph_error
    result["device_loop"] = getattr(engine, "device_loop", False)
    result["device_loop_error"] = getattr(engine, "device_loop_error", None)
    if config.penalised:
        result["cholesky"] = "none (LAMM)"
    else:
        newton = engine._newton  # what the last batch used
        result["cholesky"] = newton._solve_kernel if newton.small_solve else "cusolver"
    engine.close()
    return result


def opponent(config, batches, runner, backend, lifecycle, device_input=False):
    import renewable_huber

    kwargs = {"penalty": config.penalty, "dtype": config.dtype, "backend": backend}
    if backend == "cupy":
        kwargs["device"] = "cuda"
    data = batches
    if device_input:
        import cupy as cp

        data = [(cp.asarray(X), cp.asarray(y)) for X, y in batches]
    model = renewable_huber.RenewableHuberRegressor(**kwargs)

    def setup():
        if lifecycle == "steady":
            model.reset()
            return model
        return None

    def run(m):
        if m is None:
            m = renewable_huber.RenewableHuberRegressor(**kwargs)
        its = []
        for X, y in data:
            m.partial_fit(X, y)
            its.append(int(m.n_iter_))
        return its

    return runner(setup, run)


# -- transfers --------------------------------------------------------------------------------


def copy_timings(batch: np.ndarray, repeats: int = 7) -> dict[str, float] | None:
    """Host-to-device copy time of one batch: pageable (cupy.asarray) and pinned."""
    try:
        import cupy as cp
    except ImportError:
        return None
    dev = cp.empty(batch.shape, batch.dtype)
    pinned_mem = cp.cuda.alloc_pinned_memory(batch.nbytes)
    pinned = np.frombuffer(pinned_mem, batch.dtype, batch.size).reshape(batch.shape)
    pinned[...] = batch
    out = {}
    for name, src in (("pageable", batch), ("pinned", pinned)):
        samples = []
        for _ in range(repeats):
            cp.cuda.Device().synchronize()
            start = time.perf_counter()
            dev.set(src)
            cp.cuda.Device().synchronize()
            samples.append(time.perf_counter() - start)
        out[f"{name}_seconds"] = statistics.median(samples)
    out["bytes"] = int(batch.nbytes)
    return out


def measured_copy_bandwidth() -> float | None:
    """Device-to-device copy bandwidth (read + written bytes per second), 2 GiB."""
    try:
        import cupy as cp
    except ImportError:
        return None
    a = cp.ones(1 << 28, dtype=cp.float64)
    b = cp.empty_like(a)
    b[...] = a
    cp.cuda.Device().synchronize()
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    times = []
    for _ in range(5):
        start.record()
        b[...] = a
        stop.record()
        stop.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, stop) / 1e3)
    del a, b
    cp.get_default_memory_pool().free_all_blocks()
    return 2 * 8 * (1 << 28) / min(times)


# -- main ---------------------------------------------------------------------------------------


def sweep(args: argparse.Namespace) -> dict[str, Any]:
    gpu_runner = Runner(args.repeats, warmup=1, budget=None)
    cpu_runner = Runner(args.repeats, warmup=args.cpu_warmup, budget=args.cpu_budget)
    engines = set(args.engines)
    bandwidth = measured_copy_bandwidth() if "rh_gpu_device" in engines else None
    peaks = dense_peaks(args) if "rh_gpu_device" in engines else {}
    cases = []
    for shape in args.shapes:
        rows, features, batch_rows = ALL_SHAPES[shape]
        for dtype in args.dtypes:
            batches, digest = make_stream(shape, dtype)
            copies = copy_timings(batches[0][0]) if "rh_gpu_host" in engines else None
            for penalty in args.penalties:
                config = HuberConfig(penalty=penalty, dtype=dtype)
                case: dict[str, Any] = {
                    "shape": shape,
                    "rows": rows,
                    "features": features,
                    "batch_rows": batch_rows,
                    "batches": len(batches),
                    "dtype": dtype,
                    "penalty": penalty,
                    "dataset_sha256": digest,
                    "h2d_copy_first_batch": copies,
                    "results": {},
                }
                res = case["results"]

                def record(name, lifecycle, fn, *fn_args, res=res):
                    if name not in engines:
                        return
                    try:
                        out = fn(*fn_args)
                    except Exception as exc:  # an opponent that fails is recorded, not fatal
                        out = {"error": f"{type(exc).__name__}: {exc}"}
                    res.setdefault(name, {})[lifecycle] = out

                common = (config, batches)
                for name, mode in (
                    ("rh_gpu_device", "device"),
                    ("rh_gpu_eager", "eager"),
                    ("rh_gpu_host", "host"),
                    ("rh_gpu_host_serial", "serial"),
                    ("rh_gpu_pinned", "pinned"),
                    ("rh_gpu_cusolver", "cusolver"),
                    ("rh_gpu_kernel", "kernel"),
                    ("rh_gpu_hostloop", "hostloop"),
                    ("rh_gpu_blocked", "blocked"),
                    ("rh_gpu_columns", "columns"),
                    ("rh_gpu_tiles", "tiles"),
                ):
                    if (
                        mode in ("cusolver", "kernel", "hostloop", "blocked", "columns", "tiles")
                        and config.penalised
                    ):
                        continue  # the Cholesky path only matters to Newton
                    record(
                        name, "steady", rh_gpu_steady, *common, gpu_runner, mode, args.gpu_option
                    )
                if args.cold:
                    to_device = _device_input_converter()
                    record(
                        "rh_gpu_device",
                        "cold",
                        rh_estimator_cold,
                        *common,
                        gpu_runner,
                        "gpu",
                        to_device,
                    )
                    record("rh_gpu_host", "cold", rh_estimator_cold, *common, gpu_runner, "gpu")
                    # engine="auto" right beside the engines it chooses between: timed
                    # after the NumPy runs, whose BLAS threads were still spinning, its
                    # GPU stream was slower (reference float64 on the H200: 25.3 ms
                    # there, 20.0 here, one run each).
                    record("rh_auto", "cold", rh_auto_cold, *common, cpu_runner)
                    # The explicit engines this run times cold, beside auto in rotation.
                    explicit = [
                        e
                        for e, name in (("gpu", "rh_gpu_host"), ("numpy", "rh_numpy"))
                        if name in engines
                    ]
                    if args.auto_pairs and "rh_auto" in res and explicit:
                        rounds = args.auto_pairs
                        record("rh_auto", "paired", auto_paired, *common, explicit, rounds)
                record("rh_numpy", "steady", rh_numpy_steady, *common, cpu_runner)
                if args.cold and not args.quick:
                    record("rh_numpy", "cold", rh_estimator_cold, *common, cpu_runner, "numpy")
                record("rh_numpy_opp", "steady", opponent, *common, cpu_runner, "numpy", "steady")
                if args.cold and not args.quick:
                    record("rh_numpy_opp", "cold", opponent, *common, cpu_runner, "numpy", "cold")
                record(
                    "rh_cupy_opp_device",
                    "steady",
                    opponent,
                    *common,
                    cpu_runner,
                    "cupy",
                    "steady",
                    True,
                )
                record(
                    "rh_cupy_opp_host", "steady", opponent, *common, cpu_runner, "cupy", "steady"
                )
                if args.cold:
                    record(
                        "rh_cupy_opp_device",
                        "cold",
                        opponent,
                        *common,
                        cpu_runner,
                        "cupy",
                        "cold",
                        True,
                    )
                case["derived"] = derive(case, bandwidth, peaks.get(dtype))
                cases.append(case)
                print(one_line(case), flush=True)
                if args.output:  # a partial file survives a run cut short
                    write_json(
                        args.output, _payload(args, bandwidth, cases, complete=False, peaks=peaks)
                    )
    return _payload(args, bandwidth, cases, complete=True, peaks=peaks)


def dense_peaks(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """The device's dense FLOP/s per dtype (a square cupy.matmul), for the wide shapes only."""
    if not any(shape in WIDE_SHAPES for shape in args.shapes):
        return {}
    try:
        import cupy as cp
        from gpu_wide_profile import NOMINAL_H200_TFLOPS, measured_peak
    except ImportError:
        return {}
    out = {}
    for dtype in args.dtypes:
        peak = measured_peak(cp, dtype)
        key = "float64_tensor_core" if dtype == "float64" else "float32_vector"
        out[dtype] = {**peak, "nominal_h200_tflops": NOMINAL_H200_TFLOPS[key]}
    return out


def wide_flops(case: dict[str, Any], dev: float, its: int, peak: dict | None) -> dict[str, Any]:
    """Dense FLOP of the GPU engine's stream and the rate it achieved against the peak.

    Per Newton iteration one Gram + gradient GEMM (2·n·p·(p+1)) and one
    Cholesky factorisation (p³/3); per batch one more GEMM (the row pass
    before the first iteration) and the score variance's Gram (2·n·p²).
    """
    n, nb, p = case["batch_rows"], case["batches"], case["features"] + 1
    gram = 2.0 * n * p * (p + 1)
    factor = p**3 / 3.0
    total = (its + nb) * gram + its * factor + nb * 2.0 * n * p * p
    out: dict[str, Any] = {
        "gram_flop_per_iteration": gram,
        "factor_flop_per_iteration": factor,
        "dense_flop_per_stream": total,
        "dense_tflops_achieved": total / dev / 1e12,
    }
    if peak:
        out["measured_peak_tflops"] = peak["tflops"]
        out["fraction_of_measured_peak"] = out["dense_tflops_achieved"] / peak["tflops"]
        out["fraction_of_nominal_peak"] = (
            out["dense_tflops_achieved"] / peak["nominal_h200_tflops"]
        )
    return out


def _payload(args, bandwidth, cases, complete, peaks=None):
    return {
        "schema": SCHEMA,
        "complete": complete,
        "environment": environment(),
        "settings": {
            "quick": args.quick,
            "repeats": args.repeats,
            "cpu_budget_seconds": args.cpu_budget,
            "cpu_warmup_runs": args.cpu_warmup,
            "gpu_warmup_runs": 1,
            "cold_lifecycle": args.cold,
            "gpu_options": getattr(args, "gpu_option", {}),
            "copy_bandwidth_bytes_per_second": bandwidth,
            "copy_bandwidth_assumed": COPY_BANDWIDTH,
            "dense_peak": peaks or {},
            "native_cuda_reference_ms": {f"{s}/{d}": v for (s, d), v in NATIVE_CUDA_MS.items()},
        },
        "cases": cases,
    }


def _device_input_converter():
    try:
        import cupy as cp
    except ImportError:
        return None
    return lambda X, y: (cp.asarray(X), cp.asarray(y))


def _median(case: dict[str, Any], name: str, lifecycle: str = "steady") -> float | None:
    entry = case["results"].get(name, {}).get(lifecycle)
    if not entry or "median" not in entry:
        return None
    return float(entry["median"])


def derive(
    case: dict[str, Any], bandwidth: float | None, peak: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Ratios, per-batch times, per-iteration roofline fraction and the issue's targets.

    ``peak`` (the dtype's measured dense peak) adds, for the wide shapes, the
    stream's dense FLOP and the fraction of the peak it achieved.
    """
    out: dict[str, Any] = {}
    out.update(cold_ratio(case))
    out.update(auto_summary(case))
    dev = _median(case, "rh_gpu_device")
    nb = case["batches"]
    if dev is None:
        return out
    out["rh_gpu_device_ms_per_stream"] = dev * 1e3
    out["rh_gpu_device_ms_per_batch"] = dev * 1e3 / nb
    for opp in ("rh_cupy_opp_device", "rh_cupy_opp_host", "rh_numpy_opp", "rh_numpy"):
        other = _median(case, opp)
        if other is not None:
            out[f"speedup_vs_{opp}"] = other / dev
    entry = case["results"]["rh_gpu_device"]["steady"]
    its = sum(entry.get("iterations_per_batch") or [0])
    if its:
        item = np.dtype(case["dtype"]).itemsize
        p = case["features"] + 1
        # one pass over Z (all batches' rows) per iteration, at the copy roofline
        pass_bytes = case["rows"] * p * item
        bw = bandwidth or COPY_BANDWIDTH
        per_iter = dev / its
        out["iterations_total"] = its
        out["us_per_iteration"] = per_iter * 1e6
        out["pass_over_Z_us_at_roofline"] = pass_bytes / nb / bw * 1e6
        out["roofline_fraction_per_iteration"] = (pass_bytes / nb / bw) / per_iter
        if case["shape"] in WIDE_SHAPES:
            out.update(wide_flops(case, dev, its, peak))
    opp = out.get("speedup_vs_rh_cupy_opp_device")
    if case["shape"] in WIDE_SHAPES and opp is not None:
        out["wide_target_2x_met"] = opp >= 2.0  # issue 16: at least 2x the peer's CuPy backend
    native = NATIVE_CUDA_MS.get((case["shape"], case["dtype"]))
    if native is not None and case["penalty"] == "none":
        out["native_cuda_ms"] = native
        out["speedup_vs_native_cuda"] = native / (dev * 1e3)
    host = _median(case, "rh_gpu_host")
    copies = case.get("h2d_copy_first_batch")
    if host is not None and copies:
        copy_stream = copies["pageable_seconds"] * nb
        bound = max(dev, copy_stream)
        out["host_over_max_device_copy"] = host / bound
        out["host_target_met"] = host <= 1.15 * bound
    pinned = _median(case, "rh_gpu_pinned")
    if pinned is not None:
        out["pinned_over_device"] = pinned / dev
        out["pinned_target_met"] = pinned <= 1.25 * dev
    eager = _median(case, "rh_gpu_eager")
    if eager is not None:
        out["graph_speedup"] = eager / dev
    hostloop = _median(case, "rh_gpu_hostloop")
    if hostloop is not None:
        out["rh_gpu_hostloop_ms_per_batch"] = hostloop * 1e3 / nb
        out["device_loop_speedup"] = hostloop / dev
    cus, ker = _median(case, "rh_gpu_cusolver"), _median(case, "rh_gpu_kernel")
    if cus is not None and ker is not None:
        out["fused_cholesky_speedup_over_cusolver"] = cus / ker
    for name in (
        "rh_gpu_cusolver",
        "rh_gpu_kernel",
        "rh_gpu_blocked",
        "rh_gpu_columns",
        "rh_gpu_tiles",
    ):
        median = _median(case, name)
        if median is not None:
            out[f"{name}_ms_per_batch"] = median * 1e3 / nb
    return out


#: Issue 16 item 3: a fresh estimator's plain ``partial_fit`` loop with NumPy
#: input takes at most this many times the same loop with CuPy input.
COLD_HOST_TARGET = 1.5

#: Issue 16 item 1: ``engine="auto"`` within this factor of the faster engine per case.
AUTO_TARGET = 1.1


def auto_summary(case: dict[str, Any]) -> dict[str, Any]:
    """engine="auto"'s choice and its time against the faster explicit engine (cold lifecycle).

    The faster of ``rh_numpy`` and ``rh_gpu_host`` (fresh estimators over the
    same host batches); issue 16's target is auto ≤ 1.1 × that, calibration
    reported apart (``auto_calibration_seconds``, once per process).
    """
    entry = case["results"].get("rh_auto", {}).get("cold")
    if not entry or "median" not in entry:
        return {}
    choice = entry.get("auto_choice", {})
    out: dict[str, Any] = {
        "auto_engine": choice.get("engine"),
        "auto_ms": entry["median"] * 1e3,
        "auto_calibration_seconds": choice.get("calibration_seconds"),
    }
    explicit = {
        name: m
        for name, m in (
            ("numpy", _median(case, "rh_numpy", "cold")),
            ("gpu", _median(case, "rh_gpu_host", "cold")),
        )
        if m is not None
    }
    if explicit:
        best = min(explicit, key=explicit.get)
        out["auto_best_explicit"] = best
        out["auto_over_best"] = entry["median"] / explicit[best]
        out["auto_target_met"] = out["auto_over_best"] <= AUTO_TARGET
    paired = case["results"].get("rh_auto", {}).get("paired")
    if paired and "auto_over_best" in paired:
        # The same comparison timed in rotation (auto_paired), and auto's own cost.
        out["auto_paired_best_explicit"] = paired["best_explicit"]
        out["auto_over_best_paired"] = paired["auto_over_best"]
        out["auto_paired_target_met"] = paired["auto_over_best"] <= AUTO_TARGET
        if "auto_over_chosen" in paired:
            out["auto_over_chosen_paired"] = paired["auto_over_chosen"]
    return out


def cold_ratio(case: dict[str, Any]) -> dict[str, Any]:
    """The cold lifecycle's host and device medians (ms per stream), their ratio, the target."""
    host = _median(case, "rh_gpu_host", "cold")
    dev = _median(case, "rh_gpu_device", "cold")
    out: dict[str, Any] = {}
    if host is not None:
        out["cold_host_ms"] = host * 1e3
    if dev is not None:
        out["cold_device_ms"] = dev * 1e3
    if host is not None and dev is not None:
        out["cold_host_over_device"] = host / dev
        out["cold_host_target"] = COLD_HOST_TARGET
        out["cold_host_target_met"] = host <= COLD_HOST_TARGET * dev
    return out


def one_line(case: dict[str, Any]) -> str:
    parts = [f"{case['shape']:9s} {case['dtype']} {case['penalty']:4s}"]
    for name in (
        "rh_gpu_device",
        "rh_gpu_eager",
        "rh_gpu_cusolver",
        "rh_gpu_host",
        "rh_gpu_pinned",
        "rh_numpy",
        "rh_numpy_opp",
        "rh_cupy_opp_device",
    ):
        m = _median(case, name)
        if m is not None:
            parts.append(f"{name}={m * 1e3:.2f}ms")
        elif name in case["results"]:
            parts.append(f"{name}=ERR")
    auto = auto_summary(case)
    if auto:
        parts.append(f"auto={auto['auto_engine']} {auto['auto_ms']:.2f}ms")
        if "auto_over_best" in auto:
            met = "met" if auto["auto_target_met"] else "NOT met"
            parts.append(
                f"(x{auto['auto_over_best']:.2f} of {auto['auto_best_explicit']}, "
                f"<= {AUTO_TARGET}: {met})"
            )
        if "auto_over_best_paired" in auto:
            met = "met" if auto["auto_paired_target_met"] else "NOT met"
            parts.append(
                f"rotated x{auto['auto_over_best_paired']:.3f} of "
                f"{auto['auto_paired_best_explicit']} ({met}; "
                f"x{auto.get('auto_over_chosen_paired', float('nan')):.3f} of its choice)"
            )
    cold = cold_ratio(case)
    if "cold_host_over_device" in cold:
        met = "met" if cold["cold_host_target_met"] else "NOT met"
        parts.append(
            f"cold host={cold['cold_host_ms']:.2f}ms device={cold['cold_device_ms']:.2f}ms "
            f"ratio={cold['cold_host_over_device']:.2f} (<= {COLD_HOST_TARGET}: {met})"
        )
    return " ".join(parts)


def markdown(payload: dict[str, Any]) -> str:
    """The docs/performance.md table: ms per stream (per batch), ratios, roofline."""
    env = payload["environment"]
    gpu = env.get("gpu") or {}
    lines = [
        f"Machine: {gpu.get('name', 'no GPU')} (driver {gpu.get('driver_version')}, "
        f"CUDA runtime {gpu.get('runtime_version')}, CuPy {gpu.get('cupy_version')}), "
        f"CPU {env.get('cpu')} × {env.get('cpu_count')}; schema {payload['schema']}.",
        "",
        "| shape | dtype | penalty | GPU device ms/stream (ms/batch) | GPU host | GPU pinned "
        "| rh NumPy | opp NumPy | opp CuPy dev | opp CuPy host | × opp CuPy dev | × opp NumPy "
        "| × native CUDA | µs/iter | roofline/iter |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def ms(case, name):
        m = _median(case, name)
        return "—" if m is None else f"{m * 1e3:.2f}"

    for case in payload["cases"]:
        d = case.get("derived", {})
        dev = d.get("rh_gpu_device_ms_per_stream")
        dev_s = "—" if dev is None else f"{dev:.2f} ({d['rh_gpu_device_ms_per_batch']:.3f})"

        def ratio(key, d=d):
            v = d.get(key)
            return "—" if v is None else f"{v:.1f}"

        roof = d.get("roofline_fraction_per_iteration")
        lines.append(
            f"| {case['shape']} | {case['dtype']} | {case['penalty']} | {dev_s} "
            f"| {ms(case, 'rh_gpu_host')} | {ms(case, 'rh_gpu_pinned')} "
            f"| {ms(case, 'rh_numpy')} | {ms(case, 'rh_numpy_opp')} "
            f"| {ms(case, 'rh_cupy_opp_device')} | {ms(case, 'rh_cupy_opp_host')} "
            f"| {ratio('speedup_vs_rh_cupy_opp_device')} | {ratio('speedup_vs_rh_numpy_opp')} "
            f"| {ratio('speedup_vs_native_cuda')} "
            f"| {d.get('us_per_iteration', float('nan')):.0f} "
            f"| {'—' if roof is None else f'{roof:.1%}'} |"
        )
    cold = [(case, cold_ratio(case)) for case in payload["cases"]]
    cold = [(case, c) for case, c in cold if "cold_host_over_device" in c]
    if cold:
        lines += [
            "",
            f"Cold lifecycle (fresh estimator, plain partial_fit loop), ms per stream; "
            f"target host/device <= {COLD_HOST_TARGET}:",
            "",
            "| shape | dtype | penalty | host cold | device cold | host/device | met |",
            "|---|---|---|---|---|---|---|",
        ]
        for case, c in cold:
            lines.append(
                f"| {case['shape']} | {case['dtype']} | {case['penalty']} "
                f"| {c['cold_host_ms']:.2f} | {c['cold_device_ms']:.2f} "
                f"| {c['cold_host_over_device']:.2f} "
                f"| {'yes' if c['cold_host_target_met'] else 'no'} |"
            )
    return "\n".join(lines) + "\n"


ALL_ENGINES = (
    "rh_gpu_device",
    "rh_gpu_eager",
    "rh_gpu_cusolver",
    "rh_gpu_kernel",
    "rh_gpu_hostloop",
    "rh_gpu_blocked",
    "rh_gpu_columns",
    "rh_gpu_tiles",
    "rh_gpu_host",
    "rh_gpu_host_serial",
    "rh_gpu_pinned",
    "rh_numpy",
    "rh_numpy_opp",
    "rh_cupy_opp_device",
    "rh_cupy_opp_host",
    "rh_auto",
)


def _gpu_option(text: str) -> tuple[str, Any]:
    """``NAME=VALUE`` → (name, value): true/false as bools, whole numbers as ints."""
    name, sep, value = text.partition("=")
    if not sep or not name.isidentifier():
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    lowered = value.strip().lower()
    if lowered in ("true", "false"):
        return name, lowered == "true"
    return name, int(value) if value.strip().isdigit() else value.strip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(ALL_SHAPES))
    parser.add_argument(
        "--wide",
        action="store_true",
        help=f"add issue 16's wide designs ({', '.join(WIDE_SHAPES)}) to --shapes",
    )
    parser.add_argument("--dtypes", nargs="+", default=["float32", "float64"])
    parser.add_argument("--penalties", nargs="+", default=["none", "l1"])
    parser.add_argument("--engines", nargs="+", default=list(ALL_ENGINES), choices=ALL_ENGINES)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--cpu-budget", type=float, default=20.0, help="seconds per CPU case")
    parser.add_argument("--cpu-warmup", type=int, default=1)
    parser.add_argument(
        "--cold",
        dest="cold",
        action="store_true",
        default=True,
        help="also time the cold lifecycle (the default; --no-cold skips it)",
    )
    parser.add_argument("--no-cold", dest="cold", action="store_false")
    parser.add_argument(
        "--auto-pairs",
        type=int,
        default=12,
        help="rounds of cold streams, auto and each explicit engine timed cold, each order "
        "in turn (a multiple of 6 balances three engines; 0: none)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="fit a short device lease: 5 repeats, CPU engines 1 warm-up and a 4 s budget",
    )
    parser.add_argument(
        "--gpu-option",
        action="append",
        type=_gpu_option,
        default=[],
        metavar="NAME=VALUE",
        help="a GpuEngine keyword for every steady GPU mode, e.g. device_loop=auto or "
        "wide_kernels=true (repeatable; a mode's own option wins)",
    )
    parser.add_argument("--output", default="benchmarks/results/shape_sweep.json")
    parser.add_argument("--markdown", metavar="JSON", help="print the table of a result file")
    args = parser.parse_args(argv)
    args.gpu_option = dict(args.gpu_option)
    if args.markdown:
        print(markdown(json.loads(Path(args.markdown).read_text())))
        return 0
    if args.wide:
        args.shapes = [*args.shapes, *(s for s in WIDE_SHAPES if s not in args.shapes)]
    if args.quick:
        args.repeats = min(args.repeats, 5)
        args.cpu_budget = min(args.cpu_budget, 4.0)
    payload = sweep(args)
    write_json(args.output, payload)
    print(markdown(payload))
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
