"""The launch bodies both solvers share: the row pass with its Gram GEMM, and the commit.

``rh_newton_eval`` and ``rh_commit_eval`` are one row pass over the batch
(r, ψ, κ, the scaled rows M = [wκ ⊙ Z | wψ] and the loss at the trial β)
followed by one GEMM C = Zᵀ M (Gram matrix and gradient together).
``rh_commit_finish`` commits the batch (objective, J += Gram, β and its host
mirror) once the solve has stopped, and returns at once otherwise.
"""

from __future__ import annotations

from . import layout
from .launch import Launcher
from .solver import DenseSolver
from .workspace import Workspace


def row_pass(
    launcher: Launcher,
    dense: DenseSolver,
    ws: Workspace,
    kernel: str,
    n: int,
    before_m: tuple,
    after: tuple,
) -> None:
    """One ``eval_rows`` kernel over the batch's rows, then ``C = Zᵀ[M]``.

    ``rh_newton_eval`` and ``rh_commit_eval`` share their row pass and
    their arguments but for the residuals (``before_m``, Newton only) and
    the status word (``after``, commit only).
    """
    p = ws.p
    launcher.launch(
        (kernel, n),
        kernel,
        launcher.grid(n),
        layout.ROW_THREADS,
        (
            *(ws.Z, ws.ldz, n, p, ws.y, ws.w, ws.beta_work, ws.ctl, *before_m),
            *(ws.M, ws.ldm, ws.partials, *after),
        ),
        p * ws.item,
    )
    dense.gram_and_gradient(ws.Z, ws.ldz, ws.M, ws.ldm, ws.C, n, p)


def commit_finish(launcher: Launcher, ws: Workspace) -> None:
    """``rh_commit_finish``: commit the batch if its solve has stopped (else a no-op)."""
    launcher.launch(
        ("finish",),
        "rh_commit_finish",
        1,
        layout.SMALL_THREADS,
        (
            *(ws.C, ws.J, ws.beta_work, ws.beta, ws.p, ws.ctl, ws.beta),
            *(ws.status_ptr, ws.beta_host_ptr),
        ),
    )


def commit(launcher: Launcher, dense: DenseSolver, ws: Workspace, n: int) -> None:
    """κ, loss and Gram at the final β, then the commit (no-ops until the solve is done)."""
    row_pass(launcher, dense, ws, "rh_commit_eval", n, (), (ws.status_ptr,))
    commit_finish(launcher, ws)
