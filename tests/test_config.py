"""HuberConfig, HuberState and the data-independent rules of rh_dask.core."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest

from rh_dask import HuberConfig, HuberState, ValidationError
from rh_dask.core import (
    BatchSchedule,
    batch_schedule,
    penalty_mask,
    singular_rtol,
    soft_threshold,
    step_converged,
)


def test_defaults_match_the_estimator_parameters():
    assert HuberConfig().to_dict() == {
        "tau": 1.345,
        "penalty": "none",
        "lambda_scale": 1.0,
        "bandwidth_scale": 1.0,
        "fit_intercept": True,
        "max_iter": 100,
        "tol": 1e-6,
        "ridge": 1e-8,
        "dtype": "float64",
    }


def test_config_is_frozen_and_hashable():
    config = HuberConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.tau = 2.0
    assert {config: 1}[HuberConfig()] == 1


def test_json_round_trip_is_exact():
    config = HuberConfig(tau=0.1 + 0.2, penalty="l1", tol=1e-7, ridge=0.0, dtype="float32")
    assert HuberConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config


def test_numpy_scalars_are_normalised():
    config = HuberConfig(tau=np.float32(2.0), max_iter=np.int64(7), fit_intercept=np.bool_(False))
    assert type(config.tau) is float and type(config.max_iter) is int
    assert config.fit_intercept is False
    assert json.dumps(config.to_dict())  # JSON-serialisable
    assert config == HuberConfig(tau=2.0, max_iter=7, fit_intercept=False)


def test_from_dict_refuses_unknown_keys():
    with pytest.raises(ValidationError, match=r"unknown configuration keys.*alpha"):
        HuberConfig.from_dict({**HuberConfig().to_dict(), "alpha": 1.0})


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("tau", 0),
        ("tau", -0.5),
        ("tau", math.inf),
        ("tau", None),
        ("tau", True),
        ("bandwidth_scale", -1.0),
        ("tol", math.nan),
        ("lambda_scale", -1e-9),
        ("ridge", math.inf),
        ("penalty", "L1"),
        ("dtype", "float16"),
        ("dtype", np.float64),
        ("fit_intercept", 1),
        ("max_iter", 0),
        ("max_iter", -3),
        ("max_iter", 10.0),
        ("max_iter", np.bool_(True)),
    ],
)
def test_invalid_values_name_the_parameter(name, value):
    with pytest.raises(ValidationError, match=name):
        HuberConfig(**{name: value})


def test_zero_ridge_and_lambda_scale_are_allowed():
    config = HuberConfig(ridge=0, lambda_scale=0)
    assert config.ridge == 0.0 and config.lambda_scale == 0.0


def test_np_dtype_and_penalised():
    assert HuberConfig(dtype="float32").np_dtype == np.float32
    assert HuberConfig(penalty="l1").penalised and not HuberConfig().penalised


# -- the schedule ----------------------------------------------------------------


def _state(d, *, seen=0, weight=0.0, lam=0.0):
    state = HuberState.empty(d, True, "float64")
    state.n_samples_seen, state.weight_sum, state.previous_lambda = seen, weight, lam
    return state


@pytest.mark.parametrize("d", [1, 2, 3, 50])
def test_schedule_formulas(d):
    config = HuberConfig(penalty="l1", tau=1.5, lambda_scale=0.7, bandwidth_scale=2.0)
    got = batch_schedule(config, _state(d, seen=40, weight=30.0, lam=0.25), 20.0)
    log_d = math.log(max(d, 2))  # d = 1 uses ln 2, like d = 2
    assert got.total_weight == 50.0
    assert got.bandwidth == pytest.approx(min(2.0 / (math.sqrt(50) * log_d), 1.5), rel=1e-15)
    assert got.lambda_value == pytest.approx(0.7 * 1.5 * math.sqrt(log_d / 50), rel=1e-15)
    assert got.history_scale == pytest.approx(30.0 / 50.0 * 0.25, rel=1e-15)


def test_schedule_without_penalty_has_no_lambda_or_history():
    got = batch_schedule(HuberConfig(), _state(3, seen=10, weight=10.0, lam=0.3), 5.0)
    assert got == BatchSchedule(15.0, got.bandwidth, 0.0, 0.0)


def test_schedule_refuses_a_batch_without_weight():
    for bad in (0.0, -1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="batch weight"):
            batch_schedule(HuberConfig(), _state(2), bad)


def test_penalty_mask_leaves_the_intercept_free():
    np.testing.assert_array_equal(penalty_mask(3, True, "float64"), [1, 1, 1, 0])
    np.testing.assert_array_equal(penalty_mask(3, False, "float32"), [1, 1, 1])
    assert penalty_mask(2, True, "float32").dtype == np.float32


def test_soft_threshold():
    x = np.array([-3.0, -0.5, 0.0, 0.2, 2.0, 5.0])
    t = np.array([1.0, 1.0, 1.0, 1.0, 1.0, 0.0])
    np.testing.assert_array_equal(soft_threshold(x, t), [-2.0, 0.0, 0.0, 0.0, 1.0, 5.0])


def test_step_converged_is_relative_plus_absolute():
    assert step_converged(1e-6, 0.0, 1e-6)
    assert not step_converged(1.1e-6, 0.0, 1e-6)
    assert step_converged(1.0e-3, 999.0, 1e-6)
    assert not step_converged(1.1e-3, 999.0, 1e-6)


def test_singular_rtol_is_scale_free_and_dtype_aware():
    assert singular_rtol("float64", 3) == 10 * np.finfo(np.float64).eps
    assert singular_rtol("float32", 40) == 40 * np.finfo(np.float32).eps


# -- the portable state ------------------------------------------------------------


def test_empty_state():
    state = HuberState.empty(3, True, "float32")
    assert state.n_params == 4
    assert state.coefficients.dtype == np.float32 and not state.coefficients.any()
    assert state.information.shape == (4, 4) and not state.information.any()
    assert state.counters() == {
        "n_samples_seen": 0,
        "batch_count": 0,
        "previous_lambda": 0.0,
        "weight_sum": 0.0,
        "n_features_in": 3,
        "fit_intercept": True,
    }


def test_state_copy_and_equals_are_bitwise():
    state = HuberState.empty(2, False, "float64")
    state.coefficients[:] = [1.0, 2.0]
    copy = state.copy()
    assert copy.equals(state) and copy.coefficients is not state.coefficients
    copy.coefficients[0] = np.nextafter(1.0, 2.0)
    assert not copy.equals(state)
    assert not state.astype("float32").equals(state)  # dtype is part of equality
    other = state.copy()
    other.batch_count = 1
    assert not other.equals(state)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda s: setattr(s, "coefficients", np.zeros(3)), "coefficients have shape"),
        (lambda s: setattr(s, "information", np.zeros((4, 3))), "information has shape"),
        (lambda s: s.coefficients.__setitem__(0, np.nan), "non-finite"),
        (lambda s: setattr(s, "information", np.zeros((4, 4), int)), "floating point"),
        (lambda s: setattr(s, "n_samples_seen", -1), "non-negative"),
        (lambda s: setattr(s, "weight_sum", -1.0), "weight_sum"),
        (lambda s: setattr(s, "previous_lambda", math.inf), "previous_lambda"),
        (lambda s: setattr(s, "n_features_in", 0), "n_features_in"),
    ],
)
def test_state_validation(edit, message):
    state = HuberState.empty(3, True, "float64")
    state.validate()
    edit(state)
    with pytest.raises(ValidationError, match=message):
        state.validate()


def test_state_validation_checks_the_dtype():
    with pytest.raises(ValidationError, match="dtype"):
        HuberState.empty(3, True, "float32").validate(dtype="float64")
