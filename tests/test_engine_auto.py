"""engine="auto": the calibration's plan, decision rule, cache and rules, on simulated hosts.

A simulated host is a probe whose engines cost what a script says (a fixed
cost plus a cost per row and squared feature, optionally a drift of the
machine's speed, noise or a spike), with a clock that advances by exactly
those costs: the decisions below are pinned by the scripts, not by this
machine's speed.
"""

from __future__ import annotations

import dataclasses
import math
import os
import warnings

import dask.config
import numpy as np
import pytest

from rh_dask import HuberConfig
from rh_dask.engines.auto import (
    THREAD_VARIABLES,
    AutoCalibrator,
    EngineProbes,
    decide,
    default_calibrator,
    plan_probes,
    runtime_signature,
)
from rh_dask.engines.blas_threads import ProcessIdle
from rh_dask.exceptions import EngineUnavailableError, ValidationError
from rh_dask.settings import Settings

SETTINGS = Settings()


class Host:
    """A simulated machine: scripted engine costs and the clock they advance."""

    def __init__(
        self,
        numpy_cost,
        gpu_cost,
        *,
        drift: float = 0.0,
        spikes: dict[int, float] | None = None,
        gpu_unavailable: bool = False,
        fail_gpu_at: int | None = None,
        warmup: float = 0.0,
    ) -> None:
        self.cost = {"numpy": numpy_cost, "gpu": gpu_cost}
        self.drift = drift
        self.spikes = spikes or {}
        self.gpu_unavailable = gpu_unavailable
        self.fail_gpu_at = fail_gpu_at
        self.warmup = warmup
        self.now = 0.0
        self.calls: list[tuple[str, int]] = []
        self.built = 0

    def clock(self) -> float:
        return self.now

    def factory(self, config, n_features, max_rows, device, settings):
        self.built += 1
        if self.gpu_unavailable:
            raise EngineUnavailableError("engine='gpu' needs CuPy and a CUDA GPU: no CuPy")
        self.p = n_features + int(config.fit_intercept)
        self.max_rows = max_rows
        return self

    def time(self, engine: str, rows: int) -> float:
        index = len(self.calls)
        self.calls.append((engine, rows))
        if engine == "gpu" and self.fail_gpu_at == index:
            raise RuntimeError("cudaErrorLaunchFailure")
        seconds = self.cost[engine](rows, self.p) * (1.0 + self.drift) ** index
        seconds *= self.spikes.get(index, 1.0)
        if (engine, rows) not in self.calls[:-1]:  # a first batch of a shape: compile, capture
            seconds += self.warmup
        self.now += seconds
        return seconds


def linear(fixed: float, per_unit: float):
    """Cost of a batch: ``fixed + per_unit * rows * p**2`` seconds."""
    return lambda rows, p: fixed + per_unit * rows * p * p


def calibrator(host: Host) -> AutoCalibrator:
    return AutoCalibrator(host.factory, signature=lambda device: "host", clock=host.clock)


def choose(cal: AutoCalibrator, n: int, d: int, settings=SETTINGS, **config):
    return cal.choose(HuberConfig(**config), n, d, settings=settings)


# -- the plan ----------------------------------------------------------------------------------


def test_the_plan_is_four_sizes_up_to_the_batch_when_the_budget_allows():
    plan = plan_probes(4096, 16, budget_rows=262_144, rounds=3)
    assert plan.rows == (512, 1024, 2048, 4096)
    assert plan.batches_per_size == 7
    assert plan.rows_per_engine == 7 * (512 + 1024 + 2048 + 4096) <= 262_144


@pytest.mark.parametrize(("n", "d"), [(100_000, 90), (1_000_000, 32), (16_384, 256), (10**8, 4)])
def test_the_plan_shrinks_to_the_budget_before_anything_runs(n, d):
    plan = plan_probes(n, d, budget_rows=262_144, rounds=3)
    top = min(n, int(262_144 / (7 * 1.875)))
    assert plan.rows_per_engine <= 262_144
    assert list(plan.rows) == sorted(set(plan.rows)) and plan.rows[-1] <= top
    assert plan.rows[0] >= min(n, 16 * d)
    if top / 8 >= 16 * d:  # the floor does not bind
        assert plan.rows[-1] == top and len(plan.rows) == 4


def test_the_plan_keeps_a_floor_of_rows_and_merges_sizes():
    assert plan_probes(100, 300, budget_rows=262_144, rounds=1).rows == (100,)
    assert plan_probes(40_000, 3, budget_rows=10**6, rounds=1).rows == (
        5000,
        10_000,
        20_000,
        40_000,
    )
    assert plan_probes(800, 3, budget_rows=10**6, rounds=1).rows == (100, 200, 400, 800)
    assert plan_probes(300, 3, budget_rows=10**6, rounds=1).rows == (64, 75, 150, 300)
    wide = plan_probes(16_384, 256, budget_rows=131_072, rounds=3)
    assert wide.rows[0] == 4096 and len(wide.rows) == 3
    assert 0.9 * 131_072 < wide.rows_per_engine <= 131_072
    # A floor alone over the budget is kept: the plan is still known before measuring.
    assert plan_probes(10**6, 2000, budget_rows=10_000, rounds=1).rows == (32_000,)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, None])
def test_the_plan_refuses_counts_that_are_not_positive_ints(bad):
    with pytest.raises(ValidationError, match="must be an int >= 1"):
        plan_probes(1000, 4, budget_rows=1000, rounds=bad)


def test_the_calibration_runs_exactly_the_plan_in_alternating_pairs():
    host = Host(linear(0.0, 1e-9), linear(1e-4, 1e-10))
    choice = choose(calibrator(host), 100_000, 89)
    plan = choice.plan
    assert plan.rows_per_engine <= SETTINGS.auto_probe_rows
    for engine in ("numpy", "gpu"):
        mine = [rows for name, rows in host.calls if name == engine]
        assert len(mine) == plan.batches_per_engine
        assert sum(mine) == plan.rows_per_engine
    assert host.max_rows == max(plan.rows)
    per_size = 2 * plan.batches_per_size
    for k, rows in enumerate(plan.rows):
        calls = host.calls[k * per_size : (k + 1) * per_size]
        assert {r for _, r in calls} == {rows}
        timed = [name for name, _ in calls[2:]]
        firsts = timed[0::2]
        assert firsts.count("numpy") == firsts.count("gpu") == plan.rounds
        for a, b in zip(timed[0::2], timed[1::2], strict=True):
            assert {a, b} == {"numpy", "gpu"}
    assert [r for r, _ in choice.ratios] == list(plan.rows)


# -- the decisions on simulated hosts ----------------------------------------------------------


def test_a_gpu_whose_fixed_cost_dominates_small_batches_is_not_chosen():
    # NumPy 0.5 ns per row*p^2, the GPU 1.5 ms fixed + 0.05 ns: at 4096 x 17 NumPy takes 0.6 ms.
    host = Host(linear(2e-5, 5e-10), linear(1.5e-3, 5e-11))
    choice = choose(calibrator(host), 4096, 16)
    assert choice.engine == "numpy"
    assert choice.predicted_ratio > 1
    assert "more than" in choice.reason


def test_a_gpu_ten_times_faster_on_large_batches_is_chosen():
    host = Host(linear(1e-5, 1e-9), linear(1e-3, 1e-10))
    choice = choose(calibrator(host), 100_000, 90)
    assert choice.engine == "gpu"
    assert choice.predicted_ratio < 0.9
    assert "at most" in choice.reason
    assert choice.calibration_seconds == pytest.approx(host.now)


class SpinningProcess:
    """A process whose other threads keep ``cores`` busy for ``spin`` seconds of its clock."""

    def __init__(
        self,
        host: Host | None = None,
        *,
        idle: float = 0.1,
        spin: float = 0.13,
        cores: float = 15.0,
    ) -> None:
        self.host, self.idle_cores, self.cores = host, idle, cores
        self.wall, self.cpu, self.spin_until, self.spin = 0.0, 0.0, 0.0, spin
        self.slept: list[float] = []

    def now(self) -> float:
        return self.host.now if self.host is not None else self.wall

    def woke_blas(self) -> None:
        self.spin_until = self.now() + self.spin

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        start = self.now()
        spinning = max(0.0, min(self.spin_until - start, seconds))
        self.cpu += self.idle_cores * seconds + self.cores * spinning
        if self.host is not None:
            self.host.now += seconds
        else:
            self.wall += seconds

    def idle(self, **kwargs) -> ProcessIdle:
        return ProcessIdle(cpu=lambda: self.cpu, wall=self.now, sleep=self.sleep, **kwargs)


def test_process_idle_measures_busy_cores_and_waits_for_the_spin_to_end():
    proc = SpinningProcess()
    idle = proc.idle(step=0.01, margin=0.5)
    baseline = idle.busy()
    assert baseline == pytest.approx(0.1)
    proc.woke_blas()
    assert idle.busy() == pytest.approx(15.1)
    waited = idle.wait(baseline, 0.5)
    # Stops at the first step measured after the spin: 0.12-0.14 s of the 0.13 s left.
    assert 0.11 <= waited <= 0.13 + 0.01 + 1e-9
    assert idle.busy() <= baseline + 0.5


def test_process_idle_gives_up_after_its_bound_and_never_waits_at_zero():
    proc = SpinningProcess(spin=10.0)
    idle = proc.idle(step=0.01)
    proc.woke_blas()
    assert idle.wait(0.1, 0.2) == pytest.approx(0.2, abs=0.011)
    proc.slept.clear()
    assert idle.wait(0.1, 0.0) == 0.0 and proc.slept == []


class NumpyLastHost(Host):
    """A host whose NumPy probes leave the BLAS threads spinning (as OpenBLAS's do)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.process = SpinningProcess(self)

    def time(self, engine: str, rows: int) -> float:
        seconds = super().time(engine, rows)
        if engine == "numpy":
            self.process.woke_blas()
        return seconds


def test_a_gpu_choice_waits_for_the_numpy_probes_threads_and_counts_the_wait():
    host = NumpyLastHost(linear(1e-5, 1e-9), linear(1e-3, 1e-10))
    cal = AutoCalibrator(
        host.factory, signature=lambda device: "host", clock=host.clock, idle=host.process.idle()
    )
    choice = choose(cal, 100_000, 90)
    assert choice.engine == "gpu"
    assert host.calls[-1][0] == "numpy"  # the last probe ran NumPy: its threads spin
    assert 0.12 <= choice.settle_seconds <= 0.141
    assert choice.calibration_seconds == pytest.approx(host.now)
    # The first GPU stream starts with the process back at its baseline.
    assert host.process.idle().busy() == pytest.approx(0.1)
    # Cached decisions neither measure nor wait.
    host.process.slept.clear()
    again = choose(cal, 100_000, 90)
    assert again.cached and again.settle_seconds == 0.0 and host.process.slept == []


def test_a_numpy_choice_and_a_zero_settle_do_not_wait():
    host = NumpyLastHost(linear(2e-5, 5e-10), linear(1.5e-3, 5e-11))
    cal = AutoCalibrator(
        host.factory, signature=lambda device: "host", clock=host.clock, idle=host.process.idle()
    )
    choice = choose(cal, 4096, 16)
    assert choice.engine == "numpy" and choice.settle_seconds == 0.0
    assert host.process.slept == [0.01]  # the baseline only
    host = NumpyLastHost(linear(1e-5, 1e-9), linear(1e-3, 1e-10))
    cal = AutoCalibrator(
        host.factory, signature=lambda device: "host", clock=host.clock, idle=host.process.idle()
    )
    off = dataclasses.replace(SETTINGS, auto_settle=0.0)
    choice = choose(cal, 100_000, 90, off)
    assert choice.engine == "gpu" and choice.settle_seconds == 0.0
    assert host.process.slept == []


def test_process_idle_sees_this_process_blas_threads_spin():
    """This BLAS: a threaded product leaves threads busy, and the wait sees them stop."""
    from threadpoolctl import threadpool_limits

    idle = ProcessIdle()
    baseline = idle.busy()
    a = np.random.default_rng(0).standard_normal((1500, 1500))
    with threadpool_limits(limits=2, user_api="blas"):
        a @ a
        spinning = idle.busy()
    if spinning <= baseline + idle.margin:
        pytest.skip(f"this BLAS does not spin after a threaded call ({spinning:.2f} cores busy)")
    waited = idle.wait(baseline, 5.0)
    assert waited < 5.0
    assert idle.busy() <= baseline + idle.margin + 0.5


def test_a_gpu_only_slightly_faster_stays_within_the_allowance():
    host = Host(linear(0.0, 1e-9), linear(0.0, 0.95e-9))
    choice = choose(calibrator(host), 50_000, 30)
    assert choice.predicted_ratio == pytest.approx(0.95, rel=1e-9)
    assert choice.engine == "numpy"
    looser = dataclasses.replace(SETTINGS, auto_allowance=0.02)
    assert (
        choose(calibrator(Host(host.cost["numpy"], host.cost["gpu"])), 50_000, 30, looser).engine
        == "gpu"
    )


def test_an_advantage_beyond_the_largest_probe_is_not_extrapolated():
    # The GPU's fixed cost makes it slower on the probes (capped at ~20k rows by the budget),
    # though a line in log n would promise it the win at 10M rows.
    host = Host(linear(0.0, 1e-9), linear(2e-3, 2e-10))
    choice = choose(calibrator(host), 10_000_000, 9)
    top = max(choice.plan.rows)
    assert top < 10_000_000
    at_top = host.cost["gpu"](top, 10) / host.cost["numpy"](top, 10)
    assert at_top > 1
    assert choice.predicted_ratio == pytest.approx(at_top, rel=0.05)
    assert choice.engine == "numpy"


def test_a_gpu_that_gets_worse_with_size_is_extrapolated():
    host = Host(linear(1e-3, 1e-10), lambda rows, p: 2e-4 + 1e-13 * rows**2 * p * p)
    choice = choose(calibrator(host), 1_000_000, 9)
    top = max(choice.plan.rows)
    at_top = host.cost["gpu"](top, 10) / host.cost["numpy"](top, 10)
    assert choice.predicted_ratio > at_top
    assert choice.engine == "numpy"


def test_a_drifting_machine_favours_neither_engine():
    # Every call 2 % slower than the last: the one measured second in a pair looks slower.
    host = Host(linear(0.0, 1e-9), linear(0.0, 1e-9), drift=0.02)
    choice = choose(calibrator(host), 20_000, 20)
    for _, ratio in choice.ratios:
        assert ratio == pytest.approx(1.0, abs=0.01)
    assert choice.engine == "numpy"


def test_a_stall_only_pushes_the_decision_towards_numpy():
    costs = (linear(0.0, 1e-9), linear(1e-4, 2e-10))
    clean = choose(calibrator(Host(*costs)), 20_000, 20)
    assert clean.engine == "gpu"
    # Call 5 is a timed NumPy batch of the first size: a 50x stall makes the GPU look better
    # in one round, which the largest-over-rounds estimate ignores.
    numpy_stall = Host(*costs, spikes={5: 50.0})
    stalled = choose(calibrator(numpy_stall), 20_000, 20)
    assert numpy_stall.calls[5][0] == "numpy"
    assert stalled.ratios == clean.ratios
    # Call 4 is a timed GPU batch: its stall makes that size look worse for the GPU.
    gpu_stall = Host(*costs, spikes={4: 50.0})
    stalled = choose(calibrator(gpu_stall), 20_000, 20)
    assert gpu_stall.calls[4][0] == "gpu"
    assert stalled.ratios[0][1] > 5 * clean.ratios[0][1]
    assert stalled.ratios[1:] == clean.ratios[1:]


def test_two_equal_engines_on_a_noisy_machine_give_numpy():
    # An A/A test: the same cost on both sides, each call off by up to +-40 %.
    rng = np.random.default_rng(3)

    def noisy(rows, p):
        return 1e-9 * rows * p * p * float(rng.uniform(0.6, 1.4))

    for seed in range(20):
        rng = np.random.default_rng(seed)
        choice = choose(calibrator(Host(noisy, noisy)), 100_000, 90)
        assert choice.engine == "numpy", (seed, choice.ratios)


def test_no_gpu_here_means_numpy_and_says_why():
    host = Host(linear(0.0, 1e-9), linear(0.0, 1e-12), gpu_unavailable=True)
    choice = choose(calibrator(host), 100_000, 90)
    assert choice.engine == "numpy"
    assert "cannot start here" in choice.reason and "CuPy" in choice.reason
    assert host.calls == []


def test_a_gpu_failing_during_the_calibration_is_not_chosen():
    host = Host(linear(0.0, 1e-9), linear(0.0, 1e-12), fail_gpu_at=11)
    choice = choose(calibrator(host), 100_000, 90)
    assert choice.engine == "numpy"
    assert "cudaErrorLaunchFailure" in choice.reason


def test_the_deadline_stops_the_calibration():
    # Each NumPy batch of the smallest size takes 0.5 s: the 2 s deadline passes in the first size.
    host = Host(lambda rows, p: rows / 2500.0, linear(0.0, 1e-12))
    choice = choose(calibrator(host), 20_000, 4)
    assert choice.engine == "numpy"
    assert "deadline" in choice.reason
    assert len(choice.ratios) == 1
    # A deadline passed after two sizes decides from those two.
    host = Host(lambda rows, p: rows / 8000.0, lambda rows, p: rows / 80000.0)
    choice = choose(calibrator(host), 20_000, 4)
    assert len(choice.ratios) == 2
    assert choice.engine == "gpu"


def test_start_up_and_warm_ups_do_not_count_towards_the_deadline():
    # Ten seconds to compile and capture each new shape: the timed batches are fast.
    host = Host(linear(1e-5, 1e-9), linear(1e-4, 1e-10), warmup=10.0)
    choice = choose(calibrator(host), 100_000, 90)
    assert len(choice.ratios) == 4 and choice.engine == "gpu"
    assert choice.calibration_seconds > 80


def test_decide_fits_a_line_in_log_rows():
    ratios = [(1000, 2.0), (2000, 1.0), (4000, 0.5)]
    engine, predicted = decide(ratios, 2000, 0.1)
    assert predicted == pytest.approx(1.0) and engine == "numpy"
    engine, predicted = decide(ratios, 4000, 0.1)
    assert predicted == pytest.approx(0.5) and engine == "gpu"
    # Beyond 4000 rows the favourable slope is not followed.
    assert decide(ratios, 64_000, 0.1)[1] == pytest.approx(0.5)
    assert decide([(1000, 0.8)], 10**6, 0.1) == ("gpu", pytest.approx(0.8))
    with pytest.raises(ValidationError, match="allowance"):
        decide(ratios, 2000, 1.0)
    with pytest.raises(ValidationError, match="not finite"):
        decide([(1000, math.nan)], 2000, 0.1)
    with pytest.raises(ValidationError, match="no probe ratios"):
        decide([], 2000, 0.1)


# -- rules that need no measurement ------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "engine", "words"),
    [
        ({"device_input": True}, "gpu", "on a CUDA device"),
        ({"device": "cuda:1"}, "gpu", "names a CUDA device"),
        ({"device": 0}, "numpy", "not a CUDA device"),
        ({"device": "cpu"}, "numpy", "not a CUDA device"),
    ],
)
def test_rules_decide_without_measuring(kwargs, engine, words):
    host = Host(linear(0.0, 1.0), linear(0.0, 1.0))
    choice = calibrator(host).choose(HuberConfig(), 1000, 3, settings=SETTINGS, **kwargs)
    assert (choice.engine, host.built) == (engine, 0)
    assert words in choice.reason


def test_calibration_off_means_numpy():
    host = Host(linear(0.0, 1.0), linear(0.0, 1e-9))
    off = dataclasses.replace(SETTINGS, auto_calibrate=False)
    choice = choose(calibrator(host), 100_000, 90, settings=off)
    assert choice.engine == "numpy" and host.built == 0


# -- the cache ---------------------------------------------------------------------------------


def test_a_decision_is_cached_per_shape_class():
    host = Host(linear(1e-5, 1e-9), linear(1e-3, 1e-10))
    cal = calibrator(host)
    first = choose(cal, 100_000, 90)
    again = choose(cal, 110_000, 90)  # same power of two of rows
    assert again.cached and not first.cached
    assert again.engine == first.engine and again.calibration_seconds == 0.0
    assert host.built == 1
    for other in (
        dict(n=300_000, d=90),
        dict(n=100_000, d=91),
        dict(n=100_000, d=90, dtype="float32"),
        dict(n=100_000, d=90, penalty="l1"),
        dict(n=100_000, d=90, fit_intercept=False),
    ):
        n, d = other.pop("n"), other.pop("d")
        assert not choose(cal, n, d, **other).cached
    assert host.built == 6 and cal.cached == 6


def test_a_changed_runtime_signature_discards_the_cache():
    host = Host(linear(1e-5, 1e-9), linear(1e-3, 1e-10))
    signature = {"value": "a"}
    cal = AutoCalibrator(
        host.factory, signature=lambda device: signature["value"], clock=host.clock
    )
    choose(cal, 100_000, 90)
    choose(cal, 4096, 16)
    assert cal.cached == 2
    signature["value"] = "b"
    assert not choose(cal, 100_000, 90).cached
    assert cal.cached == 1 and host.built == 3


def test_the_runtime_signature_sees_threads_affinity_and_device(monkeypatch):
    base = runtime_signature()
    assert base.pid == os.getpid()
    assert runtime_signature() == base
    assert runtime_signature("cuda:1") != base
    for name in THREAD_VARIABLES[:3]:
        monkeypatch.setenv(name, "3")
        assert runtime_signature() != base
        monkeypatch.delenv(name)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert runtime_signature() != base
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    if hasattr(os, "sched_getaffinity"):
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
        assert runtime_signature().affinity == (0,)
        monkeypatch.undo()
    threadpoolctl = pytest.importorskip("threadpoolctl")
    if base.threadpools:
        with threadpoolctl.threadpool_limits(1):
            limited = runtime_signature()
        assert limited != base
        assert all(n == 1 for _, _, n in limited.threadpools)
    assert runtime_signature() == dataclasses.replace(base)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_starts_without_decisions(monkeypatch):
    cal = default_calibrator()
    host = Host(linear(1e-5, 1e-9), linear(1e-3, 1e-10))
    monkeypatch.setattr(cal, "_factory", host.factory)
    try:
        choose(cal, 100_000, 90)
        assert cal.cached >= 1
        pid = os.fork()
        if pid == 0:  # the child: report through the exit status only
            os._exit(0 if cal.cached == 0 else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert cal.cached >= 1
    finally:
        cal.forget()


def test_the_real_probe_without_a_gpu_says_so():
    pytest.importorskip("numpy")
    try:
        import cupy  # noqa: F401

        pytest.skip("a CUDA stack is installed here")
    except ImportError:
        pass
    with pytest.raises(EngineUnavailableError, match="CuPy"):
        EngineProbes(HuberConfig(), 4, 512)
    choice = AutoCalibrator().choose(HuberConfig(), 4096, 4, settings=SETTINGS)
    assert choice.engine == "numpy" and "cannot start here" in choice.reason


def test_the_real_probe_times_the_numpy_engine():
    probes = EngineProbes.__new__(EngineProbes)
    from rh_dask.engines import NumpyEngine

    config = HuberConfig()
    rng = np.random.default_rng(0)
    probes._X = rng.standard_normal((256, 3))
    probes._y = probes._X @ [1.0, 2.0, 3.0]
    probes._engines = {"numpy": NumpyEngine(config)}
    first, second = probes.time("numpy", 256), probes.time("numpy", 128)
    assert first > 0 and second > 0
    assert probes._engines["numpy"].n_samples_seen == 128


def test_unavailability_is_remembered_for_every_shape():
    host = Host(linear(0.0, 1e-9), linear(0.0, 1e-12), gpu_unavailable=True)
    cal = calibrator(host)
    assert choose(cal, 100_000, 90).engine == "numpy"
    later = choose(cal, 4096, 16)
    assert later.engine == "numpy" and later.cached and "cannot start here" in later.reason
    assert host.built == 1


# -- the estimator -----------------------------------------------------------------------------


@pytest.fixture
def fresh_cache():
    cal = default_calibrator()
    cal.forget()
    yield cal
    cal.forget()


def _batches(n=600, d=3, parts=3):
    rng = np.random.default_rng(11)
    X = rng.normal(size=(n, d))
    y = X @ np.arange(1.0, d + 1) + rng.standard_t(3, size=n)
    return list(zip(np.array_split(X, parts), np.array_split(y, parts), strict=True))


def no_gpu_engine(monkeypatch) -> None:
    """Make every GPU engine fail to start, as on a host whose CUDA driver cannot run it."""
    import rh_dask.distributed.actor
    import rh_dask.engines
    import rh_dask.stream

    real = rh_dask.engines.make_engine

    def no_gpu(name, config, device=None, **kwargs):
        if name == "gpu":
            raise EngineUnavailableError("engine='gpu' needs CuPy and a CUDA GPU: scripted")
        return real(name, config, device, **kwargs)

    for module in (rh_dask.engines, rh_dask.stream, rh_dask.distributed.actor):
        monkeypatch.setattr(module, "make_engine", no_gpu)


def _has_gpu() -> bool:
    try:
        import cupy  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.skipif(_has_gpu(), reason="checks the machine without a GPU")
def test_the_estimator_chooses_once_per_stream_and_says_why(fresh_cache):
    from rh_dask import RenewableHuberRegressor

    model = RenewableHuberRegressor()
    for X, y in _batches():
        model.partial_fit(X, y)
    assert model.engine_ == "numpy"
    choice = model.engine_choice_
    assert choice.engine == "numpy" and "cannot start here" in choice.reason
    assert RenewableHuberRegressor(engine="numpy").fit(*_batches()[0]).engine_choice_ is None


def test_a_measured_gpu_choice_that_fails_to_start_falls_back_to_numpy(fresh_cache, monkeypatch):
    from rh_dask import RenewableHuberRegressor
    from rh_dask.engines import auto

    host = Host(linear(1e-5, 1e-9), linear(0.0, 1e-11))
    monkeypatch.setattr(fresh_cache, "_factory", host.factory)

    no_gpu_engine(monkeypatch)
    batches = _batches()
    model = RenewableHuberRegressor()
    with pytest.warns(RuntimeWarning, match="chose the GPU engine.*runs on the NumPy engine"):
        model.partial_fit(*batches[0])
    for X, y in batches[1:]:
        model.partial_fit(X, y)
    assert model.engine_ == "numpy"
    choice = model.engine_choice_
    assert choice.engine == "numpy" and "scripted" in choice.fallback
    assert choice.predicted_ratio < 1 and isinstance(choice, auto.AutoChoice)
    reference = RenewableHuberRegressor(engine="numpy")
    for X, y in batches:
        reference.partial_fit(X, y)
    np.testing.assert_array_equal(model.coef_, reference.coef_)

    # A rule's choice (a CUDA device named) and an explicit engine never fall back.
    for params in ({"device": "cuda"}, {"engine": "gpu"}):
        other = RenewableHuberRegressor(**params)
        with pytest.raises(EngineUnavailableError, match="scripted"):
            other.partial_fit(*batches[0])
        assert not hasattr(other, "coef_")


def _scripted_gpu_choice(cal, monkeypatch):
    """A calibration that chooses the GPU engine, served by a NumPy stand-in named "gpu".

    The stand-in refuses non-finite values itself, as the GPU engine does on
    the device; it records the batches it was handed.
    """
    import rh_dask.engines
    import rh_dask.stream
    from rh_dask import NumpyEngine

    host = Host(linear(1e-5, 1e-9), linear(0.0, 1e-11))
    monkeypatch.setattr(cal, "_factory", host.factory)
    seen = []

    class _StandInGpu(NumpyEngine):
        name = "gpu"

        def partial_fit(self, X, y, sample_weight=None):
            seen.append(bool(np.isfinite(X).all() and np.isfinite(y).all()))
            if not seen[-1]:
                raise ValidationError("non-finite values (refused by the stand-in GPU engine)")
            return super().partial_fit(X, y, sample_weight)

    real = rh_dask.engines.make_engine

    def make(name, config, device=None, **kwargs):
        return _StandInGpu(config) if name == "gpu" else real(name, config, device, **kwargs)

    monkeypatch.setattr(rh_dask.stream, "make_engine", make)
    return seen


@pytest.mark.parametrize("where", ["X", "y"])
@pytest.mark.parametrize("method", ["fit", "partial_fit"])
def test_auto_choosing_the_gpu_leaves_the_nan_scan_to_the_engine(
    fresh_cache, monkeypatch, method, where
):
    from rh_dask import RenewableHuberRegressor

    seen = _scripted_gpu_choice(fresh_cache, monkeypatch)
    (X, y), (X2, y2) = _batches()[:2]
    X, y = X.copy(), y.copy()
    (X if where == "X" else y)[3] = np.nan
    model = RenewableHuberRegressor()
    with pytest.raises(ValidationError, match="stand-in"):
        getattr(model, method)(X, y)
    assert seen == [False]  # no host scan: the engine saw the batch and refused it
    assert not hasattr(model, "coef_")
    model.partial_fit(X2, y2)
    assert model.engine_ == "gpu" and seen == [False, True]


@pytest.mark.parametrize("case", ["numpy measured faster", "gpu chosen, fell back"])
@pytest.mark.parametrize("method", ["fit", "partial_fit"])
def test_auto_on_numpy_still_refuses_nan_before_the_engine(fresh_cache, monkeypatch, method, case):
    from rh_dask import RenewableHuberRegressor

    if case == "numpy measured faster":
        host = Host(linear(0.0, 1e-11), linear(1e-5, 1e-9))
        monkeypatch.setattr(fresh_cache, "_factory", host.factory)
    else:
        host = Host(linear(1e-5, 1e-9), linear(0.0, 1e-11))
        monkeypatch.setattr(fresh_cache, "_factory", host.factory)
        no_gpu_engine(monkeypatch)
    (X, y), _ = _batches()[:2]
    X = X.copy()
    X[0, 1] = np.inf
    model = RenewableHuberRegressor()
    with pytest.raises(ValidationError, match="X: Input X contains infinity"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # the fallback's warning
            getattr(model, method)(X, y)
    assert not hasattr(model, "coef_")
    X[0, 1] = 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        model.partial_fit(X, y)
    assert model.engine_ == "numpy"


def test_check_finite_batch_names_the_array_and_skips_device_arrays():
    from rh_dask.validation import check_finite_batch

    X, y = np.ones((3, 2)), np.ones(3)
    check_finite_batch(X, y)
    with pytest.raises(ValidationError, match=r"^y: Input y contains NaN"):
        check_finite_batch(X, np.array([1.0, np.nan, 2.0]))


def test_calibration_off_in_dask_config_means_numpy_without_settings_passed():
    host = Host(linear(0.0, 1.0), linear(0.0, 1e-9))
    with dask.config.set({"rh-dask.engine.auto.calibrate": False}):
        choice = calibrator(host).choose(HuberConfig(), 100_000, 90)
    assert choice.engine == "numpy" and host.built == 0
    assert "calibrate is off" in choice.reason
