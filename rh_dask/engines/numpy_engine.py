"""The NumPy reference engine: the contract, exactly, and fast on a CPU.

Every product goes through BLAS (GEMV for residuals and gradients, SYRK for
the weighted Gram), every row-length temporary lives in a workspace that is
reused across iterations and batches, and float32 streams compute in float32.
"""

from __future__ import annotations

import functools
import time
import warnings
from collections.abc import Callable
from typing import Any, ClassVar, NamedTuple

import numpy as np
import scipy.linalg
import scipy.linalg.lapack

from ..config import HuberConfig
from ..core import (
    LAMM_MAX_TRIALS,
    LAMM_MIN_PHI,
    LAMM_SLACK,
    MIN_STEP,
    BatchSchedule,
    batch_schedule,
    linear_predictor,
    penalty_mask,
    singular_rtol,
    soft_threshold,
    step_converged,
)
from ..exceptions import EngineUnavailableError, NotFittedError, ValidationError
from ..residuals import outlier_share, residual_scale
from ..row_major import as_row_major
from ..state import BatchDiagnostics, HuberState
from ..validation import check_width
from .blas_threads import (
    blas_controller,
    blas_limit,
    blas_threads_in_force,
    resolve_blas_threads,
    side_by_side,
    side_chooser,
    side_executor,
)

__all__ = ["NumpyEngine", "solve_newton_system"]

#: Z of at least this many bytes is streamed once per LAMM iteration in row blocks
#: (measured on the dev box's 32 MiB L3: below it Z stays cached between GEMVs and
#: blocks only add call overhead; above it the blocked pass halved the time).
FUSED_MIN_BYTES = 20 << 20
#: The fused pass runs on the calling thread only, so it is taken only where the
#: engine's BLAS runs on one thread; with more, the GEMVs it replaces are threaded.
FUSED_ONE_THREAD_ONLY = True
#: Bytes of Z per row block of the fused pass (to stay in a core's L2 cache).
FUSED_BLOCK_BYTES = 384 << 10
#: The Gram gathers the rows with κ > 0 before its SYRK when the rows it drops,
#: times p, reach this many times the batch's rows: on the dev box (one BLAS
#: thread, p = 9-257, 20-50 % of rows dropped) the gather cost about one pass over
#: Z and the SYRK saved p² per dropped row, level near (dropped share) × p = 12.
GATHER_MIN_SAVING = 12
#: Bytes of Z per gathered row block (a fraction of a core's L2 cache).
GATHER_BLOCK_BYTES = 256 << 10
#: Gram products of at least this many multiply-adds (rows × p²) go to the side
#: thread beside the main one's work; smaller ones cost less than the hand-off.
SIDE_MIN_FLOPS = 1 << 22


def solve_newton_system(hessian: np.ndarray, gradient: np.ndarray) -> np.ndarray:
    """D = H⁻¹ g, see :func:`_solve_ladder`, with every BLAS pool on one thread.

    The p×p system is far too small to gain from threads, and NumPy and SciPy
    may each bundle their own OpenBLAS: waking SciPy's pool here would leave
    its threads spinning against NumPy's next Gram, which costs a wide stream
    several times its single-threaded time (docs/performance.md, NumPy
    engine).
    """
    with blas_controller().limit(limits=1, user_api="blas"):
        return _solve_ladder(hessian, gradient)


@functools.cache
def _cholesky_routines(dtype: np.dtype) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """LAPACK's Cholesky factorisation and solve (potrf, potrs) for ``dtype``."""
    return scipy.linalg.lapack.get_lapack_funcs(("potrf", "potrs"), dtype=dtype)


def gather_scaled_rows(
    Z: np.ndarray, keep: np.ndarray, weights: np.ndarray, out: np.ndarray
) -> np.ndarray:
    """``out[i] = weights[i] * Z[keep[i]]``, in row blocks of :data:`GATHER_BLOCK_BYTES`.

    Each gathered block is scaled while it is in the cache, and no temporary
    larger than a block is made. Returns ``out``.
    """
    rows, p = len(keep), Z.shape[1]
    step = max(64, GATHER_BLOCK_BYTES // (p * Z.itemsize))
    for start in range(0, rows, step):
        stop = min(start + step, rows)
        np.multiply(Z[keep[start:stop]], weights[start:stop, None], out=out[start:stop])
    return out


def _solve_ladder(hessian: np.ndarray, gradient: np.ndarray) -> np.ndarray:
    """D = H⁻¹ g through the ladder Cholesky → LU → minimum-norm SVD.

    A rung is taken only if its factorisation passes the scale-invariant
    singularity test of :func:`rh_dask.core.singular_rtol` and its solution is
    finite, so a singular system always ends in the finite minimum-norm
    least-squares solution.
    """
    p = gradient.shape[0]
    rtol = singular_rtol(hessian.dtype, p)
    diag = np.diagonal(hessian)
    # LAPACK's potrf/potrs directly: the routines scipy.linalg.cholesky and
    # cho_solve call, so the same bits, without their checks and wrappers, which
    # cost about 20x the factorisation of a p = 17 system (a Newton iteration's).
    potrf, potrs = _cholesky_routines(hessian.dtype)
    lower, info = potrf(hessian, lower=1, clean=1)
    # The rung's test: every squared pivot above rtol times its diagonal entry
    # (which must be positive).
    if info == 0 and (diag > 0).all():
        pivots = np.diagonal(lower).astype(np.float64) ** 2
        if (pivots / diag > rtol).all():
            direction, info = potrs(lower, gradient, lower=1)
            if info == 0 and np.isfinite(direction).all():
                return direction
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", scipy.linalg.LinAlgWarning)
        lu, piv = scipy.linalg.lu_factor(hessian, check_finite=False)
    u_diag = np.abs(np.diagonal(lu))
    scale = float(np.max(np.abs(diag))) if p else 0.0
    if scale > 0 and np.all(u_diag > rtol * scale):
        direction = scipy.linalg.lu_solve((lu, piv), gradient, check_finite=False)
        if np.all(np.isfinite(direction)):
            return direction
    u, sigma, vt = np.linalg.svd(hessian)
    cutoff = rtol * (sigma[0] if sigma.size else 0.0)
    inv = np.zeros_like(sigma)
    keep = sigma > cutoff
    inv[keep] = 1 / sigma[keep]
    return (vt.T * inv) @ (u.T @ gradient)


class _Workspace:
    """Row-length buffers reused across iterations and batches (grown on demand)."""

    def __init__(self, dtype: np.dtype) -> None:
        self.dtype = dtype
        self.rows = 0
        self.cols = 0
        self.scaled_k: np.ndarray | None = None

    def ensure(self, n: int, p: int, side: bool) -> None:
        if n <= self.rows and p == self.cols and (self.scaled_k is not None or not side):
            return
        rows = max(n, self.rows if p == self.cols else 0)
        dt = self.dtype
        self.design = np.empty((rows, p), dtype=dt)  # Z when an intercept is added
        self.scaled = np.empty((rows, p), dtype=dt)  # √(wκ) ⊙ Z for the Gram
        # K's scaled Z, its own when K's Gram runs on the side thread beside J's.
        self.scaled_k = np.empty((rows, p), dtype=dt) if side else None
        names = ("r", "psi", "over", "lo", "hi", "kappa", "zdir", "t1", "t2", "t3", "t4")
        names += ("zdir2", "r1", "r2", "psi1", "psi2")  # the fused LAMM pass's candidates
        for name in names:
            setattr(self, name, np.empty(rows, dtype=dt))
        self.active = np.empty(rows, dtype=bool)
        self.rows, self.cols = rows, p


class _Batch:
    """One batch's views into the workspace, and the contract's formulas on them."""

    def __init__(
        self,
        ws: _Workspace,
        X: np.ndarray,
        y: np.ndarray,
        w: np.ndarray | None,
        config: HuberConfig,
        state: HuberState,
        schedule: BatchSchedule,
        side: bool = False,
        blas_threads: int | None = 1,
    ) -> None:
        n, d = X.shape
        p = state.n_params
        dt = config.np_dtype
        side = side and n * p * p >= SIDE_MIN_FLOPS
        ws.ensure(n, p, side)
        #: Whether this batch's independent Gram products run side by side.
        self.side = side
        if config.fit_intercept:
            Z = ws.design[:n]
            Z[:, :d] = X
            Z[:, d] = 1
        else:
            Z = X
        self.Z, self.y, self.w = Z, y, w
        self.scaled = ws.scaled[:n]
        self.scaled_k = ws.scaled[:n] if ws.scaled_k is None else ws.scaled_k[:n]
        names = ("r", "psi", "over", "lo", "hi", "kappa", "zdir", "t1", "t2", "t3", "t4")
        for name in (*names, "active"):
            setattr(self, name, getattr(ws, name)[:n])
        self.cand_zdir = [ws.zdir[:n], ws.zdir2[:n]]
        self.cand_r = [ws.r1[:n], ws.r2[:n]]
        self.cand_psi = [ws.psi1[:n], ws.psi2[:n]]
        # Z too large for the cache: the LAMM trials stream it once per iteration in
        # row blocks (see _Batch.trial_pass); smaller Z stays cached between GEMVs.
        # float64 only: in float32 the blocked products' other rounding moves β's last
        # bits, which κ's steep ramp (width 2h) carries into J beyond the contract's float32
        # tolerance against the per-trial GEMVs (seen with numpy 1.26's OpenBLAS).
        # One BLAS thread only: the blocks' small products run on this thread alone.
        # ``blas_threads`` None is the count in force, read only where the rest holds
        # (about 40 µs).
        self.fused = (
            Z.dtype == np.float64
            and Z.nbytes >= FUSED_MIN_BYTES
            and (not FUSED_ONE_THREAD_ONLY or (blas_threads or blas_threads_in_force()) == 1)
        )
        self.block_rows = max(64, FUSED_BLOCK_BYTES // (p * dt.itemsize))
        self.tau = dt.type(config.tau)
        self.half_inv_h = dt.type(0.5 / schedule.bandwidth)
        self.total = schedule.total_weight
        self.inv_total = dt.type(1.0 / schedule.total_weight)
        self.beta0 = state.coefficients
        self.J = state.information
        mask = penalty_mask(state.n_features_in, state.fit_intercept, dt)
        self.mask = mask
        self.history = dt.type(schedule.history_scale)
        self.sign0 = np.sign(self.beta0) * mask if schedule.history_scale else None

    # -- per-iterate quantities -------------------------------------------------
    def evaluate(self, beta: np.ndarray) -> None:
        """r = y − Zβ, ψ = clip(r, ±τ), o = r − ψ and the remainder bounds."""
        r = self.r
        np.matmul(self.Z, beta, out=r)
        np.subtract(self.y, r, out=r)
        self._clip_residuals()

    def shift(self, zdir: np.ndarray, scale: float = 1.0) -> None:
        """:meth:`evaluate` at β + scale · e from the residuals at β and zdir = Z e (no GEMV)."""
        if scale == 1.0:
            self.r -= zdir
        else:
            self.r -= np.multiply(zdir, scale, out=self.t1)
        self._clip_residuals()

    def take(self, j: int) -> None:
        """:meth:`evaluate` at the fused pass's candidate ``j`` (its r and ψ, swapped in)."""
        self.r, self.cand_r[j] = self.cand_r[j], self.r
        self.psi, self.cand_psi[j] = self.cand_psi[j], self.psi
        self._bounds()

    def _clip_residuals(self) -> None:
        np.clip(self.r, -self.tau, self.tau, out=self.psi)
        self._bounds()

    def _bounds(self) -> None:
        psi = self.psi
        np.subtract(self.r, psi, out=self.over)
        np.subtract(-self.tau, psi, out=self.lo)
        np.subtract(self.tau, psi, out=self.hi)

    def trial_pass(self, steps: list[np.ndarray]) -> list[np.ndarray]:
        """Z e, r − Z e, ψ(r − Z e) and Zᵀ(w ⊙ ψ(r − Z e)) for each step e, in one pass over Z.

        Z is read in row blocks that stay in the cache while every step's
        products are taken from them: one trip through memory where a GEMV per
        step and a gradient GEMV would take one each. The products go to
        ``cand_zdir``, ``cand_r`` and ``cand_psi`` (index = position in
        ``steps``); the return value is each step's data term Zᵀ(w ⊙ ψ).
        """
        Z, r, w, tau = self.Z, self.r, self.w, self.tau
        n, p = Z.shape
        data = [np.zeros(p, dtype=Z.dtype) for _ in steps]
        block = self.block_rows
        for start in range(0, n, block):
            stop = min(start + block, n)
            zb, rb = Z[start:stop], r[start:stop]
            for j, e in enumerate(steps):
                zd = self.cand_zdir[j][start:stop]
                rj = self.cand_r[j][start:stop]
                pj = self.cand_psi[j][start:stop]
                np.matmul(zb, e, out=zd)
                np.subtract(rb, zd, out=rj)
                np.clip(rj, -tau, tau, out=pj)
                if w is not None:
                    pj = np.multiply(w[start:stop], pj, out=self.t2[start:stop])
                data[j] += pj @ zb
        return data

    def weighted_sum(self, v: np.ndarray) -> float:
        return float(v.sum() if self.w is None else np.dot(self.w, v))

    def gradient(self, beta: np.ndarray, data: np.ndarray | None = None) -> np.ndarray:
        """g(β) = [−Zᵀ(w ⊙ ψ) + J Δ] / N − (W/N) λ_{b−1} s (``data``: Zᵀ(w ⊙ ψ) if known)."""
        if data is None:
            wpsi = self.psi if self.w is None else np.multiply(self.w, self.psi, out=self.t1)
            data = self.Z.T @ wpsi
        g = self.J @ (beta - self.beta0) - data
        g *= self.inv_total
        if self.sign0 is not None:
            g -= self.history * self.sign0
        return g

    def gram(self) -> np.ndarray:
        """Zᵀ diag(w ⊙ κ(r)) Z through SYRK on √(wκ) ⊙ Z."""
        k = self.kappa
        np.abs(self.r, out=k)
        np.subtract(self.tau, k, out=k)
        np.multiply(k, self.half_inv_h, out=k)
        k += 0.5
        np.clip(k, 0, 1, out=k)
        if self.w is not None:
            k *= self.w
        np.sqrt(k, out=k)
        # Rows beyond τ + h have κ = 0 and add nothing. Gathering the others before
        # the O(n p²) SYRK costs a pass over Z and saves p² per dropped row, so it
        # pays once the dropped rows times p pass GATHER_MIN_SAVING rows (see there).
        active = np.greater(k, 0, out=self.active)
        rows = int(np.count_nonzero(active))
        n, p = self.Z.shape
        if (n - rows) * p >= GATHER_MIN_SAVING * n:
            keep = np.flatnonzero(active)
            weights = np.take(k, keep, out=self.t2[:rows])
            scaled = gather_scaled_rows(self.Z, keep, weights, self.scaled[:rows])
        else:
            scaled = self.scaled
            np.multiply(self.Z, k[:, None], out=scaled)
        return scaled.T @ scaled

    def score_gram(self) -> np.ndarray:
        """Zᵀ diag(w ⊙ ψ(r)²) Z through SYRK on (√w ⊙ |ψ|) ⊙ Z, at the evaluated r.

        Its buffers are its own, so that it may run beside :meth:`gram` and
        :meth:`loss`.
        """
        s = np.abs(self.psi, out=self.t3)
        if self.w is not None:
            s *= np.sqrt(self.w, out=self.t4)
        scaled = self.scaled_k
        np.multiply(self.Z, s[:, None], out=scaled)
        return scaled.T @ scaled

    def loss(self) -> float:
        """Σ w ρ(r) with ρ(r) = ψ (r − ψ/2)."""
        t = self.t1
        np.multiply(self.psi, 0.5, out=t)
        np.subtract(self.r, t, out=t)
        t *= self.psi
        return self.weighted_sum(t)

    def remainder(self, zdir: np.ndarray, scale: float) -> float:
        """Σ w R_i for residual changes δ = scale · zdir (see rh_dask.core)."""
        dp, u = self.t1, self.t2
        if scale == -1.0:
            np.subtract(self.over, zdir, out=dp)
        else:
            np.multiply(zdir, scale, out=dp)
            dp += self.over
        np.clip(dp, self.lo, self.hi, out=u)
        np.multiply(u, 0.5, out=self.kappa)  # κ is not needed again before gram()
        np.subtract(dp, self.kappa, out=dp)
        return self.weighted_sum(np.multiply(u, dp, out=u))

    def robust_diagnostics(self, batch_weight: float) -> tuple[float, float, float]:
        """Mean Huber loss, share of rows with |r| > τ and 1.4826 × MAD at the evaluated r."""
        mean_loss = self.loss() / batch_weight
        share = outlier_share(self.r, float(self.tau), self.w)
        return mean_loss, share, residual_scale(self.r, self.w)

    def objective(self, beta: np.ndarray) -> float:
        """F(β) at the evaluated iterate (without the L1 norm)."""
        delta = beta - self.beta0
        value = (self.loss() + 0.5 * float(delta @ self.J @ delta)) / self.total
        if self.sign0 is not None:
            value -= float(self.history) * float(delta @ self.sign0)
        return value


class NumpyEngine:
    """Reference engine on the CPU (NumPy + LAPACK through SciPy).

    Parameters
    ----------
    config : HuberConfig
        Statistical and solver parameters of the stream.
    device : None or "cpu"
        Accepted for interface symmetry; any other device is refused.
    blas_threads : int or "auto", default "auto"
        BLAS threads of the engine's own calls (``rh-dask.numpy.blas-threads``,
        see :mod:`rh_dask.engines.blas_threads`): a count, or ``"auto"``, the
        measured rule. The count is set on entry to each call and the one in
        force before it restored on exit.

    Raises
    ------
    EngineUnavailableError
        When ``device`` is not the CPU.
    ValidationError
        When ``blas_threads`` is neither ``"auto"`` nor a whole number >= 1.
    """

    name: ClassVar[str] = "numpy"
    accepts_device_arrays: ClassVar[bool] = False

    def __init__(
        self, config: HuberConfig, device: str | None = None, blas_threads: int | str = "auto"
    ) -> None:
        if device not in (None, "cpu"):
            raise EngineUnavailableError(
                f"the numpy engine runs on the CPU only; device={device!r} is not supported"
            )
        self.config = config
        self.blas_threads = resolve_blas_threads(blas_threads)
        # "auto" on one BLAS thread with a second core: independent products side by side.
        self._side = side_by_side(blas_threads)
        self._state: HuberState | None = None
        self._ws = _Workspace(config.np_dtype)

    # -- interface ----------------------------------------------------------------
    @property
    def device(self) -> str:
        return "cpu"

    @property
    def n_features_in(self) -> int | None:
        return None if self._state is None else self._state.n_features_in

    @property
    def batch_count(self) -> int:
        return 0 if self._state is None else self._state.batch_count

    @property
    def n_samples_seen(self) -> int:
        return 0 if self._state is None else self._state.n_samples_seen

    def reset(self) -> None:
        self._state = None

    def coefficients(self) -> np.ndarray:
        return self._require_state().coefficients.copy()

    def export_state(self) -> HuberState:
        return self._require_state().copy()

    def import_state(self, state: HuberState) -> None:
        self._state = state.for_engine(self.config.fit_intercept, self.config.np_dtype)

    def predict(self, X: Any) -> np.ndarray:
        state = self._require_state()
        X = np.asarray(X)
        check_width(X, state.n_features_in)
        with blas_limit(self.blas_threads):
            return linear_predictor(X, state.coefficients, state.fit_intercept)

    def partial_fit(self, X: Any, y: Any, sample_weight: Any | None = None) -> BatchDiagnostics:
        with blas_limit(self.blas_threads):
            return self._partial_fit(X, y, sample_weight)

    def _partial_fit(self, X: Any, y: Any, sample_weight: Any | None) -> BatchDiagnostics:
        cfg = self.config
        dt = cfg.np_dtype
        X, y, w = self._check_batch(X, y, sample_weight)
        n, d = X.shape
        state = self._state
        if state is None:
            state = HuberState.empty(d, cfg.fit_intercept, dt)
        batch_weight = float(n) if w is None else float(np.sum(w, dtype=np.float64))
        schedule = batch_schedule(cfg, state, batch_weight)
        # Side by side or alone: the faster for this shape class lately (either way
        # the same bits). The class: dtype, p and the batch's rows to a power of 2.
        side_class = (dt.str, d, cfg.fit_intercept, n.bit_length())
        side = self._side and side_chooser().choose(side_class)
        batch = _Batch(
            self._ws, X, y, w, cfg, state, schedule, side=side, blas_threads=self.blas_threads
        )
        if cfg.penalised:
            beta, iterations, converged = _solve_lamm(batch, cfg, schedule)
        else:
            # Under a one-thread limit already, the p×p solve needs no limit of its own.
            solve = _solve_ladder if self.blas_threads == 1 else solve_newton_system
            beta, iterations, converged = _solve_newton(batch, cfg, solve)
        # Commit: r, κ, ψ and both Grams at the final β_b. K is accumulated only
        # while the stream has it (a state imported without K continues without).
        batch.evaluate(beta)
        objective = batch.objective(beta)
        if cfg.penalised:
            objective += schedule.lambda_value * float(np.abs(beta * batch.mask).sum())
        start = time.perf_counter()
        with _Beside(
            batch.score_gram if state.score_variance is not None else None, batch.side
        ) as k:
            information = state.information + batch.gram()
            mean_loss, share, scale = batch.robust_diagnostics(batch_weight)
        if self._side and n * state.n_params**2 >= SIDE_MIN_FLOPS:
            side_chooser().record(side_class, batch.side, time.perf_counter() - start)
        score_variance = None if k.value is None else state.score_variance + k.value
        self._state = HuberState(
            coefficients=beta,
            information=information,
            n_samples_seen=state.n_samples_seen + n,
            batch_count=state.batch_count + 1,
            previous_lambda=schedule.lambda_value,
            weight_sum=schedule.total_weight,
            n_features_in=d,
            fit_intercept=cfg.fit_intercept,
            score_variance=score_variance,
        )
        return BatchDiagnostics(
            iterations=iterations,
            converged=converged,
            objective=float(objective),
            lambda_value=float(schedule.lambda_value),
            bandwidth=float(schedule.bandwidth),
            mean_loss=mean_loss,
            outlier_share=share,
            residual_scale=scale,
        )

    # -- helpers -----------------------------------------------------------------
    def _require_state(self) -> HuberState:
        if self._state is None:
            raise NotFittedError("the engine has consumed no batch yet")
        return self._state

    def _check_batch(
        self, X: Any, y: Any, w: Any | None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """Structural checks only: the estimator validated the values already."""
        dt = self.config.np_dtype
        if not all(isinstance(a, np.ndarray) for a in (X, y)) or (
            w is not None and not isinstance(w, np.ndarray)
        ):
            raise ValidationError("the numpy engine takes NumPy arrays (validate the batch first)")
        check_width(X, self.n_features_in)
        n = X.shape[0]
        if n < 1:
            raise ValidationError("a batch needs at least one row")
        if y.shape != (n,) or (w is not None and w.shape != (n,)):
            raise ValidationError(f"y and sample_weight must have shape ({n},)")
        for name, arr in (("X", X), ("y", y), ("sample_weight", w)):
            if arr is not None and arr.dtype != dt:
                raise ValidationError(f"{name} has dtype {arr.dtype}, the engine computes in {dt}")
        if w is not None and not np.sum(w, dtype=np.float64) > 0:
            raise ValidationError("sample_weight must have a positive sum")
        return as_row_major(X), y, w


class _Beside:
    """Run ``fn`` on the side thread (``side``) or on entry, while the block runs.

    ``value`` is its result after the block (``None`` when ``fn`` is). The
    block's own work and ``fn`` must share no buffer. Exit waits for ``fn``
    whatever happened in the block, so the workspace is never left in use;
    an error of ``fn`` is raised there unless the block raised first.
    """

    def __init__(self, fn: Callable[[], Any] | None, side: bool) -> None:
        self.fn, self.side = fn, side
        self.value: Any = None
        self._job: Any = None

    def __enter__(self) -> _Beside:
        if self.fn is not None:
            if self.side:
                self._job = side_executor().submit(self.fn)
            else:
                self.value = self.fn()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if self._job is not None:
            try:
                self.value = self._job.result()
            except BaseException:
                if exc_type is None:
                    raise


def _solve_newton(
    batch: _Batch,
    cfg: HuberConfig,
    solve: Callable[[np.ndarray, np.ndarray], np.ndarray] = solve_newton_system,
) -> tuple[np.ndarray, int, bool]:
    """Damped Newton with monotone backtracking (contract, unpenalised).

    ``solve(H, g)`` is the Newton system's solver, always on one BLAS thread.
    """
    beta = batch.beta0.copy()
    J = batch.J
    p = beta.shape[0]
    ridge = batch.inv_total.dtype.type(cfg.ridge)
    converged = False
    iterations = 0
    batch.evaluate(beta)
    for iterations in range(1, cfg.max_iter + 1):  # noqa: B007 - the count is reported
        g = batch.gradient(beta)
        H = batch.gram()
        H += J
        H *= batch.inv_total
        H.flat[:: p + 1] += ridge
        D = solve(H, g).astype(beta.dtype, copy=False)
        np.matmul(batch.Z, D, out=batch.zdir)
        slope = float(g @ D)
        curvature = float(D @ J @ D)
        t = 1.0
        accepted = False
        while True:
            # F(β − tD) − F(β) in the difference form of rh_dask.core.
            change = -t * slope + (batch.remainder(batch.zdir, t) + 0.5 * t * t * curvature) / (
                batch.total
            )
            if not change > 0:
                accepted = True
                break
            t /= 2
            if t < MIN_STEP:
                break
        if not accepted:
            break
        new = beta - beta.dtype.type(t) * D
        step = float(np.linalg.norm(new - beta))
        beta = new
        if step_converged(step, float(np.linalg.norm(beta)), cfg.tol):
            converged = True
            break
        # r(β − tD) = r(β) + t Z D from the line search's Z D: no GEMV for the next
        # iterate. The commit evaluates y − Zβ afresh, so no drift reaches the state.
        batch.shift(batch.zdir, -t)
    return beta, iterations, converged


class _Trial(NamedTuple):
    """One LAMM trial: the candidate c, its step e = c − β, ½ eᵀJe and φ/2 ‖e‖² + slack."""

    point: np.ndarray
    step: np.ndarray
    quad: float
    allowance: float


def _solve_lamm(
    batch: _Batch, cfg: HuberConfig, schedule: BatchSchedule
) -> tuple[np.ndarray, int, bool]:
    """Proximal gradient with a local majorisation (contract, L1).

    The trials of an iteration are the contract's, in its order (φ, 2φ, 4φ, ...,
    the first that passes is taken). A trial whose quadratic term alone,
    ½ eᵀJe / N, exceeds the majorisation's allowance fails without Z e: the
    Huber remainder it would add is a sum of non-negative terms, so the test's
    left side can only be larger (see :func:`_fails_on_information`). When Z is
    too large for the cache (``batch.fused``), the first one or two trials'
    Z e and the gradient each would need next are computed in one pass over Z
    (:meth:`_Batch.trial_pass`): two trials when the previous iteration needed
    more than one product (the usual steady state, φ/2 failing after an
    accepted φ), else one.
    """
    beta = batch.beta0.copy()
    J = batch.J
    dt = beta.dtype.type
    lam_mask = batch.mask * dt(schedule.lambda_value)
    phi = 1.0
    converged = False
    iterations = 0
    batch.evaluate(beta)
    g = batch.gradient(beta)
    ahead = 2  # trials evaluated together by the fused pass (first iteration: φ = 1 is small)

    def candidate(phi: float) -> _Trial:
        inv_phi = dt(1.0 / phi)
        c = soft_threshold(beta - g * inv_phi, lam_mask * inv_phi)
        e = c - beta
        return _Trial(c, e, 0.5 * float(e @ J @ e), 0.5 * phi * float(e @ e) + LAMM_SLACK)

    def passes(trial: _Trial, zdir: np.ndarray) -> bool:
        # F(c) − F(β) − gᵀe ≤ φ/2 ‖e‖² (+ slack), with δ = −Z e.
        return (batch.remainder(zdir, -1.0) + trial.quad) / batch.total <= trial.allowance

    for iterations in range(1, cfg.max_iter + 1):  # noqa: B007 - the count is reported
        accepted = False
        taken = -1  # the fused candidate accepted, -1: none (or no fused pass)
        trials = products = 0
        trial = candidate(phi)
        if batch.fused:
            # The pass starts at the first trial the information alone does not fail.
            while trials < LAMM_MAX_TRIALS - 1 and _fails_on_information(trial, batch.total):
                trials += 1
                phi *= 2.0
                trial = candidate(phi)
            pending = [trial] + [candidate(phi * 2.0**j) for j in range(1, ahead)]
            pending = pending[: LAMM_MAX_TRIALS - trials]
            data = batch.trial_pass([t.step for t in pending])
            for j, trial in enumerate(pending):
                trials += 1
                products += 1
                if passes(trial, batch.cand_zdir[j]):
                    accepted, taken = True, j
                    break
                phi *= 2.0
            if not accepted and trials < LAMM_MAX_TRIALS:
                trial = candidate(phi)
        while not accepted and trials < LAMM_MAX_TRIALS:
            trials += 1
            if not _fails_on_information(trial, batch.total):
                products += 1
                np.matmul(batch.Z, trial.step, out=batch.zdir)
                if passes(trial, batch.zdir):
                    accepted = True
                    break
            phi *= 2.0
            if trials < LAMM_MAX_TRIALS:
                trial = candidate(phi)
        if not accepted:
            break
        step = float(np.linalg.norm(trial.step))
        beta = trial.point
        phi = max(phi / 2.0, LAMM_MIN_PHI)
        if step_converged(step, float(np.linalg.norm(beta)), cfg.tol):
            converged = True
            break
        # r(β + e) = r(β) − Z e, with Z e from the accepted trial: no GEMV for the next
        # iterate. The commit evaluates y − Zβ afresh, so no drift reaches the state.
        if taken >= 0:
            batch.take(taken)
            g = batch.gradient(beta, data[taken])
        else:
            batch.shift(batch.zdir)
            g = batch.gradient(beta)
        ahead = 2 if products > 1 else 1
    return beta, iterations, converged


def _fails_on_information(trial: _Trial, total: float) -> bool:
    """Whether a LAMM trial fails the majorisation test whatever its Z e.

    The test is ``(R + q) / N <= a`` with q = ½ eᵀJe, a the allowance and R the
    Huber remainder Σ w [ρ(r − δ) − ρ(r) + ψ(r) δ], which :meth:`_Batch.remainder`
    computes as a sum of terms u (δ' − u/2) whose two factors share a sign, so
    R ≥ 0 in floating point too. Rounding is monotone, so (R + q) / N ≥ q / N
    as computed, and q / N > a decides the test exactly as the full evaluation
    would, without the O(n p) product.
    """
    return trial.quad / total > trial.allowance
