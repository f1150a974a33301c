"""The model's stream object (rh_dask.stream): one object, one record type, one reset."""

from __future__ import annotations

import ast
import pickle
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from rh_dask import (
    HuberConfig,
    NotFittedError,
    NumpyEngine,
    RenewableHuberRegressor,
    ValidationError,
)
from rh_dask.stream import HISTORY_COLUMNS, BatchRecord, Stream, history_frame

PARAMS = sorted(RenewableHuberRegressor().get_params())


def test_a_fitted_model_keeps_its_whole_stream_in_one_attribute(make_stream):
    s = make_stream(300, 3, seed=41)
    model = RenewableHuberRegressor()
    assert sorted(vars(model)) == PARAMS
    for batch in s.batches([100, 100, 100]):
        model.partial_fit(*batch)
    assert sorted(vars(model)) == sorted([*PARAMS, "_stream"])
    stream = model._stream
    assert isinstance(stream, Stream) and stream.started
    assert all(isinstance(r, BatchRecord) for r in stream.records)
    assert [r.batch for r in stream.records] == [0, 1, 2]
    assert model.state_.equals(stream.state())


def test_reset_replaces_the_stream_and_keeps_its_engine_for_the_next_one(make_stream):
    s = make_stream(200, 3, seed=42)
    model = RenewableHuberRegressor().fit(s.X, s.y)
    engine = model._stream.engine
    model.reset()
    assert sorted(vars(model)) == sorted([*PARAMS, "_stream"])
    assert not model._stream.started and model._stream.engine is engine
    assert engine.n_features_in is None  # the engine was reset with the stream
    with pytest.raises(NotFittedError):
        model.n_features_in_
    model.partial_fit(s.X, s.y)
    assert model._stream.engine is engine  # same configuration: the engine is reused
    reference = NumpyEngine(HuberConfig())
    reference.partial_fit(s.X, s.y)
    assert model.state_.equals(reference.export_state())


def test_history_has_the_documented_columns_and_dtypes_in_memory_and_on_dask(make_stream):
    import dask.array as da

    s = make_stream(400, 3, seed=43)
    model = RenewableHuberRegressor(progress=False)
    model.partial_fit(s.X[:100], s.y[:100])
    X = da.from_array(s.X[100:], chunks=(100, 3))
    y = da.from_array(s.y[100:], chunks=100)
    model.partial_fit(X, y)
    history = model.history_
    assert tuple(history.columns) == HISTORY_COLUMNS
    assert [str(t) for t in history.dtypes] == [
        "int64",
        "int64",
        "int64",
        "int64",
        "bool",
        "float64",
        "float64",
        "float64",
        "float64",
        "float64",
        "float64",
    ]
    # The NumPy engine reports the optional diagnostics, in memory and on Dask.
    assert history[["mean_loss", "outlier_share", "residual_scale"]].notna().all().all()
    assert history["batch"].tolist() == [0, 1, 2, 3]
    assert history["chunk"].tolist() == [0, 0, 1, 2]  # chunk index within each call
    assert history["rows"].tolist() == [100] * 4
    records = model._stream.records
    pd.testing.assert_frame_equal(history, history_frame(records))
    np.testing.assert_array_equal(model.coef_history_, np.stack([r.coefficients for r in records]))
    assert model.diagnostics_ == records[-1].diagnostics
    assert model.n_iter_ == records[-1].diagnostics.iterations


def test_a_stream_driven_directly_consumes_or_changes_nothing(make_stream):
    s = make_stream(200, 3, seed=44)
    stream = Stream(HuberConfig(), "numpy")
    X = s.X[:100].astype(np.float32)  # the float64 engine refuses it
    with pytest.raises(ValidationError, match="dtype"):
        stream.consume(X, s.y[:100])
    assert not stream.started and stream.engine is None and stream.records == ()
    record = stream.consume(s.X[:100], s.y[:100], chunk=7, wait_seconds=0.5)
    assert stream.started and stream.n_features == 3 and stream.records == (record,)
    assert (record.batch, record.chunk, record.rows, record.wait_seconds) == (0, 7, 100, 0.5)
    assert record.coefficients.dtype == np.float64
    assert stream.placement is None and stream.n_empty == 0
    stream.count_empty(2)
    assert stream.n_empty == 2


def test_a_stream_adopts_a_remote_state_with_its_records(make_stream):
    s = make_stream(200, 3, seed=45, weights="uniform")
    remote = Stream(HuberConfig(dtype="float32"), "numpy")
    for X, y, w in s.batches([100, 100]):
        remote.consume(X.astype(np.float32), y.astype(np.float32), w.astype(np.float32))
    local = Stream(HuberConfig(dtype="float32"), "numpy")
    records = [
        BatchRecord(
            r.batch, r.chunk, r.rows, r.diagnostics, r.seconds, r.coefficients.astype(np.float32)
        )
        for r in remote.records
    ]
    local.adopt(remote.state(), [], placement={"worker": "nowhere"})
    assert not local.started  # nothing to adopt without records
    local.adopt(remote.state(), records, placement={"worker": "tcp://w:1"})
    assert local.started and local.engine is None  # the state waits for an engine
    assert local.state().equals(remote.state())
    assert [r.coefficients.dtype for r in local.records] == [np.float64, np.float64]
    placement = local.placement
    placement["worker"] = "changed"
    assert local.placement == {"worker": "tcp://w:1"}  # a copy
    local.consume(s.X[:50].astype(np.float32), s.y[:50].astype(np.float32))
    assert local.engine is not None and local.records[-1].batch == 2


def test_a_pickled_model_carries_its_stream_without_an_engine(make_stream):
    s = make_stream(300, 3, seed=46)
    model = RenewableHuberRegressor()
    for batch in s.batches([100, 100, 100])[:2]:
        model.partial_fit(*batch)
    clone = pickle.loads(pickle.dumps(model))
    assert clone._stream.engine is None and model._stream.engine is not None
    assert clone.state_.equals(model.state_)
    X, y, w = s.batches([100, 100, 100])[2]
    clone.partial_fit(X, y, w)
    model.partial_fit(X, y, w)
    assert clone.state_.equals(model.state_)
    pd.testing.assert_frame_equal(
        clone.history_.drop(columns="seconds"), model.history_.drop(columns="seconds")
    )


def _imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            base = "." * node.level + (node.module or "")
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def test_the_distributed_walk_never_imports_the_estimator():
    import rh_dask.distributed

    folder = Path(rh_dask.distributed.__file__).parent
    files = sorted(folder.glob("*.py"))
    assert len(files) > 5
    for path in files:
        for name in _imported_modules(path):
            assert not name.endswith("estimator") and ".estimator." not in name, (path, name)
    stream_imports = _imported_modules(folder.parent / "stream.py")
    assert not any("distributed" in n or "estimator" in n for n in stream_imports)
