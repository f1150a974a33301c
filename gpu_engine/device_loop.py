"""The Newton iterations of a batch on the device: one WHILE conditional graph.

With the host loop (:meth:`NewtonDriver._host_loop`) every iteration is one
graph launch followed by a host synchronisation, after which the host reads
the status block and decides whether to launch the next. The device loop
puts the same step graph's work into the body of a CUDA graph WHILE node
(CUDA 12.3 and later) and ends the body with ``rh_loop_continue``, one
thread that sets the node's condition to "the solve is still open": not
stopped, not refused, and no singular factor for the host to handle. One
launch and one synchronisation then cover every iteration up to the end of
the solve, or up to a singular factor, whose LU/minimum-norm fallback runs on the
host as before; the loop is launched again after it when the solve goes on.

The body's kernels, library calls and their order are those of the host
loop's step graph, so the two give the same bits; ``rh_loop_continue``
writes only its own pass counter and the condition. The counter bounds the
passes of one launch by the iteration cap even if a kernel failed to stop
the solve (the search's cap makes that unreachable), so the device can never
spin forever; it is reset whenever the loop ends.

A conditional body may hold only kernel, memset, memcpy, empty, child graph
and conditional nodes. A cuBLAS call captured while its handle has the
default workspace (cuBLAS 12.2 and later) allocates the workspace with
``cudaMallocAsync``: a memory allocation node, which a body refuses. So
before the first loop is captured the engine's cuBLAS handle gets a
workspace of its own, of the size of cuBLAS's default pool
(:func:`blas_workspace_bytes`), kept for the engine's life
(:meth:`DeviceLoop.bind_blas_workspace`). A refused body names its nodes in
the error (:class:`~gpu_engine.launch.LoopGraph`). cuSOLVER's factorisation
still allocates inside a capture (two allocation and two free nodes on the
H200 with CUDA 13), so the loop holds only the fused one-block solve
(``cholesky="kernel"`` or ``"blocked"``, or ``"auto"`` where the system fits
in shared memory); a solve through cuSOLVER keeps the host loop.

The kernel is compiled separately from ``huber.cu`` (a toolkit that cannot
compile it must not cost the engine its other kernels). Its one device
runtime call, ``cudaGraphSetConditional``, needs only its declaration under
NVRTC and no ``-rdc``: the compiler leaves it an undefined function that the
driver binds when it loads the module, as it binds ``vprintf``. Where the
kernel cannot be compiled, or the driver lacks conditional nodes, or the
body cannot be captured into one, ``device_loop="auto"`` keeps the host
loop and says why in :attr:`DeviceLoop.error`; ``device_loop="on"`` raises.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

import numpy as np

from rh_dask.exceptions import EngineUnavailableError

from . import layout
from .driver import DriverCalls, graph_calls
from .launch import Launch, LoopGraph
from .solver import _loaded_library

#: The ways ``GpuEngine(device_loop=...)`` may run the Newton iterations.
DEVICE_LOOP_MODES = ("auto", "on", "off")

_KERNEL = r"""
extern "C" __global__ void rh_loop_continue(const double* __restrict__ ctl,
                                            unsigned int* __restrict__ passes,
                                            unsigned long long handle) {
  // One thread, the body's last kernel: loop again while the solve is open
  // (not stopped, not refused) and no singular factor waits for the host,
  // and never more passes in one launch than the iteration cap.
  const int* ci = reinterpret_cast<const int*>(ctl + RH_N_DOUBLE);
  const unsigned int pass = passes[0] + 1u;
  const bool again = ci[RH_I_DONE] == 0 && ci[RH_I_INVALID] == 0 &&
                     ci[RH_I_FALLBACK] == 0 && (double)pass < ctl[RH_P_MAX_ITER];
  passes[0] = again ? pass : 0u;
  cudaGraphSetConditional(handle, again ? 1u : 0u);
}
"""

#: How ``cudaGraphSetConditional`` is made known to NVRTC, tried in order: the
#: declaration of the CUDA headers alone (no include path needed), then the header.
_PREAMBLES = (
    'extern "C" __device__ __cudart_builtin__ void '
    "cudaGraphSetConditional(unsigned long long handle, unsigned int value);\n",
    "#include <cuda_device_runtime_api.h>\n",
)

_LOCK = threading.Lock()
_KERNELS: dict[int, Any] = {}
_ERRORS: dict[int, str] = {}
_SET_WORKSPACE: Any = None


def blas_workspace_bytes(compute_capability: int) -> int:
    """cuBLAS's default workspace pool on a device: 32 MiB from Hopper (9.0) on, else 4 MiB.

    The loop's handle gets a workspace of this size so that cuBLAS has the
    room, and so picks the algorithms, that it has with its default pool.
    """
    return (32 if compute_capability >= 90 else 4) * 1024 * 1024


def _set_blas_workspace(handle: int, ptr: int, nbytes: int) -> int:
    """``cublasSetWorkspace_v2(handle, ptr, nbytes)`` through the cuBLAS that CuPy loaded."""
    global _SET_WORKSPACE
    with _LOCK:
        if _SET_WORKSPACE is None:
            fn = _loaded_library("cublas").cublasSetWorkspace_v2
            fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
            fn.restype = ctypes.c_int
            _SET_WORKSPACE = fn
    return int(_SET_WORKSPACE(handle, ptr, nbytes))


def loop_kernel(cp: ModuleType, device_id: int) -> Any:
    """``rh_loop_continue`` compiled for ``device_id`` (a ``cupy.RawKernel``, loaded).

    Raises
    ------
    RuntimeError
        When NVRTC cannot compile it (the message holds each attempt's error).
    """
    with _LOCK:
        if device_id in _KERNELS:
            return _KERNELS[device_id]
        if device_id in _ERRORS:
            raise RuntimeError(_ERRORS[device_id])
        errors = []
        with cp.cuda.Device(device_id):
            for preamble in _PREAMBLES:
                try:
                    module = cp.RawModule(
                        code=layout.cuda_defines() + preamble + _KERNEL, options=("--std=c++17",)
                    )
                    kernel = module.get_function("rh_loop_continue")
                    _ = kernel.kernel  # load now: never inside a graph capture
                except Exception as exc:  # NVRTC's compile error, a missing header
                    errors.append(f"{type(exc).__name__}: {exc}".strip())
                    continue
                _KERNELS[device_id] = kernel
                return kernel
        _ERRORS[device_id] = "rh_loop_continue does not compile: " + " | ".join(errors)
        raise RuntimeError(_ERRORS[device_id])


class DeviceLoop:
    """Whether the engine's Newton iterations run as a device loop, and its parts.

    Parameters
    ----------
    cp : module
        CuPy.
    device_id : int
        The engine's device.
    calls : DriverCalls
        Launches the loop graphs.
    stream : cupy.cuda.Stream
        The engine's stream.
    mode : {"auto", "on", "off"}
        ``"off"``: the host loop. ``"auto"``: the device loop where it can be
        built, else the host loop (:attr:`error` says why). ``"on"``: the
        device loop or an error.
    graphs : bool
        Whether the engine replays CUDA graphs (the device loop is one).

    Raises
    ------
    EngineUnavailableError
        With ``mode="on"``, when the driver lacks conditional graph nodes or
        the loop's kernel cannot be compiled.
    """

    def __init__(
        self,
        cp: ModuleType,
        device_id: int,
        calls: DriverCalls,
        stream: Any,
        mode: str,
        graphs: bool,
    ) -> None:
        self.mode = mode
        #: Why the Newton iterations run on the host loop (None: nothing failed).
        self.error: str | None = None
        #: Whether the next Newton solve tries the device loop.
        self.enabled = False
        self._cp = cp
        self._device_id = device_id
        self._calls = calls
        self._stream = stream
        self._graph_calls: Any = None
        self._kernel: Any = None
        self._passes: Any = None
        self._blas_workspace: Any = None
        self._blas_handle: int | None = None
        if mode == "off":
            return
        try:
            if not graphs:
                raise RuntimeError("CUDA graphs are off (graphs=False)")
            self._graph_calls = graph_calls(cp)
            self._kernel = loop_kernel(cp, device_id)
            # Zeroed on the engine's stream (non-blocking: the legacy stream's
            # memset would not be ordered before the first loop launch).
            with cp.cuda.Device(device_id), stream:
                self._passes = cp.zeros(1, dtype=np.uint32)
        except Exception as exc:
            if mode == "on":
                raise EngineUnavailableError(
                    f"device_loop='on' cannot be used here: {exc}"
                ) from exc
            self.error = str(exc)
            return
        self.enabled = True

    def bind_blas_workspace(self, blas: int) -> None:
        """Give the cuBLAS handle ``blas`` this loop's own workspace (once per handle).

        Captured with its default workspace, a cuBLAS call allocates one
        with ``cudaMallocAsync``, a node that a conditional body may not
        hold; with a workspace set it allocates nothing. The workspace lives
        as long as this object (the engine), so every graph captured with it
        stays valid; the handle keeps it until ``cublasSetStream`` (the next
        engine that leases the handle) restores the default pool.

        Raises
        ------
        RuntimeError
            When cuBLAS refuses the workspace.
        """
        if self._blas_handle == blas:
            return
        cp = self._cp
        with cp.cuda.Device(self._device_id):
            if self._blas_workspace is None:
                # CuPy writes the capability as digits: "90" for 9.0
                capability = int(cp.cuda.Device(self._device_id).compute_capability)
                self._blas_workspace = cp.empty(blas_workspace_bytes(capability), dtype=np.uint8)
            workspace = self._blas_workspace
            status = _set_blas_workspace(blas, int(workspace.data.ptr), int(workspace.nbytes))
        if status != 0:
            raise RuntimeError(f"cublasSetWorkspace failed with status {status}")
        self._blas_handle = blas

    def build(self, ctl: Any, body: Callable[[], None], blas: int) -> LoopGraph:
        """A loop graph whose every pass is ``body`` followed by ``rh_loop_continue``.

        ``blas`` is the engine's cuBLAS handle, which gets the loop's
        workspace first (:meth:`bind_blas_workspace`). Raises whatever the
        driver refuses; :meth:`give_up` decides what follows.
        """
        self.bind_blas_workspace(blas)

        def one_pass(handle: int) -> None:
            body()
            # Every launch parameter is packed as a signed 64-bit value.
            signed = handle - (1 << 64) if handle >= 1 << 63 else handle
            Launch(self._calls, self._kernel, 1, 1, (ctl, self._passes, signed))(self._stream.ptr)

        return LoopGraph(self._graph_calls, self._calls, self._stream, one_pass)

    def give_up(self, exc: BaseException) -> None:
        """A loop graph could not be built: the host loop from now on, or an error for "on".

        Raises
        ------
        EngineUnavailableError
            With ``mode="on"``.
        """
        reason = f"{type(exc).__name__}: {exc}"
        if self.mode == "on":
            raise EngineUnavailableError(
                f"device_loop='on', but the Newton loop graph cannot be built: {reason}"
            ) from exc
        self.enabled = False
        self.error = reason
