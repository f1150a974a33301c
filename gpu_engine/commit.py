"""The launch bodies both solvers share: the row pass with its Gram product, and the commit.

``rh_newton_eval`` and ``rh_commit_eval`` are one row pass over the batch
(r, ψ, κ, the scaled rows M = [wκ ⊙ Z | wψ] and the loss at the trial β)
followed by C = Zᵀ M (Gram matrix and gradient together): where the
workspace says so (``ws.gram_kernel``, p ≤ ``layout.GRAM_MAX_P``) the row pass
writes only each row's factors wκ and wψ and the engine's Gram kernels
(``rh_gram_rows``, ``rh_gram_reduce``) form M's rows from Z as they go, else
the row pass writes M and one cuBLAS GEMM makes C.
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

#: The ways ``GpuEngine(gram=...)`` may make the Gram matrix and gradient.
GRAM_MODES = ("auto", "kernel", "cublas")


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
    the status word (``after``, commit only). The commit's Gram kernels are
    gated like ``rh_commit_eval`` (no-ops until the commit is due).
    """
    p = ws.p
    launcher.launch(
        (kernel, n),
        kernel,
        launcher.grid(n),
        layout.ROW_THREADS,
        (
            *(ws.Z, ws.ldz, n, p, ws.y, ws.w, ws.beta_work, ws.ctl, *before_m),
            *(ws.M, ws.ldm, ws.kw if ws.gram_kernel else 0, ws.partials, *after),
        ),
        p * ws.item,
    )
    if ws.gram_kernel:
        gate = layout.GATE_COMMIT if kernel == "rh_commit_eval" else layout.GATE_ALWAYS
        gram_kernels(launcher, ws, n, gate)
    else:
        dense.gram_and_gradient(ws.Z, ws.ldz, ws.M, ws.ldm, ws.C, n, p)


def gram_grid(max_grid: int, n: int) -> tuple[int, int]:
    """``rh_gram_rows``' blocks and rows per block over ``n`` rows.

    Each block takes a whole number of ``layout.GRAM_ROWS``-row stages, and
    there are at most ``max_grid`` blocks: a function of the row count and
    the device only, so the sums' order (and bits) are fixed.
    """
    stages = -(-n // layout.GRAM_ROWS)
    per_block = -(-stages // max_grid) * layout.GRAM_ROWS
    return -(-n // per_block), per_block


def gram_shared(ws: Workspace) -> int:
    """``rh_gram_rows``' dynamic shared memory: Z's and M's staged rows."""
    lds = 4 * -(-ws.p // 4) + 4
    return 2 * layout.GRAM_ROWS * lds * ws.item


def gram_kernels(launcher: Launcher, ws: Workspace, n: int, gate: int) -> None:
    """``rh_gram_rows`` then ``rh_gram_reduce``: C's lower triangle and gradient column."""
    p, tiles = ws.p, layout.gram_tiles(ws.p)
    blocks, per_block = gram_grid(launcher.max_grid, n)
    launcher.launch(
        ("gram_rows", n, gate),
        "rh_gram_rows",
        blocks,
        -(-tiles // 32) * 32,
        (ws.Z, ws.ldz, n, p, ws.kw, per_block, ws.ctl, gate, ws.gram_partials),
        gram_shared(ws),
    )
    launcher.launch(
        ("gram_reduce", n, gate),
        "rh_gram_reduce",
        -(-16 * tiles // 32),
        32 * layout.GRAM_SPLITS,
        (ws.gram_partials, blocks, p, ws.ctl, gate, ws.C),
    )


def allow_row_shared(kernels: Kernels, ws: Workspace, names: tuple[str, ...]) -> None:
    """Let the row kernels ``names`` take β (p values, dynamic shared memory) at this p.

    Past the kernels' default limit (48 KiB less their static arrays: p above
    about 5,500 in float64) the launch would fail. With the Gram kernels, also
    ``rh_gram_rows``' staged rows (past 48 KiB from p = 93 in float64). Call it
    outside captures.
    """
    for name in names:
        kernels.allow_shared(name, ws.p * ws.item)
    if ws.gram_kernel:
        kernels.allow_shared("rh_gram_rows", gram_shared(ws))


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
