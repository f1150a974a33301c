"""The launch bodies both solvers share: the row pass with its Gram GEMM, and the commit.

``rh_newton_eval`` and ``rh_commit_eval`` are one row pass over the batch
(r, ψ, κ, the scaled rows M = [wκ ⊙ Z | wψ] and the loss at the trial β)
followed by one GEMM C = Zᵀ M (Gram matrix and gradient together).
``rh_commit_finish`` commits the batch (objective, J += Gram, β and its host
mirror) once the solve has stopped, and returns at once otherwise.
"""

from __future__ import annotations

from typing import Any

from . import layout
from .kernels import Kernels
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


def allow_row_shared(kernels: Kernels, ws: Workspace, names: tuple[str, ...]) -> None:
    """Let the row kernels ``names`` take β (p values, dynamic shared memory) at this p.

    Past the kernels' default limit (48 KiB less their static arrays: p above
    about 5,500 in float64) the launch would fail. Call it outside captures.
    """
    for name in names:
        kernels.allow_shared(name, ws.p * ws.item)


def commit_finish(launcher: Launcher, ws: Workspace) -> None:
    """``rh_commit_finish``: commit the batch if its solve has stopped (else a no-op).

    For a wide design (``ws.wide``) the products with J and the update
    J += sym(C) run first as grid kernels, gated on the same predicate, and
    the one-block kernel takes J(β − β0) from ``ws.jv``.
    """
    jv = 0
    if ws.wide:
        wide_symv(launcher, ws, "commit", ws.beta_work, ws.beta, layout.GATE_COMMIT)
        tiles = -(-ws.p // 32)
        launcher.launch(
            ("wide_gram",),
            "rh_wide_commit_gram",
            tiles * tiles,
            layout.WIDE_THREADS,
            (ws.C, ws.J, ws.p, ws.ctl),
        )
        jv = ws.jv
    launcher.launch(
        ("finish",),
        "rh_commit_finish",
        1,
        layout.SMALL_THREADS,
        (
            *(ws.C, ws.J, ws.beta_work, ws.beta, ws.p, ws.ctl, ws.beta),
            *(ws.status_ptr, ws.beta_host_ptr, jv),
        ),
    )


def wide_symv(launcher: Launcher, ws: Workspace, key: str, x: Any, x0: Any, gate: int) -> None:
    """``rh_wide_symv``: ``ws.jv`` = J (x − x0) (``x0`` = 0: J x) when ``gate`` holds.

    Parameters
    ----------
    launcher : Launcher
        The engine's launcher.
    ws : Workspace
        The engine's workspace (a wide design).
    key : str
        Names the prepared launch (one per call site).
    x, x0 : cupy.ndarray or 0
        The vector and what is subtracted from it (0: nothing).
    gate : int
        One of ``layout.GATE_*``: the predicate of the kernel that reads ``ws.jv``.
    """
    launcher.launch(
        ("wide_symv", key),
        "rh_wide_symv",
        -(-ws.p // 32),
        layout.ROW_THREADS,
        (ws.J, ws.p, x, x0, ws.ctl, gate, ws.jv),
    )


def commit(launcher: Launcher, dense: DenseSolver, ws: Workspace, n: int) -> None:
    """κ, loss and Gram at the final β, then the commit (no-ops until the solve is done)."""
    row_pass(launcher, dense, ws, "rh_commit_eval", n, (), (ws.status_ptr,))
    commit_finish(launcher, ws)
