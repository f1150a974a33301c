"""Generate the golden corpus: reference-engine streams with per-batch expectations.

Every engine of rh-dask is tested against these files (``tests/golden_corpus.py``
replays them). Each ``<case>.json`` holds the configuration, the exact batch
data and, after every batch, the NumPy reference engine's state and
diagnostics.

Usage::

    python tests/golden/generate.py           # rewrite tests/golden/*.json
    python tests/golden/generate.py --check   # regenerate in memory, compare, exit 1 on drift

All data are dyadic rationals (multiples of 2⁻⁸, weights multiples of 1/4),
so they are exact in float32 and float64 alike and every weight sum is exact
in any summation order.

The check mode regenerates every case and compares it with the committed
file. Inputs (configuration, batches), integer counters, the weight sum and
the convergence flags must be equal. Floating-point expectations are compared
as the numerical contract compares an engine with the reference,
``|new − old| ≤ atol + rtol·|old|`` elementwise with the contract's
(rtol, atol) for the case's dtype (CHECK_TOLERANCE): a regenerated reference
passes exactly when it would pass as an engine replaying the committed corpus.
That is the right bar because another NumPy or BLAS is another rounding of
the same computation, and conditioning amplifies its rounding: κ has slope
1/(2h) with a small bandwidth h (0.025 for the 480 rows of ``l1_f32``), so a
last-bit change of β moves κ of the rows inside the band and so J by ~1e-4
relative in float32 (``l1_f32`` moved to a quarter of the bound from the
build that generated it to NumPy 2.4.6 and its OpenBLAS). A real numerical
change moves expectations far past the bound: 0.1% on ``bandwidth_scale``
moves J by 4 to 7 times the bound in the float32 cases and by 10⁴ to 10⁶
times in the float64 ones, 0.01% on τ by 13 to 35 times in float32.
λ (``previous_lambda``) is a float64 computation with ``math.log``, which is
not correctly rounded on every C library: it must agree to within
LAMBDA_ULPS units in the last place.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from rh_dask import HuberConfig, NumpyEngine
from rh_dask.state import OPTIONAL_DIAGNOSTICS

SCHEMA_VERSION = 1
HERE = Path(__file__).resolve().parent
#: (rtol, atol) per dtype: the numerical contract's tolerance against the reference.
CHECK_TOLERANCE = {"float64": (1e-8, 2e-9), "float32": (3e-4, 3e-5)}
#: How far λ may move between C libraries, in float64 units in the last place.
LAMBDA_ULPS = 4


# -- the cases ----------------------------------------------------------------------


@dataclass(frozen=True)
class CaseSpec:
    name: str
    description: str
    config: HuberConfig
    make_batches: Callable[[], list[tuple[np.ndarray, np.ndarray, np.ndarray | None]]]


def _dyadic(x: np.ndarray, bits: int = 8) -> np.ndarray:
    return np.round(np.asarray(x, dtype=np.float64) * 2.0**bits) / 2.0**bits


def _stream(
    seed: int,
    sizes: list[int],
    d: int,
    *,
    noise_df: float,
    weights: bool,
    sparse: bool = False,
    outlier_fraction: float = 0.0,
    duplicate: tuple[int, int] | None = None,
    intercept: float = 0.75,
) -> list[tuple[np.ndarray, np.ndarray, np.ndarray | None]]:
    rng = np.random.default_rng(seed)
    n = sum(sizes)
    coef = _dyadic(rng.normal(0.0, 1.0, size=d))
    if sparse:
        coef[rng.permutation(d)[: d // 2]] = 0.0
    X = _dyadic(rng.normal(size=(n, d)))
    if duplicate is not None:
        target, source = duplicate
        X[:, target] = X[:, source]
    y = X @ coef + intercept + rng.standard_t(noise_df, size=n)
    if outlier_fraction:
        hit = rng.random(n) < outlier_fraction
        y[hit] += rng.choice([-1.0, 1.0], size=int(hit.sum())) * rng.uniform(40, 80, hit.sum())
    y = _dyadic(y)
    w = None
    if weights:
        w = rng.integers(0, 13, size=n) / 4.0  # 0, 0.25, ..., 3: zeros included
    batches = []
    start = 0
    for size in sizes:
        rows = slice(start, start + size)
        bw = None if w is None else w[rows].copy()
        if bw is not None and bw.sum() == 0:
            bw[0] = 1.0
        batches.append((X[rows].copy(), y[rows].copy(), bw))
        start += size
    return batches


CASES = [
    CaseSpec(
        "weighted_f64",
        "float64 stream with an intercept and frequency weights (zeros included), t(2) noise",
        HuberConfig(),
        lambda: _stream(101, [100, 140, 120, 120], 5, noise_df=2.0, weights=True),
    ),
    CaseSpec(
        "l1_f64",
        "float64 L1 stream (LAMM) over five batches, so the history term acts on four",
        HuberConfig(penalty="l1"),
        lambda: _stream(102, [120] * 5, 8, noise_df=3.0, weights=False, sparse=True),
    ),
    CaseSpec(
        "f32_no_intercept",
        "float32 weighted stream without an intercept",
        HuberConfig(dtype="float32", fit_intercept=False),
        lambda: _stream(103, [100, 100, 100, 100], 4, noise_df=3.0, weights=True, intercept=0),
    ),
    CaseSpec(
        "rank_deficient_ridge0",
        "column 3 duplicates column 1 and ridge=0: singular Newton systems, minimum-norm steps",
        HuberConfig(ridge=0.0),
        lambda: _stream(104, [120, 120, 120], 4, noise_df=3.0, weights=False, duplicate=(3, 1)),
    ),
    CaseSpec(
        "l1_f32",
        "float32 weighted L1 stream with lambda_scale=0.5",
        HuberConfig(dtype="float32", penalty="l1", lambda_scale=0.5),
        lambda: _stream(105, [120, 120, 120, 120], 6, noise_df=3.0, weights=True, sparse=True),
    ),
    CaseSpec(
        "outliers_unpenalised",
        "float64 unpenalised stream with 15% gross outliers, t(1.5) noise and 1- and 7-row "
        "batches",
        HuberConfig(),
        lambda: _stream(
            106, [150, 1, 7, 142, 100], 3, noise_df=1.5, weights=False, outlier_fraction=0.15
        ),
    ),
]


# -- building and writing ------------------------------------------------------------


def build_case(spec: CaseSpec) -> dict[str, Any]:
    """Run the reference engine over the case's batches; return the JSON document."""
    config = spec.config
    dt = config.np_dtype
    engine = NumpyEngine(config)
    batches, expected = [], []
    for X, y, w in spec.make_batches():
        X, y = X.astype(dt), y.astype(dt)
        w = None if w is None else w.astype(dt)
        diagnostics = engine.partial_fit(np.ascontiguousarray(X), y, w)
        if not diagnostics.converged:
            raise RuntimeError(f"{spec.name}: batch {len(batches)} did not converge; pick data")
        state = engine.export_state()
        # float32 values are stored as the float64 numbers they are exactly.
        batches.append(
            {
                "X": X.astype(np.float64).tolist(),
                "y": y.astype(np.float64).tolist(),
                "sample_weight": None if w is None else w.astype(np.float64).tolist(),
            }
        )
        expected.append(
            {
                "state": {
                    "coefficients": state.coefficients.astype(np.float64).tolist(),
                    "information": state.information.astype(np.float64).tolist(),
                    **state.counters(),
                },
                # The contract's fields; the optional diagnostics are not part of it.
                "diagnostics": {
                    k: v for k, v in diagnostics.to_dict().items() if k not in OPTIONAL_DIAGNOSTICS
                },
            }
        )
    return {
        "schema_version": SCHEMA_VERSION,
        "name": spec.name,
        "description": spec.description,
        "config": config.to_dict(),
        "batches": batches,
        "expected": expected,
    }


def _dumps(value: Any, indent: int = 0) -> str:
    """JSON with one line per matrix row, so files stay small and diffable."""
    pad = " " * indent
    if isinstance(value, dict):
        items = [
            f"{pad}  {json.dumps(k)}: {_dumps(v, indent + 2).lstrip()}" for k, v in value.items()
        ]
        return pad + "{\n" + ",\n".join(items) + "\n" + pad + "}"
    if isinstance(value, list) and value and isinstance(value[0], (list, dict)):
        items = [_dumps(v, indent + 2) for v in value]
        return pad + "[\n" + ",\n".join(items) + "\n" + pad + "]"
    return pad + json.dumps(value, allow_nan=False, separators=(",", ":"))


def render(case: dict[str, Any]) -> str:
    return _dumps(case) + "\n"


# -- checking ----------------------------------------------------------------------------

_INPUTS = ("batches", "config", "name", "schema", "description")
_EXACT = {"weight_sum", "n_samples_seen"}


@dataclass
class Comparison:
    """What comparing a regenerated case with its committed file found.

    ``problems`` are differences beyond the check's rules; ``notes`` are
    allowed differences worth saying (iteration counts); ``inexact`` counts
    floating-point fields that are not bit-identical but within tolerance, and
    ``worst`` names the one closest to its bound, as (fraction of the bound, path).
    """

    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    inexact: int = 0
    worst: tuple[float, str] = (0.0, "")


def compare_case(new: dict[str, Any], old: dict[str, Any], dtype: str) -> Comparison:
    """Compare a regenerated case document with the committed one.

    Parameters
    ----------
    new, old : dict
        Parsed JSON documents (``old`` holds the expectations).
    dtype : {"float32", "float64"}
        The case's dtype; selects the tolerance.

    Returns
    -------
    Comparison
        Inputs, counters and flags compared exactly, floating-point
        expectations within CHECK_TOLERANCE, λ within LAMBDA_ULPS.
    """
    result = Comparison()
    _compare("", new, old, dtype, result)
    return result


def _compare(path: str, new: Any, old: Any, dtype: str, result: Comparison) -> None:
    inputs = path.startswith(_INPUTS)
    if isinstance(new, dict) and isinstance(old, dict):
        if new.keys() != old.keys():
            result.problems.append(f"{path}: keys {sorted(old)} -> {sorted(new)}")
            return
        for key in new:
            _compare(f"{path}.{key}" if path else key, new[key], old[key], dtype, result)
        return
    if isinstance(new, list) and isinstance(old, list):
        if len(new) != len(old):
            result.problems.append(f"{path}: length {len(old)} -> {len(new)}")
            return
        if new and not isinstance(new[0], (list, dict)) and not inputs:
            _compare_numbers(path, new, old, dtype, result)
            return
        for i, (a, b) in enumerate(zip(new, old, strict=True)):
            _compare(f"{path}[{i}]", a, b, dtype, result)
        return
    if new == old and type(new) is type(old):
        return
    name = path.rsplit(".", 1)[-1]
    floats = isinstance(new, float) and isinstance(old, float)
    if name == "iterations":
        result.notes.append(f"{path}: iterations {old} -> {new} (recorded, not compared)")
    elif floats and name == "previous_lambda":
        if abs(new - old) <= LAMBDA_ULPS * np.spacing(abs(old)):
            result.inexact += 1
        else:
            result.problems.append(
                f"{path}: {old!r} -> {new!r} (more than {LAMBDA_ULPS} float64 ulps)"
            )
    elif floats and not inputs and name not in _EXACT:
        _compare_numbers(path, [new], [old], dtype, result)
    else:
        result.problems.append(f"{path}: {old!r} -> {new!r}")


def _compare_numbers(path: str, new: list, old: list, dtype: str, result: Comparison) -> None:
    """``|new − old| ≤ atol + rtol·|old|`` elementwise, the contract's rule."""
    a, b = np.asarray(new, dtype=np.float64), np.asarray(old, dtype=np.float64)
    if np.array_equal(a, b):
        return
    rtol, atol = CHECK_TOLERANCE[dtype]
    fraction = np.abs(a - b) / (atol + rtol * np.abs(b))
    worst = float(np.max(fraction))
    if worst > 1 or not np.all(np.isfinite(a)):
        beyond = int(np.sum(~(fraction <= 1)))
        result.problems.append(
            f"{path}: {beyond} of {a.size} values beyond |new - old| <= atol + rtol*|old| "
            f"(rtol={rtol:g}, atol={atol:g}); worst {worst:.3g} times the bound, "
            f"|new - old| up to {float(np.max(np.abs(a - b))):.3g}"
        )
        return
    result.inexact += 1
    result.worst = max(result.worst, (worst, path))


def check(directory: Path, cases: list[CaseSpec] | None = None) -> int:
    """Regenerate ``cases`` (default: CASES) and compare them with ``directory``.

    Prints a summary; returns 0 when every case is within the check's rules, 1
    otherwise (differences on stderr, each naming its case and field).
    """
    cases = CASES if cases is None else cases
    problems: list[str] = []
    expected_files = {f"{spec.name}.json" for spec in cases}
    present = {p.name for p in directory.glob("*.json")}
    for extra in sorted(present - expected_files):
        problems.append(f"{extra}: not produced by the generator")
    for missing in sorted(expected_files - present):
        problems.append(f"{missing}: missing")
    for spec in cases:
        path = directory / f"{spec.name}.json"
        if not path.is_file():
            continue
        old = json.loads(path.read_text())
        new = json.loads(render(build_case(spec)))
        found = compare_case(new, old, spec.config.dtype)
        problems.extend(f"{spec.name}: {p}" for p in found.problems)
        for note in found.notes:
            print(f"note: {spec.name}: {note}")
        if found.inexact:
            print(
                f"note: {spec.name}: {found.inexact} fields not bit-identical, within tolerance "
                f"(closest: {found.worst[1]} at {found.worst[0]:.3g} of its bound)"
            )
    if problems:
        print(f"golden corpus is out of date ({len(problems)} differences):", file=sys.stderr)
        for problem in problems[:50]:
            print(f"  {problem}", file=sys.stderr)
        if len(problems) > 50:
            print(f"  ... and {len(problems) - 50} more", file=sys.stderr)
        print("regenerate with: python tests/golden/generate.py", file=sys.stderr)
        return 1
    print(f"golden corpus up to date: {len(cases)} cases in {directory}")
    return 0


def write(directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for spec in CASES:
        path = directory / f"{spec.name}.json"
        path.write_text(render(build_case(spec)))
        print(f"wrote {path} ({path.stat().st_size / 1024:.0f} KiB)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    parser.add_argument("--dir", type=Path, default=HERE, help="corpus directory")
    args = parser.parse_args(argv)
    if args.check:
        return check(args.dir)
    write(args.dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
