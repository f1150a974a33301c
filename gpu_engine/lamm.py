"""The L1 solve on the device: LAMM rounds queued several at a time.

Each round is ``rh_lamm_eval`` (r and the gradient g in one pass) and
``rh_lamm_trials`` (``layout.LAMM_ROUND`` majorisation trials in one pass;
its last block accepts the first that passes). Rounds are queued in groups
sized from the previous batch's iteration count, each group followed by the
commit (``rh_commit_eval``, the Gram GEMM, ``rh_commit_finish``); kernels of
a finished solve, and the commit of an unfinished one, return at once. The
host synchronises once per group.
"""

from __future__ import annotations

from collections.abc import Iterator

from rh_dask.core import LAMM_MAX_TRIALS
from rh_dask.exceptions import ValidationError

from . import layout
from .commit import allow_row_shared, commit, wide_symv
from .inputs import raise_if_invalid
from .parts import DeviceParts


class LammDriver:
    """Runs the LAMM solve of one batch on the engine's stream.

    Parameters
    ----------
    parts : DeviceParts
        The engine's device-side collaborators.
    """

    def __init__(
        self,
        parts: DeviceParts,
    ) -> None:
        self._parts = parts
        #: LAMM iterations of the last batch solved: sizes the next batch's first queue.
        self.last_iterations = 4

    def solve(self, n: int) -> None:
        """Solve and commit the batch in the workspace (``n`` rows); one sync per group.

        :meth:`steps`, synchronising the engine's stream at each of its
        yields. Raises the batch's :class:`ValidationError` after the first
        group if ``rh_build`` flagged its values.
        """
        for _ in self.steps(n):
            self._parts.calls.synchronize(self._parts.stream)

    def steps(self, n: int) -> Iterator[None]:
        """The solve of :meth:`solve`, yielding after each queued group.

        The caller synchronises the engine's stream before resuming; the
        queued work and its order are those of :meth:`solve`.
        """
        ws, launcher = self._parts.ws, self._parts.launcher
        shape = self._shape()
        # Each round is one group of φ trials; an iteration takes at most five.
        rounds_left = self._parts.config.max_iter * (LAMM_MAX_TRIALS // layout.LAMM_ROUND)
        queue = max(2, self.last_iterations + 1)
        first = True
        while rounds_left > 0:
            queue = min(queue, rounds_left)
            # queue = sum of powers of two: a few cached graphs cover every length
            bit = 1
            while bit <= queue:
                if queue & bit:
                    launcher.run(("rounds", n, bit), lambda b=bit: self._rounds(n, b, shape))
                bit <<= 1
            launcher.run(("commit", n), lambda: commit(launcher, self._parts.dense, ws, n))
            rounds_left -= queue
            yield
            if first:
                raise_if_invalid(ws.status_i)
                first = False
            if ws.status_i[layout.I_DONE]:
                self.last_iterations = int(ws.status_i[layout.I_ITER])
                return
            queue *= 2

    def _shape(self) -> tuple[int, int, int, bool]:
        """Threads and dynamic shared memory of the LAMM kernels for this p.

        The last item says whether the trials take J e_k from
        ``rh_wide_lamm_symv`` (a wide design whose steps fit in its shared
        memory beside the strip sums). Sets the kernels' shared-memory
        limits, which must not happen during a graph capture.
        """
        ws, k = self._parts.ws, self._parts.kernels
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
        allow_row_shared(k, ws, ("rh_commit_eval",))
        trial_shared = layout.LAMM_ROUND * ws.ldp * ws.item
        if trial_shared + 8 * 1024 > k.max_shared:
            raise ValidationError(
                f"penalty='l1' on the GPU engine supports up to about "
                f"{(k.max_shared - 8 * 1024) // (layout.LAMM_ROUND * ws.item)} parameters"
            )
        k.allow_shared("rh_lamm_trials", trial_shared)
        # rh_wide_lamm_symv's static strip sums: LAMM_ROUND × warps × 32 doubles.
        strips = layout.LAMM_ROUND * (layout.ROW_THREADS // 32) * 32 * 8
        wide_trials = ws.wide and trial_shared + strips + 1024 <= k.max_shared
        if wide_trials:
            k.allow_shared("rh_wide_lamm_symv", trial_shared)
            k.allow_shared("rh_lamm_trials_wide", trial_shared)
        return warps * 32, shared, trial_shared, wide_trials

    def _rounds(self, n: int, rounds: int, shape: tuple[int, int, int, bool]) -> None:
        """Queue ``rounds`` LAMM rounds (eval, then trials) for the ``n``-row batch.

        For a wide design the products with J come from grid kernels queued
        before each (``rh_wide_symv``, ``rh_wide_lamm_symv``), gated on the
        same predicates as the kernels that read them.
        """
        ws, launcher = self._parts.ws, self._parts.launcher
        p = ws.p
        threads, shared, trial_shared, wide_trials = shape
        for _ in range(rounds):
            if ws.wide:
                wide_symv(launcher, ws, "lamm_eval", ws.beta_work, ws.beta, layout.GATE_LAMM)
            launcher.launch(
                ("lamm_eval", n),
                "rh_lamm_eval",
                launcher.grid(n, threads // 32),
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
                    ws.jv if ws.wide else 0,
                ),
                shared,
            )
            trial_args: tuple = (
                *(ws.Z, ws.ldz, n, p, ws.ldp, ws.r, ws.w, ws.g, ws.J, ws.ctl),
                *(ws.beta_work, ws.partials, ws.status_ptr),
            )
            if wide_trials:
                launcher.launch(
                    ("wide_lamm_symv",),
                    "rh_wide_lamm_symv",
                    -(-p // 32),
                    layout.ROW_THREADS,
                    (ws.J, p, ws.ldp, ws.beta_work, ws.g, ws.ctl, ws.jv),
                    trial_shared,
                )
                launcher.launch(
                    ("lamm_trials", n),
                    "rh_lamm_trials_wide",
                    launcher.grid(n),
                    layout.ROW_THREADS,
                    (*trial_args, ws.jv),
                    trial_shared,
                )
            else:
                launcher.launch(
                    ("lamm_trials", n),
                    "rh_lamm_trials",
                    launcher.grid(n),
                    layout.ROW_THREADS,
                    trial_args,
                    trial_shared,
                )
