"""Lazy prediction and out-of-core R² on Dask collections.

No actor is involved: the fitted coefficients are a few numbers, so they are
shipped with each chunk's task and applied where the chunk lives, in
parallel, on any worker (or the local scheduler).
"""

from __future__ import annotations

from typing import Any

import dask.array as da
import dask.dataframe as dd
import numpy as np
from dask.delayed import Delayed

from ..core import linear_predictor
from ..exceptions import ValidationError
from ..validation import (
    check_feature_names,
    check_n_features,
    feature_names_of,
    is_device_array,
    validate_features,
)
from .chunks import ChunkGraph, align_stream
from .graphs import List, Task, TaskRef
from .items import ChunkSpec
from .loading import chunk_parts, validate_chunk


def _predict_block(
    block: Any, beta: np.ndarray, fit_intercept: bool, dtype: str, n_features: int
) -> Any:
    if is_device_array(block):
        import cupy

        return linear_predictor(block, cupy.asarray(beta), fit_intercept)
    X, _ = validate_features(
        block, dtype=dtype, n_features=n_features, feature_names=None, fitted=True
    )
    return linear_predictor(X, beta, fit_intercept)


def _model_terms(model: Any) -> tuple[np.ndarray, bool, str, int]:
    """β, ``fit_intercept``, dtype and width of a fitted model, from its public state."""
    state = model.state_
    beta = state.coefficients
    return beta, state.fit_intercept, beta.dtype.name, state.n_features_in


def predict_dask(model: Any, X: Any) -> da.Array:
    """``model.predict`` for a Dask array or DataFrame: a lazy 1-D Dask array.

    Each chunk is validated (as in-memory ``predict`` validates) and predicted
    on its own; the result has ``X``'s row chunks (unknown lengths for a
    DataFrame with unknown partition lengths).
    """
    beta, fit_intercept, dtype, n_features = _model_terms(model)
    owner = type(model).__name__
    if isinstance(X, dd.DataFrame):
        names = feature_names_of(X._meta)
        check_feature_names(
            names, getattr(model, "feature_names_in_", None), fitted=True, owner=owner
        )
        X = X.to_dask_array()
    if not isinstance(X, da.Array) or X.ndim != 2:
        raise ValidationError(
            f"predict on a Dask collection needs a 2-D Dask array or a DataFrame, got {X!r}"
        )
    check_n_features(None if np.isnan(X.shape[1]) else int(X.shape[1]), n_features, owner)
    if X.numblocks[1] > 1:
        X = X.rechunk({1: -1})
    meta = np.empty((0,), dtype=dtype)
    return X.map_blocks(
        _predict_block,
        beta,
        fit_intercept,
        dtype,
        n_features,
        drop_axis=1,
        dtype=dtype,
        meta=meta,
    )


def _r2_terms(
    x_part: Any, y_part: Any, w_part: Any, spec: ChunkSpec, beta: np.ndarray, fit_intercept: bool
) -> np.ndarray:
    """One chunk's (weight, weighted mean of y, centred SS of y, SS of residuals)."""
    X, y_part, w_part = chunk_parts(x_part, y_part, w_part, spec)
    if X.shape[0] == 0:
        return np.zeros(4)
    batch = validate_chunk(X, y_part, w_part, spec)
    y = batch.y.astype(np.float64)
    pred = linear_predictor(batch.X, beta, fit_intercept).astype(np.float64)
    w = np.ones_like(y) if batch.sample_weight is None else batch.sample_weight.astype(np.float64)
    weight = float(w.sum())
    if weight == 0:
        return np.zeros(4)
    mean = float(w @ y) / weight
    return np.array([weight, mean, float(w @ (y - mean) ** 2), float(w @ (y - pred) ** 2)])


def _combine_r2(parts: list[np.ndarray]) -> float:
    """Merge per-chunk terms (Chan et al.'s pairwise update) into R².

    Centred sums are combined exactly rather than as Σwy² − (Σwy)²/Σw, which
    cancels catastrophically when the mean of y is large.
    """
    weight = mean = ss_tot = ss_res = 0.0
    for w_b, mean_b, ss_b, res_b in parts:
        if w_b == 0:
            continue
        total = weight + w_b
        delta = mean_b - mean
        ss_tot += ss_b + delta * delta * weight * w_b / total
        mean += delta * w_b / total
        weight = total
        ss_res += res_b
    if ss_tot == 0:
        # scikit-learn's convention for a constant target.
        return 1.0 if ss_res == 0 else 0.0
    return 1.0 - ss_res / ss_tot


def score_dask(model: Any, X: Any, y: Any, sample_weight: Any | None = None) -> float:
    """R² of ``model`` on a Dask stream, computed chunk by chunk out of core.

    Only four numbers per chunk leave the workers. Uses the default scheduler
    (the ``distributed`` client when there is one).
    """
    beta, fit_intercept, dtype, n_features = _model_terms(model)
    stream = align_stream(X, y, sample_weight)
    owner = type(model).__name__
    check_n_features(stream.n_features, n_features, owner)
    names = None if stream.feature_names is None else np.asarray(stream.feature_names, object)
    check_feature_names(names, getattr(model, "feature_names_in_", None), fitted=True, owner=owner)
    graph = ChunkGraph(
        stream,
        _r2_terms,
        lambda i: stream.spec(i, dtype, accept_device=False),
        (beta, fit_intercept),
        "rh-r2",
    )
    out_key = ("rh-r2-total", graph.keys[0][0])
    dsk = dict(graph.graph)
    dsk[out_key] = Task(out_key, _combine_r2, List(*(TaskRef(k) for k in graph.keys)))
    return float(Delayed(out_key, dsk).compute())
