"""Input validation (issue item 5): every bad input raises ValidationError and changes nothing.

Each failing call is made on a model that is part-way through a stream, and
the model's observable state (coefficients, information, counters,
diagnostics, feature metadata) is compared bit for bit before and after.
"""

from __future__ import annotations

import warnings

import numpy as np
import pandas as pd
import pytest
import scipy.sparse
from devices import gpu_usable

from rh_dask import (
    EngineUnavailableError,
    HuberConfig,
    HuberState,
    InputTypeError,
    NumpyEngine,
    RenewableHuberRegressor,
    ValidationError,
)
from rh_dask.validation import check_n_features, validate_batch

N_FEATURES = 4


@pytest.fixture
def stream(make_stream):
    return make_stream(240, N_FEATURES, seed=11, weights="uniform")


@pytest.fixture
def midstream(stream):
    """A model that has consumed two batches of a NumPy stream."""
    model = RenewableHuberRegressor()
    for X, y, w in stream.batches([120, 80, 40])[:2]:
        model.partial_fit(X, y, w)
    return model


def _with(array, index, value):
    out = np.array(array, dtype=float, copy=True)
    out[index] = value
    return out


# Each case maps the next good batch (X, y, w) to a bad one, and gives a regex
# the error message must match: the message has to name the problem.
BAD_BATCHES = {
    "nan_in_X": (lambda X, y, w: (_with(X, (3, 1), np.nan), y, w), r"X.*NaN"),
    "inf_in_X": (lambda X, y, w: (_with(X, (0, 0), np.inf), y, w), r"X.*infinity"),
    "neg_inf_in_X": (lambda X, y, w: (_with(X, (5, 2), -np.inf), y, w), r"X.*infinity"),
    "nan_in_y": (lambda X, y, w: (X, _with(y, 7, np.nan), w), r"y.*NaN"),
    "inf_in_y": (lambda X, y, w: (X, _with(y, 0, np.inf), w), r"y.*infinity"),
    "nan_in_weights": (
        lambda X, y, w: (X, y, _with(w, 2, np.nan)),
        r"sample_weight.*NaN",
    ),
    "inf_in_weights": (
        lambda X, y, w: (X, y, _with(w, 2, np.inf)),
        r"sample_weight.*infinity",
    ),
    "wrong_width": (
        lambda X, y, w: (X[:, :-1], y, w),
        rf"X has {N_FEATURES - 1} features, but RenewableHuberRegressor is expecting "
        rf"{N_FEATURES} features",
    ),
    "one_dimensional_X": (lambda X, y, w: (X[:, 0], y, w), r"Expected 2D array, got 1D"),
    "three_dimensional_X": (lambda X, y, w: (X[:, :, None], y, w), r"X.*dim 3"),
    "two_column_y": (lambda X, y, w: (X, np.c_[y, y], w), r"y must be 1-D"),
    "y_is_None": (lambda X, y, w: (X, None, w), r"requires y to be passed"),
    "length_mismatch": (
        lambda X, y, w: (X, y[:-1], w[:-1]),
        r"inconsistent numbers of rows",
    ),
    "zero_rows": (lambda X, y, w: (X[:0], y[:0], w[:0]), r"0 sample"),
    "strings_in_X": (
        lambda X, y, w: (X.astype(str).astype(object) + "x", y, w),
        r"X.*could not convert",
    ),
    "strings_in_y": (lambda X, y, w: (X, np.array(["a"] * len(y)), w), r"y.*could not convert"),
    "dict_in_X": (
        lambda X, y, w: (_object_with(X, (0, 0), {"a": 1}), y, w),
        r"X.*argument must be .*number",
    ),
    "complex_X": (lambda X, y, w: (X + 1j, y, w), r"X.*Complex data not supported"),
    "complex_y": (lambda X, y, w: (X, y + 1j, w), r"y.*Complex data not supported"),
    "sparse_X": (
        lambda X, y, w: (scipy.sparse.csr_matrix(X), y, w),
        r"Sparse data was passed for X",
    ),
    "negative_weight": (lambda X, y, w: (X, y, _with(w, 4, -0.5)), r"non-negative"),
    "all_zero_weights": (lambda X, y, w: (X, y, np.zeros_like(w)), r"sample_weight.*zero"),
    "negative_scalar_weight": (lambda X, y, w: (X, y, -1.0), r"non-negative"),
    "short_weights": (
        lambda X, y, w: (X, y, w[:-3]),
        r"sample_weight has shape \(37,\), expected \(40,\)",  # the third batch has 40 rows
    ),
    "two_dimensional_weights": (lambda X, y, w: (X, y, w[:, None]), r"sample_weight must be 1-D"),
    "string_weights": (
        lambda X, y, w: (X, y, np.array(["1"] * (len(w) - 1) + ["heavy"])),
        r"sample_weight.*could not convert",
    ),
}


def _object_with(array, index, value):
    out = np.array(array, dtype=object)
    out[index] = value
    return out


@pytest.mark.parametrize("case", sorted(BAD_BATCHES))
def test_bad_batch_midstream_raises_and_leaves_state_untouched(
    case, stream, midstream, snapshot, assert_unchanged
):
    make_bad, message = BAD_BATCHES[case]
    X, y, w = stream.batches([120, 80, 40])[2]
    bad = make_bad(X, y, w)
    before = snapshot(midstream)
    with pytest.raises(ValidationError, match=message):
        midstream.partial_fit(*bad)
    assert_unchanged(before, snapshot(midstream))
    # The stream is still usable, and continues exactly where it was.
    reference = RenewableHuberRegressor()
    for batch in stream.batches([120, 80, 40]):
        reference.partial_fit(*batch)
    midstream.partial_fit(X, y, w)
    assert midstream.state_.equals(reference.state_)


@pytest.mark.parametrize(
    "case", ["nan_in_X", "one_dimensional_X", "zero_rows", "all_zero_weights", "y_is_None"]
)
def test_bad_first_batch_leaves_model_unfitted(case, stream):
    make_bad, message = BAD_BATCHES[case]
    model = RenewableHuberRegressor()
    with pytest.raises(ValidationError, match=message):
        model.partial_fit(*make_bad(*stream.batches([120, 120])[0]))
    assert not hasattr(model, "n_features_in_")
    assert not hasattr(model, "diagnostics_")


@pytest.mark.parametrize("case", ["nan_in_X", "negative_weight", "y_is_None"])
def test_failed_fit_keeps_the_previous_model(case, stream, midstream, snapshot, assert_unchanged):
    # fit() resets the stream, but only once the new data passed validation:
    # the contract says a batch that fails validation leaves the state as it was.
    make_bad, message = BAD_BATCHES[case]
    before = snapshot(midstream)
    with pytest.raises(ValidationError, match=message):
        midstream.fit(*make_bad(*stream.batches([120, 120])[1]))
    assert_unchanged(before, snapshot(midstream))


def test_two_dimensional_weights_message_is_about_weights(stream, midstream):
    X, y, w = stream.batches([120, 80, 40])[2]
    with pytest.raises(ValidationError, match=r"sample_weight\.ravel\(\)") as caught:
        midstream.partial_fit(X, y, w[:, None])
    assert "single-output" not in str(caught.value)  # that hint is for y only


def test_validation_error_is_a_value_error():
    assert issubclass(ValidationError, ValueError)


# -- pandas feature names ---------------------------------------------------------


@pytest.fixture
def frame_stream(stream):
    columns = [f"f{j}" for j in range(N_FEATURES)]
    frame = pd.DataFrame(stream.X, columns=columns)
    model = RenewableHuberRegressor().partial_fit(frame.iloc[:120], stream.y[:120])
    return model, frame


@pytest.mark.parametrize(
    ("rename", "message"),
    [
        ({"f1": "g1"}, r"Feature names unseen at fit time:\n- g1"),
        ({"f1": "f2", "f2": "f1"}, r"same order"),
    ],
    ids=["renamed", "reordered"],
)
def test_mismatched_feature_names_midstream(
    frame_stream, stream, rename, message, snapshot, assert_unchanged
):
    model, frame = frame_stream
    before = snapshot(model)
    bad = frame.iloc[120:200].rename(columns=rename)
    with pytest.raises(ValidationError, match=message):
        model.partial_fit(bad, stream.y[120:200])
    assert_unchanged(before, snapshot(model))
    assert list(model.feature_names_in_) == list(frame.columns)


def test_dropped_dataframe_column_midstream(frame_stream, stream, snapshot, assert_unchanged):
    model, frame = frame_stream
    before = snapshot(model)
    with pytest.raises(ValidationError, match=r"seen at fit time, yet now missing:\n- f3"):
        model.partial_fit(frame.iloc[120:200, :3], stream.y[120:200])
    assert_unchanged(before, snapshot(model))


def test_mixed_type_column_names_are_refused(stream):
    frame = pd.DataFrame(stream.X, columns=["a", "b", 3, "d"])
    with pytest.raises(ValidationError, match="all input features have string names"):
        RenewableHuberRegressor().fit(frame, stream.y)


# -- parameters --------------------------------------------------------------------


@pytest.mark.parametrize(
    "change",
    [
        {"tau": 2.0},
        {"penalty": "l1"},
        {"lambda_scale": 0.5},
        {"bandwidth_scale": 2.0},
        {"fit_intercept": False},
        {"max_iter": 5},
        {"tol": 1e-3},
        {"ridge": 0.0},
        {"dtype": "float32"},
    ],
    ids=lambda c: next(iter(c)),
)
def test_parameters_changed_midstream_are_refused(
    change, stream, midstream, snapshot, assert_unchanged
):
    before = snapshot(midstream)
    midstream.set_params(**change)
    with pytest.raises(ValidationError, match="parameters changed since the stream started"):
        midstream.partial_fit(*stream.batches([120, 80, 40])[2])
    assert_unchanged(before, snapshot(midstream))


def test_engine_changed_midstream_is_refused_not_ignored(
    stream, midstream, snapshot, assert_unchanged
):
    # The stream runs on the NumPy engine; asking for the GPU engine part-way
    # must not silently keep going on the CPU.
    before = snapshot(midstream)
    midstream.set_params(engine="gpu")
    with pytest.raises(ValidationError, match="engine"):
        midstream.partial_fit(*stream.batches([120, 80, 40])[2])
    assert_unchanged(before, snapshot(midstream))
    midstream.set_params(engine="numpy")  # naming the engine in use is fine
    midstream.partial_fit(*stream.batches([120, 80, 40])[2])
    assert midstream.state_.batch_count == 3


BAD_PARAMETERS = [
    ("tau", 0.0),
    ("tau", -1.0),
    ("tau", np.nan),
    ("tau", np.inf),
    ("tau", "1.0"),
    ("penalty", "l2"),
    ("penalty", None),
    ("lambda_scale", -0.1),
    ("bandwidth_scale", 0.0),
    ("fit_intercept", "yes"),
    ("max_iter", 0),
    ("max_iter", 2.5),
    ("max_iter", True),
    ("tol", 0.0),
    ("tol", -1e-6),
    ("ridge", -1e-8),
    ("ridge", np.nan),
    ("dtype", "float16"),
    ("dtype", "int64"),
    ("engine", "cuda"),
]


@pytest.mark.parametrize(("name", "value"), BAD_PARAMETERS)
def test_bad_constructor_parameter(name, value, stream):
    model = RenewableHuberRegressor(**{name: value})
    with pytest.raises(ValidationError, match=name):
        model.fit(stream.X, stream.y)
    assert not hasattr(model, "n_features_in_")


@pytest.mark.skipif(gpu_usable(), reason="a CUDA GPU is usable here")
@pytest.mark.parametrize(
    "params", [{"engine": "gpu"}, {"engine": "auto", "device": "cuda:0"}], ids=["gpu", "cuda"]
)
def test_gpu_engine_without_gpu_raises_never_falls_back(params, stream):
    model = RenewableHuberRegressor(**params)
    with pytest.raises(EngineUnavailableError, match=r"(?i)gpu|cuda"):
        model.fit(stream.X, stream.y)
    assert not hasattr(model, "engine_")
    assert not hasattr(model, "n_features_in_")


def _poorly_scaled_batch(n: int, dtype: str, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Correlated columns on scales 0.1 to 30, Student-t(1.5) noise: long LAMM solves."""
    rng = np.random.default_rng(seed)
    scale = np.logspace(-1.0, 1.5, 12)
    X = (0.8 * rng.standard_normal((n, 1)) + 0.6 * rng.standard_normal((n, 12))) * scale
    y = X @ (np.linspace(-2.0, 2.0, 12) / scale) + 3.0 + rng.standard_t(1.5, n)
    return X.astype(dtype), y.astype(dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_usable(), reason="needs CuPy and a CUDA GPU")
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_gpu_l1_refused_device_batches_leave_the_model_alone(dtype, snapshot, assert_unchanged):
    """engine="gpu", penalty="l1", after a batch that ran LAMM into its cap.

    CuPy batches skip the host's finiteness scan (the engine checks them on
    the device), in memory and as chunks of a Dask array: a refused one
    leaves the model bit-identical, and the stream then continues with the
    bits of a model that never saw it.
    """
    cp = pytest.importorskip("cupy")
    da = pytest.importorskip("dask.array")
    from rh_dask.exceptions import StreamError

    X0, y0 = _poorly_scaled_batch(500, dtype, seed=31)
    X1, y1 = _poorly_scaled_batch(20000, dtype, seed=32)
    X2, y2 = _poorly_scaled_batch(3000, dtype, seed=33)
    model = RenewableHuberRegressor(engine="gpu", penalty="l1", dtype=dtype)
    model.partial_fit(cp.asarray(X0), cp.asarray(y0))
    model.partial_fit(cp.asarray(X1), cp.asarray(y1))
    assert model.n_iter_ >= 50, f"the long batch took only {model.n_iter_} LAMM iterations"
    before = snapshot(model)
    w = cp.ones(len(y2), dtype=dtype)
    bad = {
        "NaN in X": (_with(X2, (1500, 4), np.nan).astype(dtype), y2, None),
        "inf in y": (X2, _with(y2, 2999, np.inf).astype(dtype), None),
        "NaN in the weights": (X2, y2, _with(w.get(), 0, np.nan).astype(dtype)),
    }
    for name, (X, y, weights) in bad.items():
        args = [None if a is None else cp.asarray(a) for a in (X, y, weights)]
        with pytest.raises(ValidationError, match="finite"):
            model.partial_fit(*args)
        assert_unchanged(before, snapshot(model))
        # coef_history_ holds float64 copies of the engine's host mirror of β
        beta = model.state_.coefficients.astype(np.float64)
        assert model.coef_history_[-1].tobytes() == beta.tobytes(), name
    # The first of three chunks is the refused one: nothing of the stream is consumed.
    nan_first_chunk = _with(X2, (5, 2), np.nan).astype(dtype)
    bad_chunks = da.from_array(cp.asarray(nan_first_chunk), chunks=(1000, 12), asarray=False)
    good_y = da.from_array(cp.asarray(y2), chunks=1000, asarray=False)
    with pytest.raises(StreamError, match="finite"):
        model.partial_fit(bad_chunks, good_y)
    assert_unchanged(before, snapshot(model))
    model.partial_fit(cp.asarray(X2), cp.asarray(y2))
    twin = RenewableHuberRegressor(engine="gpu", penalty="l1", dtype=dtype)
    for X, y in ((X0, y0), (X1, y1), (X2, y2)):
        twin.partial_fit(cp.asarray(X), cp.asarray(y))
    assert_unchanged(snapshot(twin), snapshot(model))


def test_numpy_engine_refuses_a_cuda_device(stream):
    with pytest.raises(EngineUnavailableError, match="CPU only"):
        RenewableHuberRegressor(engine="numpy", device="cuda:0").fit(stream.X, stream.y)


# -- the validator itself -----------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_validate_batch_casts_to_the_stream_dtype(dtype, stream):
    X = np.asfortranarray(stream.X[:50]).astype(np.float32 if dtype == "float64" else np.float64)
    batch = validate_batch(X, list(stream.y[:50]), 2, dtype=dtype)
    assert batch.X.dtype == batch.y.dtype == batch.sample_weight.dtype == np.dtype(dtype)
    assert batch.X.flags.c_contiguous
    np.testing.assert_array_equal(batch.sample_weight, np.full(50, 2.0))
    assert batch.feature_names is None


def test_validate_batch_reports_dataframe_names(stream):
    frame = pd.DataFrame(stream.X[:10], columns=list("abcd"))
    batch = validate_batch(frame, pd.Series(stream.y[:10]), dtype="float64")
    assert list(batch.feature_names) == list("abcd")
    np.testing.assert_array_equal(batch.X, stream.X[:10])


def test_missing_names_after_a_named_stream_warn_but_fit(frame_stream, stream):
    model, _ = frame_stream
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.partial_fit(stream.X[120:200], stream.y[120:200])
    assert any("does not have valid feature names" in str(c.message) for c in caught)
    assert model.state_.batch_count == 2


def test_memory_mapped_chunks_pass_as_views_and_are_still_checked(tmp_path):
    X = np.arange(60, dtype=np.float32).reshape(20, 3)
    np.save(tmp_path / "X.npy", X)
    mapped = np.load(tmp_path / "X.npy", mmap_mode="r")
    y = np.ones(8, dtype=np.float32)
    batch = validate_batch(mapped[4:12], y, dtype="float32")
    # a plain ndarray viewing the file's pages, as check_array would give: no copy
    assert type(batch.X) is np.ndarray
    assert np.shares_memory(batch.X, mapped)
    np.testing.assert_array_equal(batch.X, X[4:12])
    bad = X.copy()
    bad[5, 1] = np.nan
    np.save(tmp_path / "bad.npy", bad)
    with pytest.raises(ValidationError, match="NaN"):
        validate_batch(np.load(tmp_path / "bad.npy", mmap_mode="r")[4:12], y, dtype="float32")
    # cast when the file's dtype is not the stream's
    batch = validate_batch(mapped[4:12], y, dtype="float64")
    assert batch.X.dtype == np.float64 and not np.shares_memory(batch.X, mapped)


# -- non-numeric pandas columns ------------------------------------------------------------


@pytest.mark.parametrize(
    ("column", "dtype_text"),
    [
        (pd.Categorical(["x", "y"] * 60), "category"),
        (pd.array(["x", "y"] * 60, dtype="string"), "str|string"),
        (np.array(["x", "y"] * 60, dtype=object), "object|str"),
    ],
    ids=["categorical", "string", "object"],
)
@pytest.mark.filterwarnings("ignore:X has feature names")
def test_a_non_numeric_column_is_named_with_its_dtype(
    column, dtype_text, stream, midstream, snapshot, assert_unchanged
):
    X, y, w = stream.batches([120, 80, 40])[0]
    frame = pd.DataFrame(X, columns=[f"f{j}" for j in range(N_FEATURES)])
    frame["colour"] = column
    model = RenewableHuberRegressor()
    with pytest.raises(
        InputTypeError, match=rf"column 'colour' of X has dtype ({dtype_text})"
    ) as e:
        model.fit(frame, y, w)
    assert "could not convert string to float: 'x'" in str(e.value)
    assert isinstance(e.value, ValueError) and isinstance(e.value, TypeError)
    assert not hasattr(model, "n_features_in_")
    # A fitted model keeps its stream when the next batch has such a column.
    before = snapshot(midstream)
    with pytest.raises(InputTypeError, match="column 'colour'"):
        midstream.partial_fit(frame.drop(columns="f0"), y, w)
    assert_unchanged(before, snapshot(midstream))


def test_a_categorical_target_is_named(stream):
    X = stream.batches([120, 120])[0][0]
    target = pd.Series(pd.Categorical(["low", "high"] * 60), name="grade")
    with pytest.raises(InputTypeError, match=r"^y has dtype category and cannot be converted"):
        RenewableHuberRegressor().fit(X, target)


def test_numeric_categories_and_strings_convert_as_in_scikit_learn(stream):
    # check_array converts a categorical by its values (not its codes) and
    # numeric strings to numbers; so does the estimator.
    from sklearn.utils import check_array

    X, y, _ = stream.batches([120, 120])[0]
    frame = pd.DataFrame(X[:, :2], columns=["a", "b"])
    frame["level"] = pd.Categorical(np.tile([10.0, 20.0, 40.0], 40))
    frame["count"] = np.tile(["1", "2", "3"], 40).astype(object)
    expected = check_array(frame, dtype=np.float64)
    assert expected[:3, 2].tolist() == [10.0, 20.0, 40.0]
    batch = validate_batch(frame, y, dtype="float64")
    np.testing.assert_array_equal(batch.X, expected)
    model = RenewableHuberRegressor().fit(frame, y)
    reference = RenewableHuberRegressor().fit(pd.DataFrame(expected, columns=frame.columns), y)
    assert model.state_.equals(reference.state_)


def test_a_categorical_column_in_a_dask_partition_is_a_bad_chunk():
    import dask.dataframe as dd

    from rh_dask import BadChunkError

    rng = np.random.default_rng(3)

    def part(i):
        frame = pd.DataFrame(rng.normal(size=(30, 2)), columns=["a", "b"])
        frame["y"] = rng.normal(size=30)
        if i == 1:
            frame["b"] = pd.Categorical(["u", "v"] * 15)
        return frame

    meta = pd.DataFrame({"a": [], "b": [], "y": []}, dtype=float)
    model = RenewableHuberRegressor(progress=False)
    with pytest.raises(BadChunkError, match=r"chunk 1 was refused.*column 'b' of X has dtype"):
        model.fit(dd.from_map(part, range(3), meta=meta), "y")
    assert model.history_["chunk"].tolist() == [0]


def test_a_column_vector_y_passes_validation_raveled_with_a_warning(stream):
    from sklearn.exceptions import DataConversionWarning

    X, y, w = stream.batches([120, 120])[0]
    with pytest.warns(DataConversionWarning, match="A column-vector y was passed"):
        batch = validate_batch(X, y[:, None], w, dtype="float64")
    assert batch.y.shape == (120,) and batch.y.flags.c_contiguous
    np.testing.assert_array_equal(batch.y, y)
    # Weights have no such convention: a column of weights is refused.
    with pytest.raises(ValidationError, match=r"sample_weight must be 1-D"):
        validate_batch(X, y, w[:, None], dtype="float64")


def test_one_width_check_names_its_owner_and_lets_unknown_counts_pass():
    check_n_features(None, 3, "RenewableHuberRegressor")
    check_n_features(3, None, "RenewableHuberRegressor")
    check_n_features(3, 3, "RenewableHuberRegressor")
    with pytest.raises(ValidationError) as info:
        check_n_features(2, 3, "RenewableHuberRegressor")
    assert str(info.value) == (
        "X has 2 features, but RenewableHuberRegressor is expecting 3 features as input."
    )


def test_the_engine_refuses_a_wrong_width_with_the_same_message():
    rng = np.random.default_rng(3)
    engine = NumpyEngine(HuberConfig())
    engine.partial_fit(rng.normal(size=(50, 3)), rng.normal(size=50))
    with pytest.raises(ValidationError) as info:
        engine.predict(np.zeros((4, 2)))
    assert str(info.value) == "X has 2 features, but the stream is expecting 3 features as input."
    with pytest.raises(ValidationError, match="X must be 2-D, got 1-D"):
        engine.predict(np.zeros(3))


def test_a_state_for_an_engine_is_a_validated_copy_in_its_dtype():
    state = HuberState.empty(2, fit_intercept=True, dtype="float64")
    moved = state.for_engine(True, "float32")
    assert moved.coefficients.dtype == np.float32 and moved.information.dtype == np.float32
    assert state.coefficients.dtype == np.float64
    with pytest.raises(ValidationError, match="state has fit_intercept=True, engine config has"):
        state.for_engine(False, "float64")
    state.information[0, 0] = np.nan
    with pytest.raises(ValidationError, match="non-finite"):
        state.for_engine(True, "float64")


# -- inputs already of the stream's dtype ------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_frames_and_arrays_of_the_stream_dtype_become_row_major_copies(dtype):
    rng = np.random.default_rng(5)
    values = rng.standard_normal((30, 4)).astype(dtype)
    # Columns in one column-major block, as pandas builds a frame from Parquet.
    frame = pd.DataFrame({c: values[:, j].copy() for j, c in enumerate("abcd")})
    assert frame.to_numpy().flags.f_contiguous
    y = np.ones(30, dtype=dtype)
    for X in (frame, np.asfortranarray(values), values[:, [0, 2, 1, 3]].T.copy().T):
        batch = validate_batch(X, y, dtype=dtype)
        assert batch.X.dtype == np.dtype(dtype) and batch.X.flags.c_contiguous
        np.testing.assert_array_equal(batch.X, np.asarray(X))
    # A row-major copy: the frame's own (column-major) memory is not handed on.
    assert not np.shares_memory(validate_batch(frame, y, dtype=dtype).X, frame.to_numpy())


@pytest.mark.parametrize(
    "frame",
    [
        pd.DataFrame({"a": np.arange(6, dtype=np.float32), "b": np.arange(6, dtype=np.float64)}),
        pd.DataFrame({"a": pd.array([0.5] * 6, dtype="Float32"), "b": np.ones(6, np.float32)}),
        pd.DataFrame({"a": np.arange(6, dtype=np.int64), "b": np.ones(6, np.float32)}),
    ],
    ids=["mixed-floats", "nullable-float", "integers"],
)
def test_frames_of_other_dtypes_are_converted_as_before(frame):
    batch = validate_batch(frame, np.ones(6, np.float32), dtype="float32")
    assert batch.X.dtype == np.float32 and batch.X.flags.c_contiguous
    np.testing.assert_array_equal(batch.X, frame.to_numpy(dtype=np.float32))


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_a_frame_of_the_stream_dtype_is_still_scanned(bad):
    frame = pd.DataFrame({"a": np.ones(6, np.float32), "b": np.ones(6, np.float32)})
    frame.loc[4, "b"] = bad
    with pytest.raises(ValidationError, match="X"):
        validate_batch(frame, np.ones(6, np.float32), dtype="float32")
    with pytest.raises(ValidationError, match="X"):
        validate_batch(
            np.asfortranarray(frame.to_numpy()), np.ones(6, np.float32), dtype="float32"
        )


def test_an_empty_frame_of_the_stream_dtype_is_refused_as_before():
    frame = pd.DataFrame({"a": np.ones(0, np.float32)})
    with pytest.raises(ValidationError, match="0 sample"):
        validate_batch(frame, np.ones(0, np.float32), dtype="float32")
    with pytest.raises(ValidationError, match="0 feature"):
        validate_batch(np.ones((3, 0), np.float32), np.ones(3, np.float32), dtype="float32")
