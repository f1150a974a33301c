"""End-to-end smoke test of ``rh-dask demo`` in this process (the README's main job)."""

import json
import subprocess
import sys

from rh_dask.app.cli import main


def test_demo_beats_least_squares_on_contaminated_stream(tmp_path, capsys):
    out = tmp_path / "demo"
    argv = ["demo", "--rows", "40000", "--chunk-rows", "10000", "--features", "5"]
    assert main([*argv, "--scheduler", "none", "--output-dir", str(out), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "in-process: no cluster (--scheduler none)" in printed
    assert "fitted 40,000 rows in 4 chunks" in printed
    assert "least squares" in printed and "rows/s" in printed
    report = json.loads((out / "report" / "report.json").read_text())
    assert len(report["history"]) == 4
    # Outliers and t(2) noise: the robust fit must be clearly closer to the truth.
    assert report["demo"]["huber_error"] < 0.5 * report["demo"]["least_squares_error"]


def test_the_library_imports_without_the_application():
    code = (
        "import sys, rh_dask; "
        "print(sorted(m for m in sys.modules if m.split('.')[:2] == ['rh_dask', 'app']))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
