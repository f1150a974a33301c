"""engine="auto" on a Dask walk: decided on the engine's worker at the first chunk.

The cluster is threaded (``processes=False``): its workers run in this
process, so the process's calibrator, given a simulated host of scripted
engine costs (see ``test_engine_auto.py``), is the one the engine's actor
uses. One worker advertises the GPU resource, as a GPU worker does; without
CuPy here, a GPU choice cannot start and exercises the fallback.
"""

from __future__ import annotations

import threading

import dask.array as da
import numpy as np
import pytest
from distributed import Client, LocalCluster
from test_engine_auto import Host, linear, no_gpu_engine
from threadpoolctl import threadpool_limits

from rh_dask import RenewableHuberRegressor, StreamError
from rh_dask.checkpoint_store import CheckpointStore
from rh_dask.distributed.consumer import STREAM_BLAS_THREADS
from rh_dask.engines.auto import default_calibrator

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

CHUNKS = (400, 300, 500, 400, 400)
#: The GPU's fixed cost dominates every batch: the calibration picks NumPy.
SLOW_GPU = (linear(1e-4, 1e-9), linear(1e-2, 1e-11))
#: The GPU is far faster: the calibration picks it.
FAST_GPU = (linear(1e-3, 1e-8), linear(1e-5, 1e-11))


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster(
        n_workers=2, threads_per_worker=2, processes=False, dashboard_address=":0"
    ) as lc:
        # One worker that advertises a GPU: the auto actor's place.
        gpu = next(iter(lc.workers.values()))
        gpu.state.total_resources["GPU"] = 1
        gpu.state.available_resources["GPU"] = 1
        with Client(lc, set_as_default=False) as c:
            c.run_on_scheduler(_advertise_gpu, gpu.address)
            yield c, gpu.address


def _advertise_gpu(address, dask_scheduler=None):
    ws = dask_scheduler.workers[address]
    ws.resources["GPU"] = 1
    dask_scheduler.resources.setdefault("GPU", {})[address] = 1


@pytest.fixture
def client(cluster):
    c, _ = cluster
    with c.as_current():
        yield c


@pytest.fixture
def host_of(monkeypatch):
    """Install a simulated host in the process's calibrator (fresh cache), recording threads."""
    cal = default_calibrator()
    cal.forget()

    def install(costs):
        host = Host(*costs)
        host.threads = []
        factory = host.factory

        def recording(*args):
            host.threads.append(threading.current_thread().name)
            return factory(*args)

        monkeypatch.setattr(cal, "_factory", recording)
        return host

    yield install
    cal.forget()


def _data(d=4, seed=5):
    rng = np.random.default_rng(seed)
    n = sum(CHUNKS)
    X = rng.normal(size=(n, d))
    y = X @ rng.normal(size=d) + 0.25 + rng.standard_t(2, size=n)
    return X, y


def _collection(X, y, fn=None):
    Xd = da.from_array(X, chunks=(CHUNKS, X.shape[1]))
    if fn is not None:
        Xd = Xd.map_blocks(fn, dtype=Xd.dtype)
    return Xd, da.from_array(y, chunks=(CHUNKS,))


def _numpy_loop(X, y, chunks=CHUNKS):
    model = RenewableHuberRegressor(engine="numpy")
    start = 0
    with threadpool_limits(limits=STREAM_BLAS_THREADS, user_api="blas"):
        for size in chunks:
            model.partial_fit(X[start : start + size], y[start : start + size])
            start += size
    return model


def _same_stream(a, b):
    assert a.coef_history_.tobytes() == b.coef_history_.tobytes()
    assert a.state_.coefficients.tobytes() == b.state_.coefficients.tobytes()
    assert a.state_.information.tobytes() == b.state_.information.tobytes()


def test_auto_decides_on_the_engines_worker_and_equals_the_loop(client, cluster, host_of):
    host = host_of(SLOW_GPU)
    X, y = _data()
    model = RenewableHuberRegressor(progress=False).fit(*_collection(X, y))
    # Calibrated once, on the actor's engine thread, for the first chunk's shape.
    assert host.built == 1 and host.threads == ["rh-dask-engine"]
    assert host.max_rows <= CHUNKS[0]
    choice = model.engine_choice_
    assert choice.engine == "numpy" and choice.measured and choice.predicted_ratio > 1
    assert choice.fallback is None
    assert model.engine_ == "numpy"
    placement = model.placement_
    assert placement["engine"] == "numpy" and placement["worker"] == cluster[1]
    _same_stream(model, _numpy_loop(X, y))


def test_a_measured_gpu_choice_that_cannot_start_on_the_worker_runs_numpy(
    client, host_of, monkeypatch
):
    host_of(FAST_GPU)
    no_gpu_engine(monkeypatch)
    X, y = _data(seed=6)
    model = RenewableHuberRegressor(progress=False)
    with pytest.warns(RuntimeWarning, match="chose the GPU engine.*runs on the NumPy engine"):
        model.fit(*_collection(X, y))
    choice = model.engine_choice_
    assert choice.engine == "numpy" and choice.predicted_ratio < 1
    assert "scripted" in choice.fallback
    assert model.engine_ == "numpy" and model.placement_["engine"] == "numpy"
    _same_stream(model, _numpy_loop(X, y))


def test_a_rule_or_a_named_engine_never_falls_back_on_the_worker(client, host_of, monkeypatch):
    from rh_dask.exceptions import EngineUnavailableError

    host = host_of(FAST_GPU)
    no_gpu_engine(monkeypatch)
    X, y = _data(seed=7)
    for params in ({"device": "cuda"}, {"engine": "gpu"}):
        model = RenewableHuberRegressor(progress=False, **params)
        with pytest.raises(EngineUnavailableError, match="scripted"):
            model.fit(*_collection(X, y))
        assert not hasattr(model, "coef_")
    assert host.built == 0  # a rule decides without measuring


def test_a_started_stream_keeps_its_engine_for_later_collections(client, host_of):
    host = host_of(SLOW_GPU)
    X, y = _data(seed=8)
    model = RenewableHuberRegressor(progress=False).fit(*_collection(X, y))
    first = model.engine_choice_
    host_of(FAST_GPU)  # a calibration now would pick the GPU
    model.partial_fit(*_collection(X, y))
    assert model.engine_ == "numpy" and model.engine_choice_ is first
    assert host.built == 1


_FAIL_AT = {"chunk": None}


def _fail_at(block, block_info=None):
    if block_info[0]["chunk-location"][0] == _FAIL_AT["chunk"]:
        raise OSError("scripted read failure")
    return block


def test_a_resumed_walk_goes_on_with_the_engine_the_stream_started_with(client, host_of, tmp_path):
    host = host_of(SLOW_GPU)
    X, y = _data(seed=9)
    directory = tmp_path / "ckpt"
    params = dict(progress=False, checkpoint_every=1, checkpoint_dir=directory)
    _FAIL_AT["chunk"] = 3
    try:
        with pytest.raises(StreamError, match="chunk 3"):
            RenewableHuberRegressor(**params).fit(*_collection(X, y, _fail_at))
    finally:
        _FAIL_AT["chunk"] = None
    ckpt = CheckpointStore(directory).read()
    assert ckpt.engine == "numpy" and ckpt.walk.next_chunk == 3
    assert host.built == 1
    again = host_of(FAST_GPU)  # a calibration now would pick the GPU
    resumed = RenewableHuberRegressor(**params).fit(
        *_collection(X, y, _fail_at), resume_from=directory
    )
    assert again.built == 0  # the resumed stream was not recalibrated
    assert resumed.engine_ == "numpy" and resumed.placement_["engine"] == "numpy"
    _same_stream(resumed, _numpy_loop(X, y))


def test_without_a_client_the_walk_decides_here_at_its_first_chunk(host_of):
    from rh_dask.distributed.fit import current_client

    assert current_client() is None
    host = host_of(SLOW_GPU)
    X, y = _data(seed=10)
    model = RenewableHuberRegressor(progress=False).fit(*_collection(X, y))
    assert host.built == 1 and host.max_rows <= CHUNKS[0]
    assert model.engine_choice_.engine == "numpy" and model.engine_choice_.measured
    assert model.placement_ is None
    _same_stream(model, _numpy_loop(X, y))
