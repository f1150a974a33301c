"""Fit reports: the segmented fit behind coefficient trajectories, report.json, plots."""

from __future__ import annotations

import importlib.util
import json
import sys

import dask.array as da
import numpy as np
import pytest

from rh_dask import RenewableHuberRegressor
from rh_dask.datasets import StreamSpec
from rh_dask.extras import MissingExtraError
from rh_dask.io import Table
from rh_dask.jobs import fit_table, resolve_engine
from rh_dask.report import _jsonable, build_report, write_report

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


@pytest.mark.parametrize("points", [1, 3, 6, 50])
def test_segments_give_the_single_fit_state_and_a_global_history(points):
    table = _table()
    single = _model().fit(table.X, table.y)
    outcome = fit_table(_model(), table, points=points)
    assert outcome.model.state_.equals(single.state_)
    assert list(outcome.history["chunk"]) == list(range(6))
    traj = outcome.trajectory
    assert len(traj.after_chunk) == min(points, 6) and traj.after_chunk[-1] == 6
    assert traj.rows[-1] == 1200 and traj.elapsed == sorted(traj.elapsed)
    final = np.append(single.coef_, single.intercept_)
    np.testing.assert_array_equal(traj.coefficients[-1], final)


def test_empty_chunks_are_counted_and_keep_global_chunk_numbers():
    table = _table(empty_at=2)
    outcome = fit_table(_model(), table, points=3)
    assert outcome.model.n_empty_chunks_ == 1
    assert list(outcome.history["chunk"]) == [0, 1, 3, 4, 5]


def test_a_leading_segment_of_empty_chunks_falls_back_to_one_fit():
    table = _table(n_chunks=4, empty_at=0)
    outcome = fit_table(_model(), table, points=4)
    assert outcome.model.n_samples_seen_ == 600
    assert outcome.trajectory.after_chunk == [4]
    assert list(outcome.history["chunk"]) == [1, 2, 3]


@pytest.mark.skipif(importlib.util.find_spec("cupy") is not None, reason="CuPy present")
def test_an_engine_that_cannot_start_falls_back_when_asked():
    outcome = fit_table(_model(engine="gpu"), _table(), points=2, fallback_engine="numpy")
    assert outcome.engine == "numpy" and "unavailable" in outcome.notes[0]


def test_auto_engine_follows_the_cluster():
    assert resolve_engine("auto", gpu_workers=True, has_client=True) == "gpu"
    assert resolve_engine("auto", gpu_workers=False, has_client=True) == "numpy"
    assert resolve_engine("auto", gpu_workers=False, has_client=False) == "auto"
    assert resolve_engine("numpy", gpu_workers=True, has_client=True) == "numpy"


def test_json_values_are_plain_and_non_finite_become_null():
    value = _jsonable({"a": np.float32(1.5), "b": [np.int64(2), float("nan")], "c": np.eye(2)})
    assert value == {"a": 1.5, "b": [2, None], "c": [[1.0, 0.0], [0.0, 1.0]]}
    json.dumps(value, allow_nan=False)


def test_report_json_and_plots(tmp_path):
    table = _table()
    outcome = fit_table(_model(penalty="l1"), table, points=3)
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
        "throughput.png",
    ]
    saved = json.loads(files[0].read_text())
    assert saved["schema"] == "rh-dask-report" and saved["schema_version"] == 1
    assert saved["parameters"]["penalty"] == "l1"
    assert saved["data"]["rows"] == 1200 and saved["data"]["chunks_consumed"] == 6
    assert saved["result"]["batch_count"] == 6 and saved["result"]["model"] == "model.npz"
    assert list(saved["result"]["coefficients"]) == ["x0", "x1", "x2", "x3", "(intercept)"]
    assert len(saved["history"]) == 6
    assert set(saved["history"][0]) >= {"chunk", "rows", "iterations", "converged", "objective"}
    traj = saved["coefficient_trajectory"]
    assert traj["after_chunk"] == [2, 4, 6] and len(traj["coefficients"][0]) == 5
    assert saved["timings"]["open_seconds"] == 0.1 and saved["timings"]["rows_per_second"] > 0
    assert saved["hardware"]["client"]["cpus"] >= 1 and saved["hardware"]["cluster"] is None
    assert saved["plots"] == ["coefficients.png", "convergence.png", "throughput.png"]
    assert saved["note"] == "test"
    for png in files[1:]:
        assert png.read_bytes()[:8] == PNG
    from matplotlib.image import imread

    height, width, _ = imread(files[1]).shape
    assert width > 600 and height > 400


def test_plots_survive_an_empty_report(tmp_path):
    from rh_dask import plots

    empty = {"names": [], "after_chunk": [], "rows": [], "elapsed_seconds": [], "coefficients": []}
    for path in (
        plots.coefficients(empty, tmp_path / "c.png"),
        plots.convergence([], tmp_path / "v.png"),
        plots.throughput(empty, [], tmp_path / "t.png"),
    ):
        assert path.read_bytes()[:8] == PNG


def test_many_features_draw_the_largest_and_the_intercept(tmp_path):
    from rh_dask import plots

    names = [f"x{j}" for j in range(30)] + ["(intercept)"]
    betas = np.linspace(-1, 1, 31)[None, :].repeat(2, axis=0)
    trajectory = {"names": names, "after_chunk": [1, 2], "coefficients": betas.tolist()}
    assert plots.coefficients(trajectory, tmp_path / "c.png").stat().st_size > 0


def test_missing_matplotlib_is_a_one_line_error(tmp_path, monkeypatch):
    table = _table(n_chunks=2)
    outcome = fit_table(_model(), table, points=1)
    report = build_report(outcome, data={}, feature_names=table.feature_names)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(MissingExtraError, match=r"pip install 'rh-dask\[report\]'"):
        write_report(tmp_path / "r", report)
    assert not (tmp_path / "r").exists()
