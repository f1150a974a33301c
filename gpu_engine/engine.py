"""``GpuEngine``: the renewable Huber estimator resident on one CUDA device.

The engine holds β and J on its device for the whole stream and moves only
a few hundred bytes of control data per iteration. One batch runs as:

1. ``rh_build``: the design matrix Z = [X, 1] in an aligned workspace, y and
   w copied, the batch validated (non-finite values, negative weights, Σw),
   all in one pass.
2. Newton (unpenalised), one step per iteration: the Cholesky solve
   (``rh_newton_solve``, a fused one-block kernel for p ≤ 32, else
   ``rh_newton_assemble`` + cuSOLVER ``potrf``/``potrs``), then
   ``rh_newton_search``, which evaluates all 27 backtracking steps in one pass
   and whose last block decides the step, updates β and tests convergence on
   the device, then ``rh_newton_eval`` (r, ψ, κ, the scaled rows
   M = [wκ ⊙ Z | wψ] and the loss) and one GEMM C = Zᵀ M (Gram matrix and
   gradient) at the new β: the next iteration's start and, when the search
   ended the solve, the commit's input; ``rh_commit_finish`` then commits
   (objective, J += Gram, β) and is a no-op otherwise.
   LAMM (L1), per round: ``rh_lamm_eval`` (r and g in one pass) and
   ``rh_lamm_trials`` (8 majorisation trials in one pass; the last block
   accepts the first that passes). Rounds are queued several at a time,
   followed by the commit (``rh_commit_eval``, the GEMM, ``rh_commit_finish``);
   kernels of a finished solve, and the commit of an unfinished one, return
   at once. A batch that ``rh_build`` finds invalid is finished at once:
   every iterating kernel and both commit kernels test its flag
   (``solve_open``, ``commit_due`` in ``huber.cu``), so whatever was queued
   for it, the host raises after its first synchronisation with β, J and the
   β mirror untouched, and never advances the counters of a flagged batch.

The host reads a host-mapped status block after each synchronisation: one
per Newton iteration, one per queue of LAMM rounds (one more for a weighted
batch, whose Σw sets N, h and λ). Each step is captured once as a CUDA graph
(``graphs=True``) and replayed; launches outside graphs go through
pre-packed ``cuLaunchKernel`` parameter blocks.

Decisions follow the NumPy reference exactly (:mod:`rh_dask.core`): the same
schedule, the same difference form of the line-search and LAMM tests, the
same singularity rule; when the Cholesky factor fails it, the host finishes
the contract's ladder (LU, then the minimum-norm SVD solution) and the line
search is rerun with that direction.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from rh_dask.config import HuberConfig
from rh_dask.core import LAMM_MAX_TRIALS, BatchSchedule, batch_schedule, singular_rtol
from rh_dask.exceptions import NotFittedError, ValidationError
from rh_dask.state import BatchDiagnostics, HuberState

from . import layout
from ._cuda import import_cupy, resolve_device
from .driver import CapturedGraph, DriverCalls
from .kernels import Launch, get_kernels
from .solver import DenseSolver
from .transfer import HostStager, PinnedPool, StagedBatch, as_device_array
from .workspace import Workspace

__all__ = ["GpuEngine"]


#: ``cholesky="auto"`` takes the fused kernel up to this p. Measured on an H200
#: (benchmarks/results/shape_sweep*.json, rh_gpu_kernel vs rh_gpu_cusolver and
#: the earlier run that used the kernel up to p = 256): the kernel wins at
#: p = 17 (0.42 vs 0.47 ms per stream), is within noise at p = 33 and loses at
#: p = 91 (5.0-5.2 vs 3.4-3.5 ms), where its one-block factorisation is
#: latency-bound.
_FUSED_SOLVE_MAX_P = 32


@dataclass
class _Counters:
    """The host side of the state: everything but β and J."""

    n_features_in: int
    fit_intercept: bool
    n_samples_seen: int = 0
    batch_count: int = 0
    previous_lambda: float = 0.0
    weight_sum: float = 0.0


def _env_flag(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    if value is None:
        return default
    return value.strip().lower() not in ("0", "false", "no", "off", "")


class GpuEngine:
    """Renewable Huber engine on one CUDA device (CuPy + RawKernels + cuSOLVER).

    Parameters
    ----------
    config : HuberConfig
        Statistical and solver parameters of the stream.
    device : None, "cuda", "cuda:N", int or cupy.cuda.Device
        The device the engine lives on (``None``: device 0).
    graphs : bool, optional
        Replay each iteration body as a captured CUDA graph (one launch per
        iteration instead of six). Default: the environment variable
        ``RH_DASK_GPU_GRAPHS``, else on. Falls back to plain launches if
        capture fails.
    copy_threads : int, default=4
        Threads that copy host (NumPy) batches into pinned staging memory.
    cholesky : {"auto", "kernel", "cusolver"}, default="auto"
        How the Newton system is factorised. ``"cusolver"``: cuSOLVER
        ``potrf``/``potrs`` on a preallocated workspace. ``"kernel"``: the
        engine's fused one-block kernel (assembly, Cholesky and both
        triangular solves in shared memory), which needs the p×p system to
        fit in shared memory. ``"auto"`` takes the kernel when it fits and
        cuSOLVER otherwise (see docs/gpu-engine.md for the measurements).
        The LU and minimum-norm fallbacks always use cuSOLVER.

    Raises
    ------
    EngineUnavailableError
        When CuPy, a CUDA driver or the requested device is missing.

    Notes
    -----
    Host batches can be copied ahead: :meth:`prefetch` the next batch before
    calling :meth:`partial_fit` on the current one (or use
    :meth:`partial_fit_stream`), and its transfer overlaps the solve.
    """

    name: ClassVar[str] = "gpu"
    accepts_device_arrays: ClassVar[bool] = True

    def __init__(
        self,
        config: HuberConfig,
        device: Any = None,
        *,
        graphs: bool | None = None,
        copy_threads: int = 4,
        cholesky: str = "auto",
    ) -> None:
        if cholesky not in ("auto", "kernel", "cusolver"):
            raise ValidationError(
                f"cholesky must be 'auto', 'kernel' or 'cusolver', got {cholesky!r}"
            )
        self._cholesky = cholesky
        cp = import_cupy()
        self._cp = cp
        self.config = config
        self._dtype = config.np_dtype
        self._device_id = resolve_device(cp, device)
        self._closed = True
        with cp.cuda.Device(self._device_id):
            self._kernels = get_kernels(cp, self._device_id, self._dtype)
            self._calls = DriverCalls(cp)
            self._stream = cp.cuda.Stream(non_blocking=True)
            self._dense = DenseSolver(cp, self._device_id, self._stream, self._dtype)
            # Row kernels run 2 blocks of 512 threads per multiprocessor by default.
            per_sm = int(os.environ.get("RH_DASK_GPU_BLOCKS_PER_SM", "2"))
            self._max_grid = max(1, per_sm) * self._kernels.multiprocessors
            self._ws = Workspace(cp, self._dtype, self._max_grid)
            self._stager = HostStager(
                cp, self._device_id, self._dtype, copy_threads, calls=self._calls
            )
            self._caller_ready = cp.cuda.Event(disable_timing=True)
            self._done_event = cp.cuda.Event(disable_timing=True)
        self._closed = False
        self._graphs_enabled = _env_flag("RH_DASK_GPU_GRAPHS", True) if graphs is None else graphs
        self._graph_error: str | None = None
        self._graph_cache: dict[tuple[Any, ...], CapturedGraph] = {}
        self._graph_generation = -1
        self._counters: _Counters | None = None
        self._host_beta: np.ndarray | None = None
        self._launches: dict[tuple[Any, ...], Any] = {}
        self._last_lamm_iterations = 4
        self._small_solve = False
        self._pinned_pool: PinnedPool | None = None

    @property
    def pinned_pool(self) -> PinnedPool:
        """Pinned buffers that other threads may copy host batches into (created on first use).

        A batch copied there (:meth:`PinnedPool.copy_batch`) reaches this
        engine's device by DMA alone, so the copy runs on the caller's thread
        instead of the engine's. The distributed walk's loading tasks use it.
        """
        if self._pinned_pool is None:
            self._pinned_pool = PinnedPool(self._cp, self._device_id, self._dtype)
        return self._pinned_pool

    # -- interface properties -----------------------------------------------------
    @property
    def device(self) -> str:
        return f"cuda:{self._device_id}"

    @property
    def n_features_in(self) -> int | None:
        return None if self._counters is None else self._counters.n_features_in

    @property
    def batch_count(self) -> int:
        return 0 if self._counters is None else self._counters.batch_count

    @property
    def n_samples_seen(self) -> int:
        return 0 if self._counters is None else self._counters.n_samples_seen

    @property
    def graphs(self) -> bool:
        """Whether iteration bodies are replayed as CUDA graphs."""
        return self._graphs_enabled

    @property
    def graph_error(self) -> str | None:
        """Why graph capture was turned off, if it failed."""
        return self._graph_error

    @property
    def cublas_math_mode(self) -> int:
        """The cuBLAS math mode of the engine's handle (0: default IEEE, never TF32)."""
        return self._dense.math_mode

    # -- state ---------------------------------------------------------------------
    def reset(self) -> None:
        """Forget the stream; workspaces, handles and graphs are kept."""
        self._stager.discard_pending()
        self._counters = None
        self._host_beta = None

    def coefficients(self) -> np.ndarray:
        """A host copy of β (intercept last)."""
        return self._beta_on_host().copy()

    def export_state(self) -> HuberState:
        """A host (NumPy) copy of the portable state."""
        counters = self._require_state()
        cp = self._cp
        with cp.cuda.Device(self._device_id):
            self._stream.synchronize()
            beta = cp.asnumpy(self._ws.beta, stream=self._stream)
            info = cp.asnumpy(self._ws.J, stream=self._stream)
            self._stream.synchronize()
        return HuberState(
            coefficients=beta,
            information=info,
            n_samples_seen=counters.n_samples_seen,
            batch_count=counters.batch_count,
            previous_lambda=counters.previous_lambda,
            weight_sum=counters.weight_sum,
            n_features_in=counters.n_features_in,
            fit_intercept=counters.fit_intercept,
        )

    def import_state(self, state: HuberState) -> None:
        """Continue a stream from a portable state (a checkpoint, another engine)."""
        if state.fit_intercept != self.config.fit_intercept:
            raise ValidationError(
                f"state has fit_intercept={state.fit_intercept}, "
                f"engine config has {self.config.fit_intercept}"
            )
        state.validate()
        state = state.astype(self._dtype)
        cp = self._cp
        with cp.cuda.Device(self._device_id), self._stream:
            self._ws.ensure_params(state.n_params)
            self._ws.beta.set(np.ascontiguousarray(state.coefficients), stream=self._stream)
            self._ws.beta_host[...] = state.coefficients
            self._ws.J.set(np.ascontiguousarray(state.information), stream=self._stream)
            self._stream.synchronize()
        self._counters = _Counters(
            n_features_in=int(state.n_features_in),
            fit_intercept=bool(state.fit_intercept),
            n_samples_seen=int(state.n_samples_seen),
            batch_count=int(state.batch_count),
            previous_lambda=float(state.previous_lambda),
            weight_sum=float(state.weight_sum),
        )
        self._host_beta = None

    def close(self) -> None:
        """Release pinned memory, worker threads and library handles."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        with self._cp.cuda.Device(self._device_id):
            self._stream.synchronize()
            self._stager.close()
            if self._pinned_pool is not None:
                self._pinned_pool.close()
            self._drop_graphs()
            self._ws.close()
            self._dense.close()

    def __del__(self) -> None:  # pragma: no cover - depends on interpreter shutdown
        try:
            self.close()
        except Exception:
            pass

    # -- fitting -----------------------------------------------------------------------
    def prefetch(self, X: Any, y: Any, sample_weight: Any | None = None) -> None:
        """Start copying a host batch to the device in the background.

        The next :meth:`partial_fit` called with these very arrays uses the
        copy, so that its transfer overlaps whatever the engine does in
        between (typically the solve of the current batch). The arrays must
        not be modified until then. Device arrays need no prefetch (the call
        is a no-op for them).
        """
        if _is_cuda(X):
            return
        X, y, w = self._check_host(X, y, sample_weight)
        self._stager.prefetch(X, y, w)

    def partial_fit_stream(self, batches: Any) -> Any:
        """Fit an iterable of ``(X, y)`` or ``(X, y, sample_weight)`` batches in order.

        Yields each batch's diagnostics. Host batches are copied one ahead:
        the transfer of batch i+1 overlaps the solve of batch i.
        """
        iterator = iter(batches)
        current = next(iterator, None)
        if current is not None:
            self.prefetch(*current)
        while current is not None:
            upcoming = next(iterator, None)
            cp = self._cp
            with cp.cuda.Device(self._device_id):
                inputs = self._inputs(*current)
                if upcoming is not None:
                    self.prefetch(*upcoming)
                yield self._fit_device(*inputs)
            current = upcoming

    def partial_fit(self, X: Any, y: Any, sample_weight: Any | None = None) -> BatchDiagnostics:
        """Advance the stream by one batch (host NumPy or device arrays); atomic on failure.

        Raises
        ------
        ValidationError
            For a malformed batch (shape, dtype, device, layout, non-finite
            values, negative weights or a non-positive weight sum); the
            state is left exactly as it was.
        """
        with self._cp.cuda.Device(self._device_id):
            return self._fit_device(*self._inputs(X, y, sample_weight))

    def _inputs(
        self, X: Any, y: Any, sample_weight: Any | None = None
    ) -> tuple[Any, Any, Any | None, StagedBatch | None]:
        """Device views of a batch: zero-copy for device input, staged for host input."""
        if _is_cuda(X):
            return (*self._accept_device(X, y, sample_weight), None)
        Xh, yh, wh = self._check_host(X, y, sample_weight)
        staged = self._stager.take(Xh, yh, wh) or self._stager.stage(Xh, yh, wh)
        return staged.X, staged.y, staged.w, staged

    # -- prediction ------------------------------------------------------------------
    def predict(self, X: Any) -> Any:
        """Z β: NumPy out for host input, CuPy (on the engine's device) for device input."""
        counters = self._require_state()
        d = counters.n_features_in
        if not _is_cuda(X):
            X = np.asarray(X)
            self._check_width(X, d)
            beta = self._beta_on_host()
            out = X @ beta[:d]
            if counters.fit_intercept:
                out += beta[d]
            return out
        cp = self._cp
        with cp.cuda.Device(self._device_id):
            self._caller_ready.record(cp.cuda.get_current_stream())
            with self._stream:
                Xd = as_device_array(cp, X, "X", self._device_id, self._dtype, 2)
                self._check_width(Xd, d)
                self._stream.wait_event(self._caller_ready)
                n = int(Xd.shape[0])
                out = cp.empty(n, dtype=self._dtype)
                if n:
                    p = d + int(counters.fit_intercept)
                    self._kernels.rh_predict(
                        (self._grid(n),),
                        (layout.ROW_THREADS,),
                        (Xd, d, n, d, self._ws.beta, int(counters.fit_intercept), out),
                        shared_mem=p * self._ws.item,
                    )
                self._done_event.record(self._stream)
            cp.cuda.get_current_stream().wait_event(self._done_event)
        return out

    # -- validation ------------------------------------------------------------------------
    def _require_state(self) -> _Counters:
        if self._counters is None:
            raise NotFittedError("the engine has consumed no batch yet")
        return self._counters

    def _check_width(self, X: Any, expected: int | None) -> None:
        if X.ndim != 2:
            raise ValidationError(f"X must be 2-D, got {X.ndim}-D")
        if expected is not None and X.shape[1] != expected:
            raise ValidationError(
                f"X has {X.shape[1]} features, but the stream is expecting {expected} features"
            )

    def _check_shapes(self, X: Any, y: Any, w: Any | None) -> None:
        self._check_width(X, self.n_features_in)
        n = int(X.shape[0])
        if n < 1:
            raise ValidationError("a batch needs at least one row")
        if X.shape[1] < 1:
            raise ValidationError("a batch needs at least one feature")
        if tuple(y.shape) != (n,) or (w is not None and tuple(w.shape) != (n,)):
            raise ValidationError(f"y and sample_weight must have shape ({n},)")

    def _check_host(
        self, X: Any, y: Any, w: Any | None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """Structural checks of a host batch; values are checked on the device."""
        arrays = (X, y) if w is None else (X, y, w)
        if any(_is_cuda(a) for a in arrays):
            raise ValidationError(
                "X, y and sample_weight must all be on the host or all on the device"
            )
        if not all(isinstance(a, np.ndarray) for a in arrays):
            raise ValidationError(
                "the GPU engine takes NumPy or CUDA arrays (validate the batch first)"
            )
        for name, arr in (("X", X), ("y", y), ("sample_weight", w)):
            if arr is not None and arr.dtype != self._dtype:
                raise ValidationError(
                    f"{name} has dtype {arr.dtype}, the engine computes in {self._dtype}"
                )
        self._check_shapes(X, y, w)
        return X, y, w

    def _accept_device(self, X: Any, y: Any, w: Any | None) -> tuple[Any, Any, Any | None]:
        """Zero-copy views of device inputs, ordered after the caller's stream."""
        cp = self._cp
        if not (_is_cuda(y) and (w is None or _is_cuda(w))):
            raise ValidationError(
                "X, y and sample_weight must all be on the host or all on the device"
            )
        self._caller_ready.record(cp.cuda.get_current_stream())
        with self._stream:
            dev, dt = self._device_id, self._dtype
            Xd = as_device_array(cp, X, "X", dev, dt, 2)
            yd = as_device_array(cp, y, "y", dev, dt, 1)
            wd = None if w is None else as_device_array(cp, w, "sample_weight", dev, dt, 1)
        self._check_shapes(Xd, yd, wd)
        self._stream.wait_event(self._caller_ready)
        return Xd, yd, wd

    # -- the batch -------------------------------------------------------------------------
    def _grid(self, n: int, warps: int = layout.ROW_THREADS // 32) -> int:
        return max(1, min(self._max_grid, -(-n // warps)))

    def _fit_device(
        self, X: Any, y: Any, w: Any | None, staged: StagedBatch | None
    ) -> BatchDiagnostics:
        cfg = self.config
        ws = self._ws
        n, d = int(X.shape[0]), int(X.shape[1])
        p = d + int(cfg.fit_intercept)
        counters = self._counters or _Counters(n_features_in=d, fit_intercept=cfg.fit_intercept)
        stream = self._stream
        with stream:
            calls = self._calls
            if staged is not None:
                calls.stream_wait(stream.ptr, staged.slot.ready.ptr)
            fresh = ws.ensure_params(p)
            if self._counters is None and not fresh:
                ws.beta.fill(0)
                ws.J.fill(0)
            ws.ensure_rows(n)
            self._dense.prepare(p, ws.H)
            schedule = None if w is not None else batch_schedule(cfg, counters, float(n))
            self._write_header(schedule, p)
            calls.copy_to_device(ws.ctl_ptr, ws.header.ptr, layout.CTL_BYTES, stream.ptr)
            # Packed for this batch only: X's address changes from batch to batch.
            Launch(
                calls,
                self._kernels.rh_build,
                self._grid(n),
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
            )(stream.ptr)
            if staged is not None:
                staged.slot.consumed.record(stream)
            if schedule is None:
                # Σw decides N, h and λ: read it (and the validation flags) first.
                calls.synchronize(stream)
                self._raise_if_invalid()
                total_w = float(ws.status_d[layout.S_WSUM])
                if not total_w > 0:
                    raise ValidationError("sample_weight must have a positive sum")
                schedule = batch_schedule(cfg, counters, total_w)
                self._write_header(schedule, p)
                calls.copy_to_device(ws.ctl_ptr, ws.header.ptr, layout.N_PARAM * 8, stream.ptr)
            if self._graph_generation != ws.generation:
                self._drop_graphs()
                self._graph_generation = ws.generation
            if cfg.penalised:
                self._solve_lamm(n)
            else:
                self._solve_newton(n, p)
        # The solvers raise at their first synchronisation already; this test
        # keeps the counters of a refused batch untouched whatever path the
        # solve took (the kernels never commit a flagged batch either).
        self._raise_if_invalid()
        if not ws.status_i[layout.I_COMMITTED]:  # pragma: no cover - a kernel bug
            raise RuntimeError("the GPU engine stopped without committing the batch")
        iterations = int(ws.status_i[layout.I_ITER])
        converged = bool(ws.status_i[layout.I_CONV])
        objective = float(ws.status_d[layout.S_OBJ])
        self._counters = _Counters(
            n_features_in=d,
            fit_intercept=cfg.fit_intercept,
            n_samples_seen=counters.n_samples_seen + n,
            batch_count=counters.batch_count + 1,
            previous_lambda=schedule.lambda_value,
            weight_sum=schedule.total_weight,
        )
        self._host_beta = None
        return BatchDiagnostics(
            iterations=iterations,
            converged=converged,
            objective=objective,
            lambda_value=float(schedule.lambda_value),
            bandwidth=float(schedule.bandwidth),
        )

    def _write_header(self, schedule: BatchSchedule | None, p: int) -> None:
        """Fill the pinned control-block image for this batch."""
        cfg, ws = self.config, self._ws
        dt = self._dtype.type
        hd, hi = ws.header_d, ws.header_i
        hd[:] = 0.0
        hi[:] = 0
        if schedule is not None:
            hd[layout.P_TAU] = dt(cfg.tau)
            hd[layout.P_HALF_INV_H] = dt(0.5 / schedule.bandwidth)
            hd[layout.P_INV_TOTAL] = dt(1.0 / schedule.total_weight)
            hd[layout.P_TOTAL] = schedule.total_weight
            hd[layout.P_RIDGE] = dt(cfg.ridge)
            hd[layout.P_HIST] = dt(schedule.history_scale)
            hd[layout.P_HAS_HIST] = 1.0 if schedule.history_scale else 0.0
            hd[layout.P_LAM] = dt(schedule.lambda_value)
            hd[layout.P_LAMBDA_VALUE] = schedule.lambda_value
        hd[layout.P_TOL] = cfg.tol
        hd[layout.P_RTOL] = singular_rtol(self._dtype, p)
        hd[layout.P_MAX_ITER] = float(cfg.max_iter)
        hd[layout.P_FIT_INTERCEPT] = 1.0 if cfg.fit_intercept else 0.0
        hd[layout.P_PENALISED] = 1.0 if cfg.penalised else 0.0
        hd[layout.S_PHI] = 1.0

    def _raise_if_invalid(self) -> None:
        flags = int(self._ws.status_i[layout.I_INVALID])
        if flags & 1:
            raise ValidationError("X and y must be finite (found NaN or infinity)")
        if flags & 2:
            raise ValidationError("sample_weight must be finite and non-negative")

    # -- solvers ------------------------------------------------------------------------
    def _solve_newton(self, n: int, p: int) -> None:
        """One synchronisation per iteration; the commit rides on the last one.

        Each step graph is: assemble H and g, Cholesky, line search (β moves
        on the device), then r, κ, M and the Gram GEMM at the new β, which
        are both the next iteration's start and, if the search finished the
        solve, the commit's Gram and loss; ``rh_commit_finish`` commits only
        then.
        """
        ws = self._ws
        self._small_solve = self._fused_solve_fits(p)
        self._run(("prime", n), lambda: self._eval_and_gram(n))
        for it in range(self.config.max_iter):
            self._run(("step", n), lambda: self._newton_step(n))
            self._calls.synchronize(self._stream)
            if it == 0:
                self._raise_if_invalid()
            if ws.status_i[layout.I_FALLBACK]:
                direction = self._dense.fallback_direction(
                    ws.Hs, ws.g, p, singular_rtol(self._dtype, p)
                )
                ws.D[...] = direction
                self._newton_search(n, force=1)
                self._eval_and_gram(n)
                self._commit_finish()
                self._calls.synchronize(self._stream)
            if ws.status_i[layout.I_DONE]:
                return

    def _solve_lamm(self, n: int) -> None:
        """Rounds queued in groups sized from the previous batch; one sync per group."""
        ws = self._ws
        shape = self._lamm_shape()
        # Each round is one group of φ trials; an iteration takes at most five.
        rounds_left = self.config.max_iter * (LAMM_MAX_TRIALS // layout.LAMM_ROUND)
        queue = max(2, self._last_lamm_iterations + 1)
        first = True
        while rounds_left > 0:
            queue = min(queue, rounds_left)
            # queue = sum of powers of two: a few cached graphs cover every length
            bit = 1
            while bit <= queue:
                if queue & bit:
                    self._run(("rounds", n, bit), lambda b=bit: self._lamm_rounds(n, b, shape))
                bit <<= 1
            self._run(("commit", n), lambda: self._commit(n))
            rounds_left -= queue
            self._calls.synchronize(self._stream)
            if first:
                self._raise_if_invalid()
                first = False
            if ws.status_i[layout.I_DONE]:
                self._last_lamm_iterations = int(ws.status_i[layout.I_ITER])
                return
            queue *= 2

    # -- launch bodies (prepared launches; captured once and replayed as graphs) -------
    def _launch(
        self, key: tuple[Any, ...], name: str, grid: int, block: int, args: Any, shared: int = 0
    ) -> None:
        launch = self._launches.get(key)
        if launch is None:
            kernel = getattr(self._kernels, name)
            launch = Launch(self._calls, kernel, grid, block, args, shared)
            self._launches[key] = launch
        launch(self._stream.ptr)

    def _eval_and_gram(self, n: int) -> None:
        """κ, ψ and loss at the trial β (residuals kept for the search), then the Gram."""
        ws = self._ws
        self._row_pass("rh_newton_eval", n, (ws.r,), ())

    def _row_pass(self, kernel: str, n: int, before_m: tuple, after: tuple) -> None:
        """One ``eval_rows`` kernel over the batch's rows, then ``C = Zᵀ[M]``.

        ``rh_newton_eval`` and ``rh_commit_eval`` share their row pass and
        their arguments but for the residuals (``before_m``, Newton only) and
        the status word (``after``, commit only).
        """
        ws = self._ws
        p = ws.p
        self._launch(
            (kernel, n),
            kernel,
            self._grid(n),
            layout.ROW_THREADS,
            (
                *(ws.Z, ws.ldz, n, p, ws.y, ws.w, ws.beta_work, ws.ctl, *before_m),
                *(ws.M, ws.ldm, ws.partials, *after),
            ),
            p * ws.item,
        )
        self._dense.gram_and_gradient(ws.Z, ws.ldz, ws.M, ws.ldm, ws.C, n, p)

    def _fused_solve_fits(self, p: int) -> bool:
        """Whether this p×p system goes through the fused one-block kernel.

        Sets the kernel's shared-memory limit, which must not happen during
        a graph capture.
        """
        if self._cholesky == "cusolver":
            return False
        if self._cholesky == "auto" and p > _FUSED_SOLVE_MAX_P:
            return False
        shared = (p * p + 2 * p) * self._ws.item
        fits = shared + 8 * 1024 <= self._kernels.max_shared and p <= 32 * layout.SOLVE_ROWS
        if not fits and self._cholesky == "kernel":
            raise ValidationError(
                f"cholesky='kernel' needs the {p}×{p} system in shared memory "
                f"({shared} bytes, the device allows {self._kernels.max_shared})"
            )
        if fits:
            self._kernels.allow_shared("rh_newton_solve", shared)
        return fits

    def _newton_step(self, n: int) -> None:
        ws = self._ws
        p = ws.p
        if self._small_solve:
            self._launch(
                ("solve",),
                "rh_newton_solve",
                1,
                layout.SMALL_THREADS,
                (ws.C, ws.J, ws.beta_work, ws.beta, p, ws.ctl, ws.H, ws.Hs, ws.g, ws.D),
                (p * p + 2 * p) * ws.item,
            )
        else:
            self._launch(
                ("assemble",),
                "rh_newton_assemble",
                1,
                layout.SMALL_THREADS,
                (ws.C, ws.J, ws.beta_work, ws.beta, p, ws.ctl, ws.H, ws.Hs, ws.g, ws.D),
            )
            self._dense.cholesky_solve(
                ws.H, ws.D, p, ws.int_ptr(layout.I_INFO), ws.int_ptr(layout.I_INFO_SOLVE)
            )
        self._newton_search(n, force=0)
        self._eval_and_gram(n)
        self._commit_finish()

    def _newton_search(self, n: int, force: int) -> None:
        ws = self._ws
        p = ws.p
        self._launch(
            ("search", n, force),
            "rh_newton_search",
            self._grid(n),
            layout.ROW_THREADS,
            (
                ws.Z,
                ws.ldz,
                n,
                p,
                ws.r,
                ws.w,
                ws.D,
                ws.g,
                ws.J,
                ws.H,
                ws.Hs,
                ws.ctl,
                ws.beta_work,
                ws.partials,
                ws.status_ptr,
                force,
            ),
            p * ws.item,
        )

    def _commit_finish(self) -> None:
        ws = self._ws
        self._launch(
            ("finish",),
            "rh_commit_finish",
            1,
            layout.SMALL_THREADS,
            (
                *(ws.C, ws.J, ws.beta_work, ws.beta, ws.p, ws.ctl, ws.beta),
                *(ws.status_ptr, ws.beta_host_ptr),
            ),
        )

    def _lamm_shape(self) -> tuple[int, int, int]:
        """Threads and dynamic shared memory of the LAMM kernels for this p.

        Sets the kernels' shared-memory limits, which must not happen during
        a graph capture.
        """
        ws, k = self._ws, self._kernels
        per_warp = ws.ldp * 8
        budget = k.max_shared - 8 * 1024 - ws.ldp * ws.item
        warps = max(1, min(layout.ROW_THREADS // 32, budget // per_warp))
        shared = warps * per_warp + ws.ldp * ws.item
        if shared > k.max_shared:
            raise ValidationError(
                f"penalty='l1' on the GPU engine supports up to about {k.max_shared // 8} "
                f"parameters; this stream has {ws.p}"
            )
        k.allow_shared("rh_lamm_eval", shared)
        trial_shared = layout.LAMM_ROUND * ws.ldp * ws.item
        if trial_shared + 8 * 1024 > k.max_shared:
            raise ValidationError(
                f"penalty='l1' on the GPU engine supports up to about "
                f"{(k.max_shared - 8 * 1024) // (layout.LAMM_ROUND * ws.item)} parameters"
            )
        k.allow_shared("rh_lamm_trials", trial_shared)
        return warps * 32, shared, trial_shared

    def _lamm_rounds(self, n: int, rounds: int, shape: tuple[int, int, int]) -> None:
        ws = self._ws
        p = ws.p
        threads, shared, trial_shared = shape
        for _ in range(rounds):
            self._launch(
                ("lamm_eval", n),
                "rh_lamm_eval",
                self._grid(n, threads // 32),
                threads,
                (
                    ws.Z,
                    ws.ldz,
                    n,
                    p,
                    ws.ldp,
                    ws.y,
                    ws.w,
                    ws.beta_work,
                    ws.beta,
                    ws.J,
                    ws.ctl,
                    ws.r,
                    ws.g,
                    ws.partials,
                ),
                shared,
            )
            self._launch(
                ("lamm_trials", n),
                "rh_lamm_trials",
                self._grid(n),
                layout.ROW_THREADS,
                (
                    ws.Z,
                    ws.ldz,
                    n,
                    p,
                    ws.ldp,
                    ws.r,
                    ws.w,
                    ws.g,
                    ws.J,
                    ws.ctl,
                    ws.beta_work,
                    ws.partials,
                    ws.status_ptr,
                ),
                trial_shared,
            )

    def _commit(self, n: int) -> None:
        """κ, loss and Gram at the final β, then the commit (no-ops until the solve is done)."""
        self._row_pass("rh_commit_eval", n, (), (self._ws.status_ptr,))
        self._commit_finish()

    def _run(self, key: tuple[Any, ...], body: Any) -> None:
        """Run a launch body: replay its captured graph, capturing it on first use."""
        if not self._graphs_enabled:
            body()
            return
        graph = self._graph_cache.get(key)
        if graph is None:
            graph = self._capture(body)
            if graph is None:
                body()
                return
            self._graph_cache[key] = graph
        graph.launch(self._stream.ptr)

    def _capture(self, body: Any) -> CapturedGraph | None:
        try:
            return CapturedGraph(self._cp, self._calls, self._stream, body)
        except Exception as exc:  # e.g. a library call that cannot be captured
            self._graphs_enabled = False
            self._graph_error = f"{type(exc).__name__}: {exc}"
            self._drop_graphs()
            return None

    def _drop_graphs(self) -> None:
        for graph in self._graph_cache.values():
            graph.close()
        self._graph_cache.clear()
        self._launches.clear()

    # -- helpers ---------------------------------------------------------------------------
    def _beta_on_host(self) -> np.ndarray:
        self._require_state()
        if self._host_beta is None:
            if self._closed:  # the mirror's pinned memory is freed
                raise RuntimeError("the GPU engine is closed")
            # The commit kernel mirrors β into host-mapped memory and the host
            # has synchronised since: reading it needs no CUDA call (the
            # distributed walk reads β after every batch).
            self._host_beta = self._ws.beta_host.copy()
        return self._host_beta


def _is_cuda(obj: Any) -> bool:
    from rh_dask.validation import is_device_array

    return obj is not None and is_device_array(obj)
