"""Batch validation: every check runs before any engine sees the data.

A failure raises :class:`~rh_dask.exceptions.ValidationError` naming the
problem; nothing is modified. Host inputs are converted with scikit-learn's
``check_array`` (so pandas, lists and object arrays of numbers behave as in
scikit-learn), except NumPy arrays and pandas frames that hold numbers of the
stream's dtype already: those are only made row-major
(:func:`rh_dask.row_major.as_row_major`) and scanned for NaN and infinity.
CUDA arrays are passed through untouched for engines that take them, which
check them on their device.
"""

from __future__ import annotations

import sys
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
from pandas import CategoricalDtype, DataFrame
from pandas.api.types import is_numeric_dtype
from sklearn.exceptions import DataConversionWarning
from sklearn.utils import assert_all_finite, check_array

from .exceptions import InputTypeError, ValidationError
from .row_major import as_row_major

#: DLPack device types (``DLDeviceType`` of dlpack.h), as messages name them.
DLPACK_DEVICE_NAMES = {1: "CPU", 2: "CUDA", 3: "CUDA pinned host", 13: "CUDA managed"}
#: kDLCUDA: memory of one CUDA device.
DLPACK_CUDA = 2
#: The DLPack device types CUDA owns (kDLCUDA, kDLCUDAHost, kDLCUDAManaged).
DLPACK_CUDA_TYPES = frozenset({DLPACK_CUDA, 3, 13})


@dataclass(frozen=True)
class Batch:
    """A validated batch, ready for an engine."""

    X: Any
    y: Any
    sample_weight: Any | None
    feature_names: np.ndarray | None


def is_device_array(obj: Any) -> bool:
    """True for CuPy arrays and other CUDA arrays (CUDA array interface or DLPack)."""
    if hasattr(obj, "__cuda_array_interface__"):
        return True
    dev = getattr(obj, "__dlpack_device__", None)
    if dev is None or isinstance(obj, np.ndarray):
        return False
    try:
        return int(dev()[0]) in DLPACK_CUDA_TYPES
    except Exception:
        return False


def check_lookahead(value: Any) -> int | str:
    """An estimator's ``lookahead``: the text ``"auto"`` or an integer >= 1.

    Raises
    ------
    ValidationError
        For anything else (a bool, a float, an array, other text).
    """
    if isinstance(value, str) and value == "auto":
        return "auto"
    if (
        isinstance(value, (bool, np.bool_))
        or not isinstance(value, (int, np.integer))
        or value < 1
    ):
        raise ValidationError(f'lookahead must be an integer >= 1 or "auto", got {value!r}')
    return int(value)


def feature_names_of(X: Any) -> np.ndarray | None:
    """Column names of a dataframe-like X when they are all strings, else None."""
    columns = getattr(X, "columns", None)
    if columns is None or not hasattr(X, "shape") or len(getattr(X, "shape", ())) != 2:
        return None
    names = np.asarray(list(columns), dtype=object)
    kinds = {isinstance(c, str) for c in names}
    if kinds == {True}:
        return names
    if kinds == {True, False}:
        raise ValidationError(
            "Feature names are only supported if all input features have string names, "
            f"but your input has {sorted({type(c).__name__ for c in names})} as feature name "
            "types. Convert all of them to strings."
        )
    return None


def check_feature_names(
    names: np.ndarray | None,
    expected: np.ndarray | None,
    *,
    fitted: bool,
    owner: str,
) -> None:
    """Raise when names disagree with the stream's; warn when one side has none."""
    if not fitted:
        return
    if expected is None:
        if names is not None:
            warnings.warn(
                f"X has feature names, but {owner} was fitted without feature names",
                UserWarning,
                stacklevel=4,
            )
        return
    if names is None:
        warnings.warn(
            f"X does not have valid feature names, but {owner} was fitted with feature names",
            UserWarning,
            stacklevel=4,
        )
        return
    if len(names) == len(expected) and np.array_equal(names, expected):
        return
    message = "The feature names should match those that were passed during fit.\n"
    unseen = [n for n in names if n not in set(expected)]
    missing = [n for n in expected if n not in set(names)]
    if unseen:
        message += "Feature names unseen at fit time:\n" + "".join(f"- {n}\n" for n in unseen)
    if missing:
        message += "Feature names seen at fit time, yet now missing:\n" + "".join(
            f"- {n}\n" for n in missing
        )
    if not unseen and not missing:
        message += "Feature names must be in the same order as they were in fit.\n"
    raise ValidationError(message)


def _caller_stacklevel() -> int:
    """The ``stacklevel`` of the first frame outside rh-dask (the user's call)."""
    frame = sys._getframe(1)
    level = 1
    while frame is not None and frame.f_globals.get("__name__", "").startswith("rh_dask"):
        frame = frame.f_back
        level += 1
    return level


def warn_column_vector(name: str = "y") -> None:
    """Warn, as scikit-learn does, that a column vector ``name`` is raveled."""
    warnings.warn(
        f"A column-vector {name} was passed when a 1d array was expected. Please change "
        f"the shape of {name} to (n_samples, ), for example using ravel().",
        DataConversionWarning,
        stacklevel=_caller_stacklevel(),
    )


def ravel_column_vector(y: Any, name: str = "y") -> Any:
    """``y`` of shape (n, 1) raveled, with scikit-learn's warning; any other ``y`` as it is.

    For in-memory targets (NumPy, pandas, lists, CUDA arrays); shapes other
    than (n, 1) are left for validation to accept or refuse.
    """
    if y is None or isinstance(y, str) or np.isscalar(y):
        return y
    shape = getattr(y, "shape", None)
    if shape is None:
        try:
            shape = np.shape(y)
        except ValueError:  # ragged nested sequences: validation names the problem
            return y
    if len(shape) != 2 or shape[1] != 1:
        return y
    warn_column_vector(name)
    if hasattr(y, "iloc"):
        return y.iloc[:, 0]
    if is_device_array(y):
        return y.reshape(-1)
    return np.asarray(y).reshape(-1)


def _column_dtype_error(value: Any, name: str, dtype: np.dtype) -> InputTypeError | None:
    """Name the pandas column (and its dtype) that cannot be converted to numbers.

    Numeric columns pass; a categorical, string or object column is converted
    as scikit-learn's ``check_array`` converts it (by its values: numeric
    categories and numeric strings become numbers), and the first one that
    fails is reported. ``None`` when ``value`` is not pandas or no single
    column fails.
    """
    if hasattr(value, "columns") and hasattr(value, "dtypes"):
        columns = [(f"column {c!r} of {name}", value[c]) for c in value.columns]
    elif hasattr(value, "dtype") and hasattr(value, "index") and hasattr(value, "to_numpy"):
        columns = [(name, value)]
    else:
        return None
    for label, column in columns:
        col_dtype = getattr(column, "dtype", None)
        if col_dtype is None or getattr(column, "ndim", 1) != 1:
            continue  # duplicated column names give a frame here; check_array's message stands
        if is_numeric_dtype(col_dtype) and not isinstance(col_dtype, CategoricalDtype):
            continue
        try:
            np.asarray(column, dtype=dtype)
        except (TypeError, ValueError) as exc:
            return InputTypeError(
                f"{label} has dtype {col_dtype} and cannot be converted to numbers: {exc}. "
                "Encode it as numbers first (e.g. one-hot or ordinal codes) or leave it out"
            )
    return None


def _plain_array(value: Any, dtype: np.dtype, two_d: bool) -> np.ndarray | None:
    """``value`` as a NumPy array when it holds numbers of ``dtype`` already, else ``None``.

    A NumPy array (a memmap as a plain view) of ``dtype`` and the expected
    number of dimensions, or a pandas DataFrame whose columns all have NumPy
    dtype ``dtype`` (its ``to_numpy()``, a view where pandas keeps the columns
    in one block), in either case non-empty where ``check_array`` would
    require it. Everything else goes through ``check_array``, whose messages
    then name the problem.
    """
    if type(value) in (np.ndarray, np.memmap):
        if value.dtype != dtype or value.ndim != (2 if two_d else 1):
            return None
        arr = np.asarray(value)
    elif two_d and isinstance(value, DataFrame):
        if not all(isinstance(t, np.dtype) and t == dtype for t in value.dtypes):
            return None
        arr = value.to_numpy(copy=False)  # of ``dtype``: a frame with no columns fails below
    else:
        return None
    if two_d and (arr.shape[0] < 1 or arr.shape[1] < 1):
        return None
    return arr


def _as_host_array(
    value: Any, name: str, dtype: np.dtype, *, two_d: bool, finite: bool = True
) -> np.ndarray:
    plain = _plain_array(value, dtype, two_d)
    if plain is not None:
        # Already numbers of the stream's dtype: skip check_array's ~30-50 µs of
        # Python, paid per chunk on threads that share the interpreter lock with
        # the engine's thread, and its transposing copy of column-major input
        # (pandas frames from Parquet), 2-3x slower than as_row_major's on
        # chunks larger than the cache (rh_dask.row_major).
        value = as_row_major(plain)
        if finite:
            _assert_finite(value, name)
        return value
    try:
        arr = check_array(
            value,
            dtype=dtype,
            order="C",
            ensure_2d=two_d,
            ensure_all_finite=finite,
            ensure_min_samples=1 if two_d else 0,
            ensure_min_features=1,
            accept_sparse=False,
            input_name=name,
        )
    except ValidationError:
        raise
    except (TypeError, ValueError) as exc:
        named = _column_dtype_error(value, name, dtype)
        if named is not None:
            raise named from exc
        kind = InputTypeError if isinstance(exc, TypeError) else ValidationError
        raise kind(f"{name}: {exc}") from exc
    if not two_d and arr.ndim == 2 and arr.shape[1] == 1 and name == "y":
        # scikit-learn's convention for a single-output target: ravel, with a warning.
        warn_column_vector(name)
        return np.ascontiguousarray(arr.reshape(-1))
    if not two_d and arr.ndim != 1:
        if name == "y" and arr.ndim == 2:
            raise ValidationError(
                f"y must be 1-D, got shape {arr.shape} (only single-output regression "
                "is supported)"
            )
        if arr.ndim == 2 and arr.shape[1] == 1:
            raise ValidationError(
                f"{name} must be 1-D, got shape {arr.shape}; pass {name}.ravel()"
            )
        raise ValidationError(f"{name} must be 1-D, got shape {arr.shape}")
    return arr


def check_finite_batch(X: Any, y: Any) -> None:
    """The NaN and infinity scan of X and y that ``validate_batch(check_finite=False)`` skipped.

    For a batch validated before its engine was known (``engine="auto"``):
    the stream runs it once the engine turns out not to refuse such values
    itself. Device arrays are left to their engine.

    Raises
    ------
    ValidationError
        Naming the array, with the message ``validate_batch`` would give.
    """
    for name, value in (("X", X), ("y", y)):
        if not is_device_array(value):
            _assert_finite(value, name)


def _assert_finite(value: np.ndarray, name: str) -> None:
    """scikit-learn's NaN and infinity scan, its error as a ``ValidationError`` naming ``name``."""
    try:
        assert_all_finite(value, input_name=name)
    except ValueError as exc:
        raise ValidationError(f"{name}: {exc}") from exc


def validate_weights(sample_weight: Any, n: int, dtype: np.dtype) -> np.ndarray | None:
    """Finite, non-negative frequency weights with a positive sum (None = all ones)."""
    if sample_weight is None:
        return None
    if np.isscalar(sample_weight):
        sample_weight = np.full(n, sample_weight)
    w = _as_host_array(sample_weight, "sample_weight", dtype, two_d=False)
    if w.shape != (n,):
        raise ValidationError(f"sample_weight has shape {w.shape}, expected ({n},)")
    if np.any(w < 0):
        raise ValidationError("sample_weight must be non-negative")
    if not np.sum(w, dtype=np.float64) > 0:
        raise ValidationError(
            "sample_weight must have a positive sum, but all sample weights are zero"
        )
    return w


def check_n_features(n_features: int | None, expected: int | None, owner: str) -> None:
    """Refuse an ``X`` of ``n_features`` columns where ``owner`` expects ``expected``.

    Parameters
    ----------
    n_features : int or None
        Columns of the input; ``None`` when not known yet (passes).
    expected : int or None
        Columns of the stream; ``None`` before its first batch (passes).
    owner : str
        Who expects them, as the message names it (the estimator's class name,
        ``"the stream"`` for an engine).

    Raises
    ------
    ValidationError
        When both counts are known and differ.
    """
    if n_features is not None and expected is not None and n_features != expected:
        raise ValidationError(
            f"X has {n_features} features, but {owner} is expecting {expected} features as input."
        )


def check_width(X: Any, expected: int | None) -> None:
    """An engine's structural check of ``X`` (host or device): 2-D, ``expected`` columns wide.

    Raises
    ------
    ValidationError
        When ``X`` is not 2-D, or a known ``expected`` differs from its width.
    """
    if X.ndim != 2:
        raise ValidationError(f"X must be 2-D, got {X.ndim}-D")
    check_n_features(int(X.shape[1]), expected, "the stream")


def validate_features(
    X: Any,
    *,
    dtype: np.dtype | str,
    n_features: int | None,
    feature_names: np.ndarray | None,
    fitted: bool,
    owner: str = "RenewableHuberRegressor",
    check_finite: bool = True,
) -> tuple[np.ndarray, np.ndarray | None]:
    """Validate a host X (for fitting or predicting); return it and its names."""
    dtype = np.dtype(dtype)
    names = feature_names_of(X)
    check_feature_names(names, feature_names, fitted=fitted, owner=owner)
    arr = _as_host_array(X, "X", dtype, two_d=True, finite=check_finite)
    check_n_features(arr.shape[1], n_features, owner)
    return arr, names


def validate_batch(
    X: Any,
    y: Any,
    sample_weight: Any | None = None,
    *,
    dtype: np.dtype | str,
    n_features: int | None = None,
    feature_names: np.ndarray | None = None,
    fitted: bool = False,
    accept_device: bool = False,
    owner: str = "RenewableHuberRegressor",
    check_finite: bool = True,
) -> Batch:
    """Validate one batch for ``partial_fit``.

    Parameters
    ----------
    X, y, sample_weight
        The batch. ``sample_weight=None`` means all ones.
    dtype
        The stream's dtype; host inputs are cast to it.
    n_features, feature_names, fitted
        What the stream has seen so far (``fitted=False`` before the first batch).
    accept_device
        Whether CUDA arrays may pass through (the engine checks them).
    check_finite
        Whether to scan X and y for NaN and infinity. Only for an engine that
        refuses non-finite values itself (the GPU engine does, on the device,
        in its first pass over the batch): the scan is a full extra read of
        the batch on the host. Weights are always checked.

    Raises
    ------
    ValidationError
        Naming the first problem found.
    """
    dtype = np.dtype(dtype)
    device_inputs = [is_device_array(a) for a in (X, y, sample_weight) if a is not None]
    if any(device_inputs):
        if not accept_device:
            raise ValidationError(
                "got a CUDA device array, but this engine takes host (NumPy) arrays; "
                "copy it to the host first or use engine='gpu'"
            )
        if not all(device_inputs):
            raise ValidationError(
                "X, y and sample_weight must all be on the host or all on the device"
            )
        if fitted and len(X.shape) == 2:
            check_n_features(int(X.shape[1]), n_features, owner)
        return Batch(X, ravel_column_vector(y), sample_weight, None)
    X_arr, names = validate_features(
        X,
        dtype=dtype,
        n_features=n_features if fitted else None,
        feature_names=feature_names,
        fitted=fitted,
        owner=owner,
        check_finite=check_finite,
    )
    n = X_arr.shape[0]
    if y is None:
        raise ValidationError(
            f"{owner} requires y to be passed, but the target y is None (a regressor "
            "needs targets)"
        )
    y_arr = _as_host_array(y, "y", dtype, two_d=False, finite=check_finite)
    if y_arr.shape[0] != n:
        raise ValidationError(
            f"X and y have inconsistent numbers of rows: {n} and {y_arr.shape[0]}"
        )
    w = validate_weights(sample_weight, n, dtype)
    return Batch(X_arr, y_arr, w, names)
