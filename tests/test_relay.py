"""``loader="relay"`` on Dask clusters: relays on the engine's node, loaders elsewhere.

Most tests share one in-process cluster of threaded workers (``Worker``, no
nanny), which starts in a fraction of a second and lets the tests watch the
engine from this process: the engine's worker (two threads, so placement
picks it), two workers advertising ``resources={"relay": 1}`` and two plain
loading workers. Every worker of it is on this host, so the relays are
confirmed by attaching to the ring as on a real node. The slow tests run the
same roles as worker processes under nannies, and kill a relay mid-fit.

Every equality is bit for bit with a plain ``partial_fit`` loop in this
process, run with BLAS pinned to the stream's thread count
(:data:`~rh_dask.distributed.consumer.STREAM_BLAS_THREADS`).

The ring's directory is a fresh short directory per test (the listener's
``AF_UNIX`` socket lies beside the ring, and socket paths are limited to
107 bytes), checked to be empty after every fit.
"""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import tempfile
import threading
import time
from functools import partial

import dask.array as da
import dask.config
import dask.dataframe as dd
import numpy as np
import pandas as pd
import pytest
from distributed import Client, Nanny, Scheduler, SpecCluster, Worker
from threadpoolctl import threadpool_limits

from rh_dask import BadChunkError, RenewableHuberRegressor, StreamError, ValidationError
from rh_dask.distributed import shelf
from rh_dask.distributed.consumer import STREAM_BLAS_THREADS
from rh_dask.distributed.placement import (
    BASE_LOOKAHEAD,
    WorkerInfo,
    advertised_relays,
    auto_lookahead,
    chunks_in_flight,
    loading_workers,
    relay_candidates,
    resolve_lookahead,
)
from rh_dask.distributed.push import file_sends_per_loader, sends_allowed
from rh_dask.distributed.ring import ChunkRing, RingError
from rh_dask.distributed.shelf import release_engines
from rh_dask.engines import NumpyEngine

pytestmark = pytest.mark.timeout(120)

ROLES = ("engine", "relay-0", "relay-1", "load-0", "load-1")
HISTORY = ["batch", "rows", "iterations", "converged", "objective"]


def _roles(cls) -> dict[str, dict]:
    one = {"nthreads": 1}
    relay = {"nthreads": 1, "resources": {"relay": 1}}
    return {
        "engine": {"cls": cls, "options": {"nthreads": 2}},
        "relay-0": {"cls": cls, "options": relay},
        "relay-1": {"cls": cls, "options": relay},
        "load-0": {"cls": cls, "options": one},
        "load-1": {"cls": cls, "options": one},
    }


def _cluster(workers: dict[str, dict]) -> SpecCluster:
    return SpecCluster(
        workers=workers,
        scheduler={"cls": Scheduler, "options": {"dashboard_address": ":0"}},
    )


@pytest.fixture(scope="module")
def cluster():
    with _cluster(_roles(Worker)) as spec, Client(spec, set_as_default=False) as c:
        c.wait_for_workers(len(ROLES))
        yield c


@pytest.fixture
def client(cluster):
    with cluster.as_current():
        yield cluster


@pytest.fixture
def ring_dir():
    """A short, fresh directory for the ring, set as ``rh-dask.relay.directory``."""
    path = tempfile.mkdtemp(prefix="rh-relay-", dir="/tmp" if os.path.isdir("/tmp") else None)
    with dask.config.set({"rh-dask.relay.directory": path}):
        yield path
    shutil.rmtree(path, ignore_errors=True)


def _by_name(client) -> dict[str, str]:
    """Worker name -> address."""
    info = client.scheduler_info(n_workers=-1)["workers"]
    return {w["name"]: address for address, w in info.items()}


def _data(n=3_000, d=5, seed=0, weights=False, dtype="float64"):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, d))
    y = X @ rng.normal(size=d) + 0.5 + rng.standard_t(2, size=n)
    w = rng.uniform(0.2, 3.0, size=n).astype(dtype) if weights else None
    return X.astype(dtype), y.astype(dtype), w


def _row_blocks(X, y, w, chunks):
    out, start = [], 0
    for size in chunks:
        rows = slice(start, start + size)
        out.append((X[rows], y[rows], None if w is None else w[rows]))
        start += size
    return out


def _loop(blocks, **params) -> RenewableHuberRegressor:
    """The reference: a plain partial_fit loop over in-memory chunks."""
    model = RenewableHuberRegressor(**params)
    with threadpool_limits(limits=STREAM_BLAS_THREADS, user_api="blas"):
        for X, y, w in blocks:
            if len(y):
                model.partial_fit(X, y, sample_weight=w)
    return model


def _same(a, b, assert_unchanged, snapshot):
    """Same state, history and β after every batch, bit for bit."""
    assert_unchanged(snapshot(a), snapshot(b))
    pd.testing.assert_frame_equal(a.history_[HISTORY], b.history_[HISTORY])
    assert a.coef_.tobytes() == b.coef_.tobytes()
    assert np.float64(a.intercept_).tobytes() == np.float64(b.intercept_).tobytes()
    assert a.coef_history_.tobytes() == b.coef_history_.tobytes()


def _left(directory, client=None) -> list[str]:
    """Ring files in ``directory``; with ``client``, once the parked engines (and the
    rings kept with them, ``rh-dask.relay.keep-ring``) are released."""
    if client is not None:
        release_engines(client)
    shelf.clear()  # engines parked by this process's own (in-process) workers
    return _rings(directory)


def _rings(directory) -> list[str]:
    return sorted(n for n in os.listdir(directory) if n.startswith("rh-dask-ring-"))


def _assert_roles(model, client) -> None:
    names = _by_name(client)
    placement = model.placement_
    assert placement["loader"] == "relay"
    assert placement["worker"] == names["engine"]
    assert sorted(placement["relays"]) == sorted([names["relay-0"], names["relay-1"]])
    assert sorted(placement["loaders"]) == sorted([names["load-0"], names["load-1"]])


def _arrays(X, y, w, chunks):
    d = X.shape[1]
    Xd = da.from_array(X, chunks=(chunks, d))
    yd = da.from_array(y, chunks=(chunks,))
    return Xd, yd, None if w is None else da.from_array(w, chunks=(chunks,))


# -- placement rules ------------------------------------------------------------------------
def _info(address, **resources) -> WorkerInfo:
    return WorkerInfo(address, 1, dict(resources))


def test_relay_and_loading_worker_rules():
    engine = _info("tcp://10.0.0.1:1000", GPU=1)
    same = _info("tcp://10.0.0.1:1001")
    marked = _info("tcp://10.0.0.1:1002", relay=1)
    elsewhere = _info("tcp://10.0.0.2:1000", relay=1)
    plain_far = _info("tcp://10.0.0.3:1000")
    # Without any worker advertising the resource: every other worker of the node.
    workers = [engine, same, plain_far]
    assert relay_candidates(workers, engine, "relay") == [same]
    assert advertised_relays(workers, engine, "relay") == []
    # Once one advertises it (even on another node), only those of the engine's node.
    workers = [engine, same, marked, elsewhere, plain_far]
    assert relay_candidates(workers, engine, "relay") == [marked]
    assert advertised_relays(workers, engine, "relay") == [marked]
    assert relay_candidates([engine, same, elsewhere], engine, "relay") == []
    # Another resource name is honoured.
    assert relay_candidates(workers, engine, "other") == [same, marked]
    # Loading workers: neither the engine's nor a relay; else the relays.
    relays = [marked.address]
    assert loading_workers(workers, engine, relays) == [same, elsewhere, plain_far]
    assert loading_workers([engine, marked], engine, relays) == [marked]


def test_auto_lookahead_rule():
    # Off the engine's worker: twice the chunks in flight, at least 8, at most the cap.
    assert auto_lookahead("relay", 2, 32) == BASE_LOOKAHEAD == 8
    assert auto_lookahead("relay", 6, 32) == 12
    assert auto_lookahead("cluster", 12, 32) == 24
    assert auto_lookahead("cluster", 40, 32) == 32
    # On the engine's worker, and in the client's process: the base look-ahead.
    for mode in ("actor", "engine-worker", "local"):
        assert auto_lookahead(mode, 64, 32) == BASE_LOOKAHEAD
    # The cap holds below the base too.
    assert auto_lookahead("relay", 16, 5) == 5 and auto_lookahead("actor", 0, 5) == 5


def test_chunks_in_flight_counts_threads_or_file_sends():
    one, three = WorkerInfo("tcp://a:1", 1, {}), WorkerInfo("tcp://b:1", 3, {})
    assert chunks_in_flight([one, three]) == 4
    # "auto" with 8 relays for 2 loaders: 4 sends each, at most 2 per task thread.
    assert file_sends_per_loader(8, 2, "auto") == (4, 2)
    assert chunks_in_flight([one, three], partial(sends_allowed, 4, 2)) == 2 + 4
    # A number of sends holds whatever the threads; never fewer than the threads.
    assert file_sends_per_loader(8, 2, 5) == (5, None)
    assert chunks_in_flight([one, three], partial(sends_allowed, 5, None)) == 5 + 5
    assert chunks_in_flight([one, three], partial(sends_allowed, 1, None)) == 1 + 3
    assert chunks_in_flight([]) == 0
    # Four one-thread loaders with two sends each: 16 chunks ahead, not 8.
    four = [WorkerInfo(f"tcp://l{i}:1", 1, {}) for i in range(4)]
    two_each = partial(sends_allowed, *file_sends_per_loader(8, 4, "auto"))
    assert resolve_lookahead("auto", "relay", four, 32, two_each) == 16
    assert resolve_lookahead("auto", "relay", four, 32) == 8
    assert resolve_lookahead(5, "relay", four, 32, two_each) == 5


@pytest.mark.timeout(120)
def test_lookahead_auto_follows_the_loading_threads(ring_dir, snapshot, assert_unchanged):
    # Two loading workers of three task threads each beside the engine (2) and two
    # relays (1 each): relay 2 x 6 = 12 chunks, cluster (every worker loads) 2 x 10;
    # with more file sends than threads, twice the sends.
    roles = _roles(Worker)
    for name in ("load-0", "load-1"):
        roles[name] = {"cls": Worker, "options": {"nthreads": 3}}
    X, y, _ = _data(n=2_400, seed=23)
    Xd, yd = da.from_array(X, chunks=(300, 5)), da.from_array(y, chunks=300)
    ref = _loop(_row_blocks(X, y, None, [300] * 8))
    with _cluster(roles) as spec, Client(spec, set_as_default=False) as c:
        c.wait_for_workers(len(roles))
        with c.as_current():
            cap = {"rh-dask.distributed.lookahead-max": 10}
            sends = {"rh-dask.relay.file-sends": 5}
            for loader, settings, expected in [
                ("relay", {}, 12),
                ("cluster", {}, 20),
                ("actor", {}, 8),
                ("relay", cap, 10),
                # Five file sends per loading worker over TCP: 2 x (5 + 5).
                ("relay", sends, 20),
                ("relay", {**sends, "rh-dask.relay.transport": "dask"}, 12),
            ]:
                engine = _by_name(c)["engine"]
                model = RenewableHuberRegressor(loader=loader, worker=engine, progress=False)
                assert model.get_params()["lookahead"] == "auto"
                with dask.config.set(settings):
                    model.fit(Xd, yd)
                assert model.placement_["lookahead"] == expected, (loader, settings)
                _same(model, ref, assert_unchanged, snapshot)
            assert _left(ring_dir, c) == []


# -- equality with the plain loop ---------------------------------------------------------
@pytest.mark.parametrize("transport", ["tcp", "dask"])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_relay_fit_equals_partial_fit_loop(
    client, ring_dir, dtype, transport, snapshot, assert_unchanged
):
    X, y, w = _data(n=4_000, seed=1, weights=True, dtype=dtype)
    chunks = (800, 500, 1200, 700, 800)
    Xd, yd, wd = _arrays(X, y, w, chunks)
    model = RenewableHuberRegressor(loader="relay", lookahead=3, progress=False, dtype=dtype)
    with dask.config.set({"rh-dask.relay.transport": transport}):
        model.fit(Xd, yd, sample_weight=wd)
    _assert_roles(model, client)
    assert model.placement_["relay_transport"] == transport
    assert model.coef_.dtype == np.dtype(dtype)
    ref = _loop(_row_blocks(X, y, w, chunks), dtype=dtype)
    _same(model, ref, assert_unchanged, snapshot)
    assert _left(ring_dir, client) == []


@pytest.mark.parametrize("transport", ["tcp", "dask"])
def test_the_next_fit_takes_the_kept_ring_and_fits_the_same(
    client, ring_dir, transport, snapshot, assert_unchanged
):
    release_engines(client)
    X, y, w = _data(n=3_000, seed=31, weights=True)
    chunks = (800, 700, 900, 600)
    Xd, yd, wd = _arrays(X, y, w, chunks)
    ref = _loop(_row_blocks(X, y, w, chunks))
    reused = []
    with dask.config.set({"rh-dask.relay.transport": transport}):
        for _ in range(3):
            model = RenewableHuberRegressor(loader="relay", lookahead=3, progress=False)
            model.fit(Xd, yd, sample_weight=wd)
            reused.append(model.placement_["relay_ring_reused"])
            _same(model, ref, assert_unchanged, snapshot)
            # Kept with the parked engine: one ring, named, between the fits.
            assert len(_rings(ring_dir)) == 1
        # Another look-ahead makes another ring; the kept one is closed.
        other = RenewableHuberRegressor(loader="relay", lookahead=2, progress=False)
        other.fit(Xd, yd, sample_weight=wd)
        assert other.placement_["relay_ring_reused"] is False
        _same(other, ref, assert_unchanged, snapshot)
        assert len(_rings(ring_dir)) == 1
    assert reused == [False, True, True]
    assert _left(ring_dir, client) == []


@pytest.mark.parametrize("every", [1, 3])
def test_refilling_after_every_chunk_or_several_fits_the_same(
    client, ring_dir, every, snapshot, assert_unchanged
):
    X, y, _ = _data(n=3_000, seed=34)
    Xd, yd, _ = _arrays(X, y, None, (300,) * 10)
    with dask.config.set({"rh-dask.distributed.refill-every": every}):
        model = RenewableHuberRegressor(loader="relay", lookahead=4, progress=False)
        model.fit(Xd, yd)
    _same(model, _loop(_row_blocks(X, y, None, [300] * 10)), assert_unchanged, snapshot)
    assert _left(ring_dir, client) == []


def test_keep_ring_off_leaves_nothing_after_each_fit(client, ring_dir, snapshot, assert_unchanged):
    release_engines(client)
    X, y, _ = _data(n=2_000, seed=32)
    Xd, yd, _ = _arrays(X, y, None, (500,) * 4)
    ref = _loop(_row_blocks(X, y, None, [500] * 4))
    with dask.config.set({"rh-dask.relay.keep-ring": False}):
        for _ in range(2):
            model = RenewableHuberRegressor(loader="relay", lookahead=2, progress=False)
            model.fit(Xd, yd)
            assert model.placement_["relay_ring_reused"] is False
            _same(model, ref, assert_unchanged, snapshot)
            assert os.listdir(ring_dir) == []
    release_engines(client)


def test_a_refused_chunk_keeps_no_ring_and_the_next_fit_is_right(
    client, ring_dir, snapshot, assert_unchanged
):
    release_engines(client)
    X, y, _ = _data(n=2_000, seed=33)
    Xd, yd, _ = _arrays(X, y, None, (500,) * 4)
    good = RenewableHuberRegressor(loader="relay", lookahead=2, progress=False).fit(Xd, yd)
    bad_X = X.copy()
    bad_X[1200, 2] = np.nan
    bad = RenewableHuberRegressor(loader="relay", lookahead=2, progress=False)
    with pytest.raises(BadChunkError):
        bad.fit(*_arrays(bad_X, y, None, (500,) * 4)[:2])
    assert _rings(ring_dir) == []  # the failed stream's ring was closed
    again = RenewableHuberRegressor(loader="relay", lookahead=2, progress=False).fit(Xd, yd)
    assert again.placement_["relay_ring_reused"] is False
    np.testing.assert_array_equal(again.coef_, good.coef_)
    assert _left(ring_dir, client) == []


def test_relay_fit_of_a_dataframe_with_a_target_column(
    client, ring_dir, snapshot, assert_unchanged
):
    X, y, w = _data(n=2_000, d=4, seed=2, weights=True)
    pdf = pd.DataFrame(X, columns=[f"f{i}" for i in range(4)])
    pdf["target"] = y
    pdf["w"] = w
    ddf = dd.from_pandas(pdf, npartitions=4)
    # A frame's slots default to 128 MiB each: two of them, in the test's directory.
    model = RenewableHuberRegressor(loader="relay", lookahead=2, progress=False)
    model.fit(ddf, "target", sample_weight="w")
    _assert_roles(model, client)
    feats = [f"f{i}" for i in range(4)]
    parts = [ddf.get_partition(i).compute() for i in range(ddf.npartitions)]
    ref = _loop([(p[feats], p["target"], p["w"]) for p in parts])
    assert list(model.feature_names_in_) == feats
    _same(model, ref, assert_unchanged, snapshot)
    assert _left(ring_dir, client) == []


def test_auto_picks_relay_on_a_cluster_built_for_it(client, ring_dir, snapshot, assert_unchanged):
    X, y, _ = _data(n=1_500, seed=3)
    Xd, yd, _ = _arrays(X, y, None, (500, 500, 500))
    model = RenewableHuberRegressor(progress=False, lookahead=2).fit(Xd, yd)
    _assert_roles(model, client)
    _same(model, _loop(_row_blocks(X, y, None, [500] * 3)), assert_unchanged, snapshot)
    assert _left(ring_dir, client) == []


def _slow_early(block, block_info=None):
    # Earlier chunks take longest: later ones finish loading (and relaying) first.
    index = block_info[0]["chunk-location"][0]
    time.sleep(max(0.0, 0.25 - 0.05 * index))
    return block


def test_order_kept_when_later_chunks_finish_first(client, ring_dir, snapshot, assert_unchanged):
    X, y, _ = _data(n=3_000, seed=4)
    Xd = da.from_array(X, chunks=(500, 5)).map_blocks(
        _slow_early, dtype=X.dtype, meta=np.empty((0, 0), X.dtype)
    )
    model = RenewableHuberRegressor(loader="relay", lookahead=6, progress=False)
    model.fit(Xd, da.from_array(y, chunks=500))
    assert model.history_["chunk"].tolist() == list(range(6))
    _same(model, _loop(_row_blocks(X, y, None, [500] * 6)), assert_unchanged, snapshot)
    assert _left(ring_dir, client) == []


# -- chunks sent from .npy files --------------------------------------------------------------
def _npy_inputs(tmp_path, X, y, w, chunk_rows):
    import rh_dask

    out = []
    for name, a in (("X", X), ("y", y), ("w", w)):
        if a is None:
            out.append(None)
            continue
        np.save(tmp_path / f"{name}.npy", a)
        out.append(rh_dask.read_npy(tmp_path / f"{name}.npy", chunk_rows=chunk_rows))
    return out


@pytest.mark.parametrize(
    ("transport", "sendfile", "sent"),
    [("tcp", True, True), ("tcp", False, False), ("dask", True, False)],
)
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_a_fit_from_npy_files_sends_chunks_from_the_files_and_equals_the_loop(
    client, ring_dir, tmp_path, dtype, transport, sendfile, sent, snapshot, assert_unchanged
):
    X, y, w = _data(n=3_100, seed=12, weights=True, dtype=dtype)
    Xd, yd, wd = _npy_inputs(tmp_path, X, y, w, 700)
    settings = {"rh-dask.relay.transport": transport, "rh-dask.relay.sendfile": sendfile}
    model = RenewableHuberRegressor(loader="relay", lookahead=3, progress=False, dtype=dtype)
    with dask.config.set(settings):
        model.fit(Xd, yd, sample_weight=wd)
    _assert_roles(model, client)
    assert model.placement_["relay_sendfile"] is sent
    ref = _loop(_row_blocks(X, y, w, [700] * 4 + [300]), dtype=dtype)
    _same(model, ref, assert_unchanged, snapshot)
    assert _left(ring_dir, client) == []


@pytest.mark.parametrize(("file_sends", "most"), [("auto", 1), (4, 4)])
def test_file_sends_beyond_a_loaders_threads_leave_its_pool_and_equal_the_loop(
    client, ring_dir, tmp_path, slowed_file_sends, file_sends, most, snapshot, assert_unchanged
):
    # Each send is slowed, as one waiting for its relay. The two loading workers
    # have one task thread each and share this process (and so its limit):
    # "auto" allows relays // loaders = 1 send; 4 sends take seceded tasks.
    sends = slowed_file_sends(0.15)
    X, y, w = _data(n=4_000, seed=17, weights=True)
    Xd, yd, wd = _npy_inputs(tmp_path, X, y, w, 400)
    model = RenewableHuberRegressor(loader="relay", lookahead=8, progress=False)
    settings = {"rh-dask.relay.transport": "tcp", "rh-dask.relay.file-sends": file_sends}
    with dask.config.set(settings):
        model.fit(Xd, yd, sample_weight=wd)
    assert model.placement_["relay_sendfile"] is True
    assert model.placement_["relay_file_sends"] == (1 if file_sends == "auto" else 4)
    assert sends.most == most
    _same(model, _loop(_row_blocks(X, y, w, [400] * 10)), assert_unchanged, snapshot)
    assert _left(ring_dir, client) == []


@pytest.mark.parametrize("transport", ["tcp", "dask"])
def test_a_fit_from_a_zarr_store_decoded_on_the_loaders_equals_the_loop(
    client, ring_dir, tmp_path, transport, snapshot, assert_unchanged
):
    zarr = pytest.importorskip("zarr")
    if int(zarr.__version__.split(".")[0]) < 3:
        pytest.skip("the direct decode needs zarr >= 3")
    from rh_dask import read_zarr

    X, y, _ = _data(n=3_100, seed=13, dtype="float32")
    group = zarr.open_group(str(tmp_path / "s.zarr"), mode="w", zarr_format=3)
    for name, values in (("X", X), ("y", y)):
        arr = group.create_array(
            name, shape=values.shape, chunks=(700, *values.shape[1:]), dtype=values.dtype
        )
        arr[:] = values
    stream = read_zarr(tmp_path / "s.zarr", target="y", features=["X"])
    assert stream.X.name.startswith("from-zarr-direct-")
    model = RenewableHuberRegressor(loader="relay", lookahead=3, progress=False, dtype="float32")
    with dask.config.set({"rh-dask.relay.transport": transport}):
        model.fit(stream.X, stream.y)
    _assert_roles(model, client)
    ref = _loop(_row_blocks(X, y, None, [700] * 4 + [300]), dtype="float32")
    _same(model, ref, assert_unchanged, snapshot)
    assert _left(ring_dir, client) == []


def test_a_fit_from_several_npy_files_sends_every_chunk_from_them(
    client, ring_dir, tmp_path, snapshot, assert_unchanged
):
    import rh_dask

    X, y, _ = _data(n=2_600, seed=16)
    cuts = [0, 900, 1_000, 2_600]  # three files; chunks of 400 rows never span two
    for k, (a, b) in enumerate(itertools.pairwise(cuts)):
        np.save(tmp_path / f"X-{k}.npy", X[a:b])
        np.save(tmp_path / f"y-{k}.npy", y[a:b])
    Xd = rh_dask.read_npy(str(tmp_path / "X-*.npy"), chunk_rows=400)
    yd = rh_dask.read_npy(str(tmp_path / "y-*.npy"), chunk_rows=400)
    chunks = [400, 400, 100, 100, 400, 400, 400, 400]
    assert list(Xd.chunks[0]) == chunks
    model = RenewableHuberRegressor(loader="relay", lookahead=3, progress=False)
    with dask.config.set({"rh-dask.relay.transport": "tcp"}):
        model.fit(Xd, yd)
    assert model.placement_["relay_sendfile"] is True
    _same(model, _loop(_row_blocks(X, y, None, chunks)), assert_unchanged, snapshot)
    assert _left(ring_dir, client) == []


def test_npy_chunks_of_another_dtype_or_sliced_load_as_tasks(
    client, ring_dir, tmp_path, snapshot, assert_unchanged
):
    X, y, _ = _data(n=2_000, seed=13)
    Xd, yd, _ = _npy_inputs(tmp_path, X, y, None, 500)
    with dask.config.set({"rh-dask.relay.transport": "tcp"}):
        # float64 files, a float32 stream: converted on the loading workers.
        model = RenewableHuberRegressor(loader="relay", progress=False, dtype="float32")
        model.fit(Xd, yd)
        assert model.placement_["relay_sendfile"] is False
        _same(
            model,
            _loop(_row_blocks(X, y, None, [500] * 4), dtype="float32"),
            assert_unchanged,
            snapshot,
        )
        sliced = RenewableHuberRegressor(loader="relay", progress=False)
        sliced.fit(Xd[:, :4], yd)
        assert sliced.placement_["relay_sendfile"] is False
    ref = _loop(_row_blocks(X[:, :4], y, None, [500] * 4))
    _same(sliced, ref, assert_unchanged, snapshot)
    assert _left(ring_dir, client) == []


@pytest.mark.parametrize("problem", ["nan", "negative weight"])
def test_a_bad_npy_chunk_is_refused_by_the_relay_and_changes_nothing(
    client, ring_dir, tmp_path, problem, snapshot, assert_unchanged
):
    X, y, w = _data(n=2_500, seed=14, weights=True)
    bad_X, bad_w = X.copy(), w.copy()
    if problem == "nan":
        bad_X[1_234, 1] = np.nan  # chunk 2 of 500-row chunks
    else:
        bad_w[1_100] = -1.0
    Xd, yd, wd = _npy_inputs(tmp_path, bad_X, y, bad_w, 500)
    blocks = _row_blocks(X, y, w, [500] * 5)
    model = _loop(blocks[:1])
    with dask.config.set({"rh-dask.relay.transport": "tcp"}):
        with pytest.raises(BadChunkError, match="chunk 2 was refused") as info:
            model.partial_fit(Xd, yd, sample_weight=wd)
    assert info.value.chunk_index == 2
    assert ("NaN" if problem == "nan" else "sample_weight") in str(info.value)
    assert model.placement_["relay_sendfile"] is True
    # The two chunks in front of it were fitted; nothing of chunk 2.
    _same(model, _loop(blocks[:1] + blocks[:2]), assert_unchanged, snapshot)
    assert _left(ring_dir, client) == []


def test_a_npy_file_changed_under_the_fit_names_the_chunk_and_the_file(
    client, ring_dir, tmp_path, snapshot, assert_unchanged
):
    X, y, _ = _data(n=2_000, seed=15)
    Xd, yd, _ = _npy_inputs(tmp_path, X, y, None, 500)
    np.save(tmp_path / "y.npy", y[:1_900])
    model = RenewableHuberRegressor(loader="relay", progress=False)
    with dask.config.set({"rh-dask.relay.transport": "tcp"}):
        with pytest.raises(StreamError, match=r"chunk 0 could not be loaded.*y\.npy.*changed"):
            model.fit(Xd, yd)
    assert not hasattr(model, "coef_")
    assert _left(ring_dir, client) == []


# -- the memory bound -----------------------------------------------------------------------
class _Watch:
    """What the engine consumed, and where each load started relative to it (one process)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.consumed = 0
        self.loads: list[tuple[int, int]] = []
        self.rings: list = []


_watch = _Watch()


def _logged_load(block, block_info=None):
    index = block_info[0]["chunk-location"][0]
    with _watch.lock:
        _watch.loads.append((index, _watch.consumed))
    return block


def test_no_chunk_loads_before_the_ring_has_room_for_it(client, ring_dir, monkeypatch):
    lookahead, n_chunks, rows = 3, 12, 200
    X, y, _ = _data(n=n_chunks * rows, seed=5)
    original = NumpyEngine.partial_fit

    def counted(self, *args, **kwargs):
        # A slow engine: loaders would run ahead of it if nothing held them back.
        time.sleep(0.02)
        out = original(self, *args, **kwargs)
        with _watch.lock:
            _watch.consumed += 1
        return out

    make = ChunkRing.create.__func__

    def recorded(cls, *args, **kwargs):
        made = make(cls, *args, **kwargs)
        _watch.rings.append(made.spec)
        return made

    _watch.__init__()
    monkeypatch.setattr(NumpyEngine, "partial_fit", counted)
    monkeypatch.setattr(ChunkRing, "create", classmethod(recorded))
    Xd = da.from_array(X, chunks=(rows, 5)).map_blocks(
        _logged_load, dtype=X.dtype, meta=np.empty((0, 0), X.dtype)
    )
    model = RenewableHuberRegressor(loader="relay", lookahead=lookahead, progress=False)
    model.fit(Xd, da.from_array(y, chunks=rows))
    monkeypatch.undo()
    assert len(model.history_) == n_chunks and _watch.consumed == n_chunks
    assert sorted(i for i, _ in _watch.loads) == list(range(n_chunks))
    for index, consumed in _watch.loads:
        # Chunk i loads only once chunk i - lookahead was consumed.
        assert consumed >= index - lookahead + 1, (index, consumed, _watch.loads)
    # The loads did overlap the engine (the bound is not trivially met by a serial walk).
    assert any(consumed < index for index, consumed in _watch.loads)
    (spec,) = _watch.rings
    assert spec.n_slots == lookahead
    # One slot holds the largest chunk (X, y and room for a weight column), no more.
    needed = rows * 5 * 8 + rows * 8
    assert needed <= spec.slot_bytes <= needed + rows * 8 + 3 * 64 + 4096
    assert _left(ring_dir, client) == []


def test_a_ring_of_one_slot(client, ring_dir, snapshot, assert_unchanged):
    # lookahead=1: every chunk waits in its relay for the release of the one before.
    X, y, _ = _data(n=2_000, seed=7)
    Xd, yd, _ = _arrays(X, y, None, (400,) * 5)
    model = RenewableHuberRegressor(loader="relay", lookahead=1, progress=False).fit(Xd, yd)
    _same(model, _loop(_row_blocks(X, y, None, [400] * 5)), assert_unchanged, snapshot)
    assert _left(ring_dir, client) == []


def test_chunks_larger_than_a_slot_go_through_files(client, ring_dir, snapshot, assert_unchanged):
    X, y, w = _data(n=2_400, seed=6, weights=True)
    Xd, yd, wd = _arrays(X, y, w, (600, 600, 600, 600))
    with dask.config.set({"rh-dask.relay.slot-bytes": 4096}):  # a chunk is 33.6 kB
        model = RenewableHuberRegressor(loader="relay", lookahead=2, progress=False)
        model.fit(Xd, yd, sample_weight=wd)
    _same(model, _loop(_row_blocks(X, y, w, [600] * 4)), assert_unchanged, snapshot)
    assert _left(ring_dir, client) == []


# -- bad input on this path ---------------------------------------------------------------
def test_bad_chunk_stops_in_front_of_it_then_partial_fit_continues(
    client, ring_dir, snapshot, assert_unchanged
):
    X, y, _ = _data(n=3_000, seed=10)
    bad = X.copy()
    bad[1_234, 2] = np.nan  # inside chunk 2 of 500-row chunks
    model = RenewableHuberRegressor(loader="relay", lookahead=4, progress=False)
    with pytest.raises(BadChunkError, match="chunk 2 was refused") as info:
        model.fit(da.from_array(bad, chunks=(500, 5)), da.from_array(y, chunks=500))
    assert info.value.chunk_index == 2 and "NaN" in str(info.value)
    assert isinstance(info.value, ValueError) and isinstance(info.value, StreamError)
    blocks = _row_blocks(X, y, None, [500] * 6)
    _same(model, _loop(blocks[:2]), assert_unchanged, snapshot)
    model.partial_fit(da.from_array(X[1_000:], chunks=(500, 5)), da.from_array(y[1_000:], 500))
    assert model.placement_["loader"] == "relay"
    _same(model, _loop(blocks), assert_unchanged, snapshot)
    assert _left(ring_dir, client) == []


def _fail_chunk_3(block, block_info=None):
    if block_info[0]["chunk-location"][0] == 3:
        raise OSError("disk on fire")
    return block


def test_a_failing_load_names_the_chunk(client, ring_dir, snapshot, assert_unchanged):
    X, y, _ = _data(n=3_000, seed=11)
    Xd = da.from_array(X, chunks=(500, 5)).map_blocks(
        _fail_chunk_3, dtype=X.dtype, meta=np.empty((0, 0), X.dtype)
    )
    model = RenewableHuberRegressor(loader="relay", progress=False)
    with pytest.raises(StreamError, match=r"chunk 3 could not be loaded.*disk on fire") as info:
        model.fit(Xd, da.from_array(y, chunks=500))
    assert type(info.value) is StreamError and info.value.chunk_index == 3
    _same(model, _loop(_row_blocks(X, y, None, [500] * 3)), assert_unchanged, snapshot)
    assert _left(ring_dir, client) == []


@pytest.mark.parametrize("transport", ["tcp", "dask"])
def test_a_full_ring_directory_at_a_slots_first_write_stops_the_fit_there(
    client, ring_dir, snapshot, assert_unchanged, monkeypatch, transport
):
    # Slots get their memory at their first write: the directory fills up after two.
    X, y, _ = _data(n=3_000, seed=14)
    slot_bytes = -(-(500 * (5 + 2) * 8 + 3 * 64) // 4096) * 4096
    real = os.posix_fallocate

    def fallocate(fd, offset, length):
        if offset >= 4096 + 2 * slot_bytes:
            raise OSError(28, "No space left on device")
        return real(fd, offset, length)

    monkeypatch.setattr(os, "posix_fallocate", fallocate)
    model = RenewableHuberRegressor(loader="relay", progress=False)
    with (
        dask.config.set({"rh-dask.relay.transport": transport}),
        pytest.raises(StreamError, match=r"chunk 2 .*cannot allocate slot 2") as info,
    ):
        model.fit(da.from_array(X, chunks=(500, 5)), da.from_array(y, chunks=500))
    assert info.value.chunk_index == 2
    _same(model, _loop(_row_blocks(X, y, None, [500] * 2)), assert_unchanged, snapshot)
    assert _left(ring_dir, client) == []


def test_a_refused_fit_keeps_the_fitted_model(client, ring_dir, snapshot, assert_unchanged):
    X, y, _ = _data(n=2_000, seed=12)
    model = RenewableHuberRegressor(loader="relay", progress=False)
    model.fit(da.from_array(X, chunks=(500, 5)), da.from_array(y, 500))
    before, history, placement = snapshot(model), model.history_.copy(), model.placement_
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
    assert _left(ring_dir, client) == []


def test_a_missing_ring_directory_refuses_the_fit_and_keeps_the_model(
    client, ring_dir, snapshot, assert_unchanged
):
    X, y, _ = _data(n=1_000, seed=13)
    Xd, yd = da.from_array(X, chunks=(500, 5)), da.from_array(y, 500)
    model = RenewableHuberRegressor(loader="relay", progress=False).fit(Xd, yd)
    before = snapshot(model)
    missing = os.path.join(ring_dir, "missing")
    fresh = RenewableHuberRegressor(loader="relay", progress=False)
    with dask.config.set({"rh-dask.relay.directory": missing}):
        for m in (model, fresh):
            with pytest.raises(RingError, match="missing") as info:
                m.fit(Xd, yd)
            assert isinstance(info.value, OSError)
    assert_unchanged(before, snapshot(model))
    assert not hasattr(fresh, "coef_")
    assert not os.path.exists(missing)


def test_a_chunk_the_engines_side_cannot_map_stops_the_fit_at_it(ring_dir, monkeypatch):
    # Its own small cluster: a fit that hangs here must not hold the module's.
    roles = {k: v for k, v in _roles(Worker).items() if k in ("engine", "relay-0", "load-0")}
    mapped = ChunkRing.parts

    def parts(self, note):
        if note.index == 2:
            raise OSError("cannot map the chunk")
        return mapped(self, note)

    monkeypatch.setattr(ChunkRing, "parts", parts)
    X, y, _ = _data(n=2_000, seed=16)
    Xd, yd = da.from_array(X, chunks=(500, 5)), da.from_array(y, 500)
    outcome: dict = {}
    with _cluster(roles) as spec, Client(spec, set_as_default=False) as c:

        def fit() -> None:
            try:
                with c.as_current():
                    RenewableHuberRegressor(loader="relay", progress=False).fit(Xd, yd)
            except BaseException as exc:
                outcome["error"] = exc

        thread = threading.Thread(target=fit, daemon=True)
        thread.start()
        thread.join(15)
        hung = thread.is_alive()
    assert not hung, "the fit still waits for chunk 2, whose note the engine's side dropped"
    error = outcome.get("error")
    assert isinstance(error, StreamError) and error.chunk_index == 2, error


def _fail_once_at_4(block, *, marker, block_info=None):
    if block_info[0]["chunk-location"][0] == 4 and not os.path.exists(marker):
        open(marker, "w").close()
        raise OSError("network share went away")
    return block


def test_a_resumed_relay_walk_starts_its_ring_at_the_checkpoint(
    client, ring_dir, tmp_path, snapshot, assert_unchanged
):
    X, y, _ = _data(n=8 * 250, seed=17)
    Xd = da.from_array(X, chunks=(250, 5)).map_blocks(
        _fail_once_at_4,
        dtype=X.dtype,
        meta=np.empty((0, 0), X.dtype),
        marker=str(tmp_path / "failed"),
    )
    yd = da.from_array(y, chunks=250)
    store = tmp_path / "checkpoints"
    params = dict(loader="relay", lookahead=3, progress=False, checkpoint_every=1)
    first = RenewableHuberRegressor(checkpoint_dir=str(store), **params)
    with pytest.raises(StreamError, match="chunk 4 could not be loaded"):
        first.fit(Xd, yd)
    starts: list[int] = []
    make = ChunkRing.create.__func__

    def recorded(cls, directory, n_slots, slot_bytes, start=0, **kwargs):
        starts.append(start)
        return make(cls, directory, n_slots, slot_bytes, start, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ChunkRing, "create", classmethod(recorded))
        model = RenewableHuberRegressor(**params).fit(Xd, yd, resume_from=str(store))
    assert starts == [4]
    assert model.history_["chunk"].tolist() == list(range(8))
    _same(model, _loop(_row_blocks(X, y, None, [250] * 8)), assert_unchanged, snapshot)
    assert _left(ring_dir, client) == []


# -- clusters that cannot relay -----------------------------------------------------------------
def test_relay_with_only_the_engines_worker_is_refused(ring_dir, snapshot, assert_unchanged):
    lone = {"engine": {"cls": Worker, "options": {"nthreads": 1}}}
    X, y, _ = _data(n=1_000, seed=14)
    Xd, yd = da.from_array(X, chunks=(500, 5)), da.from_array(y, 500)
    with _cluster(lone) as spec, Client(spec, set_as_default=False) as c, c.as_current():
        model = RenewableHuberRegressor(loader="cluster", progress=False).fit(Xd, yd)
        before = snapshot(model)
        model.set_params(loader="relay")
        with pytest.raises(ValidationError, match=r"loader='relay' needs a worker on the engine"):
            model.fit(Xd, yd)
        assert_unchanged(before, snapshot(model))
    assert _left(ring_dir) == []


def test_a_relay_resource_on_another_node_is_no_relay(ring_dir):
    # Two "nodes" of one machine: workers listening on 127.0.0.1 and on 127.0.0.2.
    workers = {
        "engine": {"cls": Worker, "options": {"nthreads": 2, "host": "127.0.0.1"}},
        "same-node": {"cls": Worker, "options": {"nthreads": 1, "host": "127.0.0.1"}},
        "far-relay": {
            "cls": Worker,
            "options": {"nthreads": 1, "host": "127.0.0.2", "resources": {"relay": 1}},
        },
    }
    X, y, _ = _data(n=1_000, seed=15)
    Xd, yd = da.from_array(X, chunks=(500, 5)), da.from_array(y, 500)
    try:
        spec = _cluster(workers)
    except OSError as exc:  # a platform routing only 127.0.0.1 to loopback
        pytest.skip(f"cannot listen on 127.0.0.2: {exc}")
    with spec, Client(spec, set_as_default=False) as c, c.as_current():
        # Relays are the engine node's advertising workers once any worker advertises.
        with pytest.raises(ValidationError, match="needs a worker on the engine's node"):
            RenewableHuberRegressor(loader="relay", progress=False).fit(Xd, yd)
        model = RenewableHuberRegressor(progress=False).fit(Xd, yd)
        assert model.placement_["loader"] != "relay"
        assert model.placement_["worker"] == _by_name(c)["engine"]
    assert _left(ring_dir) == []


# -- worker processes ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def process_cluster():
    with _cluster(_roles(Nanny)) as spec, Client(spec, set_as_default=False) as c:
        c.wait_for_workers(len(ROLES), timeout=60)
        yield c


def _slow_first(block, *, seconds, block_info=None):
    """Chunk function: chunk 0 takes ``seconds``, so later chunks wait, relayed, behind it."""
    if block_info is not None and block_info[0]["chunk-location"][0] == 0:
        time.sleep(seconds)
    return block


def _relayed_results(dask_scheduler=None) -> dict[str, list[str]]:
    """Worker -> relay tasks whose results it holds (run on the scheduler)."""
    out: dict[str, list[str]] = {}
    for ts in dask_scheduler.tasks.values():
        key = ts.key
        if ts.state == "memory" and isinstance(key, tuple) and key[0].startswith("rh-relay-"):
            for ws in ts.who_has or ():
                out.setdefault(ws.address, []).append(str(key))
    return out


@pytest.mark.slow
def test_relay_fit_on_worker_processes(process_cluster, ring_dir, snapshot, assert_unchanged):
    c = process_cluster
    X, y, w = _data(n=3_000, seed=20, weights=True)
    chunks = (600, 400, 800, 600, 600)
    Xd, yd, wd = _arrays(X, y, w, chunks)
    with c.as_current():
        model = RenewableHuberRegressor(loader="relay", lookahead=3, progress=False)
        model.fit(Xd, yd, sample_weight=wd)
        _assert_roles(model, c)
    _same(model, _loop(_row_blocks(X, y, w, chunks)), assert_unchanged, snapshot)
    assert _left(ring_dir, c) == []
    # The relays let go of the ring once the stream ended.
    from rh_dask.distributed.relay import attached_rings

    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        held = c.run(attached_rings, workers=model.placement_["relays"])
        if not any(held.values()):
            break
        time.sleep(0.1)
    assert not any(held.values()), held


@pytest.fixture
def dask_comm_transport():
    """Chunks reach the relays as task results (which a test can find and kill)."""
    with dask.config.set({"rh-dask.relay.transport": "dask"}):
        yield


@pytest.mark.slow
def test_losing_a_relay_mid_fit_still_gives_the_same_fit(
    process_cluster, ring_dir, snapshot, assert_unchanged, dask_comm_transport
):
    # Chunk 0 loads slowly, so chunks 1..3 sit relayed (in the ring, their
    # notes sent) behind it; the relay holding their results is killed. Dask
    # runs them again on the other relay, which writes them again and sends
    # their notes a second time: the fit must not change by a bit.
    c = process_cluster
    c.wait_for_workers(len(ROLES), timeout=60)
    names = _by_name(c)
    relays = {names["relay-0"], names["relay-1"]}

    pids = dict(c.run(os.getpid))
    X, y, _ = _data(n=12 * 200, seed=21)
    Xd = da.from_array(X, chunks=(200, 5)).map_blocks(
        _slow_first, dtype=X.dtype, meta=np.empty((0, 0), X.dtype), seconds=2.0
    )
    outcome: dict = {}

    def fit() -> None:
        try:
            with c.as_current():
                model = RenewableHuberRegressor(loader="relay", lookahead=4, progress=False)
                outcome["model"] = model.fit(Xd, da.from_array(y, chunks=200))
        except BaseException as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=fit, daemon=True)
    thread.start()
    victim, held = None, []
    deadline = time.monotonic() + 10
    while victim is None and time.monotonic() < deadline and thread.is_alive():
        for address, keys in c.run_on_scheduler(_relayed_results).items():
            if address in relays:
                victim, held = address, keys
                break
        time.sleep(0.02)
    assert victim is not None, "no relay held a relayed chunk while chunk 0 loaded"
    os.kill(pids[victim], signal.SIGKILL)
    thread.join(60)
    assert not thread.is_alive()
    assert "error" not in outcome, outcome.get("error")
    model = outcome["model"]
    assert held and victim in model.placement_["relays"]
    with pytest.raises(ProcessLookupError):  # the relay died during the fit
        os.kill(pids[victim], 0)
    assert model.placement_["relay_transport"] == "dask"
    _same(model, _loop(_row_blocks(X, y, None, [200] * 12)), assert_unchanged, snapshot)
    assert _left(ring_dir, c) == []


def _pushed(dask_scheduler=None) -> int:
    """Hand-over tasks done so far over the TCP transport (run on the scheduler)."""
    return sum(
        1
        for ts in dask_scheduler.tasks.values()
        if ts.state == "memory" and isinstance(ts.key, tuple) and ts.key[0].startswith("rh-push-")
    )


@pytest.mark.slow
def test_losing_a_relay_mid_fit_over_tcp_still_gives_the_same_fit(
    process_cluster, ring_dir, snapshot, assert_unchanged
):
    # Chunk 0 loads slowly, so chunks 1..3 sit pushed into the ring behind it;
    # then a relay is killed. Chunks that were to go to it go to the other
    # relay (push_chunk tries the next), the ring keeps what it was given,
    # and the fit must not change by a bit.
    c = process_cluster
    c.wait_for_workers(len(ROLES), timeout=60)
    names = _by_name(c)
    pids = dict(c.run(os.getpid))
    X, y, _ = _data(n=12 * 200, seed=22)
    Xd = da.from_array(X, chunks=(200, 5)).map_blocks(
        _slow_first, dtype=X.dtype, meta=np.empty((0, 0), X.dtype), seconds=2.0
    )
    outcome: dict = {}

    def fit() -> None:
        try:
            with c.as_current(), dask.config.set({"rh-dask.relay.transport": "tcp"}):
                model = RenewableHuberRegressor(loader="relay", lookahead=4, progress=False)
                outcome["model"] = model.fit(Xd, da.from_array(y, chunks=200))
        except BaseException as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=fit, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and thread.is_alive():
        if c.run_on_scheduler(_pushed) >= 2:
            break
        time.sleep(0.02)
    assert c.run_on_scheduler(_pushed) >= 2, "no chunk was pushed while chunk 0 loaded"
    victim = names["relay-0"]
    os.kill(pids[victim], signal.SIGKILL)
    thread.join(60)
    assert not thread.is_alive()
    assert "error" not in outcome, outcome.get("error")
    model = outcome["model"]
    assert model.placement_["relay_transport"] == "tcp"
    assert victim in model.placement_["relays"]
    with pytest.raises(ProcessLookupError):
        os.kill(pids[victim], 0)
    _same(model, _loop(_row_blocks(X, y, None, [200] * 12)), assert_unchanged, snapshot)
    assert _left(ring_dir, c) == []
