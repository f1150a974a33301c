"""Device buffers of one engine, allocated once and reused for the whole stream.

Everything the iteration kernels touch lives here at fixed addresses, which
is what lets a captured CUDA graph be replayed batch after batch: buffers
only move when a batch has more rows (or the stream more parameters) than
any before, and then :attr:`Workspace.generation` changes so that the
engine drops its captured graphs.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy as np

from . import layout
from .transfer import PinnedBuffer


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


class Workspace:
    """The engine's device memory (state, per-batch rows, p-space scratch, control).

    Parameters
    ----------
    cp : module
        CuPy.
    dtype : numpy.dtype
        The compute dtype.
    max_grid : int
        The largest grid any row kernel is launched with (sizes the partial sums).
    wide_kernels : bool, default=False
        Whether designs with p ≥ ``layout.WIDE_MIN_P`` run their p-space work
        as grid kernels (:attr:`wide`).
    """

    def __init__(
        self, cp: ModuleType, dtype: np.dtype, max_grid: int, *, wide_kernels: bool = False
    ) -> None:
        self._cp = cp
        self._wide_kernels = wide_kernels
        self.dtype = np.dtype(dtype)
        self.item = self.dtype.itemsize
        self.max_grid = max_grid
        # 16-byte aligned rows for Z and M.
        self._align = 16 // self.item
        self.generation = 0
        self.p = 0
        #: Whether p-space work runs as grid kernels (asked for, and p ≥ ``layout.WIDE_MIN_P``).
        self.wide = False
        self.rows = 0
        self.ctl = cp.zeros(layout.CTL_BYTES, dtype=np.uint8)
        self.status = PinnedBuffer(cp, layout.CTL_BYTES, mapped=True)
        self.status_d = self.status.view(np.float64, layout.N_DOUBLE)
        self.status_i = self.status.view(np.int32, layout.N_INT, layout.N_DOUBLE * 8)
        self.header = PinnedBuffer(cp, layout.CTL_BYTES)
        self.header_d = self.header.view(np.float64, layout.N_DOUBLE)
        self.header_i = self.header.view(np.int32, layout.N_INT, layout.N_DOUBLE * 8)
        self.partials: Any = None
        self._beta_mirror: PinnedBuffer | None = None
        self.beta_host: np.ndarray = np.zeros(0, dtype=self.dtype)

    # -- addresses -----------------------------------------------------------------
    @property
    def ctl_ptr(self) -> int:
        return int(self.ctl.data.ptr)

    def int_ptr(self, index: int) -> int:
        """Device address of the control block's int32 field ``index``."""
        return self.ctl_ptr + layout.N_DOUBLE * 8 + 4 * index

    @property
    def status_ptr(self) -> int:
        return self.status.ptr

    @property
    def beta_host_ptr(self) -> int:
        assert self._beta_mirror is not None
        return self._beta_mirror.ptr

    # -- sizing --------------------------------------------------------------------
    def ensure_params(self, p: int) -> bool:
        """Allocate the p-sized buffers; True when they were (re)allocated (state zeroed)."""
        if p == self.p:
            return False
        cp, dt = self._cp, self.dtype
        self.p = p
        self.ldz = _round_up(p, self._align)
        self.ldm = _round_up(p + 1, self._align)
        self.ldp = _round_up(p, 2)
        # The committed state β, J and K in one block (each part 128-byte
        # aligned), so that a copy of the state is one device copy.
        j_at = _round_up(p, 32)
        k_at = j_at + _round_up(p * p, 32)
        self.state_block = cp.zeros(k_at + p * p, dtype=dt)
        self.beta = self.state_block[:p]
        self.J = self.state_block[j_at : j_at + p * p].reshape(p, p)
        self.K = self.state_block[k_at:].reshape(p, p)  # Σ Zᵀ diag(w ψ²) Z, the sandwich's meat
        # Host-mapped copy of β, written by every commit (device pointer = host
        # pointer under unified addressing, like the status block's).
        if self._beta_mirror is not None:
            self._beta_mirror.free()
        self._beta_mirror = PinnedBuffer(cp, p * self.item, mapped=True)
        self.beta_host = self._beta_mirror.view(dt, p)
        self.beta_host[...] = 0
        self.beta_work = cp.zeros(p, dtype=dt)
        self.C = cp.zeros(p * (p + 1), dtype=dt)
        self.H = cp.zeros((p, p), dtype=dt)
        self.Hs = cp.zeros((p, p), dtype=dt)
        self.g = cp.zeros(p, dtype=dt)
        self.D = cp.zeros(p, dtype=dt)
        # Wide designs: J·v of rh_wide_symv (float64, up to LAMM_ROUND vectors).
        self.wide = self._wide_kernels and p >= layout.WIDE_MIN_P
        self.jv = cp.zeros(p * layout.LAMM_ROUND if self.wide else 1, dtype=np.float64)
        self.partials = cp.zeros(self.max_grid * max(32, self.ldp), dtype=np.float64)
        self.rows = 0  # row buffers depend on the strides
        self.generation += 1
        return True

    def ensure_rows(self, n: int) -> None:
        """Grow the row buffers to hold n rows."""
        if n <= self.rows:
            return
        cp, dt = self._cp, self.dtype
        self.Z = cp.empty(n * self.ldz, dtype=dt)
        self.M = cp.empty(n * self.ldm, dtype=dt)
        self.y = cp.empty(n, dtype=dt)
        self.w = cp.empty(n, dtype=dt)
        self.r = cp.empty(n, dtype=dt)
        self.rows = n
        self.generation += 1

    def close(self) -> None:
        self.status.free()
        self.header.free()
        if self._beta_mirror is not None:
            self._beta_mirror.free()
