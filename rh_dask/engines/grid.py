"""Many configurations over one stream: each batch consumed once by every configuration.

A :class:`GridEngine` holds one engine per configuration (each made by
:func:`~rh_dask.engines.make_engine` from its own
:class:`~rh_dask.config.HuberConfig`) and advances them all with the same
validated batch. Before any of them trains on the batch, the batch is scored
at every configuration's current coefficients ("test then train",
prequential): the mean Huber loss at a fixed reference τ and the mean
absolute error, weighted by ``sample_weight`` when given. The stream itself
thus ranks the configurations, on rows none of them has seen yet.

* The first batch of a stream has no prediction to score: its record holds
  NaN for every configuration and it takes no part in the totals.
* Each engine receives exactly the arrays a single fit would receive, so its
  coefficients are bit for bit those of its own single fit.
* A batch refused by any configuration leaves every configuration as it
  was: the earlier engines are put back from the states they held.
* For GPU engines a host batch is copied to the device once (through
  pinned memory; :meth:`GridEngine.partial_fit_stream`, or ``upcoming`` of
  :meth:`GridEngine.partial_fit`, copy the next batch while the engines
  solve this one) and that one device copy goes to every engine;
  the scores are computed on the device, one launch for every
  configuration (:mod:`gpu_engine.grid`).
* GPU engines consume each batch side by side (``concurrent``, by default
  ``rh-dask.grid.concurrent``): their steps are interleaved on one thread
  (:mod:`rh_dask.engines.lockstep`), each engine on its own CUDA stream
  and resumed as soon as its stream is done, so that one engine's device
  work overlaps the others' and the host's. Each
  engine still runs exactly its single fit's kernels in its single fit's
  order, so the bits do not change. NumPy engines always run one after the
  other (their BLAS calls already use the cores).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ..config import HuberConfig
from ..core import sum_weights
from ..exceptions import ValidationError
from ..settings import grid_concurrent
from ..state import BatchDiagnostics, HuberState
from ..validation import is_device_array
from . import make_engine
from .base import Engine
from .lockstep import advance_together, can_advance_together

if TYPE_CHECKING:  # pragma: no cover
    from ..settings import Settings

__all__ = ["DEFAULT_REFERENCE_TAU", "GridEngine", "GridRecord", "prequential_scores"]

#: The τ the prequential Huber loss is evaluated with unless told otherwise.
DEFAULT_REFERENCE_TAU = 1.345


@dataclass(frozen=True)
class GridRecord:
    """What the grid keeps of one consumed batch.

    Attributes
    ----------
    batch : int
        Position of the batch in the stream (0 for the first).
    chunk : int
        Index of the chunk in the collection given to the call that consumed
        it (0 for an in-memory batch).
    rows : int
        Rows of the batch.
    weight : float
        Σ w of the batch, correctly rounded as ``weight_sum`` takes it
        (``rows`` without weights): the batch's share of the weighted
        prequential means.
    huber_loss : ndarray of shape (n_configs,)
        Mean Huber loss (at the reference τ) of the batch at each
        configuration's coefficients before the batch; NaN for the first
        batch of a stream.
    mae : ndarray of shape (n_configs,)
        Mean absolute error, the same way.
    diagnostics : tuple of BatchDiagnostics
        Each configuration's solve of the batch.
    """

    batch: int
    chunk: int
    rows: int
    weight: float
    huber_loss: np.ndarray
    mae: np.ndarray
    diagnostics: tuple[BatchDiagnostics, ...]

    @property
    def scored(self) -> bool:
        """Whether the batch was scored (every batch but a stream's first)."""
        return not bool(np.isnan(self.huber_loss).all())


def check_reference_tau(value: Any) -> float:
    """``value`` as a float if it is a finite real number > 0; else :class:`ValidationError`."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise ValidationError(f"reference_tau must be a real number > 0, got {value!r}")
    out = float(value)
    if not math.isfinite(out) or out <= 0:
        raise ValidationError(f"reference_tau must be finite and > 0, got {value!r}")
    return out


def prequential_scores(
    xp: Any, X: Any, y: Any, w: Any | None, betas: Any, fit_intercept: bool, tau: float
) -> tuple[np.ndarray, np.ndarray]:
    """Weighted mean Huber loss and mean absolute error of every column of ``betas``.

    Parameters
    ----------
    xp : module
        The array library of ``X`` (NumPy, or CuPy for device batches).
    X : array of shape (n, d)
    y : array of shape (n,)
    w : array of shape (n,) or None
        Frequency weights (``None``: all ones).
    betas : array of shape (d + fit_intercept, k)
        One coefficient vector per column, the intercept last.
    fit_intercept : bool
    tau : float
        The reference τ of the Huber loss ρ_τ(r) = ψ(r)(r − ψ(r)/2),
        ψ = clip(r, −τ, τ).

    Returns
    -------
    huber_loss, mae : ndarray of shape (k,), float64, on the host
        Σ wᵢ ρ_τ(rᵢ) / Σ wᵢ and Σ wᵢ |rᵢ| / Σ wᵢ with r = y − Z β, the
        predictions computed in the batch's dtype, the losses in float64.

    Notes
    -----
    Each column is scored on its own (one matrix-vector product per
    configuration): a BLAS matrix product's rounding depends on how many
    columns it is given, and a configuration's score must not depend on
    which others share the call, so that a grid split over several actors
    (:mod:`rh_dask.distributed.grid_walk`) scores bit for bit as one grid.
    """
    d = X.shape[1]
    y64 = y.astype(xp.float64)
    w64 = None if w is None else w.astype(xp.float64)
    total = None if w64 is None else w64.sum()
    huber_cols, mae_cols = [], []
    for j in range(betas.shape[1]):
        pred = X @ betas[:d, j]
        if fit_intercept:
            pred += betas[d, j]
        r = y64 - pred.astype(xp.float64)
        psi = xp.clip(r, -tau, tau)
        rho = psi * (r - 0.5 * psi)
        absr = xp.abs(r)
        if w64 is None:
            huber_cols.append(rho.mean())
            mae_cols.append(absr.mean())
        else:
            huber_cols.append((w64 @ rho) / total)
            mae_cols.append((w64 @ absr) / total)
    huber, mae = xp.stack(huber_cols), xp.stack(mae_cols)
    if xp is not np:
        huber, mae = xp.asnumpy(huber), xp.asnumpy(mae)
    return np.asarray(huber, dtype=np.float64), np.asarray(mae, dtype=np.float64)


class GridEngine:
    """One engine per configuration, advanced together by each batch.

    Parameters
    ----------
    configs : sequence of HuberConfig
        The configurations, at least one, all with the same ``dtype`` and
        ``fit_intercept`` (they score and consume the same batches), no two
        equal.
    engine : {"auto", "numpy", "gpu"}, default="numpy"
        The engine every configuration runs on (resolved as
        :func:`~rh_dask.engines.resolve_engine_name` does).
    device : None, "cpu", "cuda", "cuda:N" or int
        The device of every engine.
    reference_tau : float, default=1.345
        The τ of the prequential Huber loss, the same for every configuration
        (it is not the τ a configuration is fitted with).
    settings : Settings, optional
        Passed to :func:`~rh_dask.engines.make_engine` (GPU engine options),
        and ``grid_concurrent``.
    concurrent : bool, optional
        Whether engines that can (GPU engines) consume each batch side by
        side, their steps interleaved and waited for together (None:
        ``settings.grid_concurrent``, from ``rh-dask.grid.concurrent``).
        Ignored for NumPy engines.

    Raises
    ------
    ValidationError
        For an empty or mixed list of configurations, duplicates, or a bad
        ``reference_tau``.
    EngineUnavailableError
        When the engine cannot start here.
    """

    name = "grid"

    def __init__(
        self,
        configs: Sequence[HuberConfig],
        engine: str = "numpy",
        device: Any = None,
        *,
        reference_tau: float = DEFAULT_REFERENCE_TAU,
        settings: Settings | None = None,
        concurrent: bool | None = None,
    ) -> None:
        configs = tuple(configs)
        _check_configs(configs)
        self.reference_tau = check_reference_tau(reference_tau)
        if concurrent is None:
            concurrent = grid_concurrent() if settings is None else bool(settings.grid_concurrent)
        elif not isinstance(concurrent, bool):
            raise ValidationError(f"concurrent must be a bool or None, got {concurrent!r}")
        self.configs = configs
        self.engines: tuple[Engine, ...] = tuple(
            make_engine(engine, c, device, settings=settings) for c in configs
        )
        self._records: list[GridRecord] = []
        #: Whether the engines consume each batch side by side (GPU engines only).
        self.concurrent = bool(
            concurrent and can_advance_together(self.engines) and len(configs) > 1
        )
        # What GPU engines share: one device copy of each batch, and the scores.
        shared = getattr(self.engines[0], "grid_device", None)
        self._device = None if shared is None else shared(self.engines, self.reference_tau)

    # -- what the grid holds ------------------------------------------------------
    @property
    def n_configs(self) -> int:
        return len(self.configs)

    @property
    def engine_name(self) -> str:
        return self.engines[0].name

    @property
    def accepts_device_arrays(self) -> bool:
        return bool(self.engines[0].accepts_device_arrays)

    @property
    def dtype(self) -> np.dtype:
        return self.configs[0].np_dtype

    @property
    def fit_intercept(self) -> bool:
        return self.configs[0].fit_intercept

    @property
    def n_features_in(self) -> int | None:
        return self.engines[0].n_features_in

    @property
    def batch_count(self) -> int:
        return self.engines[0].batch_count

    @property
    def records(self) -> tuple[GridRecord, ...]:
        """One record per batch consumed since the last reset or import."""
        return tuple(self._records)

    def coefficients(self) -> np.ndarray:
        """β of every configuration, shape (n_configs, n_params), intercept last."""
        return np.stack([e.coefficients() for e in self.engines])

    def export_states(self) -> list[HuberState]:
        """A host copy of every configuration's state, in the order of ``configs``."""
        return [e.export_state() for e in self.engines]

    def import_states(self, states: Sequence[HuberState]) -> None:
        """Continue every configuration from a state (one per configuration, in order).

        Atomic: when one state is refused, every engine keeps what it held.
        The records are kept (they describe the batches that led there).
        """
        states = list(states)
        if len(states) != self.n_configs:
            raise ValidationError(f"got {len(states)} states for {self.n_configs} configurations")
        widths = {s.n_features_in for s in states}
        counts = {s.batch_count for s in states}
        if len(widths) != 1 or len(counts) != 1:
            raise ValidationError(
                "the states of a grid must have one width and one batch count, got widths "
                f"{sorted(widths)} and batch counts {sorted(counts)}"
            )
        held = self._held()
        done = 0
        try:
            for engine, state in zip(self.engines, states, strict=True):
                engine.import_state(state)
                done += 1
        except BaseException:
            self._restore(held, range(done))
            raise

    def extend_records(self, records: Sequence[GridRecord]) -> None:
        """Append the records of batches the configurations consumed elsewhere.

        A grid walked over several actors (:mod:`rh_dask.distributed.grid_walk`)
        takes the states they reached with :meth:`import_states` and their
        merged records with this; each record must cover every configuration.
        """
        records = list(records)
        for r in records:
            if len(r.huber_loss) != self.n_configs or len(r.diagnostics) != self.n_configs:
                raise ValidationError(
                    f"a record of batch {r.batch} covers {len(r.diagnostics)} configurations, "
                    f"the grid has {self.n_configs}"
                )
        self._records.extend(records)

    def reset(self) -> None:
        """Forget the stream in every engine (workspaces kept) and the records."""
        for engine in self.engines:
            engine.reset()
        self._records = []

    def close(self) -> None:
        """Close the engines that hold resources to release (the GPU engine)."""
        device, self._device = self._device, None
        if device is not None:
            device.close()
        for engine in self.engines:
            close = getattr(engine, "close", None)
            if close is not None:
                close()

    # -- advancing ----------------------------------------------------------------
    def partial_fit(
        self,
        X: Any,
        y: Any,
        sample_weight: Any | None = None,
        *,
        chunk: int = 0,
        upcoming: tuple[Any, ...] | None = None,
    ) -> GridRecord:
        """Score one validated batch at every configuration, then fit every configuration on it.

        Parameters
        ----------
        X, y, sample_weight
            A batch validated by :func:`rh_dask.validation.validate_batch` in
            the grid's dtype (host arrays, or device arrays for a GPU engine).
        chunk : int, default=0
            The chunk index the record names.
        upcoming : tuple, optional
            ``(X, y)`` or ``(X, y, sample_weight)`` of the next batch: GPU
            engines start copying it to the device once this batch is on
            its way, so that the copy overlaps this batch's solve (the next
            call with these very arrays takes the copy; they must not be
            modified until then). Ignored by NumPy engines.

        Returns
        -------
        GridRecord
            The batch's scores and every configuration's diagnostics.

        Raises
        ------
        ValidationError
            When any configuration's engine refuses the batch; every
            configuration is then exactly as it was, and no record is added.
        """
        if self._device is not None:
            with self._device.batch(X, y, sample_weight, upcoming) as (X, y, w):
                n = self._check_batch(X, y, w)
                pending = None
                if self.n_features_in is not None:
                    pending = self._device.score(X, y, w, self.coefficients())
                diagnostics = self._fit_all(X, y, w)
                huber = mae = np.full(self.n_configs, np.nan)
                if pending is not None:
                    huber, mae = pending.result()
                weight = self._batch_weight(n, w)
        else:
            w = sample_weight
            n = self._check_batch(X, y, w)
            huber = mae = np.full(self.n_configs, np.nan)
            if self.n_features_in is not None:
                betas = np.stack([e.coefficients() for e in self.engines], axis=1)
                huber, mae = prequential_scores(
                    np, X, y, w, betas, self.fit_intercept, self.reference_tau
                )
            diagnostics = self._fit_all(X, y, w)
            weight = self._batch_weight(n, w)
        record = GridRecord(
            batch=self.batch_count - 1,
            chunk=int(chunk),
            rows=n,
            weight=weight,
            huber_loss=huber,
            mae=mae,
            diagnostics=tuple(diagnostics),
        )
        self._records.append(record)
        return record

    def partial_fit_stream(self, batches: Iterable[tuple[Any, ...]]) -> Iterator[GridRecord]:
        """:meth:`partial_fit` over ``(X, y)`` or ``(X, y, sample_weight)`` batches in order.

        Yields each batch's record (``chunk``: the batch's position in
        ``batches``). For GPU engines each host batch is copied to the device
        while the engines solve the one before it.
        """
        iterator = iter(batches)
        current = next(iterator, None)
        index = 0
        while current is not None:
            upcoming = next(iterator, None)
            yield self.partial_fit(*current, chunk=index, upcoming=upcoming)
            current = upcoming
            index += 1

    # -- internals ----------------------------------------------------------------
    def _check_batch(self, X: Any, y: Any, w: Any | None) -> int:
        """The batch's row count, after its shapes are checked against the stream."""
        n = int(X.shape[0])
        if n < 1:
            raise ValidationError("a batch needs at least one row")
        if tuple(y.shape) != (n,) or (w is not None and tuple(w.shape) != (n,)):
            raise ValidationError(f"y and sample_weight must have shape ({n},)")
        if self.n_features_in is not None and (X.ndim != 2 or X.shape[1] != self.n_features_in):
            raise ValidationError(
                f"X has shape {tuple(X.shape)}, the stream has {self.n_features_in} features"
            )
        return n

    def _fit_all(self, X: Any, y: Any, w: Any | None) -> list[BatchDiagnostics]:
        """Every engine consumes the batch; atomic: a refusal puts every engine back."""
        if can_advance_together(self.engines):
            # Any engine may fail while others have committed: each one's state is
            # held (on the device, no wait), and a failure puts every engine back.
            held = [engine.hold() for engine in self.engines]
            try:
                if self.concurrent:
                    # A GPU grid's shared copy was checked once for every engine.
                    extra = {} if self._device is None else {"checked": self._device.ready}
                    return advance_together(
                        [e.batch_steps(X, y, w, **extra) for e in self.engines]
                    )
                return [engine.partial_fit(X, y, w) for engine in self.engines]
            except BaseException:
                for engine, state in zip(self.engines, held, strict=True):
                    engine.put_back(state)
                raise
        held_states = self._held()
        diagnostics: list[BatchDiagnostics] = []
        try:
            for engine in self.engines:
                diagnostics.append(engine.partial_fit(X, y, w))
        except BaseException:
            self._restore(held_states, range(len(diagnostics)))
            raise
        return diagnostics

    def _batch_weight(self, n: int, w: Any | None) -> float:
        """The batch's Σw, exactly what its configurations added to ``weight_sum``.

        So the prequential means weigh a batch as its fits did. The engines
        report it (the GPU engine's is computed on the device); one that does
        not has it summed here, correctly rounded as every engine takes it.
        """
        if w is None:
            return float(n)
        reported = getattr(self.engines[0], "last_batch_weight", None)
        if reported is not None:
            return float(reported)
        return sum_weights(w.get() if is_device_array(w) else w)

    def _held(self) -> list[HuberState | None]:
        """What each engine but the last holds (the last one's refusal is atomic)."""
        return [None if e.n_features_in is None else e.export_state() for e in self.engines[:-1]]

    def _restore(self, held: list[HuberState | None], changed: Sequence[int]) -> None:
        """Put the engines at the indices ``changed`` back to ``held``."""
        for i in changed:
            engine, state = self.engines[i], held[i]
            if state is None:
                engine.reset()
            else:
                engine.import_state(state)


def _check_configs(configs: tuple[HuberConfig, ...]) -> None:
    if not configs:
        raise ValidationError("a grid needs at least one configuration")
    for c in configs:
        if not isinstance(c, HuberConfig):
            raise ValidationError(f"grid configurations must be HuberConfig, got {type(c)!r}")
    dtypes = {c.dtype for c in configs}
    intercepts = {c.fit_intercept for c in configs}
    if len(dtypes) != 1 or len(intercepts) != 1:
        raise ValidationError(
            "every configuration of a grid needs the same dtype and fit_intercept, got dtypes "
            f"{sorted(dtypes)} and fit_intercept {sorted(intercepts)}"
        )
    if len(set(configs)) != len(configs):
        raise ValidationError("the grid has duplicate configurations")
