"""Detached fits: the walk coordinated from a task inside the cluster, collected by name.

The cluster is a ``LocalCluster`` of two single-threaded worker processes
under nannies. Every equality is bit for bit: the detached fit runs the walk
a client runs (the engine's BLAS pinned to one thread in both), only from a
worker. The disconnect test submits from a subprocess that exits as soon as
``submit_fit`` returns, while slowed chunks keep the walk running.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import dask.array as da
import numpy as np
import pytest
from distributed import Client, LocalCluster

from rh_dask import BadChunkError, DetachedFitError, RenewableHuberRegressor, ValidationError
from rh_dask.distributed import DetachedFit, submit_fit
from rh_dask.distributed.progress import watch_progress

pytestmark = pytest.mark.timeout(120)

N_ROWS, N_FEATURES, CHUNK = 4_800, 4, 400


def _data(seed: int = 3) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(N_ROWS, N_FEATURES))
    y = X @ rng.normal(size=N_FEATURES) + 0.5 + rng.standard_t(3, size=N_ROWS)
    return X, y


def _sleep_block(block, seconds):
    time.sleep(seconds)
    return block


def _slow(X: np.ndarray, seconds: float, chunk: int = CHUNK) -> da.Array:
    return da.from_array(X, chunks=(chunk, X.shape[1])).map_blocks(
        _sleep_block, seconds, dtype=X.dtype
    )


def _assert_same_fit(a, b) -> None:
    np.testing.assert_array_equal(a.coef_, b.coef_)
    assert a.intercept_ == b.intercept_
    np.testing.assert_array_equal(a.state_.coefficients, b.state_.coefficients)
    np.testing.assert_array_equal(a.state_.information, b.state_.information)
    assert a.state_.counters() == b.state_.counters()
    np.testing.assert_array_equal(a.coef_history_, b.coef_history_)


def _reference(X: np.ndarray, y: np.ndarray, client, chunk: int = CHUNK):
    """The same fit driven from this client."""
    with client.as_current():
        return RenewableHuberRegressor(progress=False).fit(
            da.from_array(X, chunks=(chunk, X.shape[1])), da.from_array(y, chunks=chunk)
        )


@pytest.fixture(scope="module")
def client():
    with (
        LocalCluster(
            n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0"
        ) as cluster,
        Client(cluster, set_as_default=False) as c,
    ):
        c.wait_for_workers(2)
        yield c


def test_watch_progress_sees_every_update_of_a_walk_in_this_thread():
    X, y = _data()
    calls = []
    with watch_progress(lambda *args: calls.append(args)):
        # No client here: the walk runs in this process, through the same counter.
        RenewableHuberRegressor(progress=False).fit(
            da.from_array(X, chunks=(1_200, N_FEATURES)), da.from_array(y, chunks=1_200)
        )
    assert calls[0] == (0, 4, 0)
    assert calls[-1] == (4, 4, N_ROWS)
    assert [c[0] for c in calls] == sorted(c[0] for c in calls)
    calls.clear()
    RenewableHuberRegressor(progress=False).fit(
        da.from_array(X, chunks=(1_200, N_FEATURES)), da.from_array(y, chunks=1_200)
    )
    assert calls == []  # the context ended


@pytest.mark.slow
def test_a_detached_fit_equals_the_fit_driven_from_the_client(client):
    X, y = _data()
    reference = _reference(X, y, client)
    estimator = RenewableHuberRegressor(progress=None)
    fit = submit_fit(
        estimator,
        da.from_array(X, chunks=(CHUNK, N_FEATURES)),
        da.from_array(y, chunks=CHUNK),
        client=client,
    )
    assert fit.name.startswith("rh-dask-fit-") and len(fit.name) == len("rh-dask-fit-") + 8
    model = fit.result(timeout=60)
    assert fit.status() == "finished"
    _assert_same_fit(model, reference)
    assert model.placement_["loader"] == "actor"
    assert model.progress is None  # the estimator's own parameter, back in place
    assert not hasattr(estimator, "coef_")  # the estimator given is not changed
    done = fit.progress()
    assert (done["chunks_done"], done["n_chunks"], done["rows_done"]) == (12, 12, N_ROWS)
    assert done["attempt"] == 1
    fit.forget()
    with pytest.raises(DetachedFitError, match="no fit is published"):
        DetachedFit.attach(fit.name, client=client)
    with pytest.raises(DetachedFitError, match="it was forgotten"):
        fit.progress()


@pytest.mark.slow
def test_progress_moves_while_the_fit_runs(client):
    X, y = _data()
    fit = submit_fit(
        RenewableHuberRegressor(progress=False),
        _slow(X, 0.3),
        da.from_array(y, chunks=CHUNK),
        name="moving",
        client=client,
    )
    try:
        seen = set()
        deadline = time.monotonic() + 60
        while fit.status() == "running" and time.monotonic() < deadline:
            seen.add(fit.progress()["chunks_done"])
            time.sleep(0.1)
        assert fit.status() == "finished"
        assert len(seen - {0, 12}) >= 2, seen  # intermediate counts were published
        assert fit.wait(timeout=5) == "finished"
        last = fit.progress()
        assert (last["chunks_done"], last["rows_done"]) == (12, N_ROWS)
        assert last["updated"].tzname() == "UTC"
        _assert_same_fit(fit.result(), _reference(X, y, client))
    finally:
        fit.forget()


SUBMITTER = """
import sys, time
import dask.array as da
import numpy as np
from distributed import Client, wait
from rh_dask import RenewableHuberRegressor
from rh_dask.distributed import submit_fit

def sleep_block(block):
    time.sleep(0.8)
    return block

address, name = sys.argv[1], sys.argv[2]
rng = np.random.default_rng(3)
X = rng.normal(size=({n}, {d}))
y = X @ rng.normal(size={d}) + 0.5 + rng.standard_t(3, size={n})
Xd = da.from_array(X, chunks=({chunk}, {d})).map_blocks(sleep_block, dtype=X.dtype)
with Client(address) as client:
    # y persisted by this client: the publication must keep it once this client is gone.
    yd = client.persist(da.from_array(y, chunks={chunk}))
    wait(yd)
    fit = submit_fit(RenewableHuberRegressor(progress=False), Xd, yd, name=name)
    print(fit.name, flush=True)
"""


@pytest.mark.slow
def test_a_fit_whose_client_disconnected_is_collected_by_a_new_client(client):
    X, y = _data()
    script = SUBMITTER.format(n=N_ROWS, d=N_FEATURES, chunk=CHUNK)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    done = subprocess.run(
        [sys.executable, "-c", script, client.scheduler.address, "orphan"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "orphan"
    # The submitting process and its client are gone; a new client takes the fit back.
    with Client(client.scheduler.address, set_as_default=False) as other:
        fit = DetachedFit.attach("orphan", client=other)
        try:
            assert fit.status() == "running", fit.progress()
            assert fit.progress()["chunks_done"] < 12
            assert fit.wait(timeout=60) == "finished"
            model = fit.result()
            assert model.placement_["loader"] != "actor"  # persisted y: loaded by tasks
            _assert_same_fit(model, _reference(X, y, client))
        finally:
            fit.forget()


def _nan_in_chunk_3(block, block_info=None):
    if block_info[0]["chunk-location"][0] == 3:
        block = block.copy()
        block[0, 0] = np.nan
    return block


@pytest.mark.slow
def test_result_of_a_failing_fit_raises_the_fits_error(client):
    X, y = _data()
    Xd = da.from_array(X, chunks=(CHUNK, N_FEATURES)).map_blocks(_nan_in_chunk_3, dtype=X.dtype)
    fit = submit_fit(
        RenewableHuberRegressor(progress=False), Xd, da.from_array(y, chunks=CHUNK), client=client
    )
    try:
        with pytest.raises(BadChunkError, match="chunk 3") as caught:
            fit.result(timeout=60)
        assert caught.value.chunk_index == 3
        assert fit.status() == "error"
        assert fit.progress()["chunks_done"] == 3
    finally:
        fit.forget()


@pytest.mark.slow
def test_a_cancelled_fit_stops_and_says_so(client):
    X, y = _data()
    fit = submit_fit(
        RenewableHuberRegressor(progress=False),
        _slow(X, 0.5),  # 12 chunks on 2 loading threads: 3 s uncancelled
        da.from_array(y, chunks=CHUNK),
        client=client,
    )
    try:
        deadline = time.monotonic() + 30
        while fit.progress()["chunks_done"] < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        fit.cancel()
        assert fit.status() == "cancelled"
        with pytest.raises(DetachedFitError, match="was cancelled"):
            fit.result(timeout=10)
        other = DetachedFit.attach(fit.name, client=client)
        assert other.status() == "cancelled" and other.wait() == "cancelled"
        with pytest.raises(DetachedFitError, match="was cancelled"):
            other.result()
        # The walk itself stopped: its last published count stays short of the end.
        time.sleep(4.0)
        assert fit.progress()["chunks_done"] < 12
    finally:
        fit.forget()


@pytest.mark.slow
def test_refused_submissions(client):
    X, y = _data()
    Xd, yd = da.from_array(X, chunks=(CHUNK, N_FEATURES)), da.from_array(y, chunks=CHUNK)
    model = RenewableHuberRegressor(progress=False)
    with pytest.raises(ValidationError, match="Dask array or DataFrame"):
        submit_fit(model, X, y, client=client)
    with pytest.raises(ValidationError, match="non-empty string"):
        submit_fit(model, Xd, yd, name="", client=client)
    client.publish_dataset(123, name="taken")
    try:
        with pytest.raises(ValidationError, match="'taken' is published"):
            submit_fit(model, Xd, yd, name="taken", client=client)
        with pytest.raises(DetachedFitError, match="not a detached fit"):
            DetachedFit.attach("taken", client=client)
    finally:
        client.unpublish_dataset("taken")
    with pytest.raises(DetachedFitError, match="no fit is published under 'nobody'"):
        DetachedFit.attach("nobody", client=client)


def test_without_a_client_there_is_no_detached_fit():
    X, y = _data()
    with pytest.raises(DetachedFitError, match="no client"):
        submit_fit(
            RenewableHuberRegressor(),
            da.from_array(X, chunks=(CHUNK, N_FEATURES)),
            da.from_array(y, chunks=CHUNK),
        )
    with pytest.raises(DetachedFitError, match="no client"):
        DetachedFit.attach("anything")


def _processing(client, key: str) -> str | None:
    """The worker running the task ``key`` now, if any."""
    for address, keys in client.processing().items():
        if key in keys:
            return address
    return None


@pytest.mark.slow
def test_a_task_run_again_after_its_worker_died_resumes_from_the_checkpoint_dir(client, tmp_path):
    # Last in the module: it kills a worker (its nanny starts a new one).
    X, y = _data()
    estimator = RenewableHuberRegressor(
        progress=False, checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every=1, lookahead=2
    )
    fit = submit_fit(
        estimator, _slow(X, 0.3), da.from_array(y, chunks=CHUNK), name="rerun", client=client
    )
    try:
        deadline = time.monotonic() + 30
        while fit.progress()["chunks_done"] < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert fit.status() == "running"
        coordinator = _processing(client, fit._future.key)
        assert coordinator is not None
        pid = client.run(os.getpid, workers=[coordinator])[coordinator]
        os.kill(pid, signal.SIGKILL)
        model = fit.result(timeout=60)
        assert fit.progress()["attempt"] == 2
        _assert_same_fit(model, _reference(X, y, client))
        resumed = model.recoveries_[model.recoveries_["kind"] == "resume"]
        assert len(resumed) == 1
        assert resumed["from_chunk"].iloc[0] >= 3  # chunks before it were not walked again
        assert len(model.history_) == 12
    finally:
        fit.forget()
