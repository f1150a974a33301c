"""The distributed fit on a real multi-process cluster (NumPy engine, no GPU).

Every equality below is bit for bit: a distributed ``fit`` must give exactly
what a plain loop of ``partial_fit`` over the same chunks gives in this
process. Streams run their engine with BLAS pinned to one thread
(``rh_dask.distributed.consumer.STREAM_BLAS_THREADS``, because multithreaded
BLAS changes the summation order with the thread count), so the reference
loop runs under the same pin; the worker processes, the engine thread and
this process then all compute the same bits.

One cluster serves the module: two single-threaded worker processes, the
second advertising ``resources={"GPU": 1}`` so that placement can be tested
without a GPU.
"""

from __future__ import annotations

import os
import time

import dask.array as da
import dask.config
import dask.dataframe as dd
import numpy as np
import pandas as pd
import pytest
from distributed import Client, LocalCluster, Nanny, Scheduler, SpecCluster
from threadpoolctl import threadpool_limits

from rh_dask import (
    ActorLostError,
    BadChunkError,
    RenewableHuberRegressor,
    StreamError,
    ValidationError,
)
from rh_dask.distributed import release_engines
from rh_dask.distributed.consumer import STREAM_BLAS_THREADS
from rh_dask.exceptions import EngineUnavailableError

pytestmark = pytest.mark.timeout(180)


def _spec_cluster() -> SpecCluster:
    worker = {"cls": Nanny, "options": {"nthreads": 1}}
    gpu_worker = {"cls": Nanny, "options": {"nthreads": 1, "resources": {"GPU": 1}}}
    return SpecCluster(
        workers={"cpu": worker, "gpu": gpu_worker},
        scheduler={"cls": Scheduler, "options": {"dashboard_address": ":0"}},
    )


@pytest.fixture(scope="module")
def cluster():
    with _spec_cluster() as spec, Client(spec, direct_to_workers=True, set_as_default=False) as c:
        c.wait_for_workers(2)
        yield c


@pytest.fixture
def client(cluster):
    """The module's client, made current for the test only."""
    with cluster.as_current():
        yield cluster


def _workers(client) -> dict[str, dict]:
    return client.scheduler_info(n_workers=-1)["workers"]


def _gpu_worker(client) -> str:
    return next(a for a, w in _workers(client).items() if w.get("resources", {}).get("GPU"))


def _cpu_worker(client) -> str:
    return next(a for a, w in _workers(client).items() if not w.get("resources", {}).get("GPU"))


def _data(n=6_000, d=5, seed=0, weights=False):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, d))
    y = X @ rng.normal(size=d) + 0.5 + rng.standard_t(2, size=n)
    w = rng.uniform(0.2, 3.0, size=n) if weights else None
    return X, y, w


def _loop(blocks, **params) -> RenewableHuberRegressor:
    """The reference: a plain partial_fit loop over in-memory chunks."""
    model = RenewableHuberRegressor(**params)
    with threadpool_limits(limits=STREAM_BLAS_THREADS, user_api="blas"):
        for X, y, w in blocks:
            if len(y):
                model.partial_fit(X, y, sample_weight=w)
    return model


def _row_blocks(X, y, w, chunks):
    out, start = [], 0
    for size in chunks:
        rows = slice(start, start + size)
        out.append((X[rows], y[rows], None if w is None else w[rows]))
        start += size
    return out


def _same(a, b, assert_unchanged, snapshot):
    """Same state, same per-batch history, and the same β after every batch, bit for bit."""
    assert_unchanged(snapshot(a), snapshot(b))
    cols = ["batch", "rows", "iterations", "converged", "objective"]
    cols += ["mean_loss", "outlier_share", "residual_scale"]
    pd.testing.assert_frame_equal(a.history_[cols], b.history_[cols])
    betas = a.coef_history_
    assert betas.dtype == np.float64 and len(betas) == len(a.history_)
    # Bytes, not array_equal, which would take -0.0 for 0.0.
    assert betas.tobytes() == b.coef_history_.tobytes()
    final = np.append(a.coef_, a.intercept_) if a.fit_intercept else a.coef_
    np.testing.assert_array_equal(betas[-1], final)  # the last row is the model's β


# -- equality with the plain loop ---------------------------------------------------
def test_fit_equals_a_plain_loop_at_another_thread_count(client, snapshot, assert_unchanged):
    """Chunks of several row blocks: the walk's engine at "auto" on a worker, the loop at
    three threads of its own under the process's BLAS count, the same bits."""
    X, y, w = _data(n=60_000, d=20, weights=True)
    chunks = (20_000, 25_000, 15_000)  # 3.4 MB and more: several row blocks each
    model = RenewableHuberRegressor(loader="actor", progress=False)
    model.fit(
        da.from_array(X, chunks=(chunks, 20)),
        da.from_array(y, chunks=(chunks,)),
        sample_weight=da.from_array(w, chunks=(chunks,)),
    )
    ref = RenewableHuberRegressor()
    with dask.config.set({"rh-dask.numpy.blas-threads": 3}):
        for X_i, y_i, w_i in _row_blocks(X, y, w, chunks):
            ref.partial_fit(X_i, y_i, sample_weight=w_i)
    _same(model, ref, assert_unchanged, snapshot)


@pytest.mark.parametrize("loader", ["actor", "engine-worker", "cluster", "relay"])
def test_fit_equals_partial_fit_loop(client, loader, snapshot, assert_unchanged):
    X, y, w = _data(weights=True)
    chunks = (1000, 700, 1300, 1000, 2000)
    Xd = da.from_array(X, chunks=(chunks, 5))
    yd = da.from_array(y, chunks=(chunks,))
    wd = da.from_array(w, chunks=(chunks,))
    model = RenewableHuberRegressor(loader=loader, lookahead=3, progress=False)
    model.fit(Xd, yd, sample_weight=wd)
    ref = _loop(_row_blocks(X, y, w, chunks))
    placement = model.placement_
    assert placement["loader"] == loader and placement["engine"] == "numpy"
    assert placement["lookahead"] == 3 and placement["worker"] in _workers(client)
    assert len(model.history_) == len(chunks)
    _same(model, ref, assert_unchanged, snapshot)


def test_float32_and_l1_stream(client, snapshot, assert_unchanged):
    X, y, _ = _data(n=4_000, d=8, seed=3)
    params = dict(dtype="float32", penalty="l1", lambda_scale=0.5)
    model = RenewableHuberRegressor(progress=False, **params)
    model.fit(da.from_array(X, chunks=(800, 8)), da.from_array(y, chunks=800))
    ref = _loop(_row_blocks(X, y, None, [800] * 5), **params)
    assert model.coef_.dtype == np.float32
    _same(model, ref, assert_unchanged, snapshot)


def _slow_early(block, block_info=None):
    # The first chunks take longest, so later ones finish loading first.
    index = block_info[0]["chunk-location"][0]
    time.sleep(max(0.0, 0.3 - 0.1 * index))
    return block


def test_order_kept_when_later_chunks_finish_first(client, snapshot, assert_unchanged):
    X, y, _ = _data(n=3_000, seed=1)
    Xd = da.from_array(X, chunks=(500, 5)).map_blocks(_slow_early, dtype=X.dtype)
    yd = da.from_array(y, chunks=500)
    model = RenewableHuberRegressor(loader="cluster", lookahead=6, progress=False)
    model.fit(Xd, yd)
    assert list(model.history_["chunk"]) == list(range(6))
    _same(model, _loop(_row_blocks(X, y, None, [500] * 6)), assert_unchanged, snapshot)


def test_multi_column_chunks_are_merged(client, snapshot, assert_unchanged):
    X, y, _ = _data(n=3_000, d=7, seed=2)
    Xd = da.from_array(X, chunks=(600, 3))  # three column chunks per row block
    model = RenewableHuberRegressor(progress=False).fit(Xd, da.from_array(y, chunks=600))
    assert model.n_features_in_ == 7
    _same(model, _loop(_row_blocks(X, y, None, [600] * 5)), assert_unchanged, snapshot)


def test_y_rechunked_to_x_rows(client, snapshot, assert_unchanged):
    X, y, _ = _data(n=3_000, seed=4)
    model = RenewableHuberRegressor(progress=False)
    model.fit(da.from_array(X, chunks=(1000, 5)), da.from_array(y, chunks=750))
    _same(model, _loop(_row_blocks(X, y, None, [1000] * 3)), assert_unchanged, snapshot)


@pytest.mark.parametrize("loader", ["actor", "engine-worker", "cluster", "relay"])
def test_shared_reduction_in_the_graph(client, loader, snapshot, assert_unchanged):
    # Every chunk depends on a global mean: computed once, held across refills.
    X, y, _ = _data(n=3_000, seed=5)
    raw = da.from_array(X, chunks=(500, 5))
    Xs = raw - raw.mean(axis=0)
    model = RenewableHuberRegressor(loader=loader, lookahead=2, progress=False)
    model.fit(Xs, da.from_array(y, chunks=500))
    ref = _loop(_row_blocks(Xs.compute(), y, None, [500] * 6))
    _same(model, ref, assert_unchanged, snapshot)


def test_persisted_inputs_and_a_client_routed_through_the_scheduler(
    cluster, snapshot, assert_unchanged
):
    # Chunks already in cluster memory, and actor calls proxied by the scheduler.
    X, y, _ = _data(n=2_000, seed=23)
    address = cluster.scheduler.address
    with Client(address, direct_to_workers=False, set_as_default=False) as other:
        with other.as_current():
            Xd = other.persist(da.from_array(X, chunks=(500, 5)))
            yd = other.persist(da.from_array(y, chunks=500))
            model = RenewableHuberRegressor(progress=False).fit(Xd, yd)
            # Persisted chunks live in the cluster: the actor cannot compute them alone.
            assert model.placement_["loader"] in ("engine-worker", "cluster")
            before = snapshot(model)
            model.set_params(loader="actor")
            for method in (model.fit, model.partial_fit):
                with pytest.raises(ValidationError, match=r"loader='actor'.*persisted"):
                    method(Xd, yd)
                assert_unchanged(before, snapshot(model))
            model.set_params(loader="auto")
    _same(model, _loop(_row_blocks(X, y, None, [500] * 4)), assert_unchanged, snapshot)


def test_auto_loader_computes_chunks_in_the_actor(client):
    X, y, _ = _data(n=2_000, seed=27)
    model = RenewableHuberRegressor(progress=False, lookahead=2)
    model.fit(da.from_array(X, chunks=(500, 5)), da.from_array(y, 500))
    assert model.placement_["loader"] == "actor"
    wait = model.history_["wait_seconds"]
    assert len(wait) == 4 and (wait >= 0).all() and wait.dtype == np.float64
    # In-memory batches never wait for a load.
    model.partial_fit(X[:100], y[:100])
    assert model.history_["wait_seconds"].iloc[-1] == 0.0


def test_scalar_weight(client, snapshot, assert_unchanged):
    X, y, _ = _data(n=1_500, seed=25)
    model = RenewableHuberRegressor(progress=False)
    model.fit(da.from_array(X, chunks=(500, 5)), da.from_array(y, 500), sample_weight=2.0)
    ref = _loop([(X_, y_, 2.0) for X_, y_, _ in _row_blocks(X, y, None, [500] * 3)])
    _same(model, ref, assert_unchanged, snapshot)


# -- DataFrames -----------------------------------------------------------------------
def _frame(n=3_000, d=4, seed=6, npartitions=5):
    X, y, w = _data(n=n, d=d, seed=seed, weights=True)
    pdf = pd.DataFrame(X, columns=[f"f{i}" for i in range(d)])
    pdf["target"] = y
    pdf["w"] = w
    return pdf, dd.from_pandas(pdf, npartitions=npartitions)


def _partitions(ddf):
    return [ddf.get_partition(i).compute() for i in range(ddf.npartitions)]


def test_dataframe_target_column_and_names(client, snapshot, assert_unchanged):
    pdf, ddf = _frame()
    feats = [c for c in pdf.columns if c.startswith("f")]
    model = RenewableHuberRegressor(progress=False).fit(ddf, "target", sample_weight="w")
    ref = _loop([(p[feats], p["target"], p["w"]) for p in _partitions(ddf)])
    assert list(model.feature_names_in_) == feats
    _same(model, ref, assert_unchanged, snapshot)


def test_dataframe_series_target_unknown_lengths(client, snapshot, assert_unchanged):
    _, ddf = _frame(seed=7)
    # A filter leaves partition lengths unknown (and makes them uneven).
    kept = ddf[ddf["f0"] > -1.0]
    feats = kept[["f0", "f1", "f2", "f3"]]
    model = RenewableHuberRegressor(progress=False).fit(feats, kept["target"], kept["w"])
    parts = _partitions(kept)
    ref = _loop([(p[["f0", "f1", "f2", "f3"]], p["target"], p["w"]) for p in parts])
    _same(model, ref, assert_unchanged, snapshot)


def test_dataframe_partition_with_wrong_names_is_refused(client):
    cols = ["a", "b"]
    rng = np.random.default_rng(8)

    def part(i):
        frame = pd.DataFrame(rng.normal(size=(50, 2)), columns=cols)
        frame["y"] = rng.normal(size=50)
        return frame.rename(columns={"b": "c"}) if i == 2 else frame

    meta = pd.DataFrame({"a": [], "b": [], "y": []}, dtype=float)
    ddf = dd.from_map(part, range(4), meta=meta)
    model = RenewableHuberRegressor(progress=False)
    with pytest.raises(BadChunkError, match="chunk 2") as info:
        model.fit(ddf, "y")
    assert info.value.chunk_index == 2
    assert model.history_["chunk"].tolist() == [0, 1]


# -- empty and bad chunks ---------------------------------------------------------------
def test_empty_chunks_are_skipped_and_counted(client, snapshot, assert_unchanged):
    X, y, _ = _data(n=2_000, seed=9)
    chunks = (500, 0, 700, 0, 0, 800)
    model = RenewableHuberRegressor(progress=False)
    model.fit(da.from_array(X, chunks=(chunks, 5)), da.from_array(y, chunks=(chunks,)))
    assert model.n_empty_chunks_ == 3
    assert model.history_["chunk"].tolist() == [0, 2, 5]
    _same(model, _loop(_row_blocks(X, y, None, chunks)), assert_unchanged, snapshot)


def test_all_empty_collection_is_refused(client):
    X = np.empty((0, 3))
    with pytest.raises(ValidationError, match="empty"):
        RenewableHuberRegressor(progress=False).fit(
            da.from_array(X, chunks=((0, 0), (3,))), da.from_array(np.empty(0), chunks=((0, 0),))
        )


@pytest.mark.parametrize("loader", ["actor", "engine-worker", "cluster", "relay"])
def test_bad_chunk_stops_in_front_of_it_then_partial_fit_continues(
    client, loader, snapshot, assert_unchanged
):
    X, y, _ = _data(n=3_000, seed=10)
    bad = X.copy()
    bad[1_234, 2] = np.nan  # inside chunk 2 of 500-row chunks
    model = RenewableHuberRegressor(loader=loader, lookahead=4, progress=False)
    with pytest.raises(BadChunkError, match="chunk 2 was refused") as info:
        model.fit(da.from_array(bad, chunks=(500, 5)), da.from_array(y, chunks=500))
    assert info.value.chunk_index == 2
    assert "NaN" in str(info.value)
    # Bad data in a stream is a ValueError, as bad data in memory is.
    assert isinstance(info.value, ValidationError) and isinstance(info.value, ValueError)
    assert isinstance(info.value, StreamError)
    blocks = _row_blocks(X, y, None, [500] * 6)
    _same(model, _loop(blocks[:2]), assert_unchanged, snapshot)
    # The stream continues from the last good chunk.
    model.partial_fit(da.from_array(X[1_000:], chunks=(500, 5)), da.from_array(y[1_000:], 500))
    assert_unchanged(snapshot(model), snapshot(_loop(blocks)))


def _fail_chunk_3(block, block_info=None):
    if block_info[0]["chunk-location"][0] == 3:
        raise OSError("disk on fire")
    return block


@pytest.mark.parametrize("loader", ["actor", "engine-worker", "cluster", "relay"])
def test_failing_task_names_the_chunk(client, snapshot, assert_unchanged, loader):
    X, y, _ = _data(n=3_000, seed=11)
    Xd = da.from_array(X, chunks=(500, 5)).map_blocks(_fail_chunk_3, dtype=X.dtype)
    model = RenewableHuberRegressor(progress=False, loader=loader)
    with pytest.raises(StreamError, match=r"chunk 3 could not be loaded.*disk on fire") as info:
        model.fit(Xd, da.from_array(y, chunks=500))
    # A failing task is not bad data: a plain StreamError, not a ValueError.
    assert type(info.value) is StreamError and not isinstance(info.value, ValueError)
    assert info.value.chunk_index == 3
    _same(model, _loop(_row_blocks(X, y, None, [500] * 3)), assert_unchanged, snapshot)


def _refuse_chunk_1(block, block_info=None):
    if block_info[0]["chunk-location"][0] == 1:
        raise ValidationError("chunk 1 holds a sensor fault")
    return block


@pytest.mark.parametrize("loader", ["actor", "engine-worker", "cluster", "relay"])
def test_a_task_refusing_its_data_is_a_bad_chunk(client, snapshot, assert_unchanged, loader):
    X, y, _ = _data(n=1_500, seed=28)
    Xd = da.from_array(X, chunks=(500, 5)).map_blocks(_refuse_chunk_1, dtype=X.dtype)
    model = RenewableHuberRegressor(progress=False, loader=loader)
    with pytest.raises(BadChunkError, match="sensor fault") as info:
        model.fit(Xd, da.from_array(y, chunks=500))
    assert info.value.chunk_index == 1
    _same(model, _loop(_row_blocks(X, y, None, [500])), assert_unchanged, snapshot)


@pytest.mark.parametrize("loader", ["actor", "cluster", "relay"])
def test_a_refused_fit_on_the_cluster_keeps_the_fitted_model(
    client, snapshot, assert_unchanged, loader
):
    X, y, _ = _data(n=2_000, seed=29)
    model = RenewableHuberRegressor(progress=False, loader=loader)
    model.fit(da.from_array(X, chunks=(500, 5)), da.from_array(y, 500))
    before = snapshot(model)
    history = model.history_.copy()
    placement = model.placement_
    bad = X.copy()
    bad[100, 0] = np.nan  # chunk 0: the new stream consumes nothing
    refusals = [
        (da.from_array(X, chunks=(500, 5)), da.from_array(y[:-1], 500), ValidationError),
        (da.from_array(bad, chunks=(500, 5)), da.from_array(y, 500), BadChunkError),
    ]
    for Xd, yd, error in refusals:
        with pytest.raises(error):
            model.fit(Xd, yd)
        assert_unchanged(before, snapshot(model))
        pd.testing.assert_frame_equal(model.history_, history)
        assert model.placement_ == placement
        assert model.n_empty_chunks_ == 0


def test_wrong_width_is_refused_upfront(client):
    X, y, _ = _data(n=1_000, seed=12)
    model = RenewableHuberRegressor(progress=False).fit(X, y)
    with pytest.raises(ValidationError, match="expecting 5 features"):
        model.partial_fit(da.from_array(X[:, :4], chunks=(500, 4)), da.from_array(y, 500))


def test_misaligned_target_is_refused(client):
    X, y, _ = _data(n=1_000, seed=13)
    Xd = da.from_array(X, chunks=(500, 5))
    with pytest.raises(ValidationError, match="aligned"):
        RenewableHuberRegressor(progress=False).fit(Xd, dd.from_pandas(pd.Series(y), 3))


def _slow(block):
    time.sleep(0.05)
    return block


@pytest.mark.parametrize("loader", ["actor", "engine-worker"])
def test_interrupted_walk_keeps_the_consumed_chunks(client, monkeypatch, loader):
    import rh_dask.distributed.coordinator as coordinator

    polls = []
    original = coordinator.ClusterWalk._poll

    def interrupted(self, *args):
        snap = original(self, *args)
        polls.append(snap.consumed)
        if snap.consumed >= 2:
            raise KeyboardInterrupt
        return snap

    monkeypatch.setattr(coordinator.ClusterWalk, "_poll", interrupted)
    X, y, _ = _data(n=4_000, seed=24)
    model = RenewableHuberRegressor(lookahead=2, loader=loader, progress=False)
    # Slow loads: with loader="actor" a poll reports progress only every 0.25 s.
    X_dask = da.from_array(X, chunks=(250, 5)).map_blocks(_slow, dtype=X.dtype)
    with pytest.raises(KeyboardInterrupt):
        model.fit(X_dask, da.from_array(y, 250))
    # Whatever was consumed before the interrupt is in the model, with its history.
    consumed = len(model.history_)
    assert 2 <= consumed < 16
    assert model.state_.batch_count == consumed
    ref = _loop(_row_blocks(X, y, None, [250] * consumed))
    np.testing.assert_array_equal(model.state_.coefficients, ref.state_.coefficients)
    np.testing.assert_array_equal(model.coef_history_, ref.coef_history_)


def _record_heap_calls(dask_worker=None):
    """On a worker: count calls of the malloc helper and of the restore it returns."""
    from rh_dask.distributed import memory

    calls = {"applied": 0, "restored": 0}

    def recording(*args, **kwargs):
        calls["applied"] += 1

        def restore():
            calls["restored"] += 1

        return restore

    memory._saved = (memory.heap_for_chunks, calls)
    memory.heap_for_chunks = recording


def _heap_calls(dask_worker=None):
    """On a worker: the counts of :func:`_record_heap_calls`, and the helper put back."""
    from rh_dask.distributed import memory

    original, calls = memory._saved
    memory.heap_for_chunks = original
    del memory._saved
    return calls


def _worker_setting(key, dask_worker=None):
    import dask.config

    return dask.config.get(key)


def _parked(dask_worker=None):
    from rh_dask.distributed import shelf

    return shelf.parked()


def test_the_workers_process_settings_change_only_when_asked(client):
    """Malloc's settings on the engine's worker change only with heap-for-chunks on.

    The value is set on the client only (the worker processes started before
    it, with the packaged default): it reaches the actor with its settings.
    """
    key = "rh-dask.distributed.heap-for-chunks"
    X, y, _ = _data(n=1_000, seed=26)
    Xd, yd = da.from_array(X, chunks=(500, 5)), da.from_array(y, 500)
    before = client.run(lambda: __import__("sys").getswitchinterval())
    for asked in (False, True):
        client.run(_record_heap_calls)
        try:
            with dask.config.set({key: asked}):
                model = RenewableHuberRegressor(progress=False).fit(Xd, yd)
        finally:
            calls = client.run(_heap_calls)
        host = model.placement_["worker"]
        expected = {"applied": int(asked), "restored": int(asked)}
        assert calls[host] == expected, (asked, calls)
        assert all(c == {"applied": 0, "restored": 0} for a, c in calls.items() if a != host)
    assert set(client.run(_worker_setting, key).values()) == {False}
    assert client.run(lambda: __import__("sys").getswitchinterval()) == before


def test_settings_set_on_the_client_reach_the_engines_worker(client):
    X, y, _ = _data(n=1_000, seed=27)
    Xd, yd = da.from_array(X, chunks=(500, 5)), da.from_array(y, 500)
    release_engines(client)
    with dask.config.set({"rh-dask.distributed.engine-keep": 0}):
        RenewableHuberRegressor(progress=False).fit(Xd, yd)
    assert set(client.run(_parked).values()) == {0}  # closed with its actor
    assert set(client.run(_worker_setting, "rh-dask.distributed.engine-keep").values()) == {"60s"}
    with dask.config.set({"rh-dask.distributed.engine-keep": "1 minute"}):
        model = RenewableHuberRegressor(progress=False).fit(Xd, yd)
    assert client.run(_parked)[model.placement_["worker"]] == 1
    release_engines(client)


def test_a_malformed_setting_refuses_the_fit_and_leaves_the_model(client):
    from rh_dask.settings import SettingError

    X, y, _ = _data(n=1_000, seed=28)
    Xd, yd = da.from_array(X, chunks=(500, 5)), da.from_array(y, 500)
    model = RenewableHuberRegressor(progress=False).fit(Xd, yd)
    state, history = model.state_, model.history_.copy()
    key = "rh-dask.distributed.poll-interval"
    with dask.config.set({key: "soon"}), pytest.raises(SettingError) as err:
        model.partial_fit(Xd, yd)
    assert str(err.value) == (
        f"setting {key} (DASK_RH_DASK__DISTRIBUTED__POLL_INTERVAL) must be a duration > 0 "
        "(seconds, or text such as \"250ms\"), got 'soon'"
    )
    assert isinstance(err.value, ValidationError)
    assert model.state_.equals(state)
    pd.testing.assert_frame_equal(model.history_, history)


# -- refits, continuation and parameters --------------------------------------------------
def test_a_refit_takes_the_parked_engine_and_release_engines_closes_it(client, snapshot):
    X, y, _ = _data(n=2_000, seed=21)
    Xd, yd = da.from_array(X, chunks=(500, 5)), da.from_array(y, 500)
    host = _cpu_worker(client)
    # A configuration no other test uses: its shelf slot starts empty.
    params = dict(tau=1.2345, worker=host, progress=False)
    first = RenewableHuberRegressor(**params).fit(Xd, yd)
    second = RenewableHuberRegressor(**params).fit(Xd, yd)
    assert not first.placement_["engine_reused"] and second.placement_["engine_reused"]
    # The warm engine starts from the coordinator's state, not from its last stream.
    assert second.state_.coefficients.tobytes() == first.state_.coefficients.tobytes()
    assert second.state_.information.tobytes() == first.state_.information.tobytes()
    assert release_engines(client)[host] >= 1
    third = RenewableHuberRegressor(**params).fit(Xd, yd)
    assert not third.placement_["engine_reused"]


def test_an_engine_is_not_parked_after_a_failed_stream(client):
    X, y, _ = _data(n=2_000, seed=22)
    X[1_200, 2] = np.nan
    Xd, yd = da.from_array(X, chunks=(500, 5)), da.from_array(y, 500)
    params = dict(tau=1.3456, worker=_cpu_worker(client), progress=False)
    with pytest.raises(StreamError, match="chunk 2"):
        RenewableHuberRegressor(**params).fit(Xd, yd)
    X[1_200, 2] = 0.0
    model = RenewableHuberRegressor(**params).fit(da.from_array(X, chunks=(500, 5)), yd)
    assert not model.placement_["engine_reused"]


def test_fit_twice_resets(client, snapshot, assert_unchanged):
    X, y, _ = _data(n=2_000, seed=14)
    X2, y2, _ = _data(n=1_500, seed=15)
    model = RenewableHuberRegressor(progress=False)
    model.fit(da.from_array(X, chunks=(500, 5)), da.from_array(y, 500))
    model.fit(da.from_array(X2, chunks=(500, 5)), da.from_array(y2, 500))
    assert len(model.history_) == 3
    _same(model, _loop(_row_blocks(X2, y2, None, [500] * 3)), assert_unchanged, snapshot)


def test_partial_fit_mixes_memory_and_dask_batches(client, snapshot, assert_unchanged):
    X, y, _ = _data(n=2_000, seed=16)
    model = RenewableHuberRegressor(progress=False).partial_fit(X[:500], y[:500])
    model.partial_fit(da.from_array(X[500:1500], chunks=(500, 5)), da.from_array(y[500:1500], 500))
    assert model.placement_["worker"] in _workers(client)
    model.partial_fit(X[1500:], y[1500:])
    ref = _loop(_row_blocks(X, y, None, [500] * 4))
    _same(model, ref, assert_unchanged, snapshot)
    assert model.history_["batch"].tolist() == [0, 1, 2, 3]
    assert model.history_["chunk"].tolist() == [0, 0, 1, 0]
    # The last batch was in memory: it ran in this process, not on a worker.
    assert model.placement_ is None


@pytest.mark.parametrize(
    ("param", "value"),
    [("lookahead", 0), ("lookahead", "fast"), ("loader", "nowhere"), ("worker", 3)],
)
def test_bad_walk_parameters(client, param, value):
    X, y, _ = _data(n=500)
    model = RenewableHuberRegressor(progress=False, **{param: value})
    with pytest.raises(ValidationError, match=param):
        model.fit(da.from_array(X, chunks=(250, 5)), da.from_array(y, 250))


# -- prediction and scoring ----------------------------------------------------------------
def test_lazy_predict_and_score(client):
    from sklearn.metrics import r2_score

    X, y, w = _data(n=3_000, seed=17, weights=True)
    model = RenewableHuberRegressor(progress=False).fit(X, y)
    Xd = da.from_array(X, chunks=(700, 2))
    pred = model.predict(Xd)
    assert isinstance(pred, da.Array)
    assert pred.chunks == ((700, 700, 700, 700, 200),)
    np.testing.assert_array_equal(pred.compute(), model.predict(X))
    yd, wd = da.from_array(y, chunks=700), da.from_array(w, chunks=700)
    assert model.score(Xd, yd) == pytest.approx(r2_score(y, model.predict(X)), rel=1e-12)
    assert model.score(Xd, yd, wd) == pytest.approx(
        r2_score(y, model.predict(X), sample_weight=w), rel=1e-12
    )


def test_lazy_predict_dataframe_checks_names(client):
    pdf, ddf = _frame(seed=18)
    feats = ["f0", "f1", "f2", "f3"]
    model = RenewableHuberRegressor(progress=False).fit(pdf[feats], pdf["target"])
    pred = model.predict(ddf[feats])
    np.testing.assert_array_equal(pred.compute(), model.predict(pdf[feats]))
    with pytest.raises(ValidationError, match="feature names"):
        model.predict(ddf[["f1", "f0", "f2", "f3"]])
    assert model.score(ddf[[*feats, "target"]], "target") == pytest.approx(
        model.score(pdf[feats], pdf["target"]), rel=1e-12
    )


# -- placement --------------------------------------------------------------------------
def _gpu_is_numpy(dask_worker=None):
    """Worker-side stand-in: let engine="gpu" build a NumPy engine there."""
    import rh_dask.distributed.actor as actor_module
    from rh_dask.engines import NumpyEngine

    def make(name, config, device=None, **options):
        return NumpyEngine(config)

    actor_module.make_engine = make


def _restore_make_engine(dask_worker=None):
    import rh_dask.distributed.actor as actor_module
    from rh_dask.distributed import shelf
    from rh_dask.engines import make_engine

    actor_module.make_engine = make_engine
    shelf.clear()  # the stand-in engine must not serve a later engine="gpu" fit


def test_gpu_engine_that_cannot_start_on_the_worker_raises(client):
    X, y, _ = _data(n=500)
    model = RenewableHuberRegressor(engine="gpu", progress=False)
    with pytest.raises(EngineUnavailableError):
        model.fit(da.from_array(X, chunks=(250, 5)), da.from_array(y, 250))


def test_gpu_engine_is_placed_on_the_gpu_worker(client, snapshot, assert_unchanged):
    X, y, _ = _data(n=2_000, seed=19)
    client.run(_gpu_is_numpy)
    try:
        model = RenewableHuberRegressor(engine="gpu", progress=False)
        model.fit(da.from_array(X, chunks=(500, 5)), da.from_array(y, 500))
    finally:
        client.run(_restore_make_engine)
    assert model.placement_["worker"] == _gpu_worker(client)
    assert model.placement_["engine"] == "gpu"
    assert model.engine_ == "gpu"
    ref = _loop(_row_blocks(X, y, None, [500] * 4))
    np.testing.assert_array_equal(model.state_.coefficients, ref.state_.coefficients)


def test_numpy_engine_prefers_a_cpu_worker_and_honours_an_address(client):
    X, y, _ = _data(n=1_000)
    Xd, yd = da.from_array(X, chunks=(500, 5)), da.from_array(y, 500)
    model = RenewableHuberRegressor(engine="numpy", progress=False).fit(Xd, yd)
    assert model.placement_["worker"] != _gpu_worker(client)
    model = RenewableHuberRegressor(
        engine="numpy", worker=_gpu_worker(client), progress=False
    ).fit(Xd, yd)
    assert model.placement_["worker"] == _gpu_worker(client)
    # engine="auto" goes to the GPU worker and decides there (no CuPy here: NumPy).
    model = RenewableHuberRegressor(progress=False).fit(Xd, yd)
    assert model.placement_["worker"] == _gpu_worker(client)
    assert model.placement_["engine"] == "numpy" == model.engine_choice_.engine
    assert "cannot start" in model.engine_choice_.reason


def test_unknown_worker_address_is_a_clear_error(client):
    X, y, _ = _data(n=500)
    model = RenewableHuberRegressor(worker="tcp://10.255.255.1:1", progress=False)
    with pytest.raises(EngineUnavailableError, match="not in the cluster"):
        model.fit(da.from_array(X, chunks=(250, 5)), da.from_array(y, 250))


def test_choose_worker_rules():
    from rh_dask.distributed.placement import WorkerInfo, choose_worker

    cpu = WorkerInfo("tcp://a:1", 4, {})
    big = WorkerInfo("tcp://b:1", 8, {})
    gpu = WorkerInfo("tcp://g:1", 2, {"GPU": 1})
    assert choose_worker([cpu, gpu, big], "numpy", None) is big
    assert choose_worker([gpu], "numpy", None) is gpu
    assert choose_worker([cpu, gpu, big], "gpu", None) is gpu
    assert choose_worker([cpu, gpu], "gpu", "g:1") is gpu
    assert choose_worker([cpu, gpu, big], "auto", None) is gpu  # decides GPU or NumPy there
    assert choose_worker([cpu, big], "auto", None) is big
    assert choose_worker([cpu, gpu], "auto", "a:1") is cpu
    with pytest.raises(EngineUnavailableError, match="GPU"):
        choose_worker([cpu, big], "gpu", None)
    with pytest.raises(EngineUnavailableError, match="no workers"):
        choose_worker([], "numpy", None)


# -- without a client ---------------------------------------------------------------------
def test_no_client_walks_locally(snapshot, assert_unchanged):
    from rh_dask.distributed.fit import current_client

    assert current_client() is None
    X, y, w = _data(n=3_000, seed=20, weights=True)
    chunks = (1000, 0, 1200, 800)
    Xd = da.from_array(X, chunks=(chunks, 2))
    model = RenewableHuberRegressor(lookahead=2, progress=False)
    model.fit(Xd, da.from_array(y, chunks=(chunks,)), da.from_array(w, chunks=(chunks,)))
    assert model.n_empty_chunks_ == 1
    assert model.placement_ is None  # no client: the model's own engine
    _same(model, _loop(_row_blocks(X, y, w, chunks)), assert_unchanged, snapshot)


def test_no_client_bad_chunk(snapshot, assert_unchanged):
    X, y, _ = _data(n=2_000, seed=21)
    bad = X.copy()
    bad[1_600, 0] = np.inf
    model = RenewableHuberRegressor(progress=False)
    with pytest.raises(BadChunkError, match="chunk 3") as info:
        model.fit(da.from_array(bad, chunks=(500, 5)), da.from_array(y, 500))
    assert info.value.chunk_index == 3
    assert isinstance(info.value, ValueError)
    _same(model, _loop(_row_blocks(X, y, None, [500] * 3)), assert_unchanged, snapshot)


def test_no_client_failing_task_and_refusing_task(snapshot, assert_unchanged):
    X, y, _ = _data(n=3_000, seed=30)
    failing = da.from_array(X, chunks=(500, 5)).map_blocks(_fail_chunk_3, dtype=X.dtype)
    model = RenewableHuberRegressor(progress=False)
    with pytest.raises(StreamError, match="chunk 3 could not be loaded") as info:
        model.fit(failing, da.from_array(y, 500))
    assert type(info.value) is StreamError
    refusing = da.from_array(X, chunks=(500, 5)).map_blocks(_refuse_chunk_1, dtype=X.dtype)
    with pytest.raises(BadChunkError, match=r"chunk 1 was refused.*sensor fault"):
        model.partial_fit(refusing, da.from_array(y, 500))
    # The stream kept chunks 0-2 of the first call and chunk 0 of the second.
    blocks = _row_blocks(X, y, None, [500] * 3)
    _same(model, _loop([*blocks, blocks[0]]), assert_unchanged, snapshot)


def test_the_engine_refusing_a_chunk_is_a_bad_chunk():
    from rh_dask import HuberConfig, NumpyEngine
    from rh_dask.distributed.consumer import OrderedConsumer
    from rh_dask.distributed.items import LoadedChunk

    consumer = OrderedConsumer(lambda: NumpyEngine(HuberConfig()))
    try:
        consumer.begin("s", None)
        X, y, _ = _data(n=20, d=3)
        consumer.deliver("s", LoadedChunk(0, X, y, None))
        consumer.deliver("s", LoadedChunk(1, X[:, :2], y, None))  # the engine refuses it
        deadline = time.monotonic() + 10
        while consumer.failure is None and time.monotonic() < deadline:
            time.sleep(0.01)
        failure = consumer.failure
    finally:
        consumer.close()
    assert failure is not None and failure.index == 1 and failure.refused
    err = failure.exception()
    assert isinstance(err, BadChunkError) and err.chunk_index == 1
    assert err.__cause__ is failure.error


def test_resolve_loader_refuses_with_validation_errors():
    from rh_dask.distributed.coordinator import resolve_loader
    from rh_dask.distributed.placement import WorkerInfo

    host = WorkerInfo("tcp://a:1", 2, {})
    with pytest.raises(ValidationError, match="loader must be one of"):
        resolve_loader("nowhere", host, [host])
    with pytest.raises(ValidationError, match="persisted"):
        resolve_loader("actor", host, [host], self_contained=False)


def test_no_client_progress_bar(capsys):
    X, y, _ = _data(n=1_000)
    RenewableHuberRegressor(progress=True).fit(
        da.from_array(X, chunks=(250, 5)), da.from_array(y, 250)
    )
    err = capsys.readouterr().err
    assert "4/4" in err and "rows/s" in err


# -- losing the engine's worker ---------------------------------------------------------------
def _die_on_chunk_3(block, block_info=None):
    if block_info[0]["chunk-location"][0] == 3:
        os._exit(1)
    return block


@pytest.mark.slow
@pytest.mark.parametrize("loader", ["actor", "engine-worker"])
def test_losing_the_actor_worker_raises_not_hangs(loader, snapshot, assert_unchanged):
    X, y, _ = _data(n=4_000, seed=22)
    with (
        LocalCluster(
            n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0"
        ) as lc,
        Client(lc, direct_to_workers=True, set_as_default=False) as c,
        c.as_current(),
    ):
        victim = sorted(_workers(c))[0]
        Xd = da.from_array(X, chunks=(500, 5)).map_blocks(_die_on_chunk_3, dtype=X.dtype)
        # No recovery: the loss itself must raise, promptly (tests/test_faults.py recovers).
        model = RenewableHuberRegressor(
            worker=victim, loader=loader, lookahead=2, progress=False, max_retries=0
        )
        start = time.perf_counter()
        with pytest.raises(ActorLostError, match="lost"):
            model.fit(Xd, da.from_array(y, 500))
        assert time.perf_counter() - start < 60
        assert not hasattr(model, "n_features_in_")
    # A fitted model keeps its state from before the call, as the error says.
    fitted = RenewableHuberRegressor(
        loader=loader, lookahead=2, progress=False, max_retries=0
    ).fit(X, y)
    before = snapshot(fitted)
    with (
        LocalCluster(
            n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0"
        ) as lc,
        Client(lc, direct_to_workers=True, set_as_default=False) as c,
        c.as_current(),
    ):
        fitted.set_params(worker=sorted(_workers(c))[0])
        with pytest.raises(ActorLostError, match="lost"):
            fitted.fit(Xd, da.from_array(y, 500))
    fitted.set_params(worker=None)
    assert_unchanged(before, snapshot(fitted))


@pytest.mark.parametrize("separate_target", [False, True])
def test_parquet_projection_keeps_file_partitions(
    client, tmp_path, separate_target, snapshot, assert_unchanged
):
    # Reading 3 of 40 columns would let dask's optimiser merge neighbouring
    # files into one partition; the batches must stay the partitions the user sees.
    rng = np.random.default_rng(11)
    columns = [f"c{i}" for i in range(39)] + ["target"]
    for i in range(6):
        frame = pd.DataFrame(rng.normal(size=(1_500, 40)), columns=columns)
        frame.to_parquet(tmp_path / f"part{i:02d}.parquet")
    ddf = dd.read_parquet(tmp_path)
    feats = ["c0", "c1", "c2"]
    if separate_target:
        model = RenewableHuberRegressor(progress=False).fit(ddf[feats], ddf["target"])
    else:
        model = RenewableHuberRegressor(progress=False).fit(ddf[[*feats, "target"]], "target")
    parts = [pd.read_parquet(tmp_path / f"part{i:02d}.parquet") for i in range(6)]
    ref = _loop([(p[feats], p["target"], None) for p in parts])
    assert model.history_["rows"].tolist() == [1_500] * 6
    _same(model, ref, assert_unchanged, snapshot)
