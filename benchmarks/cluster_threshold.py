"""When a local cluster pays for itself: ``rh-dask fit`` with and without one.

Writes a Parquet dataset per shape (65,536-row files, as the demo writes
them), then times the whole command, ``python -m rh_dask fit``, in a fresh
interpreter, with ``--scheduler local`` (the default local cluster) and with
``--scheduler none`` (in this process), alternating the two. Records the
command's wall-clock time and the fit's own time (its "fitted ... in X s"
line), medians of the repeats, and the smallest shape at which the cluster
is faster. That size is where ``rh-dask.cli.in-process-max-rows`` belongs.

    python benchmarks/cluster_threshold.py --repeats 3 \\
        --output benchmarks/results/cluster_threshold.json
"""

from __future__ import annotations

import argparse
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd
from common import environment, summarize, write_json

from rh_dask.datasets import StreamSpec

SCHEMA = "rh-dask/bench/cluster-threshold/1"
#: Rows per Parquet file (one batch each), the demo's chunk size.
FILE_ROWS = 65_536
MODES = ("local", "none")
_FITTED = re.compile(r"^fitted [\d,]+ rows in \d+ chunks.* in ([\d.]+) s:", re.M)


def write_dataset(directory: Path, rows: int, features: int) -> int:
    """``rows`` generated rows as Parquet files of FILE_ROWS rows; returns the bytes written."""
    directory.mkdir(parents=True)
    spec = StreamSpec(n_features=features, seed=3)
    columns = [f"x{j}" for j in range(features)]
    width = len(str(-(-rows // FILE_ROWS)))
    for index, start in enumerate(range(0, rows, FILE_ROWS)):
        X, y = spec.chunk(index, min(FILE_ROWS, rows - start))
        frame = pd.DataFrame(X, columns=columns).assign(y=y)
        frame.to_parquet(directory / f"part-{index:0{width}d}.parquet", index=False)
    return sum(p.stat().st_size for p in directory.iterdir())


def run_fit(data: Path, model: Path, mode: str, timeout: float) -> dict[str, float]:
    """One ``rh-dask fit`` in a fresh interpreter: wall and fit seconds."""
    command = [sys.executable, "-m", "rh_dask", "fit", "--input", str(data), "--target", "y"]
    command += ["--output", str(model), "--scheduler", mode, "--no-progress"]
    start = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - start
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({result.returncode}): {result.stderr}")
    fitted = _FITTED.search(result.stdout)
    if fitted is None:
        raise RuntimeError(f"no 'fitted' line in the output of {' '.join(command)}")
    return {"wall_seconds": wall, "fit_seconds": float(fitted.group(1))}


def parse_shape(text: str) -> tuple[int, int]:
    rows, features = text.lower().split("x")
    return int(float(rows)), int(features)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--shapes",
        nargs="+",
        default=["1e5x20", "3e5x20", "1e6x20", "3e6x20", "1e7x20", "1e5x90", "1e6x90", "3e6x90"],
        help="ROWSxFEATURES, e.g. 1e6x20",
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per command")
    parser.add_argument("--scratch", type=Path, help="where datasets go (default: a temp dir)")
    parser.add_argument("--output", default="benchmarks/results/cluster_threshold.json")
    args = parser.parse_args(argv)

    scratch = Path(tempfile.mkdtemp(prefix="rh-dask-threshold-", dir=args.scratch))
    cases = []
    try:
        for text in args.shapes:
            rows, features = parse_shape(text)
            data = scratch / f"{rows}x{features}.parquet"
            nbytes = write_dataset(data, rows, features)
            samples: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
            for _ in range(args.repeats):  # alternate, so drifting load hits both alike
                for mode in MODES:
                    samples[mode].append(run_fit(data, scratch / "model.npz", mode, args.timeout))
            case: dict = {
                "rows": rows,
                "features": features,
                "files": -(-rows // FILE_ROWS),
                "file_rows": FILE_ROWS,
                "bytes": nbytes,
                "dtype": "float64",
            }
            for mode in MODES:
                walls = [s["wall_seconds"] for s in samples[mode]]
                fits = [s["fit_seconds"] for s in samples[mode]]
                case[mode] = {
                    "wall_seconds": walls,
                    "fit_seconds": fits,
                    "wall": summarize(walls),
                    "fit": summarize(fits),
                }
            local, none = (statistics.median(case[m]["wall_seconds"]) for m in MODES)
            case["cluster_faster"] = local < none
            cases.append(case)
            fits = " / ".join(f"{case[m]['fit']['median']:.2f}" for m in MODES)
            print(
                f"{rows:>11,} x {features:3d}  local {local:7.2f} s  none {none:7.2f} s  "
                f"(fit {fits} s)",
                flush=True,
            )
            shutil.rmtree(data)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    faster = [c["rows"] for c in cases if c["cluster_faster"]]
    summary = {
        "smallest_rows_where_the_cluster_is_faster": min(faster) if faster else None,
        "largest_rows_where_in_process_is_faster": max(
            (c["rows"] for c in cases if not c["cluster_faster"]), default=None
        ),
    }
    payload = {
        "schema": SCHEMA,
        "environment": environment(),
        "cases": cases,
        "summary": summary,
        "median_of": args.repeats,
    }
    print(summary)
    write_json(args.output, payload)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
