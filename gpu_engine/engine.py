"""``GpuEngine``: the renewable Huber estimator resident on one CUDA device.

The engine holds β and J on its device for the whole stream and moves only
a few hundred bytes of control data per iteration. It is a composition of
parts, each in its own module:

- :mod:`.inputs`: structural checks, zero-copy device views or pinned staging
  (:mod:`.transfer`), and the value checks ``rh_build`` flags on the device;
- :mod:`.batch`: one batch from ``rh_build`` to the committed counters;
- :mod:`.newton` and :mod:`.lamm`: the unpenalised and the L1 solve;
- :mod:`.commit`: the row pass, Gram GEMM and commit both solvers share;
- :mod:`.launch`: prepared kernel launches and captured CUDA graphs;
- :mod:`.state`: the counters, β's host mirror, import and export;
- :mod:`.predict`: Z β for host or device input.

Decisions follow the NumPy reference exactly (:mod:`rh_dask.core`): the same
schedule, the same difference form of the line-search and LAMM tests, the
same singularity rule. docs/gpu-engine.md describes the kernels.
"""

from __future__ import annotations

from collections.abc import Generator, Iterable, Iterator, Sequence
from typing import Any, ClassVar

import numpy as np

from rh_dask.config import HuberConfig
from rh_dask.exceptions import ValidationError
from rh_dask.state import BatchDiagnostics, HuberState

from ._cuda import import_cupy, resolve_device
from .batch import BatchRunner, run_to_end
from .device_loop import DEVICE_LOOP_MODES, DeviceLoop
from .driver import DriverCalls
from .grid import DeviceGrid
from .host_pool import device_pool
from .inputs import BatchInputs
from .kernels import get_kernels
from .lamm import LammDriver
from .launch import Launcher
from .newton import CHOLESKY_MODES, NewtonDriver
from .parts import DeviceParts
from .predict import Predictor
from .solver import DenseSolver
from .state import DeviceState, HeldState
from .transfer import HostStager, PinnedPool
from .workspace import Workspace

__all__ = ["GpuEngine"]

#: Row kernels run at most this many blocks of ``layout.ROW_THREADS`` threads
#: per multiprocessor and stride over the remaining rows. The grid size fixes
#: the order in which the last block adds the blocks' partial sums, so it is a
#: constant of the engine rather than a setting: another value gives other
#: (equally valid) bits. Two blocks per multiprocessor keep every SM busy while
#: the final sum over partials stays short.
BLOCKS_PER_SM = 2


def _check_flag(name: str, value: Any) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise ValidationError(f"{name} must be True or False, got {value!r}")
    return bool(value)


class GpuEngine:
    """Renewable Huber engine on one CUDA device (CuPy + RawKernels + cuSOLVER).

    Parameters
    ----------
    config : HuberConfig
        Statistical and solver parameters of the stream.
    device : None, "cuda", "cuda:N", int or cupy.cuda.Device
        The device the engine lives on (``None``: device 0).
    graphs : bool, default=True
        Replay each iteration body as a captured CUDA graph (one launch per
        iteration instead of six). Falls back to plain launches if capture
        fails (:attr:`graph_error` says why). The results are the same bits
        either way.
    hold_gil : bool, default=True
        Queue launches, copies and stream waits through the CUDA driver
        library without releasing the interpreter lock (see
        docs/gpu-engine.md); ``False`` uses CuPy's bindings, which release
        it around every call. The results are the same bits either way.
    copy_threads : int, default=4
        Threads that copy host (NumPy) batches into pinned staging memory
        (the process's, shared by the engines asking for as many).
    cholesky : {"auto", "kernel", "blocked", "columns", "tiles", "cusolver"}, default="auto"
        How the Newton system is factorised. ``"cusolver"``: cuSOLVER
        ``potrf``/``potrs`` on a preallocated workspace. ``"kernel"``: the
        engine's fused one-block kernel (assembly, Cholesky and both
        triangular solves in shared memory), which needs the p×p system to
        fit in shared memory. ``"blocked"``: the same in one block with a
        blocked factorisation (32-column panels, three block barriers per
        panel instead of one per column), meant for p of about 33-128;
        on an H200 it matched the reference but stayed slower than cuSOLVER
        at p = 91. ``"columns"``: one block in which each warp holds its
        columns of the factor in registers and the right-hand side rides
        along as an extra row (one block barrier per column, the forward
        solve made by the factorisation), for p ≤ 128. ``"tiles"``: one
        block factorising 32-column tiles in one warp's registers (shuffles,
        no barrier within a tile), the rows below a tile a thread each, and
        the back substitution by tiles the same way, for p ≤ 256 where
        shared memory holds the system. ``"auto"`` takes
        ``"columns"`` up to p = 33, ``"tiles"`` up to p = 128 and cuSOLVER
        above (see
        docs/gpu-engine.md for the measurements). An explicit one-block
        mode raises :class:`ValidationError` for a system it cannot hold.
        The LU and minimum-norm fallbacks always use cuSOLVER.
    score_variance : bool, default=True
        Accumulate the score variance K = Σ Zᵀ diag(w ψ²) Z (the sandwich's
        meat, :attr:`rh_dask.HuberState.score_variance`) at each committed
        batch, for standard errors: one more pass over the batch and one
        p×p GEMM per batch. ``False``: the exported state has K = ``None``.
        A penalised stream leaves K out whatever this says
        (:attr:`~rh_dask.HuberConfig.keeps_score_variance`).
    diagnostics : bool, default=False
        Report each batch's robust diagnostics in its
        :class:`~rh_dask.state.BatchDiagnostics` (``mean_loss``,
        ``outlier_share``, ``residual_scale``: :mod:`rh_dask.residuals`),
        computed on the device at the committed β (two sorts of the batch's
        residuals and one small copy to the host: on an H200 about 1 ms per
        100,000 × 90 float32 batch, more than its solve). ``False``: they are
        ``None``.
    device_loop : {"auto", "on", "off"}, default="off"
        How the Newton iterations of an unpenalised batch are driven.
        ``"off"``: the host loop, one graph launch and one host
        synchronisation per iteration. ``"on"``: the device loop, a CUDA
        graph WHILE conditional node whose body is one iteration, so one
        launch and one synchronisation per batch (plus one per singular
        factor, whose fallback runs on the host); it needs ``graphs=True``
        and a driver with conditional graph nodes (CUDA 12.3 or later).
        ``"auto"``: the device loop where it can be built, else the host
        loop (:attr:`device_loop_error` says why). The results are the same
        bits either way. The L1 solve queues its rounds without
        synchronising already and is not affected. The default is ``"off"``:
        on an H200 the device loop was slower than the host loop
        (docs/gpu-engine.md, device loop).
    wide_kernels : bool, default=True
        For p ≥ 256 (``layout.WIDE_MIN_P``), run the Newton assembly, the
        products with J and the commit's J update as grid kernels instead of
        one block (docs/gpu-engine.md, wide designs). Other bits than the
        one-block kernels (1e-16 to 3e-14 apart, relative, at p = 601 on an
        H200), within the contract's tolerances; 1.5-2.6x faster per float64
        stream at p = 512-2048. False keeps the one-block kernels.
    pinned_idle_bytes : int, optional
        The most bytes of pinned staging memory the process keeps idle for
        the device's next engine (:mod:`gpu_engine.host_pool`); it bounds
        the device's pool for every engine of the process from now on.
        ``None`` (the default) leaves the bound as it is (256 MiB unless set);
        the estimator passes ``rh-dask.gpu.pinned-idle-bytes``.

    Raises
    ------
    ValidationError
        When ``graphs``, ``hold_gil``, ``score_variance``, ``diagnostics`` or
        ``wide_kernels`` is not a bool,
        ``cholesky`` or ``device_loop`` is not one of its choices,
        ``device_loop="on"`` comes with ``graphs=False``, or
        ``pinned_idle_bytes`` is not a whole number >= 0.
    EngineUnavailableError
        When CuPy, a CUDA driver or the requested device is missing, or
        ``device_loop="on"`` where the driver lacks conditional graph nodes.

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
        graphs: bool = True,
        hold_gil: bool = True,
        copy_threads: int = 4,
        cholesky: str = "auto",
        score_variance: bool = True,
        diagnostics: bool = False,
        device_loop: str = "off",
        pinned_idle_bytes: int | None = None,
        wide_kernels: bool = True,
    ) -> None:
        graphs = _check_flag("graphs", graphs)
        wide_kernels = _check_flag("wide_kernels", wide_kernels)
        if pinned_idle_bytes is not None and (
            isinstance(pinned_idle_bytes, bool)
            or not isinstance(pinned_idle_bytes, (int, np.integer))
            or pinned_idle_bytes < 0
        ):
            raise ValidationError(
                f"pinned_idle_bytes must be a whole number >= 0 or None, got {pinned_idle_bytes!r}"
            )
        # An L1 stream leaves K out whatever the flag says (no inference for L1).
        self._score_variance = (
            _check_flag("score_variance", score_variance) and config.keeps_score_variance
        )
        self._diagnostics = _check_flag("diagnostics", diagnostics)
        hold_gil = _check_flag("hold_gil", hold_gil)
        if cholesky not in CHOLESKY_MODES:
            raise ValidationError(
                "cholesky must be one of "
                + ", ".join(repr(mode) for mode in CHOLESKY_MODES)
                + f", got {cholesky!r}"
            )
        if not isinstance(device_loop, str) or device_loop not in DEVICE_LOOP_MODES:
            raise ValidationError(
                f"device_loop must be 'auto', 'on' or 'off', got {device_loop!r}"
            )
        if device_loop == "on" and not graphs:
            raise ValidationError(
                "device_loop='on' needs graphs=True (the device loop is a graph)"
            )
        cp = import_cupy()
        self._cp = cp
        self.config = config
        self._dtype = config.np_dtype
        self._device_id = resolve_device(cp, device)
        self._closed = True
        self._last_batch_weight: float | None = None
        with cp.cuda.Device(self._device_id):
            kernels = get_kernels(cp, self._device_id, self._dtype)
            self._calls = DriverCalls(cp, hold_gil=hold_gil)
            self._stream = stream = cp.cuda.Stream(non_blocking=True)
            # First of the parts that can refuse (device_loop="on"): nothing to release yet.
            self._loop = DeviceLoop(cp, self._device_id, self._calls, stream, device_loop, graphs)
            self._dense = DenseSolver(cp, self._device_id, stream, self._dtype)
            max_grid = BLOCKS_PER_SM * kernels.multiprocessors
            self._ws = Workspace(cp, self._dtype, max_grid, wide_kernels=wide_kernels)
            self._host_pool = device_pool(cp, self._device_id)
            if pinned_idle_bytes is not None:
                self._host_pool.max_idle_bytes = int(pinned_idle_bytes)
            stager = HostStager(
                cp,
                self._device_id,
                self._dtype,
                copy_threads,
                calls=self._calls,
                pool=self._host_pool,
            )
            self._inputs = BatchInputs(
                cp, self._device_id, self._dtype, stream, stager, self._calls
            )
            self._launcher = Launcher(cp, kernels, self._calls, stream, max_grid, graphs)
            self._state = DeviceState(cp, self._device_id, stream, self._ws, self._calls)
            self._predictor = Predictor(
                cp,
                self._device_id,
                self._dtype,
                stream,
                kernels,
                self._ws,
                self._launcher,
                self._state,
            )
        parts = DeviceParts(
            config, kernels, self._calls, stream, self._dense, self._ws, self._launcher
        )
        self._newton = NewtonDriver(parts, cholesky, self._loop)
        self._lamm = LammDriver(parts)
        self._batches = BatchRunner(parts, self._newton, self._lamm, cp, self._diagnostics)
        self._closed = False
        self._pinned_pool: PinnedPool | None = None

    @property
    def pinned_pool(self) -> PinnedPool:
        """Pinned buffers that other threads may copy host batches into (created on first use).

        A batch copied there (:meth:`PinnedPool.copy_batch`) reaches this
        engine's device by DMA alone, so the copy runs on the caller's thread
        instead of the engine's. The distributed walk's loading tasks use it.
        Its buffers are leased from the device's process pool and go back
        there when the engine closes.
        """
        if self._pinned_pool is None:
            self._pinned_pool = PinnedPool(
                self._cp, self._device_id, self._dtype, source=self._host_pool
            )
        return self._pinned_pool

    # -- interface properties -----------------------------------------------------
    @property
    def device(self) -> str:
        return f"cuda:{self._device_id}"

    @property
    def n_features_in(self) -> int | None:
        counters = self._state.counters
        return None if counters is None else counters.n_features_in

    @property
    def batch_count(self) -> int:
        counters = self._state.counters
        return 0 if counters is None else counters.batch_count

    @property
    def n_samples_seen(self) -> int:
        counters = self._state.counters
        return 0 if counters is None else counters.n_samples_seen

    @property
    def stream(self) -> Any:
        """The engine's CUDA stream (``cupy.cuda.Stream``), where all its device work is queued."""
        return self._stream

    @property
    def graphs(self) -> bool:
        """Whether iteration bodies are replayed as CUDA graphs."""
        return self._launcher.graphs

    @property
    def graph_error(self) -> str | None:
        """Why graph capture was turned off, if it failed."""
        return self._launcher.graph_error

    @property
    def device_loop(self) -> bool:
        """Whether the Newton iterations run as a device loop (one synchronisation per batch).

        True while ``device_loop`` is ``"on"``, or ``"auto"`` and nothing has
        stopped it; it turns False when a loop graph fails to build
        (:attr:`device_loop_error`) or graphs are turned off by a failed
        capture.
        """
        return self._loop.enabled and (self._launcher.graphs or self._loop.mode == "on")

    @property
    def device_loop_error(self) -> str | None:
        """Why ``device_loop="auto"`` runs the host loop, if something stopped the device loop."""
        return self._loop.error

    @property
    def holds_gil(self) -> bool:
        """Whether queueing CUDA calls keep the interpreter lock.

        False with ``hold_gil=False``, or when the CUDA driver library
        cannot be loaded through ``ctypes`` (CuPy's bindings are used then).
        """
        return self._calls.holds_gil

    @property
    def cublas_math_mode(self) -> int:
        """The cuBLAS math mode of the engine's handle (0: default IEEE, never TF32)."""
        return self._dense.math_mode

    # -- state ---------------------------------------------------------------------
    @property
    def last_batch_weight(self) -> float | None:
        """Σw of the last batch (its row count when unweighted), as added to ``weight_sum``.

        Computed on the device (correctly rounded, as the NumPy engine's); None
        before the first batch and after :meth:`reset`, :meth:`import_state`
        or :meth:`put_back`.
        """
        return self._last_batch_weight

    def reset(self) -> None:
        """Forget the stream; workspaces, handles and graphs are kept."""
        self._inputs.stager.discard_pending()
        self._state.forget()
        self._last_batch_weight = None

    def coefficients(self) -> np.ndarray:
        """A host copy of β (intercept last)."""
        return self._state.beta_on_host(self._closed).copy()

    def export_state(self) -> HuberState:
        """A host (NumPy) copy of the portable state.

        Raises
        ------
        NotFittedError
            When the engine has consumed no batch.
        """
        return self._state.export()

    def import_state(self, state: HuberState) -> None:
        """Continue a stream from a portable state (a checkpoint, another engine).

        Raises
        ------
        ValidationError
            When the state's ``fit_intercept`` differs from the engine's
            configuration or the state is malformed; the engine is unchanged.
        """
        self._state.load(state, self.config.fit_intercept, self._dtype)
        self._last_batch_weight = None

    def close(self) -> None:
        """Give pinned memory and library handles back to the process's pools; free the rest.

        Only this engine's leases go back (another live engine's are its own),
        once the copies out of them are over.
        """
        self._close(finalising=False)

    def _close(self, finalising: bool) -> None:
        if getattr(self, "_closed", True):
            return
        self._closed = True
        with self._cp.cuda.Device(self._device_id):
            if finalising:
                # Collected as part of a reference cycle, this engine's CuPy stream
                # and events may have been finalised (destroyed) before it: wait for
                # the whole device instead of touching them. The staging fences are
                # RawEvents, which only the pinned pool destroys.
                self._cp.cuda.runtime.deviceSynchronize()
            else:
                self._stream.synchronize()
            self._inputs.stager.close()
            if self._pinned_pool is not None:
                self._pinned_pool.close()
            self._launcher.drop()
            self._ws.close()
            self._dense.close()

    def __del__(self) -> None:  # pragma: no cover - depends on interpreter shutdown
        try:
            self._close(finalising=True)
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
        self._inputs.prefetch(X, y, sample_weight, self.n_features_in)

    def partial_fit_stream(self, batches: Iterable[tuple[Any, ...]]) -> Iterator[BatchDiagnostics]:
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
                inputs = self._device_views(*current)
                if upcoming is not None:
                    self.prefetch(*upcoming)
                yield self._fit(*inputs)
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
            return self._fit(*self._device_views(X, y, sample_weight))

    def predict(self, X: Any) -> Any:
        """Z β: NumPy out for host input, CuPy (on the engine's device) for device input."""
        return self._predictor.predict(X, self._closed)

    # -- advancing several engines together ------------------------------------------------
    def batch_steps(
        self, X: Any, y: Any, sample_weight: Any | None = None, *, checked: Any = None
    ) -> Generator[Any, None, BatchDiagnostics]:
        """:meth:`partial_fit` as a generator that yields wherever the host must wait.

        Each ``yield`` hands out the engine's CUDA stream, with work queued on
        it whose result the next step reads: the caller calls the stream's
        ``synchronize()`` before resuming the generator. The generator's
        return value is the batch's diagnostics. Several engines' generators
        can be resumed in turn on one thread and their streams waited for
        together, so that one engine's work runs on the device while the
        host prepares another's (:mod:`gpu_engine.grid`); each engine queues
        exactly the work of its :meth:`partial_fit`, so the results are the
        same bits. Device inputs are ordered after the stream that is current
        when the generator is first resumed. Atomic on failure, as
        :meth:`partial_fit`; a generator closed before its end leaves the
        batch uncounted, with β, J and K in any state (:meth:`hold` and
        :meth:`put_back` restore them). ``checked``, a CUDA event (a
        ``cupy.cuda.Event``), says the arrays are device arrays already
        checked for this engine's device, dtype, layout and shapes (a
        grid's shared copy, made by the work the event follows): only the
        width against the stream is checked again, and the engine's stream
        waits for the event.
        """
        cp = self._cp
        with cp.cuda.Device(self._device_id):
            if checked is not None:
                views = self._inputs.checked_views(
                    X, y, sample_weight, self.n_features_in, checked
                )
            else:
                views = self._device_views(X, y, sample_weight)
            steps = self._fit_steps(*views)
        try:
            while True:
                with cp.cuda.Device(self._device_id), self._stream:
                    try:
                        next(steps)
                    except StopIteration as stop:
                        return stop.value
                yield self._stream
        finally:
            steps.close()

    @staticmethod
    def grid_device(engines: Sequence[GpuEngine], reference_tau: float) -> DeviceGrid:
        """What a grid of these engines shares: one device copy of each batch, and its scores.

        See :mod:`gpu_engine.grid` (the engines must share a device, dtype
        and ``fit_intercept``, as a grid's do).
        """
        return DeviceGrid(engines, reference_tau)

    def hold(self) -> HeldState:
        """Keep a copy of the stream's state on the device, for :meth:`put_back`.

        The copies of β, J and K are queued on the engine's stream (no
        synchronisation, no host copy); only the latest hold is kept.
        """
        with self._cp.cuda.Device(self._device_id), self._stream:
            return self._state.hold()

    def put_back(self, held: HeldState) -> None:
        """Return to the state of :meth:`hold`, whatever happened since (a batch half done)."""
        with self._cp.cuda.Device(self._device_id):
            self._state.put_back(held)
        self._last_batch_weight = None

    # -- internals ---------------------------------------------------------------------
    def _device_views(self, X: Any, y: Any, sample_weight: Any | None = None) -> tuple[Any, ...]:
        return self._inputs.device_views(X, y, sample_weight, self.n_features_in)

    def _fit(self, X: Any, y: Any, w: Any | None, staged: Any) -> BatchDiagnostics:
        with self._stream:
            return run_to_end(
                self._fit_steps(X, y, w, staged), lambda: self._calls.synchronize(self._stream)
            )

    def _fit_steps(
        self, X: Any, y: Any, w: Any | None, staged: Any
    ) -> Generator[None, None, BatchDiagnostics]:
        accumulate_k = self._state.accumulates_k(self._score_variance)
        diagnostics, counters, batch_weight = yield from self._batches.steps(
            X, y, w, staged, self._state.counters, accumulate_k
        )
        self._state.advance(counters, accumulated_k=accumulate_k)
        self._last_batch_weight = batch_weight
        return diagnostics
