"""Portable checkpoints (issue item 6): exact continuation, and refusal of bad files."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from devices import gpu_usable

from rh_dask import (
    CheckpointError,
    EngineUnavailableError,
    HuberConfig,
    NotFittedError,
    NumpyEngine,
    RenewableHuberRegressor,
)
from rh_dask.checkpoint import Checkpoint, load_checkpoint, save_checkpoint

SIZES = [90, 60, 110, 70, 50]
SPLIT = 3  # batches consumed before the checkpoint


@pytest.fixture
def stream(make_stream):
    return make_stream(sum(SIZES), 5, seed=21, weights="uniform", outlier_fraction=0.05)


@pytest.fixture
def saved(stream, tmp_path):
    """A checkpoint of a float64 model after SPLIT batches, and the model."""
    model = RenewableHuberRegressor()
    for batch in stream.batches(SIZES)[:SPLIT]:
        model.partial_fit(*batch)
    return model.save(tmp_path / "model.npz"), model


def _rewrite(path: Path, out: Path, edit) -> Path:
    """Copy an .npz archive through ``edit(record, arrays)``, as a valid zip file."""
    with np.load(path, allow_pickle=False) as npz:
        arrays = {name: npz[name] for name in npz.files}
    record = json.loads(str(arrays["metadata"][()]))
    edit(record, arrays)
    arrays["metadata"] = np.asarray(json.dumps(record))
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    out.write_bytes(buffer.getvalue())
    return out


# -- exact continuation -------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("penalty", ["none", "l1"])
def test_save_load_continue_is_bit_identical(dtype, penalty, stream, tmp_path):
    params = {"dtype": dtype, "penalty": penalty}
    uninterrupted = RenewableHuberRegressor(**params)
    interrupted = RenewableHuberRegressor(**params)
    batches = stream.batches(SIZES)
    for batch in batches[:SPLIT]:
        uninterrupted.partial_fit(*batch)
        interrupted.partial_fit(*batch)
    path = interrupted.save(tmp_path / "stream")
    del interrupted
    resumed = RenewableHuberRegressor.load(path)
    assert resumed.state_.equals(uninterrupted.state_)
    for batch in batches[SPLIT:]:
        uninterrupted.partial_fit(*batch)
        resumed.partial_fit(*batch)
        assert resumed.state_.equals(uninterrupted.state_)
        assert resumed.diagnostics_ == uninterrupted.diagnostics_
    assert resumed.state_.coefficients.dtype == np.dtype(dtype)
    # The checkpoint holds no history: the resumed model's starts at the load.
    resumed_after = len(SIZES) - SPLIT
    assert len(resumed.coef_history_) == len(resumed.history_) == resumed_after
    np.testing.assert_array_equal(
        resumed.coef_history_, uninterrupted.coef_history_[-resumed_after:]
    )


def test_engine_level_checkpoint_continues_bit_identically(stream, tmp_path):
    config = HuberConfig(penalty="l1", dtype="float32", fit_intercept=False)
    uninterrupted, first = NumpyEngine(config), NumpyEngine(config)
    batches = [
        (X.astype(np.float32), y.astype(np.float32), w.astype(np.float32))
        for X, y, w in stream.batches(SIZES)
    ]
    for batch in batches[:SPLIT]:
        uninterrupted.partial_fit(*batch)
        first.partial_fit(*batch)
    path = save_checkpoint(
        tmp_path / "engine.npz", Checkpoint(config, first.export_state(), None, first.name)
    )
    ckpt = load_checkpoint(path)
    assert ckpt.config == config and ckpt.engine == "numpy" and ckpt.feature_names is None
    second = NumpyEngine(ckpt.config)
    second.import_state(ckpt.state)
    for batch in batches[SPLIT:]:
        assert second.partial_fit(*batch) == uninterrupted.partial_fit(*batch)
    assert second.export_state().equals(uninterrupted.export_state())


def test_checkpoint_restores_parameters_names_and_predictions(stream, tmp_path):
    frame = pd.DataFrame(stream.X, columns=[f"x{j}" for j in range(5)])
    model = RenewableHuberRegressor(tau=2.0, bandwidth_scale=1.5, tol=1e-8, ridge=0.0)
    model.partial_fit(frame.iloc[:150], stream.y[:150], stream.sample_weight[:150])
    loaded = RenewableHuberRegressor.load(model.save(tmp_path / "named.npz"))
    # The checkpoint records the engine that ran the stream ("auto" resolved).
    assert loaded.get_params() == {**model.get_params(), "engine": "numpy"}
    assert list(loaded.feature_names_in_) == list(frame.columns)
    assert loaded.n_features_in_ == 5
    assert loaded.n_samples_seen_ == 150
    assert loaded.engine_ == "numpy"
    np.testing.assert_array_equal(
        loaded.predict(frame.iloc[150:]), model.predict(frame.iloc[150:])
    )
    with pytest.raises(ValueError, match="Feature names unseen"):
        loaded.predict(frame.iloc[150:].rename(columns={"x0": "z"}))


def test_save_appends_the_npz_suffix(saved, tmp_path):
    _, model = saved
    assert Path(model.save(tmp_path / "plain")).name == "plain.npz"
    assert Path(model.save(tmp_path / "run.ckpt")).name == "run.ckpt.npz"
    assert Path(model.save(tmp_path / "kept.npz")).name == "kept.npz"


def test_saving_an_unfitted_model_raises(tmp_path):
    with pytest.raises(NotFittedError):
        RenewableHuberRegressor().save(tmp_path / "nothing.npz")


# -- checkpoints written by the GPU engine --------------------------------------------


@pytest.fixture
def gpu_saved(stream, tmp_path):
    """A checkpoint that claims the GPU engine wrote it (its state is the NumPy one)."""
    config = HuberConfig(penalty="l1")
    engine = NumpyEngine(config)
    for batch in stream.batches(SIZES)[:SPLIT]:
        engine.partial_fit(*batch)
    path = save_checkpoint(
        tmp_path / "gpu.npz", Checkpoint(config, engine.export_state(), None, "gpu")
    )
    return path, engine


def test_gpu_checkpoint_continues_on_the_numpy_engine(gpu_saved, stream):
    path, engine = gpu_saved
    model = RenewableHuberRegressor.load(path, engine="numpy")
    assert model.engine == model.engine_ == "numpy"
    for batch in stream.batches(SIZES)[SPLIT:]:
        model.partial_fit(*batch)
        engine.partial_fit(*batch)
    assert model.state_.equals(engine.export_state())


@pytest.mark.skipif(gpu_usable(), reason="a CUDA GPU is usable here")
def test_gpu_checkpoint_predicts_on_host_but_does_not_continue_without_gpu(
    gpu_saved, stream, snapshot, assert_unchanged
):
    path, engine = gpu_saved
    model = RenewableHuberRegressor.load(path)
    assert model.engine == model.engine_ == "gpu"
    X = stream.X[:20]
    np.testing.assert_array_equal(model.predict(X), engine.predict(X))
    before = snapshot(model)
    with pytest.raises(EngineUnavailableError):
        model.partial_fit(*stream.batches(SIZES)[SPLIT])
    assert_unchanged(before, snapshot(model))


# -- refusing bad files ------------------------------------------------------------------


def test_missing_file(tmp_path):
    with pytest.raises(CheckpointError, match="no checkpoint file"):
        load_checkpoint(tmp_path / "absent.npz")
    with pytest.raises(CheckpointError, match="no checkpoint file"):
        RenewableHuberRegressor.load(tmp_path)  # a directory is not a checkpoint


@pytest.mark.parametrize("keep", [0.5, 0.9, 10, 0], ids=["half", "most", "ten_bytes", "empty"])
def test_truncated_file(saved, tmp_path, keep):
    path, _ = saved
    raw = path.read_bytes()
    cut = tmp_path / "cut.npz"
    cut.write_bytes(raw[: int(keep * len(raw)) if isinstance(keep, float) else keep])
    with pytest.raises(CheckpointError, match=r"cut\.npz"):
        load_checkpoint(cut)


def test_flipped_byte_in_an_array_is_detected(saved, tmp_path):
    path, model = saved
    raw = bytearray(path.read_bytes())
    offset = bytes(raw).find(model.state_.information.tobytes())
    assert offset > 0
    raw[offset + 17] ^= 0x10
    bad = tmp_path / "flipped.npz"
    bad.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=r"flipped\.npz"):
        load_checkpoint(bad)


@pytest.mark.parametrize(
    "edit",
    [
        lambda record, arrays: arrays.__setitem__("coefficients", arrays["coefficients"] * 1.5),
        lambda record, arrays: arrays.__setitem__("information", arrays["information"][::-1]),
        lambda record, arrays: record["counters"].__setitem__("n_samples_seen", 1),
        lambda record, arrays: record["counters"].__setitem__("weight_sum", 1e6),
        lambda record, arrays: record["config"].__setitem__("tau", 3.0),
        lambda record, arrays: record.__setitem__("engine", "gpu"),
        lambda record, arrays: record.__setitem__("digest", "0" * 64),
        lambda record, arrays: record.pop("digest"),
    ],
    ids=[
        "coefficients",
        "information",
        "n_samples_seen",
        "weight_sum",
        "config",
        "engine",
        "digest",
        "no_digest",
    ],
)
def test_altered_content_fails_the_integrity_check(saved, tmp_path, edit):
    # The archive itself is valid (fresh zip CRCs): only the digest can tell.
    path, _ = saved
    bad = _rewrite(path, tmp_path / "altered.npz", edit)
    with pytest.raises(CheckpointError, match="failed its integrity check"):
        load_checkpoint(bad)


@pytest.mark.parametrize("version", [4, 0, "2", True])
def test_wrong_format_version(saved, tmp_path, version):
    path, _ = saved
    edit = lambda r, a: r.__setitem__("format_version", version)  # noqa: E731
    bad = _rewrite(path, tmp_path / "other_version.npz", edit)
    with pytest.raises(
        CheckpointError, match=f"format version {version!r}; .* reads versions 1, 2, 3"
    ):
        load_checkpoint(bad)


def test_wrong_format_name(saved, tmp_path):
    path, _ = saved
    bad = _rewrite(path, tmp_path / "other.npz", lambda r, a: r.__setitem__("format", "other"))
    with pytest.raises(CheckpointError, match="not an rh-dask checkpoint"):
        load_checkpoint(bad)


def test_foreign_npz(tmp_path):
    foreign = tmp_path / "foreign.npz"
    np.savez(foreign, weights=np.ones(3), bias=np.zeros(1))
    with pytest.raises(CheckpointError, match="not an rh-dask checkpoint"):
        load_checkpoint(foreign)


def test_npz_with_the_right_names_but_no_json(tmp_path):
    fake = tmp_path / "fake.npz"
    np.savez(
        fake,
        metadata=np.asarray("{not json"),
        coefficients=np.zeros(3),
        information=np.zeros((3, 3)),
        feature_names=np.asarray([], dtype=str),
    )
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_checkpoint(fake)


def test_plain_npy_file_is_refused_with_a_checkpoint_error(tmp_path):
    # np.load returns a bare array for .npy content, whatever the file is called.
    fake = tmp_path / "array.npz"
    with fake.open("wb") as fh:
        np.save(fh, np.arange(4.0))
    with pytest.raises(CheckpointError, match="not an rh-dask checkpoint"):
        load_checkpoint(fake)


def test_text_file_is_refused_without_suggesting_pickle(tmp_path):
    fake = tmp_path / "notes.npz"
    fake.write_text("these are not the coefficients you are looking for\n")
    with pytest.raises(CheckpointError, match="not an rh-dask checkpoint") as caught:
        load_checkpoint(fake)
    assert "pickle" not in str(caught.value)


class _Bomb:
    """Unpickling this object records that a pickle was executed."""

    triggered = False

    def __reduce__(self):
        return (_Bomb._trigger, ())

    @staticmethod
    def _trigger():
        _Bomb.triggered = True
        return "boom"


def test_pickled_arrays_are_never_unpickled(saved, tmp_path):
    path, _ = saved
    bad = _rewrite(
        path,
        tmp_path / "pickled.npz",
        lambda r, a: a.__setitem__("feature_names", np.array([_Bomb()], dtype=object)),
    )
    _Bomb.triggered = False
    with pytest.raises(CheckpointError, match="allow_pickle=False"):
        load_checkpoint(bad)
    assert not _Bomb.triggered


def _digested(tmp_path, config, state, names=None, name="crafted.npz"):
    """A checkpoint written by save_checkpoint (so its digest is valid)."""
    return save_checkpoint(tmp_path / name, Checkpoint(config, state, names, "numpy"))


def test_digested_but_inconsistent_checkpoints_are_refused(saved, tmp_path):
    _, model = saved
    state = model.state_
    config = HuberConfig()
    cases = {
        "dtype": (config, state.astype("float32"), None),
        "intercept": (HuberConfig(fit_intercept=False), state, None),
        "names": (config, state, np.asarray(["a", "b"], dtype=object)),
    }
    bad_shape = state.copy()
    bad_shape.n_features_in = 4
    cases["shape"] = (config, bad_shape, None)
    bad_values = state.copy()
    bad_values.coefficients = bad_values.coefficients.copy()
    bad_values.coefficients[0] = np.nan
    cases["non_finite"] = (config, bad_values, None)
    for name, (cfg, st, names) in cases.items():
        path = _digested(tmp_path, cfg, st, names, name=f"{name}.npz")
        with pytest.raises(CheckpointError, match="inconsistent"):
            load_checkpoint(path)


def test_load_reads_with_allow_pickle_false(saved, monkeypatch):
    path, _ = saved
    calls = []
    original = np.load

    def spy(*args, **kwargs):
        calls.append(kwargs.get("allow_pickle"))
        return original(*args, **kwargs)

    monkeypatch.setattr(np, "load", spy)
    load_checkpoint(path)
    assert calls == [False]


# -- declared sizes are checked before anything is allocated -----------------------------


def _forge_member(path: Path, out: Path, member: str, shape: tuple[int, ...]) -> Path:
    """Copy the archive, giving ``member``'s .npy header another ``shape`` (data kept)."""
    import zipfile

    with zipfile.ZipFile(path) as archive:
        contents = {name: archive.read(name) for name in archive.namelist()}
    raw = io.BytesIO(contents[f"{member}.npy"])
    assert np.lib.format.read_magic(raw) == (1, 0)  # what np.savez writes here
    _, fortran, dtype = np.lib.format.read_array_header_1_0(raw)
    data = raw.read()
    forged = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        forged,
        {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": fortran, "shape": shape},
    )
    contents[f"{member}.npy"] = forged.getvalue() + data
    with zipfile.ZipFile(out, "w") as archive:
        for name, blob in contents.items():
            archive.writestr(name, blob)
    return out


@pytest.mark.parametrize(
    ("member", "shape"),
    [
        ("information", (10**6, 10**6)),
        ("coefficients", (10**12,)),
        ("feature_names", (10**12,)),
        ("metadata", (10**12,)),
    ],
)
def test_a_forged_huge_shape_is_refused_before_allocating(saved, tmp_path, member, shape):
    path, _ = saved
    forged = _forge_member(path, tmp_path / "huge.npz", member, shape)
    with pytest.raises(CheckpointError, match=r"huge\.npz") as caught:
        load_checkpoint(forged)
    assert "bytes" in str(caught.value) or "JSON" in str(caught.value)


def test_a_forged_shape_matching_forged_metadata_is_refused_by_the_file_size(saved, tmp_path):
    path, _ = saved

    def enlarge(record, arrays):
        record["counters"]["n_features_in"] = 10**6 - 1

    bigger = _rewrite(path, tmp_path / "meta.npz", enlarge)
    forged = _forge_member(bigger, tmp_path / "both.npz", "information", (10**6, 10**6))
    forged = _forge_member(forged, tmp_path / "all.npz", "coefficients", (10**6,))
    with pytest.raises(CheckpointError, match=r"all\.npz is inconsistent.*bytes"):
        load_checkpoint(forged)


def test_rh_dask_info_reports_a_forged_checkpoint_as_bad_input(saved, tmp_path, capsys):
    from rh_dask.app.cli import main

    path, _ = saved
    forged = _forge_member(path, tmp_path / "huge.npz", "information", (10**6, 10**6))
    assert main(["info", str(forged)]) == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("rh-dask: error:") and "huge.npz" in err[0]


def test_an_array_whose_shape_disagrees_with_the_metadata_is_refused(saved, tmp_path):
    path, _ = saved
    # Same bytes, other shape: p = 6 parameters, declared as 3 x 12.
    forged = _forge_member(path, tmp_path / "reshaped.npz", "information", (3, 12))
    with pytest.raises(CheckpointError, match=r"information .* the metadata says"):
        load_checkpoint(forged)


def test_an_unknown_engine_name_is_a_checkpoint_error(saved, tmp_path):
    _, model = saved
    path = save_checkpoint(
        tmp_path / "tpu.npz", Checkpoint(HuberConfig(), model.state_, None, "tpu")
    )
    with pytest.raises(CheckpointError, match=r"inconsistent: unknown engine 'tpu'"):
        load_checkpoint(path)
    with pytest.raises(CheckpointError, match="unknown engine"):
        RenewableHuberRegressor.load(path)


# -- a failed save changes nothing on disk --------------------------------------------------


def _half_then_full(self, data):
    """A writer that dies half-way, as on a full disk."""
    with open(self, "wb") as fh:
        fh.write(data[: len(data) // 2])
    raise OSError(28, "No space left on device")


def _listing(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


@pytest.mark.parametrize("failure", ["write", "replace"])
def test_a_failed_save_leaves_no_temporary_file_and_the_old_checkpoint(
    saved, stream, monkeypatch, failure
):
    import os

    path, model = saved
    before = _listing(path.parent)
    model.partial_fit(*stream.batches(SIZES)[SPLIT])  # something new to save
    if failure == "write":
        monkeypatch.setattr(Path, "write_bytes", _half_then_full)
    else:

        def refuse(src, dst):
            raise PermissionError(13, "Permission denied")

        monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(OSError, match=r"No space left|Permission denied"):
        model.save(path)
    monkeypatch.undo()
    assert _listing(path.parent) == before
    assert load_checkpoint(path).state.batch_count == SPLIT


def test_saving_into_a_read_only_directory_fails_cleanly(saved, tmp_path):
    import os

    if os.geteuid() == 0:
        pytest.skip("root writes into read-only directories")
    _, model = saved
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        with pytest.raises(PermissionError):
            model.save(locked / "m.npz")
        assert list(locked.iterdir()) == []
    finally:
        locked.chmod(0o700)


# -- the version 2 layout of a model checkpoint -----------------------------------------------


def test_a_model_checkpoint_has_only_the_current_entries(saved, tmp_path):
    import zipfile

    from rh_dask.checkpoint import checkpoint_bytes, checkpoint_from_bytes

    path, model = saved
    with zipfile.ZipFile(path) as archive:
        members = {name: archive.read(name) for name in archive.namelist()}
    assert sorted(members) == [
        "coefficients.npy",
        "feature_names.npy",
        "information.npy",
        "metadata.npy",
        "score_variance.npy",
    ]
    record = json.loads(str(np.load(io.BytesIO(members["metadata.npy"]))[()]))
    assert sorted(record) == [
        "config",
        "counters",
        "digest",
        "engine",
        "format",
        "format_version",
        "has_feature_names",
        "library_version",
    ]
    assert record["format_version"] == 3
    # The bytes API reads the file as load_checkpoint does, and writes the same entries.
    ckpt = checkpoint_from_bytes(path.read_bytes(), str(path))
    assert ckpt.walk is None and ckpt.records == () and ckpt.recoveries == ()
    assert ckpt.state.equals(load_checkpoint(path).state) and ckpt.state.equals(model.state_)
    with zipfile.ZipFile(io.BytesIO(checkpoint_bytes(ckpt))) as archive:
        again = {name: archive.read(name) for name in archive.namelist()}
    assert again == members
