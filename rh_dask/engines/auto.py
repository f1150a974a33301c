"""``engine="auto"``: NumPy or GPU, decided once per stream by a bounded, measured calibration.

The decision is made from the first batch's shape (rows n, features d,
dtype, penalty). Where it is not a question of speed it is a rule:

* a batch already on a CUDA device, or ``device="cuda[:N]"``: the GPU engine;
* ``device="cpu"``, or the ``rh-dask.engine.auto.calibrate`` setting off:
  the NumPy engine;
* a GPU engine that cannot start here (no CuPy, no device): the NumPy engine.

Otherwise both engines are timed on synthetic batches of the stream's
shape. The plan is fixed before anything is measured (:func:`plan_probes`):
four probe sizes, n/8, n/4, n/2 and n rows, scaled down together until each
engine's rows, warm-ups included, fit the ``probe-rows`` budget. Each size
runs one untimed warm-up batch per engine, then ``rounds`` rounds of two
timed pairs, NumPy then GPU and GPU then NumPy, so that a drift of the
machine's speed or a cache warmed by the first of a pair favours neither:
a round's estimate is the mean of its two log ratios log(t_gpu / t_numpy),
a size's the largest over its rounds (the GPU must win every round: noise,
a stall of either engine, can only push the decision towards NumPy). These
are fitted by a line in log n, which predicts the ratio at the batch's n,
never extrapolating an advantage of the GPU beyond the largest probe (its
slope is taken as zero there when it favours the GPU). The GPU engine is
chosen when the predicted ratio is at most ``1 - allowance``: a conservative
margin, since a wrong GPU choice also pays the GPU's start-up. A calibration
whose timed batches have taken longer than its ``deadline`` (checked after
each size; the engines' start-up and the warm-ups, where the GPU compiles
and captures, do not count, and the rows budget is the hard bound) stops and
decides from the sizes it finished (NumPy with fewer than two).

Decisions are cached per shape class (d, dtype, penalty, fit_intercept and
n to the nearest power of two) for the runtime signature that measured them
(:func:`runtime_signature`: process id, CPU affinity, the BLAS/OpenMP thread
variables, the thread pools threadpoolctl sees, the CUDA device); a changed
signature discards the cache, and a forked child starts with none. Nothing
is written to a file.
"""

from __future__ import annotations

import math
import os
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from ..config import HuberConfig
from ..exceptions import EngineUnavailableError, ValidationError
from .blas_threads import ProcessIdle

__all__ = [
    "THREAD_VARIABLES",
    "AutoCalibrator",
    "AutoChoice",
    "EngineProbes",
    "Probe",
    "ProbePlan",
    "RuntimeSignature",
    "choose_engine",
    "decide",
    "default_calibrator",
    "plan_probes",
    "runtime_signature",
    "start_chosen",
]

#: Environment variables that set the BLAS and OpenMP thread counts: part of the signature.
THREAD_VARIABLES = (
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "BLIS_NUM_THREADS",
    "VECLIB_MAXIMUM_THREADS",
)
#: Relative probe sizes: fractions of the (possibly scaled-down) batch rows.
_FRACTIONS = (0.125, 0.25, 0.5, 1.0)
#: The smallest probe: enough rows for the solve to do its usual work.
_MIN_ROWS = 64
#: Rows per feature below which a probe is a harder problem than a real batch: with few
#: rows per parameter the Newton solve needs many more iterations (on the H200 a
#: 1248 x 256 probe took 4x longer than a 2496 x 256 one, on both engines).
_ROWS_PER_FEATURE = 16


# -- runtime signature -------------------------------------------------------------------------


@dataclass(frozen=True)
class RuntimeSignature:
    """What a calibration's timings depend on besides the batch shape.

    Attributes
    ----------
    pid : int
        The process that measured.
    affinity : tuple of int or None
        The CPUs it may run on (``None`` where the platform cannot say).
    thread_variables : tuple of (str, str or None)
        :data:`THREAD_VARIABLES` and their values.
    threadpools : tuple of (str, str, int)
        ``(user_api, internal_api, num_threads)`` of each thread pool
        threadpoolctl sees (empty without threadpoolctl).
    cuda_device : str
        The device asked for and ``CUDA_VISIBLE_DEVICES``.
    """

    pid: int
    affinity: tuple[int, ...] | None
    thread_variables: tuple[tuple[str, str | None], ...]
    threadpools: tuple[tuple[str, str, int], ...]
    cuda_device: str


_controller_lock = threading.Lock()
_controller: tuple[int, Any] | None = None


def _threadpools() -> tuple[tuple[str, str, int], ...]:
    """The thread pools of this process's BLAS/OpenMP libraries and their current sizes.

    The libraries are found once per process (the slow part); their thread
    counts are read each time, so a ``threadpool_limits`` in force shows.
    """
    global _controller
    try:
        from threadpoolctl import ThreadpoolController
    except ImportError:
        return ()
    with _controller_lock:
        if _controller is None or _controller[0] != os.getpid():
            _controller = (os.getpid(), ThreadpoolController())
        controller = _controller[1]
    return tuple(
        (lib.user_api, lib.internal_api, int(lib.num_threads))
        for lib in controller.lib_controllers
    )


def runtime_signature(device: Any = None) -> RuntimeSignature:
    """The :class:`RuntimeSignature` of this process now, for ``device``."""
    try:
        affinity: tuple[int, ...] | None = tuple(sorted(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        affinity = None
    return RuntimeSignature(
        pid=os.getpid(),
        affinity=affinity,
        thread_variables=tuple((name, os.environ.get(name)) for name in THREAD_VARIABLES),
        threadpools=_threadpools(),
        cuda_device=f"{device!r}; CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')}",
    )


# -- the probe plan ----------------------------------------------------------------------------


@dataclass(frozen=True)
class ProbePlan:
    """What a calibration will run, fixed before anything is timed.

    Attributes
    ----------
    rows : tuple of int
        Rows of each probe size, ascending.
    n_features : int
        Features of every probe batch.
    rounds : int
        Rounds per size, each two timed pairs in both orders (each engine
        also runs one untimed warm-up batch per size).
    """

    rows: tuple[int, ...]
    n_features: int
    rounds: int

    @property
    def batches_per_size(self) -> int:
        """Probe batches each engine runs at each size: the warm-up and two per round."""
        return 1 + 2 * self.rounds

    @property
    def rows_per_engine(self) -> int:
        """Rows each engine consumes in the whole calibration, warm-ups included."""
        return self.batches_per_size * sum(self.rows)

    @property
    def batches_per_engine(self) -> int:
        """Probe batches each engine runs, warm-ups included."""
        return self.batches_per_size * len(self.rows)


def plan_probes(n_rows: int, n_features: int, *, budget_rows: int, rounds: int) -> ProbePlan:
    """The probe sizes for a first batch of ``n_rows`` × ``n_features``.

    The sizes are n/8, n/4, n/2 and n rows, each at least
    ``min(n, max(64, 16 * n_features))`` rows (a probe with fewer rows per
    feature solves a harder problem than the batch; duplicates merged),
    scaled down together until :attr:`ProbePlan.rows_per_engine` is at most
    ``budget_rows``. Only a floor alone over the budget (a very wide batch)
    takes the plan past it; either way the cost is known before measuring.

    Raises
    ------
    ValidationError
        When a count is not an int >= 1.
    """
    for name, value in (
        ("n_rows", n_rows),
        ("n_features", n_features),
        ("budget_rows", budget_rows),
        ("rounds", rounds),
    ):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValidationError(f"{name} must be an int >= 1, got {value!r}")
    floor = min(int(n_rows), max(_MIN_ROWS, _ROWS_PER_FEATURE * int(n_features)))
    per_row = (1 + 2 * rounds) * sum(_FRACTIONS)
    top = min(int(n_rows), int(budget_rows / per_row))
    while True:
        rows = sorted({max(floor, int(top * f)) for f in _FRACTIONS})
        if (1 + 2 * rounds) * sum(rows) <= budget_rows or top <= floor:
            break
        top = max(floor, int(top * 0.95))
    return ProbePlan(rows=tuple(rows), n_features=int(n_features), rounds=int(rounds))


# -- timing ------------------------------------------------------------------------------------


class Probe(Protocol):
    """Times one batch of an engine: ``seconds = probe.time(engine_name, rows)``."""

    def time(self, engine: str, rows: int) -> float: ...


#: Builds the probe of a calibration: ``factory(config, n_features, max_rows, device, settings)``.
#: Raises :class:`~rh_dask.exceptions.EngineUnavailableError` when the GPU engine cannot start.
ProbeFactory = Callable[[HuberConfig, int, int, Any, Any], Probe]


class EngineProbes:
    """The real probe: both engines, built once, timed on synthetic rows of the stream's shape.

    Parameters
    ----------
    config : HuberConfig
        The stream's configuration (dtype, penalty, solver settings).
    n_features : int
        Features of the stream.
    max_rows : int
        Rows of the largest probe.
    device : optional
        Passed to the GPU engine.
    settings : Settings, optional
        Decide the GPU engine's options.

    Raises
    ------
    EngineUnavailableError
        When the GPU engine cannot be made here.
    """

    def __init__(
        self,
        config: HuberConfig,
        n_features: int,
        max_rows: int,
        device: Any = None,
        settings: Any = None,
    ) -> None:
        from . import make_engine

        # The GPU engine first: where it cannot start, nothing else is made.
        gpu = make_engine("gpu", config, device, settings=settings)
        rng = np.random.default_rng(20240607)
        dtype = config.np_dtype
        beta = rng.standard_normal(n_features)
        self._X = rng.standard_normal((max_rows, n_features)).astype(dtype)
        noise = rng.standard_t(3.0, size=max_rows)
        self._y = (self._X.astype(np.float64) @ beta + noise).astype(dtype)
        self._engines = {
            "numpy": make_engine("numpy", config, None, settings=settings),
            "gpu": gpu,
        }

    def time(self, engine: str, rows: int) -> float:
        """Seconds of one fresh-stream batch of ``rows`` rows on ``engine``."""
        eng = self._engines[engine]
        eng.reset()
        X, y = self._X[:rows], self._y[:rows]
        start = time.perf_counter()
        eng.partial_fit(X, y, None)
        return time.perf_counter() - start


# -- the decision ------------------------------------------------------------------------------


@dataclass(frozen=True)
class AutoChoice:
    """What ``engine="auto"`` chose for a stream, and why.

    Attributes
    ----------
    engine : {"numpy", "gpu"}
        The engine chosen.
    reason : str
        One sentence: the rule that applied, or the calibration's prediction.
    predicted_ratio : float or None
        The calibration's predicted t_gpu / t_numpy at the batch's rows
        (``None`` when no calibration decided).
    plan : ProbePlan or None
        The probes that were planned (``None`` without a calibration).
    ratios : tuple of (int, float)
        ``(rows, median paired ratio)`` of each probe size measured.
    calibration_seconds : float
        Wall time the calibration took (0 for a rule or a cached decision),
        ``settle_seconds`` included.
    settle_seconds : float
        Of that, the wait after a calibration that chose the GPU for the
        BLAS threads its NumPy probes woke to go idle
        (``rh-dask.engine.auto.settle``).
    cached : bool
        Whether the decision came from the cache.
    fallback : str or None
        Set when the chosen GPU engine failed to start and the stream runs
        on the NumPy engine instead: why it failed.
    """

    engine: str
    reason: str
    predicted_ratio: float | None = None
    plan: ProbePlan | None = None
    ratios: tuple[tuple[int, float], ...] = field(default=())
    calibration_seconds: float = 0.0
    settle_seconds: float = 0.0
    cached: bool = False
    fallback: str | None = None

    @property
    def measured(self) -> bool:
        """Whether a calibration decided (not a rule): only such a choice may fall back."""
        return self.predicted_ratio is not None


def decide(
    ratios: Sequence[tuple[int, float]], n_rows: int, allowance: float
) -> tuple[str, float | None]:
    """The engine and predicted t_gpu / t_numpy from measured ``(rows, ratio)`` pairs.

    The log ratios are fitted by a line in log rows (least squares; a
    constant for a single size) and evaluated at ``n_rows``; beyond the
    largest probe a slope in the GPU's favour is taken as zero. The GPU is
    chosen when the prediction is at most ``1 - allowance``.

    Raises
    ------
    ValidationError
        When ``ratios`` is empty or holds a ratio that is not finite and > 0,
        or ``allowance`` is not within [0, 1).
    """
    if not ratios:
        raise ValidationError("no probe ratios to decide from")
    if not (0.0 <= allowance < 1.0):
        raise ValidationError(f"allowance must be within [0, 1), got {allowance!r}")
    for rows, ratio in ratios:
        if not (math.isfinite(ratio) and ratio > 0):
            raise ValidationError(f"probe ratio at {rows} rows is {ratio!r}, not finite and > 0")
    xs = [math.log(rows) for rows, _ in ratios]
    ys = [math.log(ratio) for _, ratio in ratios]
    x_mean, y_mean = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - x_mean) ** 2 for x in xs)
    slope = (
        0.0
        if sxx == 0
        else sum((x - x_mean) * (y - y_mean) for x, y in zip(xs, ys, strict=True)) / sxx
    )
    x_top = max(xs)
    at_top = y_mean + slope * (x_top - x_mean)
    x = math.log(n_rows)
    if x > x_top:
        predicted = at_top + max(slope, 0.0) * (x - x_top)
    else:
        predicted = y_mean + slope * (x - x_mean)
    ratio = math.exp(predicted)
    return ("gpu" if ratio <= 1.0 - allowance else "numpy"), ratio


def _shape_class(config: HuberConfig, n_rows: int, n_features: int) -> tuple[Any, ...]:
    return (
        int(n_features),
        config.dtype,
        config.penalty,
        config.fit_intercept,
        round(math.log2(max(int(n_rows), 1))),
    )


class AutoCalibrator:
    """Decides ``engine="auto"`` and caches the decisions for one runtime signature.

    Parameters
    ----------
    probe_factory : callable, optional
        Builds the :class:`Probe` of a calibration (default
        :class:`EngineProbes`); tests inject engines of scripted cost.
    signature : callable, optional
        ``signature(device) -> hashable``, default :func:`runtime_signature`.
    clock : callable, optional
        Seconds, for the deadline and ``calibration_seconds`` (default
        :func:`time.perf_counter`).
    idle : ProcessIdle, optional
        Measures the process's busy cores before the probes and waits, after
        a calibration that chose the GPU, until they are back there (default
        :class:`~rh_dask.engines.blas_threads.ProcessIdle`).
    """

    def __init__(
        self,
        probe_factory: ProbeFactory | None = None,
        *,
        signature: Callable[[Any], Any] = runtime_signature,
        clock: Callable[[], float] = time.perf_counter,
        idle: ProcessIdle | None = None,
    ) -> None:
        self._factory: ProbeFactory = probe_factory or EngineProbes
        self._signature = signature
        self._clock = clock
        self._idle = idle or ProcessIdle()
        self._lock = threading.Lock()
        self._cache: dict[tuple[Any, ...], AutoChoice] = {}
        self._cache_signature: Any = None
        self._unavailable: str | None = None

    def forget(self) -> None:
        """Discard every cached decision."""
        with self._lock:
            self._cache.clear()
            self._cache_signature = None
            self._unavailable = None

    def after_fork(self) -> None:
        """In a forked child: no decision, and a fresh lock (another thread may have held it)."""
        self._lock = threading.Lock()
        self._cache = {}
        self._cache_signature = None
        self._unavailable = None

    @property
    def cached(self) -> int:
        """How many decisions the cache holds."""
        return len(self._cache)

    def choose(
        self,
        config: HuberConfig,
        n_rows: int,
        n_features: int,
        *,
        device: Any = None,
        device_input: bool = False,
        settings: Any = None,
    ) -> AutoChoice:
        """The engine for a stream whose first batch is ``n_rows`` × ``n_features``.

        Parameters
        ----------
        config : HuberConfig
            The stream's configuration.
        n_rows, n_features : int
            The first batch's shape.
        device : optional
            The estimator's ``device``.
        device_input : bool
            Whether the first batch is already on a CUDA device.
        settings : Settings, optional
            ``rh-dask.engine.auto.*`` (default: read from :mod:`dask.config`).

        Returns
        -------
        AutoChoice
        """
        if device_input:
            return AutoChoice("gpu", "the first batch is on a CUDA device")
        if device is not None and str(device).startswith("cuda"):
            return AutoChoice("gpu", f"device={device!r} names a CUDA device")
        if device is not None:
            return AutoChoice("numpy", f"device={device!r} is not a CUDA device")
        from ..settings import Settings

        # Every stream asks; only a calibration needs more than this one setting.
        calibrate = (
            Settings.read("auto_calibrate") if settings is None else settings.auto_calibrate
        )
        if not calibrate:
            return AutoChoice("numpy", "rh-dask.engine.auto.calibrate is off")
        key = _shape_class(config, n_rows, n_features)
        signature = self._signature(device)
        with self._lock:
            if signature != self._cache_signature:
                self._cache.clear()
                self._cache_signature = signature
                self._unavailable = None
            if self._unavailable is not None:
                return AutoChoice("numpy", self._unavailable, cached=True)
            hit = self._cache.get(key)
            if hit is not None:
                return _replace_cached(hit)
            if settings is None:
                settings = Settings.from_config()
            choice = self._calibrate(config, n_rows, n_features, device, settings)
            self._cache[key] = choice
            return choice

    def _calibrate(
        self, config: HuberConfig, n_rows: int, n_features: int, device: Any, settings: Any
    ) -> AutoChoice:
        plan = plan_probes(
            n_rows,
            n_features,
            budget_rows=settings.auto_probe_rows,
            rounds=settings.auto_rounds,
        )
        start = self._clock()
        # The process's busy cores before the NumPy probes wake any BLAS threads.
        baseline = self._idle.busy() if settings.auto_settle > 0 else 0.0
        try:
            probe = self._factory(config, n_features, max(plan.rows), device, settings)
        except EngineUnavailableError as exc:
            # Not a property of the shape: every later stream of this signature is told at once.
            self._unavailable = f"the GPU engine cannot start here ({exc})"
            return AutoChoice("numpy", self._unavailable, plan=plan)
        timed = 0.0
        ratios: list[tuple[int, float]] = []
        ran_out = False
        try:
            for rows in plan.rows:
                probe.time("numpy", rows)
                probe.time("gpu", rows)
                rounds = []
                for _ in range(plan.rounds):
                    logs = []
                    for order in (("numpy", "gpu"), ("gpu", "numpy")):
                        seconds = {name: probe.time(name, rows) for name in order}
                        timed += seconds["numpy"] + seconds["gpu"]
                        logs.append(
                            math.log(max(seconds["gpu"], 1e-12) / max(seconds["numpy"], 1e-12))
                        )
                    rounds.append(statistics.fmean(logs))
                ratios.append((rows, math.exp(max(rounds))))
                if timed > settings.auto_deadline:
                    ran_out = rows != plan.rows[-1]
                    break
        except Exception as exc:  # a GPU that fails while probed is not chosen
            return AutoChoice(
                "numpy",
                f"a probe batch failed during the calibration ({type(exc).__name__}: {exc})",
                plan=plan,
                ratios=tuple(ratios),
                calibration_seconds=self._clock() - start,
            )
        elapsed = self._clock() - start
        if ran_out and len(ratios) < 2:
            return AutoChoice(
                "numpy",
                f"the calibration's timed batches passed its {settings.auto_deadline:g} s "
                f"deadline after {len(ratios)} probe size",
                plan=plan,
                ratios=tuple(ratios),
                calibration_seconds=elapsed,
            )
        engine, predicted = decide(ratios, n_rows, settings.auto_allowance)
        faster = "at most" if engine == "gpu" else "more than"
        settle = 0.0
        if engine == "gpu" and settings.auto_settle > 0:
            # The last probe ran NumPy: its BLAS threads still spin and would take
            # the cores of the GPU stream that follows (docs/performance.md).
            settle = self._idle.wait(baseline, settings.auto_settle)
        return AutoChoice(
            engine,
            f"predicted t_gpu/t_numpy {predicted:.3g} at {n_rows} rows, {faster} "
            f"1 - allowance = {1 - settings.auto_allowance:g}",
            predicted_ratio=predicted,
            plan=plan,
            ratios=tuple(ratios),
            calibration_seconds=self._clock() - start,
            settle_seconds=settle,
        )


def _replace_cached(choice: AutoChoice) -> AutoChoice:
    return AutoChoice(
        choice.engine,
        choice.reason,
        predicted_ratio=choice.predicted_ratio,
        plan=choice.plan,
        ratios=choice.ratios,
        calibration_seconds=0.0,
        cached=True,
    )


_default = AutoCalibrator()


def default_calibrator() -> AutoCalibrator:
    """The process's calibrator, whose cache :func:`choose_engine` uses."""
    return _default


def choose_engine(
    config: HuberConfig,
    n_rows: int,
    n_features: int,
    *,
    device: Any = None,
    device_input: bool = False,
    settings: Any = None,
) -> AutoChoice:
    """``engine="auto"`` for a stream's first batch, with the process's cache.

    See :meth:`AutoCalibrator.choose`.
    """
    return _default.choose(
        config,
        n_rows,
        n_features,
        device=device,
        device_input=device_input,
        settings=settings,
    )


def start_chosen(
    choice: AutoChoice, config: HuberConfig, device: Any = None, *, settings: Any = None
) -> tuple[Any, AutoChoice]:
    """The engine ``choice`` names, started; a measured GPU choice that cannot start gives NumPy.

    Only a GPU engine chosen by the calibration (:attr:`AutoChoice.measured`)
    falls back: the NumPy engine is made instead and the returned choice
    says why in ``fallback``. A choice made by a rule (a CUDA device named,
    a batch on the device) raises what the engine raised, as an explicitly
    named engine does.

    Returns
    -------
    (Engine, AutoChoice)
        The engine, and ``choice`` (with ``engine="numpy"`` and ``fallback``
        set after a fallback).
    """
    from dataclasses import replace

    from . import make_engine

    try:
        return make_engine(choice.engine, config, device, settings=settings), choice
    except Exception as exc:
        if choice.engine != "gpu" or not choice.measured:
            raise
        why = f"{type(exc).__name__}: {exc}"
    engine = make_engine("numpy", config, None, settings=settings)
    return engine, replace(choice, engine="numpy", fallback=why)


def _after_fork() -> None:
    global _controller, _controller_lock
    _controller, _controller_lock = None, threading.Lock()
    _default.after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)
