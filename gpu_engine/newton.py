"""The unpenalised solve on the device: Newton with monotone backtracking.

One step graph per iteration: the Cholesky solve of the Newton system
(a one-block kernel for small p, by default ``rh_newton_solve_columns_*`` or
``rh_newton_solve_tiles``, else
``rh_newton_assemble`` + cuSOLVER ``potrf``/``potrs``; for wide designs,
p ≥ ``layout.WIDE_MIN_P``, the assembly and the products with J are grid
kernels, ``rh_wide_symv`` and ``rh_wide_assemble``), ``rh_newton_search``
(all 27 backtracking steps in one pass; its last block decides the step,
moves β and tests convergence on the device), then the row pass and Gram
GEMM at the new β, which are both the next iteration's start and, when the
search ended the solve, the commit's input, and ``rh_commit_finish``.

The iterations run either as a host loop (one step graph launch and one host
synchronisation per iteration) or as a device loop (:mod:`.device_loop`:
the step graph's work as the body of a WHILE conditional graph, one launch
and one synchronisation per batch); both queue the same work in the same
order and give the same bits. When the device reports the Cholesky factor
singular, the host finishes the contract's ladder (LU, then the minimum-norm
solution by eigendecomposition) and the line search is rerun with that
direction; the device loop exits to the host for it and is launched again if
the solve goes on.
"""

from __future__ import annotations

from collections.abc import Iterator

from rh_dask.core import singular_rtol
from rh_dask.exceptions import EngineUnavailableError, ValidationError

from . import layout
from .commit import allow_row_shared, commit_finish, row_pass, wide_symv
from .device_loop import DeviceLoop
from .inputs import raise_if_invalid
from .launch import LoopGraph
from .parts import DeviceParts

#: ``cholesky="auto"`` takes the register-column kernels (``"columns"``) up to
#: AUTO_COLUMNS_MAX_P, the register-tile kernel (``"tiles"``) up to
#: AUTO_TILES_MAX_P and cuSOLVER above. Measured on an H100 machine, ms per
#: batch, host loop (benchmarks/results/shape_sweep-h100-tiles-2.json and
#: shape_sweep-h100-tiles-auto.json): at p = 91 tiles 0.72-0.74 against
#: cuSOLVER 0.86-0.87 and columns 0.90-0.92 (float32), 0.97-0.98 against
#: 1.04 and 1.07 (float64); at p = 33 columns 0.453-0.456 against tiles
#: 0.480-0.485 in float64 and 0.390 against 0.375-0.378 in float32; at p = 17
#: within 1 %. The solve alone (solve_probe-h100-tiles.json, float32 µs): tiles
#: 75.7 against cuSOLVER's 92.8 at p = 128; past it, not measured.
AUTO_COLUMNS_MAX_P = 33
AUTO_TILES_MAX_P = 128

#: The ways ``GpuEngine(cholesky=...)`` may factorise the Newton system.
CHOLESKY_MODES = ("auto", "kernel", "blocked", "columns", "tiles", "cusolver")

#: ``cholesky="columns"``: the register-column kernels, each with the largest p
#: it holds (its warps' registers hold columns 0..p−1 and rows 0..p).
COLUMNS_KERNELS = (
    (32, "rh_newton_solve_columns_s"),
    (96, "rh_newton_solve_columns_m"),
    (128, "rh_newton_solve_columns_l"),
)


class NewtonDriver:
    """Runs the Newton solve of one batch on the engine's stream.

    Parameters
    ----------
    parts : DeviceParts
        The engine's device-side collaborators.
    cholesky : {"auto", "kernel", "blocked", "columns", "tiles", "cusolver"}
        How the Newton system is factorised (see :class:`GpuEngine`).
    loop : DeviceLoop or None
        Runs the iterations as a device loop where it is enabled (None: the
        host loop).
    """

    def __init__(
        self,
        parts: DeviceParts,
        cholesky: str,
        loop: DeviceLoop | None = None,
    ) -> None:
        self._parts = parts
        self._cholesky = cholesky
        self._loop = loop
        #: The one-block kernel of the current batch's p and its dynamic shared
        #: bytes (set by :meth:`_fused_solve_fits`).
        self._solve_kernel = "rh_newton_solve"
        self._solve_shared = 0
        #: Whether the last solve used the fused one-block kernel.
        self.small_solve = False
        #: Whether the last solve ran as a device loop.
        self.device_loop = False

    def solve(self, n: int, p: int) -> None:
        """Solve and commit the batch in the workspace (``n`` rows, ``p`` parameters).

        :meth:`steps`, synchronising the engine's stream at each of its
        yields: one synchronisation per iteration (host loop) or per batch
        (device loop, plus one per singular factor); the commit rides on the
        last one. Raises the batch's :class:`ValidationError` after the first
        one if ``rh_build`` flagged its values.

        Raises
        ------
        EngineUnavailableError
            With ``device_loop="on"``, when the loop graph cannot be built
            (before anything is committed).
        """
        for _ in self.steps(n, p):
            self._parts.calls.synchronize(self._parts.stream)

    def steps(self, n: int, p: int) -> Iterator[None]:
        """The solve of :meth:`solve`, yielding where it needs the stream synchronised.

        Each ``yield`` follows queued work whose status the next step reads:
        the caller synchronises the engine's stream before resuming (several
        engines can so be synchronised together, :mod:`gpu_engine.grid`).
        The queued work and its order are those of :meth:`solve`.
        """
        run = self._parts.launcher.run
        self.small_solve = self._fused_solve_fits(p)
        # The loop graph first: building it gives cuBLAS the loop's workspace,
        # which the prime graph's GEMM then uses too, and a loop that cannot
        # be built with "on" raises before anything is queued. Asked for again
        # after the prime graph: a failed capture of that one drops every graph.
        self._loop_graph(n)
        run(("prime", n), lambda: self._eval_and_gram(n))
        graph = self._loop_graph(n)
        self.device_loop = graph is not None
        if graph is None:
            yield from self._host_loop(n, p)
        else:
            yield from self._device_loop(n, p, graph)

    def _host_loop(self, n: int, p: int) -> Iterator[None]:
        """One step graph and one synchronisation per iteration."""
        ws, run = self._parts.ws, self._parts.launcher.run
        for it in range(self._parts.config.max_iter):
            run(("step", n), lambda: self._step(n))
            yield
            if it == 0:
                raise_if_invalid(ws.status_i)
            if ws.status_i[layout.I_FALLBACK]:
                yield from self._fallback(n, p)
            if ws.status_i[layout.I_DONE]:
                return

    def _device_loop(self, n: int, p: int, graph: LoopGraph) -> Iterator[None]:
        """Every iteration in one launch, up to the end of the solve or a singular factor.

        Each launch ends the solve or advances the iteration count (the
        fallback's step counts one), so ``max_iter`` launches always suffice.
        """
        ws = self._parts.ws
        for it in range(self._parts.config.max_iter):
            graph.launch(self._parts.stream.ptr)
            yield
            if it == 0:
                raise_if_invalid(ws.status_i)
            if ws.status_i[layout.I_FALLBACK]:
                yield from self._fallback(n, p)
            elif not ws.status_i[layout.I_DONE]:  # pragma: no cover - a kernel bug
                raise RuntimeError(
                    "the Newton device loop stopped with the solve still open "
                    f"after {int(ws.status_i[layout.I_ITER])} iterations"
                )
            if ws.status_i[layout.I_DONE]:
                return

    def _fallback(self, n: int, p: int) -> Iterator[None]:
        """The factor was singular: the host's direction, its line search and the row pass.

        Yields once, after the commit kernel: the caller synchronises before
        the status is read again.
        """
        ws = self._parts.ws
        direction = self._parts.dense.fallback_direction(
            ws.Hs, ws.g, p, singular_rtol(self._parts.config.np_dtype, p)
        )
        ws.D[...] = direction
        self._search(n, force=1)
        self._eval_and_gram(n)
        commit_finish(self._parts.launcher, ws)
        yield

    def _loop_graph(self, n: int) -> LoopGraph | None:
        """The device loop's graph for ``n`` rows (built on first use), or None for the host loop.

        Built only while graphs are on (``device_loop="on"`` tries anyway).
        A loop that cannot be built turns the device loop off for good
        (:attr:`DeviceLoop.error` says why), or raises with ``"on"``.
        """
        loop, launcher = self._loop, self._parts.launcher
        if loop is None or not loop.enabled or not (launcher.graphs or loop.mode == "on"):
            return None
        if not self.small_solve:
            # cuSOLVER's factorisation allocates inside a capture (memory
            # allocation and free nodes, measured on the H200), which a conditional
            # body refuses; a failed capture of it is not attempted at all.
            reason = (
                "the Newton step factorises with cuSOLVER (p too large for the fused "
                "one-block kernel, or cholesky='cusolver'), which a device loop cannot hold"
            )
            if loop.mode == "on":
                raise EngineUnavailableError(f"device_loop='on', but {reason}")
            loop.error = reason
            return None
        key = ("loop", n, self.small_solve)
        graph = launcher.cached_graph(key)
        if isinstance(graph, LoopGraph):
            return graph
        try:
            graph = loop.build(self._parts.ws.ctl, lambda: self._step(n), self._parts.dense.blas)
        except Exception as exc:  # a driver or a body that a conditional node refuses
            loop.give_up(exc)
            return None
        launcher.keep_graph(key, graph)
        return graph

    def _fused_solve_fits(self, p: int) -> bool:
        """Whether this p×p system goes through the fused one-block kernel.

        Sets the shared-memory limits of this p's launches (the solve kernel's,
        and the row kernels' β), which must not happen during a graph capture.
        """
        allow_row_shared(
            self._parts.kernels,
            self._parts.ws,
            ("rh_newton_eval", "rh_newton_search", "rh_commit_eval"),
        )
        mode = self._cholesky
        if mode == "cusolver":
            return False
        if mode == "auto":
            if p > AUTO_TILES_MAX_P:
                return False
            mode = "columns" if p <= AUTO_COLUMNS_MAX_P else "tiles"
        item = self._parts.ws.item
        if mode == "columns":
            name = next((kernel for top, kernel in COLUMNS_KERNELS if p <= top), None)
            shared, max_p = (p * p + 4 * p + 2) * item, COLUMNS_KERNELS[-1][0]
        elif mode == "tiles":
            name = "rh_newton_solve_tiles"
            shared, max_p = (p * p + 3 * p) * item, 32 * layout.SOLVE_ROWS
        else:
            name = "rh_newton_solve_blocked" if mode == "blocked" else "rh_newton_solve"
            shared, max_p = (p * p + 2 * p) * item, 32 * layout.SOLVE_ROWS
        fits = (
            name is not None and p <= max_p and shared + 8 * 1024 <= self._parts.kernels.max_shared
        )
        if not fits and self._cholesky != "auto":
            raise ValidationError(
                f"cholesky={self._cholesky!r} solves systems of p ≤ {max_p} in shared "
                f"memory; this one has p = {p} ({shared} bytes, the device allows "
                f"{self._parts.kernels.max_shared})"
            )
        if fits:
            self._solve_kernel, self._solve_shared = name, shared
            self._parts.kernels.allow_shared(name, shared)
        return fits

    def _eval_and_gram(self, n: int) -> None:
        """κ, ψ and loss at the trial β (residuals kept for the search), then the Gram."""
        ws = self._parts.ws
        row_pass(self._parts.launcher, self._parts.dense, ws, "rh_newton_eval", n, (ws.r,), ())

    def _step(self, n: int) -> None:
        """One iteration: solve, line search, row pass and Gram at the new β, commit."""
        ws, launch = self._parts.ws, self._parts.launcher.launch
        p = ws.p
        if self.small_solve:
            launch(
                ("solve", self._solve_kernel),
                self._solve_kernel,
                1,
                layout.SMALL_THREADS,
                (ws.C, ws.J, ws.beta_work, ws.beta, p, ws.ctl, ws.H, ws.Hs, ws.g, ws.D),
                self._solve_shared,
            )
        elif ws.wide:
            # J(β − β0) for g, then H's tiles and g over the grid
            wide_symv(
                self._parts.launcher, ws, "assemble", ws.beta_work, ws.beta, layout.GATE_ALWAYS
            )
            tiles = -(-p // 32)
            launch(
                ("wide_assemble",),
                "rh_wide_assemble",
                tiles * tiles + -(-p // layout.WIDE_THREADS),
                layout.WIDE_THREADS,
                (ws.C, ws.J, ws.beta, p, ws.ctl, ws.jv, ws.H, ws.Hs, ws.g, ws.D),
            )
            self._parts.dense.cholesky_solve(
                ws.H, ws.D, p, ws.int_ptr(layout.I_INFO), ws.int_ptr(layout.I_INFO_SOLVE)
            )
        else:
            launch(
                ("assemble",),
                "rh_newton_assemble",
                1,
                layout.SMALL_THREADS,
                (ws.C, ws.J, ws.beta_work, ws.beta, p, ws.ctl, ws.H, ws.Hs, ws.g, ws.D),
            )
            self._parts.dense.cholesky_solve(
                ws.H, ws.D, p, ws.int_ptr(layout.I_INFO), ws.int_ptr(layout.I_INFO_SOLVE)
            )
        self._search(n, force=0)
        self._eval_and_gram(n)
        commit_finish(self._parts.launcher, ws)

    def _search(self, n: int, force: int) -> None:
        """``rh_newton_search``: the backtracking steps in one pass (``force``: take D as is)."""
        ws, launcher = self._parts.ws, self._parts.launcher
        p = ws.p
        if ws.wide:  # JD for the step's curvature term, over the grid
            wide_symv(launcher, ws, "search", ws.D, 0, layout.GATE_OPEN)
        launcher.launch(
            ("search", n, force),
            "rh_newton_search",
            launcher.grid(n),
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
                ws.jv if ws.wide else 0,
            ),
            p * ws.item,
        )
