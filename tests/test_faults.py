"""Fault injection: lost engine workers, lost loading workers, a killed client, bad checkpoints.

Processes die by ``SIGKILL`` of their own process, from inside a chunk's
``map_blocks`` function (:func:`faults_helpers.die_at`), as a preempted host
or the OOM killer ends them. With ``loader="actor"`` the chunks load on the
engine's worker, so killing the process that loads chunk 3 kills the engine.
The cluster is a ``LocalCluster`` of two single-threaded worker processes
under nannies (which restart a killed worker at a new address).

Every recovered or resumed fit must give exactly, bit for bit, what the
uninterrupted fit of the same collection gives. Tests without a cluster (the
refused checkpoints) run the walk in this process.
"""

from __future__ import annotations

import errno
import math
import os
import subprocess
import sys
import time

import numpy as np
import pandas as pd
import pytest
from faults_helpers import (
    CHUNK_ROWS,
    N_CHUNKS,
    RESUME_PARAMS,
    arrays,
    collection,
    die_at,
    kills,
    slow_collection,
)
from threadpoolctl import threadpool_limits

from rh_dask import ActorLostError, CheckpointError, RenewableHuberRegressor, RhDaskError
from rh_dask.checkpoint_store import CheckpointStore
from rh_dask.distributed.consumer import STREAM_BLAS_THREADS
from rh_dask.stream import RECOVERY_COLUMNS

pytestmark = pytest.mark.timeout(120)

HISTORY = ["batch", "rows", "iterations", "converged", "objective"]


# -- fixtures and references ---------------------------------------------------------------
@pytest.fixture(scope="module")
def cluster():
    import dask.config
    from distributed import Client, LocalCluster

    # A LocalCluster closes a worker's nanny when, lost-worker-timeout (15 s)
    # after a loss, no worker of its name is registered: a second kill of the
    # same worker at that moment would then leave one worker for good.
    with (
        dask.config.set({"distributed.deploy.lost-worker-timeout": "1h"}),
        LocalCluster(
            n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0"
        ) as lc,
        Client(lc, direct_to_workers=True, set_as_default=False) as c,
    ):
        yield c


@pytest.fixture
def client(cluster):
    """The module's client, current for the test, once both workers are up again."""
    cluster.wait_for_workers(2, timeout=60)
    with cluster.as_current():
        yield cluster


def _pids(client) -> dict[int, str]:
    """Worker process ids -> addresses."""
    return {pid: address for address, pid in client.run(os.getpid).items()}


def _loop(X, y, n_chunks: int, **params) -> RenewableHuberRegressor:
    """A partial_fit loop over the first ``n_chunks`` chunks (the stream's BLAS pin)."""
    model = RenewableHuberRegressor(**params)
    with threadpool_limits(limits=STREAM_BLAS_THREADS, user_api="blas"):
        for i in range(n_chunks):
            rows = slice(i * CHUNK_ROWS, (i + 1) * CHUNK_ROWS)
            model.partial_fit(X[rows], y[rows])
    return model


def _assert_same_fit(model, ref) -> None:
    """Same coefficients, state and per-chunk history, bit for bit."""
    np.testing.assert_array_equal(model.coef_, ref.coef_)
    assert model.intercept_ == ref.intercept_
    assert model.state_.information.tobytes() == ref.state_.information.tobytes()
    assert model.state_.counters() == ref.state_.counters()
    pd.testing.assert_frame_equal(model.history_[HISTORY], ref.history_[HISTORY])
    assert model.coef_history_.tobytes() == ref.coef_history_.tobytes()


def _assert_recovery_row(row, *, kind: str, every: int, last_chunk: int) -> None:
    assert isinstance(row["time"], pd.Timestamp) and str(row["time"].tz) == "UTC"
    assert abs(row["time"] - pd.Timestamp.now(tz="UTC")) < pd.Timedelta(minutes=5)
    assert row["kind"] == kind
    assert row["from_chunk"] % every == 0 and 0 <= row["from_chunk"] <= last_chunk
    # The lost engine consumed at most the chunks before the one whose load killed it.
    assert 0 <= row["chunks_replayed"] <= last_chunk - row["from_chunk"]
    assert 0.0 <= row["recover_seconds"] < 60.0


# -- the engine's worker is lost -------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("at", [3, N_CHUNKS - 1], ids=["chunk_3", "last_chunk"])
def test_losing_the_engine_worker_once_recovers_bit_identically(client, tmp_path, at):
    X, y = arrays()
    log = str(tmp_path / "kills")
    spare = (os.getpid(),)
    Xd, yd = collection(
        X, y, die_at, at=at, marker=str(tmp_path / "fired"), log=log, spare=spare, delay=0.3
    )
    pids = _pids(client)
    params = dict(loader="actor", lookahead=2, progress=False)
    model = RenewableHuberRegressor(checkpoint_every=2, **params).fit(Xd, yd)
    (killed_pid, _), *more = kills(log)
    assert not more
    # The marker is taken: the same collection now loads without killing anyone.
    ref = RenewableHuberRegressor(**params).fit(Xd, yd)
    _assert_same_fit(model, ref)
    assert list(model.history_["chunk"]) == list(range(N_CHUNKS))
    _assert_same_fit(model, _loop(X, y, N_CHUNKS))

    rec = model.recoveries_
    assert list(rec.columns) == list(RECOVERY_COLUMNS)
    assert len(rec) == 1
    row = rec.iloc[0]
    _assert_recovery_row(row, kind="worker-lost", every=2, last_chunk=at)
    assert row["lost_worker"] == pids[killed_pid]
    assert row["new_worker"] and row["new_worker"] != row["lost_worker"]
    assert model.placement_["worker"] == row["new_worker"]
    assert 0.0 <= row["detect_seconds"] < 30.0
    assert ref.recoveries_.empty and list(ref.recoveries_.columns) == list(RECOVERY_COLUMNS)


@pytest.mark.slow
def test_losing_the_engine_worker_every_time_honours_max_retries(client, tmp_path):
    X, y = arrays()
    log = str(tmp_path / "kills")
    retries = 2
    # Chunk 3 kills whoever loads it, until the log holds retries + 1 kills.
    kill = dict(at=3, log=log, limit=retries + 1, spare=(os.getpid(),), delay=0.5)
    Xd, yd = collection(X, y, die_at, **kill)
    directory = tmp_path / "ckpt"
    model = RenewableHuberRegressor(
        checkpoint_every=2,
        checkpoint_dir=directory,
        max_retries=retries,
        loader="actor",
        lookahead=2,
        progress=False,
    )
    start = time.perf_counter()
    with pytest.raises(
        ActorLostError, match=f"lost {retries + 1} times.*max_retries={retries}"
    ) as info:
        model.fit(Xd, yd)
    assert "resume_from" in str(info.value)  # the message says how to go on
    assert time.perf_counter() - start < 60
    assert isinstance(info.value, RhDaskError)
    # The first engine and each of the `retries` new ones died loading chunk 3.
    assert len(kills(log)) == retries + 1
    assert len({pid for pid, _ in kills(log)}) == retries + 1
    # The model holds the last stream checkpoint: after chunks 0 and 1.
    assert info.value.chunk_index == 2
    _assert_same_fit(model, _loop(X, y, 2))
    assert len(model.recoveries_) == retries
    assert (model.recoveries_["from_chunk"] == 2).all()
    stored = CheckpointStore(directory).read()
    assert stored is not None and stored.walk.next_chunk == 2
    # The checkpoint left behind records the losses too, so a resume keeps them.
    assert [r.kind for r in stored.recoveries] == ["worker-lost"] * retries

    # The log is full: the same collection now loads, and the fit resumes from the directory.
    resumed = RenewableHuberRegressor(**model.get_params()).fit(Xd, yd, resume_from=directory)
    ref = RenewableHuberRegressor(loader="actor", lookahead=2, progress=False).fit(Xd, yd)
    _assert_same_fit(resumed, ref)
    # Those the checkpoint held (the losses), then the resume.
    kinds = ["worker-lost"] * retries + ["resume"]
    assert resumed.recoveries_["kind"].tolist() == kinds
    assert resumed.recoveries_["from_chunk"].iloc[-1] == 2


@pytest.mark.slow
def test_no_eligible_worker_within_the_timeout_raises_promptly(client, tmp_path):
    X, y = arrays()
    log = str(tmp_path / "kills")
    Xd, yd = collection(
        X,
        y,
        die_at,
        at=3,
        marker=str(tmp_path / "fired"),
        log=log,
        spare=(os.getpid(),),
        delay=0.5,
    )
    # The engine is pinned to one address: its nanny restarts the worker at
    # another, so no eligible worker ever comes back.
    victim = sorted(_pids(client).values())[0]
    model = RenewableHuberRegressor(
        worker=victim, checkpoint_every=2, loader="actor", lookahead=2, progress=False
    )
    import dask.config

    with (
        dask.config.set({"rh-dask.recovery.worker-timeout": "1s"}),
        pytest.raises(ActorLostError) as info,
    ):
        model.fit(Xd, yd)
    raised = time.time()
    ((_, killed_at),) = kills(log)
    assert raised - killed_at < 10.0
    assert victim in str(info.value) and "rh-dask.recovery.worker-timeout" in str(info.value)
    assert info.value.chunk_index == 2
    _assert_same_fit(model, _loop(X, y, 2))


# -- a loading worker is lost ----------------------------------------------------------------
@pytest.mark.slow
def test_losing_a_loading_worker_needs_no_recovery(client, tmp_path):
    X, y = arrays()
    pids = _pids(client)
    engine_pid, engine_worker = sorted(pids.items(), key=lambda kv: kv[1])[0]
    marker = tmp_path / "fired"
    log = str(tmp_path / "kills")
    # Any chunk loading on the other worker kills it, once; the engine's worker never dies.
    Xd, yd = collection(
        X, y, die_at, marker=str(marker), log=log, spare=(os.getpid(), engine_pid), delay=0.2
    )
    params = dict(worker=engine_worker, loader="cluster", lookahead=4, progress=False)
    model = RenewableHuberRegressor(**params).fit(Xd, yd)
    ((killed_pid, _),) = kills(log)
    assert pids[killed_pid] != engine_worker
    assert model.recoveries_.empty
    assert model.placement_["worker"] == engine_worker
    ref = RenewableHuberRegressor(**params).fit(Xd, yd)
    _assert_same_fit(model, ref)
    _assert_same_fit(model, _loop(X, y, N_CHUNKS))


# -- the client is lost ----------------------------------------------------------------------
@pytest.mark.slow
def test_a_killed_client_is_resumed_in_another_process(client, tmp_path):
    directory = tmp_path / "ckpt"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    code = "import sys, faults_helpers; sys.exit(faults_helpers.client_main(sys.argv[1:]))"
    proc = subprocess.Popen(
        [sys.executable, "-c", code, client.scheduler.address, str(directory)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    store = CheckpointStore(directory)
    try:
        deadline = time.monotonic() + 60
        seen = None
        while time.monotonic() < deadline and proc.poll() is None:
            ckpt = store.read() if os.path.exists(store.path) else None
            if ckpt is not None and ckpt.walk.next_chunk >= 4:
                seen = ckpt.walk.next_chunk
                break
            time.sleep(0.05)
        assert seen is not None, proc.stderr.read() if proc.poll() is not None else "timeout"
        proc.kill()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
    last = store.read()
    assert seen <= last.walk.next_chunk < N_CHUNKS  # killed before it finished

    Xd, yd = slow_collection()
    model = RenewableHuberRegressor(checkpoint_dir=directory, **RESUME_PARAMS)
    model.fit(Xd, yd, resume_from=directory)
    ref = RenewableHuberRegressor(**RESUME_PARAMS).fit(Xd, yd)
    _assert_same_fit(model, ref)
    assert list(model.history_["chunk"]) == list(range(N_CHUNKS))
    rec = model.recoveries_
    assert len(rec) == 1
    row = rec.iloc[0]
    _assert_recovery_row(row, kind="resume", every=1, last_chunk=N_CHUNKS)
    assert row["from_chunk"] == last.walk.next_chunk
    assert row["lost_worker"] == "" and row["new_worker"] == ""
    assert math.isnan(row["detect_seconds"])
    # The resumed fit went on checkpointing into the same directory, to the end.
    assert store.read().walk.next_chunk == N_CHUNKS


# -- refused checkpoints (no cluster: the walk runs in this process) -----------------------
@pytest.fixture
def finished(tmp_path):
    """A directory holding the stream checkpoint of a finished 12-chunk fit, and the model."""
    X, y = arrays()
    directory = tmp_path / "ckpt"
    model = RenewableHuberRegressor(checkpoint_every=2, checkpoint_dir=directory, progress=False)
    model.fit(*collection(X, y))
    return directory, model


@pytest.fixture
def fitted(make_stream):
    """A model fitted in memory: every refused resume must leave it as it is."""
    stream = make_stream(300, 5, seed=3)
    return RenewableHuberRegressor(progress=False).fit(stream.X, stream.y)


def test_a_finished_checkpoint_resumes_to_the_same_model(finished):
    directory, model = finished
    assert CheckpointStore(directory).read().walk.next_chunk == N_CHUNKS
    X, y = arrays()
    again = RenewableHuberRegressor(progress=False).fit(*collection(X, y), resume_from=directory)
    _assert_same_fit(again, model)


@pytest.mark.parametrize(
    ("other", "match"),
    [
        (lambda: arrays(n_chunks=10), "n_chunks"),
        (lambda: arrays(seed=14), "another input"),
        (lambda: arrays(d=6), "n_features"),
    ],
    ids=["chunk_count", "values", "width"],
)
def test_a_checkpoint_of_another_input_is_refused(
    finished, fitted, other, match, snapshot, assert_unchanged
):
    directory, _ = finished
    before = snapshot(fitted)
    with pytest.raises(CheckpointError, match=match) as info:
        fitted.fit(*collection(*other()), resume_from=directory)
    assert "another input" in str(info.value)
    assert_unchanged(before, snapshot(fitted))


def test_a_checkpoint_of_another_configuration_is_refused(
    finished, fitted, snapshot, assert_unchanged
):
    directory, _ = finished
    fitted.set_params(tau=2.0)
    before = snapshot(fitted)
    with pytest.raises(CheckpointError, match="tau"):
        fitted.fit(*collection(*arrays()), resume_from=directory)
    assert_unchanged(before, snapshot(fitted))


def _flip(data: bytes, needle: bytes, offset: int) -> bytes:
    """``data`` with one bit flipped ``offset`` bytes into the first copy of ``needle``."""
    at = data.find(needle)
    assert at >= 0, "the array is not stored as is"
    raw = bytearray(data)
    raw[at + offset] ^= 0x10
    return bytes(raw)


@pytest.mark.parametrize(
    "damage",
    [
        lambda raw, model: raw[: len(raw) // 2],
        lambda raw, model: raw[:-1],
        lambda raw, model: b"",
        lambda raw, model: _flip(raw, model.state_.information.tobytes(), 9),
        lambda raw, model: _flip(raw, model.coef_history_.tobytes(), 3),
    ],
    ids=["half", "last_byte", "empty", "information_byte", "history_byte"],
)
def test_a_damaged_checkpoint_is_refused_and_never_loaded(
    finished, fitted, damage, snapshot, assert_unchanged
):
    directory, model = finished
    store = CheckpointStore(directory)
    raw = open(store.path, "rb").read()
    bad = damage(raw, model)
    assert bad != raw
    with open(store.path, "wb") as fh:
        fh.write(bad)
    with pytest.raises(CheckpointError):
        store.read()
    before = snapshot(fitted)
    with pytest.raises(CheckpointError):
        fitted.fit(*collection(*arrays()), resume_from=directory)
    assert_unchanged(before, snapshot(fitted))


def test_resuming_from_a_directory_without_a_checkpoint_is_refused(
    tmp_path, fitted, snapshot, assert_unchanged
):
    before = snapshot(fitted)
    with pytest.raises(CheckpointError, match="no stream checkpoint"):
        fitted.fit(*collection(*arrays()), resume_from=tmp_path)
    assert_unchanged(before, snapshot(fitted))


def test_a_full_disk_skips_checkpoints_and_the_fit_goes_on(tmp_path, monkeypatch):
    # The disk fills up after the second stream checkpoint: its later writes fail at fsync.
    real_fsync, calls = os.fsync, []

    def fsync(fd: int) -> None:
        calls.append(fd)
        if len(calls) > 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_fsync(fd)

    X, y = arrays()
    directory = tmp_path / "ckpt"
    monkeypatch.setattr(os, "fsync", fsync)
    model = RenewableHuberRegressor(checkpoint_every=2, checkpoint_dir=directory, progress=False)
    with pytest.warns(RuntimeWarning, match="No space left on device"):
        model.fit(*collection(X, y))
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert len(calls) > 3  # every later checkpoint was attempted
    _assert_same_fit(model, RenewableHuberRegressor(progress=False).fit(*collection(X, y)))
    # The last checkpoint written is intact, and no partial file was left beside it.
    assert sorted(os.listdir(directory)) == ["stream.npz"]
    kept = CheckpointStore(directory).read()
    assert kept.walk.next_chunk == 4 and len(kept.records) == 4
    resumed = RenewableHuberRegressor(progress=False).fit(*collection(X, y), resume_from=directory)
    _assert_same_fit(resumed, model)
