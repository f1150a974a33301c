"""Whether a NumPy stream leaves BLAS threads spinning that slow the next GPU streams.

On a GPU machine: GPU-engine streams (fresh estimator, NumPy input) before and after
a NumPy-engine stream, after gaps of 0-1 s, under ``threadpool_limits(1)``, and after
``ProcessIdle.wait``; the process's busy cores while the main thread sleeps; then
``engine="auto"``'s calibrating stream and the streams after it. Writes
``$OUT/spin_probe.json`` (docs/performance.md, issue 16's sweep).

    python benchmarks/blas_spin_probe.py
"""

import json
import os
import time

import cupy as cp
import numpy as np
import threadpoolctl

from rh_dask import RenewableHuberRegressor
from rh_dask.datasets import StreamSpec
from rh_dask.engines.auto import default_calibrator

print(
    json.dumps(
        [{k: v for k, v in i.items() if k != "filepath"} for i in threadpoolctl.threadpool_info()]
    )
)
print(
    {
        k: os.environ.get(k)
        for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OPENBLAS_THREAD_TIMEOUT")
    }
)
results = {}
for dtype, features in (("float64", 90), ("float32", 90), ("float32", 257)):
    rows, batch = (131072, 32768) if features == 90 else (16384, 4096)
    X, y = StreamSpec(n_features=features, seed=7).chunk(0, rows, "float64")
    X, y = np.ascontiguousarray(X, dtype=dtype), np.ascontiguousarray(y, dtype=dtype)
    batches = [(X[s : s + batch], y[s : s + batch]) for s in range(0, rows, batch)]

    def stream(engine, batches=batches):
        t = time.perf_counter()
        m = RenewableHuberRegressor(engine=engine)
        for a, b in batches:
            m.partial_fit(a, b)
        cp.cuda.Device().synchronize()
        return (time.perf_counter() - t) * 1e3

    def cpu_in_sleep(s=0.05):
        c, w = time.process_time(), time.perf_counter()
        time.sleep(s)
        return round((time.process_time() - c) / (time.perf_counter() - w), 2)

    for _ in range(4):
        stream("gpu")
    key = f"{dtype}/{features}"
    out = results[key] = {}
    out["base"] = [round(stream("gpu"), 2) for _ in range(8)]
    stream("numpy")
    out["cores_busy_in_50ms_sleep_after_numpy"] = [cpu_in_sleep() for _ in range(8)]
    for gap in (0.0, 0.05, 0.1, 0.2, 0.4, 1.0):
        stream("numpy")
        time.sleep(gap)
        out[f"after_numpy_gap{gap}"] = [round(stream("gpu"), 2) for _ in range(6)]
    # Parking attempt: threadpool_limits(1) right after the NumPy stream.
    ctl = threadpoolctl.ThreadpoolController()
    stream("numpy")
    with ctl.limit(limits=1, user_api="blas"):
        out["limit1_busy"] = [cpu_in_sleep() for _ in range(3)]
        out["limit1_after_numpy"] = [round(stream("gpu"), 2) for _ in range(6)]
    stream("numpy")
    with ctl.limit(limits=1, user_api="blas"):
        out["limit1_then_1x1_gemm_busy"] = None
        a = np.ones((64, 64))
        a @ a
        out["limit1_then_gemm_busy"] = [cpu_in_sleep() for _ in range(3)]
        out["limit1_then_gemm_after_numpy"] = [round(stream("gpu"), 2) for _ in range(6)]
    from rh_dask.engines.blas_threads import ProcessIdle

    idle = ProcessIdle()
    b0 = idle.busy()
    stream("numpy")
    out["settle_waited"] = round(idle.wait(b0, 0.5), 3)
    out["settle_baseline"] = round(b0, 2)
    out["after_numpy_settled"] = [round(stream("gpu"), 2) for _ in range(6)]
    out["base_again"] = [round(stream("gpu"), 2) for _ in range(8)]
    print(key, json.dumps(out), flush=True)
# engine="auto" as the sweep times it: calibration, then streams

default_calibrator().forget()
t = time.perf_counter()
m = RenewableHuberRegressor(engine="auto")
for a, b in batches:
    m.partial_fit(a, b)
c = m.engine_choice_
print(
    "auto first (calibrates)",
    round((time.perf_counter() - t) * 1e3, 1),
    m.engine_,
    c.calibration_seconds,
    c.settle_seconds,
)
print("auto later", [round(stream("auto"), 2) for _ in range(12)])
out_dir = os.environ.get("OUT", "/tmp")
json.dump(results, open(os.path.join(out_dir, "spin_probe.json"), "w"), indent=1)
