"""The GPU engine's CPU-side behaviour: importable without CuPy, clear refusals.

These tests run everywhere (CI has no GPU); the device tests are in
tests/test_gpu_engine.py.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from devices import gpu_usable

import gpu_engine
from gpu_engine import layout
from gpu_engine.kernels import COMPILE_OPTIONS, KERNEL_NAMES, SOURCE
from rh_dask import HuberConfig, RenewableHuberRegressor
from rh_dask.core import LAMM_MAX_TRIALS, LAMM_MIN_PHI, LAMM_SLACK
from rh_dask.engines import make_engine
from rh_dask.exceptions import EngineUnavailableError, ValidationError


def test_engine_refuses_to_start_without_cupy_or_gpu():
    if gpu_usable():
        pytest.skip("a CUDA GPU is present: the refusal path cannot be exercised here")
    with pytest.raises(EngineUnavailableError, match=r"CuPy|GPU|CUDA"):
        gpu_engine.GpuEngine(HuberConfig())
    with pytest.raises(EngineUnavailableError, match=r"CuPy|GPU|CUDA"):
        make_engine("gpu", HuberConfig(), "cuda:0")
    X = np.random.default_rng(0).normal(size=(20, 3))
    with pytest.raises(EngineUnavailableError):
        RenewableHuberRegressor(engine="gpu").fit(X, X[:, 0])


def test_every_layout_constant_the_kernels_use_is_defined():
    source = SOURCE.read_text()
    used = set(re.findall(r"\bRH_[A-Z0-9_]+\b", source))
    defined = set(re.findall(r"#define (RH_[A-Z0-9_]+) ", layout.cuda_defines()))
    defined |= {o[2:].split("=")[0] for o in COMPILE_OPTIONS if o.startswith("-DRH_")}
    assert used <= defined, sorted(used - defined)
    for name in KERNEL_NAMES:
        assert re.search(rf"\b{name}\(", source), name


def test_the_kernels_get_the_contract_constants_from_core_exactly():
    defines = dict(o[2:].split("=") for o in COMPILE_OPTIONS if o.startswith("-D"))
    assert float(defines["RH_LAMM_SLACK"]) == LAMM_SLACK
    assert float(defines["RH_LAMM_MIN_PHI"]) == LAMM_MIN_PHI
    assert int(defines["RH_LAMM_MAX_TRIALS"]) == LAMM_MAX_TRIALS
    # No copy of them in the source, and no build without them.
    code = "\n".join(line.split("//")[0] for line in SOURCE.read_text().splitlines())
    assert not re.search(r"\b(1e-12|1e-0?8|40)\b", code)
    assert re.search(r"#if !defined\(RH_LAMM_SLACK\).*\n#error", code)


def test_control_block_fields_do_not_overlap():
    params = [v for k, v in vars(layout).items() if k.startswith("P_")]
    solver = [v for k, v in vars(layout).items() if k.startswith("S_")]
    ints = [v for k, v in vars(layout).items() if k.startswith("I_")]
    assert len(set(params)) == len(params) and max(params) < layout.N_PARAM
    assert len(set(solver)) == len(solver)
    assert layout.N_PARAM <= min(solver) and max(solver) < layout.N_DOUBLE
    assert len(set(ints)) == len(ints) and max(ints) < layout.N_INT
    # the status mirror copies the doubles and the ints as whole doubles
    assert layout.N_INT % 2 == 0
    # the contract's 27 backtracking steps fit in one warp; 40 LAMM trials in whole rounds
    assert 2.0**-layout.LINE_SEARCH_STEPS < 1e-8 <= 2.0 ** -(layout.LINE_SEARCH_STEPS - 1)
    assert layout.LINE_SEARCH_STEPS <= 32 and 40 % layout.LAMM_ROUND == 0


@pytest.mark.parametrize(
    "options, message",
    [
        ({"graphs": "false"}, "graphs must be True or False"),
        ({"hold_gil": 0}, "hold_gil must be True or False"),
        ({"cholesky": "lu"}, "cholesky must be"),
    ],
)
def test_engine_options_are_checked_before_the_device_is_touched(options, message):
    # Refused on every machine, with or without CuPy: the options are checked first.
    with pytest.raises(ValidationError, match=message):
        gpu_engine.GpuEngine(HuberConfig(), **options)


def test_partial_fit_stream_prefetches_one_batch_ahead_with_or_without_weights():
    """The stream's order of calls, with the device parts stood in (no CuPy needed)."""
    from contextlib import nullcontext
    from types import SimpleNamespace

    log: list = []

    class Inputs:
        def prefetch(self, X, y, w, n_features):
            log.append(("prefetch", X, w))

        def device_views(self, X, y, w, n_features):
            log.append(("views", X, w))
            return X, y, w, None

    class Batches:
        def steps(self, X, y, w, staged, counters, accumulate_k):
            log.append(("fit", X, w))
            return f"diagnostics {X}", SimpleNamespace(n_features_in=3), 10.0
            yield  # a generator that never needs its stream synchronised

    class State:
        counters = None

        def accumulates_k(self, enabled):
            return enabled

        def advance(self, counters, accumulated_k=None):
            self.counters = counters

    engine = object.__new__(gpu_engine.GpuEngine)
    engine._cp = SimpleNamespace(cuda=SimpleNamespace(Device=lambda index: nullcontext()))
    engine._device_id = 0
    engine._score_variance = True
    engine._inputs, engine._batches, engine._state = Inputs(), Batches(), State()
    engine._stream = nullcontext()
    engine._calls = SimpleNamespace(synchronize=lambda stream: log.append("sync"))
    stream = [("a", "ya"), ("b", "yb", "wb"), ("c", "yc")]
    assert list(engine.partial_fit_stream(stream)) == [
        "diagnostics a",
        "diagnostics b",
        "diagnostics c",
    ]
    assert log == [
        ("prefetch", "a", None),
        ("views", "a", None),
        ("prefetch", "b", "wb"),
        ("fit", "a", None),
        ("views", "b", "wb"),
        ("prefetch", "c", None),
        ("fit", "b", "wb"),
        ("views", "c", None),
        ("fit", "c", None),
    ]
    assert engine.last_batch_weight == 10.0  # what the last batch's steps reported
