"""The golden corpus: load the cases of tests/golden/ and replay them on any engine.

Every engine is held to the NumPy reference through these files::

    from golden_corpus import load_cases, replay_case

    for case in load_cases():
        replay_case(case, lambda config: MyEngine(config))

``replay_case`` feeds each batch to ``engine.partial_fit(X, y, w)`` (arrays in
the case's dtype) and, after every batch, compares ``engine.export_state()``
and the returned diagnostics with the recorded ones, using the tolerances of
the numerical contract. Counters (including the weight sum, exact because the
corpus uses dyadic weights) and the converged flag must match exactly; λ
(``previous_lambda``, a float64 ``math.log`` and ``sqrt`` of exact numbers)
within LAMBDA_ULPS float64 units in the last place, since the C library's
``log`` is not correctly rounded everywhere and the files come from another
machine; iteration counts are reported but not compared.

The files are written by ``tests/golden/generate.py`` (see its docstring).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from rh_dask import BatchDiagnostics, Engine, HuberConfig, HuberState

GOLDEN_DIR = Path(__file__).resolve().parent / "golden"
SCHEMA_VERSION = 1
#: (rtol, atol) of the numerical contract, per dtype.
TOLERANCES: dict[str, tuple[float, float]] = {
    "float64": (1e-8, 2e-9),
    "float32": (3e-4, 3e-5),
}
#: How far λ may move between C libraries, in float64 units in the last place.
LAMBDA_ULPS = 4


@dataclass(frozen=True)
class GoldenBatch:
    """One batch of a case, as float64 arrays (exact for float32 cases too)."""

    X: np.ndarray
    y: np.ndarray
    sample_weight: np.ndarray | None

    def cast(self, dtype: np.dtype | str) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """The batch in ``dtype``, C-contiguous, ready for ``partial_fit``."""
        w = self.sample_weight
        return (
            np.ascontiguousarray(self.X, dtype=dtype),
            np.ascontiguousarray(self.y, dtype=dtype),
            None if w is None else np.ascontiguousarray(w, dtype=dtype),
        )


@dataclass(frozen=True)
class GoldenStep:
    """The reference's state and diagnostics after one batch."""

    state: HuberState
    diagnostics: dict[str, Any]


@dataclass(frozen=True)
class GoldenCase:
    name: str
    description: str
    config: HuberConfig
    batches: list[GoldenBatch]
    expected: list[GoldenStep]

    @property
    def dtype(self) -> np.dtype:
        return self.config.np_dtype

    def __repr__(self) -> str:  # short ids in pytest output
        return f"GoldenCase({self.name!r})"


def case_from_dict(data: dict[str, Any]) -> GoldenCase:
    """Parse one JSON document of the corpus."""
    if data.get("schema_version") != SCHEMA_VERSION:
        raise ValueError(
            f"golden case {data.get('name')!r} has schema version "
            f"{data.get('schema_version')!r}, expected {SCHEMA_VERSION}"
        )
    config = HuberConfig.from_dict(data["config"])
    batches = [
        GoldenBatch(
            X=np.asarray(b["X"], dtype=np.float64),
            y=np.asarray(b["y"], dtype=np.float64),
            sample_weight=None
            if b["sample_weight"] is None
            else np.asarray(b["sample_weight"], dtype=np.float64),
        )
        for b in data["batches"]
    ]
    expected = []
    for step in data["expected"]:
        s = step["state"]
        state = HuberState(
            coefficients=np.asarray(s["coefficients"], dtype=np.float64),
            information=np.asarray(s["information"], dtype=np.float64),
            n_samples_seen=s["n_samples_seen"],
            batch_count=s["batch_count"],
            previous_lambda=s["previous_lambda"],
            weight_sum=s["weight_sum"],
            n_features_in=s["n_features_in"],
            fit_intercept=s["fit_intercept"],
        )
        expected.append(GoldenStep(state, dict(step["diagnostics"])))
    if len(batches) != len(expected) or not batches:
        raise ValueError(f"golden case {data['name']!r}: batches and expectations disagree")
    return GoldenCase(data["name"], data.get("description", ""), config, batches, expected)


def load_cases(directory: Path | str = GOLDEN_DIR) -> list[GoldenCase]:
    """Every case of the corpus, sorted by name."""
    paths = sorted(Path(directory).glob("*.json"))
    if not paths:
        raise FileNotFoundError(f"no golden cases in {directory}")
    return [case_from_dict(json.loads(p.read_text())) for p in paths]


def _tolerance(dtype: np.dtype | str) -> tuple[float, float]:
    return TOLERANCES[np.dtype(dtype).name]


def _assert_array_close(name: str, actual: Any, expected: np.ndarray, dtype, context: str):
    rtol, atol = _tolerance(dtype)
    actual = np.asarray(actual)
    prefix = f"{context}: " if context else ""
    if actual.shape != expected.shape:
        raise AssertionError(f"{prefix}{name} has shape {actual.shape}, expected {expected.shape}")
    if not np.all(np.isfinite(actual)):
        raise AssertionError(f"{prefix}{name} is not finite: {actual}")
    diff = np.abs(actual.astype(np.float64) - expected)
    bound = atol + rtol * np.abs(expected)
    bad = diff > bound
    if np.any(bad):
        where = np.argwhere(bad)[:5].tolist()
        worst = float(np.max(diff / bound))
        raise AssertionError(
            f"{prefix}{name} differs from the reference beyond rtol={rtol}, atol={atol} "
            f"at {int(bad.sum())} of {bad.size} entries (e.g. {where}); worst |diff|/bound "
            f"= {worst:.3g}\nactual:   {actual.ravel()[:8]}\nexpected: {expected.ravel()[:8]}"
        )


def assert_state_close(
    actual: HuberState, expected: HuberState, dtype: np.dtype | str, context: str = ""
) -> None:
    """``actual`` within the contract's tolerance of ``expected``; counters exact, λ to ulps."""
    prefix = f"{context}: " if context else ""
    got, want = actual.counters(), expected.counters()
    got_lambda, want_lambda = got.pop("previous_lambda"), want.pop("previous_lambda")
    if got != want:
        raise AssertionError(f"{prefix}counters differ: {got} != {want}")
    if not abs(got_lambda - want_lambda) <= LAMBDA_ULPS * np.spacing(abs(want_lambda)):
        raise AssertionError(
            f"{prefix}previous_lambda {got_lambda!r} differs from the reference's "
            f"{want_lambda!r} by more than {LAMBDA_ULPS} float64 ulps"
        )
    if np.asarray(actual.coefficients).dtype != np.dtype(dtype):
        raise AssertionError(
            f"{prefix}coefficients have dtype {np.asarray(actual.coefficients).dtype}, "
            f"expected {np.dtype(dtype)}"
        )
    _assert_array_close("coefficients", actual.coefficients, expected.coefficients, dtype, context)
    _assert_array_close("information", actual.information, expected.information, dtype, context)


def assert_diagnostics_close(
    actual: BatchDiagnostics | dict[str, Any],
    expected: dict[str, Any],
    dtype: np.dtype | str,
    context: str = "",
) -> None:
    """Converged exactly; objective, λ and bandwidth within tolerance; iterations ignored."""
    got = actual.to_dict() if isinstance(actual, BatchDiagnostics) else dict(actual)
    prefix = f"{context}: " if context else ""
    if bool(got["converged"]) != bool(expected["converged"]):
        raise AssertionError(
            f"{prefix}converged={got['converged']} but the reference has "
            f"{expected['converged']} (iterations {got['iterations']} vs "
            f"{expected['iterations']})"
        )
    for key in ("objective", "lambda_value", "bandwidth"):
        _assert_array_close(key, np.float64(got[key]), np.float64(expected[key]), dtype, context)


def replay_case(case: GoldenCase, engine_factory: Callable[[HuberConfig], Engine]) -> list[Any]:
    """Run ``case`` through a fresh engine, asserting state and diagnostics after every batch.

    Returns the diagnostics of every batch (so callers may report iterations).
    """
    engine = engine_factory(case.config)
    reports = []
    for index, (batch, step) in enumerate(zip(case.batches, case.expected, strict=True)):
        context = f"{case.name}, batch {index}"
        diagnostics = engine.partial_fit(*batch.cast(case.dtype))
        assert_state_close(engine.export_state(), step.state, case.dtype, context)
        assert_diagnostics_close(diagnostics, step.diagnostics, case.dtype, context)
        reports.append(diagnostics)
    return reports
