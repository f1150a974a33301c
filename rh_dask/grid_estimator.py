"""``RenewableHuberGridRegressor``: a grid of τ (and λ scale) values fitted from one pass.

Every configuration of the grid (the product of ``taus`` and, for
``penalty="l1"``, ``lambda_scales``) is its own renewable Huber stream, and
all of them consume each batch once, through one
:class:`~rh_dask.engines.grid.GridEngine`: each batch is first scored at
every configuration's current coefficients (prequential, "test then train"),
then fitted by every configuration. The configuration with the lowest
prequential criterion over the stream is selected; ``coef_``, ``predict``
and ``score`` are its own, and :attr:`best_estimator_` is a
:class:`~rh_dask.RenewableHuberRegressor` holding its state.

Dask collections are walked on the cluster when a ``distributed.Client`` is
current (``walk="auto"``): one actor per GPU worker, each holding its share of
the configurations, every chunk loaded once and delivered to every actor
(:mod:`rh_dask.distributed.grid_walk`). Without a client (or with
``walk="local"``) chunks are computed in this process in index order, with
``lookahead`` of them loading ahead on threads
(:func:`rh_dask.distributed.local.iter_local`), each computed once and given
to every configuration. Both walks give bit-identical results.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd
from sklearn.base import BaseEstimator, RegressorMixin

from .config import HuberConfig
from .engines import resolve_engine_name
from .engines.grid import DEFAULT_REFERENCE_TAU, GridEngine, GridRecord, check_reference_tau
from .exceptions import NotFittedError, ValidationError
from .validation import (
    check_feature_names,
    check_lookahead,
    check_n_features,
    validate_batch,
)

__all__ = ["CRITERIA", "RenewableHuberGridRegressor"]

#: Selection criteria: the prequential mean Huber loss or mean absolute error.
CRITERIA: tuple[str, ...] = ("huber", "mae")

#: Where a Dask stream's grid runs (the ``walk`` parameter).
WALKS: tuple[str, ...] = ("auto", "local", "cluster")

_DEFAULT_TAUS = (0.5, 0.75, 1.0, 1.345, 2.0, 3.0, 5.0, 10.0)


def _is_dask_collection(obj: Any) -> bool:
    from dask.base import is_dask_collection

    return is_dask_collection(obj)


def _values(name: str, values: Any) -> tuple[float, ...]:
    """``values`` as a non-empty tuple of distinct real numbers (each checked later)."""
    if isinstance(values, (str, bytes)) or not isinstance(values, (Sequence, np.ndarray)):
        raise ValidationError(f"{name} must be a sequence of numbers, got {values!r}")
    out = []
    for v in values:
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Real):
            raise ValidationError(f"{name} must hold real numbers, got {v!r}")
        out.append(float(v))
    if not out:
        raise ValidationError(f"{name} must hold at least one value")
    if len(set(out)) != len(out):
        raise ValidationError(f"{name} has duplicate values: {out}")
    return tuple(out)


class RenewableHuberGridRegressor(RegressorMixin, BaseEstimator):
    """Renewable Huber regression over a grid of τ (and λ scale) values, in one pass.

    Parameters
    ----------
    taus : sequence of float, default=(0.5, 0.75, 1.0, 1.345, 2.0, 3.0, 5.0, 10.0)
        The τ values, each > 0, distinct.
    lambda_scales : sequence of float, default=None
        ``penalty="l1"`` only: the λ scales, each >= 0, distinct; the grid is
        every (τ, λ scale) pair, τ-major. ``None``: ``(1.0,)``. Given with
        ``penalty="none"`` it raises :class:`~rh_dask.exceptions.ValidationError`.
    penalty : {"none", "l1"}, default="none"
    reference_tau : float, default=1.345
        The τ of the prequential Huber loss, the same for every
        configuration (on the scale of ``y``).
    criterion : {"huber", "mae"}, default="huber"
        What selects the configuration: the prequential mean Huber loss at
        ``reference_tau`` or the mean absolute error.
    bandwidth_scale, fit_intercept, max_iter, tol, ridge, dtype
        As in :class:`~rh_dask.RenewableHuberRegressor`, shared by every
        configuration.
    engine : {"auto", "numpy", "gpu"}, default="auto"
        The engine of every configuration (one per configuration; with the
        GPU engine, a host batch is copied to the device once for all).
    device : str or int, default=None
        Device of the engines.
    lookahead : int or "auto", default="auto"
        Dask streams only: chunks loading ahead of the one being consumed (in
        this process, or on the cluster). ``"auto"``: 8 in this process; on
        the cluster, where chunks load on any worker, twice the workers' task
        threads, at least 8 and at most ``rh-dask.distributed.lookahead-max``
        (32); the number used is in :attr:`placement_`.
    walk : {"auto", "local", "cluster"}, default="auto"
        Dask streams only: where the grid runs. ``"cluster"``: one actor per
        worker advertising the resource ``GPU`` (one actor on one worker
        when none does), configurations split contiguously over them (sizes
        differing by at most one), see :attr:`placement_`; it needs a current
        ``distributed.Client``. ``"local"``: in this process. ``"auto"``:
        ``"cluster"`` when a client is current, else ``"local"``.

    Attributes
    ----------
    configs_ : pandas.DataFrame
        One row per configuration, in grid order: ``tau``, ``lambda_scale``,
        ``huber_loss`` and ``mae`` (prequential means over the scored
        batches, weighted by each batch's Σ w), ``scored_batches``,
        ``scored_weight`` and ``rank`` (1 = selected, by ``criterion``).
    coefs_ : ndarray of shape (n_configs, n_features)
        Every configuration's feature coefficients.
    intercepts_ : ndarray of shape (n_configs,)
        Every configuration's intercept (0.0 without one).
    prequential_ : pandas.DataFrame
        One row per configuration per consumed batch: ``config`` (row of
        ``configs_``), ``tau``, ``lambda_scale``, ``batch``, ``chunk``,
        ``rows``, ``weight``, ``huber_loss``, ``mae`` (NaN for the first
        batch of the stream, which has no prediction), ``iterations`` and
        ``converged``.
    scores_ : ndarray of shape (n_batches, n_configs)
        Per batch, the criterion of every configuration (NaN on the first).
    best_index_ : int
        Row of ``configs_`` selected: the lowest prequential criterion (the
        first of equals).
    best_config_ : HuberConfig
        Its configuration.
    best_params_ : dict
        ``{"tau": ..., "lambda_scale": ...}`` of the selected configuration.
    best_estimator_ : RenewableHuberRegressor
        A fitted model holding the selected configuration's state (``cov_``,
        ``summary()``, ``save`` work on it); see also :meth:`estimator_for`.
    coef_, intercept_ : the selected configuration's coefficients and intercept.
    n_features_in_, feature_names_in_, n_samples_seen_, n_empty_chunks_, engine_
        As in :class:`~rh_dask.RenewableHuberRegressor`.
    placement_ : list of dict
        After a walk on the cluster: one entry per actor, in configuration
        order: ``worker`` (its address), ``configs`` (the rows of
        ``configs_`` it held), ``busy_fraction`` (the share of the walk's
        wall time its engines spent fitting) and ``lookahead`` (the walk's);
        empty after a walk in this process.

    Notes
    -----
    The selection attributes need at least one scored batch, that is two
    consumed batches: before that they raise
    :class:`~rh_dask.exceptions.NotFittedError`. In-memory ``fit(X, y)`` is a
    one-batch stream; give a Dask collection (its chunks are the batches) or
    call :meth:`partial_fit` batch by batch.
    """

    def __init__(
        self,
        *,
        taus: Sequence[float] = _DEFAULT_TAUS,
        lambda_scales: Sequence[float] | None = None,
        penalty: str = "none",
        reference_tau: float = DEFAULT_REFERENCE_TAU,
        criterion: str = "huber",
        bandwidth_scale: float = 1.0,
        fit_intercept: bool = True,
        max_iter: int = 100,
        tol: float = 1e-6,
        ridge: float = 1e-8,
        engine: str = "auto",
        device: str | int | None = None,
        dtype: str = "float64",
        lookahead: int | str = "auto",
        walk: str = "auto",
    ) -> None:
        self.taus = taus
        self.lambda_scales = lambda_scales
        self.penalty = penalty
        self.reference_tau = reference_tau
        self.criterion = criterion
        self.bandwidth_scale = bandwidth_scale
        self.fit_intercept = fit_intercept
        self.max_iter = max_iter
        self.tol = tol
        self.ridge = ridge
        self.engine = engine
        self.device = device
        self.dtype = dtype
        self.lookahead = lookahead
        self.walk = walk

    #: The grid being fitted; ``None`` until the first batch.
    _grid: GridEngine | None = None
    _feature_names: np.ndarray | None = None
    _n_empty: int = 0
    _placement: list[dict[str, Any]] | None = None

    # -- configuration ---------------------------------------------------------
    def _make_configs(self) -> tuple[HuberConfig, ...]:
        taus = _values("taus", self.taus)
        if self.penalty == "l1":
            scales = (
                (1.0,)
                if self.lambda_scales is None
                else _values("lambda_scales", self.lambda_scales)
            )
        else:
            if self.lambda_scales is not None:
                raise ValidationError(
                    "lambda_scales scales the L1 penalty: give it with penalty='l1', or leave "
                    f"it None (penalty={self.penalty!r})"
                )
            scales = (1.0,)
        return tuple(
            HuberConfig(
                tau=tau,
                penalty=self.penalty,
                lambda_scale=scale,
                bandwidth_scale=self.bandwidth_scale,
                fit_intercept=self.fit_intercept,
                max_iter=self.max_iter,
                tol=self.tol,
                ridge=self.ridge,
                dtype=self.dtype,
            )
            for tau in taus
            for scale in scales
        )

    def _check_params(self) -> tuple[tuple[HuberConfig, ...], str, float]:
        """The configurations, engine name and reference τ; every parameter checked."""
        configs = self._make_configs()
        if self.criterion not in CRITERIA:
            raise ValidationError(f"criterion must be one of {CRITERIA}, got {self.criterion!r}")
        check_lookahead(self.lookahead)
        if self.walk not in WALKS:
            raise ValidationError(f"walk must be one of {WALKS}, got {self.walk!r}")
        return (
            configs,
            resolve_engine_name(self.engine, self.device),
            check_reference_tau(self.reference_tau),
        )

    def _new_grid(self) -> GridEngine:
        configs, name, reference_tau = self._check_params()
        return GridEngine(configs, name, self.device, reference_tau=reference_tau)

    def _continued_grid(self) -> GridEngine | None:
        """The fitted grid a ``partial_fit`` continues (checked against the parameters)."""
        configs, name, reference_tau = self._check_params()
        grid = self._fitted_grid()
        if grid is None:
            return None
        if grid.configs != configs or grid.reference_tau != reference_tau:
            raise ValidationError(
                "the estimator's parameters changed since the stream started; "
                "call reset() or fit() to start a new stream with them"
            )
        if grid.engine_name != name:
            raise ValidationError(
                f"engine={self.engine!r} was requested, but the grid runs on the "
                f"{grid.engine_name!r} engine; call reset() or fit() to start a new stream"
            )
        return grid

    # -- fitting -------------------------------------------------------------------
    def reset(self) -> RenewableHuberGridRegressor:
        """Forget the stream of every configuration."""
        self._grid = None
        self._feature_names = None
        self._n_empty = 0
        self._placement = None
        return self

    def fit(self, X: Any, y: Any, sample_weight: Any | None = None) -> RenewableHuberGridRegressor:
        """Start a new stream of every configuration with ``X``.

        In-memory ``X`` is one batch (which no configuration can be scored
        on: see the class notes); a Dask array's row chunks or a Dask
        DataFrame's partitions are the batches, in order. The current stream
        is forgotten only once the new one has consumed a batch: a ``fit``
        refused before that leaves the model as it was.

        Parameters
        ----------
        X : array-like of shape (n_samples, n_features), or a Dask collection
        y : array-like of shape (n_samples,), a Dask collection, or a column name of X
        sample_weight : array-like of shape (n_samples,), default=None
            Frequency weights; they also weight the prequential scores.

        Returns
        -------
        self
        """
        grid = self._new_grid()
        self._feed(grid, X, y, sample_weight, fresh=True)
        return self

    def partial_fit(
        self, X: Any, y: Any, sample_weight: Any | None = None
    ) -> RenewableHuberGridRegressor:
        """Score, then fit, one batch (or each chunk of a Dask collection) at every configuration.

        A batch refused by validation or by any configuration's engine raises
        :class:`~rh_dask.exceptions.ValidationError` and leaves every
        configuration exactly as it was. On a Dask collection a refused chunk
        raises :class:`~rh_dask.exceptions.BadChunkError` naming it, the
        model keeping the state after the last good chunk.
        """
        grid = self._continued_grid()
        fresh = grid is None
        self._feed(grid if grid is not None else self._new_grid(), X, y, sample_weight, fresh)
        return self

    def _feed(self, grid: GridEngine, X: Any, y: Any, w: Any | None, fresh: bool) -> None:
        """Give ``grid`` the input; it becomes the model's once it has consumed a batch."""
        if any(_is_dask_collection(a) for a in (X, y, w)):
            self._walk(grid, X, y, w, fresh)
            return
        batch = validate_batch(
            X,
            y,
            w,
            dtype=grid.dtype,
            n_features=None if fresh else grid.n_features_in,
            feature_names=None if fresh else self._feature_names,
            fitted=not fresh,
            accept_device=grid.accepts_device_arrays,
            owner=type(self).__name__,
        )
        grid.partial_fit(batch.X, batch.y, batch.sample_weight)
        if fresh:
            self._adopt(grid, batch.feature_names)

    def _adopt(self, grid: GridEngine, feature_names: np.ndarray | None) -> None:
        self._grid, self._feature_names, self._n_empty = grid, feature_names, 0

    def _walk(self, grid: GridEngine, X: Any, y: Any, w: Any | None, fresh: bool) -> None:
        """Every chunk of a Dask collection, in order, computed once, into ``grid``."""
        from contextlib import closing

        from .distributed.chunks import ChunkGraph, align_stream
        from .distributed.fit import column_vector_target, local_lookahead
        from .distributed.items import BadChunk, EmptyChunk, chunk_error
        from .distributed.loading import assemble_chunk
        from .distributed.local import iter_local

        owner = type(self).__name__
        aligned = align_stream(X, column_vector_target(y), w)
        _check_row_chunks(aligned.parts, aligned.roles)
        names = (
            None if aligned.feature_names is None else np.asarray(aligned.feature_names, object)
        )
        if not fresh:
            check_n_features(aligned.n_features, grid.n_features_in, owner)
            check_feature_names(names, self._feature_names, fitted=True, owner=owner)
        accept_device = grid.accepts_device_arrays
        dtype = grid.configs[0].dtype
        graph = ChunkGraph(
            aligned, assemble_chunk, lambda i: aligned.spec(i, dtype, accept_device)
        )
        client = _cluster_client(self.walk)
        if client is not None:
            self._walk_cluster(client, grid, graph, names, fresh, aligned.n_chunks)
            return
        if not graph.self_contained:
            raise ValidationError(
                f"{owner} computes the chunks in this process, and this collection references "
                "data persisted on a cluster; pass the unpersisted collection"
            )
        consumed = empty = 0

        def fit(item: Any, upcoming: Any) -> None:
            nonlocal consumed
            ahead = None if upcoming is None else (upcoming.X, upcoming.y, upcoming.sample_weight)
            try:
                grid.partial_fit(
                    item.X, item.y, item.sample_weight, chunk=item.index, upcoming=ahead
                )
            except ValidationError as exc:
                message = f"chunk {item.index} was refused: {type(exc).__name__}: {exc}"
                raise chunk_error(item.index, exc, message) from exc
            if fresh and consumed == 0:
                self._adopt(grid, names)
            consumed += 1

        try:
            with closing(iter_local(graph, local_lookahead(self.lookahead))) as items:
                # One chunk held back, so that a GPU grid copies the next chunk
                # while it solves this one.
                held = None
                for item in items:
                    if isinstance(item, EmptyChunk):
                        empty += 1
                        continue
                    if isinstance(item, BadChunk):
                        if held is not None:
                            fit(held, None)
                        raise item.exception()
                    if held is not None:
                        fit(held, item)
                    held = item
                if held is not None:
                    fit(held, None)
        finally:
            if consumed or not fresh:
                self._n_empty += empty
        if consumed == 0 and fresh:
            raise ValidationError(
                f"every one of the {aligned.n_chunks} chunks is empty: there is nothing to fit"
            )

    def _walk_cluster(
        self,
        client: Any,
        grid: GridEngine,
        graph: Any,
        names: np.ndarray | None,
        fresh: bool,
        n_chunks: int,
    ) -> None:
        """The walk over one actor per GPU worker; its outcome imported into ``grid``."""
        from .distributed.grid_walk import walk_grid
        from .settings import Settings

        done = walk_grid(
            client,
            graph,
            grid.configs,
            grid.engine_name,
            self.device,
            grid.reference_tau,
            None if fresh else grid.export_states(),
            self.lookahead,
            Settings.from_config(),
        )
        if done.records:
            grid.import_states(done.states)
            grid.extend_records(done.records)
            if fresh:
                self._adopt(grid, names)
        if done.records or not fresh:
            self._n_empty += done.empty
            self._placement = [
                {
                    "worker": s.worker,
                    "configs": list(s.configs),
                    "busy_fraction": busy / done.wall if done.wall > 0 else 0.0,
                    "lookahead": done.lookahead,
                }
                for s, busy in zip(done.shares, done.busy, strict=True)
            ]
        if done.error is not None:
            raise done.error
        if not done.records and fresh:
            raise ValidationError(
                f"every one of the {n_chunks} chunks is empty: there is nothing to fit"
            )

    # -- fitted views ------------------------------------------------------------
    @property
    def placement_(self) -> list[dict[str, Any]]:
        """Which worker held which configurations in the last cluster walk (see the class)."""
        self._require_fitted()
        return [dict(p, configs=list(p["configs"])) for p in (self._placement or [])]

    def _fitted_grid(self) -> GridEngine | None:
        grid = self._grid
        return grid if grid is not None and grid.n_features_in is not None else None

    def __sklearn_is_fitted__(self) -> bool:
        return self._fitted_grid() is not None

    def _require_fitted(self) -> GridEngine:
        grid = self._fitted_grid()
        if grid is None:
            raise NotFittedError(
                f"This {type(self).__name__} instance is not fitted yet. Call 'fit' or "
                "'partial_fit' with appropriate arguments before using this estimator."
            )
        return grid

    def _totals(self) -> tuple[np.ndarray, np.ndarray, int, float]:
        """Prequential means of every configuration over the scored batches."""
        grid = self._require_fitted()
        scored = [r for r in grid.records if r.scored]
        k = grid.n_configs
        if not scored:
            nan = np.full(k, np.nan)
            return nan, nan.copy(), 0, 0.0
        weights = np.array([r.weight for r in scored])
        total = float(weights.sum())
        huber = weights @ np.stack([r.huber_loss for r in scored]) / total
        mae = weights @ np.stack([r.mae for r in scored]) / total
        return huber, mae, len(scored), total

    @property
    def configs_(self) -> pd.DataFrame:
        """Every configuration and its prequential scores (see the class docstring)."""
        grid = self._require_fitted()
        huber, mae, n_scored, weight = self._totals()
        frame = pd.DataFrame(
            {
                "tau": [c.tau for c in grid.configs],
                "lambda_scale": [c.lambda_scale for c in grid.configs],
                "huber_loss": huber,
                "mae": mae,
                "scored_batches": np.full(grid.n_configs, n_scored, dtype=np.int64),
                "scored_weight": np.full(grid.n_configs, weight),
            }
        )
        column = "huber_loss" if self.criterion == "huber" else "mae"
        frame["rank"] = frame[column].rank(method="first").astype("Int64")
        return frame

    @property
    def coefs_(self) -> np.ndarray:
        """Feature coefficients of every configuration, shape (n_configs, n_features)."""
        grid = self._require_fitted()
        return grid.coefficients()[:, : grid.n_features_in]

    @property
    def intercepts_(self) -> np.ndarray:
        """Intercept of every configuration, shape (n_configs,) (zeros without one)."""
        grid = self._require_fitted()
        if not grid.fit_intercept:
            return np.zeros(grid.n_configs, dtype=grid.dtype)
        return grid.coefficients()[:, -1]

    @property
    def prequential_(self) -> pd.DataFrame:
        """One row per configuration per batch (see the class docstring)."""
        grid = self._require_fitted()
        return _prequential_frame(grid.configs, grid.records)

    @property
    def scores_(self) -> np.ndarray:
        """The criterion per batch (rows) and configuration (columns); NaN on the first batch."""
        grid = self._require_fitted()
        records = grid.records
        if not records:
            return np.empty((0, grid.n_configs))
        field = "huber_loss" if self.criterion == "huber" else "mae"
        return np.stack([getattr(r, field) for r in records])

    @property
    def best_index_(self) -> int:
        """Row of ``configs_`` with the lowest prequential criterion (the first of equals)."""
        huber, mae, n_scored, _ = self._totals()
        if n_scored == 0:
            raise NotFittedError(
                f"{type(self).__name__} selects a configuration by prequential scores, and no "
                "batch has been scored yet: the first batch of a stream only trains. Consume "
                "at least two batches (a Dask collection of several chunks, or partial_fit "
                "calls)"
            )
        return int(np.argmin(huber if self.criterion == "huber" else mae))

    @property
    def best_config_(self) -> HuberConfig:
        """The selected configuration."""
        return self._require_fitted().configs[self.best_index_]

    @property
    def best_params_(self) -> dict[str, float]:
        """``tau`` and ``lambda_scale`` of the selected configuration."""
        config = self.best_config_
        return {"tau": config.tau, "lambda_scale": config.lambda_scale}

    def estimator_for(self, index: int) -> Any:
        """A fitted :class:`~rh_dask.RenewableHuberRegressor` at configuration ``index``'s state.

        It continues that configuration's stream on its own (``partial_fit``)
        and offers ``cov_``, ``summary()`` and ``save``. Its ``history_`` is
        empty: the grid's records are in :attr:`prequential_`.

        Raises
        ------
        ValidationError
            For an index outside ``range(n_configs)``.
        """
        from .estimator import RenewableHuberRegressor
        from .stream import Stream

        grid = self._require_fitted()
        if (
            isinstance(index, (bool, np.bool_))
            or not isinstance(index, (int, np.integer))
            or not 0 <= index < grid.n_configs
        ):
            raise ValidationError(
                f"index must be an integer in [0, {grid.n_configs}), got {index!r}"
            )
        config = grid.configs[int(index)]
        model = RenewableHuberRegressor(
            tau=config.tau,
            penalty=config.penalty,
            lambda_scale=config.lambda_scale,
            bandwidth_scale=config.bandwidth_scale,
            fit_intercept=config.fit_intercept,
            max_iter=config.max_iter,
            tol=config.tol,
            ridge=config.ridge,
            engine=grid.engine_name,
            device=self.device,
            dtype=config.dtype,
        )
        state = grid.engines[int(index)].export_state()
        model._stream = Stream.restored(config, grid.engine_name, state, self._feature_names)
        return model

    @property
    def best_estimator_(self) -> Any:
        """A fitted ``RenewableHuberRegressor`` holding the selected configuration's state."""
        return self.estimator_for(self.best_index_)

    @property
    def coef_(self) -> np.ndarray:
        """Feature coefficients of the selected configuration."""
        return self.coefs_[self.best_index_]

    @property
    def intercept_(self) -> float:
        """Intercept of the selected configuration (0.0 without one)."""
        return float(self.intercepts_[self.best_index_])

    @property
    def n_features_in_(self) -> int:
        return int(self._require_fitted().n_features_in)

    @property
    def feature_names_in_(self) -> np.ndarray:
        self._require_fitted()
        if self._feature_names is None:
            raise AttributeError(
                f"this {type(self).__name__} was fitted without feature names "
                "(its stream did not come as DataFrames with string columns)"
            )
        return self._feature_names

    @property
    def n_samples_seen_(self) -> int:
        return int(self._require_fitted().engines[0].n_samples_seen)

    @property
    def n_empty_chunks_(self) -> int:
        self._require_fitted()
        return self._n_empty

    @property
    def engine_(self) -> str:
        return self._require_fitted().engine_name

    # -- prediction ----------------------------------------------------------------
    def predict(self, X: Any) -> Any:
        """Predictions of the selected configuration (as ``RenewableHuberRegressor.predict``)."""
        return self.best_estimator_.predict(X)

    def score(self, X: Any, y: Any, sample_weight: Any | None = None) -> float:
        """R² of the selected configuration (as ``RenewableHuberRegressor.score``).

        For choosing between models prefer a robust criterion:
        :func:`rh_dask.huber_scorer`.
        """
        return self.best_estimator_.score(X, y, sample_weight)


def _cluster_client(walk: str) -> Any:
    """The current ``distributed.Client`` when the grid walks on the cluster, else ``None``."""
    if walk == "local":
        return None
    try:
        from distributed import default_client

        return default_client()
    except (ImportError, ValueError):
        if walk == "cluster":
            raise ValidationError(
                "walk='cluster' needs a current distributed.Client (create one, or use "
                "walk='local' or 'auto')"
            ) from None
        return None


def _check_row_chunks(parts: tuple[Any, ...], roles: tuple[str, ...]) -> None:
    """Refuse, before any chunk is consumed, a ``y`` or weights chunked unlike ``X``."""
    import dask.array as da

    X = parts[0]
    if not isinstance(X, da.Array) or any(math.isnan(c) for c in X.chunks[0]):
        return
    rows = tuple(X.chunks[0])
    for role, part in zip(roles[1:], parts[1:], strict=True):
        if not isinstance(part, da.Array) or any(math.isnan(c) for c in part.chunks[0]):
            continue
        if tuple(part.chunks[0]) != rows:
            name = "y" if role == "y" else "sample_weight"
            raise ValidationError(
                f"{name} has row chunks {part.chunks[0]}, X has {rows}: they must be aligned "
                "chunk by chunk"
            )


_PREQUENTIAL_COLUMNS = (
    "config",
    "tau",
    "lambda_scale",
    "batch",
    "chunk",
    "rows",
    "weight",
    "huber_loss",
    "mae",
    "iterations",
    "converged",
)


def _prequential_frame(
    configs: Sequence[HuberConfig], records: Sequence[GridRecord]
) -> pd.DataFrame:
    rows = [
        (
            j,
            c.tau,
            c.lambda_scale,
            r.batch,
            r.chunk,
            r.rows,
            r.weight,
            float(r.huber_loss[j]),
            float(r.mae[j]),
            r.diagnostics[j].iterations,
            r.diagnostics[j].converged,
        )
        for r in records
        for j, c in enumerate(configs)
    ]
    frame = pd.DataFrame(rows, columns=list(_PREQUENTIAL_COLUMNS))
    return frame.astype(
        {
            "config": "int64",
            "tau": "float64",
            "lambda_scale": "float64",
            "batch": "int64",
            "chunk": "int64",
            "rows": "int64",
            "weight": "float64",
            "huber_loss": "float64",
            "mae": "float64",
            "iterations": "int64",
            "converged": "bool",
        }
    )
