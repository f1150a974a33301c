"""The renewable score variance K (the sandwich's meat) in the state, the engine and checkpoints.

K_b = K_{b-1} + Zᵀ diag(w ⊙ ψ(r)²) Z at each batch's final β_b (numerical
contract, "Commit"). It is checked against a direct float64 computation, for
exact continuation through checkpoints (bit for bit), against the golden
format-1 files of ``tests/golden`` (written by the format-1 writer: they load
with K None and continue), and for bit identity between a ``partial_fit``
loop, a distributed walk and a resumed stream walk.
"""

from __future__ import annotations

import io
import json
import zipfile
from pathlib import Path

import dask.array as da
import numpy as np
import pandas as pd
import pytest
from threadpoolctl import threadpool_limits

from rh_dask import (
    CheckpointError,
    HuberConfig,
    NumpyEngine,
    RenewableHuberRegressor,
    ValidationError,
)
from rh_dask.checkpoint import (
    Checkpoint,
    checkpoint_bytes,
    checkpoint_from_bytes,
    load_checkpoint,
)
from rh_dask.checkpoint_store import CheckpointStore
from rh_dask.distributed.consumer import STREAM_BLAS_THREADS
from rh_dask.state import HuberState

GOLDEN = Path(__file__).resolve().parent / "golden"
SIZES = [70, 45, 90, 60]


def _direct_increment(X, y, w, beta, tau, fit_intercept) -> np.ndarray:
    """Σ w ψ(r)² z zᵀ in float64, row by row, at ``beta``."""
    X = np.asarray(X, dtype=np.float64)
    Z = np.column_stack([X, np.ones(len(X))]) if fit_intercept else X
    r = np.asarray(y, dtype=np.float64) - Z @ np.asarray(beta, dtype=np.float64)
    psi = np.clip(r, -tau, tau)
    weight = np.ones(len(r)) if w is None else np.asarray(w, dtype=np.float64)
    out = np.zeros((Z.shape[1], Z.shape[1]))
    for z, wi, p in zip(Z, weight, psi, strict=True):
        out += wi * p * p * np.outer(z, z)
    return out


def _batches(stream, dtype):
    out = []
    for X, y, w in stream.batches(SIZES):
        out.append((X.astype(dtype), y.astype(dtype), None if w is None else w.astype(dtype)))
    return out


# -- the engine accumulates K ----------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("weights", [None, "dyadic"])
@pytest.mark.parametrize("fit_intercept", [True, False])
@pytest.mark.parametrize("penalty", ["none", "l1"])
def test_k_is_the_sum_of_weighted_squared_scores_at_each_final_beta(
    make_stream, dtype, weights, fit_intercept, penalty
):
    stream = make_stream(sum(SIZES), 4, seed=7, weights=weights, outlier_fraction=0.1)
    config = HuberConfig(dtype=dtype, fit_intercept=fit_intercept, penalty=penalty)
    engine = NumpyEngine(config)
    p = 4 + int(fit_intercept)
    expected = np.zeros((p, p))
    previous_beta = None
    rtol = 1e-10 if dtype == "float64" else 2e-4
    for X, y, w in _batches(stream, dtype):
        engine.partial_fit(X, y, w)
        state = engine.export_state()
        K = state.score_variance
        if penalty == "l1":  # no inference for L1: the stream keeps no K
            assert K is None
            continue
        assert K.dtype == np.dtype(dtype) and K.shape == (p, p)
        increment = _direct_increment(X, y, w, state.coefficients, config.tau, fit_intercept)
        expected += increment
        scale = np.max(np.abs(expected))
        np.testing.assert_allclose(K, expected, rtol=rtol, atol=rtol * scale)
        np.testing.assert_array_equal(K, K.T)
        assert np.all(np.linalg.eigvalsh(K.astype(np.float64)) > -rtol * scale)
        # ψ² is not the curvature κ: K and J differ (outliers have κ = 0 but ψ² = τ²).
        assert not np.allclose(K, state.information, rtol=1e-3)
        if previous_beta is not None:
            # At the previous batch's β the increment would differ: K is taken at β_b.
            stale = _direct_increment(X, y, w, previous_beta, config.tau, fit_intercept)
            assert not np.allclose(stale, increment, rtol=1e-6)
        previous_beta = state.coefficients


def test_zero_weight_rows_add_nothing_to_k(make_stream):
    stream = make_stream(120, 3, seed=2)
    w = np.ones(120)
    w[::3] = 0.0
    with_zeros = NumpyEngine(HuberConfig())
    with_zeros.partial_fit(stream.X, stream.y, w)
    beta = with_zeros.export_state().coefficients
    kept = w > 0
    direct = _direct_increment(stream.X[kept], stream.y[kept], None, beta, 1.345, True)
    np.testing.assert_allclose(with_zeros.export_state().score_variance, direct, rtol=1e-12)


def test_empty_and_reset_give_zeros(make_stream):
    for dtype in ("float64", "float32"):
        empty = HuberState.empty(3, True, dtype)
        assert empty.score_variance.dtype == np.dtype(dtype)
        np.testing.assert_array_equal(empty.score_variance, np.zeros((4, 4)))
    stream = make_stream(150, 3, seed=4)
    engine, fresh = NumpyEngine(HuberConfig()), NumpyEngine(HuberConfig())
    engine.partial_fit(stream.X[:100], stream.y[:100])
    engine.reset()
    engine.partial_fit(stream.X[100:], stream.y[100:])
    fresh.partial_fit(stream.X[100:], stream.y[100:])
    assert engine.export_state().equals(fresh.export_state())
    assert engine.export_state().score_variance.tobytes() == (
        fresh.export_state().score_variance.tobytes()
    )


def test_a_state_without_k_continues_without_it_and_k_never_moves_the_fit(make_stream):
    stream = make_stream(sum(SIZES), 4, seed=9, weights="uniform")
    batches = stream.batches(SIZES)
    with_k, without_k = NumpyEngine(HuberConfig()), NumpyEngine(HuberConfig())
    with_k.partial_fit(*batches[0])
    old = with_k.export_state()
    old.score_variance = None
    without_k.import_state(old)
    for batch in batches[1:]:
        a, b = with_k.partial_fit(*batch), without_k.partial_fit(*batch)
        assert a == b
        sa, sb = with_k.export_state(), without_k.export_state()
        assert sb.score_variance is None and sa.score_variance is not None
        assert sa.coefficients.tobytes() == sb.coefficients.tobytes()
        assert sa.information.tobytes() == sb.information.tobytes()
        assert sa.counters() == sb.counters()


# -- the state's handling of K ----------------------------------------------------------------


def _fitted_state(make_stream, dtype="float64") -> HuberState:
    stream = make_stream(200, 3, seed=5)
    engine = NumpyEngine(HuberConfig(dtype=dtype))
    engine.partial_fit(stream.X.astype(dtype), stream.y.astype(dtype))
    return engine.export_state()


def test_copy_astype_and_equals_handle_k(make_stream):
    state = _fitted_state(make_stream)
    copy = state.copy()
    assert copy.equals(state)
    assert copy.score_variance is not state.score_variance
    copy.score_variance[0, 0] = np.nextafter(copy.score_variance[0, 0], np.inf)
    assert not copy.equals(state) and not state.equals(copy)
    low = state.astype("float32")
    assert low.score_variance.dtype == np.float32
    assert state.score_variance.dtype == np.float64
    none = state.copy()
    none.score_variance = None
    assert none.copy().score_variance is None and none.astype("float32").score_variance is None
    assert none.equals(none.copy())
    assert not none.equals(state) and not state.equals(none)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda s: np.zeros((3, 3)), r"score_variance has shape \(3, 3\), expected \(4, 4\)"),
        (lambda s: s.score_variance.astype(np.float32), "score_variance dtype float32 differs"),
        (lambda s: np.full((4, 4), np.nan), "score_variance contain non-finite values"),
        (lambda s: s.score_variance.astype(np.int64), "score_variance must be floating point"),
    ],
    ids=["shape", "dtype", "nan", "int"],
)
def test_a_malformed_k_is_refused_and_the_engine_keeps_its_state(make_stream, edit, message):
    state = _fitted_state(make_stream)
    bad = state.copy()
    bad.score_variance = edit(state)
    with pytest.raises(ValidationError, match=message):
        bad.validate()
    engine = NumpyEngine(HuberConfig())
    engine.import_state(state)
    with pytest.raises(ValidationError, match=message):
        engine.import_state(bad)
    assert engine.export_state().equals(state)


# -- checkpoints -------------------------------------------------------------------------------


def _members(data: bytes) -> tuple[dict, dict[str, np.ndarray]]:
    with np.load(io.BytesIO(data), allow_pickle=False) as npz:
        arrays = {name: npz[name] for name in npz.files}
    return json.loads(str(arrays.pop("metadata")[()])), arrays


def _pack(record: dict, arrays: dict[str, np.ndarray]) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, metadata=np.asarray(json.dumps(record, sort_keys=True)), **arrays)
    return buffer.getvalue()


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_save_load_continue_keeps_k_bit_for_bit(make_stream, tmp_path, dtype):
    stream = make_stream(sum(SIZES), 4, seed=11, weights="uniform", outlier_fraction=0.05)
    batches = _batches(stream, dtype)
    straight = RenewableHuberRegressor(dtype=dtype)
    interrupted = RenewableHuberRegressor(dtype=dtype)
    for batch in batches[:2]:
        straight.partial_fit(*batch)
        interrupted.partial_fit(*batch)
    path = interrupted.save(tmp_path / "model.npz")
    with zipfile.ZipFile(path) as archive:
        assert "score_variance.npy" in archive.namelist()
    resumed = RenewableHuberRegressor.load(path)
    assert resumed.state_.score_variance.dtype == np.dtype(dtype)
    assert resumed.state_.score_variance.tobytes() == straight.state_.score_variance.tobytes()
    for batch in batches[2:]:
        straight.partial_fit(*batch)
        resumed.partial_fit(*batch)
        assert resumed.state_.equals(straight.state_)
        assert resumed.state_.score_variance.tobytes() == (
            straight.state_.score_variance.tobytes()
        )


def test_a_state_without_k_is_written_without_the_member(make_stream):
    state = _fitted_state(make_stream)
    state.score_variance = None
    data = checkpoint_bytes(Checkpoint(HuberConfig(), state, None, "gpu"))
    record, arrays = _members(data)
    assert record["format_version"] == 3 and "score_variance" not in arrays
    back = checkpoint_from_bytes(data, "no-k")
    assert back.state.score_variance is None and back.state.equals(state)


def _with_k(make_stream) -> bytes:
    return checkpoint_bytes(Checkpoint(HuberConfig(), _fitted_state(make_stream), None, "numpy"))


def test_an_altered_or_removed_k_fails_the_integrity_check(make_stream):
    record, arrays = _members(_with_k(make_stream))
    altered = dict(arrays, score_variance=arrays["score_variance"] * 2)
    with pytest.raises(CheckpointError, match="failed its integrity check"):
        checkpoint_from_bytes(_pack(record, altered), "altered")
    removed = {k: v for k, v in arrays.items() if k != "score_variance"}
    with pytest.raises(CheckpointError, match="failed its integrity check"):
        checkpoint_from_bytes(_pack(record, removed), "removed")


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda r, a: a.__setitem__("score_variance", a["score_variance"].astype(np.float32)),
            r"score_variance is a float32 array of shape \(4, 4\), the metadata says float64",
        ),
        (
            lambda r, a: a.__setitem__("score_variance", np.zeros((4, 3))),
            r"score_variance is a float64 array of shape \(4, 3\)",
        ),
        (
            lambda r, a: r.__setitem__("format_version", 1),
            "a format version 1 checkpoint has no score_variance member",
        ),
        (
            lambda r, a: a.__setitem__("score_variance", np.full((4, 4), np.inf)),
            "score_variance contain non-finite values",
        ),
    ],
    ids=["dtype", "shape", "in_version_1", "non_finite"],
)
def test_an_inconsistent_k_member_is_refused(make_stream, edit, message):
    record, arrays = _members(_with_k(make_stream))
    record.pop("digest")
    edit(record, arrays)
    # A correct digest: only the consistency checks can refuse it.
    from rh_dask.checkpoint import _digest

    record["digest"] = _digest(arrays, record)
    with pytest.raises(CheckpointError, match=message):
        checkpoint_from_bytes(_pack(record, arrays), "edited")


# -- format version 1 --------------------------------------------------------------------------


def _v1_batches():
    """The batches of ``tests/golden/checkpoint_v1.npz`` (the first two were fitted)."""
    rng = np.random.default_rng(1515)
    out = []
    for n in (64, 48, 80):
        X = rng.integers(-512, 513, size=(n, 3)) / 256.0
        noise = rng.integers(-256, 257, size=n) / 256.0
        y = X @ np.array([1.5, -0.75, 0.25]) + 0.5 + noise
        y[::16] += 12.0
        w = rng.integers(1, 13, size=n) / 4.0
        out.append((pd.DataFrame(X, columns=["a", "b", "c"]), y, w))
    return out


def test_a_version_1_model_loads_without_k_and_continues(tmp_path):
    path = GOLDEN / "checkpoint_v1.npz"
    record, arrays = _members(path.read_bytes())
    assert record["format_version"] == 1 and "score_variance" not in arrays
    old = RenewableHuberRegressor.load(path)
    assert old.state_.score_variance is None and old.state_.batch_count == 2
    assert list(old.feature_names_in_) == ["a", "b", "c"]
    batches = _v1_batches()
    fresh = RenewableHuberRegressor()
    for X, y, w in batches[:2]:
        fresh.partial_fit(X, y, sample_weight=w)
    # Another BLAS rounds differently: the file is compared to the contract's float64 bar.
    np.testing.assert_allclose(old.state_.coefficients, fresh.state_.coefficients, rtol=1e-8)
    np.testing.assert_allclose(old.state_.information, fresh.state_.information, rtol=1e-8)
    X, y, w = batches[2]
    old.partial_fit(X, y, sample_weight=w)
    fresh.partial_fit(X, y, sample_weight=w)
    assert old.state_.score_variance is None and old.state_.batch_count == 3
    np.testing.assert_allclose(old.state_.coefficients, fresh.state_.coefficients, rtol=1e-8)
    # Written again, it is a current-version file without K, and stays without K.
    again = old.save(tmp_path / "continued.npz")
    record, arrays = _members(again.read_bytes())
    assert record["format_version"] == 3 and "score_variance" not in arrays
    back = RenewableHuberRegressor.load(again)
    assert back.state_.score_variance is None and back.state_.equals(old.state_)


def test_a_version_1_walk_checkpoint_loads_without_k():
    ckpt = load_checkpoint(GOLDEN / "walk_checkpoint_v1.npz")
    assert ckpt.state.score_variance is None
    assert ckpt.walk.next_chunk == 2 and len(ckpt.records) == 2
    np.testing.assert_array_equal(ckpt.records[-1].coefficients, ckpt.state.coefficients)


# -- the distributed walk and a resumed stream ---------------------------------------------------


def _loop(X, y, w, chunk_rows, **params) -> RenewableHuberRegressor:
    """A partial_fit loop over the chunks, under the stream's BLAS pin."""
    model = RenewableHuberRegressor(progress=False, **params)
    with threadpool_limits(limits=STREAM_BLAS_THREADS, user_api="blas"):
        for start in range(0, len(y), chunk_rows):
            rows = slice(start, start + chunk_rows)
            model.partial_fit(X[rows], y[rows], sample_weight=None if w is None else w[rows])
    return model


def _data(n=2_400, d=4, seed=15):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, d))
    y = X @ rng.normal(size=d) + 0.5 + rng.standard_t(2, size=n)
    return X, y, rng.uniform(0.2, 3.0, size=n)


@pytest.fixture(scope="module")
def threaded_client():
    from distributed import Client, LocalCluster

    with (
        LocalCluster(
            n_workers=1, threads_per_worker=2, processes=False, dashboard_address=":0"
        ) as lc,
        Client(lc, set_as_default=False) as c,
    ):
        yield c


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_the_distributed_walk_gives_the_loops_k_bit_for_bit(threaded_client, dtype):
    X, y, w = _data()
    X, y, w = X.astype(dtype), y.astype(dtype), w.astype(dtype)
    with threaded_client.as_current():
        model = RenewableHuberRegressor(dtype=dtype, progress=False)
        model.fit(da.from_array(X, chunks=(400, 4)), da.from_array(y, chunks=400),
                  sample_weight=da.from_array(w, chunks=400))  # fmt: skip
    assert model.placement_["worker"].startswith("inproc://")  # walked on the cluster
    ref = _loop(X, y, w, 400, dtype=dtype)
    assert model.state_.equals(ref.state_)
    K = model.state_.score_variance
    assert K.dtype == np.dtype(dtype) and K.tobytes() == ref.state_.score_variance.tobytes()


def _fail_once(block, marker, at, block_info=None):
    """Fail the load of chunk ``at`` the first time only (the marker file remembers)."""
    if block_info[0]["chunk-location"][0] == at and not Path(marker).exists():
        Path(marker).touch()
        raise OSError("the disk went away")
    return block


def test_a_resumed_stream_gives_the_loops_k_bit_for_bit(tmp_path):
    X, y, _ = _data(n=1_200, seed=16)
    marker, directory = str(tmp_path / "failed"), tmp_path / "ckpt"

    def collection():
        Xd = da.from_array(X, chunks=(100, 4)).map_blocks(
            _fail_once, marker=marker, at=7, dtype=X.dtype
        )
        return Xd, da.from_array(y, chunks=100)

    params = dict(checkpoint_dir=directory, checkpoint_every=2, max_retries=0, progress=False)
    with pytest.raises(Exception, match="the disk went away"):
        RenewableHuberRegressor(**params).fit(*collection())
    kept = CheckpointStore(directory).read()
    assert 0 < kept.walk.next_chunk <= 7
    partial = _loop(X[: 100 * kept.walk.next_chunk], y[: 100 * kept.walk.next_chunk], None, 100)
    assert kept.state.score_variance.tobytes() == partial.state_.score_variance.tobytes()
    resumed = RenewableHuberRegressor(**params).fit(*collection(), resume_from=directory)
    assert list(resumed.recoveries_["kind"]) == ["resume"]
    assert resumed.recoveries_["from_chunk"].iloc[0] == kept.walk.next_chunk
    ref = _loop(X, y, None, 100)
    assert resumed.state_.equals(ref.state_)
    assert resumed.state_.score_variance.tobytes() == ref.state_.score_variance.tobytes()
    assert CheckpointStore(directory).read().state.equals(ref.state_)
