"""The one-pass grid: GridEngine and RenewableHuberGridRegressor (NumPy engine)."""

from __future__ import annotations

import math

import dask
import dask.array as da
import dask.dataframe as dd
import numpy as np
import pandas as pd
import pytest
from sklearn.base import clone

from rh_dask import (
    BadChunkError,
    HuberConfig,
    NotFittedError,
    NumpyEngine,
    RenewableHuberGridRegressor,
    RenewableHuberRegressor,
    ValidationError,
)
from rh_dask.engines.grid import GridEngine

TAUS = (0.5, 1.345, 3.0, 100.0)


def _configs(taus=TAUS, **kw):
    return [HuberConfig(tau=t, **kw) for t in taus]


def _states_equal(a, b) -> bool:
    return all(x.equals(y) for x, y in zip(a, b, strict=True))


def test_each_configuration_is_bit_identical_to_its_own_single_fit(make_stream):
    s = make_stream(n=900, d=5, outlier_fraction=0.1, weights="uniform")
    batches = s.batches([300, 200, 400])
    grid = GridEngine(_configs())
    for X, y, w in batches:
        grid.partial_fit(X, y, w)
    for config, state in zip(grid.configs, grid.export_states(), strict=True):
        single = NumpyEngine(config)
        for X, y, w in batches:
            single.partial_fit(X, y, w)
        assert single.export_state().equals(state)
        assert single.coefficients().tobytes() == state.coefficients.tobytes()


def test_prequential_scores_by_hand(make_stream):
    s = make_stream(n=120, d=3, weights="uniform")
    batches = s.batches([40, 50, 30])
    ref = 0.8
    grid = GridEngine(_configs((0.7, 2.0)), reference_tau=ref)
    singles = [NumpyEngine(c) for c in grid.configs]
    for b, (X, y, w) in enumerate(batches):
        record = grid.partial_fit(X, y, w, chunk=b)
        for j, engine in enumerate(singles):
            if b == 0:
                assert np.isnan(record.huber_loss[j]) and np.isnan(record.mae[j])
            else:
                r = y - (X @ engine.coefficients()[:3] + engine.coefficients()[3])
                rho = np.where(np.abs(r) <= ref, 0.5 * r**2, ref * np.abs(r) - 0.5 * ref**2)
                np.testing.assert_allclose(record.huber_loss[j], np.sum(w * rho) / np.sum(w))
                np.testing.assert_allclose(record.mae[j], np.sum(w * np.abs(r)) / np.sum(w))
            engine.partial_fit(X, y, w)
        assert record.weight == pytest.approx(float(np.sum(w)))
        assert record.rows == len(y) and record.batch == b and record.chunk == b
    assert [r.scored for r in grid.records] == [False, True, True]


def test_a_records_weight_is_what_the_configurations_added_to_weight_sum():
    # Real-valued float64 weights whose plain sum rounds away from the exact one.
    rng = np.random.default_rng(3)
    n = 20_000
    X = rng.standard_normal((n, 3))
    y = X @ np.array([1.0, -2.0, 0.5]) + rng.standard_t(3, n)
    w = rng.uniform(0.5, 2.0, n)
    while math.fsum(w) == float(np.sum(w)):
        w = rng.uniform(0.5, 2.0, n)
    grid = GridEngine(_configs((0.7, 2.0)))
    assert grid.engines[0].last_batch_weight is None
    record = grid.partial_fit(X, y, w)
    assert record.weight == grid.engines[0].last_batch_weight == math.fsum(w)
    for state in grid.export_states():
        assert state.weight_sum == record.weight
    # A second batch: the record holds the batch's own sum, not the stream's.
    second = grid.partial_fit(X[:7000], y[:7000], w[:7000])
    assert second.weight == math.fsum(w[:7000])
    assert grid.partial_fit(X[:10], y[:10]).weight == 10.0
    # An engine that does not report it: the grid sums the weights itself.
    grid = GridEngine(_configs((0.7, 2.0)))
    grid.engines = (_Unreporting(grid.configs[0]), grid.engines[1])
    assert grid.partial_fit(X, y, w).weight == math.fsum(w)


def test_the_numpy_engines_last_batch_weight_follows_its_stream():
    rng = np.random.default_rng(4)
    X = rng.standard_normal((500, 3))
    y = X @ np.array([1.0, -2.0, 0.5]) + rng.standard_t(3, 500)
    w = rng.uniform(0.5, 2.0, 500)
    engine = NumpyEngine(_configs((1.0,))[0])
    assert engine.last_batch_weight is None
    engine.partial_fit(X, y, w)
    assert engine.last_batch_weight == math.fsum(w)
    state = engine.export_state()
    with pytest.raises(ValidationError):
        engine.partial_fit(X, y, -w)
    assert engine.last_batch_weight == math.fsum(w)  # a refused batch changes nothing
    engine.partial_fit(X[:200], y[:200])
    assert engine.last_batch_weight == 200.0
    engine.import_state(state)
    assert engine.last_batch_weight is None
    engine.partial_fit(X, y, w)
    engine.reset()
    assert engine.last_batch_weight is None


class _Unreporting(NumpyEngine):
    """A NumPy engine that does not report its batches' weight."""

    last_batch_weight = None


def test_estimator_totals_are_the_weighted_means_of_the_scored_batches(make_stream):
    s = make_stream(n=300, d=3)
    model = RenewableHuberGridRegressor(taus=(1.0, 2.0))
    for X, y, _ in s.batches([100, 50, 150]):
        model.partial_fit(X, y)
    pre = model.prequential_
    assert len(pre) == 6 and pre["huber_loss"].isna().sum() == 2
    scored = pre.dropna()
    for j in (0, 1):
        rows = scored[scored["config"] == j]
        expected = np.sum(rows["weight"] * rows["huber_loss"]) / rows["weight"].sum()
        assert model.configs_.loc[j, "huber_loss"] == pytest.approx(expected)
    assert list(model.configs_["scored_batches"]) == [2, 2]
    assert model.scores_.shape == (3, 2) and np.isnan(model.scores_[0]).all()


def test_selection_picks_a_small_tau_under_contaminated_errors(make_stream):
    s = make_stream(n=8000, d=4, noise_df=None, outlier_fraction=0.15, outlier_scale=40.0)
    model = RenewableHuberGridRegressor(taus=(0.5, 1.0, 1.345, 100.0))
    for X, y, _ in s.batches([1000] * 8):
        model.partial_fit(X, y)
    configs = model.configs_
    assert model.best_config_.tau <= 1.345
    assert configs.loc[3, "huber_loss"] > configs["huber_loss"].min()
    err = np.linalg.norm(model.coefs_ - s.coef, axis=1)
    assert err[model.best_index_] < err[3]
    assert model.configs_.loc[model.best_index_, "rank"] == 1
    mae = RenewableHuberGridRegressor(taus=(0.5, 1.0, 1.345, 100.0), criterion="mae")
    for X, y, _ in s.batches([1000] * 8):
        mae.partial_fit(X, y)
    assert mae.best_config_.tau <= 1.345


def test_selected_configuration_is_exposed_like_a_single_model(make_stream):
    s = make_stream(n=600, d=3, outlier_fraction=0.1)
    batches = s.batches([200, 200, 200])
    model = RenewableHuberGridRegressor(taus=(0.5, 1.345, 100.0))
    for X, y, _ in batches:
        model.partial_fit(X, y)
    best = model.best_index_
    single = RenewableHuberRegressor(tau=model.best_config_.tau)
    for X, y, _ in batches:
        single.partial_fit(X, y)
    assert model.coef_.tobytes() == single.coef_.tobytes()
    assert model.intercept_ == single.intercept_
    assert model.coefs_.shape == (3, 3) and model.intercepts_.shape == (3,)
    np.testing.assert_array_equal(model.predict(s.X), single.predict(s.X))
    assert model.score(s.X, s.y) == single.score(s.X, s.y)
    est = model.best_estimator_
    assert isinstance(est, RenewableHuberRegressor)
    assert est.state_.equals(single.state_)
    np.testing.assert_array_equal(est.cov_, single.cov_)
    assert model.best_params_ == {"tau": model.configs_.loc[best, "tau"], "lambda_scale": 1.0}
    with pytest.raises(ValidationError, match="index"):
        model.estimator_for(3)


def test_selection_needs_a_scored_batch(make_stream):
    s = make_stream(n=100, d=2)
    model = RenewableHuberGridRegressor(taus=(1.0, 2.0)).fit(s.X, s.y)
    assert model.coefs_.shape == (2, 2)
    assert np.isnan(model.configs_["huber_loss"]).all()
    with pytest.raises(NotFittedError, match="no batch has been scored"):
        model.best_index_
    with pytest.raises(NotFittedError):
        RenewableHuberGridRegressor().coefs_


def _grid_snapshot(model):
    grid = model._grid
    return grid.export_states(), len(grid.records), model.configs_.copy()


def test_a_refused_batch_leaves_every_configuration_as_it_was(make_stream):
    s = make_stream(n=300, d=3)
    model = RenewableHuberGridRegressor(taus=(0.5, 1.0, 2.0))
    for X, y, _ in s.batches([100, 100, 100]):
        model.partial_fit(X, y)
    states, n_records, configs = _grid_snapshot(model)
    bad_y = s.y[:50].copy()
    bad_y[3] = np.nan
    with pytest.raises(ValidationError):
        model.partial_fit(s.X[:50], bad_y)
    with pytest.raises(ValidationError):
        model.partial_fit(s.X[:50, :2], s.y[:50])
    with pytest.raises(ValidationError):
        model.partial_fit(s.X[:50], s.y[:50], -np.ones(50))
    after, n_after, configs_after = _grid_snapshot(model)
    assert _states_equal(states, after) and n_after == n_records
    pd.testing.assert_frame_equal(configs, configs_after)


class _Refusing(NumpyEngine):
    """A NumPy engine that refuses the batch it is handed after ``allow`` batches."""

    def __init__(self, config, allow):
        super().__init__(config)
        self.allow = allow

    def partial_fit(self, X, y, sample_weight=None):
        if self.batch_count >= self.allow:
            raise ValidationError("refused by this configuration")
        return super().partial_fit(X, y, sample_weight)


@pytest.mark.parametrize("allow", [0, 2])
def test_a_later_engine_refusing_restores_the_earlier_ones(make_stream, allow):
    s = make_stream(n=300, d=3)
    grid = GridEngine(_configs((0.5, 1.0, 2.0)))
    grid.engines = (*grid.engines[:2], _Refusing(grid.configs[2], allow))
    batches = s.batches([100, 100, 100])
    for X, y, w in batches[:allow]:
        grid.partial_fit(X, y, w)
    before = [e.export_state() if e.n_features_in else None for e in grid.engines]
    with pytest.raises(ValidationError, match="refused by this configuration"):
        grid.partial_fit(*batches[allow][:2])
    for engine, state in zip(grid.engines, before, strict=True):
        if state is None:
            assert engine.n_features_in is None
        else:
            assert engine.export_state().equals(state)
    assert len(grid.records) == allow


class _Wait:
    """What a stand-in's step yields: waiting for it is logged."""

    def __init__(self, log, name):
        self.log, self.name = log, name

    def synchronize(self):
        self.log.append(("wait", self.name))


class _Stepped(NumpyEngine):
    """A NumPy engine offering ``batch_steps`` (as the GPU engine does) to the grid.

    Each batch takes three resumes: the first fits the batch (the state is
    committed from then on), then two more yields, as a GPU solve that waits
    for its device between iterations. ``fail`` = (batch, resume, error)
    raises that error at that resume of that batch.
    """

    def __init__(self, config, name, log, fail=None):
        super().__init__(config)
        self.name, self.log, self.fail = name, log, fail

    def batch_steps(self, X, y, sample_weight=None):
        batch = self.batch_count
        diagnostics = None
        for resume in range(3):
            self.log.append(("step", self.name, resume))
            if self.fail is not None and self.fail[:2] == (batch, resume):
                raise self.fail[2]
            if resume == 0:
                diagnostics = super().partial_fit(X, y, sample_weight)
            yield _Wait(self.log, self.name)
        return diagnostics

    def hold(self):
        return None if self.n_features_in is None else self.export_state()

    def put_back(self, held):
        if held is None:
            self.reset()
        else:
            self.import_state(held)


def _stepped_grid(configs, log, failing=None, fail=None):
    """A concurrent grid of stand-ins; engine ``failing`` gets ``fail``."""
    grid = GridEngine(configs, concurrent=True)
    grid.engines = tuple(
        _Stepped(c, i, log, fail if i == failing else None) for i, c in enumerate(configs)
    )
    grid.concurrent = True
    return grid


def test_engines_with_steps_advance_in_rounds_with_the_same_bits(make_stream):
    """GPU grids interleave their engines' steps; here NumPy stand-ins take that path."""
    s = make_stream(n=600, d=4, outlier_fraction=0.1, weights="uniform")
    batches = s.batches([200, 150, 250])
    configs = _configs((0.5, 1.0, 2.0, 5.0))
    plain = GridEngine(configs)
    assert not plain.concurrent  # NumPy engines: one after the other
    for X, y, w in batches:
        plain.partial_fit(X, y, w)
    log = []
    grid = _stepped_grid(configs, log)
    for X, y, w in batches:
        grid.partial_fit(X, y, w)
    assert _states_equal(grid.export_states(), plain.export_states())
    assert [r.diagnostics for r in grid.records] == [r.diagnostics for r in plain.records]
    assert [r.huber_loss.tobytes() for r in grid.records] == [
        r.huber_loss.tobytes() for r in plain.records
    ]
    # Every engine is started before the host waits for any; each is resumed
    # only after its own wait.
    per_batch = len(log) // len(batches)
    assert per_batch == 4 * (3 + 3)
    for b in range(len(batches)):
        part = log[b * per_batch : (b + 1) * per_batch]
        assert part[:4] == [("step", i, 0) for i in range(4)]
        for i in range(4):
            own = [entry for entry in part if entry[1] == i]
            assert own == [x for resume in range(3) for x in (("step", i, resume), ("wait", i))]


@pytest.mark.parametrize(
    ("failing", "resume", "error"),
    [
        (2, 1, ValidationError("refused by this configuration")),  # 0 and 1 committed already
        (0, 2, KeyboardInterrupt()),  # Ctrl-C in the middle of a batch
        (3, 0, RuntimeError("a device fault")),
    ],
)
def test_a_failing_engine_puts_every_engine_back(make_stream, failing, resume, error):
    s = make_stream(n=600, d=4, outlier_fraction=0.1)
    batches = s.batches([200, 150, 250])
    log = []
    grid = _stepped_grid(_configs((0.5, 1.0, 2.0, 5.0)), log, failing, (2, resume, error))
    grid.partial_fit(*batches[0][:2])
    grid.partial_fit(*batches[1][:2])
    before = grid.export_states()
    with pytest.raises(type(error)):
        grid.partial_fit(*batches[2][:2])
    assert _states_equal(grid.export_states(), before)  # every engine put back
    assert len(grid.records) == 2 and grid.batch_count == 2
    # The round stopped at the failure: no engine after it was resumed again.
    assert log[-1] == ("step", failing, resume)


def test_concurrent_must_be_a_bool():
    with pytest.raises(ValidationError, match="concurrent"):
        GridEngine(_configs(), concurrent="yes")


def test_parameters_are_checked_before_anything_changes(make_stream):
    s = make_stream(n=100, d=2)
    with pytest.raises(ValidationError, match="lambda_scales"):
        RenewableHuberGridRegressor(lambda_scales=(1.0,)).fit(s.X, s.y)
    with pytest.raises(ValidationError, match="duplicate"):
        RenewableHuberGridRegressor(taus=(1.0, 1.0)).fit(s.X, s.y)
    with pytest.raises(ValidationError, match="at least one"):
        RenewableHuberGridRegressor(taus=()).fit(s.X, s.y)
    with pytest.raises(ValidationError, match="tau"):
        RenewableHuberGridRegressor(taus=(1.0, -2.0)).fit(s.X, s.y)
    with pytest.raises(ValidationError, match="criterion"):
        RenewableHuberGridRegressor(criterion="r2").fit(s.X, s.y)
    with pytest.raises(ValidationError, match="reference_tau"):
        RenewableHuberGridRegressor(reference_tau=0).fit(s.X, s.y)
    model = RenewableHuberGridRegressor(taus=(1.0, 2.0)).fit(s.X, s.y)
    states, _, _ = _grid_snapshot(model)
    model.set_params(taus=(1.0, 3.0))
    with pytest.raises(ValidationError, match="parameters changed"):
        model.partial_fit(s.X, s.y)
    assert _states_equal(states, model._grid.export_states())
    with pytest.raises(ValidationError, match="taus"):
        model.set_params(taus=(1.0, "x")).fit(s.X, s.y)
    assert _states_equal(states, model._grid.export_states())


def test_sklearn_clone_and_get_params():
    model = RenewableHuberGridRegressor(taus=(0.5, 2.0), penalty="l1", lambda_scales=(0.5, 1.0))
    params = model.get_params()
    assert params["taus"] == (0.5, 2.0) and params["lambda_scales"] == (0.5, 1.0)
    assert params["reference_tau"] == 1.345 and params["criterion"] == "huber"
    copy = clone(model)
    assert copy.get_params() == params and copy is not model
    assert not hasattr(copy, "coef_")


def test_l1_grid_over_taus_and_lambda_scales(make_stream):
    s = make_stream(n=1200, d=8, sparse=True)
    batches = s.batches([400, 400, 400])
    model = RenewableHuberGridRegressor(
        taus=(1.0, 2.0), penalty="l1", lambda_scales=(0.5, 2.0, 8.0)
    )
    for X, y, _ in batches:
        model.partial_fit(X, y)
    configs = model.configs_
    assert list(zip(configs["tau"], configs["lambda_scale"], strict=True)) == [
        (1.0, 0.5),
        (1.0, 2.0),
        (1.0, 8.0),
        (2.0, 0.5),
        (2.0, 2.0),
        (2.0, 8.0),
    ]
    nonzero = (model.coefs_ != 0).sum(axis=1)
    assert nonzero[2] <= nonzero[0] and nonzero[5] <= nonzero[3]
    single = RenewableHuberRegressor(tau=2.0, penalty="l1", lambda_scale=8.0)
    for X, y, _ in batches:
        single.partial_fit(X, y)
    assert model.coefs_[5].tobytes() == single.coef_.tobytes()


def test_dask_array_stream_each_chunk_once_equal_to_the_loop(make_stream):
    s = make_stream(n=600, d=3, weights="uniform")
    loop = RenewableHuberGridRegressor(taus=(0.7, 2.0))
    for X, y, w in s.batches([150] * 4):
        loop.partial_fit(X, y, w)
    calls = []

    def counted(block):
        calls.append(block.shape[0])
        return block

    X = da.from_array(s.X, chunks=(150, 3)).map_blocks(counted, dtype=s.X.dtype)
    y = da.from_array(s.y, chunks=150)
    w = da.from_array(s.sample_weight, chunks=150)
    calls.clear()  # map_blocks called it once on an empty block for the metadata
    with dask.config.set(scheduler="synchronous"):
        model = RenewableHuberGridRegressor(taus=(0.7, 2.0), lookahead=2).fit(X, y, w)
    assert calls == [150] * 4
    assert _states_equal(model._grid.export_states(), loop._grid.export_states())
    pd.testing.assert_frame_equal(model.configs_, loop.configs_)
    assert list(model.prequential_["chunk"].unique()) == [0, 1, 2, 3]
    lazy = model.predict(X)
    np.testing.assert_array_equal(lazy.compute(), loop.predict(s.X))


def test_dask_dataframe_stream_with_a_target_column_and_an_empty_partition(make_stream):
    s = make_stream(n=400, d=3)
    frame = pd.DataFrame(s.X, columns=["a", "b", "c"]).assign(target=s.y)
    parts = [frame.iloc[:200], frame.iloc[:0], frame.iloc[200:]]
    ddf = dd.concat([dd.from_pandas(p, npartitions=1) for p in parts])
    model = RenewableHuberGridRegressor(taus=(1.0, 2.0)).fit(ddf, "target")
    assert model.n_empty_chunks_ == 1
    assert list(model.feature_names_in_) == ["a", "b", "c"]
    assert list(model.prequential_["chunk"].unique()) == [0, 2]
    loop = RenewableHuberGridRegressor(taus=(1.0, 2.0))
    loop.partial_fit(frame.iloc[:200, :3], s.y[:200]).partial_fit(frame.iloc[200:, :3], s.y[200:])
    assert _states_equal(model._grid.export_states(), loop._grid.export_states())


def test_a_bad_chunk_stops_the_walk_after_the_good_ones(make_stream):
    s = make_stream(n=300, d=2)
    y = s.y.copy()
    y[250] = np.inf
    model = RenewableHuberGridRegressor(taus=(1.0, 2.0))
    with pytest.raises(BadChunkError) as info:
        model.fit(da.from_array(s.X, chunks=(100, 2)), da.from_array(y, chunks=100))
    assert info.value.chunk_index == 2
    assert model._grid.batch_count == 2
    fresh = RenewableHuberGridRegressor(taus=(1.0, 2.0))
    with pytest.raises(BadChunkError):
        fresh.fit(da.from_array(s.X[200:], chunks=(100, 2)), da.from_array(y[200:], chunks=100))
    assert not hasattr(fresh, "coefs_")
