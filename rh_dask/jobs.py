"""The fit job behind ``rh-dask fit`` and ``rh-dask demo``.

One job: take a :class:`~rh_dask.io.Table`, fit it with the estimator (on
the active ``distributed`` client, if any), and keep what a report needs.

Coefficient trajectories. ``history_`` records per-chunk diagnostics but not
the coefficients, and the engine that holds them may live in an actor on
another machine. So the job walks the stream in ``points`` consecutive
segments of chunks, one ``partial_fit`` call each, and reads ``coef_`` after
every segment. The state after the last segment is exactly the one a single
``fit`` call gives (the same chunks reach the engine in the same order);
what segments cost is a pipeline restart per segment (a new engine actor and
an empty look-ahead queue), so ``points`` is kept small, and ``points=1``
is a plain ``fit``.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
from tqdm.auto import tqdm

from .distributed.chunks import stable_partitions
from .distributed.progress import progress_enabled
from .estimator import RenewableHuberRegressor
from .exceptions import EngineUnavailableError, ValidationError
from .io import Table, take_chunks

__all__ = ["DEFAULT_TRAJECTORY_POINTS", "FitOutcome", "Trajectory", "fit_table", "resolve_engine"]

#: Segments the stream is fitted in when a report wants coefficient trajectories.
#: Each extra segment restarts the pipeline: about 0.4 s on a LocalCUDACluster
#: with an H200 and 131,072 x 90 float32 Parquet chunks (measured), hence few.
DEFAULT_TRAJECTORY_POINTS = 8


@dataclass
class Trajectory:
    """Coefficients along the stream, one point per segment.

    Attributes
    ----------
    after_chunk : list of int
        Chunks of the stream consumed (empty ones included) at each point.
    rows : list of int
        Rows consumed at each point.
    elapsed : list of float
        Wall-clock seconds since the fit started, at each point.
    coefficients : list of ndarray
        β at each point, the intercept last when the model has one.
    """

    after_chunk: list[int] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    elapsed: list[float] = field(default_factory=list)
    coefficients: list[np.ndarray] = field(default_factory=list)


@dataclass
class FitOutcome:
    """A fitted model and the facts about how it got there.

    Attributes
    ----------
    model : RenewableHuberRegressor
    history : pandas.DataFrame
        ``history_`` with ``chunk`` renumbered as the index in the whole stream.
    trajectory : Trajectory
    seconds : float
        Wall-clock time of the fit.
    engine : str
        The engine that fitted the stream.
    placements : list of dict
        Where the engine ran, per segment, when the fit ran on a cluster.
    notes : list of str
        Things the user should know (an ``auto`` engine falling back).
    """

    model: RenewableHuberRegressor
    history: pd.DataFrame
    trajectory: Trajectory
    seconds: float
    engine: str
    placements: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def resolve_engine(requested: str, gpu_workers: bool, has_client: bool) -> str:
    """The engine to ask the estimator for.

    ``auto`` picks the GPU engine on a cluster whose workers advertise a GPU,
    the NumPy engine on any other cluster, and leaves the choice to the
    estimator without a cluster.
    """
    if requested != "auto":
        return requested
    if has_client:
        return "gpu" if gpu_workers else "numpy"
    return "auto"


def _beta(model: RenewableHuberRegressor) -> np.ndarray:
    beta = np.asarray(model.coef_, dtype=np.float64)
    if model.fit_intercept:
        beta = np.append(beta, model.intercept_)
    return beta


def _history_length(model: RenewableHuberRegressor) -> int:
    return len(model.history_) if hasattr(model, "n_features_in_") else 0


def _segments(n_chunks: int, points: int) -> list[tuple[int, int]]:
    edges = np.unique(np.linspace(0, n_chunks, max(1, min(points, n_chunks)) + 1).round())
    bounds = [int(e) for e in edges]
    return list(itertools.pairwise(bounds))


def _walk(model: RenewableHuberRegressor, table: Table, points: int) -> tuple[Any, Trajectory]:
    """Fit ``table`` in segments; return the history offsets and the trajectory."""
    segments = _segments(table.n_chunks, points)
    if len(segments) == 1:
        return _walk_segments(model, table, segments, None)
    # One bar for the whole stream, not one per segment: the estimator's own
    # bar is switched off for the segment calls and restored afterwards.
    wanted = model.progress
    bar = tqdm(
        total=table.n_chunks,
        unit="chunk",
        desc="rh-dask fit",
        disable=not progress_enabled(wanted),
        dynamic_ncols=True,
    )
    model.set_params(progress=False)
    try:
        return _walk_segments(model, table, segments, bar)
    finally:
        model.set_params(progress=wanted)
        bar.close()


def _walk_segments(
    model: RenewableHuberRegressor,
    table: Table,
    segments: list[tuple[int, int]],
    bar: Any | None,
) -> tuple[Any, Trajectory]:
    trajectory = Trajectory()
    offsets: list[tuple[int, int]] = []  # (first history row of a segment, its first chunk)
    placements = []
    start = time.perf_counter()
    model.reset()
    X, y, weight = table.fit_inputs()
    for first, stop in segments:
        before = _history_length(model)
        try:
            model.partial_fit(
                take_chunks(X, first, stop),
                y if isinstance(y, str) else take_chunks(y, first, stop),
                weight if isinstance(weight, str) else take_chunks(weight, first, stop),
            )
        except ValidationError:
            if hasattr(model, "n_features_in_") or len(segments) == 1:
                raise
            # The leading segment held only empty chunks (or the input is bad):
            # a single fit over the whole stream settles which, without segments.
            return None, Trajectory()
        offsets.append((before, first))
        placement = model.placement_
        if placement:
            placements.append(dict(placement, chunks=[first, stop]))
        trajectory.after_chunk.append(stop)
        trajectory.rows.append(int(model.n_samples_seen_))
        trajectory.elapsed.append(time.perf_counter() - start)
        trajectory.coefficients.append(_beta(model))
        if bar is not None:
            rate = trajectory.rows[-1] / max(trajectory.elapsed[-1], 1e-9)
            bar.set_postfix_str(f"{rate:,.0f} rows/s", refresh=False)
            bar.update(stop - first)
    return (offsets, placements), trajectory


def _global_history(model: RenewableHuberRegressor, offsets: list[tuple[int, int]]) -> Any:
    history = model.history_.copy()
    chunk = history["chunk"].to_numpy().copy()
    bounds = [b for b, _ in offsets] + [len(history)]
    for (row, first), end in zip(offsets, bounds[1:], strict=True):
        chunk[row:end] += first
    history["chunk"] = chunk
    return history


def fit_table(
    model: RenewableHuberRegressor,
    table: Table,
    *,
    points: int = DEFAULT_TRAJECTORY_POINTS,
    fallback_engine: str | None = None,
) -> FitOutcome:
    """Fit ``model`` on ``table``, recording coefficients at ``points`` places.

    Parameters
    ----------
    model : RenewableHuberRegressor
        Reset first: the fit starts a new stream.
    table : Table
    points : int
        Segments (coefficient snapshots) along the stream; 1 fits in one call.
    fallback_engine : str, optional
        When the requested engine cannot start before any chunk was
        consumed, refit with this engine (how ``--engine auto`` backs off
        from a GPU it cannot use) and say so in ``notes``.

    Returns
    -------
    FitOutcome
    """
    if points < 1:
        raise ValueError(f"points must be >= 1, got {points}")
    notes: list[str] = []
    start = time.perf_counter()
    with stable_partitions():
        try:
            walked, trajectory = _walk(model, table, points)
        except EngineUnavailableError as exc:
            if fallback_engine is None or hasattr(model, "n_features_in_"):
                raise
            notes.append(f"engine {model.engine!r} unavailable ({exc}); used {fallback_engine!r}")
            model.set_params(engine=fallback_engine)
            start = time.perf_counter()
            walked, trajectory = _walk(model, table, points)
        if walked is None:
            model.fit(*table.fit_inputs())
    if walked is None:
        offsets, placements = [(0, 0)], []
        placement = model.placement_
        if placement:
            placements.append(dict(placement, chunks=[0, table.n_chunks]))
        trajectory = Trajectory(
            [table.n_chunks],
            [int(model.n_samples_seen_)],
            [time.perf_counter() - start],
            [_beta(model)],
        )
    else:
        offsets, placements = walked
    seconds = time.perf_counter() - start
    return FitOutcome(
        model=model,
        history=_global_history(model, offsets),
        trajectory=trajectory,
        seconds=seconds,
        engine=model.engine_,
        placements=placements,
        notes=notes,
    )
