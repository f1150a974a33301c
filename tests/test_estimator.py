"""RenewableHuberRegressor: the user-facing estimator (issue item 2)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from devices import gpu_usable

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
    optional = {"mean_loss", "outlier_share", "residual_scale"}
    assert set(model.diagnostics_.to_dict()) == diagnostics | optional


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


# -- a refused call changes nothing -----------------------------------------------------
def _everything(model) -> dict:
    """Every observable attribute of ``model`` (fitted or not), arrays as bytes.

    Also the parameters, the attribute names and the engine object itself: a
    refused call must not set a parameter, add an attribute or swap in an
    engine it started.
    """
    out = {
        "params": repr(model.get_params()),
        "keys": sorted(vars(model)),
        "stream_object": id(vars(model).get("_stream")),
        "engine_object": id(_engine_of(model)),
        "fitted": hasattr(model, "n_features_in_"),
    }
    if not out["fitted"]:
        return out
    state = model.state_
    history = model.history_
    out.update(
        coef=(model.coef_.dtype.str, model.coef_.tobytes()),
        intercept=model.intercept_,
        state_arrays=(state.coefficients.tobytes(), state.information.tobytes()),
        counters=state.counters(),
        history=(history.to_dict("list"), str(history.dtypes)),
        coef_history=model.coef_history_.tobytes(),
        n_features_in=model.n_features_in_,
        feature_names_in=list(getattr(model, "feature_names_in_", [])),
        n_iter=getattr(model, "n_iter_", None),
        diagnostics=getattr(model, "diagnostics_", None),
        engine=model.engine_,
        n_samples_seen=model.n_samples_seen_,
        n_empty_chunks=model.n_empty_chunks_,
        placement=model.placement_,
    )
    return out


def _engine_of(model):
    """The engine object holding ``model``'s stream (``None`` when it has none)."""
    stream = vars(model).get("_stream")
    return None if stream is None else stream.engine


def _frame(X, names=("a", "b", "c")):
    return pd.DataFrame(X, columns=list(names))


@pytest.fixture
def fitted(make_stream):
    """A model part-way through a named stream, and the stream."""
    s = make_stream(400, 3, seed=31, weights="uniform")
    model = RenewableHuberRegressor(progress=False)
    for X, y, w in s.batches([200, 100, 100])[:2]:
        model.partial_fit(_frame(X), y, w)
    return model, s


def _dask_stream(X, y, chunks=100):
    import dask.array as da

    return da.from_array(X, chunks=(chunks, X.shape[1])), da.from_array(y, chunks=chunks)


def _refusals(s):
    """(label, call) pairs: each call must be refused up front by a fitted model."""
    import dask.array as da
    import dask.dataframe as dd

    X, y = s.X[300:], s.y[300:]
    Xd, yd = _dask_stream(X, y, 50)
    frame = dd.from_pandas(_frame(X).assign(t=y), npartitions=2)
    cases = {
        "memory_short_y": lambda m, fit: fit(m)(_frame(X), y[:-1]),
        "memory_wrong_width": lambda m, fit: fit(m)(X[:, :2], y),
        "memory_renamed": lambda m, fit: fit(m)(_frame(X, "abd"), y),
        "dask_short_y": lambda m, fit: fit(m)(Xd, da.from_array(y[:-1], chunks=50)),
        "dask_misaligned_y": lambda m, fit: fit(m)(Xd, dd.from_pandas(pd.Series(y), 3)),
        "dask_short_weights": lambda m, fit: fit(m)(
            Xd, yd, da.from_array(np.abs(y[1:]) + 1, chunks=50)
        ),
        "dask_wrong_width": lambda m, fit: fit(m)(Xd[:, :2], yd),
        "dask_missing_column": lambda m, fit: fit(m)(frame, "nope"),
        "dask_renamed": lambda m, fit: fit(m)(frame.rename(columns={"c": "d"}), "t"),
        "dask_two_column_y": lambda m, fit: fit(m)(Xd, da.stack([yd, yd], axis=1)),
    }
    return cases


#: Refusals of a fitted model, and the methods refusing them (``fit`` starts a
#: new stream, so another width or other names are fine there).
_REFUSED = {
    "memory_short_y": ("fit", "partial_fit"),
    "memory_wrong_width": ("partial_fit",),
    "memory_renamed": ("partial_fit",),
    "dask_short_y": ("fit", "partial_fit"),
    "dask_misaligned_y": ("fit", "partial_fit"),
    "dask_short_weights": ("fit", "partial_fit"),
    "dask_wrong_width": ("partial_fit",),
    "dask_missing_column": ("fit", "partial_fit"),
    "dask_renamed": ("partial_fit",),
    "dask_two_column_y": ("fit", "partial_fit"),
}


@pytest.mark.parametrize(
    ("case", "method"), [(c, m) for c, methods in _REFUSED.items() for m in methods]
)
def test_a_refused_call_leaves_a_fitted_model_exactly_as_it_was(fitted, case, method):
    from rh_dask import ValidationError

    model, s = fitted
    call = _refusals(s)[case]
    before = _everything(model)
    with pytest.raises(ValidationError):
        call(model, lambda m: getattr(m, method))
    assert _everything(model) == before
    # ... and the stream continues as if the call had never happened.
    X, y, w = s.batches([200, 100, 100])[2]
    model.partial_fit(_frame(X), y, w)
    reference = RenewableHuberRegressor()
    for Xb, yb, wb in s.batches([200, 100, 100]):
        reference.partial_fit(_frame(Xb), yb, wb)
    assert model.state_.equals(reference.state_)


@pytest.mark.parametrize("dask_input", [False, True], ids=["memory", "dask"])
@pytest.mark.parametrize(
    ("param", "value"),
    [("tau", -1.0), ("engine", "tpu"), ("dtype", "float16"), ("max_iter", 0)],
)
def test_bad_parameters_refuse_fit_before_the_model_changes(fitted, dask_input, param, value):
    from rh_dask import ValidationError

    model, s = fitted
    X, y = s.X[300:], s.y[300:]
    if dask_input:
        X, y = _dask_stream(X, y)
    model.set_params(**{param: value})
    before = _everything(model)
    for method in (model.fit, model.partial_fit):
        with pytest.raises(ValidationError, match=param if param != "engine" else "engine"):
            method(X, y)
        assert _everything(model) == before


@pytest.mark.parametrize(
    ("param", "value"),
    [("loader", "nowhere"), ("lookahead", 0), ("lookahead", "fast"), ("worker", 7)],
)
def test_bad_walk_parameters_refuse_a_dask_fit_before_the_model_changes(fitted, param, value):
    from rh_dask import ValidationError

    model, s = fitted
    model.set_params(**{param: value})
    before = _everything(model)
    Xd, yd = _dask_stream(s.X[300:], s.y[300:])
    for method in (model.fit, model.partial_fit):
        with pytest.raises(ValidationError, match=param):
            method(Xd, yd)
        assert _everything(model) == before


def test_a_dask_fit_whose_first_chunk_is_bad_keeps_the_previous_model(fitted):
    from rh_dask import BadChunkError

    model, s = fitted
    X = s.X[200:].copy()
    X[10, 1] = np.nan  # chunk 0
    before = _everything(model)
    with pytest.raises(BadChunkError, match=r"chunk 0 was refused.*NaN") as caught:
        model.fit(*_dask_stream(X, s.y[200:]))
    assert caught.value.chunk_index == 0
    assert isinstance(caught.value, ValueError)
    assert _everything(model) == before


def test_a_dask_fit_of_empty_chunks_only_keeps_the_previous_model(fitted):
    import dask.array as da

    from rh_dask import ValidationError

    model, _ = fitted
    before = _everything(model)
    X = da.from_array(np.empty((0, 3)), chunks=((0, 0), (3,)))
    y = da.from_array(np.empty(0), chunks=((0, 0),))
    with pytest.raises(ValidationError, match="empty"):
        model.fit(X, y)
    assert _everything(model) == before


def test_a_dask_partial_fit_that_fails_before_any_batch_counts_no_empty_chunk(fitted):
    model, s = fitted
    X = s.X[200:].copy()
    X[150, 0] = np.inf  # chunk 2 of 50-row chunks, after two empty ones
    import dask.array as da

    chunks = (0, 0, 200)
    Xd = da.from_array(X, chunks=(chunks, 3))
    yd = da.from_array(s.y[200:], chunks=(chunks,))
    before = _everything(model)
    with pytest.raises(ValueError, match="chunk 2"):
        model.partial_fit(Xd, yd)
    assert _everything(model) == before


class _Refusing(NumpyEngine):
    """A NumPy engine that refuses every batch (as an engine's own checks would)."""

    def partial_fit(self, X, y, sample_weight=None):
        from rh_dask import ValidationError

        raise ValidationError("refused by the engine")


@pytest.mark.parametrize("dask_input", [False, True], ids=["memory", "dask"])
def test_a_fit_the_engine_refuses_puts_the_old_stream_back_in_the_engine(
    fitted, monkeypatch, dask_input
):
    import rh_dask.stream as stream_module

    model, s = fitted
    engine = _engine_of(model)
    before = _everything(model)
    X, y = s.X[300:], s.y[300:]
    if dask_input:
        X, y = _dask_stream(X, y)
    # The model's own engine (same configuration) refuses; it was reset for the
    # new stream, so its old stream must come back.
    monkeypatch.setattr(type(engine), "partial_fit", _Refusing.partial_fit)
    with pytest.raises(ValueError, match="refused by the engine"):
        model.fit(X, y)
    assert _everything(model) == before
    monkeypatch.undo()
    # A new configuration needs a new engine: it is not kept when it refuses.
    monkeypatch.setattr(stream_module, "make_engine", lambda *a, **k: _Refusing(HuberConfig()))
    model.set_params(tau=2.0)
    before = _everything(model)
    with pytest.raises(ValueError, match="refused by the engine"):
        model.fit(X, y)
    assert _everything(model) == before
    assert _engine_of(model) is engine


def test_refused_partial_fit_of_a_loaded_model_starts_no_engine(fitted, tmp_path):
    from rh_dask import ValidationError

    model, s = fitted
    loaded = RenewableHuberRegressor.load(model.save(tmp_path / "m.npz"))
    before = _everything(loaded)
    X = _frame(s.X[300:]).copy()
    X.iloc[3, 0] = np.nan
    with pytest.raises(ValidationError, match="NaN"):
        loaded.partial_fit(X, s.y[300:])
    assert _everything(loaded) == before
    assert _engine_of(loaded) is None


@pytest.mark.skipif(gpu_usable(), reason="a CUDA GPU is usable here")
@pytest.mark.parametrize("dask_input", [False, True], ids=["memory", "dask"])
def test_a_fit_on_an_engine_that_cannot_start_keeps_the_model(fitted, dask_input):
    from rh_dask import EngineUnavailableError

    model, s = fitted
    X, y = s.X[300:], s.y[300:]
    if dask_input:
        X, y = _dask_stream(X, y)
    model.set_params(engine="gpu")
    before = _everything(model)
    with pytest.raises(EngineUnavailableError):
        model.fit(X, y)
    assert _everything(model) == before


# -- scikit-learn conventions -----------------------------------------------------------
def test_not_fitted_error_is_both_rh_dask_and_scikit_learn():
    import sklearn.exceptions

    from rh_dask import RhDaskError
    from rh_dask.exceptions import NotFittedError as Ours

    assert Ours is NotFittedError
    with pytest.raises(NotFittedError) as caught:
        RenewableHuberRegressor().predict(np.ones((2, 2)))
    assert isinstance(caught.value, sklearn.exceptions.NotFittedError)
    assert isinstance(caught.value, RhDaskError)
    for name in ("coef_", "state_", "history_", "placement_"):
        with pytest.raises(RhDaskError):
            getattr(RenewableHuberRegressor(), name)
    with pytest.raises(sklearn.exceptions.NotFittedError):
        RenewableHuberRegressor().save("never.npz")
    from sklearn.utils.validation import check_is_fitted

    check_is_fitted(RenewableHuberRegressor().fit(np.eye(3), np.arange(3.0)))


@pytest.mark.parametrize("method", ["fit", "partial_fit"])
def test_a_column_vector_y_is_raveled_with_scikit_learns_warning(make_stream, method):
    from sklearn.exceptions import DataConversionWarning

    s = make_stream(200, 3, seed=32)
    reference = getattr(RenewableHuberRegressor(), method)(s.X, s.y)
    for column in (s.y[:, None], pd.DataFrame({"t": s.y}), s.y[:, None].tolist()):
        with pytest.warns(DataConversionWarning, match="A column-vector y was passed") as rec:
            model = getattr(RenewableHuberRegressor(), method)(s.X, column)
        assert rec[0].filename == __file__  # points at the caller's line
        assert model.state_.equals(reference.state_)
    with pytest.warns(DataConversionWarning, match="column-vector y"):
        score = reference.score(s.X, s.y[:, None])
    assert score == reference.score(s.X, s.y)


@pytest.mark.parametrize("kind", ["array", "frame"])
def test_a_dask_column_vector_y_is_raveled_lazily_with_the_warning(make_stream, kind):
    import dask.array as da
    import dask.dataframe as dd
    from sklearn.exceptions import DataConversionWarning

    s = make_stream(300, 3, seed=33)
    X, y = _dask_stream(s.X, s.y)
    column = y[:, None] if kind == "array" else dd.from_dask_array(y[:, None], columns=["t"])
    if kind == "frame":
        X = dd.from_dask_array(X, columns=["a", "b", "c"])
    reference = RenewableHuberRegressor(progress=False).fit(
        X, y if kind == "array" else column["t"]
    )
    with pytest.warns(DataConversionWarning, match="column-vector y"):
        model = RenewableHuberRegressor(progress=False).fit(X, column)
    assert model.state_.equals(reference.state_)
    with pytest.warns(DataConversionWarning, match="column-vector y"):
        lazy = model.score(X, column)
    in_memory = X.compute() if kind == "frame" else s.X
    assert lazy == pytest.approx(model.score(in_memory, s.y), rel=1e-12)
    assert isinstance(column, (da.Array, dd.DataFrame))


def test_check_estimator_passes_fully_with_the_array_api_check(tmp_path):
    # check_array_api_input runs only when SCIPY_ARRAY_API is set before SciPy is
    # imported: a fresh interpreter runs the whole suite with it.
    import os
    import subprocess
    import sys

    code = (
        "from sklearn.utils.estimator_checks import check_estimator\n"
        "from rh_dask import RenewableHuberRegressor\n"
        "results = check_estimator(RenewableHuberRegressor(), on_fail=None)\n"
        "bad = [(r['check_name'], r['status'], str(r['exception'])) for r in results\n"
        "       if r['status'] != 'passed']\n"
        "assert not bad, bad\n"
        "print(len(results))\n"
    )
    env = {**os.environ, "SCIPY_ARRAY_API": "1"}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert int(done.stdout.split()[-1]) >= 50


class _FakeCudaArray:
    """Looks like a CUDA array to rh-dask's device check (never dereferenced)."""

    shape = (2, 3)

    @property
    def __cuda_array_interface__(self):
        return {"shape": self.shape, "typestr": "<f8", "data": (0, False), "version": 3}


def test_a_device_array_refused_by_a_host_model_starts_no_engine(fitted, tmp_path):
    from rh_dask import ValidationError

    model, _ = fitted
    loaded = RenewableHuberRegressor.load(model.save(tmp_path / "m.npz"))
    before = _everything(loaded)
    with pytest.raises(ValidationError, match="takes host arrays"):
        loaded.predict(_FakeCudaArray())
    assert _everything(loaded) == before
    assert _engine_of(loaded) is None
