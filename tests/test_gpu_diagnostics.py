"""The GPU engine's robust diagnostics (gpu_engine/diagnostics.py) run on NumPy arrays.

The module takes its array module as an argument; with NumPy in place of
CuPy its results must equal :mod:`rh_dask.residuals` (the NumPy engine's
definitions) on awkward inputs: zero weights, a cumulative weight hitting
exactly half, ties, float32. The GPU tests compare the engine itself.
"""

from __future__ import annotations

import numpy as np
import pytest

from rh_dask.residuals import outlier_share, residual_scale

diagnostics = pytest.importorskip("gpu_engine.diagnostics")


def _reference(r, w, tau):
    psi = np.clip(r, -tau, tau)
    rho = psi * (r - 0.5 * psi)
    total = float(len(r)) if w is None else float(np.sum(w, dtype=np.float64))
    loss = float(np.sum(rho if w is None else w * rho, dtype=np.float64)) / total
    return loss, outlier_share(r, tau, w), residual_scale(r, w)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize(
    "case", ["normal", "zero-weights", "exact-half", "integer-weights", "ties", "unweighted-even"]
)
def test_device_diagnostics_equal_the_reference_definitions(case, dtype):
    rng = np.random.default_rng(len(case))
    r = rng.standard_t(3, 1001).astype(dtype)
    w = rng.uniform(0.1, 3, r.size).astype(dtype)
    if case == "zero-weights":
        w[::3] = 0
    elif case == "exact-half":
        r, w = np.array([-2.0, -1.0, 0.5, 3.0], dtype), np.array([1, 1, 1, 1], dtype)
    elif case == "integer-weights":
        w = rng.integers(0, 4, r.size).astype(dtype)
        w[0] = 1
    elif case == "ties":
        r = np.round(r).astype(dtype)
    elif case == "unweighted-even":
        r, w = r[:1000], None
    tau = 1.345
    total = float(len(r)) if w is None else float(np.sum(w, dtype=np.float64))
    got = diagnostics.robust_diagnostics(np, r, w, tau, total)
    want = _reference(r, w, tau)
    rtol = 1e-12 if dtype == "float64" else 1e-6
    assert got[0] == pytest.approx(want[0], rel=rtol)
    assert got[1] == pytest.approx(want[1], rel=1e-12)
    assert got[2] == pytest.approx(want[2], rel=rtol)
