"""Fit reports: the one-call fit and its per-batch coefficient trajectory, report.json, plots."""

from __future__ import annotations

import importlib.util
import json
import sys

import dask.array as da
import numpy as np
import pytest

from rh_dask import RenewableHuberRegressor
from rh_dask.app.extras import MissingExtraError
from rh_dask.app.io import Table
from rh_dask.app.jobs import fit_table
from rh_dask.app.report import REPORT_FILES, _jsonable, build_report, write_report
from rh_dask.datasets import StreamSpec
from rh_dask.engines import resolve_engine_name
from rh_dask.exceptions import EngineUnavailableError, ValidationError

PNG = b"\x89PNG\r\n\x1a\n"


def _table(n_chunks: int = 6, rows: int = 200, d: int = 4, empty_at: int | None = None) -> Table:
    spec = StreamSpec(n_features=d, seed=5)
    chunks = [spec.chunk(i, 0 if i == empty_at else rows) for i in range(n_chunks)]
    X = np.concatenate([c[0] for c in chunks])
    y = np.concatenate([c[1] for c in chunks])
    sizes = tuple(len(c[1]) for c in chunks)
    return Table(
        X=da.from_array(X, chunks=(sizes, d)),
        y=da.from_array(y, chunks=(sizes,)),
        sample_weight=None,
        feature_names=[f"x{j}" for j in range(d)],
        named=False,
        description={"format": "test", "path": "memory"},
    )


def _model(**params) -> RenewableHuberRegressor:
    return RenewableHuberRegressor(progress=False, **params)


def test_one_fit_gives_the_fit_state_and_a_point_per_batch():
    table = _table()
    single = _model().fit(table.X, table.y)
    outcome = fit_table(_model(), table)
    assert outcome.model.state_.equals(single.state_)
    assert list(outcome.history["chunk"]) == list(range(6))
    assert outcome.placement is None  # no client: the walk ran in this process
    traj = outcome.trajectory
    assert traj.after_chunk.tolist() == [1, 2, 3, 4, 5, 6]
    assert traj.rows.tolist() == [200, 400, 600, 800, 1000, 1200]
    assert np.all(np.diff(traj.engine_seconds) >= 0) and traj.engine_seconds[0] > 0
    np.testing.assert_array_equal(traj.coefficients, single.coef_history_)
    final = np.append(single.coef_, single.intercept_)
    np.testing.assert_array_equal(traj.coefficients[-1], final)
    model = outcome.model
    np.testing.assert_array_equal(traj.coefficients[-1, :-1], model.coef_)
    assert traj.coefficients[-1, -1] == model.intercept_


def test_a_float32_trajectory_ends_exactly_at_the_model():
    outcome = fit_table(_model(dtype="float32", fit_intercept=False), _table())
    traj, model = outcome.trajectory, outcome.model
    assert traj.coefficients.dtype == np.float64 and traj.coefficients.shape == (6, 4)
    np.testing.assert_array_equal(traj.coefficients[-1], model.coef_)


def test_empty_chunks_are_counted_and_keep_global_chunk_numbers():
    table = _table(empty_at=2)
    outcome = fit_table(_model(), table)
    assert outcome.model.n_empty_chunks_ == 1
    assert list(outcome.history["chunk"]) == [0, 1, 3, 4, 5]
    assert outcome.trajectory.after_chunk.tolist() == [1, 2, 4, 5, 6]
    assert outcome.trajectory.rows.tolist() == [200, 400, 600, 800, 1000]


def test_leading_empty_chunks_are_skipped():
    table = _table(n_chunks=4, empty_at=0)
    outcome = fit_table(_model(), table)
    assert outcome.model.n_samples_seen_ == 600
    assert outcome.trajectory.after_chunk.tolist() == [2, 3, 4]
    assert list(outcome.history["chunk"]) == [1, 2, 3]


def test_fit_table_starts_a_new_stream():
    table = _table(n_chunks=3)
    model = _model().fit(*_table(n_chunks=2).fit_inputs())
    outcome = fit_table(model, table)
    assert len(outcome.history) == 3 and outcome.trajectory.coefficients.shape == (3, 5)


@pytest.mark.skipif(importlib.util.find_spec("cupy") is not None, reason="CuPy present")
def test_an_engine_that_cannot_start_falls_back_when_asked():
    outcome = fit_table(_model(engine="gpu"), _table(), fallback_engine="numpy")
    assert outcome.engine == "numpy" and "unavailable" in outcome.notes[0]
    assert len(outcome.trajectory.after_chunk) == 6


def test_auto_engine_follows_the_cluster():
    assert resolve_engine_name("auto", gpu_workers=True) == "gpu"
    assert resolve_engine_name("auto", gpu_workers=False) == "numpy"
    assert resolve_engine_name("numpy", gpu_workers=True) == "numpy"
    assert resolve_engine_name("gpu", gpu_workers=False) == "gpu"
    # Told about the cluster, the rule follows its workers, whatever device is named.
    assert resolve_engine_name("auto", "cuda:0", gpu_workers=False) == "numpy"
    assert resolve_engine_name("auto", "cpu", gpu_workers=True) == "gpu"


def test_auto_engine_without_a_cluster_follows_the_device():
    assert resolve_engine_name("auto") == "numpy"
    assert resolve_engine_name("auto", "cpu") == "numpy"
    assert resolve_engine_name("auto", "cuda") == "gpu"
    assert resolve_engine_name("auto", "cuda:1") == "gpu"
    # The estimator applies the same rule: auto, no device, no client fits on NumPy.
    assert fit_table(_model(), _table(n_chunks=2)).engine == resolve_engine_name("auto")


def test_an_unknown_engine_is_refused_by_the_rule():
    with pytest.raises(ValidationError, match="engine must be one of"):
        resolve_engine_name("cuda")
    with pytest.raises(ValidationError, match="engine must be one of"):
        resolve_engine_name("Auto", gpu_workers=True)


@pytest.mark.skipif(importlib.util.find_spec("cupy") is not None, reason="CuPy present")
def test_a_fitted_model_falls_back_too_when_the_engine_cannot_start():
    model = _model().fit(*_table(n_chunks=2).fit_inputs())
    model.set_params(engine="gpu")
    outcome = fit_table(model, _table(), fallback_engine="numpy")
    assert outcome.engine == "numpy" and "unavailable" in outcome.notes[0]
    assert len(outcome.history) == 6
    assert outcome.model.state_.equals(_model().fit(*_table().fit_inputs()).state_)


@pytest.mark.skipif(importlib.util.find_spec("cupy") is not None, reason="CuPy present")
def test_without_a_fallback_a_fitted_model_keeps_its_stream():
    model = _model().fit(*_table(n_chunks=2).fit_inputs())
    before = model.state_
    model.set_params(engine="gpu")
    with pytest.raises(EngineUnavailableError):
        fit_table(model, _table())
    assert model.state_.equals(before) and len(model.history_) == 2


def test_json_values_are_plain_and_non_finite_become_null():
    value = _jsonable({"a": np.float32(1.5), "b": [np.int64(2), float("nan")], "c": np.eye(2)})
    assert value == {"a": 1.5, "b": [2, None], "c": [[1.0, 0.0], [0.0, 1.0]]}
    json.dumps(value, allow_nan=False)


def test_report_json_and_plots(tmp_path):
    table = _table()
    outcome = fit_table(_model(penalty="l1"), table)
    report = build_report(
        outcome,
        data=table.description,
        feature_names=table.feature_names,
        command=["rh-dask", "fit"],
        timings={"open_seconds": 0.1},
        model_path="model.npz",
        extra={"note": "test"},
    )
    truth = np.append(StreamSpec(n_features=4, seed=5).coefficients(), 1.0)
    files = write_report(tmp_path / "report", report, truth=truth)
    assert [f.name for f in files] == [
        "report.json",
        "coefficients.png",
        "convergence.png",
        "diagnostics.png",
        "throughput.png",
    ]
    assert tuple(f.name for f in files) == REPORT_FILES  # what the command line checks first
    saved = json.loads(files[0].read_text())
    assert saved["schema"] == "rh-dask-report" and saved["schema_version"] == 3
    assert saved["parameters"]["penalty"] == "l1"
    assert saved["data"]["rows"] == 1200 and saved["data"]["chunks_consumed"] == 6
    assert saved["result"]["batch_count"] == 6 and saved["result"]["model"] == "model.npz"
    assert list(saved["result"]["coefficients"]) == ["x0", "x1", "x2", "x3", "(intercept)"]
    assert len(saved["history"]) == 6
    assert set(saved["history"][0]) >= {
        "chunk",
        "rows",
        "iterations",
        "converged",
        "objective",
        "wait_seconds",
    }
    waits = sum(h["wait_seconds"] for h in saved["history"])
    assert saved["timings"]["engine_wait_seconds"] == pytest.approx(waits)
    traj = saved["coefficient_trajectory"]
    assert traj["after_chunk"] == [1, 2, 3, 4, 5, 6] and len(traj["coefficients"][0]) == 5
    assert traj["rows"][-1] == 1200 and len(traj["engine_seconds"]) == 6
    assert traj["coefficients"] == outcome.model.coef_history_.tolist()
    assert saved["engine"]["placement"] is None
    assert saved["timings"]["open_seconds"] == 0.1 and saved["timings"]["rows_per_second"] > 0
    assert saved["hardware"]["client"]["cpus"] >= 1 and saved["hardware"]["cluster"] is None
    assert saved["plots"] == [
        "coefficients.png",
        "convergence.png",
        "diagnostics.png",
        "throughput.png",
    ]
    assert saved["note"] == "test"
    assert saved["recoveries"] == []  # nothing was lost
    for png in files[1:]:
        assert png.read_bytes()[:8] == PNG
    from matplotlib.image import imread

    height, width, _ = imread(files[1]).shape
    assert width > 600 and height > 400


def test_the_report_lists_the_recoveries_of_a_resumed_fit(tmp_path):
    from rh_dask.app.jobs import FitOutcome, Trajectory

    X, y = StreamSpec(n_features=3, seed=4).chunk(0, 600)
    Xd, yd = da.from_array(X, chunks=(100, 3)), da.from_array(y, chunks=100)
    directory = tmp_path / "ckpt"
    RenewableHuberRegressor(checkpoint_dir=directory, progress=False).fit(Xd, yd)
    model = RenewableHuberRegressor(progress=False).fit(Xd, yd, resume_from=directory)
    outcome = FitOutcome(
        model=model,
        history=model.history_,
        trajectory=Trajectory.from_model(model),
        seconds=0.1,
        engine=model.engine_,
    )
    report = build_report(outcome, data={}, feature_names=["a", "b", "c"])
    saved = json.loads(json.dumps(report))
    [resumed] = saved["recoveries"]
    assert resumed["kind"] == "resume" and resumed["from_chunk"] == 6
    assert resumed["detect_seconds"] is None and resumed["time"].endswith("+00:00")
    assert len(saved["history"]) == 6  # the checkpoint kept every batch


def test_plots_survive_an_empty_report(tmp_path):
    from rh_dask.app import plots

    empty = {"names": [], "after_chunk": [], "rows": [], "engine_seconds": [], "coefficients": []}
    for path in (
        plots.coefficients(empty, tmp_path / "c.png"),
        plots.convergence([], tmp_path / "v.png"),
        plots.throughput([], tmp_path / "t.png"),
    ):
        assert path.read_bytes()[:8] == PNG


def test_many_features_draw_the_largest_and_the_intercept(tmp_path):
    from rh_dask.app import plots

    names = [f"x{j}" for j in range(30)] + ["(intercept)"]
    betas = np.linspace(-1, 1, 31)[None, :].repeat(2, axis=0)
    trajectory = {"names": names, "after_chunk": [1, 2], "coefficients": betas.tolist()}
    assert plots.coefficients(trajectory, tmp_path / "c.png").stat().st_size > 0


def test_long_streams_are_thinned_for_plotting_only(tmp_path):
    from rh_dask.app import plots

    kept = plots._thin(5_000)
    assert len(kept) <= plots.MAX_POINTS and kept[0] == 0 and kept[-1] == 4_999
    assert plots._thin(7).tolist() == list(range(7))
    n = 5_000
    betas = np.cumsum(np.random.default_rng(0).normal(size=(n, 3)), axis=0)
    trajectory = {
        "names": ["a", "b", "(intercept)"],
        "after_chunk": list(range(1, n + 1)),
        "rows": list(range(100, 100 * n + 1, 100)),
        "engine_seconds": list(np.linspace(0.01, 5.0, n)),
        "coefficients": betas.tolist(),
    }
    history = [{"chunk": i, "rows": 100, "seconds": 0.001} for i in range(n)]
    assert plots.coefficients(trajectory, tmp_path / "c.png").read_bytes()[:8] == PNG
    path = plots.throughput(history, tmp_path / "t.png", fit_seconds=9.0)
    assert path.read_bytes()[:8] == PNG


def test_missing_matplotlib_is_a_one_line_error(tmp_path, monkeypatch):
    table = _table(n_chunks=2)
    outcome = fit_table(_model(), table)
    report = build_report(outcome, data={}, feature_names=table.feature_names)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(MissingExtraError, match=r"pip install 'rh-dask\[report\]'"):
        write_report(tmp_path / "r", report)
    assert not (tmp_path / "r").exists()


# -- inference, robust diagnostics, grid scores and what the plots draw --------------------


def _report(outcome, table, **kwargs):
    return json.loads(
        json.dumps(
            build_report(
                outcome, data=table.description, feature_names=table.feature_names, **kwargs
            )
        )
    )


def _drawn(monkeypatch):
    """Capture every figure the plots save, by file name."""
    from rh_dask.app import plots

    figures = {}
    save = plots._save

    def keep(fig, path):
        figures[path.name] = fig
        return save(fig, path)

    monkeypatch.setattr(plots, "_save", keep)
    return figures


def test_report_json_has_the_summary_of_the_sandwich_covariance():
    table = _table(n_chunks=4, rows=300)
    outcome = fit_table(_model(), table)
    model = outcome.model
    inference = _report(outcome, table)["inference"]
    assert inference["available"] is True
    assert inference["covariance_type"].startswith("sandwich")
    assert inference["alpha"] == 0.05 and inference["n_samples_seen"] == 1200
    rows = inference["parameters"]
    assert [r["name"] for r in rows] == ["x0", "x1", "x2", "x3", "intercept"]
    beta = np.append(model.coef_, model.intercept_)
    bse = model.bse_
    ci = model.conf_int()
    for j, row in enumerate(rows):
        assert row["coef"] == pytest.approx(beta[j], rel=1e-12)
        assert row["std err"] == pytest.approx(bse[j], rel=1e-12)
        assert row["z"] == pytest.approx(beta[j] / bse[j], rel=1e-12)
        assert 0 <= row["P>|z|"] <= 1
        assert [row["[0.025"], row["0.975]"]] == pytest.approx(ci[j], rel=1e-12)
        assert row["0.975]"] - row["[0.025"] == pytest.approx(2 * 1.959964 * bse[j], rel=1e-6)


def test_an_l1_report_says_inference_is_unavailable_and_why(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    table = _table(n_chunks=3)
    outcome = fit_table(_model(penalty="l1"), table)
    report = _report(outcome, table)
    assert report["inference"]["available"] is False
    assert "l1" in report["inference"]["reason"].lower()
    assert set(report["inference"]) == {"available", "reason"}
    figures = _drawn(monkeypatch)
    write_report(tmp_path, report)
    ax = figures["coefficients.png"].axes[0]
    assert len(ax.collections) == 0  # no bands
    assert any("no confidence intervals" in t.get_text() for t in ax.texts)


def test_the_history_and_the_report_carry_the_robust_diagnostics():
    table = _table(n_chunks=4, rows=250)
    outcome = fit_table(_model(tau=1.0), table)
    report = _report(outcome, table)
    history = outcome.history
    for record, (_, row) in zip(report["history"], history.iterrows(), strict=True):
        assert record["outlier_share"] == pytest.approx(row["outlier_share"])
        assert record["residual_scale"] == pytest.approx(row["residual_scale"])
        assert record["mean_loss"] == pytest.approx(row["mean_loss"])
    robust = report["robust_diagnostics"]
    assert robust["available"] is True and robust["chunks_reported"] == 4
    assert "reason" not in robust
    assert robust["outlier_share_mean"] == pytest.approx(history["outlier_share"].mean())
    assert robust["outlier_share_max"] == pytest.approx(history["outlier_share"].max())
    assert robust["residual_scale_median"] == pytest.approx(history["residual_scale"].median())
    # By hand at the last chunk's estimate (its rows are the last 250).
    X = np.asarray(table.X)[-250:]
    y = np.asarray(table.y)[-250:]
    model = outcome.model
    r = y - (X @ model.coef_ + model.intercept_)
    assert history["outlier_share"].iloc[-1] == pytest.approx(np.mean(np.abs(r) > 1.0))
    mad = np.median(np.abs(r - np.median(r)))
    assert history["residual_scale"].iloc[-1] == pytest.approx(1.482602218505602 * mad)
    psi = np.clip(r, -1.0, 1.0)
    assert history["mean_loss"].iloc[-1] == pytest.approx(np.mean(psi * (r - psi / 2)))


def _without_diagnostics(outcome, engine="gpu"):
    """The outcome as an engine that does not compute the optional diagnostics reports it."""
    from rh_dask.app.jobs import FitOutcome

    history = outcome.history.copy()
    history[["mean_loss", "outlier_share", "residual_scale"]] = np.nan
    return FitOutcome(
        model=outcome.model,
        history=history,
        trajectory=outcome.trajectory,
        seconds=outcome.seconds,
        engine=engine,
    )


def test_an_engine_without_diagnostics_is_named_and_nothing_is_drawn(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    table = _table(n_chunks=3)
    outcome = _without_diagnostics(fit_table(_model(), table))
    report = _report(outcome, table)
    robust = report["robust_diagnostics"]
    assert robust["available"] is False and robust["chunks_reported"] == 0
    assert robust["reason"] == "not reported by the gpu engine"
    assert all(h["outlier_share"] is None for h in report["history"])
    figures = _drawn(monkeypatch)
    write_report(tmp_path, report)
    top, bottom = figures["diagnostics.png"].axes
    for ax in (top, bottom):
        assert len(ax.lines) == 0
        assert ax.texts[0].get_text().endswith("not reported by the gpu engine")
    loss_ax = figures["convergence.png"].axes[1]
    assert (
        len(loss_ax.lines) == 0 and "not reported by the gpu engine" in loss_ax.texts[0].get_text()
    )


def test_plots_draw_bands_diagnostics_and_measured_times(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    table = _table(n_chunks=5, rows=240)
    outcome = fit_table(_model(tau=1.2), table)
    report = _report(outcome, table)
    figures = _drawn(monkeypatch)
    write_report(tmp_path, report)
    history = outcome.history
    # Coefficients: a line and a band per parameter (4 features and the intercept).
    ax = figures["coefficients.png"].axes[0]
    assert len(ax.lines) == 5 and len(ax.collections) == 5
    ci = outcome.model.conf_int()
    for band, (low, high) in zip(
        ax.collections,
        ci[[*np.argsort(-np.abs(outcome.model.coef_), kind="stable"), 4]],
        strict=True,
    ):
        ys = band.get_paths()[0].vertices[:, 1]
        assert ys.min() == pytest.approx(low) and ys.max() == pytest.approx(high)
    assert "final 95% interval" in ax.get_title()
    # Convergence: the mean Huber loss per chunk, not the 1/N objective.
    [loss] = figures["convergence.png"].axes[1].lines
    np.testing.assert_allclose(loss.get_ydata(), history["mean_loss"])
    np.testing.assert_array_equal(loss.get_xdata(), history["chunk"])
    # Diagnostics: share and scale per chunk, and the τ line.
    top, bottom = figures["diagnostics.png"].axes
    [share] = top.lines
    np.testing.assert_allclose(share.get_ydata(), history["outlier_share"])
    scale, tau = bottom.lines
    np.testing.assert_allclose(scale.get_ydata(), history["residual_scale"])
    assert tuple(tau.get_ydata()) == (1.2, 1.2)
    # Throughput: cumulative measured engine seconds, one marker per batch, the fit's end a point.
    top = figures["throughput.png"].axes[0]
    engine = top.lines[0]
    np.testing.assert_allclose(engine.get_xdata()[1:], np.cumsum(history["seconds"]))
    np.testing.assert_array_equal(engine.get_ydata()[1:], np.cumsum(history["rows"]))
    assert engine.get_marker() == "."
    end = top.lines[-1]
    assert list(end.get_xdata()) == [report["timings"]["fit_seconds"]]
    assert end.get_linestyle() == "None"


def test_waits_add_a_measured_curve(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from rh_dask.app import plots

    figures = _drawn(monkeypatch)
    history = [
        {"chunk": i, "rows": 100, "seconds": 0.01, "wait_seconds": 0.02 * i} for i in range(4)
    ]
    plots.throughput(history, tmp_path / "t.png")
    busy, walk = figures["t.png"].axes[0].lines
    np.testing.assert_allclose(busy.get_xdata(), [0, 0.01, 0.02, 0.03, 0.04])
    np.testing.assert_allclose(walk.get_xdata(), [0, 0.01, 0.04, 0.09, 0.16])


def _scores(n_batches=6, taus=(0.5, 1.345, 3.0)):
    import pandas as pd

    rng = np.random.default_rng(2)
    rows = []
    for b in range(n_batches):
        for j, tau in enumerate(taus):
            first = b == 0
            rows.append(
                {
                    "config": j,
                    "tau": tau,
                    "lambda_scale": 1.0,
                    "batch": b,
                    "huber_loss": np.nan if first else 0.5 + rng.random(),
                    "mae": np.nan if first else 0.8 + rng.random(),
                }
            )
    return pd.DataFrame(rows)


def test_prequential_scores_one_line_per_configuration(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from rh_dask.app import plots

    figures = _drawn(monkeypatch)
    scores = _scores()
    plots.prequential(scores, tmp_path / "p.png", selected=1)
    top, bottom = figures["p.png"].axes
    assert len(top.lines) == len(bottom.lines) == 3
    assert [line.get_label() for line in top.lines] == [
        "τ = 0.5",
        "τ = 1.345 (selected)",
        "τ = 3",
    ]
    for j, line in enumerate(bottom.lines):
        want = scores[scores["config"] == j].dropna()
        np.testing.assert_array_equal(
            line.get_xdata(), want["batch"]
        )  # the NaN first batch left out
        np.testing.assert_allclose(line.get_ydata(), want["mae"])
    with pytest.raises(ValueError, match="missing \\['mae'\\]"):
        plots.prequential(scores.drop(columns="mae"), tmp_path / "q.png")


def test_a_report_with_grid_scores_keeps_them_and_plots_them(tmp_path):
    pytest.importorskip("matplotlib")
    from rh_dask.app.report import GRID_FILE

    table = _table(n_chunks=2)
    outcome = fit_table(_model(), table)
    scores = _scores(n_batches=2)
    report = _report(outcome, table, grid_scores=scores)
    records = report["grid"]["scores"]
    assert len(records) == 6 and records[0]["huber_loss"] is None
    assert records[4]["mae"] == pytest.approx(scores["mae"].iloc[4])
    assert set(records[0]) == {"config", "tau", "lambda_scale", "batch", "huber_loss", "mae"}
    files = write_report(tmp_path, report)
    assert files[-1].name == GRID_FILE and files[-1].read_bytes()[:8] == PNG
    with pytest.raises(ValueError, match="grid scores lack the columns \\['huber_loss'\\]"):
        build_report(
            outcome,
            data={},
            feature_names=table.feature_names,
            grid_scores=scores.drop(columns="huber_loss"),
        )
