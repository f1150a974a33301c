"""One batch on the device, from ``rh_build`` to the committed counters.

``rh_build`` writes the design matrix Z = [X, 1] into the aligned workspace,
copies y and w and validates the values, all in one pass. The batch's scalar
parameters (τ, h, N, λ, ...) go into the control block's header, written
once per batch so that captured graphs stay valid from batch to batch; a
weighted batch needs Σw first (it sets N, h and λ), so its header is
completed after one synchronisation. The Newton or LAMM driver then solves
and commits on the device, and the host advances the counters only for a
batch the device committed.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Generator
from typing import Any, TypeVar

import numpy as np

from rh_dask.core import BatchSchedule, batch_schedule, singular_rtol
from rh_dask.exceptions import ValidationError
from rh_dask.state import BatchDiagnostics

from . import layout
from .diagnostics import add_score_gram, residuals, robust_diagnostics
from .inputs import raise_if_invalid
from .lamm import LammDriver
from .launch import Launch
from .newton import NewtonDriver
from .parts import DeviceParts
from .state import Counters
from .transfer import StagedBatch

R = TypeVar("R")

#: ``rh_build`` launches kept packed per engine (a launch holds the input addresses).
BUILD_LAUNCHES = 4


def run_to_end(steps: Generator[Any, None, R], synchronize: Callable[[], None]) -> R:
    """Drive ``steps`` to its end, calling ``synchronize`` at each of its yields; its value."""
    while True:
        try:
            next(steps)
        except StopIteration as stop:
            return stop.value
        synchronize()


class BatchRunner:
    """Runs batches on the engine's stream with the Newton or the LAMM driver.

    Parameters
    ----------
    parts : DeviceParts
        The engine's device-side collaborators.
    newton, lamm : NewtonDriver, LammDriver
        The solvers.
    cp : module
        CuPy (for the diagnostics).
    diagnostics : bool
        Report each batch's robust diagnostics (mean Huber loss, share beyond
        τ, 1.4826 × MAD; :mod:`.diagnostics`).
    """

    def __init__(
        self,
        parts: DeviceParts,
        newton: NewtonDriver,
        lamm: LammDriver,
        cp: Any = None,
        diagnostics: bool = False,
    ) -> None:
        self._parts = parts
        self._cp = cp
        self._newton = newton
        self._lamm = lamm
        self._diagnostics = diagnostics
        #: Packed ``rh_build`` launches by input addresses, oldest first.
        self._builds: dict[tuple[int, ...], Launch] = {}
        #: Control-block header templates by (p, whether the schedule is known).
        self._headers: dict[tuple[int, bool], np.ndarray] = {}

    def steps(
        self,
        X: Any,
        y: Any,
        w: Any | None,
        staged: StagedBatch | None,
        counters: Counters | None,
        accumulate_k: bool,
    ) -> Generator[None, None, tuple[BatchDiagnostics, Counters, float]]:
        """Fit one batch of device arrays, yielding wherever the host must wait.

        Each ``yield`` follows work whose status the next step reads: the
        caller synchronises the engine's stream before resuming (with
        :func:`run_to_end`, or together with other engines), and makes that
        stream CuPy's current one for every resume (the generator never
        holds a stream context across a yield, so several engines' steps can
        be interleaved on one thread). ``counters`` are those before the
        batch (``None``: an empty stream, whose β, J and K are zeroed first).
        ``accumulate_k``: add the batch's score Gram to K once the batch is
        committed. Returns the batch's diagnostics, the counters after it
        and the batch's Σw (its row count when unweighted); nothing is
        committed when it raises.

        Raises
        ------
        ValidationError
            For non-finite values, negative weights or a non-positive weight
            sum (found on the device), or a stream too wide for the solver.
        """
        cfg = self._parts.config
        ws = self._parts.ws
        n, d = int(X.shape[0]), int(X.shape[1])
        p = d + int(cfg.fit_intercept)
        before = counters or Counters(n_features_in=d, fit_intercept=cfg.fit_intercept)
        stream = self._parts.stream
        calls = self._parts.calls
        if staged is not None:
            calls.stream_wait(stream.ptr, staged.slot.ready.ptr)
        fresh = ws.ensure_params(p)
        if counters is None and not fresh:
            ws.beta.fill(0)
            ws.J.fill(0)
            ws.K.fill(0)
        ws.ensure_rows(n)
        self._parts.dense.prepare(p, ws.H)
        # The batch's own Σw (the schedule's total is the stream's): read from the
        # device below when the batch is weighted.
        batch_weight = float(n)
        schedule = None if w is not None else batch_schedule(cfg, before, batch_weight)
        self._write_header(schedule, p)
        calls.copy_to_device(ws.ctl_ptr, ws.header.ptr, layout.CTL_BYTES, stream.ptr)
        self._build(X, y, w, n, d, p)(stream.ptr)
        if staged is not None:
            staged.slot.consumed.record(stream)
        if schedule is None:
            # Σw decides N, h and λ: read it (and the validation flags) first.
            yield
            raise_if_invalid(ws.status_i)
            batch_weight = float(ws.status_d[layout.S_WSUM])
            if not batch_weight > 0:
                raise ValidationError("sample_weight must have a positive sum")
            schedule = batch_schedule(cfg, before, batch_weight)
            self._write_header(schedule, p)
            calls.copy_to_device(ws.ctl_ptr, ws.header.ptr, layout.N_PARAM * 8, stream.ptr)
        self._parts.launcher.follow(ws.generation)
        if cfg.penalised:
            yield from self._lamm.steps(n)
        else:
            yield from self._newton.steps(n, p)
        # The solvers raise at their first synchronisation already; this test
        # keeps the counters of a refused batch untouched whatever path the
        # solve took (the kernels never commit a flagged batch either).
        raise_if_invalid(ws.status_i)
        if not ws.status_i[layout.I_COMMITTED]:  # pragma: no cover - a kernel bug
            raise RuntimeError("the GPU engine stopped without committing the batch")
        robust: tuple[float | None, ...] = (None, None, None)
        if accumulate_k:
            parts = self._parts
            add_score_gram(parts.launcher, parts.dense, parts.kernels, ws, n)
        if self._diagnostics:
            _, r = residuals(ws, n, p, self._parts.dense)
            weights = None if w is None else ws.w[:n]
            robust = self._robust(r, weights, cfg.tau, batch_weight)
        diagnostics = BatchDiagnostics(
            iterations=int(ws.status_i[layout.I_ITER]),
            converged=bool(ws.status_i[layout.I_CONV]),
            objective=float(ws.status_d[layout.S_OBJ]),
            lambda_value=float(schedule.lambda_value),
            bandwidth=float(schedule.bandwidth),
            mean_loss=robust[0],
            outlier_share=robust[1],
            residual_scale=robust[2],
        )
        after = Counters(
            n_features_in=d,
            fit_intercept=cfg.fit_intercept,
            n_samples_seen=before.n_samples_seen + n,
            batch_count=before.batch_count + 1,
            previous_lambda=schedule.lambda_value,
            weight_sum=schedule.total_weight,
        )
        return diagnostics, after, batch_weight

    def _build(self, X: Any, y: Any, w: Any | None, n: int, d: int, p: int) -> Launch:
        """The ``rh_build`` launch of these inputs, packed once for their addresses.

        A batch's inputs move from batch to batch, but staged host batches
        alternate between two slots (and a grid's engines share one copy),
        so the last few launches are kept (:data:`BUILD_LAUNCHES`).
        """
        ws = self._parts.ws
        key = (
            int(X.data.ptr),
            int(y.data.ptr),
            0 if w is None else int(w.data.ptr),
            n,
            d,
            p,
            ws.generation,
        )
        launch = self._builds.get(key)
        if launch is None:
            launch = Launch(
                self._parts.calls,
                self._parts.kernels.rh_build,
                self._parts.launcher.grid(n),
                layout.ROW_THREADS,
                (
                    X,
                    d,
                    y,
                    0 if w is None else w,
                    n,
                    d,
                    p,
                    ws.ldz,
                    ws.Z,
                    ws.y,
                    ws.w,
                    ws.partials,
                    ws.ctl,
                    ws.status_ptr,
                    ws.beta,
                    ws.beta_work,
                ),
            )
            if len(self._builds) >= BUILD_LAUNCHES:
                del self._builds[next(iter(self._builds))]
            self._builds[key] = launch
        return launch

    def _robust(
        self, r: Any, w: Any | None, tau: float, batch_weight: float
    ) -> tuple[float | None, ...]:
        """The batch's robust diagnostics; a failure to compute them never fails the batch.

        The batch is committed by now, and the diagnostics only describe it: if
        computing them raises (a CuPy without a routine they use), the engine
        warns once, stops computing them and reports ``None``, as with
        ``diagnostics=False``.
        """
        try:
            return robust_diagnostics(self._cp, r, w, tau, batch_weight)
        except Exception as exc:
            self._diagnostics = False
            warnings.warn(
                f"the GPU engine stopped computing its robust diagnostics ({exc!r}); "
                "they are None from this batch on",
                RuntimeWarning,
                stacklevel=2,
            )
            return (None, None, None)

    def _write_header(self, schedule: BatchSchedule | None, p: int) -> None:
        """Fill the pinned control-block image for this batch (``None``: Σw not known yet).

        The fields that depend on the configuration and p alone come from a
        template made once per p; the schedule's are written per batch.
        """
        ws = self._parts.ws
        hd = ws.header_d
        hd[:] = self._header_template(p, with_schedule=schedule is not None)
        ws.header_i[:] = 0
        if schedule is not None:
            dt = self._parts.config.np_dtype.type
            hd[layout.P_HALF_INV_H] = dt(0.5 / schedule.bandwidth)
            hd[layout.P_INV_TOTAL] = dt(1.0 / schedule.total_weight)
            hd[layout.P_TOTAL] = schedule.total_weight
            hd[layout.P_HIST] = dt(schedule.history_scale)
            hd[layout.P_HAS_HIST] = 1.0 if schedule.history_scale else 0.0
            hd[layout.P_LAM] = dt(schedule.lambda_value)
            hd[layout.P_LAMBDA_VALUE] = schedule.lambda_value

    def _header_template(self, p: int, with_schedule: bool) -> np.ndarray:
        """The header's doubles that depend on the configuration and p only."""
        key = (p, with_schedule)
        template = self._headers.get(key)
        if template is None:
            cfg = self._parts.config
            dt = cfg.np_dtype.type
            template = np.zeros_like(self._parts.ws.header_d)
            if with_schedule:
                template[layout.P_TAU] = dt(cfg.tau)
                template[layout.P_RIDGE] = dt(cfg.ridge)
            template[layout.P_TOL] = cfg.tol
            template[layout.P_RTOL] = singular_rtol(cfg.np_dtype, p)
            template[layout.P_MAX_ITER] = float(cfg.max_iter)
            template[layout.P_FIT_INTERCEPT] = 1.0 if cfg.fit_intercept else 0.0
            template[layout.P_PENALISED] = 1.0 if cfg.penalised else 0.0
            template[layout.S_PHI] = 1.0
            self._headers[key] = template
        return template
