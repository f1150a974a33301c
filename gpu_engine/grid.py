"""The device side of a grid of GPU engines: one copy of each batch, scored on the device.

:class:`rh_dask.engines.grid.GridEngine` advances one :class:`GpuEngine` per
configuration with every batch. :class:`DeviceGrid` gives those engines what
they share:

* **one device copy of each batch**: a host batch is staged once through
  pinned memory on a stream of the grid's own (:class:`~.transfer.HostStager`,
  so the next batch can be copied while the engines solve this one, see
  :meth:`DeviceGrid.batch`), and every engine reads that copy; a device
  batch is viewed where it is;
* **the prequential scores** of every configuration on the batch, before any
  of them trains on it (``kernels/score.cu``: one launch for all
  configurations, each configuration's sums independent of the others), read
  back through host-mapped memory once the batch is done.

The engines themselves are advanced by the grid (one after the other, or
together with :func:`rh_dask.engines.lockstep.advance_together`); each reads
the shared copy in its own ``rh_build``, ordered after the grid's stream.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from rh_dask.exceptions import ValidationError

from . import layout
from ._cuda import import_cupy, resolve_device
from .driver import DriverCalls
from .host_pool import device_pool
from .inputs import accept_device_batch, check_host_batch, is_cuda
from .transfer import HostStager, PinnedBuffer, StagedBatch

__all__ = ["DeviceGrid", "PendingScores"]

SOURCE = Path(__file__).with_name("kernels") / "score.cu"

#: NVRTC options of the scoring kernels (no fast-math: IEEE arithmetic).
COMPILE_OPTIONS: tuple[str, ...] = ("--std=c++17",)

#: Row kernels of the scores run at most this many blocks per multiprocessor
#: (the engine's own rule, ``engine.BLOCKS_PER_SM``): the grid size fixes the
#: order of the partial sums, so it depends on the row count and device only.
BLOCKS_PER_SM = 2

_LOCK = threading.Lock()
_KERNELS: dict[tuple[int, str], tuple[Any, Any, int]] = {}


def score_kernels(cp: ModuleType, device_id: int, dtype: np.dtype) -> tuple[Any, Any, int]:
    """``(rh_score_rows<T>, rh_score_finish, multiprocessors)`` of a device, compiled once."""
    ctype = {np.dtype(np.float32): "float", np.dtype(np.float64): "double"}[np.dtype(dtype)]
    key = (device_id, ctype)
    with _LOCK:
        found = _KERNELS.get(key)
        if found is None:
            code = layout.cuda_defines() + SOURCE.read_text()
            rows = f"rh_score_rows<{ctype}>"
            with cp.cuda.Device(device_id):
                module = cp.RawModule(
                    code=code, options=COMPILE_OPTIONS, name_expressions=[rows, "rh_score_finish"]
                )
                found = (
                    module.get_function(rows),
                    module.get_function("rh_score_finish"),
                    int(
                        cp.cuda.runtime.deviceGetAttribute(
                            cp.cuda.runtime.cudaDevAttrMultiProcessorCount, device_id
                        )
                    ),
                )
            _KERNELS[key] = found
        return found


class PendingScores:
    """Scores queued on the grid's stream; :meth:`result` waits for them."""

    def __init__(self, grid: DeviceGrid, k: int) -> None:
        self._grid = grid
        self._k = k

    def result(self) -> tuple[np.ndarray, np.ndarray]:
        """``(huber_loss, mae)``, each of shape (k,), float64 host arrays."""
        self._grid.stream.synchronize()
        values = self._grid.scores_view(self._k)
        return values[:, 0].copy(), values[:, 1].copy()


class DeviceGrid:
    """Staging and scoring shared by a grid's GPU engines.

    Parameters
    ----------
    engines : sequence of GpuEngine
        One per configuration, all on one device with one dtype and
        ``fit_intercept``.
    reference_tau : float
        The τ of the prequential Huber loss.
    copy_threads : int, default=4
        Threads copying pageable host rows into pinned memory.
    """

    def __init__(
        self, engines: Sequence[Any], reference_tau: float, copy_threads: int = 4
    ) -> None:
        cp = import_cupy()
        self._cp = cp
        first = engines[0]
        self._device_id = resolve_device(cp, first.device)
        self._dtype = np.dtype(first.config.np_dtype)
        self._intercept = int(first.config.fit_intercept)
        self._tau = float(reference_tau)
        self._engine_streams = [e.stream for e in engines]
        self._calls = DriverCalls(cp)
        with cp.cuda.Device(self._device_id):
            self.stream = cp.cuda.Stream(non_blocking=True)
            self._caller_ready = cp.cuda.Event(disable_timing=True)
            self._ready = cp.cuda.Event(disable_timing=True)
            self._stager = HostStager(
                cp,
                self._device_id,
                self._dtype,
                copy_threads,
                calls=self._calls,
                pool=device_pool(cp, self._device_id),
            )
        self._rows, self._finish, sms = score_kernels(cp, self._device_id, self._dtype)
        self._max_grid = BLOCKS_PER_SM * sms
        self._betas_host: PinnedBuffer | None = None
        self._betas: Any = None
        self._partials: Any = None
        self._out: PinnedBuffer | None = None
        self._capacity = (0, 0)  # (configurations, parameters) the buffers hold
        self._closed = False

    # -- staging ----------------------------------------------------------------------
    def prefetch(self, X: Any, y: Any, w: Any | None = None) -> None:
        """Start copying a host batch to the device (the next :meth:`batch` of it takes it)."""
        if is_cuda(X) or self._closed:
            return
        X, y, w = self._check_host(X, y, w)
        self._stager.prefetch(X, y, w)

    @contextmanager
    def batch(
        self, X: Any, y: Any, w: Any | None, upcoming: tuple[Any, ...] | None = None
    ) -> Iterator[tuple[Any, Any, Any | None]]:
        """The batch on the device, with the device and the grid's stream current.

        Host arrays are staged once (or taken from a matching
        :meth:`prefetch`); device arrays are viewed, ordered after the
        caller's current stream. ``upcoming`` (the next batch's arrays) is
        then prefetched, so that its copy overlaps this batch's work. Inside
        the block, work queued on the grid's stream or by engines created
        from it reads the batch. On leaving, the grid waits for every
        engine's stream and for its own, after which the staging memory may
        be reused.

        Raises
        ------
        ValidationError
            For arrays of another dtype, device or layout than the grid's.
        """
        cp = self._cp
        with cp.cuda.Device(self._device_id):
            staged: StagedBatch | None = None
            if is_cuda(X):
                arrays = self._accept_device(X, y, w)
            else:
                Xh, yh, wh = self._check_host(X, y, w)
                staged = self._stager.take(Xh, yh, wh) or self._stager.stage(Xh, yh, wh)
                self._calls.stream_wait(self.stream.ptr, staged.slot.ready.ptr)
                arrays = (staged.X, staged.y, staged.w)
            self._ready.record(self.stream)
            if upcoming is not None:
                try:
                    self.prefetch(*upcoming)
                except ValidationError:
                    pass  # that batch is refused when its own turn comes
            try:
                with self.stream:
                    yield arrays
            finally:
                # Every reader of the copy has run once all the streams are done.
                for stream in self._engine_streams:
                    stream.synchronize()
                self.stream.synchronize()
                if staged is not None:
                    staged.slot.consumed.record(self.stream)

    def _check_host(self, X: Any, y: Any, w: Any | None) -> tuple[Any, Any, Any | None]:
        return check_host_batch(X, y, w, self._dtype, None)

    def _accept_device(self, X: Any, y: Any, w: Any | None) -> tuple[Any, Any, Any | None]:
        return accept_device_batch(
            self._cp,
            X,
            y,
            w,
            self._device_id,
            self._dtype,
            self.stream,
            self._caller_ready,
            None,
        )

    @property
    def ready(self) -> Any:
        """The event engines wait for before reading the current :meth:`batch` (a CUDA event).

        Recorded on the grid's stream once the batch is on the device (the
        scores queued after it are not waited for).
        """
        return self._ready

    # -- scores -----------------------------------------------------------------------
    def score(self, X: Any, y: Any, w: Any | None, betas: np.ndarray) -> PendingScores:
        """Queue every configuration's prequential scores of a batch from :meth:`batch`.

        Parameters
        ----------
        X, y, w
            The device arrays :meth:`batch` gave.
        betas : ndarray of shape (k, p)
            Each configuration's coefficients before the batch, intercept last.
        """
        cp = self._cp
        k, p = betas.shape
        n, d = int(X.shape[0]), int(X.shape[1])
        ldb = p + (p & 1)  # even: every vector starts 8-byte aligned in float32
        self._ensure(k, ldb)
        assert self._betas_host is not None and self._out is not None
        staging = self._betas_host.view(self._dtype, k * ldb).reshape(k, ldb)
        staging[:, :p] = betas
        item = self._dtype.itemsize
        self._calls.copy_to_device(
            int(self._betas.data.ptr), self._betas_host.ptr, k * ldb * item, self.stream.ptr
        )
        blocks = max(1, min(self._max_grid, -(-n // (layout.ROW_THREADS // 32))))
        shared = (d + self._intercept) * item
        if shared > 48 * 1024 - 3 * 8 * (layout.ROW_THREADS // 32):
            self._rows.max_dynamic_shared_size_bytes = shared
        with cp.cuda.Device(self._device_id):
            self._rows(
                (blocks, k),
                (layout.ROW_THREADS,),
                (
                    X,
                    np.int64(d),
                    np.int64(n),
                    np.int64(d),
                    y,
                    w if w is not None else np.uint64(0),
                    self._betas,
                    np.int64(ldb),
                    np.int64(self._intercept),
                    np.float64(self._tau),
                    self._partials,
                ),
                shared_mem=shared,
                stream=self.stream,
            )
            threads = 128
            self._finish(
                (-(-k // threads),),
                (threads,),
                (self._partials, np.int64(blocks), np.int64(k), np.uint64(self._out.ptr)),
                stream=self.stream,
            )
        return PendingScores(self, k)

    def scores_view(self, k: int) -> np.ndarray:
        """The mapped scores of the last :meth:`score`, shape (k, 2) (valid after a sync)."""
        assert self._out is not None
        return self._out.view(np.float64, 2 * k).reshape(k, 2)

    def _ensure(self, k: int, ldb: int) -> None:
        held_k, held_ldb = self._capacity
        if k <= held_k and ldb == held_ldb:
            return
        cp = self._cp
        self.stream.synchronize()  # nothing may still read the buffers replaced here
        for buffer in (self._betas_host, self._out):
            if buffer is not None:
                buffer.free()
        with cp.cuda.Device(self._device_id):
            item = self._dtype.itemsize
            self._betas_host = PinnedBuffer(cp, k * ldb * item)
            self._out = PinnedBuffer(cp, 2 * k * 8, mapped=True)
            self._betas = cp.zeros(k * ldb, dtype=self._dtype)
            self._partials = cp.zeros(k * self._max_grid * 3, dtype=np.float64)
        self._capacity = (k, ldb)

    def close(self) -> None:
        """Wait for the grid's copies and give its pinned memory back."""
        if self._closed:
            return
        self._closed = True
        with self._cp.cuda.Device(self._device_id):
            self.stream.synchronize()
            self._stager.close()
            for buffer in (self._betas_host, self._out):
                if buffer is not None:
                    buffer.free()
            self._betas_host = self._out = None
