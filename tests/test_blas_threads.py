"""The NumPy engine's threads: the setting, BLAS on one thread, the restored count."""

from __future__ import annotations

import os

import dask.config
import numpy as np
import pytest
from threadpoolctl import threadpool_info, threadpool_limits

from rh_dask import HuberConfig, NumpyEngine, ValidationError
from rh_dask.engines import make_engine
from rh_dask.engines import numpy_engine as numpy_engine_module
from rh_dask.engines import row_blocks as row_blocks_module
from rh_dask.engines.blas_threads import (
    blas_threads_in_force,
    last_level_cache_bytes,
    one_blas_thread,
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


def test_auto_is_measured_and_a_count_is_kept():
    assert resolve_blas_threads("auto") is None
    assert resolve_blas_threads(" AUTO ") is None
    assert resolve_blas_threads(3) == 3
    assert usable_cores() >= 1
    assert NumpyEngine(HuberConfig()).blas_threads is None


@pytest.mark.parametrize("value", [0, -2, True, 1.5, "two", None])
def test_a_malformed_count_is_refused(value):
    with pytest.raises(ValidationError, match='"auto" or a whole number >= 1'):
        resolve_blas_threads(value)
    with pytest.raises(ValidationError):
        NumpyEngine(HuberConfig(), blas_threads=value)


@pytest.mark.parametrize("penalty", ["none", "l1"])
@pytest.mark.parametrize("threads", [1, 2])
def test_calls_run_blas_on_one_thread_and_restore_the_callers(monkeypatch, penalty, threads):
    seen: list[list[int]] = []
    run_tasks = numpy_engine_module.run_tasks

    def recording(tasks, count):
        def watched(task):
            def run():
                seen.append(_blas_counts())
                return task()

            return run

        return run_tasks([watched(task) for task in tasks], count)

    monkeypatch.setattr(numpy_engine_module, "run_tasks", recording)
    monkeypatch.setattr(row_blocks_module, "MIN_BLOCK_BYTES", 4096)
    engine = NumpyEngine(HuberConfig(penalty=penalty), blas_threads=threads)
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
    """BLAS runs on one thread whatever the caller set, and the engine's count moves no bit."""
    results = []
    for outer, threads in ((1, 1), (2, 1), (None, 1), (4, 2), (1, 3)):
        engine = NumpyEngine(HuberConfig(dtype=dtype), blas_threads=threads)
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
        assert make_engine("numpy", HuberConfig()).blas_threads is None
    with dask.config.set({"rh-dask.numpy.blas-threads": "lots"}), pytest.raises(SettingError):
        make_engine("numpy", HuberConfig())


def test_one_blas_thread_holds_until_the_last_thread_leaves():
    """Thread counts are per process: one engine leaving must not lift another's limit."""
    import threading

    entered, release = threading.Event(), threading.Event()
    inside: list[int] = []

    def other() -> None:
        with one_blas_thread():
            entered.set()
            release.wait(10)
            inside.append(blas_threads_in_force())

    with threadpool_limits(limits=2, user_api="blas"):
        before = blas_threads_in_force()
        thread = threading.Thread(target=other)
        thread.start()
        assert entered.wait(10)
        with one_blas_thread():
            assert blas_threads_in_force() == 1
        assert blas_threads_in_force() == 1  # the other thread is still inside
        release.set()
        thread.join(10)
        assert inside == [1]
        assert blas_threads_in_force() == before


def _fake_cpu(root, cpu: int, caches: list[tuple[str, str]]) -> None:
    for i, (kind, size) in enumerate(caches):
        index = root / f"cpu{cpu}" / "cache" / f"index{i}"
        index.mkdir(parents=True)
        (index / "level").write_text(f"{min(i + 1, 3)}\n")
        (index / "type").write_text(kind + "\n")
        (index / "size").write_text(size + "\n")
        (index / "shared_cpu_list").write_text(f"{cpu}\n")


def test_the_last_level_cache_is_the_largest_data_cache_of_a_usable_core(tmp_path):
    cpu = min(os.sched_getaffinity(0))
    caches = [("Data", "48K"), ("Instruction", "4096K"), ("Unified", "2048K")]
    _fake_cpu(tmp_path, cpu, [*caches, ("Unified", "300M")])
    assert last_level_cache_bytes(tmp_path) == 300 << 20
    fewer = tmp_path / "fewer"
    _fake_cpu(fewer, cpu, caches)  # the instruction cache never counts
    assert last_level_cache_bytes(fewer) == 2 << 20
    assert last_level_cache_bytes(tmp_path / "absent") is None


# The dev box's 32 MiB keeps the 20 MiB it was measured at; the 16-core host's 300 MiB
# holds a reference float64 batch (24 MB); an unknown cache falls back to 20 MiB.
@pytest.mark.parametrize(
    ("cache", "fused_from"),
    [(32 << 20, 20 << 20), (300 << 20, 0.625 * (300 << 20)), (None, 20 << 20)],
)
def test_the_fused_pass_starts_at_a_share_of_the_hosts_cache(monkeypatch, cache, fused_from):
    monkeypatch.setattr(numpy_engine_module, "last_level_cache_bytes", lambda: cache)
    assert numpy_engine_module._fused_min_bytes() == int(fused_from)
    monkeypatch.setattr(numpy_engine_module, "FUSED_MIN_BYTES", 0)
    assert numpy_engine_module._fused_min_bytes() == 0
