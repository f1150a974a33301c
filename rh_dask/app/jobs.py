"""The fit job behind ``rh-dask fit`` and ``rh-dask demo``.

One job: take a :class:`~rh_dask.app.io.Table`, fit it with the estimator (on
the active ``distributed`` client, if any) in one call, and keep what a
report needs.

Coefficient trajectories come from the estimator itself: the engine records
β after every batch (in the actor, for a cluster fit) and the model exposes
the rows as ``coef_history_``, aligned with ``history_``. So the trajectory
has one point per consumed batch and costs the fit nothing beyond a copy of
p numbers per batch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from ..distributed.chunks import stable_partitions
from ..estimator import RenewableHuberRegressor
from ..exceptions import EngineUnavailableError
from ..state import HuberState
from .io import Table

__all__ = ["FitOutcome", "Trajectory", "fit_table"]


@dataclass
class Trajectory:
    """Coefficients along the stream, one point per consumed batch.

    Attributes
    ----------
    after_chunk : ndarray of int
        Chunks of the stream dealt with (empty ones included) at each point:
        the batch's chunk index + 1.
    rows : ndarray of int
        Rows consumed at each point.
    engine_seconds : ndarray of float
        Engine time spent up to and including each batch (the cumulative
        ``seconds`` of ``history_``; loading and transfers not included).
    coefficients : ndarray of shape (n_points, n_params)
        β at each point, the intercept last when the model has one.
    """

    after_chunk: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))
    rows: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))
    engine_seconds: np.ndarray = field(default_factory=lambda: np.empty(0))
    coefficients: np.ndarray = field(default_factory=lambda: np.empty((0, 0)))

    @classmethod
    def from_model(cls, model: RenewableHuberRegressor) -> Trajectory:
        """The trajectory of ``model``'s stream since its last reset."""
        history = model.history_
        return cls(
            after_chunk=history["chunk"].to_numpy(dtype=np.int64) + 1,
            rows=np.cumsum(history["rows"].to_numpy(dtype=np.int64)),
            engine_seconds=np.cumsum(history["seconds"].to_numpy(dtype=np.float64)),
            coefficients=model.coef_history_,
        )


@dataclass
class FitOutcome:
    """A fitted model and the facts about how it got there.

    Attributes
    ----------
    model : RenewableHuberRegressor
    history : pandas.DataFrame
        ``history_`` (``chunk`` is the index in the whole stream: one call).
    trajectory : Trajectory
    seconds : float
        Wall-clock time of the fit.
    engine : str
        The engine that fitted the stream.
    placement : dict or None
        Where the engine ran when the fit ran on a cluster (``placement_``).
    notes : list of str
        Things the user should know (an ``auto`` engine falling back).
    """

    model: RenewableHuberRegressor
    history: pd.DataFrame
    trajectory: Trajectory
    seconds: float
    engine: str
    placement: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)


def fit_table(
    model: RenewableHuberRegressor,
    table: Table,
    *,
    fallback_engine: str | None = None,
) -> FitOutcome:
    """Fit ``model`` on ``table`` in one call, recording β after every batch.

    Parameters
    ----------
    model : RenewableHuberRegressor
        Reset first: the fit starts a new stream.
    table : Table
    fallback_engine : str, optional
        When the requested engine cannot start before any chunk of this
        fit was consumed, refit with this engine (how ``--engine auto``
        backs off from a GPU it cannot use) and say so in ``notes``. A model
        fitted before keeps its old stream when the engine cannot start, so
        "nothing consumed" means the model's state is the one it had before.

    Returns
    -------
    FitOutcome
    """
    notes: list[str] = []
    before = _stream_state(model)
    start = time.perf_counter()
    with stable_partitions():
        try:
            model.fit(*table.fit_inputs())
        except EngineUnavailableError as exc:
            if fallback_engine is None or _consumed_since(model, before):
                raise
            notes.append(f"engine {model.engine!r} unavailable ({exc}); used {fallback_engine!r}")
            model.set_params(engine=fallback_engine)
            start = time.perf_counter()
            model.fit(*table.fit_inputs())
    seconds = time.perf_counter() - start
    return FitOutcome(
        model=model,
        history=model.history_,
        trajectory=Trajectory.from_model(model),
        seconds=seconds,
        engine=model.engine_,
        placement=model.placement_,
        notes=notes,
    )


def _stream_state(model: RenewableHuberRegressor) -> HuberState | None:
    """The state of the model's stream, ``None`` for a model not fitted."""
    return model.state_ if model.__sklearn_is_fitted__() else None


def _consumed_since(model: RenewableHuberRegressor, before: HuberState | None) -> bool:
    """Whether the model consumed a batch since its stream state was ``before``."""
    after = _stream_state(model)
    if after is None:
        return False
    return before is None or not after.equals(before)
