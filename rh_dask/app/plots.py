"""The plots of a fit report, drawn with matplotlib's Agg canvas (no display).

Each function takes the JSON-ready sections of ``report.json`` (so a report
can be re-plotted from the file alone), or for :func:`prequential` a plain
DataFrame of scores, and writes one PNG. Every curve is drawn through
measured points only, with markers where there are few enough to see.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import PercentFormatter, StrMethodFormatter

from ..inference import interval_columns

__all__ = [
    "MAX_LINES",
    "MAX_POINTS",
    "PREQUENTIAL_COLUMNS",
    "coefficients",
    "convergence",
    "diagnostics",
    "prequential",
    "throughput",
]

#: Coefficients drawn at most (the largest in magnitude at the end of the stream).
MAX_LINES = 10
#: Trajectory points drawn at most per line; ``report.json`` keeps them all.
#: A few hundred already resolve a plot 880 pixels wide; thousands of batches
#: would only make the PNG slower to draw.
MAX_POINTS = 400
_DPI = 110
#: Columns :func:`prequential` needs: the batch, a configuration label and its two scores.
PREQUENTIAL_COLUMNS = ("batch", "config", "huber_loss", "mae")
#: Markers are drawn on a curve of at most this many points.
_MARKED = 200


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
    ax.text(
        0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="0.4", wrap=True
    )
    ax.set_xticks([])
    ax.set_yticks([])


def _marker(n: int) -> str | None:
    return "." if n <= _MARKED else None


def _column(history: list[dict[str, Any]], name: str) -> np.ndarray:
    """A float column of the history, NaN where a value is missing (null, absent)."""
    return np.array(
        [np.nan if h.get(name) is None else float(h[name]) for h in history], dtype=float
    )


def _not_reported(engine: str | None) -> str:
    return f"not reported by the {engine} engine" if engine else "not reported by the engine"


def coefficients(
    trajectory: dict[str, Any],
    path: Path,
    truth: np.ndarray | None = None,
    inference: dict[str, Any] | None = None,
) -> Path:
    """Coefficients after each batch of the stream, their final intervals, and the settling.

    The upper panel draws at most :data:`MAX_LINES` coefficients: the
    intercept, and the features with the largest final magnitude; ``truth``
    (intercept last) adds dotted reference lines in the same colours. When
    ``inference`` (the report's section) is available, each drawn
    coefficient gets a shaded band: the final confidence interval, across the
    whole stream, so one sees where the trajectory sat against the end
    result's uncertainty (the history keeps β per batch, not its covariance).
    The lower panel shows how far the whole vector still was from its final
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
    bands = _final_intervals(inference, betas.shape[1])
    marker = "o" if len(x) <= 30 else None
    for colour, j in enumerate(shown):
        style = {"color": f"C{colour % 10}"}
        ax.plot(x, betas[:, j], marker=marker, markersize=3, label=names[j], **style)
        if bands is not None:
            ax.fill_between(
                [x[0], x[-1]], bands[j, 0], bands[j, 1], alpha=0.15, linewidth=0, **style
            )
        if truth is not None and j < len(truth):
            ax.axhline(truth[j], linestyle=":", linewidth=1, **style)
    hidden = betas.shape[1] - len(shown)
    title = "Coefficients over the stream"
    if hidden:
        title += f" ({len(shown)} of {betas.shape[1]}: largest at the end)"
    notes = []
    if bands is not None:
        level = 100 * (1 - float(inference["alpha"]))
        notes.append(f"shaded: final {level:g}% interval")
    if truth is not None:
        notes.append("dotted: truth")
    if notes:
        title += "\n" + "; ".join(notes)
    ax.set_title(title)
    if inference is not None and not inference.get("available", False):
        ax.text(
            0.01,
            0.01,
            "no confidence intervals: see report.json, inference.reason",
            transform=ax.transAxes,
            fontsize="small",
            color="0.4",
        )
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


def _final_intervals(inference: dict[str, Any] | None, n_params: int) -> np.ndarray | None:
    """(n_params, 2) interval bounds from the report's inference section, or None."""
    if not inference or not inference.get("available", False):
        return None
    rows = inference["parameters"]
    if len(rows) != n_params:
        return None
    low, high = interval_columns(float(inference["alpha"]))
    return np.array(
        [[np.nan if r[c] is None else r[c] for c in (low, high)] for r in rows], dtype=float
    )


def convergence(history: list[dict[str, Any]], path: Path, engine: str | None = None) -> Path:
    """Iterations per chunk (non-converged in red) and the mean Huber loss at each estimate.

    The lower panel is Σ w ρ_τ(r) / Σ w over the chunk's own rows at the
    chunk's final β: flat on a stationary stream, up on a chunk that fits
    worse (contamination, drift). The solver's surrogate objective is not
    drawn: it is normalised by all the rows seen so far and falls like 1/N
    whatever the data.
    """
    fig = Figure(figsize=(8.0, 5.6), layout="constrained")
    top, bottom = fig.subplots(2, 1, sharex=True)
    if not history:
        _empty(top, "no chunk was consumed")
        return _save(fig, path)
    chunk = np.array([h["chunk"] for h in history])
    iterations = np.array([h["iterations"] for h in history])
    converged = np.array([bool(h["converged"]) for h in history])
    colours = np.where(converged, "C0", "C3")
    top.bar(chunk, iterations, color=colours, width=0.8)
    top.set_ylabel("iterations")
    stuck = int((~converged).sum())
    top.set_title(
        "Solver iterations per chunk"
        + (f" ({stuck} chunk(s) not converged, red)" if stuck else " (all converged)")
    )
    top.grid(alpha=0.3, axis="y")
    loss = _column(history, "mean_loss")
    measured = np.isfinite(loss)
    if measured.any():
        bottom.plot(
            chunk[measured], loss[measured], marker=_marker(int(measured.sum())), color="C1"
        )
        bottom.set_title("Mean Huber loss of each chunk's rows at its estimate")
    else:
        _empty(bottom, f"mean Huber loss per chunk {_not_reported(engine)}")
    bottom.set_ylabel("mean Huber loss")
    bottom.set_xlabel("chunk")
    bottom.grid(alpha=0.3)
    return _save(fig, path)


def diagnostics(
    history: list[dict[str, Any]],
    path: Path,
    tau: float | None = None,
    engine: str | None = None,
) -> Path:
    """Robust diagnostics per chunk at the chunk's estimate: share beyond τ, residual scale.

    The upper panel is the share of the chunk's rows with |r| > τ (the rows
    the loss treats as outliers); the lower one is 1.4826 × MAD of its
    residuals, with τ as a dashed line for comparison (τ ≈ 1.345 × scale is
    the classic choice). Chunks whose engine did not report them are left
    out; when none did, the panels say so rather than draw zeros.
    """
    fig = Figure(figsize=(8.0, 5.6), layout="constrained")
    top, bottom = fig.subplots(2, 1, sharex=True)
    if not history:
        _empty(top, "no chunk was consumed")
        return _save(fig, path)
    chunk = np.array([h["chunk"] for h in history])
    share = _column(history, "outlier_share")
    scale = _column(history, "residual_scale")
    for ax, values, what in (
        (top, share, "share of rows with |r| > τ"),
        (bottom, scale, "robust residual scale"),
    ):
        measured = np.isfinite(values)
        if not measured.any():
            _empty(ax, f"{what} {_not_reported(engine)}")
            continue
        ax.plot(
            chunk[measured],
            values[measured],
            marker=_marker(int(measured.sum())),
            color="C4" if ax is top else "C5",
            label=what,
        )
        ax.grid(alpha=0.3)
    top.set_title("Robust diagnostics per chunk, at the chunk's estimate")
    top.set_ylabel("rows with |r| > τ")
    top.yaxis.set_major_formatter(PercentFormatter(xmax=1.0))
    bottom.set_ylabel("1.4826 × MAD of r")
    bottom.set_xlabel("chunk")
    if tau is not None and np.isfinite(scale).any():
        bottom.axhline(tau, color="0.3", linestyle="--", linewidth=1, label=f"τ = {tau:g}")
        bottom.legend(fontsize="small", frameon=False)
        bottom.set_ylim(bottom=0)
    return _save(fig, path)


def throughput(
    history: list[dict[str, Any]],
    path: Path,
    fit_seconds: float | None = None,
) -> Path:
    """Rows consumed against the engine's measured time, and the engine's rows/s per chunk.

    The upper panel draws, one point per batch, the rows consumed against the
    engine's cumulative solve time and against its cumulative solve plus
    waiting time (how long it sat idle for the next chunk: loading and
    transfers), both summed from the history; the gap between the two curves
    is what the pipeline around the engine costs. Given ``fit_seconds``, the
    end of the whole fit (start-up included) is one more measured point.
    """
    fig = Figure(figsize=(8.0, 5.6), layout="constrained")
    top, bottom = fig.subplots(2, 1)
    if history:
        rows = np.cumsum([float(h["rows"]) for h in history])
        busy = np.cumsum(_column(history, "seconds"))
        waits = np.nan_to_num(_column(history, "wait_seconds"))
        elapsed = busy + np.cumsum(waits)
        drawn = _thin(rows.size)
        marker = _marker(drawn.size)
        r = np.concatenate([[0.0], rows[drawn]])
        engine_rate = rows[-1] / max(busy[-1], 1e-12)
        top.plot(
            np.concatenate([[0.0], busy[drawn]]),
            r,
            color="C0",
            marker=marker,
            label=f"engine solving: {engine_rate:,.0f} rows/s",
        )
        if waits.sum() > 0:
            walk_rate = rows[-1] / max(elapsed[-1], 1e-12)
            top.plot(
                np.concatenate([[0.0], elapsed[drawn]]),
                r,
                color="C1",
                marker=marker,
                label=f"engine solving + waiting for chunks: {walk_rate:,.0f} rows/s",
            )
        if fit_seconds is not None and fit_seconds > 0:
            top.plot(
                [fit_seconds],
                [rows[-1]],
                linestyle="none",
                marker="s",
                color="C3",
                label=f"whole fit ended (wall-clock): {rows[-1] / fit_seconds:,.0f} rows/s",
            )
        top.legend(fontsize="small", frameon=False)
        top.set_xlim(left=0)
        top.set_ylim(bottom=0)
        top.yaxis.set_major_formatter(StrMethodFormatter("{x:,.0f}"))
    else:
        _empty(top, "no timing was recorded")
    top.set_title("Rows consumed against measured time")
    top.set_xlabel("seconds")
    top.set_ylabel("rows consumed")
    top.grid(alpha=0.3)
    timed = [h for h in history if h["seconds"] and h["seconds"] > 0]
    if timed:
        chunk = np.array([h["chunk"] for h in timed])
        speed = np.array([h["rows"] / h["seconds"] for h in timed])
        bottom.plot(chunk, speed, marker=_marker(len(chunk)), color="C2")
        bottom.set_yscale("log")
    else:
        _empty(bottom, "no engine timing was recorded")
    bottom.set_title("Engine alone, per chunk")
    bottom.set_xlabel("chunk")
    bottom.set_ylabel("rows / s")
    bottom.grid(alpha=0.3)
    return _save(fig, path)


def prequential(scores: Any, path: Path, selected: Any | None = None) -> Path:
    """Prequential scores per configuration of a grid: each chunk scored before it is consumed.

    Parameters
    ----------
    scores : pandas.DataFrame
        One row per (batch, configuration), with the columns
        :data:`PREQUENTIAL_COLUMNS`: ``batch``, ``config`` (a label: its
        text names the line), ``huber_loss`` (mean Huber loss at the
        reference τ) and ``mae``; NaN scores (the first batch, which no
        estimate precedes) are left out.
    path : Path
    selected : optional
        The ``config`` label of the selected configuration, drawn thicker.

    Raises
    ------
    ValueError
        When a column is missing.
    """
    missing = [c for c in PREQUENTIAL_COLUMNS if c not in scores.columns]
    if missing:
        raise ValueError(
            f"prequential scores need the columns {list(PREQUENTIAL_COLUMNS)}; missing {missing}"
        )
    fig = Figure(figsize=(8.0, 5.6), layout="constrained")
    top, bottom = fig.subplots(2, 1, sharex=True)
    labels = list(dict.fromkeys(scores["config"]))
    if not labels:
        _empty(top, "no batch was scored")
        return _save(fig, path)
    names = _config_names(scores)
    for colour, label in enumerate(labels):
        rows = scores[scores["config"] == label].sort_values("batch")
        style = {"color": f"C{colour % 10}", "label": names[label]}
        if selected is not None and label == selected:
            style.update(linewidth=2.5, label=f"{names[label]} (selected)")
        for ax, column in ((top, "huber_loss"), (bottom, "mae")):
            values = rows[column].to_numpy(dtype=float)
            batch = rows["batch"].to_numpy()
            measured = np.isfinite(values)
            kept = np.flatnonzero(measured)[_thin(int(measured.sum()))]
            ax.plot(batch[kept], values[kept], marker=_marker(kept.size), **style)
    top.set_title("Prequential scores per configuration (each chunk scored before it is fitted)")
    top.set_ylabel("mean Huber loss")
    bottom.set_ylabel("mean absolute error")
    bottom.set_xlabel("batch")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    top.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize="small", frameon=False)
    return _save(fig, path)


def _config_names(scores: Any) -> dict[Any, str]:
    """Legend text per ``config`` label: its τ (and λ scale where it varies) when given."""
    names = {}
    varies = "lambda_scale" in scores.columns and scores["lambda_scale"].nunique() > 1
    for label, rows in scores.groupby("config", sort=False):
        text = str(label)
        if "tau" in scores.columns:
            text = f"τ = {float(rows['tau'].iloc[0]):g}"
            if varies:
                text += f", λ × {float(rows['lambda_scale'].iloc[0]):g}"
        names[label] = text
    return names
