"""Σw of a batch: the correctly rounded sum that every engine's counters share."""

from __future__ import annotations

import math

import numpy as np
import pytest

from rh_dask import HuberConfig, NumpyEngine
from rh_dask.core import _exact_sum, sum_weights


def _cases():
    rng = np.random.default_rng(11)
    yield "uniform", rng.uniform(0.5, 2.0, 20_000)
    yield "one", np.array([0.7])
    yield "whole numbers", rng.integers(0, 5, 10_000).astype(np.float64)
    yield "float32", rng.uniform(0.5, 2.0, 20_000).astype(np.float32)
    yield (
        "float32 wide range",
        (rng.uniform(0, 1, 5_000) * 10.0 ** rng.integers(-30, 30, 5_000)).astype(np.float32),
    )
    yield "float64 wide range", rng.uniform(0, 1, 5_000) * 10.0 ** rng.integers(-300, 300, 5_000)
    yield "subnormals", np.array([5e-324, 1e-310, 0.0, 2.5e-308, 3e-320])
    yield "float32 subnormals", np.array([1e-45, 1e-40, 0.0, 3e38], dtype=np.float32)
    yield "ties", np.array([1.0, 2.0**-53, 2.0**-53 * 0.5, 2.0**-53 * 0.5])


@pytest.mark.parametrize("name, w", list(_cases()), ids=[name for name, _ in _cases()])
def test_sum_weights_is_the_correctly_rounded_sum(name, w):
    assert sum_weights(w) == math.fsum(w.astype(np.float64).tolist())


def test_the_sum_does_not_depend_on_the_order_where_float_sums_do():
    # Two summation orders an engine might use (sequential, and 80 partial
    # sums added at the end, like a grid reduction) differ from each other and
    # from the correctly rounded sum, which no reordering changes.
    w = np.random.default_rng(0).uniform(0.5, 2.0, 20_000)
    exact = math.fsum(w.tolist())
    assert {sum_weights(w), sum_weights(w[::-1]), sum_weights(np.sort(w))} == {exact}
    sequential = float(np.cumsum(w)[-1])
    grid = float(np.sum(np.sum(w.reshape(-1, 80), axis=0)))
    assert len({sequential, grid, exact}) == 3


@pytest.mark.parametrize("seed", range(40))
def test_the_exact_sum_holds_for_adversarial_weights(seed):
    # Wide exponent ranges, subnormals, dyadic values with long carries and
    # sums at rounding ties: every extraction level must be exact.
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 5_000))
    kind = seed % 4
    if kind == 0:
        w = rng.uniform(0, 1, n) * 10.0 ** rng.integers(-300, 300, n)
    elif kind == 1:
        w = rng.uniform(0, 1, n) * 10.0 ** rng.integers(-323, -300, n)
    elif kind == 2:
        w = np.round(rng.uniform(0, 1e6, n)) * 2.0 ** rng.integers(-60, 60, n)
    else:
        w = np.concatenate([[1.0], np.full(n, 2.0**-54), rng.uniform(0.5, 2.0, n)])
    assert _exact_sum(w) == math.fsum(w.tolist())


def test_weights_near_the_float64_limit():
    w = np.array([1.5e308, 1e-300, 3.0])
    assert sum_weights(w) == math.fsum(w.tolist())


def test_overflow_zeros_and_empty():
    assert sum_weights(np.full(3, 1.7e308)) == math.inf
    assert sum_weights(np.zeros(4)) == 0.0
    assert sum_weights(np.zeros(0)) == 0.0


@pytest.mark.parametrize("bad", [-1.0, np.nan, np.inf])
def test_bad_weights_are_refused(bad):
    with pytest.raises(ValueError, match="finite and non-negative"):
        sum_weights(np.array([1.0, bad]))


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_the_numpy_engines_weight_sum_counter_is_correctly_rounded(dtype):
    rng = np.random.default_rng(3)
    engine = NumpyEngine(HuberConfig(dtype=dtype))
    expected = 0.0
    for n in (20_000, 7_001):
        X = rng.standard_normal((n, 4)).astype(dtype)
        y = (X @ np.arange(1.0, 5.0) + rng.standard_normal(n)).astype(dtype)
        w = rng.uniform(0.5, 2.0, n).astype(dtype)
        engine.partial_fit(X, y, w)
        expected = expected + math.fsum(w.astype(np.float64).tolist())
        assert engine.export_state().weight_sum == expected
