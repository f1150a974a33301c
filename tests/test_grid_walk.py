"""The configuration grid on a Dask cluster: one actor per worker advertising ``GPU``.

The workers run the NumPy engine (they only advertise ``GPU=1``), in one
process (``processes=False``), so these tests run in CI without a GPU.
"""

from __future__ import annotations

import threading

import dask.array as da
import dask.config
import numpy as np
import pytest
from distributed import Client, LocalCluster

from rh_dask import BadChunkError, RenewableHuberGridRegressor, ValidationError
from rh_dask.distributed.grid_walk import split_configs

TAUS = (0.5, 0.75, 1.0, 1.345, 2.0, 3.0, 5.0)

_LOADS: list[int] = []
_LOCK = threading.Lock()


def _counted(block, block_info=None):
    """Record which row chunk is read (the workers share this process)."""
    with _LOCK:
        _LOADS.append(block_info[0]["chunk-location"][0])
    return block


@pytest.fixture(scope="module")
def stream():
    rng = np.random.default_rng(7)
    X = rng.standard_normal((1800, 4))
    y = X @ np.array([1.0, -2.0, 0.5, 3.0]) + 0.3 + rng.standard_t(2.0, 1800)
    w = rng.uniform(0.5, 2.0, 1800)
    return X, y, w


def _dask(X, y, w, rows=300):
    return (
        da.from_array(X, chunks=(rows, X.shape[1])),
        da.from_array(y, chunks=rows),
        da.from_array(w, chunks=rows),
    )


def _cluster(n: int, gpu: bool = True) -> LocalCluster:
    return LocalCluster(
        n_workers=n,
        processes=False,
        threads_per_worker=1,
        resources={"GPU": 1} if gpu else None,
        dashboard_address=None,
    )


def test_split_configs_is_contiguous_and_balanced():
    assert split_configs(7, 3) == [range(0, 3), range(3, 5), range(5, 7)]
    assert split_configs(2, 3) == [range(0, 1), range(1, 2)]
    assert split_configs(4, 1) == [range(0, 4)]
    for n in range(1, 12):
        for k in range(1, 6):
            shares = split_configs(n, k)
            sizes = [len(s) for s in shares]
            assert [j for s in shares for j in s] == list(range(n))
            assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1
    with pytest.raises(ValidationError):
        split_configs(0, 2)


@pytest.mark.parametrize("n_workers", [1, 2, 3])
def test_cluster_grid_is_bit_identical_to_the_local_grid(stream, n_workers):
    Xd, yd, wd = _dask(*stream)
    local = RenewableHuberGridRegressor(taus=TAUS, engine="numpy", walk="local")
    local.fit(Xd, yd, wd)
    with _cluster(n_workers) as cluster, Client(cluster):
        model = RenewableHuberGridRegressor(taus=TAUS, engine="numpy").fit(Xd, yd, wd)
        workers = sorted(cluster.scheduler.workers)
    assert model.coefs_.tobytes() == local.coefs_.tobytes()
    assert model.intercepts_.tobytes() == local.intercepts_.tobytes()
    assert model.prequential_.equals(local.prequential_)
    assert model.configs_.equals(local.configs_)
    assert model.best_index_ == local.best_index_
    for a, b in zip(model._grid.export_states(), local._grid.export_states(), strict=True):
        assert a.equals(b)
    shares = split_configs(len(TAUS), n_workers)
    placement = model.placement_
    assert [(p["worker"], p["configs"]) for p in placement] == [
        (w, list(s)) for w, s in zip(workers, shares, strict=True)
    ]
    assert all(0.0 < p["busy_fraction"] <= 1.0 for p in placement)
    assert all(p["lookahead"] == 8 for p in placement)  # "auto": at least 8
    assert local.placement_ == []


def test_lookahead_auto_on_the_cluster_is_twice_its_task_threads(stream):
    # Chunks load on any worker: 3 workers x 3 threads -> 18 chunks; the cap holds.
    Xd, yd, wd = _dask(*stream)
    local = RenewableHuberGridRegressor(taus=TAUS[:3], engine="numpy", walk="local")
    local.fit(Xd, yd, wd)
    cluster = LocalCluster(
        n_workers=3, processes=False, threads_per_worker=3, dashboard_address=None
    )
    with cluster, Client(cluster):
        for cap, expected in [(None, 18), (10, 10)]:
            settings = {} if cap is None else {"rh-dask.distributed.lookahead-max": cap}
            model = RenewableHuberGridRegressor(taus=TAUS[:3], engine="numpy")
            with dask.config.set(settings):
                model.fit(Xd, yd, wd)
            assert [p["lookahead"] for p in model.placement_] == [expected]
            assert model.coefs_.tobytes() == local.coefs_.tobytes()


def test_partial_fit_on_the_cluster_continues_the_stream(stream):
    X, y, w = stream
    first, second = _dask(X[:900], y[:900], w[:900]), _dask(X[900:], y[900:], w[900:])
    local = RenewableHuberGridRegressor(taus=TAUS[:4], engine="numpy", walk="local")
    local.partial_fit(*first).partial_fit(*second)
    with _cluster(2) as cluster, Client(cluster):
        model = RenewableHuberGridRegressor(taus=TAUS[:4], engine="numpy")
        model.partial_fit(*first).partial_fit(*second)
    assert model.coefs_.tobytes() == local.coefs_.tobytes()
    assert model.prequential_.equals(local.prequential_)


def test_each_chunk_is_loaded_once(stream):
    X, y, _ = stream
    _LOADS.clear()
    Xd = da.from_array(X, chunks=(300, 4)).map_blocks(_counted, dtype=X.dtype)
    yd = da.from_array(y, chunks=300)
    with _cluster(3) as cluster, Client(cluster):
        model = RenewableHuberGridRegressor(taus=TAUS, engine="numpy", lookahead=3)
        model.fit(Xd, yd)
    assert sorted(_LOADS) == list(range(6))
    assert len(model.placement_) == 3


def test_without_gpu_workers_one_actor_holds_every_configuration(stream):
    Xd, yd, _ = _dask(*stream)
    with _cluster(2, gpu=False) as cluster, Client(cluster):
        model = RenewableHuberGridRegressor(taus=TAUS[:3], engine="numpy").fit(Xd, yd)
        workers = set(cluster.scheduler.workers)
    assert len(model.placement_) == 1
    assert model.placement_[0]["configs"] == [0, 1, 2]
    assert model.placement_[0]["worker"] in workers


def test_a_bad_chunk_stops_the_walk_before_it(stream):
    X, y, w = stream
    X = X.copy()
    X[1300, 2] = np.nan  # chunk 4
    Xd, yd, wd = _dask(X, y, w)
    good = _dask(X[:1200], y[:1200], w[:1200])
    local = RenewableHuberGridRegressor(taus=TAUS, engine="numpy", walk="local")
    local.fit(*good)
    with _cluster(2) as cluster, Client(cluster):
        model = RenewableHuberGridRegressor(taus=TAUS, engine="numpy")
        with pytest.raises(BadChunkError, match="chunk 4") as info:
            model.fit(Xd, yd, wd)
    assert info.value.chunk_index == 4
    assert model.coefs_.tobytes() == local.coefs_.tobytes()
    assert model.prequential_.equals(local.prequential_)
    assert model.n_samples_seen_ == 1200


def test_an_engine_refusal_rolls_every_actor_back(stream, monkeypatch):
    """One actor refusing a chunk its peers took: they are all put back before it."""
    from rh_dask.engines.grid import GridEngine

    X, y, w = stream
    Xd, yd, wd = _dask(X, y, w)
    good = _dask(X[:900], y[:900], w[:900])
    local = RenewableHuberGridRegressor(taus=TAUS, engine="numpy", walk="local").fit(*good)
    original = GridEngine.partial_fit

    def refuse_chunk_3_for_the_last_share(
        self, X, y, sample_weight=None, *, chunk=0, upcoming=None
    ):
        if chunk == 3 and self.configs[-1].tau == TAUS[-1]:
            raise ValidationError("refused for the test")
        return original(self, X, y, sample_weight, chunk=chunk, upcoming=upcoming)

    monkeypatch.setattr(GridEngine, "partial_fit", refuse_chunk_3_for_the_last_share)
    with _cluster(3) as cluster, Client(cluster):
        model = RenewableHuberGridRegressor(taus=TAUS, engine="numpy", lookahead=4)
        with pytest.raises(BadChunkError, match="chunk 3 was refused"):
            model.fit(Xd, yd, wd)
    assert model.coefs_.tobytes() == local.coefs_.tobytes()
    assert model.prequential_.equals(local.prequential_)


def test_walk_parameter_is_checked(stream):
    Xd, yd, _ = _dask(*stream)
    with pytest.raises(ValidationError, match="walk must be one of"):
        RenewableHuberGridRegressor(walk="gpu").fit(Xd, yd)
    for bad in (0, "fast", 2.5):
        with pytest.raises(ValidationError, match='lookahead must be an integer >= 1 or "auto"'):
            RenewableHuberGridRegressor(lookahead=bad).fit(Xd, yd)
    with pytest.raises(ValidationError, match=r"needs a current distributed\.Client"):
        RenewableHuberGridRegressor(engine="numpy", walk="cluster").fit(Xd, yd)


def _slow(block, block_info=None):
    """A chunk that takes a while to load, so that a worker can go away mid-walk."""
    import time

    _counted(block, block_info)
    time.sleep(0.05)
    return block


def test_a_lost_actor_worker_raises_actor_lost_naming_it(stream):
    from rh_dask import ActorLostError

    X, y, _ = stream
    _LOADS.clear()
    Xd = da.from_array(X, chunks=(100, 4)).map_blocks(_slow, dtype=X.dtype)
    yd = da.from_array(y, chunks=100)
    with _cluster(2) as cluster, Client(cluster):
        model = RenewableHuberGridRegressor(taus=TAUS, engine="numpy", lookahead=2)
        victim = sorted(cluster.scheduler.workers)[1]
        worker = next(w for w in cluster.workers.values() if w.address == victim)

        def close_when_walking():
            while len(_LOADS) < 4:
                threading.Event().wait(0.01)
            cluster.sync(worker.close)

        closer = threading.Thread(target=close_when_walking, daemon=True)
        closer.start()
        with pytest.raises(ActorLostError, match=victim) as info:
            model.fit(Xd, yd)
        closer.join(5)
    assert "configurations 4..6" in str(info.value)
    assert not model.__sklearn_is_fitted__()


@pytest.mark.slow
def test_worker_processes_give_the_in_process_grid(stream):
    """Chunks cross process boundaries to each actor's worker; results stay bit-identical."""
    Xd, yd, wd = _dask(*stream, rows=450)
    local = RenewableHuberGridRegressor(taus=TAUS[:5], engine="numpy", walk="local")
    local.fit(Xd, yd, wd)
    with (
        LocalCluster(
            n_workers=2,
            processes=True,
            threads_per_worker=1,
            resources={"GPU": 1},
            dashboard_address=None,
        ) as cluster,
        Client(cluster),
    ):
        model = RenewableHuberGridRegressor(taus=TAUS[:5], engine="numpy").fit(Xd, yd, wd)
    assert model.coefs_.tobytes() == local.coefs_.tobytes()
    assert model.prequential_.equals(local.prequential_)
    assert [p["configs"] for p in model.placement_] == [[0, 1, 2], [3, 4]]


def _fail_on_2(block, block_info=None):
    if block_info[0]["chunk-location"][0] == 2:
        raise OSError("disk gone")
    return block


def test_a_chunk_whose_task_fails_stops_the_walk_with_stream_error(stream):
    from rh_dask import StreamError

    X, y, w = stream
    Xd = da.from_array(X, chunks=(300, 4)).map_blocks(_fail_on_2, dtype=X.dtype)
    yd = da.from_array(y, chunks=300)
    local = RenewableHuberGridRegressor(taus=TAUS[:3], engine="numpy", walk="local")
    local.fit(*_dask(X[:600], y[:600], w[:600])[:2])
    with _cluster(2) as cluster, Client(cluster):
        model = RenewableHuberGridRegressor(taus=TAUS[:3], engine="numpy")
        with pytest.raises(StreamError, match="chunk 2 could not be loaded: OSError") as info:
            model.fit(Xd, yd)
    assert not isinstance(info.value, BadChunkError)
    assert model.coefs_.tobytes() == local.coefs_.tobytes()


def test_an_actor_failure_names_its_worker_and_keeps_the_model(stream, monkeypatch):
    from rh_dask import ActorLostError, StreamError
    from rh_dask.engines.grid import GridEngine

    Xd, yd, wd = _dask(*stream)
    original = GridEngine.partial_fit

    def fault_on_chunk_2(self, X, y, sample_weight=None, *, chunk=0, upcoming=None):
        if chunk == 2 and self.configs[0].tau == TAUS[0]:
            raise RuntimeError("device fault")
        return original(self, X, y, sample_weight, chunk=chunk, upcoming=upcoming)

    monkeypatch.setattr(GridEngine, "partial_fit", fault_on_chunk_2)
    with _cluster(2) as cluster, Client(cluster):
        first = sorted(cluster.scheduler.workers)[0]
        model = RenewableHuberGridRegressor(taus=TAUS, engine="numpy")
        with pytest.raises(StreamError, match="device fault") as info:
            model.fit(Xd, yd, wd)
    assert first in str(info.value) and "configurations 0..3" in str(info.value)
    assert not isinstance(info.value, (ActorLostError, BadChunkError))
    assert not model.__sklearn_is_fitted__()
