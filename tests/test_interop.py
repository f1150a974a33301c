"""renewable-huber checkpoints (formats 1 and 2) continue in rh-dask.

Every file is written by renewable-huber itself (its ``save``); format 1,
which renewable-huber 0.7.1 reads but no longer writes, is made from one of
its format-2 files by removing ``weight_sum`` and setting the version, and
checked to be read by renewable-huber as well.
"""

from __future__ import annotations

import io
import json
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
from golden_corpus import TOLERANCES, assert_state_close

from rh_dask import HuberConfig, HuberState, RenewableHuberRegressor
from rh_dask.app.cli import main
from rh_dask.checkpoint import load_checkpoint
from rh_dask.exceptions import CheckpointError

rh = pytest.importorskip("renewable_huber")
rh_config = pytest.importorskip("renewable_huber.config")

N_SAVED, N_MORE, ROWS = 3, 3, 300


def _stream(d: int, *, seed: int, weights: bool, dtype: str) -> list[tuple[Any, Any, Any]]:
    rng = np.random.default_rng(seed)
    coef = rng.normal(size=d)
    coef[: d // 2] = 0.0
    batches = []
    for _ in range(N_SAVED + N_MORE):
        X = rng.normal(size=(ROWS, d)).astype(dtype)
        y = (X @ coef + 0.5 + rng.standard_t(2.5, size=ROWS)).astype(dtype)
        w = rng.integers(0, 4, size=ROWS).astype(dtype) if weights else None
        if w is not None:
            w[0] = 1.0
        batches.append((X, y, w))
    return batches


def _their_state(model: Any) -> HuberState:
    """renewable-huber's state as an rh-dask HuberState (its arrays already intercept last)."""
    s = model.state_dict()
    return HuberState(
        coefficients=np.asarray(s["coefficients"]),
        information=np.asarray(s["information"]),
        n_samples_seen=s["n_samples_seen"],
        batch_count=s["batch_count"],
        previous_lambda=s["previous_lambda"],
        weight_sum=s["weight_sum"],
        n_features_in=s["n_features_in"],
        fit_intercept=s["fit_intercept"],
    )


def _members(path: Path) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    with np.load(path, allow_pickle=False) as npz:
        arrays = {name: npz[name] for name in npz.files}
    return arrays, json.loads(str(arrays.pop("metadata")[()]))


def _rewrite(path: Path, out: Path, edit, arrays_edit=None) -> Path:
    """A copy of renewable-huber's file ``path`` with its metadata (and arrays) edited."""
    arrays, metadata = _members(path)
    edit(metadata)
    if arrays_edit is not None:
        arrays_edit(arrays)
    np.savez_compressed(out, **{"metadata": np.asarray(json.dumps(metadata)), **arrays})
    return out


def _as_format_1(metadata: dict[str, Any]) -> None:
    metadata["format_version"] = 1
    del metadata["weight_sum"]


def _check_continued(ours: RenewableHuberRegressor, theirs: Any, dtype: str, what: str) -> None:
    assert_state_close(ours.state_, _their_state(theirs), dtype, what)
    np.testing.assert_array_equal(ours.coef_.shape, np.asarray(theirs.coef_).shape)


@pytest.mark.parametrize(
    ("penalty", "dtype", "weights", "fit_intercept"),
    [
        ("none", "float64", False, True),
        ("none", "float64", True, True),
        ("l1", "float64", True, True),
        ("none", "float32", False, True),
        ("none", "float64", False, False),
    ],
)
@pytest.mark.parametrize("version", [1, 2])
def test_a_stream_saved_by_renewable_huber_continues_in_rh_dask(
    tmp_path, penalty, dtype, weights, fit_intercept, version
):
    d = 6
    batches = _stream(d, seed=7, weights=weights, dtype=dtype)
    params = {"penalty": penalty, "dtype": dtype, "fit_intercept": fit_intercept, "tau": 1.5}
    theirs = rh.RenewableHuberRegressor(backend="numpy", **params)
    for X, y, w in batches[:N_SAVED]:
        theirs.partial_fit(X, y, sample_weight=w)
    path = theirs.save(tmp_path / "theirs.npz")
    if version == 1:
        path = _rewrite(path, tmp_path / "theirs-v1.npz", _as_format_1)
    # renewable-huber continues its own file: the reference the import must match.
    reference = rh.RenewableHuberRegressor.load(path, backend="numpy")
    if version == 1:
        assert reference.state_dict()["weight_sum"] == N_SAVED * ROWS

    ours = RenewableHuberRegressor.load(path)
    assert ours.engine == "auto"
    assert ours.state_.score_variance is None
    assert ours.dtype == dtype and ours.penalty == penalty and ours.tau == 1.5
    assert_state_close(ours.state_, _their_state(reference), dtype, "as loaded")
    for i, (X, y, w) in enumerate(batches[N_SAVED:]):
        ours.partial_fit(X, y, sample_weight=w)
        reference.partial_fit(X, y, sample_weight=w)
        _check_continued(ours, reference, dtype, f"batch {N_SAVED + i}")
    assert ours.engine_ == "numpy"

    if version == 2 or not weights:
        # rh-dask from the first batch ends at the same stream (a format-1 file of a weighted
        # stream knows only its row count, not its weight). The first batches were solved by
        # two implementations, each stopping within tol of the batch's optimum (the step
        # criterion), so the streams agree to about tol rather than to rounding.
        fresh = RenewableHuberRegressor(engine="numpy", **params)
        for X, y, w in batches:
            fresh.partial_fit(X, y, sample_weight=w)
        got, want = ours.state_.counters(), fresh.state_.counters()
        assert got.pop("previous_lambda") == pytest.approx(want.pop("previous_lambda"), rel=1e-14)
        assert got == want
        rtol, atol = TOLERANCES[dtype]
        bound = 10 * HuberConfig().tol
        np.testing.assert_allclose(
            ours.coef_, fresh.coef_, rtol=max(rtol, bound), atol=max(atol, bound)
        )


def test_format_1_of_a_weighted_stream_continues_with_its_row_count_as_weight(tmp_path):
    batches = _stream(4, seed=3, weights=True, dtype="float64")
    theirs = rh.RenewableHuberRegressor(backend="numpy")
    for X, y, w in batches[:N_SAVED]:
        theirs.partial_fit(X, y, sample_weight=w)
    v2 = theirs.save(tmp_path / "v2.npz")
    v1 = _rewrite(v2, tmp_path / "v1.npz", _as_format_1)
    two, one = RenewableHuberRegressor.load(v2), RenewableHuberRegressor.load(v1)
    assert two.state_.weight_sum == theirs.state_dict()["weight_sum"] != N_SAVED * ROWS
    assert one.state_.weight_sum == N_SAVED * ROWS
    X, y, w = batches[N_SAVED]
    two.partial_fit(X, y, sample_weight=w)
    one.partial_fit(X, y, sample_weight=w)
    assert not np.allclose(one.coef_, two.coef_, rtol=1e-10, atol=0)


def test_feature_names_and_a_converted_file(tmp_path):
    batches = _stream(3, seed=1, weights=False, dtype="float64")
    names = ["alpha", "beta", "gamma"]
    theirs = rh.RenewableHuberRegressor(backend="numpy")
    for X, y, _ in batches[:N_SAVED]:
        theirs.partial_fit(pd.DataFrame(X, columns=names), y)
    path = theirs.save(tmp_path / "named.npz")
    ours = RenewableHuberRegressor.load(path)
    assert list(ours.feature_names_in_) == names
    ckpt = load_checkpoint(path)
    assert ckpt.library_version == "renewable-huber (checkpoint format 2)"
    assert ckpt.engine == "auto"

    # Loading and saving converts: the rh-dask file holds the same stream.
    converted = ours.save(tmp_path / "converted.npz")
    again = RenewableHuberRegressor.load(converted)
    assert again.state_.equals(ours.state_)
    assert list(again.feature_names_in_) == names
    X, y, _ = batches[N_SAVED]
    frame = pd.DataFrame(X, columns=names)
    np.testing.assert_array_equal(again.predict(frame), ours.predict(frame))
    with pytest.raises(ValueError, match="feature names"):
        ours.partial_fit(pd.DataFrame(X, columns=["a", "b", "c"]), y)


def test_rh_dask_info_reads_a_renewable_huber_file(tmp_path, capsys):
    batches = _stream(3, seed=2, weights=False, dtype="float64")
    theirs = rh.RenewableHuberRegressor(backend="numpy")
    for X, y, _ in batches[:N_SAVED]:
        theirs.partial_fit(X, y)
    path = theirs.save(tmp_path / "theirs.npz")
    assert main(["info", str(path), "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["library_version"] == "renewable-huber (checkpoint format 2)"
    assert record["counters"]["batch_count"] == N_SAVED
    assert "score variance" in record["inference"]["unavailable"]


def test_missing_parameters_take_the_defaults_both_libraries_share(tmp_path):
    theirs_defaults = rh_config.EstimatorConfig()
    ours_defaults = HuberConfig()
    for key in ("tau", "penalty", "lambda_scale", "bandwidth_scale", "fit_intercept"):
        assert getattr(theirs_defaults, key) == getattr(ours_defaults, key), key
    for key in ("max_iter", "tol", "ridge", "dtype"):
        assert getattr(theirs_defaults, key) == getattr(ours_defaults, key), key
    path = _fitted_file(tmp_path, tau=2.0, max_iter=50)

    def drop(metadata):
        for key in ("lambda_scale", "bandwidth_scale", "ridge", "n_jobs", "cuda_graphs"):
            del metadata["config"][key]

    model = RenewableHuberRegressor.load(_rewrite(path, tmp_path / "sparse.npz", drop))
    assert (model.tau, model.max_iter, model.ridge) == (2.0, 50, HuberConfig().ridge)


@pytest.mark.parametrize("backend", ["cupy", "native_cuda", "torch", "native_cpu"])
def test_execution_parameters_do_not_travel(tmp_path, backend):
    path = _fitted_file(tmp_path)

    def edit(metadata):
        metadata["config"].update(backend=backend, device="cuda", n_jobs=4, cuda_graphs=True)

    model = RenewableHuberRegressor.load(_rewrite(path, tmp_path / "gpu.npz", edit))
    assert model.engine == "auto" and model.device is None
    np.testing.assert_array_equal(model.coef_, RenewableHuberRegressor.load(path).coef_)


def _fitted_file(tmp_path: Path, **params: Any) -> Path:
    batches = _stream(3, seed=5, weights=False, dtype="float64")
    theirs = rh.RenewableHuberRegressor(backend="numpy", **params)
    for X, y, _ in batches[:2]:
        theirs.partial_fit(X, y)
    return theirs.save(tmp_path / "fitted.npz")


def _set(key, value):
    def edit(metadata):
        metadata[key] = value

    return edit


def _set_config(key, value):
    def edit(metadata):
        metadata["config"][key] = value

    return edit


def _drop(key):
    def edit(metadata):
        del metadata[key]

    return edit


def _array(name, value):
    def edit(arrays):
        arrays[name] = value

    return edit


def _keep(metadata):
    return None


REFUSED = {
    "version 3": (_set("format_version", 3), None, "format version 3"),
    "version true": (_set("format_version", True), None, "format version True"),
    "unknown key": (_set("diagnostics", {}), None, r"does not know: \['diagnostics'\]"),
    "no weight_sum in v2": (_drop("weight_sum"), None, r"lacks \['weight_sum'\]"),
    "no config": (_drop("config"), None, r"lacks \['config'\]"),
    "config not a dict": (_set("config", [1]), None, "config is a JSON list"),
    "fast math": (_set_config("cuda_fast_math", True), None, "cuda_fast_math=True"),
    "unknown parameter": (_set_config("scale", "mad"), None, r"does not know: \['scale'\]"),
    "bad tau": (_set_config("tau", -1.0), None, "tau must be"),
    "bad penalty": (_set_config("penalty", "l2"), None, "penalty must be"),
    "intercept mismatch": (_set_config("fit_intercept", False), None, "fit_intercept"),
    "float counter": (_set("n_samples_seen", 600.0), None, "n_samples_seen is 600.0"),
    "bool count": (_set("batch_count", True), None, "batch_count is True"),
    "negative lambda": (_set("previous_lambda", -0.1), None, "previous_lambda is -0.1"),
    "zero weight": (_set("weight_sum", 0.0), None, "weight_sum is 0"),
    "too many features": (_set("n_features_in", 4), None, "coefficients is a float64 array"),
    "names": (_set("feature_names_in", ["a"]), None, "feature_names_in"),
    "int coefficients": (_keep, _array("coefficients", np.arange(4)), "coefficients is a int64"),
    "nan information": (
        _keep,
        _array("information", np.full((4, 4), np.nan)),
        "information contain non-finite",
    ),
    "metadata not a string": (_keep, _array("metadata", np.zeros(3)), "metadata is a float64"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_a_refused_file_raises_checkpoint_error_naming_it(tmp_path, case):
    edit, arrays_edit, message = REFUSED[case]
    bad = _rewrite(_fitted_file(tmp_path), tmp_path / "bad.npz", edit, arrays_edit)
    with pytest.raises(CheckpointError, match=message) as info:
        RenewableHuberRegressor.load(bad)
    assert str(bad) in str(info.value)
    assert "renewable-huber" in str(info.value)


def test_pickled_and_damaged_members_are_refused_before_loading(tmp_path):
    path = _fitted_file(tmp_path)
    arrays, metadata = _members(path)
    pickled = tmp_path / "pickled.npz"
    objects = np.empty(4, dtype=object)
    objects[:] = [1.0, 2.0, 3.0, 4.0]
    np.savez(
        pickled,
        metadata=np.asarray(json.dumps(metadata)),
        information=arrays["information"],
        coefficients=objects,
    )
    with pytest.raises(CheckpointError, match="pickled data") as info:
        RenewableHuberRegressor.load(pickled)
    assert str(pickled) in str(info.value)

    # Flip bytes inside the compressed coefficients: zlib or the CRC notices.
    raw = bytearray(path.read_bytes())
    with zipfile.ZipFile(io.BytesIO(bytes(raw))) as archive:
        member = archive.getinfo("coefficients.npy")
    start = member.header_offset + 30 + len(member.filename) + len(member.extra)
    for k in range(start + 2, start + min(member.compress_size, 24)):
        raw[k] ^= 0xFF
    damaged = tmp_path / "damaged.npz"
    damaged.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError) as info:
        RenewableHuberRegressor.load(damaged)
    assert str(damaged) in str(info.value)

    truncated = tmp_path / "truncated.npz"
    truncated.write_bytes(path.read_bytes()[:-40])
    with pytest.raises(CheckpointError, match=r"not a readable \.npz") as info:
        RenewableHuberRegressor.load(truncated)
    assert str(truncated) in str(info.value)


def test_a_forged_size_is_refused_before_anything_is_allocated(tmp_path):
    path = _fitted_file(tmp_path)
    arrays, metadata = _members(path)
    forged = tmp_path / "forged.npz"
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        header, {"descr": "<f8", "fortran_order": False, "shape": (10**12,)}
    )
    with zipfile.ZipFile(forged, "w", zipfile.ZIP_STORED) as archive:
        archive.writestr("metadata.npy", _npy(np.asarray(json.dumps(metadata))))
        archive.writestr("information.npy", _npy(arrays["information"]))
        archive.writestr("coefficients.npy", header.getvalue() + b"\0" * 32)
    with pytest.raises(CheckpointError, match="declares a float64 array of shape") as info:
        RenewableHuberRegressor.load(forged)
    assert str(forged) in str(info.value)


def _npy(arr: np.ndarray) -> bytes:
    out = io.BytesIO()
    np.lib.format.write_array(out, arr, allow_pickle=False)
    return out.getvalue()


def test_other_archives_are_still_not_checkpoints(tmp_path):
    path = _fitted_file(tmp_path)
    arrays, metadata = _members(path)
    extra = tmp_path / "extra.npz"
    np.savez(extra, metadata=np.asarray(json.dumps(metadata)), extra=np.zeros(1), **arrays)
    with pytest.raises(CheckpointError, match="not an rh-dask checkpoint") as info:
        RenewableHuberRegressor.load(extra)
    assert str(extra) in str(info.value)
