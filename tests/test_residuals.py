"""Robust per-batch diagnostics: the formulas, the NumPy engine, history_ and checkpoints."""

from __future__ import annotations

import io
import json
import math

import numpy as np
import pytest

from rh_dask import CheckpointError, HuberConfig, NumpyEngine, RenewableHuberRegressor
from rh_dask import checkpoint as ckpt_module
from rh_dask.checkpoint import Checkpoint, WalkPosition, checkpoint_bytes, checkpoint_from_bytes
from rh_dask.residuals import MAD_CONSISTENCY, outlier_share, residual_scale, weighted_median
from rh_dask.state import OPTIONAL_DIAGNOSTICS, BatchDiagnostics
from rh_dask.stream import BatchRecord, history_frame


def test_weighted_median_is_the_median_of_the_repeated_rows():
    rng = np.random.default_rng(0)
    for n in (1, 2, 7, 10, 51):
        values = rng.normal(size=n)
        counts = rng.integers(0, 4, size=n)
        counts[0] = max(counts[0], 1)
        repeated = np.repeat(values, counts)
        assert weighted_median(values, counts.astype(float)) == np.median(repeated)
        assert weighted_median(values) == np.median(values)
        assert weighted_median(values, np.ones(n)) == np.median(values)
        mad = np.median(np.abs(repeated - np.median(repeated)))
        assert residual_scale(values, counts.astype(float)) == pytest.approx(
            MAD_CONSISTENCY * mad, rel=1e-15, abs=1e-300
        )


def test_a_hand_computed_batch():
    r = np.array([-3.0, -1.0, 0.0, 0.5, 1.0, 2.0, 10.0])
    # |r| > 1.345: -3, 2, 10.
    assert outlier_share(r, 1.345) == pytest.approx(3 / 7)
    # median 0.5; |r - 0.5| = 3.5, 1.5, 0.5, 0, 0.5, 1.5, 9.5; its median 1.5.
    assert residual_scale(r) == pytest.approx(MAD_CONSISTENCY * 1.5)
    w = np.array([1.0, 0.0, 2.0, 1.0, 1.0, 0.0, 1.0])
    # Weight on beyond-τ rows: 1 (-3) + 0 (2) + 1 (10) of 6.
    assert outlier_share(r, 1.345, w) == pytest.approx(2 / 6)
    # Rows repeated by weight: -3, 0, 0, 0.5, 1, 10: median 0.25; deviations
    # 3.25, 0.25, 0.25, 0.25, 0.75, 9.75: median 0.5.
    assert residual_scale(r, w) == pytest.approx(MAD_CONSISTENCY * 0.5)
    assert residual_scale(np.zeros(5)) == 0.0


def test_the_scale_estimates_sigma_and_ignores_gross_outliers():
    rng = np.random.default_rng(1)
    r = 2.0 * rng.standard_normal(200_000)
    assert residual_scale(r) == pytest.approx(2.0, rel=0.01)
    r[:20_000] = 1e6  # 10% gross outliers
    assert residual_scale(r) == pytest.approx(2.0 * 1.16, rel=0.05)
    assert outlier_share(r, 1e5) == pytest.approx(0.1)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("penalty", ["none", "l1"])
def test_the_engine_reports_them_at_the_batch_estimate(make_stream, dtype, weighted, penalty):
    s = make_stream(600, 4, seed=3, outlier_fraction=0.1, weights="uniform" if weighted else None)
    config = HuberConfig(dtype=dtype, penalty=penalty, tau=1.0)
    engine = NumpyEngine(config)
    for rows in (slice(0, 300), slice(300, 600)):
        X, y = s.X[rows].astype(dtype), s.y[rows].astype(dtype)
        w = None if s.sample_weight is None else s.sample_weight[rows].astype(dtype)
        diag = engine.partial_fit(X, y, w)
        beta = engine.coefficients().astype(np.float64)
        r = y.astype(np.float64) - (X.astype(np.float64) @ beta[:-1] + beta[-1])
        weights = np.ones(len(r)) if w is None else w.astype(np.float64)
        psi = np.clip(r, -1.0, 1.0)
        loss = np.sum(weights * psi * (r - psi / 2)) / weights.sum()
        share = weights[np.abs(r) > 1.0].sum() / weights.sum()
        tol = 1e-9 if dtype == "float64" else 2e-4
        assert diag.mean_loss == pytest.approx(loss, rel=tol)
        # float32 residuals may sit on the other side of τ for a row at most.
        assert diag.outlier_share == pytest.approx(share, abs=tol + 1.01 / len(r))
        assert diag.residual_scale == pytest.approx(
            residual_scale(r, None if w is None else weights), rel=tol, abs=tol
        )
        assert 0 < diag.outlier_share < 1 and diag.residual_scale > 0


def test_history_has_them_and_nan_where_an_engine_did_not_report(make_stream):
    s = make_stream(400, 3, seed=4)
    model = RenewableHuberRegressor(progress=False)
    model.partial_fit(s.X[:200], s.y[:200])
    model.partial_fit(s.X[200:], s.y[200:])
    history = model.history_
    assert list(history.columns[-3:]) == list(OPTIONAL_DIAGNOSTICS)
    last = model.diagnostics_
    assert history["outlier_share"].iloc[-1] == last.outlier_share
    assert history["residual_scale"].iloc[-1] == last.residual_scale
    assert history["mean_loss"].iloc[-1] == last.mean_loss
    plain = BatchDiagnostics(3, True, 0.5, 0.0, 0.1)  # an engine without them
    record = BatchRecord(0, 0, 10, plain, 0.01, np.zeros(4))
    frame = history_frame([record])
    assert frame[list(OPTIONAL_DIAGNOSTICS)].isna().all().all()


def _walk(make_stream, diagnostics_of=lambda d: d):
    s = make_stream(300, 3, seed=6)
    engine = NumpyEngine(HuberConfig())
    records = []
    for i in range(3):
        rows = slice(100 * i, 100 * (i + 1))
        diag = diagnostics_of(engine.partial_fit(s.X[rows], s.y[rows]))
        records.append(BatchRecord(i, i, 100, diag, 0.01, engine.coefficients()))
    walk = WalkPosition(next_chunk=3, n_chunks=3, n_empty=0, fingerprint={"token": "t"})
    return Checkpoint(
        HuberConfig(), engine.export_state(), None, "numpy", walk=walk, records=tuple(records)
    )


def test_a_walk_checkpoint_keeps_them_and_none_stays_none(make_stream):
    ckpt = _walk(make_stream)
    back = checkpoint_from_bytes(checkpoint_bytes(ckpt), "walk")
    assert [r.diagnostics for r in back.records] == [r.diagnostics for r in ckpt.records]
    assert back.records[0].diagnostics.residual_scale > 0
    # A record whose engine reported none of them keeps None, not zeros.
    strip = lambda d: BatchDiagnostics(  # noqa: E731
        d.iterations, d.converged, d.objective, d.lambda_value, d.bandwidth
    )
    plain = _walk(make_stream, strip)
    back = checkpoint_from_bytes(checkpoint_bytes(plain), "plain")
    assert all(
        getattr(r.diagnostics, n) is None for r in back.records for n in OPTIONAL_DIAGNOSTICS
    )


def _members(data: bytes) -> tuple[dict, dict[str, np.ndarray]]:
    with np.load(io.BytesIO(data), allow_pickle=False) as npz:
        arrays = {name: npz[name] for name in npz.files}
    record = json.loads(str(arrays.pop("metadata")[()]))
    record.pop("digest")
    return record, arrays


def _pack(record: dict, arrays: dict[str, np.ndarray]) -> bytes:
    record = dict(record, digest=ckpt_module._digest(arrays, record))
    buffer = io.BytesIO()
    np.savez(buffer, metadata=np.asarray(json.dumps(record, sort_keys=True)), **arrays)
    return buffer.getvalue()


def test_a_version_2_walk_checkpoint_reads_them_as_none(make_stream):
    record, arrays = _members(checkpoint_bytes(_walk(make_stream)))
    del arrays["diagnostics_history"]
    record["format_version"] = 2
    back = checkpoint_from_bytes(_pack(record, arrays), "v2")
    assert len(back.records) == 3
    assert all(
        getattr(r.diagnostics, n) is None for r in back.records for n in OPTIONAL_DIAGNOSTICS
    )
    # The same file claiming version 3 lacks the member.
    record["format_version"] = 3
    with pytest.raises(CheckpointError, match="walk checkpoint needs a diagnostics_history"):
        checkpoint_from_bytes(_pack(record, arrays), "v3")


def test_a_negative_or_misshapen_diagnostic_is_refused(make_stream):
    record, arrays = _members(checkpoint_bytes(_walk(make_stream)))
    bad = arrays["diagnostics_history"].copy()
    bad[1, 2] = -1.0
    with pytest.raises(CheckpointError, match=r"record 1: residual_scale is -1\.0, need >= 0"):
        checkpoint_from_bytes(_pack(record, {**arrays, "diagnostics_history": bad}), "neg")
    short = arrays["diagnostics_history"][:, :2].copy()
    with pytest.raises(CheckpointError, match="diagnostics_history is a float64 array of shape"):
        checkpoint_from_bytes(_pack(record, {**arrays, "diagnostics_history": short}), "short")
    assert math.isfinite(float(arrays["diagnostics_history"].sum()))


def test_the_digest_covers_them(make_stream):
    data = checkpoint_bytes(_walk(make_stream))
    with np.load(io.BytesIO(data), allow_pickle=False) as npz:
        arrays = {name: npz[name] for name in npz.files}
    arrays["diagnostics_history"] = arrays["diagnostics_history"] * 2
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    with pytest.raises(CheckpointError, match="failed its integrity check"):
        checkpoint_from_bytes(buffer.getvalue(), "altered")
