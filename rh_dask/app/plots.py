"""The three plots of a fit report, drawn with matplotlib's Agg canvas (no display).

Each function takes the JSON-ready sections of ``report.json`` (so a report
can be re-plotted from the file alone) and writes one PNG.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import StrMethodFormatter

__all__ = ["MAX_LINES", "MAX_POINTS", "coefficients", "convergence", "throughput"]

#: Coefficients drawn at most (the largest in magnitude at the end of the stream).
MAX_LINES = 10
#: Trajectory points drawn at most per line; ``report.json`` keeps them all.
#: A few hundred already resolve a plot 880 pixels wide; thousands of batches
#: would only make the PNG slower to draw.
MAX_POINTS = 400
_DPI = 110


def _thin(n: int, limit: int = MAX_POINTS) -> np.ndarray:
    """Indices of at most ``limit`` of ``n`` points, evenly spread, first and last kept."""
    if n <= limit:
        return np.arange(n)
    return np.unique(np.linspace(0, n - 1, limit).round().astype(np.int64))


def _save(fig: Figure, path: Path) -> Path:
    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=_DPI)
    return path


def _empty(ax: Any, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="0.4")
    ax.set_xticks([])
    ax.set_yticks([])


def coefficients(trajectory: dict[str, Any], path: Path, truth: np.ndarray | None = None) -> Path:
    """Coefficients after each batch of the stream, and their distance to the end.

    The upper panel draws at most :data:`MAX_LINES` coefficients: the
    intercept, and the features with the largest final magnitude; ``truth``
    (intercept last) adds dotted reference lines in the same colours. The
    lower panel shows how far the whole vector still was from its final
    value, ‖β − β_final‖₂, on a log scale: how fast the stream settled. Long
    streams are drawn at :data:`MAX_POINTS` evenly spread points.
    """
    fig = Figure(figsize=(8.0, 6.4), layout="constrained")
    ax, settle = fig.subplots(2, 1, sharex=True, height_ratios=[2.2, 1])
    betas = np.asarray(trajectory["coefficients"], dtype=float)
    names = list(trajectory["names"])
    x = np.asarray(trajectory["after_chunk"])
    if betas.size == 0:
        _empty(ax, "no coefficient trajectory was recorded")
        return _save(fig, path)
    drawn = _thin(len(x))
    betas, x = betas[drawn], x[drawn]
    has_intercept = bool(names) and names[-1] == "(intercept)"
    n_features = betas.shape[1] - int(has_intercept)
    order = np.argsort(-np.abs(betas[-1, :n_features]), kind="stable")
    shown = list(order[: MAX_LINES - int(has_intercept)])
    if has_intercept:
        shown.append(n_features)
    marker = "o" if len(x) <= 30 else None
    for colour, j in enumerate(shown):
        style = {"color": f"C{colour % 10}"}
        ax.plot(x, betas[:, j], marker=marker, markersize=3, label=names[j], **style)
        if truth is not None and j < len(truth):
            ax.axhline(truth[j], linestyle=":", linewidth=1, **style)
    hidden = betas.shape[1] - len(shown)
    title = "Coefficients over the stream"
    if hidden:
        title += f" ({len(shown)} of {betas.shape[1]}: largest at the end)"
    if truth is not None:
        title += "; dotted: truth"
    ax.set_title(title)
    ax.set_ylabel("coefficient")
    ax.grid(alpha=0.3)
    ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize="small", frameon=False)
    distance = np.linalg.norm(betas[:-1] - betas[-1], axis=1)
    if distance.size and np.any(distance > 0):
        settle.semilogy(
            x[:-1], np.where(distance > 0, distance, np.nan), marker=marker, color="0.3"
        )
    else:
        _empty(settle, "a single batch: nothing to compare with the end")
    settle.set_ylabel("‖β − β_final‖₂")
    settle.set_xlabel("chunks consumed")
    settle.grid(alpha=0.3)
    return _save(fig, path)


def convergence(history: list[dict[str, Any]], path: Path) -> Path:
    """Iterations (bars, non-converged chunks in red) and objective per chunk."""
    fig = Figure(figsize=(8.0, 5.6), layout="constrained")
    top, bottom = fig.subplots(2, 1, sharex=True)
    if not history:
        _empty(top, "no chunk was consumed")
        return _save(fig, path)
    chunk = np.array([h["chunk"] for h in history])
    iterations = np.array([h["iterations"] for h in history])
    converged = np.array([bool(h["converged"]) for h in history])
    objective = np.array([np.nan if h["objective"] is None else h["objective"] for h in history])
    colours = np.where(converged, "C0", "C3")
    top.bar(chunk, iterations, color=colours, width=0.8)
    top.set_ylabel("iterations")
    stuck = int((~converged).sum())
    top.set_title(
        "Solver iterations per chunk"
        + (f" ({stuck} chunk(s) not converged, red)" if stuck else " (all converged)")
    )
    top.grid(alpha=0.3, axis="y")
    bottom.plot(chunk, objective, marker="." if len(chunk) <= 200 else None, color="C1")
    if np.all(objective[np.isfinite(objective)] > 0):
        bottom.set_yscale("log")
    bottom.set_ylabel("objective at the chunk's estimate")
    bottom.set_xlabel("chunk")
    bottom.grid(alpha=0.3)
    return _save(fig, path)


def throughput(
    trajectory: dict[str, Any],
    history: list[dict[str, Any]],
    path: Path,
    fit_seconds: float | None = None,
) -> Path:
    """Rows consumed against engine and wall-clock time, and the engine's rows/s per chunk.

    The upper panel draws the rows consumed against the engine's cumulative
    time (one point per batch) and, given ``fit_seconds``, the whole fit's
    average over its wall-clock time (loading, transfers, start-up and
    engine): the gap between the two slopes is what the pipeline around
    the engine costs.
    """
    fig = Figure(figsize=(8.0, 5.6), layout="constrained")
    top, bottom = fig.subplots(2, 1)
    seconds = np.asarray(trajectory["engine_seconds"], dtype=float)
    rows = np.asarray(trajectory["rows"], dtype=float)
    if seconds.size:
        drawn = _thin(seconds.size)
        t = np.concatenate([[0.0], seconds[drawn]])
        r = np.concatenate([[0.0], rows[drawn]])
        engine_rate = rows[-1] / max(seconds[-1], 1e-12)
        top.plot(t, r, color="C0", linewidth=1.5, label=f"engine: {engine_rate:,.0f} rows/s")
        if fit_seconds is not None and fit_seconds > 0:
            overall = rows[-1] / fit_seconds
            top.plot(
                [0.0, fit_seconds],
                [0.0, rows[-1]],
                color="C1",
                linestyle="--",
                linewidth=1,
                label=f"whole fit (wall-clock): {overall:,.0f} rows/s",
            )
        top.legend(fontsize="small", frameon=False)
        top.set_xlim(left=0)
        top.set_ylim(bottom=0)
        top.yaxis.set_major_formatter(StrMethodFormatter("{x:,.0f}"))
    else:
        _empty(top, "no timing was recorded")
    top.set_title("Rows consumed: engine time against the whole fit")
    top.set_xlabel("seconds")
    top.set_ylabel("rows consumed")
    top.grid(alpha=0.3)
    timed = [h for h in history if h["seconds"] and h["seconds"] > 0]
    if timed:
        chunk = np.array([h["chunk"] for h in timed])
        speed = np.array([h["rows"] / h["seconds"] for h in timed])
        bottom.plot(chunk, speed, marker="." if len(chunk) <= 200 else None, color="C2")
        bottom.set_yscale("log")
    else:
        _empty(bottom, "no engine timing was recorded")
    bottom.set_title("Engine alone, per chunk")
    bottom.set_xlabel("chunk")
    bottom.set_ylabel("rows / s")
    bottom.grid(alpha=0.3)
    return _save(fig, path)
