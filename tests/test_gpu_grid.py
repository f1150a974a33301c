"""A grid of GPU engines (GridEngine with engine="gpu") on a real CUDA device.

Skipped (with the reason) where CuPy or a CUDA device is missing, as on CI.
On a GPU machine:

    PYTHONPATH=. pytest -q -m gpu tests/test_gpu_grid.py
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from devices import gpu_usable

cp = pytest.importorskip("cupy", reason="the GPU engine needs CuPy")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not gpu_usable(), reason="no CUDA device visible to CuPy"),
]

from rh_dask import HuberConfig, make_engine  # noqa: E402
from rh_dask.datasets import StreamSpec  # noqa: E402
from rh_dask.engines.grid import GridEngine, prequential_scores  # noqa: E402
from rh_dask.exceptions import ValidationError  # noqa: E402

TAUS = (0.5, 1.0, 1.345, 3.0, 10.0)


def _batches(features, sizes, dtype, weights=False, seed=11):
    spec = StreamSpec(n_features=features, seed=seed)
    X, y = spec.chunk(0, sum(sizes), "float64")
    X, y = X.astype(dtype), y.astype(dtype)
    rng = np.random.default_rng(seed)
    out, start = [], 0
    for size in sizes:
        part = [X[start : start + size], y[start : start + size]]
        if weights:
            part.append(rng.uniform(0.5, 2.0, size).astype(dtype))
        out.append(tuple(part))
        start += size
    return out


def _single_states(configs, batches):
    states = []
    for config in configs:
        engine = make_engine("gpu", config)
        for batch in batches:
            engine.partial_fit(*batch)
        states.append(engine.export_state())
        engine.close()
    return states


@pytest.mark.parametrize("concurrent", [True, False])
@pytest.mark.parametrize(
    ("features", "dtype", "weights", "penalty"),
    [
        (90, "float32", False, "none"),
        (90, "float64", True, "none"),
        (16, "float32", True, "l1"),
        (300, "float64", False, "none"),  # a wide design: cuSOLVER and grid kernels
    ],
)
def test_every_configuration_is_bit_identical_to_its_own_single_fit(
    concurrent, features, dtype, weights, penalty
):
    batches = _batches(features, [20000, 20000, 7000], dtype, weights)
    configs = [HuberConfig(tau=t, dtype=dtype, penalty=penalty) for t in TAUS]
    grid = GridEngine(configs, "gpu", concurrent=concurrent)
    assert grid.concurrent is concurrent
    records = list(grid.partial_fit_stream(batches))
    assert len(records) == len(batches) and records[1].scored
    for record, batch in zip(records, batches, strict=True):
        # The weight the configurations added to weight_sum, summed on the device.
        exact = math.fsum(batch[2].astype(np.float64).tolist()) if weights else len(batch[1])
        assert record.weight == exact
    for single, state in zip(_single_states(configs, batches), grid.export_states(), strict=True):
        assert single.equals(state)
    grid.close()


def test_device_batches_and_host_batches_give_the_same_bits():
    batches = _batches(40, [10000, 12000, 9000], "float32", weights=True)
    configs = [HuberConfig(tau=t, dtype="float32") for t in TAUS]
    host = GridEngine(configs, "gpu", concurrent=True)
    for batch in batches:
        host.partial_fit(*batch)
    device = GridEngine(configs, "gpu", concurrent=True)
    for batch in batches:
        device.partial_fit(*(cp.asarray(a) for a in batch))
    for a, b in zip(host.export_states(), device.export_states(), strict=True):
        assert a.equals(b)
    for a, b in zip(host.records, device.records, strict=True):
        assert a.huber_loss.tobytes() == b.huber_loss.tobytes()
        assert a.mae.tobytes() == b.mae.tobytes()
    host.close()
    device.close()


@pytest.mark.parametrize("weights", [False, True])
def test_device_scores_match_the_host_formula(weights):
    batches = _batches(30, [5000, 6000, 4000], "float64", weights=weights)
    configs = [HuberConfig(tau=t) for t in TAUS]
    grid = GridEngine(configs, "gpu", reference_tau=0.9)
    for i, batch in enumerate(batches):
        betas = None if i == 0 else np.stack([e.coefficients() for e in grid.engines], axis=1)
        record = grid.partial_fit(*batch)
        if betas is None:
            assert not record.scored
            continue
        X, y = batch[0], batch[1]
        w = batch[2] if weights else None
        huber, mae = prequential_scores(np, X, y, w, betas, True, 0.9)
        np.testing.assert_allclose(record.huber_loss, huber, rtol=1e-12)
        np.testing.assert_allclose(record.mae, mae, rtol=1e-12)
    grid.close()


def test_scores_of_a_configuration_do_not_depend_on_the_others():
    """What a grid split over several actors relies on: each score is its own."""
    batches = _batches(50, [8000, 8000, 8000], "float32")
    configs = [HuberConfig(tau=t, dtype="float32") for t in TAUS]
    whole = GridEngine(configs, "gpu")
    part = GridEngine(configs[2:4], "gpu")
    for batch in batches:
        a = whole.partial_fit(*batch)
        b = part.partial_fit(*batch)
    assert a.huber_loss[2:4].tobytes() == b.huber_loss.tobytes()
    assert a.mae[2:4].tobytes() == b.mae.tobytes()
    whole.close()
    part.close()


@pytest.mark.parametrize("concurrent", [True, False])
def test_a_refused_batch_leaves_every_configuration_as_it_was(concurrent):
    batches = _batches(20, [3000, 3000], "float32")
    configs = [HuberConfig(tau=t, dtype="float32") for t in TAUS]
    grid = GridEngine(configs, "gpu", concurrent=concurrent)
    grid.partial_fit(*batches[0])
    before = grid.export_states()
    X, y = batches[1]
    bad = X.copy()
    bad[17, 3] = np.nan
    with pytest.raises(ValidationError, match="finite"):
        grid.partial_fit(bad, y)
    with pytest.raises(ValidationError, match="finite"):
        grid.partial_fit(cp.asarray(bad), cp.asarray(y))
    with pytest.raises(ValidationError):
        grid.partial_fit(X.astype("float64"), y.astype("float64"))
    for a, b in zip(before, grid.export_states(), strict=True):
        assert a.equals(b)
    assert len(grid.records) == 1
    grid.partial_fit(X, y)  # and the grid goes on as if nothing happened
    for single, state in zip(_single_states(configs, batches), grid.export_states(), strict=True):
        assert single.equals(state)
    grid.close()


def test_a_failure_in_the_middle_of_a_batch_puts_every_engine_back(monkeypatch):
    """A configuration failing after others committed (a device fault, Ctrl-C)."""
    batches = _batches(20, [3000, 3000, 3000], "float32")
    configs = [HuberConfig(tau=t, dtype="float32") for t in TAUS]
    grid = GridEngine(configs, "gpu", concurrent=True)
    grid.partial_fit(*batches[0])
    grid.partial_fit(*batches[1])
    before = grid.export_states()
    victim = grid.engines[3]
    real = victim.batch_steps

    def failing(*args, **kwargs):
        steps = real(*args, **kwargs)
        yield next(steps)
        yield next(steps)
        raise KeyboardInterrupt

    monkeypatch.setattr(victim, "batch_steps", failing)
    with pytest.raises(KeyboardInterrupt):
        grid.partial_fit(*batches[2])
    for a, b in zip(before, grid.export_states(), strict=True):
        assert a.equals(b)
    assert [e.coefficients().tobytes() for e in grid.engines] == [
        s.coefficients.tobytes() for s in before
    ]
    monkeypatch.undo()
    grid.partial_fit(*batches[2])
    for single, state in zip(_single_states(configs, batches), grid.export_states(), strict=True):
        assert single.equals(state)
    grid.close()


def test_a_first_batch_failing_leaves_an_empty_grid():
    batches = _batches(20, [3000], "float32")
    configs = [HuberConfig(tau=t, dtype="float32") for t in TAUS]
    grid = GridEngine(configs, "gpu", concurrent=True)
    X, y = batches[0]
    bad = y.copy()
    bad[5] = np.inf
    with pytest.raises(ValidationError):
        grid.partial_fit(X, bad)
    assert grid.n_features_in is None and not grid.records
    grid.partial_fit(X, y)
    for single, state in zip(_single_states(configs, batches), grid.export_states(), strict=True):
        assert single.equals(state)
    grid.close()
