"""RenewableHuberRegressor: the user-facing estimator (issue item 2)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from rh_dask import (
    BatchDiagnostics,
    HuberConfig,
    HuberState,
    NotFittedError,
    NumpyEngine,
    RenewableHuberRegressor,
)

DEFAULTS = {
    "tau": 1.345,
    "penalty": "none",
    "lambda_scale": 1.0,
    "bandwidth_scale": 1.0,
    "fit_intercept": True,
    "max_iter": 100,
    "tol": 1e-6,
    "ridge": 1e-8,
    "engine": "auto",
    "device": None,
    "dtype": "float64",
}


def test_default_parameters_are_the_documented_ones():
    params = RenewableHuberRegressor().get_params()
    # Other issues may add keyword parameters; the ones of issue 2 keep their defaults.
    assert {k: params[k] for k in DEFAULTS} == DEFAULTS


def test_parameters_are_keyword_only():
    with pytest.raises(TypeError):
        RenewableHuberRegressor(2.0)


def test_partial_fit_consumes_one_batch_and_mirrors_the_engine(make_stream):
    s = make_stream(300, 4, seed=1, weights="integer")
    model = RenewableHuberRegressor()
    engine = NumpyEngine(HuberConfig())
    for i, (X, y, w) in enumerate(s.batches([100, 100, 100]), start=1):
        assert model.partial_fit(X, y, w) is model
        diag = engine.partial_fit(X, y, w)
        assert model.state_.equals(engine.export_state())
        assert model.diagnostics_ == diag
        assert model.n_iter_ == diag.iterations
        assert model.n_samples_seen_ == 100 * i
        # One coefficient row per batch, appended: β after that batch, exactly.
        assert model.coef_history_.shape == (i, 5) == (len(model.history_), 5)
        np.testing.assert_array_equal(model.coef_history_[-1], engine.coefficients())
        assert model.placement_ is None
    state = engine.export_state()
    np.testing.assert_array_equal(model.coef_, state.coefficients[:4])
    assert model.intercept_ == state.coefficients[4]
    assert model.n_features_in_ == 4
    assert model.engine_ == "numpy"
    assert not hasattr(model, "feature_names_in_")


def test_fitted_attributes_have_the_documented_types(make_stream):
    s = make_stream(200, 3, seed=2)
    model = RenewableHuberRegressor().fit(s.X, s.y)
    assert isinstance(model.state_, HuberState)
    assert isinstance(model.diagnostics_, BatchDiagnostics)
    assert model.coef_.shape == (3,) and isinstance(model.intercept_, float)
    assert isinstance(model.state_.coefficients, np.ndarray)
    fields = {
        "coefficients",
        "information",
        "n_samples_seen",
        "batch_count",
        "previous_lambda",
        "weight_sum",
        "n_features_in",
        "fit_intercept",
    }
    assert fields <= set(vars(model.state_))
    diagnostics = {"iterations", "converged", "objective", "lambda_value", "bandwidth"}
    assert set(model.diagnostics_.to_dict()) == diagnostics


def test_fit_resets_and_consumes_one_batch(make_stream):
    s = make_stream(400, 3, seed=3, weights="uniform")
    model = RenewableHuberRegressor()
    for batch in s.batches([200, 200]):
        model.partial_fit(*batch)
    model.fit(s.X, s.y, s.sample_weight)
    single = NumpyEngine(HuberConfig())
    single.partial_fit(s.X, s.y, s.sample_weight)
    assert model.state_.equals(single.export_state())
    assert model.state_.batch_count == 1 and model.n_samples_seen_ == 400
    np.testing.assert_array_equal(model.coef_history_, single.coefficients()[None, :])


def test_fit_starts_a_new_stream_of_another_width(make_stream):
    model = RenewableHuberRegressor().fit(make_stream(100, 3).X, make_stream(100, 3).y)
    other = make_stream(100, 5, seed=4)
    model.fit(other.X, other.y)
    assert model.n_features_in_ == 5 and model.coef_.shape == (5,)


def test_reset_forgets_everything(make_stream):
    s = make_stream(100, 3, seed=5)
    frame = pd.DataFrame(s.X, columns=["a", "b", "c"])
    model = RenewableHuberRegressor().fit(frame, s.y)
    assert model.reset() is model
    for name in ("n_features_in_", "feature_names_in_", "n_iter_", "diagnostics_", "engine_"):
        assert not hasattr(model, name), name
    for name in (
        "coef_",
        "intercept_",
        "state_",
        "n_samples_seen_",
        "history_",
        "coef_history_",
        "placement_",
    ):
        with pytest.raises(NotFittedError):
            getattr(model, name)
    # After a reset, a stream of another width and dtype starts cleanly.
    model.set_params(dtype="float32")
    model.partial_fit(s.X[:, :2], s.y)
    assert model.state_.coefficients.dtype == np.float32 and model.n_features_in_ == 2
    assert model.coef_history_.shape == (1, 3) and len(model.history_) == 1


@pytest.mark.parametrize("fit_intercept", [True, False])
def test_coef_history_is_float64_and_ends_at_the_model(make_stream, fit_intercept):
    s = make_stream(300, 3, seed=6)
    model = RenewableHuberRegressor(dtype="float32", fit_intercept=fit_intercept)
    betas = []
    for X, y, w in s.batches([100, 100, 100]):
        model.partial_fit(X, y, w)
        betas.append(model.state_.coefficients.astype(np.float64))
    history = model.coef_history_
    assert history.dtype == np.float64 and history.shape == (3, 3 + fit_intercept)
    np.testing.assert_array_equal(history, np.stack(betas))  # float32 -> float64 is exact
    final = np.append(model.coef_, model.intercept_) if fit_intercept else model.coef_
    np.testing.assert_array_equal(history[-1], final)
    # A copy: changing it changes nothing in the model.
    history[:] = 0
    assert model.coef_history_[-1, 0] != 0


def test_coef_history_survives_pickle_but_not_checkpoints(make_stream, tmp_path):
    import pickle

    s = make_stream(300, 3, seed=7)
    model = RenewableHuberRegressor()
    for batch in s.batches([100, 100, 100]):
        model.partial_fit(*batch)
    clone = pickle.loads(pickle.dumps(model))
    np.testing.assert_array_equal(clone.coef_history_, model.coef_history_)
    loaded = RenewableHuberRegressor.load(model.save(tmp_path / "m.npz"))
    assert loaded.coef_history_.shape == (0, 4) and len(loaded.history_) == 0
    assert loaded.placement_ is None


def test_unfitted_model_raises_not_fitted(make_stream):
    model = RenewableHuberRegressor()
    with pytest.raises(NotFittedError):
        model.predict(make_stream(10, 3).X)
    with pytest.raises(NotFittedError):
        model.coef_
    assert issubclass(NotFittedError, AttributeError)  # so hasattr(model, "coef_") is False
    assert not hasattr(model, "coef_")


def test_state_is_a_copy(make_stream):
    s = make_stream(100, 3, seed=6)
    model = RenewableHuberRegressor().fit(s.X, s.y)
    state = model.state_
    state.coefficients[:] = 0.0
    state.information[:] = 0.0
    assert np.all(model.state_.coefficients != 0.0)
    coef = model.coef_
    coef[:] = 0.0
    assert np.all(model.coef_ != 0.0)


def test_predict_and_intercept_conventions(make_stream):
    s = make_stream(300, 3, seed=7)
    with_icpt = RenewableHuberRegressor().fit(s.X, s.y)
    np.testing.assert_allclose(
        with_icpt.predict(s.X), s.X @ with_icpt.coef_ + with_icpt.intercept_, rtol=1e-14
    )
    without = RenewableHuberRegressor(fit_intercept=False).fit(s.X, s.y)
    assert without.intercept_ == 0.0
    assert without.state_.coefficients.shape == (3,)
    np.testing.assert_allclose(without.predict(s.X), s.X @ without.coef_, rtol=1e-14)


def test_float32_model_predicts_in_float32(make_stream):
    s = make_stream(200, 3, seed=8)
    model = RenewableHuberRegressor(dtype="float32").fit(s.X, s.y)
    assert model.predict(s.X).dtype == np.float32
    assert model.coef_.dtype == np.float32


def test_score_is_the_weighted_r2(make_stream):
    s = make_stream(300, 3, seed=9, weights="uniform", noise_df=None)
    model = RenewableHuberRegressor().fit(s.X, s.y)
    pred = model.predict(s.X)
    w = s.sample_weight
    mean = np.average(s.y, weights=w)
    r2_weighted = 1 - np.dot(w, (s.y - pred) ** 2) / np.dot(w, (s.y - mean) ** 2)
    r2_plain = 1 - np.sum((s.y - pred) ** 2) / np.sum((s.y - s.y.mean()) ** 2)
    assert model.score(s.X, s.y, sample_weight=w) == pytest.approx(r2_weighted, rel=1e-12)
    assert model.score(s.X, s.y) == pytest.approx(r2_plain, rel=1e-12)
    assert r2_weighted != pytest.approx(r2_plain, rel=1e-6)


def test_dataframe_stream_records_feature_names(make_stream):
    s = make_stream(200, 3, seed=10)
    frame = pd.DataFrame(s.X, columns=["alpha", "beta", "gamma"])
    model = RenewableHuberRegressor()
    model.partial_fit(frame.iloc[:100], pd.Series(s.y[:100]))
    model.partial_fit(frame.iloc[100:], s.y[100:])
    assert list(model.feature_names_in_) == ["alpha", "beta", "gamma"]
    with pytest.warns(UserWarning, match="does not have valid feature names"):
        plain = model.predict(frame.to_numpy())
    np.testing.assert_array_equal(model.predict(frame), plain)


def test_scalar_sample_weight_is_a_frequency_weight(make_stream):
    # A constant weight c scales N by c: the bandwidth and λ change like a c-fold
    # repetition of every row, and so the estimate equals the repeated stream's.
    s = make_stream(200, 3, seed=11)
    weighted = RenewableHuberRegressor().fit(s.X, s.y, sample_weight=3)
    repeated = RenewableHuberRegressor().fit(np.repeat(s.X, 3, axis=0), np.repeat(s.y, 3))
    np.testing.assert_allclose(weighted.coef_, repeated.coef_, rtol=1e-10)
    assert weighted.state_.weight_sum == 600.0 and weighted.n_samples_seen_ == 200


def test_auto_engine_resolves_to_numpy(make_stream):
    s = make_stream(50, 2)
    model = RenewableHuberRegressor(engine="auto").fit(s.X, s.y)
    assert model.engine_ == "numpy"
    assert model.engine == "auto"  # the parameter is left as given


def test_robust_fit_beats_least_squares_on_contaminated_data(make_stream):
    s = make_stream(4000, 4, seed=12, noise_df=2.0, outlier_fraction=0.1, outlier_scale=40.0)
    model = RenewableHuberRegressor()
    for batch in s.batches([1000] * 4):
        model.partial_fit(*batch)
    truth = np.r_[s.coef, s.intercept]
    Z = np.column_stack([s.X, np.ones(len(s.y))])
    ols = np.linalg.lstsq(Z, s.y, rcond=None)[0]
    huber_error = np.linalg.norm(np.r_[model.coef_, model.intercept_] - truth)
    assert huber_error < 0.2
    assert huber_error < 0.5 * np.linalg.norm(ols - truth)
