"""The NumPy engine's fast paths give the plain path's answer.

* Row blocks on any number of threads (``blas-threads`` a count, or ``auto``
  measuring one per batch class): the same one-thread products, summed in
  the same order, so the very same bits.
* The fused LAMM pass (Z streamed once per iteration in row blocks, the
  first two trials together): the contract's decisions in the contract's
  order, so the same iteration counts, and states within its tolerances
  (the gradient's sums are taken block by block).
* LAMM trials that fail on ½ eᵀJe alone skip their Z e: the very same
  decisions, so the very same bits.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
from threadpoolctl import threadpool_info

from rh_dask import HuberConfig, NumpyEngine
from rh_dask.engines import numpy_engine as numpy_engine_module
from rh_dask.engines import row_blocks as row_blocks_module

TOL = {"float64": {"rtol": 1e-8, "atol": 2e-9}, "float32": {"rtol": 3e-4, "atol": 3e-5}}


def _stream(dtype: str, weighted: bool, n: int = 6000, d: int = 12, seed: int = 5):
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((n, d)).astype(dtype)
    beta = np.where(np.arange(d) % 3 == 0, 0.0, np.linspace(-2, 2, d))
    y = (X @ beta + 0.5 + rng.standard_t(2, n)).astype(dtype)
    w = rng.integers(0, 4, n).astype(dtype) if weighted else None
    step = n // 4
    return [
        (X[i : i + step], y[i : i + step], None if w is None else w[i : i + step])
        for i in range(0, n, step)
    ]


def _run(engine: NumpyEngine, batches) -> tuple[list, object]:
    diags = [engine.partial_fit(X, y, w) for X, y, w in batches]
    return diags, engine.export_state()


class _Cycling:
    """A chooser that takes each count in turn (and keeps what it is told)."""

    def __init__(self) -> None:
        self.taken: list[int] = []
        self.records: list[tuple] = []

    def choose(self, key, counts) -> int:
        self.taken.append(counts[len(self.taken) % len(counts)])
        return self.taken[-1]

    def record(self, key, count, seconds) -> None:
        self.records.append((key, count))

    def calibrated(self, key) -> bool:  # so that each batch takes the next count
        return True


def _small_blocks(monkeypatch, cores: int = 4) -> None:
    """Blocks of a few KiB, so that the tests' small batches are cut into many."""
    monkeypatch.setattr(row_blocks_module, "MIN_BLOCK_BYTES", 2048)
    monkeypatch.setattr(row_blocks_module, "usable_cores", lambda: cores)


@pytest.mark.parametrize("penalty", ["none", "l1"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("weighted", [False, True])
def test_any_thread_count_gives_the_same_bits(monkeypatch, penalty, dtype, weighted):
    _small_blocks(monkeypatch)
    config = HuberConfig(penalty=penalty, dtype=dtype)
    batches = _stream(dtype, weighted)
    threads_seen: set[str] = set()
    blas_seen: set[int] = set()
    run_tasks = numpy_engine_module.run_tasks

    def watching(tasks, count):
        def watched(task):
            def run():
                threads_seen.add(threading.current_thread().name)
                blas_seen.update(
                    pool["num_threads"] for pool in threadpool_info() if pool["user_api"] == "blas"
                )
                return task()

            return run

        return run_tasks([watched(task) for task in tasks], count)

    monkeypatch.setattr(numpy_engine_module, "run_tasks", watching)
    one_diags, one = _run(NumpyEngine(config, blas_threads=1), batches)
    assert threads_seen == {threading.current_thread().name}
    for threads in (2, 3, "auto"):
        chooser = _Cycling()
        monkeypatch.setattr(numpy_engine_module, "thread_chooser", lambda c=chooser: c)
        diags, state = _run(NumpyEngine(config, blas_threads=threads), batches)
        assert state.equals(one), threads  # bit for bit, K (None for L1) included
        assert diags == one_diags, threads
        if threads == "auto":
            assert set(chooser.taken) == {1, 2, 4}  # powers of two up to the 4 cores
            grams = [key for key, _ in chooser.records if "gemv" not in key]
            assert len(grams) == len(batches)  # each commit's time
            assert len(chooser.records) > len(grams)  # and each Z v's
    assert any(name.startswith("rh-dask-numpy-rows") for name in threads_seen)
    assert blas_seen == {1}


def test_an_error_in_a_row_block_leaves_the_state_unchanged(monkeypatch):
    _small_blocks(monkeypatch)
    engine = NumpyEngine(HuberConfig(), blas_threads=2)
    (X, y, _), (X2, y2, _) = _stream("float64", False)[:2]
    engine.partial_fit(X, y)
    before = engine.export_state()
    tasks = numpy_engine_module._Batch.score_gram_tasks

    def failing(batch):
        def fail():
            raise FloatingPointError("row block failed")

        return [*tasks(batch), fail]

    monkeypatch.setattr(numpy_engine_module._Batch, "score_gram_tasks", failing)
    with pytest.raises(FloatingPointError, match="row block failed"):
        engine.partial_fit(X2, y2)
    assert engine.export_state().equals(before)
    monkeypatch.setattr(numpy_engine_module._Batch, "score_gram_tasks", tasks)
    engine.partial_fit(X2, y2)
    assert engine.batch_count == 2


def _count_fused_passes(monkeypatch) -> list[int]:
    """Fuse the LAMM trials of every batch size; the list gets each pass's trial count."""
    counts: list[int] = []
    trial_pass = numpy_engine_module._Batch.trial_pass

    def counting(batch, steps):
        counts.append(len(steps))
        return trial_pass(batch, steps)

    monkeypatch.setattr(numpy_engine_module, "FUSED_MIN_BYTES", 0)
    monkeypatch.setattr(numpy_engine_module._Batch, "trial_pass", counting)
    return counts


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("block_bytes", [1 << 10, 384 << 10])
def test_the_fused_lamm_pass_takes_the_plain_paths_steps(
    monkeypatch, dtype, weighted, block_bytes
):
    config = HuberConfig(penalty="l1", dtype=dtype)
    batches = _stream(dtype, weighted, n=20_000, d=30)
    plain_diags, plain = _run(NumpyEngine(config, blas_threads=1), batches)
    fused_batches = _count_fused_passes(monkeypatch)
    monkeypatch.setattr(numpy_engine_module, "FUSED_BLOCK_BYTES", block_bytes)
    fused_diags, fused = _run(NumpyEngine(config, blas_threads=1), batches)
    if dtype == "float32":  # float32 keeps the per-trial products: the same stream, bit for bit
        assert fused_batches == []
        assert fused.equals(plain) and fused_diags == plain_diags
        return
    assert set(fused_batches) == {1, 2}  # both one trial and two trials ahead were taken
    assert [d.iterations for d in fused_diags] == [d.iterations for d in plain_diags]
    assert [d.converged for d in fused_diags] == [d.converged for d in plain_diags]
    assert fused.score_variance is None and plain.score_variance is None  # L1: no K
    for name in ("coefficients", "information"):
        np.testing.assert_allclose(getattr(fused, name), getattr(plain, name), **TOL[dtype])
    for a, b in zip(fused_diags, plain_diags, strict=True):
        np.testing.assert_allclose(a.objective, b.objective, **TOL[dtype])
    assert fused.n_samples_seen == plain.n_samples_seen


def test_the_fused_lamm_pass_is_taken_by_the_shape_at_any_thread_count(monkeypatch):
    """Its blocks run on one thread whatever the count: the same bits at every count."""
    _small_blocks(monkeypatch)
    taken = _count_fused_passes(monkeypatch)
    config = HuberConfig(penalty="l1")
    batches = _stream("float64", False, n=4000, d=12)
    _, plain = _run(NumpyEngine(config, blas_threads=1), batches)
    assert taken
    for threads in (2, 4):
        taken.clear()
        _, state = _run(NumpyEngine(config, blas_threads=threads), batches)
        assert taken
        assert state.equals(plain)


def test_auto_calibrates_each_batch_class_once_on_its_first_batch(monkeypatch):
    """Every count timed on the first batch of a class, forward then back; later batches
    add one sample each; the cost is kept apart."""
    _small_blocks(monkeypatch, cores=4)
    chooser = row_blocks_module.ThreadChooser()
    monkeypatch.setattr(numpy_engine_module, "thread_chooser", lambda: chooser)
    recorded: list[tuple] = []
    record = chooser.record
    monkeypatch.setattr(
        chooser, "record", lambda k, c, s: (recorded.append((k, c)), record(k, c, s))
    )
    engine = NumpyEngine(HuberConfig(), blas_threads="auto")
    batches = _stream("float64", False, n=8000)
    X, y, _ = batches[0]
    engine.partial_fit(X, y)
    rows = X.shape[0].bit_length()
    gram, gemv = ("<f8", 13, True, rows), ("<f8", 13, "gemv", rows)
    assert [c for k, c in recorded if k == gram] == [1, 2, 4, 4, 2, 1]
    # The matrix-vector products: their calibration's rounds, then each Z v of the solve.
    gemv_counts = [c for k, c in recorded if k == gemv]
    rounds = numpy_engine_module.GEMV_CALIBRATION_ROUNDS
    assert gemv_counts[: 6 * rounds] == [1, 2, 4, 4, 2, 1] * rounds
    assert len(gemv_counts) > 6 * rounds and len(set(gemv_counts[6 * rounds :])) == 1
    assert {k for k, _ in recorded} == {gram, gemv}
    costs = chooser.calibration_seconds()
    assert set(costs) == {gram, gemv} and all(cost > 0 for cost in costs.values())
    recorded.clear()
    for X, y, _ in batches[1:]:
        engine.partial_fit(X, y)
    assert len([k for k, _ in recorded if k == gram]) == len(batches) - 1
    assert len([k for k, _ in recorded if k == gemv]) >= len(batches) - 1
    assert chooser.calibration_seconds() == costs  # no class calibrated twice


@pytest.mark.parametrize("penalty", ["none", "l1"])
def test_the_measured_choice_changes_no_bit_of_a_stream(monkeypatch, penalty):
    """The real chooser, switching counts between batches, against one thread alone."""
    _small_blocks(monkeypatch, cores=2)
    chooser = row_blocks_module.ThreadChooser(keep=3, warmup=1, probe_every=2)
    monkeypatch.setattr(numpy_engine_module, "thread_chooser", lambda: chooser)
    config = HuberConfig(penalty=penalty)
    batches = _stream("float64", True, n=8000) * 2
    measured_diags, measured = _run(NumpyEngine(config, blas_threads="auto"), batches)
    medians = list(chooser.medians().values())
    assert medians and all(set(m) == {1, 2} for m in medians)  # both counts were taken
    alone_diags, alone = _run(NumpyEngine(config, blas_threads=1), batches)
    assert measured.equals(alone)
    assert measured_diags == alone_diags


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("fused", [False, True])
def test_trials_failed_on_the_information_skip_their_product_and_change_no_bit(
    monkeypatch, dtype, weighted, fused
):
    config = HuberConfig(penalty="l1", dtype=dtype)
    # Many small batches: J grows against each batch's own curvature, so late
    # batches have trials that the information alone fails.
    batches = _stream(dtype, weighted, n=16_000, d=20)[:1] + _stream(
        dtype, weighted, n=16_000, d=20, seed=6
    )
    batches = [
        (X[i : i + 500], y[i : i + 500], None if w is None else w[i : i + 500])
        for X, y, w in batches
        for i in range(0, len(X), 500)
    ]
    if fused:
        monkeypatch.setattr(numpy_engine_module, "FUSED_MIN_BYTES", 0)
    check = numpy_engine_module._fails_on_information
    calls = {"skipped": 0, "products": 0}

    def counting_check(trial, total):
        failed = check(trial, total)
        calls["skipped"] += failed
        return failed

    remainder = numpy_engine_module._Batch.remainder

    def counting_remainder(batch, zdir, scale):
        calls["products"] += 1
        return remainder(batch, zdir, scale)

    monkeypatch.setattr(numpy_engine_module, "_fails_on_information", counting_check)
    monkeypatch.setattr(numpy_engine_module._Batch, "remainder", counting_remainder)
    skip_diags, skipping = _run(NumpyEngine(config, blas_threads=1), batches)
    with_skips = dict(calls)
    monkeypatch.setattr(numpy_engine_module, "_fails_on_information", lambda trial, total: False)
    calls["products"] = 0
    full_diags, full = _run(NumpyEngine(config, blas_threads=1), batches)
    assert with_skips["skipped"] > 0  # the stream has such trials
    if not fused:  # the fused pass may take a skipped trial's product along with the one before
        assert calls["products"] - with_skips["products"] == with_skips["skipped"]
    assert skipping.equals(full)
    assert skip_diags == full_diags


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_the_huber_remainder_is_never_negative_as_computed(dtype):
    """The skip's premise: R = Σ w [ρ(r − δ) − ρ(r) + ψ(r) δ] ≥ 0 in floating point."""
    from rh_dask.core import batch_schedule
    from rh_dask.state import HuberState

    rng = np.random.default_rng(3)
    n, d = 4000, 3
    config = HuberConfig(penalty="l1", dtype=dtype, tau=0.7)
    state = HuberState.empty(d, True, np.dtype(dtype))
    ws = numpy_engine_module._Workspace(np.dtype(dtype))
    for scale in (1e-30, 1e-6, 1.0, 1e3, 1e20):
        X = rng.standard_normal((n, d)).astype(dtype)
        y = (rng.standard_t(1, n) * rng.choice([1e-3, 1, 1e3], n)).astype(dtype)
        w = rng.choice([0, 0.5, 1, 7], n).astype(dtype)
        schedule = batch_schedule(config, state, float(w.sum()))
        batch = numpy_engine_module._Batch(ws, X, y, w, config, state, schedule)
        batch.evaluate(rng.standard_normal(d + 1).astype(dtype))
        zdir = (rng.standard_normal(n) * scale).astype(dtype)
        assert batch.remainder(zdir, -1.0) >= 0.0
        assert batch.remainder(zdir, 1.0) >= 0.0


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("saving", [0, 10**9])  # always gather the rows with κ > 0, never
def test_both_ways_to_the_gram_give_the_contracts_information(
    monkeypatch, dtype, weighted, saving
):
    from rh_dask.core import batch_schedule
    from rh_dask.state import HuberState

    monkeypatch.setattr(numpy_engine_module, "GATHER_MIN_SAVING", saving)
    monkeypatch.setattr(numpy_engine_module, "GATHER_BLOCK_BYTES", 4096)  # several blocks
    rng = np.random.default_rng(11)
    n, d = 3000, 20
    X = rng.standard_normal((n, d)).astype(dtype)
    y = (rng.standard_t(1.5, n)).astype(dtype)
    w = rng.choice([0, 1, 2.5], n).astype(dtype) if weighted else None
    config = HuberConfig(dtype=dtype)
    state = HuberState.empty(d, True, np.dtype(dtype))
    total = float(n if w is None else w.sum())
    schedule = batch_schedule(config, state, total)
    batch = numpy_engine_module._Batch(
        numpy_engine_module._Workspace(np.dtype(dtype)), X, y, w, config, state, schedule
    )
    beta = rng.standard_normal(d + 1).astype(dtype) * 0.1
    batch.evaluate(beta)
    gram = batch.gram()
    # The contract's Zᵀ diag(w κ(r)) Z in float64, from its piecewise κ.
    Z = np.hstack([X, np.ones((n, 1), dtype)]).astype(np.float64)
    r = y.astype(np.float64) - Z @ beta.astype(np.float64)
    tau, h = config.tau, schedule.bandwidth
    kappa = np.clip(0.5 + (tau - np.abs(r)) / (2 * h), 0, 1)
    assert 0.1 < np.mean(kappa == 0) < 0.9  # both kinds of rows are there
    weight = kappa if w is None else kappa * w
    expected = (Z * weight[:, None]).T @ Z
    scale = np.abs(expected).max()
    np.testing.assert_allclose(gram, expected, rtol=TOL[dtype]["rtol"], atol=1e-6 * scale)


def test_one_thread_keeps_no_second_scaled_buffer(monkeypatch):
    """K's Gram reuses J's scaled Z on one thread; only beside J's on threads has it its own."""
    _small_blocks(monkeypatch)
    batches = _stream("float64", True)
    one = NumpyEngine(HuberConfig(), blas_threads=1)
    _, state_one = _run(one, batches)
    assert one._ws.scaled_k is None
    two = NumpyEngine(HuberConfig(), blas_threads=2)
    _, state_two = _run(two, batches)
    assert two._ws.scaled_k is not None and two._ws.scaled_k.shape == two._ws.scaled.shape
    assert state_one.equals(state_two)
