"""scikit-learn compatibility: the estimator checks, meta-estimators, pickling."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
from sklearn.base import clone
from sklearn.exceptions import DataConversionWarning
from sklearn.model_selection import GridSearchCV, KFold
from sklearn.pipeline import Pipeline
from sklearn.preprocessing import StandardScaler
from sklearn.utils.estimator_checks import parametrize_with_checks

from rh_dask import RenewableHuberRegressor, ValidationError


@parametrize_with_checks([RenewableHuberRegressor()])
def test_sklearn_estimator_checks(estimator, check):
    check(estimator)


def test_column_vector_y_is_raveled_and_other_2d_y_refused(make_stream):
    s = make_stream(30, 2)
    with pytest.warns(DataConversionWarning, match="A column-vector y was passed"):
        column = RenewableHuberRegressor().fit(s.X, s.y[:, None])
    assert column.state_.equals(RenewableHuberRegressor().fit(s.X, s.y).state_)
    with pytest.raises(ValidationError, match="single-output"):
        RenewableHuberRegressor().fit(s.X, np.c_[s.y, s.y])
    X = s.X.astype(object)
    X[0, 0] = {"foo": "bar"}
    with pytest.raises(ValidationError, match="argument must be a string or a real number"):
        RenewableHuberRegressor().fit(X, s.y)


def test_clone_copies_parameters_not_the_fit(make_stream):
    s = make_stream(100, 3)
    model = RenewableHuberRegressor(tau=2.0, penalty="l1", dtype="float32").fit(s.X, s.y)
    copy = clone(model)
    assert copy.get_params() == model.get_params()
    assert not hasattr(copy, "n_features_in_")
    copy.fit(s.X, s.y)
    assert copy.state_.equals(model.state_)


def test_pipeline_with_standard_scaler(make_stream):
    s = make_stream(400, 3, seed=1, noise_df=None)
    X = s.X * [1.0, 100.0, 0.01] + [0.0, 50.0, -3.0]
    pipe = Pipeline([("scale", StandardScaler()), ("huber", RenewableHuberRegressor())])
    pipe.fit(X, s.y)
    scaled = StandardScaler().fit_transform(X)
    direct = RenewableHuberRegressor().fit(scaled, s.y)
    np.testing.assert_array_equal(pipe.named_steps["huber"].coef_, direct.coef_)
    np.testing.assert_allclose(pipe.predict(X), direct.predict(scaled), rtol=1e-12)
    assert pipe.score(X, s.y) == pytest.approx(direct.score(scaled, s.y), rel=1e-12)


def test_grid_search_over_tau(make_stream):
    s = make_stream(300, 3, seed=2)
    search = GridSearchCV(
        RenewableHuberRegressor(),
        {"tau": [0.5, 1.345, 3.0]},
        cv=KFold(3, shuffle=True, random_state=0),
    )
    search.fit(s.X, s.y)
    assert search.best_params_["tau"] in (0.5, 1.345, 3.0)
    assert search.best_estimator_.tau == search.best_params_["tau"]
    # The refitted best model is the one-batch fit of the whole data.
    best = RenewableHuberRegressor(tau=search.best_params_["tau"]).fit(s.X, s.y)
    assert search.best_estimator_.state_.equals(best.state_)
    assert np.all(np.isfinite(search.cv_results_["mean_test_score"]))


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_pickle_round_trip_continues_the_stream(make_stream, dtype):
    s = make_stream(300, 4, seed=3, weights="uniform")
    batches = s.batches([100, 100, 100])
    model = RenewableHuberRegressor(penalty="l1", dtype=dtype)
    for batch in batches[:2]:
        model.partial_fit(*batch)
    restored = pickle.loads(pickle.dumps(model))
    assert restored.state_.equals(model.state_)
    np.testing.assert_array_equal(restored.predict(s.X), model.predict(s.X))
    assert restored.diagnostics_ == model.diagnostics_
    model.partial_fit(*batches[2])
    restored.partial_fit(*batches[2])
    assert restored.state_.equals(model.state_)


def test_pickle_of_an_unfitted_model(make_stream):
    restored = pickle.loads(pickle.dumps(RenewableHuberRegressor(tau=2.0)))
    assert restored.tau == 2.0 and not hasattr(restored, "n_features_in_")
    s = make_stream(50, 2)
    restored.fit(s.X, s.y)
    assert restored.n_features_in_ == 2
