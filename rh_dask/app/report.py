"""Per-fit reports: ``report.json`` and the plots next to it.

A report directory holds

* ``report.json``: schema ``rh-dask-report`` version 3 with the command,
  the configuration, the data, the result (coefficients by name), the
  inference (the coefficient table with sandwich standard errors, or why
  there is none), the robust diagnostics per chunk, timings, the per-chunk
  history, the coefficient trajectory (β after every batch), the engine and
  where it ran, the hardware of the client and of every worker, and for a
  grid the prequential scores of every configuration;
* ``coefficients.png``: coefficient trajectories over the stream, with the
  final confidence intervals as bands;
* ``convergence.png``: iterations and the mean Huber loss per chunk;
* ``diagnostics.png``: share of rows with |r| > τ and the robust residual
  scale per chunk;
* ``throughput.png``: rows consumed against the engine's measured time, and
  the engine's own rows per second per chunk;
* ``prequential.png``, for a grid only: the prequential scores per
  configuration.

The plots need matplotlib (the ``report`` extra); without it
:func:`write_report` raises :class:`~rh_dask.app.extras.MissingExtraError`
before writing anything.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import sys
from pathlib import Path
from typing import Any

import numpy as np

from .._version import __version__
from ..exceptions import InferenceError
from ..inference import summarize
from .extras import require
from .jobs import FitOutcome

__all__ = [
    "GRID_FILE",
    "REPORT_FILES",
    "SCHEMA",
    "SCHEMA_VERSION",
    "build_report",
    "hardware",
    "write_report",
]

SCHEMA = "rh-dask-report"
SCHEMA_VERSION = 3
#: The files :func:`write_report` always writes, ``report.json`` first.
REPORT_FILES = (
    "report.json",
    "coefficients.png",
    "convergence.png",
    "diagnostics.png",
    "throughput.png",
)
#: The plot :func:`write_report` adds for a report with grid scores.
GRID_FILE = "prequential.png"
#: The columns of the grid scores a report keeps, when the frame has them.
_GRID_COLUMNS = ("config", "tau", "lambda_scale", "batch", "chunk", "rows", "huber_loss", "mae")
_PACKAGES = ("numpy", "pandas", "dask", "distributed", "scipy", "cupy", "dask_cuda")


def _jsonable(value: Any) -> Any:
    """Plain JSON values: NumPy scalars and arrays unwrapped, NaN and inf as null."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.ndarray):
        return _jsonable(value.tolist())
    if isinstance(value, np.generic):
        return _jsonable(value.item())
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Path):
        return os.fspath(value)
    return value


def _versions() -> dict[str, str]:
    out = {"rh_dask": __version__, "python": platform.python_version()}
    for name in _PACKAGES:
        module = sys.modules.get(name)
        if module is not None:
            out[name] = str(getattr(module, "__version__", "unknown"))
    return out


def _client_gpu() -> list[str]:
    """GPU names visible to this process, when CuPy is already loaded (never imported here)."""
    cupy = sys.modules.get("cupy")
    if cupy is None:
        return []
    try:
        count = cupy.cuda.runtime.getDeviceCount()
        return [cupy.cuda.runtime.getDeviceProperties(i)["name"].decode() for i in range(count)]
    except Exception:  # a CuPy without a working driver
        return []


def hardware(session: Any | None) -> dict[str, Any]:
    """The client machine, and the cluster's workers when there is a cluster."""
    import psutil  # a dependency of distributed

    return {
        "client": {
            "host": platform.node(),
            "platform": platform.platform(),
            "machine": platform.machine(),
            "cpus": os.cpu_count(),
            "memory_bytes": int(psutil.virtual_memory().total),
            "gpus": _client_gpu(),
        },
        "cluster": None
        if session is None or session.client is None
        else {
            "kind": session.kind,
            "scheduler": session.address,
            "workers": session.workers(),
        },
    }


def _coefficients_by_name(model: Any, names: list[str]) -> dict[str, float]:
    out = dict(zip(names, (float(c) for c in model.coef_), strict=True))
    if model.fit_intercept:
        out["(intercept)"] = float(model.intercept_)
    return out


def _inference(model: Any, feature_names: list[str], engine: str) -> dict[str, Any]:
    """The coefficient table with sandwich standard errors, or why there is none."""
    try:
        summary = summarize(
            model.state_,
            tau=model.tau,
            penalty=model.penalty,
            dtype=model.dtype,
            feature_names=feature_names,
            engine=engine,
        )
    except InferenceError as exc:
        return {"available": False, "reason": str(exc)}
    return {"available": True, **summary.to_dict()}


def _robust_diagnostics(history: Any, engine: str) -> dict[str, Any]:
    """How many chunks report the robust diagnostics, and their range over the stream."""
    n = len(history)
    share = history["outlier_share"].dropna() if n else history
    scale = history["residual_scale"].dropna() if n else history
    reported = int(min(len(share), len(scale))) if n else 0
    out: dict[str, Any] = {
        "available": reported > 0,
        "chunks_reported": reported,
        "residual_scale_estimator": "1.4826 x weighted MAD of each chunk's residuals",
    }
    if reported == 0:
        out["reason"] = (
            "no chunk was consumed" if n == 0 else f"not reported by the {engine} engine"
        )
        return out
    if reported < n:
        out["reason"] = (
            f"reported for {reported} of {n} chunks (the others came from an engine or a "
            "checkpoint that does not record them)"
        )
    out.update(
        outlier_share_mean=float(share.mean()),
        outlier_share_max=float(share.max()),
        residual_scale_median=float(scale.median()),
        residual_scale_min=float(scale.min()),
        residual_scale_max=float(scale.max()),
    )
    return out


def _grid(scores: Any) -> dict[str, Any]:
    """The grid section: the prequential scores, one record per (batch, configuration)."""
    missing = [c for c in ("batch", "config", "huber_loss", "mae") if c not in scores.columns]
    if missing:
        raise ValueError(f"grid scores lack the columns {missing}")
    kept = [c for c in _GRID_COLUMNS if c in scores.columns]
    return {"scores": scores[kept].to_dict(orient="records")}


def _recoveries(model: Any) -> list[dict[str, Any]]:
    """``recoveries_`` as records, times as ISO 8601 UTC text."""
    records = model.recoveries_.to_dict(orient="records")
    for record in records:
        record["time"] = record["time"].isoformat()
    return records


def build_report(
    outcome: FitOutcome,
    *,
    data: dict[str, Any],
    feature_names: list[str],
    session: Any | None = None,
    command: list[str] | None = None,
    timings: dict[str, float] | None = None,
    model_path: str | None = None,
    extra: dict[str, Any] | None = None,
    grid_scores: Any | None = None,
) -> dict[str, Any]:
    """Everything ``report.json`` holds, as JSON-ready values.

    Parameters
    ----------
    outcome : FitOutcome
        The fitted model, its history and trajectory.
    data : dict
        Description of the input (:attr:`rh_dask.app.io.Table.description`).
    feature_names : list of str
        Display names of the features.
    session : ClusterSession, optional
        The cluster the fit ran on.
    command : list of str, optional
        The command line.
    timings : dict, optional
        Further timings (seconds) to record next to the fit's.
    model_path : str, optional
        Where the model was saved.
    extra : dict, optional
        Further sections (the demo adds its comparison with least squares).
    grid_scores : pandas.DataFrame, optional
        Prequential scores of a grid of configurations, one row per (batch,
        configuration), with at least the columns ``batch``, ``config`` (a
        label), ``huber_loss`` and ``mae`` (``tau``, ``lambda_scale``,
        ``chunk`` and ``rows`` are kept too when present). Adds the ``grid``
        section and, in :func:`write_report`, ``prequential.png``.

    Raises
    ------
    ValueError
        ``grid_scores`` lacks one of the required columns.
    """
    model = outcome.model
    history = outcome.history
    rows = int(model.n_samples_seen_)
    engine_seconds = float(history["seconds"].sum()) if len(history) else 0.0
    wait_seconds = float(history["wait_seconds"].sum()) if len(history) else 0.0
    fit_seconds = float(outcome.seconds)
    traj = outcome.trajectory
    names = [*feature_names, *(["(intercept)"] if model.fit_intercept else [])]
    report = {
        "schema": SCHEMA,
        "schema_version": SCHEMA_VERSION,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": command,
        "parameters": model.get_params(),
        "data": {**data, "rows": rows, "chunks_consumed": len(history)},
        "result": {
            "model": model_path,
            "coefficients": _coefficients_by_name(model, feature_names),
            "n_samples_seen": rows,
            "batch_count": int(model.state_.batch_count),
            "n_empty_chunks": int(model.n_empty_chunks_),
            "chunks_not_converged": int((~history["converged"]).sum()) if len(history) else 0,
        },
        "inference": _inference(model, feature_names, outcome.engine),
        "robust_diagnostics": _robust_diagnostics(history, outcome.engine),
        "timings": {
            **(timings or {}),
            "fit_seconds": fit_seconds,
            "engine_seconds": engine_seconds,
            "engine_wait_seconds": wait_seconds,
            "rows_per_second": rows / fit_seconds if fit_seconds > 0 else None,
            "engine_rows_per_second": rows / engine_seconds if engine_seconds > 0 else None,
        },
        "engine": {
            "name": outcome.engine,
            "dtype": model.dtype,
            "placement": outcome.placement,
            "notes": outcome.notes,
        },
        "history": history.to_dict(orient="records"),
        "recoveries": _recoveries(model),
        "coefficient_trajectory": {
            "names": names,
            "after_chunk": traj.after_chunk,
            "rows": traj.rows,
            "engine_seconds": traj.engine_seconds,
            "coefficients": traj.coefficients,
        },
        "hardware": hardware(session),
        "versions": _versions(),
    }
    if grid_scores is not None:
        report["grid"] = _grid(grid_scores)
    if extra:
        report.update(extra)
    return _jsonable(report)


def write_report(
    directory: str | os.PathLike[str],
    report: dict[str, Any],
    *,
    truth: np.ndarray | None = None,
) -> list[Path]:
    """Write ``report.json`` and the plots into ``directory`` (created if needed).

    Parameters
    ----------
    directory : str or path-like
    report : dict
        What :func:`build_report` returned.
    truth : ndarray, optional
        True coefficients (intercept last), drawn as reference lines.

    Returns
    -------
    list of Path
        The files written, ``report.json`` first.
    """
    require("matplotlib", "report", "plotting the fit report")
    from . import plots

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    json_name, coefficients_name, convergence_name, diagnostics_name, throughput_name = (
        REPORT_FILES
    )
    engine = report["engine"]["name"]
    figures = [
        plots.coefficients(
            report["coefficient_trajectory"],
            out / coefficients_name,
            truth,
            inference=report.get("inference"),
        ),
        plots.convergence(report["history"], out / convergence_name, engine=engine),
        plots.diagnostics(
            report["history"],
            out / diagnostics_name,
            tau=report["parameters"].get("tau"),
            engine=engine,
        ),
        plots.throughput(
            report["history"],
            out / throughput_name,
            fit_seconds=report["timings"]["fit_seconds"],
        ),
    ]
    if report.get("grid") is not None:
        import pandas as pd

        scores = pd.DataFrame(report["grid"]["scores"])
        scores[["huber_loss", "mae"]] = scores[["huber_loss", "mae"]].astype(float)
        figures.append(plots.prequential(scores, out / GRID_FILE))
    report = dict(report, plots=[p.name for p in figures])
    path = out / json_name
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=2, allow_nan=False) + "\n")
    os.replace(tmp, path)
    return [path, *figures]
