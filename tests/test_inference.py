"""Inference: the sandwich J⁻¹KJ⁻¹, intervals, p-values, the summary, refusals, coverage."""

from __future__ import annotations

import json
import re

import dask.config
import numpy as np
import pandas as pd
import pytest
from devices import gpu_usable
from scipy import stats

from rh_dask import (
    HuberConfig,
    HuberState,
    InferenceError,
    NotFittedError,
    NumpyEngine,
    RenewableHuberRegressor,
    ValidationError,
)
from rh_dask.app.cli import main
from rh_dask.inference import (
    COVARIANCE_LABEL,
    confidence_intervals,
    interval_columns,
    normal_quantile,
    p_values,
    sandwich,
    standard_errors,
    z_values,
)

FEATURES = ["alpha", "beta", "gamma"]
TABLE_COLUMNS = ["coef", "std err", "z", "P>|z|", "[0.025", "0.975]"]


def _hand_made_state(p: int = 4, dtype: str = "float64", seed: int = 0) -> HuberState:
    rng = np.random.default_rng(seed)
    a = rng.normal(size=(50, p))
    b = rng.normal(size=(50, p)) * rng.uniform(0.5, 2.0, size=(50, 1))
    return HuberState(
        coefficients=rng.normal(size=p).astype(dtype),
        information=(a.T @ a).astype(dtype),
        score_variance=(b.T @ b).astype(dtype),
        n_samples_seen=50,
        batch_count=2,
        weight_sum=50.0,
        n_features_in=p - 1,
        fit_intercept=True,
    )


def _frames(n: int = 6000, n_batches: int = 4, seed: int = 1):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, len(FEATURES)))
    y = X @ np.array([1.5, -2.0, 0.25]) + 0.5 + rng.standard_t(3, size=n)
    frame = pd.DataFrame(X, columns=FEATURES)
    cuts = np.array_split(np.arange(n), n_batches)
    return [(frame.iloc[rows], y[rows]) for rows in cuts]


def _fitted(**params) -> RenewableHuberRegressor:
    model = RenewableHuberRegressor(engine="numpy", **params)
    for X, y in _frames():
        model.partial_fit(X, y)
    return model


# -- the formulas ----------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_sandwich_is_inverse_information_times_score_variance_times_inverse_information(dtype):
    state = _hand_made_state(dtype=dtype)
    j = state.information.astype(np.float64)
    k = state.score_variance.astype(np.float64)
    expected = np.linalg.inv(j) @ k @ np.linalg.inv(j)
    got = sandwich(state)
    assert got.dtype == np.float64 and got.shape == (4, 4)
    np.testing.assert_allclose(got, expected, rtol=1e-10, atol=0)
    np.testing.assert_array_equal(got, got.T)
    # Not J⁻¹ alone: the meat matters.
    assert not np.allclose(got, np.linalg.inv(j), rtol=0.05)


def test_sandwich_scales_like_the_inverse_sample_size():
    """J and K are sums: doubling both (twice the rows) halves the covariance."""
    state = _hand_made_state()
    doubled = state.copy()
    doubled.information = 2 * doubled.information
    doubled.score_variance = 2 * doubled.score_variance
    np.testing.assert_allclose(sandwich(doubled), sandwich(state) / 2, rtol=1e-12)


def test_standard_errors_z_p_values_and_intervals_follow_the_normal_distribution():
    beta = np.array([1.0, -0.5, 0.02, 3.0])
    cov = np.diag([0.04, 0.01, 0.0001, 9.0])
    bse = standard_errors(cov)
    np.testing.assert_allclose(bse, [0.2, 0.1, 0.01, 3.0], rtol=1e-15)
    z = z_values(beta, bse)
    np.testing.assert_allclose(z, [5.0, -5.0, 2.0, 1.0], rtol=1e-15)
    np.testing.assert_allclose(p_values(z), 2 * stats.norm.sf(np.abs(z)), rtol=1e-12)
    assert p_values(np.array([1.959963984540054]))[0] == pytest.approx(0.05, rel=1e-12)
    assert normal_quantile(0.05) == pytest.approx(1.959964, abs=1e-6)
    assert normal_quantile(0.10) == pytest.approx(1.644854, abs=1e-6)
    for alpha in (0.01, 0.05, 0.2):
        assert normal_quantile(alpha) == pytest.approx(stats.norm.ppf(1 - alpha / 2), rel=1e-14)
        ci = confidence_intervals(beta, bse, alpha)
        q = stats.norm.ppf(1 - alpha / 2)
        np.testing.assert_allclose(ci, np.column_stack([beta - q * bse, beta + q * bse]))
    assert interval_columns(0.05) == ("[0.025", "0.975]")
    assert interval_columns(0.1) == ("[0.05", "0.95]")


@pytest.mark.parametrize("alpha", [0, 1, -0.1, 1.5, float("nan"), "x", None])
def test_an_alpha_outside_zero_one_is_a_validation_error(alpha):
    with pytest.raises(ValidationError, match="alpha"):
        normal_quantile(alpha)
    model = _fitted()
    with pytest.raises(ValidationError, match="alpha"):
        model.conf_int(alpha)
    with pytest.raises(ValidationError, match="alpha"):
        model.summary(alpha)


# -- the estimator -----------------------------------------------------------------------------
def test_cov_bse_conf_int_come_from_the_state_and_are_ordered_like_it():
    model = _fitted()
    state = model.state_
    assert state.score_variance is not None
    cov = model.cov_
    assert cov.shape == (4, 4) and cov.dtype == np.float64
    np.testing.assert_allclose(cov, sandwich(state), rtol=0, atol=0)
    np.testing.assert_array_equal(model.bse_, np.sqrt(np.diag(cov)))
    ci = model.conf_int()
    beta = np.r_[model.coef_, model.intercept_]
    np.testing.assert_allclose(ci[:, 0], beta - 1.959963984540054 * model.bse_, rtol=1e-14)
    np.testing.assert_allclose(ci[:, 1], beta + 1.959963984540054 * model.bse_, rtol=1e-14)
    assert np.all(ci[:, 0] < beta) and np.all(beta < ci[:, 1])
    narrower = model.conf_int(alpha=0.2)
    assert np.all(narrower[:, 0] > ci[:, 0]) and np.all(narrower[:, 1] < ci[:, 1])
    # 6,000 rows, unit-scale noise: standard errors of the order 1/√n.
    assert np.all((model.bse_ > 0.005) & (model.bse_ < 0.05))


def test_without_intercept_the_covariance_covers_the_features_only():
    model = _fitted(fit_intercept=False)
    assert model.cov_.shape == (3, 3)
    assert list(model.summary().table.index) == FEATURES


def test_summary_table_and_text():
    model = _fitted()
    summary = model.summary()
    table = summary.table
    assert list(table.columns) == TABLE_COLUMNS
    assert list(table.index) == [*FEATURES, "intercept"]
    np.testing.assert_array_equal(table["coef"], np.r_[model.coef_, model.intercept_])
    np.testing.assert_array_equal(table["std err"], model.bse_)
    np.testing.assert_allclose(table["z"], table["coef"] / table["std err"], rtol=1e-15)
    np.testing.assert_allclose(table["P>|z|"], 2 * stats.norm.sf(np.abs(table["z"])))
    np.testing.assert_array_equal(table[["[0.025", "0.975]"]].to_numpy(), model.conf_int())
    text = str(summary)
    assert text == summary.as_text()
    for needle in (
        "rows seen:",
        "6,000",
        "batches:",
        "tau:",
        "1.345",
        "penalty:",
        "none",
        "dtype:",
        "float64",
        COVARIANCE_LABEL,
        "P>|z|",
        "[0.025",
        "0.975]",
    ):
        assert needle in text, needle
    rows = {line.split()[0]: line.split() for line in text.splitlines() if line.split()}
    for name in [*FEATURES, "intercept"]:
        assert float(rows[name][1]) == pytest.approx(table.loc[name, "coef"], abs=5e-5)
        assert float(rows[name][2]) == pytest.approx(table.loc[name, "std err"], abs=5e-5)
    assert list(model.summary(alpha=0.1).table.columns)[-2:] == ["[0.05", "0.95]"]
    as_dict = summary.to_dict()
    json.dumps(as_dict)
    assert [r["name"] for r in as_dict["parameters"]] == [*FEATURES, "intercept"]


def test_summary_of_an_unnamed_float32_stream_names_x0_x1():
    rng = np.random.default_rng(3)
    X = rng.normal(size=(3000, 2)).astype(np.float32)
    y = (X @ np.array([1.0, 2.0]) + rng.normal(size=3000)).astype(np.float32)
    model = RenewableHuberRegressor(dtype="float32").fit(X, y)
    summary = model.summary()
    assert list(summary.table.index) == ["x0", "x1", "intercept"]
    assert "float32" in str(summary)
    assert model.state_.score_variance.dtype == np.float32
    assert model.cov_.dtype == np.float64


def test_l1_is_refused_with_the_reason_and_the_model_unchanged(snapshot, assert_unchanged):
    model = _fitted(penalty="l1")
    before = snapshot(model)
    for get in (
        lambda: model.cov_,
        lambda: model.bse_,
        lambda: model.conf_int(),
        lambda: model.summary(),
    ):
        with pytest.raises(InferenceError, match=r'penalty="l1".*selects'):
            get()
    assert_unchanged(before, snapshot(model))
    assert issubclass(InferenceError, ValueError)


def test_an_l1_stream_keeps_no_score_variance_and_drops_an_imported_one():
    """K serves inference only, which an L1 fit has not: its commits skip the second Gram."""
    assert HuberConfig().keeps_score_variance
    assert not HuberConfig(penalty="l1").keeps_score_variance
    assert _fitted(penalty="l1").state_.score_variance is None
    assert _fitted().state_.score_variance is not None
    (X0, y0), (X1, y1) = [(np.asarray(X, dtype=np.float64), y) for X, y in _frames()[:2]]
    unpenalised = NumpyEngine(HuberConfig())
    unpenalised.partial_fit(X0, y0)
    with_k = unpenalised.export_state()
    assert with_k.score_variance is not None
    lasso = NumpyEngine(HuberConfig(penalty="l1"))
    lasso.import_state(with_k)
    lasso.partial_fit(X1, y1)  # an L1 stream continuing a state with K drops it
    assert lasso.export_state().score_variance is None
    unpenalised.partial_fit(X1, y1)  # an unpenalised one adds this batch's Gram
    assert not np.array_equal(unpenalised.export_state().score_variance, with_k.score_variance)


def test_unfitted_raises_not_fitted():
    model = RenewableHuberRegressor()
    for get in (
        lambda: model.cov_,
        lambda: model.bse_,
        lambda: model.conf_int(),
        lambda: model.summary(),
    ):
        with pytest.raises(NotFittedError):
            get()
    assert not hasattr(model, "cov_")


def test_a_state_without_score_variance_is_refused_naming_why(tmp_path):
    state = _hand_made_state()
    state.score_variance = None
    with pytest.raises(InferenceError, match="format version 2"):
        sandwich(state)
    with pytest.raises(InferenceError, match=r"GPU engine with rh-dask.gpu.score-variance off"):
        sandwich(state, engine="gpu")


def test_a_model_continuing_a_format_1_checkpoint_has_no_covariance(tmp_path):
    from pathlib import Path

    golden = Path(__file__).parent / "golden" / "checkpoint_v1.npz"
    if not golden.exists():
        pytest.skip("no format-1 golden checkpoint")
    model = RenewableHuberRegressor.load(golden, engine="numpy")
    assert model.state_.score_variance is None
    with pytest.raises(InferenceError, match=r"format version 2.*a fresh fit"):
        model.summary()
    d = model.n_features_in_
    rng = np.random.default_rng(0)
    X = rng.normal(size=(200, d))
    X = pd.DataFrame(X, columns=model.feature_names_in_) if _has_names(model) else X
    model.partial_fit(X, rng.normal(size=200))
    assert model.state_.score_variance is None
    with pytest.raises(InferenceError, match="score variance K"):
        model.cov_
    # A fresh stream accumulates K again.
    model.fit(X, rng.normal(size=200))
    assert np.all(np.isfinite(model.cov_))


def _has_names(model: RenewableHuberRegressor) -> bool:
    try:
        model.feature_names_in_
    except AttributeError:
        return False
    return True


def test_a_singular_information_matrix_is_refused():
    state = _hand_made_state()
    j = state.information
    j[:, 0] = j[:, 1]
    j[0, :] = j[1, :]
    with pytest.raises(InferenceError, match="singular"):
        sandwich(state)
    rng = np.random.default_rng(0)
    X = rng.normal(size=(500, 2))
    X[:, 1] = 2 * X[:, 0]
    model = RenewableHuberRegressor(ridge=1e-8).fit(X, X[:, 0] + rng.normal(size=500))
    with pytest.raises(InferenceError, match="singular"):
        model.summary()


def test_a_dask_walk_gives_the_loops_covariance_bit_for_bit():
    import dask
    import dask.dataframe as dd

    frames = _frames()
    loop = _fitted()
    X = pd.concat([f for f, _ in frames])
    y = np.concatenate([t for _, t in frames])
    X["y"] = y
    ddf = dd.from_pandas(X, npartitions=len(frames), sort=False)
    sizes = ddf.map_partitions(len).compute(scheduler="sync")
    assert list(sizes) == [len(t) for _, t in frames]
    with dask.config.set(scheduler="sync"):
        walked = RenewableHuberRegressor(engine="numpy").fit(ddf[FEATURES], ddf["y"])
    assert walked.state_.score_variance.tobytes() == loop.state_.score_variance.tobytes()
    assert walked.cov_.tobytes() == loop.cov_.tobytes()


# -- the command line ---------------------------------------------------------------------------
def test_info_prints_the_summary_table(tmp_path, capsys):
    path = _fitted().save(tmp_path / "model.npz")
    assert main(["info", str(path)]) == 0
    out = capsys.readouterr().out
    assert COVARIANCE_LABEL in out
    header = next(line for line in out.splitlines() if "std err" in line)
    assert re.split(r"\s{2,}", header.strip()) == TABLE_COLUMNS
    assert any(line.startswith("intercept ") for line in out.splitlines())
    assert main(["info", str(path), "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    params = record["inference"]["parameters"]
    assert [p["name"] for p in params] == [*FEATURES, "intercept"]
    assert set(TABLE_COLUMNS) <= set(params[0])


def test_info_says_why_an_l1_model_has_no_summary(tmp_path, capsys):
    path = _fitted(penalty="l1").save(tmp_path / "l1.npz")
    assert main(["info", str(path)]) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("inference:")]
    assert len(lines) == 1 and 'penalty="l1"' in lines[0]
    assert "std err" not in out
    assert main(["info", str(path), "--json"]) == 0
    assert 'penalty="l1"' in json.loads(capsys.readouterr().out)["inference"]["unavailable"]


# -- against a full-data M-estimator ------------------------------------------------------------
def _full_data_huber(X: np.ndarray, y: np.ndarray, tau: float) -> tuple[np.ndarray, np.ndarray]:
    """The in-memory Huber M-estimate (IRLS to convergence) and its classical sandwich."""
    Z = np.column_stack([X, np.ones(len(X))])
    beta = np.linalg.lstsq(Z, y, rcond=None)[0]
    for _ in range(200):
        r = y - Z @ beta
        w = np.minimum(1.0, tau / np.maximum(np.abs(r), 1e-300))
        new = np.linalg.solve(Z.T @ (w[:, None] * Z), Z.T @ (w * y))
        if np.linalg.norm(new - beta) <= 1e-12 * (1 + np.linalg.norm(new)):
            beta = new
            break
        beta = new
    r = y - Z @ beta
    inside = (np.abs(r) <= tau).astype(float)
    psi = np.clip(r, -tau, tau)
    bread = np.linalg.inv(Z.T @ (inside[:, None] * Z))
    meat = Z.T @ ((psi**2)[:, None] * Z)
    return beta, np.sqrt(np.diag(bread @ meat @ bread))


@pytest.mark.parametrize("errors", ["t3", "contaminated"])
def test_standard_errors_match_the_full_data_huber_sandwich_within_5_percent(errors):
    rng = np.random.default_rng(11)
    n = 20_000
    X = rng.normal(size=(n, 4))
    noise = _errors(rng, errors, n)
    y = X @ np.array([1.0, -1.0, 0.5, 2.0]) + 0.3 + noise
    model = RenewableHuberRegressor(engine="numpy")
    for rows in np.array_split(np.arange(n), 10):
        model.partial_fit(X[rows], y[rows])
    beta, bse = _full_data_huber(X, y, 1.345)
    np.testing.assert_allclose(model.bse_, bse, rtol=0.05)
    np.testing.assert_allclose(np.r_[model.coef_, model.intercept_], beta, atol=2 * bse.max())


@pytest.mark.parametrize("errors", ["normal", "t3", "contaminated"])
def test_standard_errors_match_statsmodels_rlm_with_a_fixed_scale(errors):
    sm = pytest.importorskip(
        "statsmodels.api", reason="statsmodels is not installed (the dev extra has it)"
    )
    rng = np.random.default_rng(12)
    n = 20_000
    X = rng.normal(size=(n, 3))
    y = X @ np.array([1.0, -1.0, 0.5]) + 0.3 + _errors(rng, errors, n)
    model = RenewableHuberRegressor(engine="numpy")
    for rows in np.array_split(np.arange(n), 10):
        model.partial_fit(X[rows], y[rows])
    Z = np.column_stack([X, np.ones(n)])
    rlm = sm.RLM(y, Z, M=sm.robust.norms.HuberT(t=1.345))
    result = rlm.fit(scale_est=_UnitScale(), cov="H1")
    np.testing.assert_allclose(model.bse_, result.bse, rtol=0.05)


class _UnitScale:
    """A statsmodels scale estimator that keeps the scale at 1 (τ is on y's scale)."""

    def __call__(self, *args, **kwargs) -> float:
        return 1.0


# -- coverage ----------------------------------------------------------------------------------
def _errors(rng: np.random.Generator, kind: str, n: int) -> np.ndarray:
    if kind == "normal":
        return rng.normal(size=n)
    if kind == "t3":
        return rng.standard_t(3, size=n)
    # 10% of the rows from a normal ten times wider: symmetric gross outliers.
    wide = rng.random(n) < 0.1
    return np.where(wide, 10.0, 1.0) * rng.normal(size=n)


def _coverage(
    kind: str, replications: int, n_features: int, seed: int, n: int = 20_000, batches: int = 10
) -> tuple[int, int]:
    """Intervals (95%) covering the true parameters, and intervals drawn, over replications."""
    rng = np.random.default_rng(seed)
    truth = np.r_[rng.uniform(-2, 2, size=n_features), 0.5]
    cuts = np.array_split(np.arange(n), batches)
    covered = 0
    for _ in range(replications):
        X = rng.normal(size=(n, n_features))
        y = X @ truth[:-1] + truth[-1] + _errors(rng, kind, n)
        model = RenewableHuberRegressor(engine="numpy")
        for rows in cuts:
            model.partial_fit(X[rows], y[rows])
        ci = model.conf_int(0.05)
        covered += int(np.sum((ci[:, 0] <= truth) & (truth <= ci[:, 1])))
    return covered, replications * truth.size


def test_95_percent_intervals_cover_about_95_percent_fast():
    """40 replications, p = 3, three error laws: 360 intervals pooled."""
    counts = [_coverage(kind, 40, 2, seed) for seed, kind in enumerate(("normal", "t3", "cont"))]
    covered, total = map(sum, zip(*counts, strict=True))
    assert 0.90 <= covered / total <= 0.985, (covered, total, counts)


@pytest.mark.slow
@pytest.mark.parametrize("batches", [10, 100])
def test_95_percent_intervals_cover_94_to_96_percent(batches):
    """200 replications, p = 10 (9 features and the intercept), N = 20,000 in 10 or 100 batches.

    2,000 intervals per error law, 6,000 pooled: a standard error of 0.28
    points on the pooled coverage, so the 94-96% band is ±3.6 standard errors.
    """
    kinds = ("normal", "t3", "contaminated")
    seed = 100 if batches == 10 else 200
    counts = {k: _coverage(k, 200, 9, seed + i, batches=batches) for i, k in enumerate(kinds)}
    covered, total = map(sum, zip(*counts.values(), strict=True))
    assert 0.94 <= covered / total <= 0.96, counts
    for kind, (c, t) in counts.items():
        assert 0.93 <= c / t <= 0.97, (kind, c, t)


def test_a_gpu_engine_checkpoint_without_k_has_no_covariance_and_says_so(tmp_path, capsys):
    """A GPU engine with the setting off exports K = None; its checkpoints name the reason."""
    from rh_dask.checkpoint import Checkpoint, save_checkpoint

    fitted = _fitted()
    state = fitted.state_
    state.score_variance = None
    path = save_checkpoint(
        tmp_path / "gpu.npz",
        Checkpoint(
            config=fitted._make_config(),
            state=state,
            feature_names=fitted.feature_names_in_,
            engine="gpu",
        ),
    )
    model = RenewableHuberRegressor.load(path)
    assert model.engine == "gpu"
    with pytest.raises(InferenceError, match=r"GPU engine.*score-variance off.*fresh fit"):
        model.summary()
    assert main(["info", str(path)]) == 0
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("inference:")]
    assert len(lines) == 1 and "GPU engine" in lines[0]


@pytest.mark.skipif(not gpu_usable(), reason="no CUDA device visible to CuPy")
def test_a_gpu_engine_fit_with_the_setting_off_raises_inference_error_naming_it():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(2000, 3))
    y = X.sum(axis=1) + rng.normal(size=2000)
    assert np.isfinite(RenewableHuberRegressor(engine="gpu").fit(X, y).bse_).all()
    with dask.config.set({"rh-dask.gpu.score-variance": False}):
        model = RenewableHuberRegressor(engine="gpu").fit(X, y)
    with pytest.raises(InferenceError, match="score-variance off"):
        model.cov_
