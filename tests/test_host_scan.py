"""The estimator's host scan for NaN and inf, skipped where the GPU engine scans on the device.

The GPU engine refuses non-finite X and y in its first kernel (a
``ValidationError`` from the call that passed the batch, the model
unchanged), so ``engine="gpu"`` does not read every batch a second time on
the host. Here a NumPy engine stands in for it (named ``"gpu"``, refusing
non-finite values itself as the real one does), so that the rule runs on CPU.
"""

from __future__ import annotations

import numpy as np
import pytest

import rh_dask.stream as stream_module
from rh_dask import HuberConfig, NumpyEngine, RenewableHuberRegressor, ValidationError

DEVICE_MESSAGE = "X and y must be finite (found NaN or infinity)"


class _DeviceScanning(NumpyEngine):
    """Stands in for the GPU engine: its own finiteness check, counted."""

    name = "gpu"
    calls = 0

    def partial_fit(self, X, y, sample_weight=None):
        type(self).calls += 1
        if not (np.isfinite(X).all() and np.isfinite(y).all()):
            raise ValidationError(DEVICE_MESSAGE)
        return super().partial_fit(X, y, sample_weight)


@pytest.fixture
def gpu_stand_in(monkeypatch):
    _DeviceScanning.calls = 0

    def make(name, config, device=None, **kwargs):
        if name == "gpu":
            return _DeviceScanning(config)
        return NumpyEngine(config)

    monkeypatch.setattr(stream_module, "make_engine", make)
    return _DeviceScanning


def _batch(seed=0, n=200, d=4):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, d)), rng.normal(size=n)


@pytest.mark.parametrize("where", ["X", "y"])
def test_engine_gpu_leaves_the_scan_to_the_engine_and_the_model_unchanged(gpu_stand_in, where):
    X, y = _batch()
    bad_X, bad_y = X.copy(), y.copy()
    if where == "X":
        bad_X[7, 2] = np.nan
    else:
        bad_y[3] = np.inf
    model = RenewableHuberRegressor(engine="gpu")
    with pytest.raises(ValidationError, match="found NaN or infinity"):
        model.partial_fit(bad_X, bad_y)
    assert gpu_stand_in.calls == 1  # it reached the engine: no host scan
    assert not hasattr(model, "coef_")
    model.partial_fit(X, y)
    before = model.coef_.copy()
    with pytest.raises(ValidationError, match="found NaN or infinity"):
        model.partial_fit(bad_X, bad_y)  # a started stream: the engine refuses again
    assert gpu_stand_in.calls == 3
    np.testing.assert_array_equal(model.coef_, before)
    assert model.state_.batch_count == 1
    with pytest.raises(ValidationError, match="found NaN or infinity"):
        RenewableHuberRegressor(engine="gpu").fit(bad_X, bad_y)
    assert gpu_stand_in.calls == 4


@pytest.mark.parametrize("engine", ["numpy", "auto"])
def test_other_engines_keep_the_host_scan(gpu_stand_in, engine):
    X, y = _batch()
    X[5, 1] = np.nan
    model = RenewableHuberRegressor(engine=engine)
    with pytest.raises(ValidationError, match="NaN") as refused:
        model.partial_fit(X, y)
    assert DEVICE_MESSAGE not in str(refused.value)  # refused on the host, before any engine
    with pytest.raises(ValidationError, match="NaN"):
        model.fit(X, y)
    assert gpu_stand_in.calls == 0


def test_weights_are_always_scanned_on_the_host(gpu_stand_in):
    X, y = _batch()
    w = np.ones(len(y))
    w[4] = -1.0
    with pytest.raises(ValidationError, match="sample_weight"):
        RenewableHuberRegressor(engine="gpu").partial_fit(X, y, w)
    assert gpu_stand_in.calls == 0


def test_the_stand_in_is_built_with_the_streams_configuration(gpu_stand_in):
    X, y = _batch(seed=3)
    model = RenewableHuberRegressor(engine="gpu", tau=2.0).partial_fit(X, y)
    ref = NumpyEngine(HuberConfig(tau=2.0))
    ref.partial_fit(X, y)
    np.testing.assert_allclose(model.coef_, ref.coefficients()[:-1])
