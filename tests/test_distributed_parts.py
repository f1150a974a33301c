"""Pieces of the distributed fit that need no cluster: ordering, graph split, loading."""

from __future__ import annotations

import pickle
import threading
import time

import dask
import dask.array as da
import numpy as np
import pandas as pd
import pytest
from dask.sizeof import sizeof
from threadpoolctl import threadpool_limits

from rh_dask import HuberConfig, NumpyEngine, RenewableHuberRegressor
from rh_dask.distributed.chunks import SMALL_LITERAL_BYTES, ChunkGraph, align_stream
from rh_dask.distributed.consumer import OrderedConsumer
from rh_dask.distributed.items import BadChunk, EmptyChunk, LoadedChunk
from rh_dask.distributed.loading import assemble_chunk
from rh_dask.engines.blas_threads import blas_threads_in_force
from rh_dask.exceptions import ValidationError


class _RecordingEngine(NumpyEngine):
    """A NumPy engine that remembers the first row of every batch it fits."""

    def __init__(self, config):
        super().__init__(config)
        self.seen = []
        self.threads = set()

    def partial_fit(self, X, y, sample_weight=None):
        self.seen.append(float(X[0, 0]))
        self.threads.add(threading.get_ident())
        return super().partial_fit(X, y, sample_weight)


def _chunks(n_chunks=6, rows=50, d=3, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n_chunks):
        X = rng.normal(size=(rows, d))
        X[0, 0] = i  # tags the chunk
        out.append(LoadedChunk(i, X, X.sum(axis=1) + rng.normal(size=rows), None))
    return out


def _wait(consumer, target):
    done = threading.Event()
    consumer.add_waiter(target, done.set)
    assert done.wait(30)


def test_consumer_takes_chunks_in_index_order_whatever_the_arrival_order():
    consumer = OrderedConsumer(lambda: _RecordingEngine(HuberConfig()))
    try:
        consumer.begin("s", None)
        items = _chunks()
        for item in reversed(items):  # the last chunk arrives first
            assert consumer.deliver("s", item)
        _wait(consumer, len(items))
        engine = consumer.engine
        assert engine.seen == [float(i) for i in range(len(items))]
        assert len(engine.threads) == 1 and threading.get_ident() not in engine.threads
        ref = NumpyEngine(HuberConfig())
        betas = []
        for item in items:
            ref.partial_fit(item.X, item.y)
            betas.append(ref.coefficients())
        assert consumer.end("s")[0].equals(ref.export_state())
        # Each record carries β after its own batch, taken on the engine thread.
        records = consumer.snapshot().records
        np.testing.assert_array_equal([r.coefficients for r in records], betas)
    finally:
        consumer.close()


class _BlasWatchingEngine(NumpyEngine):
    """A NumPy engine that remembers BLAS's thread count as each batch begins."""

    def __init__(self, config):
        super().__init__(config)
        self.counts = []

    def partial_fit(self, X, y, sample_weight=None):
        self.counts.append(blas_threads_in_force())
        return super().partial_fit(X, y, sample_weight)


def test_consumer_pins_blas_while_another_thread_controls_it():
    """threadpoolctl >= 3.8 ignores limits set by a thread other than the controlling one."""
    consumer = OrderedConsumer(lambda: _BlasWatchingEngine(HuberConfig()), blas_threads=1)
    try:
        # This thread takes OpenBLAS's control and keeps it while the stream runs.
        with threadpool_limits(limits=2, user_api="blas"):
            outside = blas_threads_in_force()
            consumer.begin("s", None)
            items = _chunks(n_chunks=3)
            for item in items:
                assert consumer.deliver("s", item)
            _wait(consumer, len(items))
            assert consumer.engine.counts == [1, 1, 1]
            assert blas_threads_in_force() == outside  # restored when the engine left
    finally:
        consumer.close()


def test_consumer_refuses_a_blas_count_it_does_not_keep():
    with pytest.raises(ValueError, match="1 or None"):
        OrderedConsumer(lambda: NumpyEngine(HuberConfig()), blas_threads=2)


def test_consumer_skips_empty_stops_at_bad_and_ignores_stale():
    consumer = OrderedConsumer(lambda: NumpyEngine(HuberConfig()))
    try:
        consumer.begin("s", None)
        items = _chunks(4)
        consumer.deliver("s", items[0])
        consumer.deliver("s", EmptyChunk(1))
        consumer.deliver("s", BadChunk(2, "broken", ValueError("x")))
        consumer.deliver("s", items[3])
        _wait(consumer, 4)  # fires at the failure
        snap = consumer.snapshot()
        assert snap.consumed == 2 and snap.n_empty == 1
        assert snap.failure.index == 2
        assert [r.chunk for r in snap.records] == [0]
        assert not consumer.deliver("other-stream", items[3])
        state, final = consumer.end("s")
        assert state.batch_count == 1 and final.consumed == 2
    finally:
        consumer.close()


def test_consumer_reports_an_engine_refusal_as_the_chunk_failure():
    consumer = OrderedConsumer(lambda: NumpyEngine(HuberConfig()))
    try:
        consumer.begin("s", None)
        good = _chunks(1)[0]
        wrong = LoadedChunk(1, np.ones((5, 4)), np.ones(5), None)  # wrong width
        consumer.deliver("s", good)
        consumer.deliver("s", wrong)
        _wait(consumer, 2)
        failure = consumer.snapshot().failure
        assert failure.index == 1 and "features" in failure.reason
    finally:
        consumer.close()


class _StreamingEngine(_RecordingEngine):
    """Pulls the next batch before solving the current one, as the GPU engine does.

    ``refuse_staging`` names a tagged batch whose *staging* (pulling it as the
    upcoming batch) raises, before the current batch is solved.
    """

    refuse_staging: float | None = None

    def partial_fit_stream(self, batches):
        it = iter(batches)
        current = next(it, None)
        while current is not None:
            upcoming = next(it, None)
            if upcoming is not None and float(upcoming[0][0, 0]) == self.refuse_staging:
                raise ValidationError("cannot stage this batch")
            yield self.partial_fit(*current)
            current = upcoming

    def partial_fit(self, X, y, sample_weight=None):
        if float(X[0, 0]) == self.refuse_staging:
            raise ValidationError("cannot stage this batch")
        return super().partial_fit(X, y, sample_weight)


@pytest.mark.parametrize("refuse", [None, 3.0])
def test_consumer_uses_partial_fit_stream_in_order(refuse):
    def make():
        engine = _StreamingEngine(HuberConfig())
        engine.refuse_staging = refuse
        return engine

    consumer = OrderedConsumer(make)
    try:
        consumer.begin("s", None)
        items = _chunks(6)
        # Chunk 1 is empty; chunk i >= 2 carries the batch tagged i - 1.
        shifted = [LoadedChunk(i + 1, it.X, it.y, None) for i, it in enumerate(items) if i]
        mixed = [items[0], EmptyChunk(1), *shifted]
        for item in reversed(mixed):
            consumer.deliver("s", item)
        _wait(consumer, len(mixed))
        snap = consumer.snapshot()
        fitted = [r.chunk for r in snap.records]
        if refuse is None:
            assert fitted == [0, 2, 3, 4, 5, 6] and snap.n_empty == 1
            assert snap.failure is None
        else:
            # Batch tagged 3.0 is chunk 4: everything before it is fitted, then it fails.
            assert fitted == [0, 2, 3] and snap.failure.index == 4
        ref = NumpyEngine(HuberConfig())
        betas = []
        for item in mixed[: len(fitted) + 1]:
            if isinstance(item, LoadedChunk):
                ref.partial_fit(item.X, item.y)
                betas.append(ref.coefficients())
        # β is read between the stream's yields: after each batch, not after the
        # one already pulled for staging.
        np.testing.assert_array_equal([r.coefficients for r in snap.records], betas)
        assert consumer.end("s")[0].equals(ref.export_state())
    finally:
        consumer.close()


def test_engine_that_cannot_start_raises_from_the_constructor():
    def broken():
        raise RuntimeError("no device")

    with pytest.raises(RuntimeError, match="no device"):
        OrderedConsumer(broken)


def test_assemble_chunk_outcomes():
    from rh_dask.distributed.items import ChunkSpec

    spec = ChunkSpec(index=4, dtype="float32", n_features=2, feature_names=None)
    ok = assemble_chunk(np.ones((3, 2)), np.ones(3), None, spec)
    assert isinstance(ok, LoadedChunk) and ok.X.dtype == np.float32 and ok.rows == 3
    assert isinstance(assemble_chunk(np.ones((0, 2)), np.ones(0), None, spec), EmptyChunk)
    bad = assemble_chunk(np.ones((0, 2)), np.ones(2), None, spec)
    assert isinstance(bad, BadChunk) and bad.index == 4
    wide = assemble_chunk(np.ones((3, 3)), np.ones(3), None, spec)
    assert isinstance(wide, BadChunk) and "3 features" in wide.reason
    named = ChunkSpec(index=0, dtype="float64", n_features=2, feature_names=("a", "b"))
    frame = pd.DataFrame({"b": [1.0], "a": [2.0]})
    assert isinstance(assemble_chunk(frame, np.ones(1), None, named), BadChunk)


def test_shared_reduction_is_computed_once_and_raw_chunks_are_not_held():
    calls = []
    lock = threading.Lock()

    def counted(block, block_info=None):
        with lock:
            calls.append(block_info[0]["chunk-location"][0])
        return block

    X = np.random.default_rng(1).normal(size=(600, 3))
    raw = da.from_array(X, chunks=(100, 3)).map_blocks(counted, dtype=X.dtype)
    Xs = raw - raw.mean(axis=0)
    stream = align_stream(Xs, da.from_array(X[:, 0], chunks=100), None)
    graph = ChunkGraph(stream, assemble_chunk, lambda i: stream.spec(i, "float64", False))
    # Chunk 0 computes the mean (every raw chunk) and holds it for all others;
    # the raw chunks feeding the mean are recomputed, not held for the whole fit.
    held = graph.shared_owned(0)
    assert any("mean" in str(k) for k in held)
    assert not any("counted" in str(k) for k in held)
    model = RenewableHuberRegressor(progress=False).fit(Xs, da.from_array(X[:, 0], chunks=100))
    assert model.n_samples_seen_ == 600
    # Six reads for the mean, then one per chunk (chunk 0 shares its read).
    assert sorted(calls) == sorted(list(range(6)) + list(range(1, 6)))


def test_align_stream_refusals():
    X = da.ones((10, 2), chunks=5)
    with pytest.raises(ValidationError, match="2-D"):
        align_stream(da.ones(10, chunks=5), X[:, 0], None)
    with pytest.raises(ValidationError, match="1-D"):
        align_stream(X, X, None)
    with pytest.raises(ValidationError, match="None"):
        align_stream(X, None, None)
    with pytest.raises(ValidationError, match="DataFrame"):
        align_stream(X, "y", None)
    with pytest.raises(ValidationError, match="shape"):
        align_stream(X, np.ones(9), None)
    aligned = align_stream(X, np.arange(10.0), None)
    assert aligned.n_chunks == 2


def test_chunk_graph_travels_without_its_sources():
    import pickle

    X = np.random.default_rng(2).normal(size=(300, 3))
    stream = align_stream(da.from_array(X, chunks=(100, 3)), da.from_array(X[:, 1], 100), None)
    graph = ChunkGraph(stream, assemble_chunk, lambda i: stream.spec(i, "float64", False))
    assert graph.self_contained
    copy = pickle.loads(pickle.dumps(graph))
    assert copy.stream is None and copy.make_spec is None
    assert copy.keys == graph.keys and copy.n_chunks == 3
    # Without the key of chunk 1's block the graph needs data from elsewhere.
    block = next(k for k in graph.graph if "array" in str(k) and k[1:] == (1, 0))
    partial = pickle.loads(pickle.dumps(graph))
    del partial.graph[block]
    assert not partial.self_contained


@pytest.mark.parametrize("lookahead", [1, 3])
def test_feeder_keeps_the_window_and_matches_a_loop(lookahead):
    from rh_dask.distributed.feeder import ChunkFeeder

    rng = np.random.default_rng(3)
    X = rng.normal(size=(700, 3))
    y = X.sum(axis=1) + rng.standard_t(2, size=700)
    # The mean is a key every chunk shares: computed once, held, then released.
    Xd = da.from_array(X, chunks=(100, 3))
    Xd = Xd - Xd.mean(axis=0)
    stream = align_stream(Xd, da.from_array(y, 100), None)
    graph = ChunkGraph(stream, assemble_chunk, lambda i: stream.spec(i, "float64", False))
    consumer = OrderedConsumer(lambda: NumpyEngine(HuberConfig()))
    ahead = []

    def stage(item):
        ahead.append(item.index - consumer.consumed)
        return item

    try:
        consumer.begin("s", None)
        feeder = ChunkFeeder(graph, consumer, "s", lookahead, threads=3, stage=stage)
        feeder.start()
        _wait(consumer, 7)
        feeder.join(30)
        state = consumer.engine.export_state()
        assert consumer.snapshot().failure is None
    finally:
        consumer.close()
    assert len(ahead) == 7 and max(ahead) < lookahead
    ref = NumpyEngine(HuberConfig())
    centred = X - X.mean(axis=0)
    for start in range(0, 700, 100):
        ref.partial_fit(centred[start : start + 100], y[start : start + 100])
    np.testing.assert_allclose(state.coefficients, ref.export_state().coefficients, rtol=1e-12)


def test_feeder_reports_a_load_failure_and_stops():
    from rh_dask.distributed.feeder import ChunkFeeder

    def fail_on_2(block, block_info=None):
        if block_info[0]["chunk-location"][0] == 2:
            raise OSError("gone")
        return block

    X = np.random.default_rng(4).normal(size=(500, 2))
    Xd = da.from_array(X, chunks=(100, 2)).map_blocks(fail_on_2, dtype=X.dtype)
    stream = align_stream(Xd, da.from_array(X[:, 0], 100), None)
    graph = ChunkGraph(stream, assemble_chunk, lambda i: stream.spec(i, "float64", False))
    consumer = OrderedConsumer(lambda: NumpyEngine(HuberConfig()))
    try:
        consumer.begin("s", None)
        feeder = ChunkFeeder(graph, consumer, "s", 2, threads=2, stage=lambda item: item)
        feeder.start()
        _wait(consumer, 5)  # fires at the failure
        feeder.join(30)
        snap = consumer.snapshot()
    finally:
        consumer.close()
    assert snap.consumed == 2 and snap.failure.index == 2
    assert snap.failure.message.startswith("chunk 2 could not be loaded: OSError: gone")


def test_heap_for_chunks_applies_and_restores_on_glibc():
    import platform

    from rh_dask.distributed.memory import heap_for_chunks

    restore = heap_for_chunks()
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        assert restore is None
        return
    assert callable(restore)
    try:
        big = np.ones((400_000, 90))  # 288 MB from the heap while the setting holds
        assert big.sum() == big.size
        del big
    finally:
        restore()
    restore()  # idempotent


# -- the shelf of parked engines and the actor's pinning rule --------------------------------
def _consumer():
    return OrderedConsumer(lambda: NumpyEngine(HuberConfig()))


def test_shelf_parks_takes_replaces_and_expires():
    from rh_dask.distributed import shelf

    key = ("test-shelf", 1)
    first, second = _consumer(), _consumer()
    shelf.park(key, first, 30)
    assert shelf.take(key) is first and shelf.take(key) is None
    shelf.park(key, first, 30)
    shelf.park(key, second, 30)  # replaces (and closes) the one parked before
    assert not first.running and second.running
    assert shelf.take(key) is second
    shelf.park(key, second, 0.05)
    deadline = time.monotonic() + 10
    while second.running and time.monotonic() < deadline:
        time.sleep(0.02)
    assert shelf.take(key) is None and not second.running
    third = _consumer()
    shelf.park(key, third, 0)  # no keep time: closed at once
    assert not third.running and shelf.take(key) is None
    fourth = _consumer()
    shelf.park(key, fourth, 30)
    assert shelf.clear() >= 1 and not fourth.running and shelf.parked() == 0


class _FakePool:
    def __init__(self):
        self.copied = []

    def copy_batch(self, X, y, w, wait=True):
        self.copied.append(X.shape[0])
        return X.copy(), y.copy(), w


@pytest.mark.parametrize("pin_mapped", [False, True])
def test_actor_pins_small_chunks_and_mapped_chunks_of_any_size(tmp_path, pin_mapped):
    from rh_dask.distributed.actor import EngineActor, _mapped
    from rh_dask.settings import Settings

    np.save(tmp_path / "X.npy", np.ones((4_000, 8)))
    mapped = np.load(tmp_path / "X.npy", mmap_mode="r")
    assert _mapped(mapped[1_000:3_000]) and _mapped(np.asarray(mapped[:10]))
    assert not _mapped(np.array(mapped[:10])) and not _mapped(np.ones(3))
    assert not _mapped(pickle.loads(pickle.dumps(mapped[:10])))  # bytes travelled with it

    settings = Settings(pin_max_bytes=10_000, pin_mapped=pin_mapped)
    actor = EngineActor("numpy", HuberConfig(), settings=settings)
    try:
        actor._pool = pool = _FakePool()
        y = np.zeros(2_000)
        small = LoadedChunk(0, np.ones((100, 8)), y[:100], None)  # 6.4 kB
        big = LoadedChunk(1, np.ones((2_000, 8)), y, None)  # 128 kB in memory
        big_mapped = LoadedChunk(2, np.asarray(mapped[:2_000]), y, None)
        out = [actor._pinned(item) for item in (small, big, big_mapped)]
        assert out[1] is big
        assert (out[2] is not big_mapped) == pin_mapped
        assert pool.copied == ([100, 2_000] if pin_mapped else [100])
        np.testing.assert_array_equal(out[2].X, big_mapped.X)
    finally:
        actor.close()


def test_compute_keys_runs_each_task_once_after_its_dependencies():
    from dask.task_spec import Task, TaskRef

    from rh_dask.distributed.local import compute_keys

    calls = []

    def f(name, *args):
        calls.append(name)
        return (name, *args)

    # a diamond (b and c share a) plus a legacy tuple task, two keys requested
    # (names are upper case: a legacy task reads any string equal to a key as that key)
    legacy = {
        "a": (f, "A"),
        "b": (f, "B", "a"),
        "c": (f, "C", "a"),
        "d": (f, "D", "b", "c"),
    }
    values = compute_keys(legacy, ["d", "b"])
    assert values[0] == ("D", ("B", ("A",)), ("C", ("A",)))
    assert values[1] == ("B", ("A",))
    assert sorted(calls) == ["A", "B", "C", "D"]
    assert calls.index("A") < min(calls.index("B"), calls.index("C")) < calls.index("D")
    # new-style tasks give the same values, and the same as Dask's own scheduler
    calls.clear()
    tasks = {
        "a": Task("a", f, "A"),
        "b": Task("b", f, "B", TaskRef("a")),
        "c": Task("c", f, "C", TaskRef("a")),
        "d": Task("d", f, "D", TaskRef("b"), TaskRef("c")),
    }
    assert compute_keys(tasks, ["d", "b"]) == values
    assert len(calls) == 4
    import dask

    assert list(dask.get(legacy, ["d", "b"])) == values


# -- Ctrl-C held back while a walk's bookkeeping changes ------------------------------------
def test_an_interrupt_inside_a_deferred_block_is_raised_once_the_block_is_done():
    import signal

    from rh_dask.distributed.interrupts import interrupts_deferred

    done = []
    # Python's own handler, as in an interactive session (a background job, such
    # as CI under a non-interactive shell, starts with SIGINT ignored).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            with interrupts_deferred():
                signal.raise_signal(signal.SIGINT)  # Ctrl-C between two steps of the block
                done.append("second step")
        assert done == ["second step"]
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        with interrupts_deferred():  # no interrupt: nothing raised
            done.append("again")
        assert done == ["second step", "again"]
    finally:
        signal.signal(signal.SIGINT, previous)


class _Rows:
    """An array-like over rows, as da.from_array wraps a file reader (a small literal)."""

    def __init__(self, n: int, d: int) -> None:
        self.shape, self.dtype, self.ndim = (n, d), np.dtype("float64"), 2

    def __getitem__(self, index):
        rows, cols = index
        return np.arange(self.shape[0] * self.shape[1], dtype="float64").reshape(self.shape)[
            rows, cols
        ]


class _BigRows(_Rows):
    """The same reader, reporting the size of a large in-memory buffer it would hold."""

    def __sizeof__(self) -> int:
        return 10 * SMALL_LITERAL_BYTES


@pytest.mark.parametrize("inline", [False, True])
def test_a_small_literal_is_copied_into_every_chunk_and_a_large_one_is_held(inline):
    # A small literal (a reader object) is copied into each chunk: no chunk then
    # depends on a key one worker holds, which would pin every load to it.
    small = da.from_array(_Rows(40, 3), chunks=(10, 3), inline_array=inline)
    stream = align_stream(small, small[:, 0], None)
    graph = ChunkGraph(stream, assemble_chunk, lambda i: stream.spec(i, "float64", False))
    assert all(graph.shared_needed(i) == [] for i in range(graph.n_chunks))
    assert all(graph.shared_owned(i) == [] for i in range(graph.n_chunks))
    # A literal beyond SMALL_LITERAL_BYTES is held once, never copied per chunk.
    big = _BigRows(40, 3)
    assert sizeof(big) > SMALL_LITERAL_BYTES
    Xb = da.from_array(big, chunks=(10, 3))
    stream = align_stream(Xb, Xb[:, 0], None)
    graph = ChunkGraph(stream, assemble_chunk, lambda i: stream.spec(i, "float64", False))
    assert graph.shared_owned(0) and all(graph.shared_needed(i) for i in range(1, graph.n_chunks))
    with dask.config.set(scheduler="sync"):
        model = RenewableHuberRegressor(progress=False).fit(small, small[:, 0] * 0.5 + 1)
    assert model.n_samples_seen_ == 40
