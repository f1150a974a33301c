"""The ``rh-dask`` command line: subprocess runs of every command and exit code.

Data fixtures are small (1,200 rows in a few chunks) so that the runs cost
mostly interpreter start-up. Fits are compared with a plain loop of
``partial_fit`` over the chunks the command line is documented to make:
equal states prove the readers cut the stream where they say they do.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import dask
import numpy as np
import pandas as pd
import pytest
from threadpoolctl import threadpool_limits

import rh_dask.settings
from rh_dask import RenewableHuberRegressor
from rh_dask.app.cli import (
    EXIT_CLUSTER,
    EXIT_ENGINE,
    EXIT_INPUT,
    EXIT_INTERRUPTED,
    EXIT_MISSING_EXTRA,
    EXIT_USAGE,
    _exit_code,
    build_parser,
    main,
)
from rh_dask.app.io import (
    INPUT_FORMATS,
    InputError,
    detect_format,
    input_files,
    open_table,
    write_predictions,
)
from rh_dask.app.jobs import fit_table
from rh_dask.app.sizing import input_rows
from rh_dask.checkpoint import load_checkpoint
from rh_dask.datasets import StreamSpec
from rh_dask.exceptions import ActorLostError, SchedulerLostError, StreamError
from rh_dask.settings import IN_PROCESS_MAX_ROWS, in_process_max_rows

FEATURES = ["f0", "f1", "f2"]
N_ROWS = 1200


def _sigint_default() -> None:
    """In the child: Ctrl-C's default action, even under a shell that ignores it.

    A job a non-interactive shell starts in the background inherits SIGINT
    ignored, and Python then installs no KeyboardInterrupt handler.
    """
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run_cli(
    *args: str, cwd: Path, timeout: float = 120, warnings: bool = False
) -> subprocess.CompletedProcess:
    """``python -m rh_dask ARGS`` in a fresh interpreter (warnings hidden unless asked for)."""
    env = dict(os.environ)
    if not warnings:
        env["PYTHONWARNINGS"] = "ignore"
    return subprocess.run(
        [sys.executable, "-m", "rh_dask", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
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
    for word in ("demo", "fit", "attach", "predict", "info", "exit codes"):
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
    for name in ("coefficients.png", "convergence.png", "diagnostics.png", "throughput.png"):
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
    assert report["schema"] == "rh-dask-report" and report["schema_version"] == 3
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
    from rh_dask.app.cli import build_parser

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
            "import sys; sys.modules['zarr'] = None; from rh_dask.app.cli import main; "
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


# -- output paths are checked before any work -----------------------------------------------
def _tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("fit-output-directory", "--output 'taken' is a directory"),
        ("fit-output-npz-directory", "--output 'taken.npz' is a directory"),
        ("fit-output-missing-directory", "the directory 'nowhere' does not exist"),
        ("fit-output-under-a-file", "'plain.txt' is not a directory"),
        ("fit-output-unwritable", "cannot write in '/proc'"),
        ("fit-report-is-a-file", "--report 'plain.txt' is a file, not a directory"),
        ("fit-report-under-a-file", "cannot be created: 'plain.txt' is a file"),
        ("fit-report-holds-a-directory", "report.json' is a directory"),
        ("predict-output-directory", "--output 'taken.npy' is a directory"),
        ("predict-output-exists", "--output 'old.parquet' exists; pass --overwrite"),
        ("predict-output-suffix", "the name must end in one of"),
        ("demo-output-dir-is-a-file", "--output-dir 'plain.txt' is a file"),
        ("demo-data-dir-not-empty", "--data-dir 'full' is not empty"),
    ],
)
def test_output_paths_are_refused_before_any_work(tmp_path, monkeypatch, capsys, case, message):
    """Exit 3, one line, nothing written; the input is missing, so only an up-front check sees
    the output (a fit would have reported the input first)."""
    if case.endswith("unwritable") and not os.path.isdir("/proc"):
        pytest.skip("needs /proc, a directory where no one can create files")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken.npz").mkdir()
    (tmp_path / "plain.txt").write_text("x")
    (tmp_path / "rep" / "report.json").mkdir(parents=True)
    (tmp_path / "old.parquet").mkdir()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("keep")
    (tmp_path / "taken.npy").mkdir()
    before = _tree(tmp_path)
    fit = ["fit", "--input", "absent.parquet", "--target", "y"]
    predict = ["predict", "--model", "absent.npz", "--input", "absent.parquet"]
    argv = {
        "fit-output-directory": [*fit, "--output", "taken"],
        "fit-output-npz-directory": [*fit, "--output", "taken.npz"],
        "fit-output-missing-directory": [*fit, "--output", "nowhere/m.npz"],
        "fit-output-under-a-file": [*fit, "--output", "plain.txt/m.npz"],
        "fit-output-unwritable": [*fit, "--output", "/proc/m.npz"],
        "fit-report-is-a-file": [*fit, "--output", "m.npz", "--report", "plain.txt"],
        "fit-report-under-a-file": [*fit, "--output", "m.npz", "--report", "plain.txt/r"],
        "fit-report-holds-a-directory": [*fit, "--output", "m.npz", "--report", "rep"],
        "predict-output-directory": [*predict, "--output", "taken.npy"],
        "predict-output-exists": [*predict, "--output", "old.parquet"],
        "predict-output-suffix": [*predict, "--output", "p.txt"],
        "demo-output-dir-is-a-file": ["demo", "--output-dir", "plain.txt"],
        "demo-data-dir-not-empty": ["demo", "--output-dir", "out", "--data-dir", "full"],
    }[case]
    monkeypatch.chdir(tmp_path)
    assert main(argv) == EXIT_INPUT
    captured = capsys.readouterr()
    assert captured.out == ""  # no cluster, no data, no fit
    (line,) = captured.err.splitlines()
    assert line.startswith("rh-dask: error: ") and message in line, line
    assert _tree(tmp_path) == before


def test_output_errors_are_one_line_from_the_command_line(tmp_path):
    (tmp_path / "taken").mkdir()
    result = run_cli(
        "fit", "--input", "absent.parquet", "--target", "y", "--output", "taken", cwd=tmp_path
    )
    assert result.returncode == EXIT_INPUT
    assert result.stdout == ""
    assert result.stderr.splitlines() == [
        "rh-dask: error: --output 'taken' is a directory; give a file name"
    ]


def test_predict_overwrites_a_parquet_dataset_only_when_asked(data, parquet_model, tmp_path):
    out = tmp_path / "pred.parquet"
    args = ["predict", "--model", str(parquet_model), "--input", str(data["root"] / "table.csv")]
    args += ["--output", str(out), "--scheduler", "none"]
    assert main(args) == 0
    assert main(args) == EXIT_INPUT
    assert main([*args, "--overwrite"]) == 0
    assert len(pd.read_parquet(out)) == N_ROWS


# -- columns, files and rows of the input ----------------------------------------------------
def test_fit_excludes_columns_and_records_them(data, tmp_path):
    frame = data["frame"].assign(id=np.arange(N_ROWS, dtype=float))
    source = tmp_path / "with-id.csv"
    frame.to_csv(source, index=False)
    model, report_dir = tmp_path / "model.npz", tmp_path / "report"
    args = ["fit", "--input", str(source), "--target", "y", "--weight", "w", "--exclude", "id"]
    assert main([*args, "--output", str(model), "--report", str(report_dir)]) == 0
    assert list(RenewableHuberRegressor.load(model).feature_names_in_) == FEATURES
    assert_same_stream(model, data["X"], data["y"], [N_ROWS], w=data["w"])
    report = json.loads((report_dir / "report.json").read_text())
    assert report["data"]["exclude"] == ["id"] and report["data"]["features"] == FEATURES


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--exclude", "id", "nope"], r"columns to exclude \['nope'\] are not in"),
        (["--features", "f0", "id", "--exclude", "id"], r"columns \['id'\] are both features"),
    ],
)
def test_fit_refuses_unknown_or_contradictory_exclusions(data, tmp_path, capsys, extra, message):
    source = tmp_path / "with-id.csv"
    data["frame"].assign(id=1.0).to_csv(source, index=False)
    model = tmp_path / "model.npz"
    argv = ["fit", "--input", str(source), "--target", "y", *extra, "--output", str(model)]
    assert main(argv) == EXIT_INPUT
    assert re.search(message, capsys.readouterr().err)
    assert not model.exists()


def test_exclusions_of_arrays_and_zarr_groups_are_checked(data):
    with pytest.raises(InputError, match="out of range"):
        open_table(data["root"] / "rows-0.npy", target="-1", exclude=["9"])
    with pytest.raises(InputError, match="both features and excluded"):
        open_table(data["root"] / "rows-0.npy", target="-1", features=["0:2"], exclude=["1"])
    with pytest.raises(InputError, match=r"columns to exclude \['Z'\]"):
        open_table(data["root"] / "arrays.zarr", target="y", exclude=["Z"])
    table = open_table(data["root"] / "rows-0.npy", target="-1", exclude=["0"])
    assert table.feature_names == ["x1", "x2"]


def test_a_header_only_csv_is_reported_as_having_no_rows(data, tmp_path):
    empty = tmp_path / "empty.csv"
    empty.write_text("f0,f1,y\n")
    with pytest.raises(InputError, match=r"'.*empty\.csv' has no rows: it holds a header only"):
        open_table(empty, target="y")
    data["frame"].to_csv(tmp_path / "full.csv", index=False)
    with pytest.raises(InputError, match=r"empty\.csv', the first file of .* has no rows"):
        open_table(tmp_path / "[ef]*.csv", target="y")
    # A real text column is still reported as one.
    text = tmp_path / "text.csv"
    text.write_text("a,s,y\n1,x,2\n")
    with pytest.raises(InputError, match=r"column 's'.*not numbers"):
        open_table(text, target="y")


def test_data_files_count_files_not_paths(data, tmp_path):
    root = data["root"]
    assert open_table(root / "table.parquet", target="y").description["files"] == 3
    assert open_table(root / "rows-*.npy", target="-1").description["files"] == 2
    assert open_table(root / "arrays.zarr", target="y").description["files"] == 1
    # Parquet dataset conventions: partition directories walked, _/. files are not data.
    dataset = tmp_path / "parts"
    for i, key in enumerate(("a", "a", "b")):
        (dataset / f"k={key}").mkdir(parents=True, exist_ok=True)
        data["frame"].iloc[:10].to_parquet(dataset / f"k={key}" / f"part-{i}.parquet")
    (dataset / "_SUCCESS").write_text("")
    (dataset / "k=a" / ".part-0.parquet.crc").write_text("")
    assert len(input_files(dataset, "parquet")) == 3


def test_row_counts_come_from_metadata(data, tmp_path):
    root = data["root"]
    parquet = open_table(root / "table.parquet", target="y")
    count = input_rows(parquet, input_files(root / "table.parquet"))
    assert (count.rows, count.exact) == (N_ROWS, True)
    assert input_rows(parquet, input_files(root / "table.parquet"), limit=500).rows == 800
    npy = open_table(root / "rows-*.npy", target="-1")
    assert input_rows(npy, input_files(root / "rows-*.npy")).rows == N_ROWS
    csv = open_table(root / "table.csv", target="y")
    estimate = input_rows(csv, input_files(root / "table.csv"))
    assert not estimate.exact and abs(estimate.rows - N_ROWS) < 0.05 * N_ROWS
    gz = tmp_path / "table.csv.gz"
    data["frame"].to_csv(gz, index=False)
    assert input_rows(open_table(gz, target="y"), [str(gz)]) is None  # no cheap count


# -- the scheduler a command uses ------------------------------------------------------------
def test_a_small_input_runs_in_process_and_says_so(data, tmp_path, capsys):
    model = tmp_path / "model.npz"
    argv = ["fit", "--input", str(data["root"] / "table.parquet"), "--target", "y"]
    assert main([*argv, "--features", *FEATURES, "--output", str(model)]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    limit = in_process_max_rows()
    assert first == (
        f"in-process: {N_ROWS:,} rows below the cluster threshold ({limit:,}); "
        "--scheduler local to force a cluster"
    )
    assert RenewableHuberRegressor.load(model).n_samples_seen_ == N_ROWS


@pytest.mark.parametrize(
    ("setting", "extra", "expected"),
    [
        (N_ROWS + 1, [], "none"),
        (N_ROWS, [], "local"),  # at the threshold: a cluster
        (0, [], "local"),
        (10**9, ["--workers", "2"], "local"),  # a local-cluster option asks for one
        (10**9, ["--loader", "cluster"], "local"),
        (10**9, ["--scheduler", "local"], "local"),
        (0, ["--scheduler", "none"], "none"),
    ],
)
def test_auto_scheduler_follows_the_setting_and_the_options(data, setting, extra, expected):
    from rh_dask.app.cli import _choose_scheduler

    path = str(data["root"] / "table.parquet")
    args = build_parser().parse_args(
        ["fit", "--input", path, "--target", "y", "--output", "m.npz", *extra]
    )
    table = open_table(path, target="y")
    with dask.config.set({IN_PROCESS_MAX_ROWS: setting}):
        assert _choose_scheduler(args, table)[0] == expected


def test_auto_scheduler_starts_a_gpu_cluster_where_local_means_one(data, monkeypatch):
    """The threshold was measured against CPU clusters; a GPU cluster brings the GPU engine."""
    import rh_dask.app.cluster
    from rh_dask.app.cli import _choose_scheduler

    path = str(data["root"] / "table.parquet")
    args = build_parser().parse_args(["fit", "--input", path, "--target", "y", "--output", "m"])
    table = open_table(path, target="y")
    assert _choose_scheduler(args, table)[0] == "none"
    monkeypatch.setattr(rh_dask.app.cluster, "gpu_count", lambda: 1)
    assert _choose_scheduler(args, table) == ("local", None)


def test_the_threshold_is_a_dask_setting_with_an_environment_variable(data, tmp_path):
    import yaml

    packaged = Path(rh_dask.settings.__file__).with_name("rh-dask.yaml")
    default = yaml.safe_load(packaged.read_text())["rh-dask"]["cli"]["in-process-max-rows"]
    program = f"import dask, rh_dask; print(dask.config.get({IN_PROCESS_MAX_ROWS!r}))"
    env = {k: v for k, v in os.environ.items() if not k.startswith("DASK_")}
    loaded = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, env=env, timeout=120
    )
    assert loaded.stdout.strip() == str(default) and default > 0, loaded.stderr  # on import
    env["DASK_RH_DASK__CLI__IN_PROCESS_MAX_ROWS"] = "1234"
    result = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, env=env, timeout=120
    )
    assert result.stdout.strip() == "1234", result.stderr
    with dask.config.set({IN_PROCESS_MAX_ROWS: 77}):
        assert in_process_max_rows() == 77
    env["DASK_RH_DASK__CLI__IN_PROCESS_MAX_ROWS"] = "many"
    argv = ["fit", "--input", str(data["root"] / "table.csv"), "--target", "y"]
    bad = subprocess.run(
        [sys.executable, "-m", "rh_dask", *argv, "--output", str(tmp_path / "m.npz")],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert bad.returncode == EXIT_USAGE
    assert bad.stderr.splitlines() == [
        "rh-dask: error: setting rh-dask.cli.in-process-max-rows "
        "(DASK_RH_DASK__CLI__IN_PROCESS_MAX_ROWS) must be a whole number >= 0, got 'many'"
    ]
    assert not (tmp_path / "m.npz").exists()


def test_dashboard_needs_a_cluster(data, tmp_path, capsys):
    argv = ["fit", "--input", str(data["root"] / "table.csv"), "--target", "y"]
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--output", str(tmp_path / "m.npz"), "--scheduler", "none", "--dashboard"])
    assert exit_.value.code == EXIT_USAGE
    assert "--dashboard needs a cluster" in capsys.readouterr().err


# -- the local cluster ---------------------------------------------------------------------
def test_local_cluster_is_quiet_without_a_dashboard_and_prints_one_when_asked(data, tmp_path):
    """A taken port 8787 (distributed's dashboard default) gives no warning; --dashboard
    serves one and prints its link."""
    holder = socket.socket()
    try:
        holder.bind(("127.0.0.1", 8787))
        holder.listen()
    except OSError:
        pass  # taken already: the case under test
    try:
        argv = ["fit", "--input", str(data["root"] / "table.parquet"), "--target", "y"]
        argv += ["--output", str(tmp_path / "m.npz"), "--workers", "1"]
        quiet = run_cli(*argv, cwd=tmp_path, warnings=True)
        assert quiet.returncode == 0, quiet.stderr
        assert quiet.stderr == ""
        assert quiet.stdout.startswith("cluster: local at tcp://127.0.0.1:")
        assert "dashboard" not in quiet.stdout
        shown = run_cli(*argv, "--dashboard", "127.0.0.1:0", cwd=tmp_path, warnings=True)
        assert shown.returncode == 0, shown.stderr
        assert re.search(r"^dashboard: http://127\.0\.0\.1:\d+/status", shown.stdout, re.M)
    finally:
        holder.close()


def _listening(process) -> set[tuple[str, int]]:
    import psutil

    return {
        (c.laddr.ip, c.laddr.port)
        for c in process.net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN
    }


def test_local_cluster_listens_on_loopback_only():
    """Scheduler, nannies, workers and their HTTP servers: 127.0.0.1, never 0.0.0.0."""
    import psutil

    from rh_dask.app.cluster import open_cluster

    me = psutil.Process()
    before = _listening(me)
    with open_cluster("local", n_workers=2, threads_per_worker=1) as session:
        children = me.children(recursive=True)
        addresses = _listening(me) - before
        for child in children:
            addresses |= _listening(child)
        assert session.cluster.scheduler.http_server is not None
    assert len(addresses) >= 5  # scheduler, its HTTP server, 2 nannies, 2 workers...
    assert {ip for ip, _ in addresses} == {"127.0.0.1"}, addresses


def _lines(stream, sink: queue.Queue) -> None:
    for line in stream:
        sink.put(line)
    sink.put(None)


def test_an_interrupted_wait_on_an_actor_adds_no_warning_to_the_line(monkeypatch, capsys):
    """distributed's ActorFuture leaves its result coroutine unawaited when interrupted."""
    import warnings

    from rh_dask.app import cli as cli_module

    class ActorFuture:  # the name Python's warning carries
        async def _result(self):
            return None

    def handler(args, argv):
        waiting = ActorFuture()._result()  # noqa: F841 - abandoned, as an interrupt does
        raise KeyboardInterrupt

    parser = argparse.ArgumentParser()
    parser.set_defaults(handler=handler, traceback=False)
    monkeypatch.setattr(cli_module, "build_parser", lambda: parser)
    monkeypatch.setattr(cli_module, "_check_usage", lambda parser, args: None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert cli_module.main([]) == cli_module.EXIT_INTERRUPTED
    assert [str(w.message) for w in caught] == []
    assert capsys.readouterr().err.splitlines() == ["rh-dask: interrupted"]


def test_ctrl_c_on_the_default_local_cluster_is_one_line_and_prompt(tmp_path):
    """SIGINT to the process group, as a terminal sends it, in the middle of a fit."""
    spec = StreamSpec(n_features=4, seed=11)
    X, y = spec.chunk(0, 400_000)
    np.save(tmp_path / "rows.npy", np.column_stack([X, y]))  # 2,000 chunks: seconds of fit
    model = tmp_path / "model.npz"
    argv = ["fit", "--input", "rows.npy", "--target", "-1", "--chunk-rows", "200"]
    argv += ["--output", str(model), "--scheduler", "local"]
    process = subprocess.Popen(
        [sys.executable, "-m", "rh_dask", *argv],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True, preexec_fn=_sigint_default,
    )  # fmt: skip
    out: queue.Queue = queue.Queue()
    err: queue.Queue = queue.Queue()
    readers = [
        threading.Thread(target=_lines, args=(process.stdout, out), daemon=True),
        threading.Thread(target=_lines, args=(process.stderr, err), daemon=True),
    ]
    for reader in readers:
        reader.start()
    started = time.monotonic()
    try:
        first = out.get(timeout=120)
        # How long this machine took to start the cluster: under load (CI runs
        # other work beside) everything, shutting down included, is slower.
        startup = time.monotonic() - started
        assert first is not None and first.startswith("cluster: local at"), first
        time.sleep(1.5)  # the fit is under way
        os.killpg(process.pid, signal.SIGINT)
        signalled = time.monotonic()
        code = process.wait(timeout=60)
        elapsed = time.monotonic() - signalled
        for reader in readers:
            reader.join(timeout=30)
        stdout = "".join(iter(out.get_nowait, None))
        stderr = "".join(iter(err.get_nowait, None))
        assert code == EXIT_INTERRUPTED, stderr
        assert stderr.splitlines() == [
            "rh-dask: interrupted; nothing was kept (--checkpoint-dir DIR keeps a checkpoint "
            "to resume)"
        ], stderr
        assert "fitted" not in stdout and not model.exists()  # interrupted mid-fit
        # Prompt: the command does not wait for the fit (or a hung worker); the
        # bound grows with how slow this machine is right now.
        assert elapsed < 10 + 2 * startup, (elapsed, startup)
        # The worker processes are gone too (none left in the process group).
        deadline = time.monotonic() + 10
        while True:
            try:
                os.killpg(process.pid, 0)
            except ProcessLookupError:
                break
            assert time.monotonic() < deadline, "worker processes outlived the command"
            time.sleep(0.2)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


# -- the documentation keeps up --------------------------------------------------------------
DOCS = Path(__file__).resolve().parents[1] / "docs"


def test_api_reference_covers_every_option_and_public_name():
    import argparse

    import rh_dask
    from rh_dask.app.cli import build_parser

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


def test_the_cli_choices_and_defaults_are_the_librarys():
    from rh_dask.app.cli import build_parser
    from rh_dask.app.cluster import open_cluster
    from rh_dask.config import DTYPES, PENALTIES
    from rh_dask.distributed.coordinator import LOADERS
    from rh_dask.engines import ENGINE_NAMES

    parser = build_parser()
    (commands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    estimator = RenewableHuberRegressor().get_params()
    choices = {"engine": ENGINE_NAMES, "dtype": DTYPES, "penalty": PENALTIES, "loader": LOADERS}
    for name in ("demo", "fit"):
        actions = {a.dest: a for a in commands.choices[name]._actions}
        for dest, expected in choices.items():
            assert tuple(actions[dest].choices) == tuple(expected), (name, dest)
        for dest in (*choices, "tau", "lambda_scale", "bandwidth_scale", "max_iter", "tol",
                     "ridge", "lookahead", "device", "worker"):  # fmt: skip
            assert actions[dest].default == estimator[dest], (name, dest)
        # --no-intercept turns off an intercept the estimator fits by default.
        assert estimator["fit_intercept"] is True and actions["no_intercept"].default is False
        timeout = inspect.signature(open_cluster).parameters["timeout"].default
        assert actions["connect_timeout"].default == timeout
    demo = {a.dest: a.default for a in commands.choices["demo"]._actions}
    assert (demo["features"], demo["seed"]) == (StreamSpec().n_features, StreamSpec().seed)
    predict = {a.dest: a for a in commands.choices["predict"]._actions}
    column = inspect.signature(write_predictions).parameters["column"].default
    assert predict["column"].default == column
    assert tuple(predict["format"].choices) == INPUT_FORMATS


def test_a_lost_actor_or_scheduler_is_a_cluster_failure_and_other_stream_errors_bad_input():
    assert _exit_code(ActorLostError("the engine's worker went away")) == EXIT_CLUSTER
    assert _exit_code(SchedulerLostError("the scheduler went away")) == EXIT_CLUSTER
    assert _exit_code(StreamError("a chunk of the wrong width")) == EXIT_INPUT
