"""The robust scorer: mean Huber loss, its scikit-learn scorers, and tuning τ with them."""

from __future__ import annotations

import numpy as np
import pytest
from sklearn.metrics import get_scorer
from sklearn.model_selection import GridSearchCV, KFold

from rh_dask import RenewableHuberRegressor, ValidationError
from rh_dask.metrics import huber_loss, huber_scorer, neg_huber_loss


def _rho(r: np.ndarray, tau: float) -> np.ndarray:
    """ρ_τ written piecewise, independently of the module's ψ form."""
    a = np.abs(r)
    return np.where(a <= tau, 0.5 * r * r, tau * a - 0.5 * tau * tau)


def _residuals() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    y_true = rng.standard_normal(50) * 3.0
    y_pred = y_true + rng.standard_normal(50) * 2.0
    return y_true, y_pred


@pytest.mark.parametrize("tau", [0.5, 1.345, 4.0])
def test_huber_loss_is_the_mean_of_rho(tau):
    y_true, y_pred = _residuals()
    r = y_true - y_pred
    assert (np.abs(r) > tau).any() and (np.abs(r) <= tau).any()
    assert huber_loss(y_true, y_pred, tau=tau) == pytest.approx(_rho(r, tau).mean(), rel=1e-14)


def test_huber_loss_weighted_mean_and_integer_weights_repeat_rows():
    y_true, y_pred = _residuals()
    w = np.random.default_rng(1).integers(0, 4, size=y_true.size).astype(float)
    r = y_true - y_pred
    expected = np.sum(w * _rho(r, 1.345)) / w.sum()
    assert huber_loss(y_true, y_pred, sample_weight=w) == pytest.approx(expected, rel=1e-14)
    rows = np.repeat(np.arange(y_true.size), w.astype(int))
    assert huber_loss(y_true, y_pred, sample_weight=w) == pytest.approx(
        huber_loss(y_true[rows], y_pred[rows]), rel=1e-12
    )


def test_huber_loss_of_small_residuals_is_half_the_mse_and_of_large_ones_linear():
    y = np.zeros(4)
    assert huber_loss(y, np.array([0.1, -0.2, 0.3, 0.0])) == pytest.approx(
        0.5 * np.mean([0.01, 0.04, 0.09, 0.0])
    )
    assert huber_loss([0.0], [10.0], tau=2.0) == pytest.approx(2.0 * 10.0 - 2.0)


def test_a_column_vector_counts_as_a_vector():
    y_true, y_pred = _residuals()
    assert huber_loss(y_true[:, None], y_pred) == huber_loss(y_true, y_pred)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"tau": 0.0}, "tau must be finite and > 0"),
        ({"tau": -1.0}, "tau must be finite and > 0"),
        ({"tau": float("nan")}, "tau must be finite and > 0"),
        ({"tau": float("inf")}, "tau must be finite and > 0"),
        ({"tau": "1"}, "tau must be a real number"),
        ({"tau": True}, "tau must be a real number"),
    ],
)
def test_bad_tau_is_refused(kwargs, match):
    with pytest.raises(ValidationError, match=match):
        huber_loss([1.0], [0.0], **kwargs)
    with pytest.raises(ValidationError, match=match):
        huber_scorer(**kwargs)


@pytest.mark.parametrize(
    ("y_true", "y_pred", "weights", "match"),
    [
        ([1.0, 2.0], [1.0], None, "different lengths: 2 and 1"),
        ([], [], None, "at least one sample"),
        ([1.0, np.nan], [1.0, 2.0], None, "y_true contains NaN"),
        ([1.0, 2.0], [1.0, np.inf], None, "y_pred contains NaN or infinity"),
        (np.ones((2, 2)), np.ones((2, 2)), None, r"y_true must be 1-D .* shape \(2, 2\)"),
        (["a", "b"], [1.0, 2.0], None, "y_true must be numbers"),
        ([1.0, 2.0], [1.0, 2.0], [1.0], "sample_weight has 1 entries for 2 samples"),
        ([1.0, 2.0], [1.0, 2.0], [1.0, -1.0], "non-negative"),
        ([1.0, 2.0], [1.0, 2.0], [0.0, 0.0], "positive sum"),
        ([1.0, 2.0], [1.0, 2.0], [1.0, np.nan], "sample_weight contains NaN"),
    ],
)
def test_bad_inputs_are_refused(y_true, y_pred, weights, match):
    with pytest.raises(ValidationError, match=match):
        huber_loss(y_true, y_pred, sample_weight=weights)


def test_scorers_negate_the_loss_of_the_predictions():
    rng = np.random.default_rng(2)
    X = rng.standard_normal((80, 2))
    y = X @ np.array([1.0, -1.0]) + rng.standard_normal(80) * 2.0
    model = RenewableHuberRegressor(engine="numpy").fit(X, y)
    pred = model.predict(X)
    assert neg_huber_loss(model, X, y) == pytest.approx(-huber_loss(y, pred))
    assert huber_scorer(0.5)(model, X, y) == pytest.approx(-huber_loss(y, pred, tau=0.5))
    w = rng.uniform(0.5, 2.0, size=80)
    assert neg_huber_loss(model, X, y, sample_weight=w) == pytest.approx(
        -huber_loss(y, pred, sample_weight=w)
    )
    # Mean absolute error is scikit-learn's own scorer; it works on the estimator as it is.
    assert get_scorer("neg_mean_absolute_error")(model, X, y) == pytest.approx(
        -np.mean(np.abs(y - pred))
    )


def _contaminated(seed: int = 15) -> tuple[np.ndarray, np.ndarray]:
    """Unit-scale Gaussian noise, 15 % of targets shifted up by 20 to 40."""
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((600, 3))
    y = X @ np.array([1.0, -2.0, 0.5]) + 0.3 + rng.standard_normal(600)
    outliers = rng.random(600) < 0.15
    y[outliers] += rng.uniform(20.0, 40.0, size=outliers.sum())
    return X, y


def test_grid_search_over_tau_r2_picks_least_squares_and_huber_loss_a_robust_tau():
    X, y = _contaminated()
    grid = {"tau": [1.0, 1.345, 100.0]}
    base = RenewableHuberRegressor(engine="numpy")
    by_r2 = GridSearchCV(base, grid, cv=KFold(3)).fit(X, y)
    by_huber = GridSearchCV(base, grid, scoring=neg_huber_loss, cv=KFold(3)).fit(X, y)
    assert by_r2.best_params_ == {"tau": 100.0}
    assert by_huber.best_params_["tau"] in (1.0, 1.345)
    # The robust choice is closer to the truth: least squares is shifted and noisier.
    truth = np.array([1.0, -2.0, 0.5])
    robust_err = np.abs(by_huber.best_estimator_.coef_ - truth).max()
    r2_err = np.abs(by_r2.best_estimator_.coef_ - truth).max()
    assert robust_err < r2_err
    assert abs(by_huber.best_estimator_.intercept_ - 0.3) < abs(
        by_r2.best_estimator_.intercept_ - 0.3
    )
