"""Device probe: the Newton system's solve alone, per factorisation, in µs per launch.

For p = 17, 33, 91 and 128 (16, 32, 90 and 127 features with the intercept)
and both dtypes, one GPU engine fits a 4,096-row batch (so its workspace
holds an assembled system's inputs), then the solve step of one Newton
iteration is launched on its own, eagerly, 100 times between two CUDA events,
5 times: ``assemble`` (the one-block assembly kernel alone, the part every
mode shares), ``cusolver`` (assembly + ``potrf``/``potrs``), and the one-block
kernels ``kernel``, ``blocked``, ``columns`` and ``tiles`` (assembly,
factorisation and both triangular solves in one launch), ``columns_noloop``
(the columns kernel without its factorisation loop). Medians of the five
per-launch means.

    PYTHONPATH=. python benchmarks/solve_probe.py [--output FILE]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path
from typing import Any

import numpy as np
from common import environment, write_json

from rh_dask import HuberConfig
from rh_dask.datasets import StreamSpec

SCHEMA = "rh-dask/bench/solve-probe/1"
MODES = (
    "assemble",
    "cusolver",
    "kernel",
    "blocked",
    "columns",
    "columns_noloop",
    "tiles",
)

#: ``columns_noloop``: the columns kernel compiled with its factorisation loop
#: taken out (assembly, register loads, back substitution and writes only), so
#: that columns − columns_noloop is the loop's cost. Its outputs are garbage.
_NOLOOP = (
    "for (int k = 0; k < q; ++k) {\n    fail = s_fail[k & 1];",
    "for (int k = 0; k < 0; ++k) {\n    fail = s_fail[k & 1];",
)


def _variant_body(cp: Any, engine: Any, p: int, name: str, shared: int, change: tuple):
    """One launch of kernel ``name`` compiled from the source with ``change`` made."""
    from gpu_engine import kernels, layout

    ws, stream = engine._ws, engine._newton._parts.stream
    source = kernels.SOURCE.read_text()
    if source.count(change[0]) != 1:
        raise RuntimeError(f"{name}: the code to change is not where the probe expects it")
    code = layout.cuda_defines() + source.replace(*change)
    ctype = "float" if ws.item == 4 else "double"
    module = cp.RawModule(
        code=code, options=kernels.COMPILE_OPTIONS, name_expressions=[f"{name}<{ctype}>"]
    )
    kernel = module.get_function(f"{name}<{ctype}>")
    kernel.max_dynamic_shared_size_bytes = shared
    args = (ws.C, ws.J, ws.beta_work, ws.beta, np.int64(p), ws.ctl, ws.H, ws.Hs, ws.g, ws.D)

    def body() -> None:
        with stream:
            kernel((1,), (layout.SMALL_THREADS,), args, shared_mem=shared)

    return body


def _solve_body(engine: Any, mode: str, p: int):
    from gpu_engine import layout

    drv, ws, launcher = engine._newton, engine._ws, engine._launcher
    args = (ws.C, ws.J, ws.beta_work, ws.beta, p, ws.ctl, ws.H, ws.Hs, ws.g, ws.D)

    def assemble() -> None:
        launcher.launch(("assemble",), "rh_newton_assemble", 1, layout.SMALL_THREADS, args)

    if mode == "assemble":
        return assemble
    if mode == "columns_noloop":
        import cupy as cp

        # the driver's own choice of columns kernel and its shared memory at this p
        drv._cholesky = "columns"
        drv._fused_solve_fits(p)
        return _variant_body(cp, engine, p, drv._solve_kernel, drv._solve_shared, _NOLOOP)
    if mode == "cusolver":

        def body() -> None:
            assemble()
            engine._dense.cholesky_solve(
                ws.H, ws.D, p, ws.int_ptr(layout.I_INFO), ws.int_ptr(layout.I_INFO_SOLVE)
            )

        return body
    drv._cholesky = mode
    drv._fused_solve_fits(p)
    name, shared = drv._solve_kernel, drv._solve_shared
    return lambda: launcher.launch(("probe", name), name, 1, layout.SMALL_THREADS, args, shared)


def _time(cp: Any, stream: Any, body, launches: int = 100, repeats: int = 5) -> list[float]:
    for _ in range(20):
        body()
    start, end = cp.cuda.Event(), cp.cuda.Event()
    out = []
    for _ in range(repeats):
        start.record(stream)
        for _ in range(launches):
            body()
        end.record(stream)
        end.synchronize()
        out.append(cp.cuda.get_elapsed_time(start, end) * 1e3 / launches)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default=None)
    args = parser.parse_args(argv)
    import cupy as cp

    from gpu_engine import GpuEngine

    results: dict[str, Any] = {}
    for dtype in ("float32", "float64"):
        for features in (16, 32, 90, 127):
            X, y = StreamSpec(n_features=features, seed=3).chunk(0, 4096, "float64")
            engine = GpuEngine(HuberConfig(dtype=dtype), graphs=False, cholesky="cusolver")
            engine.partial_fit(cp.asarray(X.astype(dtype)), cp.asarray(y.astype(dtype)))
            p = features + 1
            row: dict[str, Any] = {}
            for mode in MODES:
                try:
                    body = _solve_body(engine, mode, p)
                    samples = _time(cp, engine._newton._parts.stream, body)
                    row[mode] = {"us": statistics.median(samples), "samples": samples}
                except Exception as exc:  # a mode that cannot hold this p
                    row[mode] = {"error": f"{type(exc).__name__}: {exc}"}
            engine.close()
            results[f"{dtype}-p{p}"] = row
            print(
                dtype,
                p,
                " ".join(f"{m}={v['us']:.1f}" if "us" in v else f"{m}=-" for m, v in row.items()),
                flush=True,
            )
    payload = {"schema": SCHEMA, "environment": environment(), "us_per_launch": results}
    output = args.output or (
        str(Path(os.environ["OUT"]) / "solve_probe.json") if os.environ.get("OUT") else None
    )
    if output:
        write_json(output, payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
