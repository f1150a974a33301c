"""End-to-end smoke test of the in-process demo (the README's main job)."""

from rh_dask.datasets import StreamSpec
from rh_dask.demo import main, run_local_demo


def test_demo_beats_least_squares_on_contaminated_stream():
    result = run_local_demo(n_rows=40_000, chunk_rows=10_000, spec=StreamSpec(n_features=5))
    assert result.batches == 4
    # Outliers and t(2) noise: the robust fit must be clearly closer to the truth.
    assert result.huber_error < 0.5 * result.ols_error


def test_demo_cli_prints_comparison(capsys):
    assert main(["--rows", "20000", "--chunk-rows", "5000", "--features", "4"]) == 0
    out = capsys.readouterr().out
    assert "least squares" in out and "rows/s" in out
