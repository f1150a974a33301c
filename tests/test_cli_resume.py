"""``rh-dask fit`` with stream checkpoints: --checkpoint-dir, --resume, Ctrl-C, --detach, attach.

Fits run in this process (``--scheduler none``) on a 1,200-row ``.npy`` input
cut into 12 chunks, except the subprocess runs that send SIGINT and the
detached fit, which needs a scheduler of its own. A chunk that raises
``KeyboardInterrupt`` while it loads stands for Ctrl-C at a known chunk: the
reader's method is patched, which leaves the input's dask token (and so its
fingerprint) as it was. Every resumed model is compared bit for bit with an
uninterrupted fit of the same input.
"""

from __future__ import annotations

import json
import os
import queue
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from rh_dask import RenewableHuberRegressor
from rh_dask.app import io as app_io
from rh_dask.app.cli import (
    EXIT_INPUT,
    EXIT_INTERRUPTED,
    EXIT_USAGE,
    _estimator,
    build_parser,
    main,
)
from rh_dask.checkpoint import load_checkpoint
from rh_dask.checkpoint_store import CheckpointStore
from rh_dask.datasets import StreamSpec

ROWS, CHUNK_ROWS, CHUNKS = 1200, 100, 12


@pytest.fixture(scope="module")
def rows(tmp_path_factory) -> Path:
    """1,200 rows of 3 features and the target (last column) in one ``.npy`` file."""
    root = tmp_path_factory.mktemp("resume-data")
    X, y = StreamSpec(n_features=3, seed=5).chunk(0, ROWS)
    path = root / "rows.npy"
    np.save(path, np.column_stack([X, y]))
    return path


def fit_argv(source: Path, output: Path, *extra: str, chunk_rows: int = CHUNK_ROWS) -> list[str]:
    return [
        "fit", "--input", str(source), "--target", "-1", "--chunk-rows", str(chunk_rows),
        "--output", str(output), "--scheduler", "none", "--no-progress", *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def uninterrupted(rows, tmp_path_factory) -> Path:
    """The model of one uninterrupted fit of ``rows``, without checkpoints."""
    path = tmp_path_factory.mktemp("resume-reference") / "model.npz"
    assert main(fit_argv(rows, path)) == 0
    return path


def assert_same_model(path: Path, reference: Path) -> None:
    got, expected = load_checkpoint(path).state, load_checkpoint(reference).state
    assert got.counters() == expected.counters()
    np.testing.assert_array_equal(got.coefficients, expected.coefficients)
    np.testing.assert_array_equal(got.information, expected.information)


@pytest.fixture
def interrupt_at(monkeypatch):
    """``interrupt_at(chunk, error=KeyboardInterrupt)``: loading that chunk raises, once."""

    def arm(chunk: int, error: type[BaseException] = KeyboardInterrupt) -> None:
        read = app_io.NpyRows.__getitem__
        fired = []

        def getitem(self, key):
            if not fired and key[0].start == chunk * CHUNK_ROWS:
                fired.append(key)
                raise error("the disk went away")
            return read(self, key)

        monkeypatch.setattr(app_io.NpyRows, "__getitem__", getitem)

    return arm


# -- options ---------------------------------------------------------------------------------
def test_fault_tolerance_options_set_the_estimator_parameters():
    parser = build_parser()
    base = ["fit", "--input", "x.npy", "--target", "-1", "--output", "m.npz"]
    options = ["--checkpoint-dir", "s3://bucket/run", "--checkpoint-every", "4"]
    args = parser.parse_args([*base, *options, "--max-retries", "0", "--resume"])
    params = _estimator(args, "numpy").get_params()
    assert params["checkpoint_dir"] == "s3://bucket/run"
    assert (params["checkpoint_every"], params["max_retries"]) == (4, 0)
    assert args.resume and not args.detach
    # Unset, each is the estimator's default (None: the rh-dask.* setting).
    defaults = _estimator(parser.parse_args(base), "numpy").get_params()
    estimator = RenewableHuberRegressor().get_params()
    for name in ("checkpoint_dir", "checkpoint_every", "max_retries"):
        assert defaults[name] == estimator[name] is None, name


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--resume"], "--resume needs --checkpoint-dir DIR"),
        (["--detach"], "--detach needs a running scheduler"),
        (["--detach", "--scheduler", "local"], "--scheduler local, would stop with it"),
        (["--detach", "--scheduler", "none"], "--detach needs a running scheduler"),
        (
            ["--detach", "--resume", "--checkpoint-dir", "d", "--scheduler", "tcp://h:8786"],
            "--detach and --resume exclude each other",
        ),
        (["--checkpoint-every", "0"], "expected a positive integer, got 0"),
        (["--max-retries", "-1"], "expected a whole number >= 0, got -1"),
        (["--max-retries", "few"], "expected a whole number >= 0, got 'few'"),
    ],
)
def test_fault_tolerance_usage_errors(tmp_path, capsys, extra, message):
    with pytest.raises(SystemExit) as exit_:
        main(fit_argv(tmp_path / "absent.npy", tmp_path / "m.npz", *extra))
    assert exit_.value.code == EXIT_USAGE
    assert message in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["attach", "rh-dask-fit-1"], "attach needs the fit's scheduler"),
        (["attach", "rh-dask-fit-1", "--scheduler", "local"], "attach needs the fit's scheduler"),
        (["attach"], "the following arguments are required: NAME"),
    ],
)
def test_attach_usage_errors(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == EXIT_USAGE
    assert message in capsys.readouterr().err


def test_a_checkpoint_dir_that_is_a_file_is_refused_before_any_work(rows, tmp_path, capsys):
    (tmp_path / "plain.txt").write_text("x")
    argv = fit_argv(rows, tmp_path / "m.npz", "--checkpoint-dir", str(tmp_path / "plain.txt"))
    assert main(argv) == EXIT_INPUT
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines() == [
        f"rh-dask: error: --checkpoint-dir {str(tmp_path / 'plain.txt')!r} is a file, "
        "not a directory"
    ]
    assert not (tmp_path / "m.npz").exists()


# -- interrupted, then resumed ---------------------------------------------------------------
def test_an_interrupted_fit_resumes_to_the_uninterrupted_model(
    rows, uninterrupted, tmp_path, capsys, interrupt_at
):
    model, store = tmp_path / "model.npz", tmp_path / "ckpt"
    argv = fit_argv(rows, model, "--checkpoint-dir", str(store), "--checkpoint-every", "2")
    interrupt_at(5)
    assert main(argv) == EXIT_INTERRUPTED
    captured = capsys.readouterr()
    (line,) = captured.err.splitlines()
    assert line.startswith(f"rh-dask: interrupted: stopped after 5 of {CHUNKS} chunks; ")
    assert f"the checkpoint in {store} keeps them; resume with: rh-dask fit " in line
    assert line.endswith(" --resume") and "fitted" not in captured.out
    assert not model.exists()
    kept = CheckpointStore(store).read()
    assert (kept.walk.next_chunk, kept.walk.n_chunks) == (5, CHUNKS)
    assert [r.chunk for r in kept.records] == [0, 1, 2, 3, 4]

    # The command the message gives, run again (the patched chunk raises only once).
    resume = shlex.split(line.split("resume with: ", 1)[1])[1:]
    assert resume == [*argv, "--resume"]
    assert main(resume) == 0
    out = capsys.readouterr().out
    assert "resumed at chunk 5: fitted 700 more rows in 7 chunks in " in out
    assert f"{ROWS:,} rows in {CHUNKS} chunks in all" in out
    assert_same_model(model, uninterrupted)
    resumed = RenewableHuberRegressor.load(model)
    assert resumed.n_samples_seen_ == ROWS
    finished = CheckpointStore(store).read()
    assert finished.walk.next_chunk == CHUNKS and len(finished.records) == CHUNKS


def test_a_chunk_that_cannot_be_loaded_ends_the_line_with_the_resume_command(
    rows, uninterrupted, tmp_path, capsys, interrupt_at
):
    """A failure a rerun can get past (here an I/O error) keeps its exit code and its
    message, and says how to resume; the resumed fit is the uninterrupted one."""
    model, store = tmp_path / "model.npz", tmp_path / "ckpt"
    argv = fit_argv(rows, model, "--checkpoint-dir", str(store))
    interrupt_at(7, OSError)
    assert main(argv) == EXIT_INPUT
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("rh-dask: error: chunk 7 could not be loaded: OSError: the disk "), line
    assert f"; the checkpoint in {store} keeps 7 of {CHUNKS} chunks; resume with: " in line
    assert shlex.split(line.split("resume with: ", 1)[1]) == ["rh-dask", *argv, "--resume"]
    assert not model.exists()
    assert main([*argv, "--resume"]) == 0
    assert "resumed at chunk 7: fitted 500 more rows in 5 chunks" in capsys.readouterr().out
    assert_same_model(model, uninterrupted)


def test_resume_refuses_a_checkpoint_of_another_input_and_a_damaged_one(rows, tmp_path, capsys):
    store = tmp_path / "ckpt"
    assert main(fit_argv(rows, tmp_path / "a.npz", "--checkpoint-dir", str(store))) == 0
    written = (store / "stream.npz").read_bytes()
    capsys.readouterr()
    # The same file cut into 8 chunks of 150 rows is another stream.
    other = fit_argv(rows, tmp_path / "b.npz", "--checkpoint-dir", str(store), "--resume")
    other[other.index("--chunk-rows") + 1] = "150"
    assert main(other) == EXIT_INPUT
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("rh-dask: error: ") and "another input" in line, line
    assert "n_chunks 12 != 8" in line or "n_chunks 8 != 12" in line, line
    assert not (tmp_path / "b.npz").exists()
    assert (store / "stream.npz").read_bytes() == written  # left as it was
    # The same input with another model option is another fit.
    tau = fit_argv(rows, tmp_path / "b.npz", "--checkpoint-dir", str(store), "--resume")
    assert main([*tau, "--tau", "2.5"]) == EXIT_INPUT
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("rh-dask: error: ") and "tau" in line, line
    assert not (tmp_path / "b.npz").exists()
    # A truncated checkpoint is refused, never loaded.
    (store / "stream.npz").write_bytes(written[: len(written) // 2])
    same = fit_argv(rows, tmp_path / "c.npz", "--checkpoint-dir", str(store), "--resume")
    assert main(same) == EXIT_INPUT
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("rh-dask: error: ") and "stream.npz" in line, line
    assert not (tmp_path / "c.npz").exists()


def test_resume_without_a_checkpoint_fits_from_the_first_chunk(
    rows, uninterrupted, tmp_path, capsys
):
    """A requeued job's first run: --resume finds nothing and fits the whole input."""
    store, model = tmp_path / "ckpt", tmp_path / "model.npz"
    argv = fit_argv(rows, model, "--checkpoint-dir", str(store), "--resume")
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert f"fitted {ROWS:,} rows in {CHUNKS} chunks in " in out
    assert f"note: no stream checkpoint in {store}: fitted from the first chunk" in out
    assert_same_model(model, uninterrupted)
    # Run again: the checkpoint is of a finished fit, nothing is left to walk.
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert f"resumed at chunk {CHUNKS}: fitted 0 more rows in 0 chunks" in out
    assert f"the checkpoint in {store} is a finished fit ({CHUNKS} of {CHUNKS} chunks)" in out
    assert_same_model(model, uninterrupted)
    # Without --resume the fit starts over, and says what it replaces.
    assert main(argv[:-1]) == 0
    out = capsys.readouterr().out
    assert f"fitted {ROWS:,} rows in {CHUNKS} chunks in " in out
    assert f"note: replaced the stream checkpoint in {store} ({CHUNKS} of {CHUNKS}" in out
    assert_same_model(model, uninterrupted)


def test_an_interruption_without_a_checkpoint_dir_says_nothing_was_kept(
    rows, tmp_path, capsys, interrupt_at
):
    interrupt_at(3)
    assert main(fit_argv(rows, tmp_path / "m.npz")) == EXIT_INTERRUPTED
    assert capsys.readouterr().err.splitlines() == [
        "rh-dask: interrupted; nothing was kept (--checkpoint-dir DIR keeps a checkpoint "
        "to resume)"
    ]


def test_an_interruption_before_the_first_chunk_keeps_nothing_to_resume(
    rows, tmp_path, capsys, interrupt_at
):
    store = tmp_path / "ckpt"
    interrupt_at(0)
    assert main(fit_argv(rows, tmp_path / "m.npz", "--checkpoint-dir", str(store))) == 130
    assert capsys.readouterr().err.splitlines() == [
        f"rh-dask: interrupted before the first chunk was fitted: {store} holds nothing "
        "of this fit to resume"
    ]
    assert CheckpointStore(store).read() is None


# -- Ctrl-C from a terminal ------------------------------------------------------------------
def _sigint_default() -> None:
    """In the child: Ctrl-C's default action, even under a shell that ignores it.

    A job a non-interactive shell starts in the background inherits SIGINT
    ignored, and Python then installs no KeyboardInterrupt handler.
    """
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _lines(stream, sink: queue.Queue) -> None:
    for line in stream:
        sink.put(line)
    sink.put(None)


@pytest.mark.slow
@pytest.mark.parametrize("scheduler", ["none", "local"])
def test_sigint_leaves_a_checkpoint_that_resumes_to_the_uninterrupted_model(
    tmp_path, monkeypatch, scheduler
):
    """SIGINT to the process group, as a terminal sends it, once a checkpoint was written."""
    X, y = StreamSpec(n_features=4, seed=12).chunk(0, 120_000)
    np.save(tmp_path / "rows.npy", np.column_stack([X, y]))  # 600 chunks of 200 rows
    store, model = tmp_path / "ckpt", tmp_path / "model.npz"
    fit = ["fit", "--input", "rows.npy", "--target", "-1", "--chunk-rows", "200", "--no-progress"]
    keep = ["--checkpoint-dir", str(store), "--checkpoint-every", "50"]
    cluster = ["--scheduler", scheduler]
    if scheduler == "local":
        cluster += ["--workers", "1", "--threads-per-worker", "2"]
    argv = [*fit, "--output", str(model), *cluster, *keep]
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    process = subprocess.Popen(
        [sys.executable, "-m", "rh_dask", *argv],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True, env=env, preexec_fn=_sigint_default,
    )  # fmt: skip
    err: queue.Queue = queue.Queue()
    reader = threading.Thread(target=_lines, args=(process.stderr, err), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 90
        while not (store / "stream.npz").exists():
            assert process.poll() is None, "the fit ended before its first checkpoint"
            assert time.monotonic() < deadline, "no checkpoint was written"
            time.sleep(0.05)
        os.killpg(process.pid, signal.SIGINT)
        code = process.wait(timeout=60)
        reader.join(timeout=30)
        stderr = "".join(iter(err.get_nowait, None))
        assert code == EXIT_INTERRUPTED, stderr
        (line,) = stderr.splitlines()
        stopped = re.match(r"rh-dask: interrupted: stopped after (\d+) of 600 chunks; ", line)
        assert stopped, line
        assert not model.exists()
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    kept = CheckpointStore(store).read()
    assert kept.walk.next_chunk == int(stopped.group(1))
    assert 50 <= kept.walk.next_chunk < 600
    # The command the message gives is this one with --resume; run here, in this process
    # (the walk's bits do not depend on where it runs), it gives the uninterrupted model.
    assert shlex.split(line.split("resume with: ", 1)[1]) == ["rh-dask", *argv, "--resume"]
    monkeypatch.chdir(tmp_path)
    here = ["--scheduler", "none"]
    assert main([*fit, "--output", str(model), *here, *keep, "--resume"]) == 0
    reference = tmp_path / "reference.npz"
    assert main([*fit, "--output", str(reference), *here]) == 0
    assert_same_model(model, reference)


# -- detached fits ---------------------------------------------------------------------------
@pytest.mark.slow
def test_a_detached_fit_is_collected_by_attach(rows, uninterrupted, tmp_path, capsys):
    """fit --detach returns at once with the fit's name; attach, from another client, saves
    the same model an in-process fit makes, writes the report, and forgets the fit."""
    from distributed import LocalCluster

    model, report = tmp_path / "model.npz", tmp_path / "report"
    with LocalCluster(
        n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None
    ) as cluster:
        address = cluster.scheduler_address
        argv = fit_argv(rows, model, "--report", str(report), "--detach")
        argv[argv.index("--scheduler") + 1] = address
        assert main(argv) == 0
        out = capsys.readouterr().out
        name = re.search(r"^detached fit: (rh-dask-fit-[0-9a-f]{8}) on ", out, re.M).group(1)
        command = shlex.split(re.search(r"^collect it with: (.*)$", out, re.M).group(1))
        assert command == [
            "rh-dask", "attach", name, "--scheduler", address, "--output", str(model),
            "--report", str(report),
        ]  # fmt: skip
        assert not model.exists()  # the command returned; the fit runs in the cluster
        assert main([*command[1:], "--no-progress"]) == 0
        out = capsys.readouterr().out
        assert f"detached fit {name}: " in out
        assert f"fitted {ROWS:,} rows in {CHUNKS} chunks in " in out
        assert f"model: {model}" in out
        assert_same_model(model, uninterrupted)
        written = json.loads((report / "report.json").read_text())
        assert written["data"]["format"] == "npy" and written["result"]["model"] == str(model)
        assert [h["chunk"] for h in written["history"]] == list(range(CHUNKS))
        # Saved, the fit was forgotten: a second attach finds no fit of that name.
        assert main([*command[1:5], "--no-progress"]) == EXIT_INPUT
        (line,) = capsys.readouterr().err.splitlines()
        assert line.startswith(f"rh-dask: error: no fit is published under {name!r}"), line
