"""The NumPy engine's BLAS thread count: the rule, the setting, the restored count."""

from __future__ import annotations

import dask.config
import numpy as np
import pytest
from threadpoolctl import threadpool_info, threadpool_limits

from rh_dask import HuberConfig, NumpyEngine, ValidationError
from rh_dask.engines import make_engine
from rh_dask.engines import numpy_engine as numpy_engine_module
from rh_dask.engines.blas_threads import (
    SINGLE_THREAD_MAX_CORES,
    resolve_blas_threads,
    usable_cores,
)
from rh_dask.settings import SettingError


def _blas_counts() -> list[int]:
    return [pool["num_threads"] for pool in threadpool_info() if pool["user_api"] == "blas"]


def _stream(dtype: str = "float64", n: int = 3000, d: int = 6, seed: int = 3):
    step = n // 3
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((n, d)).astype(dtype)
    y = (X @ np.arange(1, d + 1) + rng.standard_t(2, n)).astype(dtype)
    return [(X[i : i + step], y[i : i + step]) for i in range(0, n, step)]


def test_auto_takes_one_thread_on_small_hosts_and_leaves_larger_ones_alone():
    assert resolve_blas_threads("auto", cores=1) == 1
    assert resolve_blas_threads("auto", cores=SINGLE_THREAD_MAX_CORES) == 1
    assert resolve_blas_threads("AUTO", cores=SINGLE_THREAD_MAX_CORES + 1) is None
    assert resolve_blas_threads(3, cores=1) == 3
    assert usable_cores() >= 1


@pytest.mark.parametrize("value", [0, -2, True, 1.5, "two", None])
def test_a_malformed_count_is_refused(value):
    with pytest.raises(ValidationError, match='"auto" or a whole number >= 1'):
        resolve_blas_threads(value)
    with pytest.raises(ValidationError):
        NumpyEngine(HuberConfig(), blas_threads=value)


@pytest.mark.parametrize("penalty", ["none", "l1"])
def test_calls_run_on_the_engines_count_and_restore_the_callers(monkeypatch, penalty):
    seen: list[list[int]] = []
    gram = numpy_engine_module._Batch.gram

    def recording_gram(batch):
        seen.append(_blas_counts())
        return gram(batch)

    monkeypatch.setattr(numpy_engine_module._Batch, "gram", recording_gram)
    engine = NumpyEngine(HuberConfig(penalty=penalty), blas_threads=1)
    with threadpool_limits(limits=2, user_api="blas"):
        before = _blas_counts()
        for X, y in _stream():
            engine.partial_fit(X, y)
        assert _blas_counts() == before
        engine.predict(X)
        assert _blas_counts() == before
    assert seen and all(counts == [1] * len(counts) for counts in seen)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_the_engines_count_decides_the_bits_whatever_the_callers(dtype):
    """The distributed walk pins one thread around engine calls: the engine's count wins."""
    results = []
    for outer in (1, 2, None):
        engine = NumpyEngine(HuberConfig(dtype=dtype), blas_threads=1)
        with threadpool_limits(limits=outer, user_api="blas"):
            for X, y in _stream(dtype, n=300_000, d=24):
                engine.partial_fit(X, y)
        results.append(engine.export_state())
    for other in results[1:]:
        np.testing.assert_array_equal(other.coefficients, results[0].coefficients)
        np.testing.assert_array_equal(other.information, results[0].information)
        np.testing.assert_array_equal(other.score_variance, results[0].score_variance)


def test_make_engine_reads_the_setting():
    with dask.config.set({"rh-dask.numpy.blas-threads": 2}):
        assert make_engine("numpy", HuberConfig()).blas_threads == 2
    with dask.config.set({"rh-dask.numpy.blas-threads": "auto"}):
        assert make_engine("numpy", HuberConfig()).blas_threads == resolve_blas_threads("auto")
    with dask.config.set({"rh-dask.numpy.blas-threads": "lots"}), pytest.raises(SettingError):
        make_engine("numpy", HuberConfig())
