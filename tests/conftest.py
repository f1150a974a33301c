"""Shared fixtures: reproducible regression streams and model snapshots."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest


@dataclass(frozen=True)
class Stream:
    """A synthetic linear stream: rows, targets, optional weights and the truth."""

    X: np.ndarray
    y: np.ndarray
    sample_weight: np.ndarray | None
    coef: np.ndarray
    intercept: float

    def batches(self, sizes: list[int]) -> list[tuple[np.ndarray, np.ndarray, Any]]:
        """Cut the rows, in order, into consecutive batches of the given sizes."""
        assert sum(sizes) == len(self.y), "batch sizes must cover the stream exactly"
        out = []
        start = 0
        for size in sizes:
            rows = slice(start, start + size)
            w = None if self.sample_weight is None else self.sample_weight[rows]
            out.append((self.X[rows], self.y[rows], w))
            start += size
        return out


def _make_stream(
    n: int = 400,
    d: int = 4,
    *,
    seed: int = 0,
    noise_df: float | None = 3.0,
    noise_scale: float = 1.0,
    outlier_fraction: float = 0.0,
    outlier_scale: float = 30.0,
    intercept: float = 0.5,
    weights: str | None = None,
    sparse: bool = False,
) -> Stream:
    """Gaussian features, Student-t (or Gaussian when ``noise_df`` is None) noise.

    ``weights``: None, "uniform" (positive reals), "integer" (0..3, zeros
    included) or "dyadic" (multiples of 1/4 in [0, 3], exact in float32).
    ``sparse`` zeroes about half of the true coefficients (L1 streams).
    """
    rng = np.random.default_rng(seed)
    coef = rng.normal(0.0, 1.0, size=d)
    if sparse:
        coef[rng.permutation(d)[: d // 2]] = 0.0
    X = rng.normal(size=(n, d))
    noise = rng.standard_normal(n) if noise_df is None else rng.standard_t(noise_df, size=n)
    y = X @ coef + intercept + noise_scale * noise
    if outlier_fraction:
        hit = rng.random(n) < outlier_fraction
        y[hit] += outlier_scale * rng.choice([-1.0, 1.0], size=int(hit.sum()))
    w = None
    if weights == "uniform":
        w = rng.uniform(0.2, 3.0, size=n)
    elif weights == "integer":
        w = rng.integers(0, 4, size=n).astype(np.float64)
        w[0] = 1.0  # every prefix batch keeps a positive weight sum
    elif weights == "dyadic":
        w = rng.integers(0, 13, size=n) / 4.0
        w[0] = 1.0
    elif weights is not None:
        raise ValueError(weights)
    return Stream(X, y, w, coef, intercept)


@pytest.fixture
def make_stream():
    """Factory of reproducible streams, see :func:`_make_stream`."""
    return _make_stream


def model_snapshot(model: Any) -> dict[str, Any]:
    """Everything observable about a (possibly unfitted) estimator's stream."""
    snap: dict[str, Any] = {"fitted": hasattr(model, "n_features_in_")}
    if not snap["fitted"]:
        return snap
    state = model.state_
    snap.update(
        coefficients=state.coefficients.copy(),
        information=state.information.copy(),
        score_variance=None if state.score_variance is None else state.score_variance.copy(),
        counters=state.counters(),
        # A model restored from a checkpoint has no last-batch diagnostics yet.
        diagnostics=getattr(model, "diagnostics_", None),
        n_features_in=model.n_features_in_,
        feature_names_in=getattr(model, "feature_names_in_", None),
        n_iter=getattr(model, "n_iter_", None),
        n_samples_seen=model.n_samples_seen_,
        engine=model.engine_,
        # β after every batch since the reset: a refused batch must not add a row.
        coef_history=model.coef_history_.copy(),
    )
    return snap


def assert_same_snapshot(before: dict[str, Any], after: dict[str, Any]) -> None:
    """Bit-for-bit equality of two :func:`model_snapshot` results."""
    assert before.keys() == after.keys()
    for key, value in before.items():
        other = after[key]
        if key == "feature_names_in":
            assert (value is None) == (other is None), key
            assert value is None or list(value) == list(other), key
        elif isinstance(value, np.ndarray):
            assert value.dtype == other.dtype, key
            assert value.shape == other.shape, key
            # array_equal treats -0.0 == 0.0; compare the bytes for bit identity.
            assert value.tobytes() == other.tobytes(), key
        else:
            assert value == other, key


@pytest.fixture
def snapshot():
    """Function taking a bit-exact snapshot of an estimator (see model_snapshot)."""
    return model_snapshot


@pytest.fixture
def assert_unchanged():
    """Function asserting two snapshots are bit-identical."""
    return assert_same_snapshot


class SendsInFlight:
    """How many file chunks this process was sending at once, at most (``most``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._now = 0
        self.most = 0

    def wrap(self, send: Any, seconds: float) -> Any:
        def slowed(sock: Any, chunk: Any, files: Any) -> Any:
            with self._lock:
                self._now += 1
                self.most = max(self.most, self._now)
            try:
                time.sleep(seconds)  # as a send that waits for its relay
                return send(sock, chunk, files)
            finally:
                with self._lock:
                    self._now -= 1

        return slowed


@pytest.fixture
def slowed_file_sends(monkeypatch):
    """Each file chunk's send slowed down; returns a :class:`SendsInFlight` counting them."""
    from rh_dask.distributed import push as push_module

    def slow(seconds: float) -> SendsInFlight:
        counter = SendsInFlight()
        send = push_module._send_file_chunk
        monkeypatch.setattr(push_module, "_send_file_chunk", counter.wrap(send, seconds))
        return counter

    return slow
