"""Replay the golden corpus (issue item 8) on the NumPy engine and through the estimator."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from golden_corpus import (
    GOLDEN_DIR,
    LAMBDA_ULPS,
    TOLERANCES,
    assert_diagnostics_close,
    assert_state_close,
    load_cases,
    replay_case,
)

from rh_dask import NumpyEngine, RenewableHuberRegressor

CASES = load_cases()
GENERATOR = GOLDEN_DIR / "generate.py"


class _EstimatorAsEngine:
    """Just enough of the Engine interface for replay_case, through the estimator."""

    def __init__(self, config):
        self.model = RenewableHuberRegressor(engine="numpy", **config.to_dict())

    def partial_fit(self, X, y, sample_weight=None):
        return self.model.partial_fit(X, y, sample_weight).diagnostics_

    def export_state(self):
        return self.model.state_


def test_corpus_has_the_required_cases():
    names = {case.name for case in CASES}
    assert names >= {
        "weighted_f64",
        "l1_f64",
        "f32_no_intercept",
        "rank_deficient_ridge0",
        "l1_f32",
        "outliers_unpenalised",
    }
    total = sum(p.stat().st_size for p in GOLDEN_DIR.glob("*.json"))
    assert total < 1.5e6


def test_cases_cover_what_they_claim():
    by_name = {case.name: case for case in CASES}
    assert by_name["weighted_f64"].batches[0].sample_weight is not None
    assert any(np.any(b.sample_weight == 0) for b in by_name["weighted_f64"].batches)
    l1 = by_name["l1_f64"]
    assert l1.config.penalty == "l1" and len(l1.batches) >= 3
    assert any(np.any(step.state.coefficients[:-1] == 0) for step in l1.expected)
    f32 = by_name["f32_no_intercept"]
    assert f32.config.dtype == "float32" and not f32.config.fit_intercept
    rank = by_name["rank_deficient_ridge0"]
    X = rank.batches[0].X
    assert rank.config.ridge == 0.0 and np.array_equal(X[:, 3], X[:, 1])
    for case in CASES:  # float32 cases hold exactly representable float32 values
        if case.config.dtype == "float32":
            for b in case.batches:
                assert np.array_equal(b.X.astype(np.float32).astype(np.float64), b.X)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_numpy_engine_replays_the_corpus(case):
    diagnostics = replay_case(case, NumpyEngine)
    assert len(diagnostics) == len(case.batches)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_estimator_replays_the_corpus(case):
    replay_case(case, _EstimatorAsEngine)


def test_replay_detects_a_wrong_engine():
    case = next(c for c in CASES if c.name == "l1_f64")

    class Biased(NumpyEngine):
        def export_state(self):
            state = super().export_state()
            state.coefficients[1] *= 1 + 1e-7  # just beyond the float64 tolerance
            return state

    with pytest.raises(AssertionError, match="coefficients differs"):
        replay_case(case, Biased)


def test_state_comparison_is_exact_on_counters_and_relative_on_arrays():
    case = CASES[0]
    expected = case.expected[0].state
    actual = expected.copy()
    assert_state_close(actual, expected, "float64")
    actual.information = actual.information * (1 + 5e-9)  # within rtol 1e-8
    assert_state_close(actual, expected, "float64")
    actual.n_samples_seen += 1
    with pytest.raises(AssertionError, match="counters differ"):
        assert_state_close(actual, expected, "float64")


def test_state_comparison_allows_lambda_a_few_ulps_and_no_more():
    case = next(c for c in CASES if c.name == "l1_f64")
    expected = case.expected[-1].state
    assert expected.previous_lambda > 0
    actual = expected.copy()
    actual.previous_lambda = float(np.nextafter(np.nextafter(expected.previous_lambda, 1), 1))
    assert_state_close(actual, expected, case.dtype)  # another libm's log: last bits
    actual.previous_lambda = expected.previous_lambda * (1 + 1e-12)
    with pytest.raises(AssertionError, match="previous_lambda"):
        assert_state_close(actual, expected, case.dtype)
    with pytest.raises(AssertionError, match="dtype"):
        assert_state_close(expected.astype("float32"), expected, "float64")


def test_diagnostics_comparison_requires_the_same_convergence():
    step = CASES[0].expected[0]
    flipped = {**step.diagnostics, "converged": not step.diagnostics["converged"]}
    assert_diagnostics_close({**step.diagnostics, "iterations": 99}, step.diagnostics, "float64")
    with pytest.raises(AssertionError, match="converged"):
        assert_diagnostics_close(flipped, step.diagnostics, "float64")


def test_generator_check_mode_passes_on_the_committed_corpus():
    # The generator's command line, as CI and developers run it.
    result = subprocess.run(
        [sys.executable, str(GENERATOR), "--check"], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "up to date" in result.stdout


@pytest.fixture(scope="module")
def generator():
    spec = importlib.util.spec_from_file_location("golden_generate", GENERATOR)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


def _edited_copy(tmp_path: Path, edit, name: str = "weighted_f64") -> Path:
    corpus = tmp_path / "golden"
    shutil.copytree(GOLDEN_DIR, corpus, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    path = corpus / f"{name}.json"
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))
    return corpus


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d["batches"][1]["y"].__setitem__(3, 0.5), r"batches\[1\]\.y"),
        (
            lambda d: d["expected"][2]["state"]["coefficients"].__setitem__(0, 1.0),
            r"expected\[2\]\.state\.coefficients",
        ),
        (lambda d: d["expected"][0]["state"].__setitem__("batch_count", 7), "batch_count"),
        (lambda d: d["expected"][1]["state"].__setitem__("weight_sum", 240.25), "weight_sum"),
        (
            lambda d: d["expected"][1]["diagnostics"].__setitem__("converged", False),
            r"expected\[1\]\.diagnostics\.converged",
        ),
        (lambda d: d["config"].__setitem__("tau", 2.0), r"config\.tau"),
    ],
    ids=["input", "coefficients", "counter", "weight_sum", "converged", "config"],
)
def test_generator_check_mode_reports_drift(generator, tmp_path, capsys, edit, message):
    corpus = _edited_copy(tmp_path, edit)
    assert generator.main(["--check", "--dir", str(corpus)]) == 1
    err = capsys.readouterr().err
    assert "out of date" in err
    assert re.search(message, err), err


def test_check_tolerance_is_the_contracts(generator):
    # The check accepts a regenerated reference exactly when replay would accept it.
    assert generator.CHECK_TOLERANCE == TOLERANCES
    assert generator.LAMBDA_ULPS == LAMBDA_ULPS


def _nudge_expectations(data: dict, relative: float) -> None:
    """Scale every floating-point expectation by 1 + relative; move λ by 2 ulps."""
    for step in data["expected"]:
        state = step["state"]
        state["coefficients"] = [v * (1 + relative) for v in state["coefficients"]]
        state["information"] = [[v * (1 + relative) for v in r] for r in state["information"]]
        step["diagnostics"]["objective"] *= 1 + relative
        lam = state["previous_lambda"]
        state["previous_lambda"] = float(np.nextafter(np.nextafter(lam, 1), 1)) if lam else 0.0


def test_check_accepts_differences_at_the_level_of_a_blas_update(generator, tmp_path, capsys):
    # ~8 float32 ulps (1e-6) on every float32 expectation, J included, ~4500 float64
    # ulps (1e-12) on every float64 one, λ 2 ulps off: another BLAS or NumPy, not a change.
    corpus = tmp_path / "golden"
    shutil.copytree(GOLDEN_DIR, corpus, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    for case in CASES:
        path = corpus / f"{case.name}.json"
        data = json.loads(path.read_text())
        _nudge_expectations(data, 1e-6 if case.config.dtype == "float32" else 1e-12)
        path.write_text(json.dumps(data))
    assert generator.main(["--check", "--dir", str(corpus)]) == 0
    out = capsys.readouterr().out
    assert "up to date" in out
    assert re.search(r"l1_f32: \d+ fields not bit-identical, within tolerance", out), out


@pytest.mark.parametrize(
    ("name", "change"),
    [
        ("l1_f32", {"bandwidth_scale": 1.001}),
        ("f32_no_intercept", {"bandwidth_scale": 1.001}),
        ("l1_f32", {"tau": 1.0001}),
        ("weighted_f64", {"bandwidth_scale": 1.001}),
    ],
    ids=["l1_f32-h", "f32_no_intercept-h", "l1_f32-tau", "weighted_f64-h"],
)
def test_check_rejects_a_real_numerical_change(generator, capsys, name, change):
    # The generator's configuration changed by 0.1% (h) or 0.01% (τ): the committed
    # expectations must no longer pass, and the report names the numbers that moved.
    cases = []
    for spec in generator.CASES:
        if spec.name == name:
            scaled = {k: getattr(spec.config, k) * f for k, f in change.items()}
            spec = dataclasses.replace(spec, config=dataclasses.replace(spec.config, **scaled))
        cases.append(spec)
    assert generator.check(GOLDEN_DIR, cases) == 1
    err = capsys.readouterr().err
    assert re.search(rf"{name}: expected\[\d\]\.state\.information\[\d\]: \d+ of", err), err


@pytest.mark.parametrize(
    ("name", "relative"),
    [("l1_f32", 1e-3), ("f32_no_intercept", 1e-3), ("l1_f64", 1e-7)],
)
def test_check_rejects_one_expectation_scaled(generator, tmp_path, capsys, name, relative):
    # One coefficient, the largest, scaled by 1 + relative: beyond the contract's rtol.
    def edit(data):
        coefficients = data["expected"][-1]["state"]["coefficients"]
        largest = int(np.argmax(np.abs(coefficients)))
        coefficients[largest] *= 1 + relative

    corpus = _edited_copy(tmp_path, edit, name)
    assert generator.main(["--check", "--dir", str(corpus)]) == 1
    err = capsys.readouterr().err
    last = len(json.loads((GOLDEN_DIR / f"{name}.json").read_text())["expected"]) - 1
    assert f"{name}: expected[{last}].state.coefficients: 1 of" in err, err


def test_generator_check_mode_reports_missing_and_extra_files(generator, tmp_path, capsys):
    corpus = _edited_copy(tmp_path, lambda d: None)
    (corpus / "l1_f32.json").unlink()
    (corpus / "stray.json").write_text("{}")
    assert generator.main(["--check", "--dir", str(corpus)]) == 1
    err = capsys.readouterr().err
    assert "l1_f32.json: missing" in err and "stray.json: not produced" in err


def test_generator_writes_what_check_accepts(generator, tmp_path, capsys):
    assert generator.main(["--dir", str(tmp_path)]) == 0
    assert generator.main(["--check", "--dir", str(tmp_path)]) == 0
    assert "up to date" in capsys.readouterr().out
    written = sorted(p.name for p in tmp_path.glob("*.json"))
    assert written == sorted(p.name for p in GOLDEN_DIR.glob("*.json"))
    # The committed files are what this environment writes, to the check's rules:
    # inputs, counters and flags equal, numbers within the contract's tolerance.
    for spec in generator.CASES:
        new = json.loads((tmp_path / f"{spec.name}.json").read_text())
        old = json.loads((GOLDEN_DIR / f"{spec.name}.json").read_text())
        found = generator.compare_case(new, old, spec.config.dtype)
        assert found.problems == [], (spec.name, found.problems)
        assert new["batches"] == old["batches"] and new["config"] == old["config"]
