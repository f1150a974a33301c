"""The ``rh-dask`` command line: subprocess runs of every command and exit code.

Data fixtures are small (1,200 rows in a few chunks) so that the runs cost
mostly interpreter start-up. Fits are compared with a plain loop of
``partial_fit`` over the chunks the command line is documented to make:
equal states prove the readers cut the stream where they say they do.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from threadpoolctl import threadpool_limits

from rh_dask import RenewableHuberRegressor
from rh_dask.checkpoint import load_checkpoint
from rh_dask.cli import (
    EXIT_CLUSTER,
    EXIT_ENGINE,
    EXIT_INPUT,
    EXIT_MISSING_EXTRA,
    EXIT_USAGE,
    main,
)
from rh_dask.datasets import StreamSpec
from rh_dask.io import InputError, detect_format, open_table, write_predictions
from rh_dask.jobs import fit_table

FEATURES = ["f0", "f1", "f2"]
N_ROWS = 1200


def run_cli(*args: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    """``python -m rh_dask ARGS`` in a fresh interpreter."""
    return subprocess.run(
        [sys.executable, "-m", "rh_dask", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def reference_state(batches, weights=None):
    """The state a plain loop of partial_fit reaches (BLAS pinned as streams pin it)."""
    model = RenewableHuberRegressor()
    with threadpool_limits(1):
        for i, (X, y) in enumerate(batches):
            w = None if weights is None else weights[i]
            model.partial_fit(X, y, sample_weight=w)
    return model.state_


def cut(array, sizes):
    out, start = [], 0
    for size in sizes:
        out.append(array[start : start + size])
        start += size
    return out


def assert_same_stream(model_path: Path, X, y, sizes, w=None):
    state = load_checkpoint(model_path).state
    expected = reference_state(
        list(zip(cut(X, sizes), cut(y, sizes), strict=True)),
        None if w is None else cut(w, sizes),
    )
    assert state.counters() == expected.counters()
    np.testing.assert_array_equal(state.coefficients, expected.coefficients)
    np.testing.assert_array_equal(state.information, expected.information)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """The same 1,200 rows as Parquet (3 files), CSV, a Zarr group and two .npy files."""
    root = tmp_path_factory.mktemp("cli-data")
    spec = StreamSpec(n_features=3, seed=7)
    parts = [spec.chunk(i, 400) for i in range(3)]
    X = np.concatenate([p[0] for p in parts])
    y = np.concatenate([p[1] for p in parts])
    w = np.random.default_rng(3).integers(1, 4, size=N_ROWS).astype(float)
    frame = pd.DataFrame(X, columns=FEATURES).assign(w=w, y=y)
    (root / "table.parquet").mkdir()
    for i in range(3):
        frame.iloc[400 * i : 400 * (i + 1)].to_parquet(
            root / "table.parquet" / f"part-{i}.parquet", index=False
        )
    frame.to_csv(root / "table.csv", index=False)
    import zarr

    group = zarr.open_group(root / "arrays.zarr", mode="w")
    group.create_array("X", data=X, chunks=(400, 3))
    group.create_array("y", data=y, chunks=(400,))
    matrix = np.column_stack([X, y])
    np.save(root / "rows-0.npy", matrix[:700])
    np.save(root / "rows-1.npy", matrix[700:])
    return {"root": root, "X": X, "y": y, "w": w, "frame": frame}


@pytest.fixture(scope="module")
def parquet_model(data):
    """A model fitted on the Parquet table, in this process (fast)."""
    path = data["root"] / "parquet-model.npz"
    args = ["fit", "--input", str(data["root"] / "table.parquet"), "--target", "y"]
    args += ["--features", *FEATURES, "--output", str(path), "--scheduler", "none"]
    assert main(args) == 0
    return path


# -- commands that succeed -------------------------------------------------------------------
def test_help_lists_commands_and_exit_codes(tmp_path):
    result = run_cli("--help", cwd=tmp_path)
    assert result.returncode == 0
    for word in ("demo", "fit", "predict", "info", "exit codes"):
        assert word in result.stdout
    version = run_cli("--version", cwd=tmp_path)
    assert version.returncode == 0 and version.stdout.startswith("rh-dask ")


def test_demo_runs_small_on_a_local_cluster(tmp_path):
    out = tmp_path / "demo"
    result = run_cli(
        "demo", "--rows", "12000", "--chunk-rows", "3000", "--features", "4",
        "--workers", "1", "--threads-per-worker", "2", "--output-dir", str(out),
        cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "cluster: local at tcp://127.0.0.1:" in result.stdout
    assert "rows/s" in result.stdout and "least squares" in result.stdout
    assert f"model: {out / 'model.npz'}" in result.stdout
    report = json.loads((out / "report" / "report.json").read_text())
    assert report["data"]["rows"] == 12000 and len(report["history"]) == 4
    assert report["coefficient_trajectory"]["after_chunk"] == [1, 2, 3, 4]
    assert report["demo"]["huber_error"] < report["demo"]["least_squares_error"]
    assert report["hardware"]["cluster"]["kind"] == "local"
    for name in ("coefficients.png", "convergence.png", "throughput.png"):
        assert (out / "report" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The generated data lived in a temporary directory, removed afterwards.
    assert not Path(report["data"]["path"]).exists()


@pytest.mark.parametrize(
    ("source", "extra", "sizes"),
    [
        ("table.parquet", ["--features", *FEATURES], [400, 400, 400]),  # a file per batch
        ("table.csv", ["--features", *FEATURES, "--chunk-rows", "500"], [500, 500, 200]),
        ("arrays.zarr", [], [400, 400, 400]),  # the Zarr chunks
        ("rows-*.npy", [], [700, 500]),  # a file per batch (each under 65,536 rows)
    ],
)
def test_fit_reads_each_format_into_the_documented_batches(data, tmp_path, source, extra, sizes):
    target = "-1" if source.endswith(".npy") else "y"
    model = tmp_path / "model.npz"
    result = run_cli(
        "fit", "--input", str(data["root"] / source), "--target", target, *extra,
        "--output", str(model), "--scheduler", "none", cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert f"fitted {N_ROWS:,} rows in {len(sizes)} chunks" in result.stdout
    assert_same_stream(model, data["X"], data["y"], sizes)


def test_fit_on_a_local_cluster_with_weights_and_report(data, tmp_path):
    """The console script, a local cluster, weights, a report with a point per chunk."""
    script = Path(sys.executable).with_name("rh-dask")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "rh_dask"]
    model, report_dir = tmp_path / "model.npz", tmp_path / "report"
    result = subprocess.run(
        [
            *command, "fit", "--input", str(data["root"] / "table.parquet"), "--target", "y",
            "--weight", "w", "--output", str(model), "--report", str(report_dir),
            "--workers", "1", "--threads-per-worker", "2",
        ],
        cwd=tmp_path, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert_same_stream(model, data["X"], data["y"], [400, 400, 400], w=data["w"])
    report = json.loads((report_dir / "report.json").read_text())
    assert report["schema"] == "rh-dask-report" and report["schema_version"] == 2
    assert report["data"]["features"] == FEATURES and report["data"]["weight"] == "w"
    assert [h["chunk"] for h in report["history"]] == [0, 1, 2]
    trajectory = report["coefficient_trajectory"]
    assert trajectory["after_chunk"] == [1, 2, 3] and trajectory["rows"] == [400, 800, 1200]
    state = load_checkpoint(model).state
    assert trajectory["coefficients"][-1] == state.coefficients.tolist()
    placement = report["engine"]["placement"]
    assert placement["worker"].startswith("tcp://") and placement["loader"] == "actor"
    assert report["engine"]["name"] == "numpy"
    assert set(report["result"]["coefficients"]) == {*FEATURES, "(intercept)"}
    assert report["parameters"]["tau"] == 1.345


def test_report_has_a_trajectory_point_per_non_empty_chunk(data, tmp_path):
    """An empty Parquet file is skipped: no point of its own, still counted in after_chunk."""
    source = tmp_path / "gappy.parquet"
    source.mkdir()
    frame = data["frame"]
    parts = [frame.iloc[:400], frame.iloc[:0], frame.iloc[400:800], frame.iloc[800:]]
    for i, part in enumerate(parts):
        part.to_parquet(source / f"part-{i}.parquet", index=False)
    model, report_dir = tmp_path / "model.npz", tmp_path / "report"
    args = ["fit", "--input", str(source), "--target", "y", "--features", *FEATURES]
    args += ["--output", str(model), "--report", str(report_dir), "--scheduler", "none"]
    assert main(args) == 0
    assert_same_stream(model, data["X"], data["y"], [400, 400, 400])
    report = json.loads((report_dir / "report.json").read_text())
    trajectory = report["coefficient_trajectory"]
    assert report["result"]["n_empty_chunks"] == 1 and len(report["history"]) == 3
    assert trajectory["after_chunk"] == [1, 3, 4] and trajectory["rows"] == [400, 800, 1200]
    assert len(trajectory["coefficients"]) == 3 and len(trajectory["engine_seconds"]) == 3
    final = load_checkpoint(model).state.coefficients
    assert trajectory["coefficients"][-1] == final.tolist()
    assert report["engine"]["placement"] is None


def test_lookahead_default_is_the_estimator_s():
    from rh_dask.cli import build_parser

    args = build_parser().parse_args(["fit", "--input", "x", "--target", "y", "--output", "m"])
    assert args.lookahead == RenewableHuberRegressor().get_params()["lookahead"]


def test_predict_writes_npy_parquet_and_csv(data, parquet_model, tmp_path):
    model = RenewableHuberRegressor.load(parquet_model)
    expected = model.predict(data["frame"][FEATURES])
    for name in ("pred.npy", "pred.parquet"):
        out = tmp_path / name
        result = run_cli(
            "predict", "--model", str(parquet_model), "--input",
            str(data["root"] / "table.parquet"), "--output", str(out), "--scheduler", "none",
            cwd=tmp_path,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        got = np.load(out) if name.endswith(".npy") else pd.read_parquet(out)["prediction"]
        np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-12)
    # In-process (same code path) for CSV, from the CSV input.
    csv_out = tmp_path / "pred.csv"
    args = ["predict", "--model", str(parquet_model), "--input", str(data["root"] / "table.csv")]
    assert main([*args, "--output", str(csv_out), "--scheduler", "none"]) == 0
    np.testing.assert_allclose(pd.read_csv(csv_out)["prediction"], expected, rtol=1e-12)
    # An existing output is kept unless --overwrite.
    assert main([*args, "--output", str(csv_out), "--scheduler", "none"]) == EXIT_INPUT
    assert main([*args, "--output", str(csv_out), "--scheduler", "none", "--overwrite"]) == 0


def test_info_shows_config_counters_and_named_coefficients(parquet_model, tmp_path):
    text = run_cli("info", str(parquet_model), cwd=tmp_path)
    assert text.returncode == 0, text.stderr
    assert f"{N_ROWS:,} rows in 3 batches" in text.stdout
    assert "tau=1.345" in text.stdout and "f2" in text.stdout and "(intercept)" in text.stdout
    as_json = run_cli("info", str(parquet_model), "--json", cwd=tmp_path)
    record = json.loads(as_json.stdout)
    assert record["feature_names"] == FEATURES
    assert record["counters"]["batch_count"] == 3
    assert set(record["coefficients"]) == {*FEATURES, "(intercept)"}


# -- documented failures ---------------------------------------------------------------------
def _nan_csv(root: Path) -> Path:
    path = root / "nan.csv"
    if not path.exists():
        rows = np.arange(30, dtype=float).reshape(10, 3)
        rows[6, 1] = np.nan  # in the second chunk of 5 rows
        pd.DataFrame(rows, columns=["a", "b", "y"]).to_csv(path, index=False)
    return path


@pytest.mark.parametrize(
    ("case", "code", "message"),
    [
        ("usage", EXIT_USAGE, "required"),
        ("missing-file", EXIT_INPUT, "no such file"),
        ("unknown-column", EXIT_INPUT, "target column 'nope' is not in"),
        ("bad-chunk", EXIT_INPUT, "chunk 1 was refused"),
        ("bad-model", EXIT_INPUT, "not an rh-dask checkpoint"),
        ("predict-width", EXIT_INPUT, "the model expects 3"),
        ("no-scheduler", EXIT_CLUSTER, "cannot connect to the Dask scheduler"),
        ("no-gpu", EXIT_ENGINE, "engine='gpu'"),
        ("missing-extra", EXIT_MISSING_EXTRA, "pip install 'rh-dask[io]'"),
    ],
)
def test_failures_exit_with_their_code_and_one_line(
    data, parquet_model, tmp_path, case, code, message
):
    root = data["root"]
    csv = ["--input", str(root / "table.csv")]
    out = ["--output", str(tmp_path / "m.npz")]
    local = ["--scheduler", "none"]
    unreachable = f"tcp://127.0.0.1:{free_port()}"
    argv = {
        "usage": ["fit", *csv],
        "missing-file": ["fit", "--input", str(root / "absent.parquet"), "--target", "y", *out],
        "unknown-column": ["fit", *csv, "--target", "nope", *out],
        "bad-chunk": [
            "fit", "--input", str(_nan_csv(root)), "--target", "y", *out, *local,
            "--chunk-rows", "5",
        ],
        "bad-model": ["info", str(root / "table.csv")],
        "predict-width": [
            "predict", "--model", str(parquet_model), "--input", str(root / "rows-0.npy"),
            "--output", str(tmp_path / "p.npy"), *local,
        ],
        "no-scheduler": [
            "fit", *csv, "--target", "y", *out, "--scheduler", unreachable,
            "--connect-timeout", "1",
        ],
        "no-gpu": ["fit", *csv, "--target", "y", *out, *local, "--engine", "gpu"],
        "missing-extra": ["fit", "--input", str(root / "arrays.zarr"), "--target", "y", *out],
    }[case]  # fmt: skip
    if case == "no-gpu" and importlib.util.find_spec("cupy") is not None:
        pytest.skip("CuPy is installed: engine='gpu' may start here")
    if case == "missing-extra":
        # A fresh interpreter in which zarr cannot be imported.
        program = (
            "import sys; sys.modules['zarr'] = None; from rh_dask.cli import main; "
            f"raise SystemExit(main({argv!r}))"
        )
        result = subprocess.run(
            [sys.executable, "-c", program], cwd=tmp_path, capture_output=True, text=True,
            timeout=120,
        )  # fmt: skip
    else:
        result = run_cli(*argv, cwd=tmp_path)
    assert result.returncode == code, result.stderr
    assert message in result.stderr
    if code != EXIT_USAGE:
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("rh-dask: error: "), result.stderr


# -- the readers, in this process --------------------------------------------------------------
@pytest.mark.parametrize(
    ("path", "fmt"),
    [
        ("x.parquet", "parquet"),
        ("x.pq", "parquet"),
        ("data/*.csv", "csv"),
        ("x.csv.gz", "csv"),
        ("x.zarr/", "zarr"),
        ("rows-*.npy", "npy"),
    ],
)
def test_formats_are_detected_from_names(path, fmt):
    assert detect_format(path) == fmt


def test_unknown_format_and_bad_columns_are_input_errors(data, tmp_path):
    with pytest.raises(InputError, match="--format"):
        detect_format(str(tmp_path / "data.bin"))
    with pytest.raises(InputError, match="cannot also be features"):
        open_table(data["root"] / "table.csv", target="y", features=["f0", "y"])
    text = tmp_path / "text.csv"
    pd.DataFrame({"a": [1.0, 2.0], "s": ["x", "z"], "y": [0.0, 1.0]}).to_csv(text, index=False)
    with pytest.raises(InputError, match=r"column 's'.*not numbers"):
        open_table(text, target="y")
    with pytest.raises(InputError, match="out of range"):
        open_table(data["root"] / "rows-0.npy", target="7")


def test_chunk_rows_recut_a_table_exactly(data):
    table = open_table(data["root"] / "table.parquet", target="y", chunk_rows=350)
    assert table.n_chunks == 4
    frame, y, weight = table.fit_inputs()
    assert y == "y" and weight is None
    sizes = [len(frame.partitions[i].compute()) for i in range(table.n_chunks)]
    assert sizes == [350, 350, 350, 150]


def test_a_few_columns_of_parquet_keep_one_batch_per_file(tmp_path):
    """Reading few columns must not merge Parquet partitions (dask's "tune" stage)."""
    spec = StreamSpec(n_features=8, seed=2)
    (tmp_path / "wide").mkdir()
    for i in range(9):
        X, y = spec.chunk(i, 50)
        frame = pd.DataFrame(X, columns=[f"c{j}" for j in range(8)]).assign(y=y)
        frame.to_parquet(tmp_path / "wide" / f"part-{i}.parquet", index=False)
    table = open_table(tmp_path / "wide", target="y", features=["c0"])
    outcome = fit_table(RenewableHuberRegressor(progress=False), table)
    assert len(outcome.history) == 9
    assert list(outcome.history["rows"]) == [50] * 9


def test_write_predictions_refuses_unknown_suffix(tmp_path):
    import dask.array as da

    with pytest.raises(InputError, match="must end in one of"):
        write_predictions(da.zeros(3, chunks=2), tmp_path / "out.txt")


# -- the documentation keeps up --------------------------------------------------------------
DOCS = Path(__file__).resolve().parents[1] / "docs"


def test_api_reference_covers_every_option_and_public_name():
    import argparse

    import rh_dask
    from rh_dask.cli import build_parser

    text = (DOCS / "api.md").read_text()
    parser = build_parser()
    (commands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    missing = []
    for name, sub in commands.choices.items():
        assert f"rh-dask {name}" in text
        for action in sub._actions:
            missing += [f"{name} {o}" for o in action.option_strings if o.startswith("--")]
    missing = [m for m in missing if f"`{m.split()[1]}" not in text and m.split()[1] != "--help"]
    assert not missing, missing
    names = [n for n in rh_dask.__all__ if n != "__version__"]
    assert not [n for n in names if f"`{n}" not in text]


def test_relative_links_of_the_docs_resolve():
    root = DOCS.parent
    pages = [root / "README.md", *DOCS.glob("*.md"), *(root / "deploy").rglob("README.md")]
    broken = []
    for page in pages:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" not in target and not (page.parent / target).exists():
                broken.append(f"{page.relative_to(root)} -> {target}")
    assert not broken, broken
