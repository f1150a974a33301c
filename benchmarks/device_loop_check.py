"""Device check of the Newton device loop: bit identity with the host loop, and its time.

Builds a GPU engine with ``device_loop="on"`` and one with ``"off"`` for a
few streams (reference float32, latency float64, a weighted stream without
intercept, a rank-deficient stream whose factors are singular, and the wide
shape's p = 256 float64, whose Newton system goes through cuSOLVER and,
at that size, cuSOLVER's own cuBLAS calls) and asserts that every batch's
diagnostics, the final state and the β mirror are the same bits. A loop
that cannot be built (``EngineUnavailableError`` with "on") is reported for
its case, with the reason (a refused body names its nodes), as is any
other error of a case, rather than ending the run. Then times the reference
float32 stream (100,000 × 90 in 32,768-row batches, CuPy input, empty state
to last batch) both ways, with the device loop and ``cholesky="kernel"``,
``"blocked"`` and ``"columns"``, and with the host loop and ``"columns"``,
alternating the engines, 20 repeats each after a warm-up, and reports the
medians per stream and per batch (and whether the blocked factorisation's β
is within the contract's float32 tolerance of cuSOLVER's). Runs in well
under a minute on an H200.

    PYTHONPATH=. python benchmarks/device_loop_check.py [--repeats 20] [--output FILE]

Prints the JSON; writes it to ``--output`` or, when ``$OUT`` is set, to
``$OUT/device_loop_check.json``. Exits 1 when the device loop was not used
or a stream differs.

The timing needs the loop on the reference stream; where it cannot be built
there, the timing section holds the reason instead of timings.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from common import SHAPES, environment, summarize, write_json

from rh_dask import HuberConfig
from rh_dask.datasets import StreamSpec
from rh_dask.exceptions import EngineUnavailableError

SCHEMA = "rh-dask/bench/device-loop-check/1"


def _stream(rows: int, features: int, batch: int, dtype: str, seed: int = 7):
    X, y = StreamSpec(n_features=features, seed=seed).chunk(0, rows, "float64")
    X, y = np.ascontiguousarray(X, dtype=dtype), np.ascontiguousarray(y, dtype=dtype)
    return [(X[s : s + batch], y[s : s + batch]) for s in range(0, rows, batch)]


def _cases() -> dict[str, tuple[HuberConfig, list, list | None]]:
    rows, features, batch = SHAPES["reference"]
    latency = SHAPES["latency"]
    wide_rows, wide_features, wide_batch = SHAPES["wide"]
    weighted = _stream(12_000, 20, 4_000, "float64", seed=8)
    rng = np.random.default_rng(8)
    weights = [rng.integers(0, 4, len(y)).astype("float64") for _, y in weighted]
    singular = [
        (np.ascontiguousarray(np.column_stack([X, X[:, 2]])), y)
        for X, y in _stream(2_100, 6, 800, "float32", seed=11)
    ]
    return {
        "reference_float32": (
            HuberConfig(dtype="float32"),
            _stream(rows, features, batch, "float32"),
            None,
        ),
        "latency_float64": (HuberConfig(), _stream(*latency, "float64"), None),
        "weighted_no_intercept_float64": (HuberConfig(fit_intercept=False), weighted, weights),
        "singular_float32": (HuberConfig(dtype="float32", ridge=0.0), singular, None),
        "wide_cusolver_float64": (
            HuberConfig(),
            _stream(wide_rows // 2, wide_features, wide_batch, "float64"),
            None,
        ),
    }


def _run(cp, engine, data, weights) -> list:
    out = []
    for i, (X, y) in enumerate(data):
        w = None if weights is None else weights[i]
        out.append(engine.partial_fit(X, y, w))
    return out


def _compare(cp, name, config, batches, weights) -> dict[str, Any]:
    from gpu_engine import GpuEngine

    data = [(cp.asarray(X), cp.asarray(y)) for X, y in batches]
    dev_w = None if weights is None else [cp.asarray(w) for w in weights]
    results = {}
    for mode in ("on", "off"):
        engine = GpuEngine(config, device_loop=mode)
        try:
            diagnostics = _run(cp, engine, data, dev_w)
        except Exception as exc:  # EngineUnavailableError: "on", and no loop can be built
            engine.close()
            refused = isinstance(exc, EngineUnavailableError) and "cuSOLVER" in str(exc)
            if refused:  # as designed: a cuSOLVER solve keeps the host loop
                return {
                    "case": name,
                    "dtype": config.dtype,
                    "batches": len(batches),
                    "device_loop_error": str(exc),
                    "checks": {"refused_for_cusolver": True},
                    "ok": True,
                }
            return {
                "case": name,
                "dtype": config.dtype,
                "batches": len(batches),
                "device_loop_error": f"device_loop={mode!r}: {type(exc).__name__}: {exc}",
                "checks": {"device_loop_used": False},
                "ok": False,
            }
        state = engine.export_state()
        results[mode] = {
            "diagnostics": diagnostics,
            "state": state,
            "mirror": engine._ws.beta_host.tobytes(),
            "used": engine._newton.device_loop,
            "error": engine.device_loop_error,
        }
        engine.close()
    on, off = results["on"], results["off"]
    checks = {
        "device_loop_used": bool(on["used"]),
        "host_loop_used_when_off": not off["used"],
        "diagnostics_equal": on["diagnostics"] == off["diagnostics"],
        "state_equal": bool(on["state"].equals(off["state"])),
        "mirror_equal": on["mirror"] == off["mirror"],
    }
    return {
        "case": name,
        "dtype": config.dtype,
        "batches": len(batches),
        "iterations": [d.iterations for d in on["diagnostics"]],
        "device_loop_error": on["error"],
        "checks": checks,
        "ok": all(checks.values()),
    }


def _time(cp, config, batches, repeats: int) -> dict[str, Any]:
    from gpu_engine import GpuEngine

    data = [(cp.asarray(X), cp.asarray(y)) for X, y in batches]
    engines = {mode: GpuEngine(config, device_loop=mode) for mode in ("on", "off")}
    # the device loop with the one-block Cholesky kernels, whatever "auto" chose
    engines["on_kernel"] = GpuEngine(config, device_loop="on", cholesky="kernel")
    engines["on_blocked"] = GpuEngine(config, device_loop="on", cholesky="blocked")
    engines["on_columns"] = GpuEngine(config, device_loop="on", cholesky="columns")
    # the host loop with the register-column kernel: what the loop adds on its own
    engines["off_columns"] = GpuEngine(config, device_loop="off", cholesky="columns")
    samples: dict[str, list[float]] = {mode: [] for mode in engines}
    iterations: dict[str, list[int]] = {}
    unavailable: dict[str, str] = {}
    for mode, engine in engines.items():  # warm-up: compiles and captures every graph
        engine.reset()
        try:
            iterations[mode] = [d.iterations for d in _run(cp, engine, data, None)]
        except EngineUnavailableError as exc:
            unavailable[mode] = str(exc)
        cp.cuda.Device().synchronize()
    for mode in unavailable:
        engines.pop(mode).close()
    if "off" not in engines or len(engines) < 2:
        for engine in engines.values():
            engine.close()
        return {"unavailable": unavailable}
    modes = tuple(engines)
    for rep in range(repeats):
        order = modes if rep % 2 == 0 else modes[::-1]
        for mode in order:
            engine = engines[mode]
            engine.reset()
            cp.cuda.Device().synchronize()
            start = time.perf_counter()
            _run(cp, engine, data, None)
            cp.cuda.Device().synchronize()
            samples[mode].append(time.perf_counter() - start)
    out: dict[str, Any] = {
        "batches": len(batches),
        "rows_per_batch": len(batches[0][1]),
        "unavailable": unavailable,
    }
    beta = {mode: engine.coefficients().astype(np.float64) for mode, engine in engines.items()}
    scale = 3e-5 + 3e-4 * np.abs(beta["off"])  # the contract's float32 tolerance
    out["within_tolerance_of_off"] = {
        mode: bool(np.all(np.abs(b - beta["off"]) <= scale)) for mode, b in beta.items()
    }
    for mode, engine in engines.items():
        med = statistics.median(samples[mode])
        out[f"device_loop_{mode}"] = {
            "device_loop_used": engine._newton.device_loop,
            "fused_solve": engine._newton.small_solve,
            "device_loop_error": engine.device_loop_error,
            "graphs": engine.graphs,
            "graph_error": engine.graph_error,
            "iterations": iterations[mode],
            "seconds": samples[mode],
            "summary": summarize(samples[mode]),
            "ms_per_stream": med * 1e3,
            "ms_per_batch": med * 1e3 / len(batches),
        }
        engine.close()
    off = out["device_loop_off"]["ms_per_batch"]
    loops = {m: v["ms_per_batch"] for m, v in out.items() if m.startswith("device_loop_on")}
    out["speedup_per_batch"] = {m: off / ms for m, ms in loops.items() if ms}
    out["best_loop_ms_per_batch"] = min(loops.values()) if loops else None
    every = {m: v["ms_per_batch"] for m, v in out.items() if m.startswith("device_loop_")}
    out["best_ms_per_batch"] = min(every, key=every.get)
    out["target_ms_per_batch"] = 0.55
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--output", default=None)
    args = parser.parse_args(argv)
    import cupy as cp

    started = time.perf_counter()
    cases = [_compare(cp, name, *case) for name, case in _cases().items()]
    config, batches, _ = _cases()["reference_float32"]
    timing = _time(cp, config, batches, args.repeats)
    payload = {
        "schema": SCHEMA,
        "environment": environment(),
        "settings": {"repeats": args.repeats, "shape": "reference", "input": "cupy"},
        "bit_identity": cases,
        "reference_float32_timing": timing,
        "ok": all(c["ok"] for c in cases) and "device_loop_on_kernel" in timing,
        "wall_seconds": time.perf_counter() - started,
    }
    output = args.output
    if output is None and os.environ.get("OUT"):
        output = str(Path(os.environ["OUT"]) / "device_loop_check.json")
    if output:
        write_json(output, payload)
    brief: dict[str, Any] = {
        "ok": payload["ok"],
        "cases": {
            c["case"]: (c["ok"], c.get("iterations"), c["device_loop_error"]) for c in cases
        },
        "wall_seconds": payload["wall_seconds"],
    }
    brief["timing_unavailable"] = timing.get("unavailable")
    brief["ms_per_batch"] = {
        mode: (v["ms_per_batch"], v["fused_solve"])
        for mode, v in timing.items()
        if mode.startswith("device_loop_")
    }
    brief["within_tolerance_of_off"] = timing.get("within_tolerance_of_off")
    print(json.dumps(brief, indent=1, default=str))
    return 0 if payload["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
