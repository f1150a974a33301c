"""The NumPy reference engine: the contract, exactly, and fast on a CPU.

Every product goes through BLAS (GEMV for residuals and gradients, SYRK for
the weighted Gram) on one BLAS thread, in fixed row blocks that run on as many
threads as is fastest (:mod:`rh_dask.engines.row_blocks`: the same bits on any
number); every row-length temporary lives in a workspace that is reused across
iterations and batches, and float32 streams compute in float32.
"""

from __future__ import annotations

import functools
import time
import warnings
from collections.abc import Callable
from typing import Any, ClassVar, NamedTuple, TypeVar

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
    sum_weights,
)
from ..exceptions import EngineUnavailableError, NotFittedError, ValidationError
from ..residuals import outlier_share, residual_scale
from ..row_major import as_row_major
from ..state import BatchDiagnostics, HuberState
from ..validation import check_width
from .blas_threads import (
    ProcessIdle,
    last_level_cache_bytes,
    one_blas_thread,
    resolve_blas_threads,
)
from .row_blocks import row_blocks, run_tasks, thread_chooser, thread_counts

__all__ = ["NumpyEngine", "solve_newton_system"]

T = TypeVar("T")

#: Z of at least this share of the host's last-level cache is streamed once per LAMM
#: iteration in row blocks. On the dev box (32 MiB L3) the blocked pass halved the time
#: above 20 MiB of Z and below it only added call overhead, as Z stayed cached between
#: GEMVs; on a 16-core host with 300 MiB of L3, 24 MB batches of Z (reference, float64)
#: took 1.3x longer fused than not (benchmarks/results/gemv_probe-h100-16-cores.json).
FUSED_CACHE_SHARE = 0.625
#: The threshold in bytes of Z where the host does not say its cache size.
FUSED_FALLBACK_BYTES = 20 << 20
#: A fixed threshold in bytes of Z in place of the cache's share (tests, probes).
FUSED_MIN_BYTES: int | None = None
#: Bytes of Z per row block of the fused pass (to stay in a core's L2 cache).
FUSED_BLOCK_BYTES = 384 << 10
#: The Gram gathers the rows with κ > 0 before its SYRK when the rows it drops,
#: times p, reach this many times the batch's rows: on the dev box (one BLAS
#: thread, p = 9-257, 20-50 % of rows dropped) the gather cost about one pass over
#: Z and the SYRK saved p² per dropped row, level near (dropped share) × p = 12.
GATHER_MIN_SAVING = 12
#: Bytes of Z per gathered row block (a fraction of a core's L2 cache).
GATHER_BLOCK_BYTES = 256 << 10
#: The most a calibration waits for the process's other threads to go quiet (see
#: :func:`_calibrate`).
CALIBRATION_SETTLE_SECONDS = 0.3

#: Rounds of the matrix-vector products' calibration (each: every count, in an order
#: and its reverse). A GEMV takes 0.1-3 ms on the sweep's shapes, so a round costs little
#: and one sample per direction is too few to rank counts apart by 10 %.
GEMV_CALIBRATION_ROUNDS = 3


def solve_newton_system(hessian: np.ndarray, gradient: np.ndarray) -> np.ndarray:
    """D = H⁻¹ g for a symmetric H, see :func:`_solve_ladder`, with every BLAS pool on
    one thread.

    The p×p system is far too small to gain from threads, and NumPy and SciPy
    may each bundle their own OpenBLAS: waking SciPy's pool here would leave
    its threads spinning against NumPy's next Gram, which costs a wide stream
    several times its single-threaded time (docs/performance.md, NumPy
    engine).
    """
    with one_blas_thread():
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
    """D = H⁻¹ g through the ladder Cholesky → LU → minimum norm (eigendecomposition).

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
    # The minimum-norm solution through the symmetric eigendecomposition H = V Λ Vᵀ
    # (H is a Gram plus J; its lower triangle is read): its singular values are |λ|,
    # so H⁺ = V Λ⁺ Vᵀ with the SVD's cut-off on |λ|, as the GPU engine solves it.
    # LAPACK's syevd took 4.7x less than NumPy's SVD at p = 1025 in float32 and 2.5x
    # in float64 (dev box, one BLAS thread: 65 against 304 ms, 101 against 257), and
    # a float32 wide stream's first batch may take this rung in most iterations.
    lam, vecs = scipy.linalg.eigh(hessian, driver="evd", check_finite=False)
    size = np.abs(lam)
    cutoff = rtol * (float(size.max()) if size.size else 0.0)
    inv = np.zeros_like(lam)
    keep = size > cutoff
    inv[keep] = 1 / lam[keep]
    return vecs @ (inv * (vecs.T @ gradient))


class _Workspace:
    """Row-length buffers reused across iterations and batches (grown on demand)."""

    def __init__(self, dtype: np.dtype) -> None:
        self.dtype = dtype
        self.rows = 0
        self.cols = 0

    def scaled_k_for(self, n: int) -> np.ndarray:
        """K's scaled Z for ``n`` rows, made at first use (K's Gram beside J's on threads)."""
        if self.scaled_k is None:
            self.scaled_k = np.empty_like(self.scaled)
        return self.scaled_k[:n]

    def ensure(self, n: int, p: int) -> None:
        if n <= self.rows and p == self.cols:
            return
        rows = max(n, self.rows if p == self.cols else 0)
        dt = self.dtype
        self.design = np.empty((rows, p), dtype=dt)  # Z when an intercept is added
        self.scaled = np.empty((rows, p), dtype=dt)  # √(wκ) ⊙ Z for J's Gram
        self.scaled_k: np.ndarray | None = None  # √w |ψ| ⊙ Z for K's, made at first use
        names = ("r", "psi", "over", "lo", "hi", "kappa", "zdir", "t1", "t2", "t3", "t4")
        names += ("zdir2", "r1", "r2", "psi1", "psi2")  # the fused LAMM pass's candidates
        for name in names:
            setattr(self, name, np.empty(rows, dtype=dt))
        self.active = np.empty(rows, dtype=bool)
        self.rows, self.cols = rows, p


def _fused_min_bytes() -> int:
    """Bytes of Z from which the LAMM trials take the fused pass on this host."""
    if FUSED_MIN_BYTES is not None:
        return FUSED_MIN_BYTES
    cache = last_level_cache_bytes()
    return FUSED_FALLBACK_BYTES if cache is None else int(FUSED_CACHE_SHARE * cache)


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
        threads: int = 1,
    ) -> None:
        n, d = X.shape
        p = state.n_params
        dt = config.np_dtype
        ws.ensure(n, p)
        #: Threads that run the row blocks of this batch's Grams.
        self.threads = threads
        #: Threads of its matrix-vector products (Z v and Zᵀ u of the LAMM, Z D of the
        #: line search): memory-bound, and cheap enough that a pool's hand-over can cost
        #: more than a second thread saves, so their count is measured on its own.
        self.gemv_threads = threads
        #: ``(chooser, key)`` to which each Z v reports its time, or None.
        self.gemv_timer: tuple[Any, Any] | None = None
        if config.fit_intercept:
            Z = ws.design[:n]
            Z[:, :d] = X
            Z[:, d] = 1
        else:
            Z = X
        self.Z, self.y, self.w = Z, y, w
        self.scaled = ws.scaled[:n]
        self.ws = ws
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
        self.fused = Z.dtype == np.float64 and Z.nbytes >= _fused_min_bytes()
        self.block_rows = max(64, FUSED_BLOCK_BYTES // (p * dt.itemsize))
        self.tau = dt.type(config.tau)
        self.neg_tau = -self.tau
        self.half_inv_h = dt.type(0.5 / schedule.bandwidth)
        self.total = schedule.total_weight
        self.inv_total = dt.type(1.0 / schedule.total_weight)
        self.beta0 = state.coefficients
        self.J = state.information
        mask = penalty_mask(state.n_features_in, state.fit_intercept, dt)
        self.mask = mask
        self.history = dt.type(schedule.history_scale)
        self.sign0 = np.sign(self.beta0) * mask if schedule.history_scale else None

    # -- products over the rows, in fixed blocks (rh_dask.engines.row_blocks) -----
    def run(self, tasks: list[Callable[[], Any]]) -> list[Any]:
        """The tasks' results in task order, on the batch's thread count."""
        return run_tasks(tasks, self.threads)

    def blocks(self, rows: int, fn: Callable[[int, int], Any]) -> list[Callable[[], Any]]:
        """``fn(start, stop)`` for each row block of a ``rows``-row operand, as tasks."""
        blocks = row_blocks(rows, self.Z.shape[1], self.Z.itemsize)
        return [functools.partial(fn, a, b) for a, b in blocks]

    def over_blocks(self, rows: int, fn: Callable[[int, int], T], count: int) -> list[T]:
        """``fn(start, stop)`` for each row block, results in block order, on ``count``
        threads; on one, the blocks in turn as :func:`run_tasks` would take them, without
        making tasks (an iteration's products on small batches are that cheap)."""
        if count == 1:
            return [fn(a, b) for a, b in row_blocks(rows, self.Z.shape[1], self.Z.itemsize)]
        return run_tasks(self.blocks(rows, fn), count)

    def matvec(self, v: np.ndarray, out: np.ndarray) -> np.ndarray:
        """``out = Z v``, a GEMV per row block, on :attr:`gemv_threads`."""
        Z = self.Z

        def block(a: int, b: int) -> None:
            np.matmul(Z[a:b], v, out=out[a:b])

        count = self.gemv_threads
        start = time.perf_counter()
        self.over_blocks(len(out), block, count)
        if self.gemv_timer is not None:
            chooser, key = self.gemv_timer
            chooser.record(key, count, time.perf_counter() - start)
        return out

    def _rmatvec_block(self, u: np.ndarray) -> Callable[[int, int], np.ndarray]:
        """``Zᵀ u`` over one row block, a GEMV (the blocks' sum in order is the product)."""
        Z = self.Z
        return lambda a, b: Z[a:b].T @ u[a:b]

    def scaled_gram_tasks(
        self, factor: np.ndarray, scaled: np.ndarray
    ) -> list[Callable[[], np.ndarray]]:
        """Tasks of Zᵀ diag(factor²) Z: a SYRK on factor ⊙ Z per row block, in ``scaled``."""
        Z = self.Z

        def block(a: int, b: int) -> np.ndarray:
            s = np.multiply(Z[a:b], factor[a:b, None], out=scaled[a:b])
            return s.T @ s

        return self.blocks(len(factor), block)

    # -- per-iterate quantities -------------------------------------------------
    def evaluate(self, beta: np.ndarray) -> None:
        """r = y − Zβ, ψ = clip(r, ±τ), o = r − ψ and the remainder bounds."""
        r = self.matvec(beta, self.r)
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
        self.r.clip(self.neg_tau, self.tau, out=self.psi)  # the method: fewer Python calls
        self._bounds()

    def _bounds(self) -> None:
        psi = self.psi
        np.subtract(self.r, psi, out=self.over)
        np.subtract(self.neg_tau, psi, out=self.lo)
        np.subtract(self.tau, psi, out=self.hi)

    def trial_pass(self, steps: list[np.ndarray]) -> list[np.ndarray]:
        """Z e, r − Z e, ψ(r − Z e) and Zᵀ(w ⊙ ψ(r − Z e)) for each step e, in one pass over Z.

        Z is read in small blocks that stay in the cache while every step's
        products are taken from them: one trip through memory where a GEMV per
        step and a gradient GEMV would take one each. The products go to
        ``cand_zdir``, ``cand_r`` and ``cand_psi`` (index = position in
        ``steps``); the return value is each step's data term Zᵀ(w ⊙ ψ), summed
        per row block of :meth:`blocks` and then in block order.
        """
        Z, r, w, tau, neg_tau = self.Z, self.r, self.w, self.tau, self.neg_tau
        p = Z.shape[1]
        small = self.block_rows

        def block(a: int, b: int) -> list[np.ndarray]:
            data = [np.zeros(p, dtype=Z.dtype) for _ in steps]
            for start in range(a, b, small):
                stop = min(start + small, b)
                zb, rb = Z[start:stop], r[start:stop]
                for j, e in enumerate(steps):
                    zd = self.cand_zdir[j][start:stop]
                    rj = self.cand_r[j][start:stop]
                    pj = self.cand_psi[j][start:stop]
                    np.matmul(zb, e, out=zd)
                    np.subtract(rb, zd, out=rj)
                    np.clip(rj, neg_tau, tau, out=pj)
                    if w is not None:
                        pj = np.multiply(w[start:stop], pj, out=self.t2[start:stop])
                    data[j] += pj @ zb
            return data

        # On one thread at any count: the small blocks' Python steps hold the GIL, and
        # on two threads the pass took 1.6x its time on one (dev box).
        parts = self.over_blocks(len(r), block, 1)
        return [_sum_in_order([part[j] for part in parts]) for j in range(len(steps))]

    def weighted_sum(self, v: np.ndarray) -> float:
        return float(v.sum() if self.w is None else np.dot(self.w, v))

    def gradient(self, beta: np.ndarray, data: np.ndarray | None = None) -> np.ndarray:
        """g(β) = [−Zᵀ(w ⊙ ψ) + J Δ] / N − (W/N) λ_{b−1} s (``data``: Zᵀ(w ⊙ ψ) if known)."""
        if data is None:
            u = self._weighted_psi()
            data = _sum_in_order(
                self.over_blocks(len(u), self._rmatvec_block(u), self.gemv_threads)
            )
        g = self.J @ (beta - self.beta0) - data
        g *= self.inv_total
        if self.sign0 is not None:
            g -= self.history * self.sign0
        return g

    def data_tasks(self) -> list[Callable[[], np.ndarray]]:
        """Tasks of the data term Zᵀ(w ⊙ ψ) at the evaluated r."""
        u = self._weighted_psi()
        return self.blocks(len(u), self._rmatvec_block(u))

    def _weighted_psi(self) -> np.ndarray:
        return self.psi if self.w is None else np.multiply(self.w, self.psi, out=self.t1)

    def gradient_and_gram(self, beta: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`gradient` and :meth:`gram` at the evaluated r, their blocks run together."""
        data, gram = self.data_tasks(), self.gram_tasks()
        parts = self.run(data + gram)
        return (
            self.gradient(beta, _sum_in_order(parts[: len(data)])),
            _sum_in_order(parts[len(data) :]),
        )

    def commit_grams(self, score: bool) -> tuple[np.ndarray, np.ndarray | None]:
        """:meth:`gram` and, with ``score``, K's Gram, their blocks run together."""
        if not score:
            return self.gram(), None
        gram, k = self.gram_tasks(), self.score_gram_tasks()
        parts = self.run(gram + k)
        return _sum_in_order(parts[: len(gram)]), _sum_in_order(parts[len(gram) :])

    def gram(self) -> np.ndarray:
        """Zᵀ diag(w ⊙ κ(r)) Z through SYRK on √(wκ) ⊙ Z."""
        return _sum_in_order(self.run(self.gram_tasks()))

    def gram_tasks(self) -> list[Callable[[], np.ndarray]]:
        """Tasks of :meth:`gram` (their sum in order is J's increment)."""
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
        if (n - rows) * p < GATHER_MIN_SAVING * n:
            return self.scaled_gram_tasks(k, self.scaled)
        keep = np.flatnonzero(active)
        weights = np.take(k, keep, out=self.t2[:rows])
        Z, scaled = self.Z, self.scaled

        def block(a: int, b: int) -> np.ndarray:
            s = gather_scaled_rows(Z, keep[a:b], weights[a:b], scaled[a:b])
            return s.T @ s

        return self.blocks(rows, block)

    def score_gram_tasks(self) -> list[Callable[[], np.ndarray]]:
        """Tasks of K's Gram Zᵀ diag(w ⊙ ψ(r)²) Z, a SYRK on (√w ⊙ |ψ|) ⊙ Z per row block.

        Their scaled Z is their own on several threads, where they run beside
        J's. On one thread they run after J's tasks (:meth:`commit_grams` lists
        them last), each of which has taken its product from the shared scaled Z
        before, so they reuse it and the engine keeps no second n × p buffer.
        """
        s = np.abs(self.psi, out=self.t3)
        if self.w is not None:
            s *= np.sqrt(self.w, out=self.t4)
        scaled = self.ws.scaled_k_for(len(s)) if self.threads > 1 else self.scaled
        return self.scaled_gram_tasks(s, scaled)

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
        dp.clip(self.lo, self.hi, out=u)
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
        Threads of the engine's products (``rh-dask.numpy.blas-threads``): a
        count, or ``"auto"``, per batch two counts measured fastest for its
        class, one for the Grams and one for the matrix-vector products
        (calibrated on the class's first batch in the process, see
        :func:`_calibrate` and :func:`_calibrate_gemv`;
        :mod:`rh_dask.engines.row_blocks`). Each BLAS
        call runs on one thread, in row blocks fixed by the shape, so the count
        changes no bit of a result. BLAS's own count is set to one on entry to
        each call and the one in force before it restored on exit.

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
        #: The threads of the products; None: measured per batch class.
        self.blas_threads = resolve_blas_threads(blas_threads)
        self._state: HuberState | None = None
        self._last_batch_weight: float | None = None
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

    @property
    def last_batch_weight(self) -> float | None:
        """Σw of the last batch (its row count when unweighted), as added to ``weight_sum``.

        None before the first batch and after :meth:`reset` or :meth:`import_state`.
        """
        return self._last_batch_weight

    def reset(self) -> None:
        self._state = None
        self._last_batch_weight = None

    def coefficients(self) -> np.ndarray:
        return self._require_state().coefficients.copy()

    def export_state(self) -> HuberState:
        return self._require_state().copy()

    def import_state(self, state: HuberState) -> None:
        self._state = state.for_engine(self.config.fit_intercept, self.config.np_dtype)
        self._last_batch_weight = None

    def predict(self, X: Any) -> np.ndarray:
        state = self._require_state()
        X = np.asarray(X)
        check_width(X, state.n_features_in)
        with one_blas_thread():
            return linear_predictor(X, state.coefficients, state.fit_intercept)

    def partial_fit(self, X: Any, y: Any, sample_weight: Any | None = None) -> BatchDiagnostics:
        with one_blas_thread():
            return self._partial_fit(X, y, sample_weight)

    def _partial_fit(self, X: Any, y: Any, sample_weight: Any | None) -> BatchDiagnostics:
        cfg = self.config
        dt = cfg.np_dtype
        X, y, w = self._check_batch(X, y, sample_weight)
        n, d = X.shape
        state = self._state
        if state is None:
            state = HuberState.empty(d, cfg.fit_intercept, dt, cfg.keeps_score_variance)
        batch_weight = float(n) if w is None else sum_weights(w)
        schedule = batch_schedule(cfg, state, batch_weight)
        # The Grams' thread count: the engine's, or, for "auto", the one whose batches of
        # this class committed fastest lately (measured below: the commit's Grams are the
        # same work in every batch of a class, where the iterations are not). The class:
        # dtype, p, whether K is kept and the rows to a power of 2. The matrix-vector
        # products take a count of their own (below). Any count gives the same bits.
        keeps_k = cfg.keeps_score_variance and state.score_variance is not None
        shape = (dt.str, state.n_params, keeps_k, n.bit_length())
        threads = self.blas_threads
        counts = thread_counts(len(row_blocks(n, state.n_params, dt.itemsize)))
        measured = threads is None and len(counts) > 1
        chooser = thread_chooser()
        if measured:
            threads = chooser.choose(shape, counts)
        elif threads is None:
            threads = 1
        batch = _Batch(self._ws, X, y, w, cfg, state, schedule, threads=threads)
        if measured:
            # The matrix-vector products' own count, measured the same way: a class of
            # its own, calibrated on its first batch with Z β_{b-1}, each later Z v timed.
            gemv_shape = (dt.str, state.n_params, "gemv", n.bit_length())
            if not chooser.calibrated(gemv_shape):
                _calibrate_gemv(batch, gemv_shape, counts)
            batch.gemv_threads = chooser.choose(gemv_shape, counts)
            batch.gemv_timer = (chooser, gemv_shape)
        if cfg.penalised:
            beta, iterations, converged = _solve_lamm(batch, cfg, schedule)
        else:
            # Under a one-thread limit already, the p×p solve needs no limit of its own.
            beta, iterations, converged = _solve_newton(batch, cfg, _solve_ladder)
        # Commit: r, κ, ψ and both Grams at the final β_b. K is accumulated only
        # while the stream has it (a state imported without K continues without) and
        # its configuration keeps it (a penalised stream drops an imported K).
        batch.evaluate(beta)
        objective = batch.objective(beta)
        if cfg.penalised:
            objective += schedule.lambda_value * float(np.abs(beta * batch.mask).sum())
        if measured and not chooser.calibrated(shape):
            gram, score_gram = _calibrate(batch, shape, counts, keeps_k)
        else:
            start = time.perf_counter()
            gram, score_gram = batch.commit_grams(keeps_k)
            if measured:
                chooser.record(shape, threads, time.perf_counter() - start)
        information = state.information + gram
        score_variance = None if score_gram is None else state.score_variance + score_gram
        mean_loss, share, scale = batch.robust_diagnostics(batch_weight)
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
        self._last_batch_weight = batch_weight
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


def _calibrate(
    batch: _Batch, shape: tuple[Any, ...], counts: tuple[int, ...], score: bool
) -> tuple[np.ndarray, np.ndarray | None]:
    """Time the commit's Grams at every thread count, on this batch.

    The first batch of a class under ``"auto"`` does it, once per process:
    each count runs the commit's Grams twice, the counts in an order and then
    in its reverse, so that each is timed as often before as after the others
    (paired). A bounded cost known before it starts: 2 × len(counts) − 1 more
    Gram commits of this batch.
    Every count gives the same bits, so the Grams returned are the batch's.

    It starts once the process's other threads are quiet, for at most
    :data:`CALIBRATION_SETTLE_SECONDS`: BLAS threads that another library
    woke spin on after its calls (about 0.13 s with OpenBLAS) and would take
    the cores a count is timed on.
    """
    chooser = thread_chooser()
    begin = time.perf_counter()
    ProcessIdle().wait(baseline=0.0, max_seconds=CALIBRATION_SETTLE_SECONDS)
    order = [*counts, *reversed(counts)]
    result: tuple[np.ndarray, np.ndarray | None] = (batch.J, None)
    own = 0.0
    for count in order:
        batch.threads = count
        start = time.perf_counter()
        result = batch.commit_grams(score)
        own = time.perf_counter() - start
        chooser.record(shape, count, own)
    chooser.add_calibration(shape, time.perf_counter() - begin - own)
    return result


def _calibrate_gemv(batch: _Batch, shape: tuple[Any, ...], counts: tuple[int, ...]) -> None:
    """Time Z β_{b-1} at every thread count, on this batch (as :func:`_calibrate`).

    Each count runs it :data:`GEMV_CALIBRATION_ROUNDS` times over, the counts in
    an order and then its reverse; the product lands in ``zdir``, scratch that
    the solvers write before they read it, so the batch is unchanged. A bounded
    cost: 2 × rounds × len(counts) GEMVs of this batch.
    """
    chooser = thread_chooser()
    begin = time.perf_counter()
    ProcessIdle().wait(baseline=0.0, max_seconds=CALIBRATION_SETTLE_SECONDS)
    before, batch.gemv_timer = batch.gemv_threads, (chooser, shape)  # matvec records each
    for _ in range(GEMV_CALIBRATION_ROUNDS):
        for count in [*counts, *reversed(counts)]:
            batch.gemv_threads = count
            batch.matvec(batch.beta0, batch.zdir)
    batch.gemv_threads = before
    chooser.add_calibration(shape, time.perf_counter() - begin)


def _norm(x: np.ndarray) -> float:
    """‖x‖₂ as ``np.linalg.norm`` computes it for a vector (√(x·x)), without its checks."""
    return float(np.sqrt(x.dot(x)))


def _sum_in_order(parts: list[np.ndarray]) -> np.ndarray:
    """The row blocks' partial products added in block order (into the first)."""
    total = parts[0]
    for part in parts[1:]:
        total += part
    return total


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
        g, H = batch.gradient_and_gram(beta)
        H += J
        H *= batch.inv_total
        H.flat[:: p + 1] += ridge
        D = solve(H, g).astype(beta.dtype, copy=False)
        batch.matvec(D, batch.zdir)
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
        step = _norm(new - beta)
        beta = new
        if step_converged(step, _norm(beta), cfg.tol):
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
                batch.matvec(trial.step, batch.zdir)
                if passes(trial, batch.zdir):
                    accepted = True
                    break
            phi *= 2.0
            if trials < LAMM_MAX_TRIALS:
                trial = candidate(phi)
        if not accepted:
            break
        step = _norm(trial.step)
        beta = trial.point
        phi = max(phi / 2.0, LAMM_MIN_PHI)
        if step_converged(step, _norm(beta), cfg.tol):
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
