"""The engine's per-batch CUDA calls, made without giving up the interpreter lock.

CuPy releases the GIL around every CUDA call that may block: kernel and graph
launches, asynchronous copies, stream waits. Each release is cheap on its
own, but a thread that gave the lock away must queue to get it back, and in a
Dask worker other threads are always waiting for it: with CuPy's bindings two
thirds of the engine thread's samples in a native profile of the distributed
fit wait for the lock after a CUDA call has returned (``docs/performance.md``,
"Where the engine's worker spends its time").

The calls bound here only *queue* work and return within microseconds, so
:class:`DriverCalls` makes them through the CUDA driver library loaded with
:class:`ctypes.PyDLL`, which keeps the lock for the duration of the call.
Synchronisations still release it: they wait for the device, and other
threads should run meanwhile. Host-to-device copies through here must come
from page-locked memory (from pageable memory the driver copies
synchronously, which would hold the lock for the whole copy).

:class:`DriverCalls` with ``hold_gil=False`` uses CuPy's bindings instead
(benchmarks compare both; ``GpuEngine(hold_gil=...)`` passes the choice down).
"""

from __future__ import annotations

import ctypes
import sys
import threading
from types import ModuleType
from typing import Any

_CUDA_SUCCESS = 0
_CUDA_ERROR_INVALID_CONTEXT = 201
_CUDA_ERROR_NOT_READY = 600
_LIBRARY_NAMES = ("nvcuda.dll",) if sys.platform == "win32" else ("libcuda.so.1", "libcuda.so")

_LOCK = threading.Lock()
_LIBRARY: Any = None
_LOAD_ERROR: str | None = None


def _driver_library() -> Any:
    """The CUDA driver library as a ``PyDLL`` with typed entry points, or None."""
    global _LIBRARY, _LOAD_ERROR
    with _LOCK:
        if _LIBRARY is not None or _LOAD_ERROR is not None:
            return _LIBRARY
        errors = []
        for name in _LIBRARY_NAMES:
            try:
                lib = ctypes.PyDLL(name)
                break
            except OSError as exc:
                errors.append(str(exc))
        else:
            _LOAD_ERROR = "; ".join(errors)
            return None
        vp, u, ull, sz = ctypes.c_void_p, ctypes.c_uint, ctypes.c_ulonglong, ctypes.c_size_t
        signatures = {
            "cuLaunchKernel": [vp, u, u, u, u, u, u, u, vp, vp, vp],
            "cuGraphLaunch": [vp, vp],
            "cuMemcpyHtoDAsync_v2": [ull, vp, sz, vp],
            "cuMemcpyDtoDAsync_v2": [ull, ull, sz, vp],
            "cuStreamWaitEvent": [vp, vp, u],
            "cuEventQuery": [vp],
        }
        try:
            for fname, argtypes in signatures.items():
                fn = getattr(lib, fname)
                fn.argtypes = argtypes
                fn.restype = ctypes.c_int
        except AttributeError as exc:  # a driver too old for one of them
            _LOAD_ERROR = str(exc)
            return None
        _LIBRARY = lib
        return lib


class DriverCalls:
    """The engine's queueing CUDA calls, bound once per engine.

    With ``hold_gil`` (and a loadable driver library) they go through
    ``PyDLL`` and keep the interpreter lock; otherwise through CuPy's
    bindings, which release it. Results are identical either way: the same
    work is queued on the same streams in the same order.

    Parameters
    ----------
    cp : module
        CuPy (for its error type and the fallback bindings).
    hold_gil : bool, default=True
        Make the queueing calls through the driver library, keeping the
        interpreter lock. :attr:`holds_gil` says whether they do (False
        when the library cannot be loaded).
    """

    def __init__(self, cp: ModuleType, hold_gil: bool = True) -> None:
        self._cp = cp
        self._lib = _driver_library() if hold_gil else None
        self.holds_gil = self._lib is not None
        if self._lib is not None:
            lib = self._lib
            self._launch = lib.cuLaunchKernel
            self._graph_launch = lib.cuGraphLaunch
            self._htod = lib.cuMemcpyHtoDAsync_v2
            self._dtod = lib.cuMemcpyDtoDAsync_v2
            self._wait = lib.cuStreamWaitEvent
            self._event_query = lib.cuEventQuery
        else:
            self._launch = cp.cuda.driver.launchKernel

    def _call(self, fn: Any, *args: Any) -> int:
        status = fn(*args)
        if status == _CUDA_ERROR_INVALID_CONTEXT:
            # A thread whose runtime calls so far needed no context (CuPy's
            # ``Device`` only reads the current device): bind the device's
            # primary context, as the runtime would, and retry.
            self._cp.cuda.runtime.free(0)
            status = fn(*args)
        return status

    def _check(self, status: int) -> None:
        if status != _CUDA_SUCCESS:
            raise self._cp.cuda.driver.CUDADriverError(status)

    def launch(
        self, function: int, grid: int, block: int, shared: int, stream: int, params: int
    ) -> None:
        """``cuLaunchKernel`` of a one-dimensional grid with a packed parameter array."""
        if self._lib is None:
            self._launch(function, grid, 1, 1, block, 1, 1, shared, stream, params, 0)
            return
        self._check(
            self._call(
                self._launch, function, grid, 1, 1, block, 1, 1, shared, stream, params, None
            )
        )

    def graph_launch(self, graph_exec: int, stream: int) -> None:
        if self._lib is None:
            self._cp.cuda.runtime.graphLaunch(graph_exec, stream)
            return
        self._check(self._call(self._graph_launch, graph_exec, stream))

    def copy_to_device(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        """Queue a copy from page-locked host memory ``src`` to device memory ``dst``."""
        if self._lib is None:
            rt = self._cp.cuda.runtime
            rt.memcpyAsync(dst, src, nbytes, rt.memcpyHostToDevice, stream)
            return
        self._check(self._call(self._htod, dst, src, nbytes, stream))

    def copy_on_device(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        """Queue a copy between two device buffers."""
        if self._lib is None:
            rt = self._cp.cuda.runtime
            rt.memcpyAsync(dst, src, nbytes, rt.memcpyDeviceToDevice, stream)
            return
        self._check(self._call(self._dtod, dst, src, nbytes, stream))

    def stream_wait(self, stream: int, event: int) -> None:
        """Work queued on ``stream`` from now on waits for ``event``."""
        if self._lib is None:
            self._cp.cuda.runtime.streamWaitEvent(stream, event)
            return
        self._check(self._call(self._wait, stream, event, 0))

    def event_done(self, event: int) -> bool:
        """Whether the work an event records has completed (never blocks)."""
        if self._lib is None:
            status = int(self._cp.cuda.runtime.eventQuery(event))
        else:
            status = self._call(self._event_query, event)
        if status == _CUDA_ERROR_NOT_READY:
            return False
        self._check(status)
        return True

    def synchronize(self, stream: Any) -> None:
        """Block until everything queued on a ``cupy.cuda.Stream`` has run.

        The wait releases the interpreter lock (CuPy's binding): other
        threads run while the device works.
        """
        stream.synchronize()

    def event_wait(self, event: Any) -> None:
        """Block until a ``cupy.cuda.Event`` completes; no lock hand-over if it already has."""
        if not self.event_done(event.ptr):
            event.synchronize()


# -- conditional graphs (built once per batch shape, so the lock is not kept) ----------

#: ``CUgraphNodeType`` of a conditional node (cuda.h, CUDA >= 12.3).
CU_GRAPH_NODE_TYPE_CONDITIONAL = 13
#: ``CUgraphConditionalNodeType``: the body runs again while the condition is non-zero.
CU_GRAPH_COND_TYPE_WHILE = 1
#: ``cuGraphConditionalHandleCreate`` flag: the default value is assigned at every launch.
CU_GRAPH_COND_ASSIGN_DEFAULT = 1
#: ``CUstreamCaptureMode``: relaxed, as the engine's other captures.
CU_STREAM_CAPTURE_MODE_RELAXED = 2
#: ``CUgraphNodeType`` names (cuda.h), for messages about a refused loop body.
NODE_TYPE_NAMES = (
    "kernel",
    "memcpy",
    "memset",
    "host",
    "child graph",
    "empty",
    "event wait",
    "event record",
    "semaphore signal",
    "semaphore wait",
    "memory allocation",
    "memory free",
    "batch memory op",
    "conditional",
)


class ConditionalNodeParams(ctypes.Structure):
    """``CUDA_CONDITIONAL_NODE_PARAMS`` (cuda.h): handle, type, size, phGraph_out, ctx."""

    _fields_ = [
        ("handle", ctypes.c_ulonglong),
        ("type", ctypes.c_int),
        ("size", ctypes.c_uint),
        ("phGraph_out", ctypes.POINTER(ctypes.c_void_p)),
        ("ctx", ctypes.c_void_p),
    ]


class GraphNodeParams(ctypes.Structure):
    """``CUgraphNodeParams`` (cuda.h) with its union's conditional member.

    The type, three reserved ints, a union of 29 ``long long`` (232 bytes)
    whose first 32 bytes are the conditional parameters, and a trailing
    reserved ``long long``: 256 bytes, every unused byte zero.
    """

    _fields_ = [
        ("type", ctypes.c_int),
        ("reserved0", ctypes.c_int * 3),
        ("conditional", ConditionalNodeParams),
        ("union_rest", ctypes.c_longlong * 25),
        ("reserved2", ctypes.c_longlong),
    ]


assert ctypes.sizeof(ConditionalNodeParams) == 32
assert ctypes.sizeof(GraphNodeParams) == 256
assert GraphNodeParams.conditional.offset == 16


_GRAPH_LOCK = threading.Lock()
_GRAPH_CALLS: GraphCalls | None = None
_GRAPH_ERROR: str | None = None


class GraphCalls:
    """The CUDA driver's graph-building entry points of a WHILE conditional node.

    Bound through ``ctypes.CDLL`` (these calls run once per batch shape, and
    may release the lock). Each method raises ``CUDADriverError`` on a
    failed call.

    Parameters
    ----------
    cp : module
        CuPy (its driver error type).
    lib : ctypes.CDLL
        The CUDA driver library with the signatures set by :func:`graph_calls`.
    add_node_v2 : bool
        Whether ``cuGraphAddNode_v2`` (with edge data, CUDA >= 12.3) is bound
        rather than the older ``cuGraphAddNode``.
    """

    def __init__(self, cp: ModuleType, lib: Any, add_node_v2: bool) -> None:
        self._cp = cp
        self._lib = lib
        self._add_node_v2 = add_node_v2

    def _check(self, status: int) -> None:
        if status != _CUDA_SUCCESS:
            raise self._cp.cuda.driver.CUDADriverError(status)

    def current_context(self) -> int:
        """The calling thread's current context (the device's primary context)."""
        ctx = ctypes.c_void_p()
        self._check(self._lib.cuCtxGetCurrent(ctypes.byref(ctx)))
        if not ctx.value:
            # A thread whose runtime calls needed no context yet: bind it, as
            # DriverCalls does, and ask again.
            self._cp.cuda.runtime.free(0)
            self._check(self._lib.cuCtxGetCurrent(ctypes.byref(ctx)))
        if not ctx.value:
            raise RuntimeError("no CUDA context is current on this thread")
        return int(ctx.value)

    def create_graph(self) -> int:
        graph = ctypes.c_void_p()
        self._check(self._lib.cuGraphCreate(ctypes.byref(graph), 0))
        return int(graph.value or 0)

    def destroy_graph(self, graph: int) -> None:
        self._check(self._lib.cuGraphDestroy(graph))

    def add_while_node(self, graph: int, ctx: int, default: int) -> tuple[int, int]:
        """Add a WHILE node to ``graph``; its condition handle and its (empty) body graph.

        The condition is set to ``default`` at every launch of the graph, so
        the body runs at least once when it is 1.
        """
        handle = ctypes.c_ulonglong()
        self._check(
            self._lib.cuGraphConditionalHandleCreate(
                ctypes.byref(handle), graph, ctx, default, CU_GRAPH_COND_ASSIGN_DEFAULT
            )
        )
        params = GraphNodeParams()  # ctypes zero-fills every byte
        params.type = CU_GRAPH_NODE_TYPE_CONDITIONAL
        params.conditional.handle = handle.value
        params.conditional.type = CU_GRAPH_COND_TYPE_WHILE
        params.conditional.size = 1
        params.conditional.ctx = ctx
        node = ctypes.c_void_p()
        if self._add_node_v2:
            status = self._lib.cuGraphAddNode_v2(
                ctypes.byref(node), graph, None, None, 0, ctypes.byref(params)
            )
        else:
            status = self._lib.cuGraphAddNode(
                ctypes.byref(node), graph, None, 0, ctypes.byref(params)
            )
        self._check(status)
        out = params.conditional.phGraph_out
        body = out[0] if out else None
        if not body:
            raise RuntimeError("cuGraphAddNode returned no body graph for the WHILE node")
        return int(handle.value), int(body)

    def begin_capture_to_graph(self, stream: int, graph: int) -> None:
        """Capture what ``stream`` queues from now on into the existing ``graph``."""
        self._check(
            self._lib.cuStreamBeginCaptureToGraph(
                stream, graph, None, None, 0, CU_STREAM_CAPTURE_MODE_RELAXED
            )
        )

    def end_capture(self, stream: int, check: bool = True) -> None:
        """End the capture on ``stream`` (the captured graph is the one it was given)."""
        graph = ctypes.c_void_p()
        status = self._lib.cuStreamEndCapture(stream, ctypes.byref(graph))
        if check:
            self._check(status)

    def node_types(self, graph: int) -> list[int]:
        """The ``CUgraphNodeType`` of each node of ``graph`` (its own level only)."""
        count = ctypes.c_size_t(0)
        self._check(self._lib.cuGraphGetNodes(graph, None, ctypes.byref(count)))
        nodes = (ctypes.c_void_p * max(count.value, 1))()
        self._check(self._lib.cuGraphGetNodes(graph, nodes, ctypes.byref(count)))
        kinds = []
        for node in nodes[: count.value]:
            kind = ctypes.c_int(-1)
            self._check(self._lib.cuGraphNodeGetType(node, ctypes.byref(kind)))
            kinds.append(int(kind.value))
        return kinds

    def instantiate(self, graph: int) -> int:
        exec_ = ctypes.c_void_p()
        self._check(self._lib.cuGraphInstantiateWithFlags(ctypes.byref(exec_), graph, 0))
        return int(exec_.value or 0)

    def destroy_exec(self, graph_exec: int) -> None:
        self._check(self._lib.cuGraphExecDestroy(graph_exec))


def graph_calls(cp: ModuleType) -> GraphCalls:
    """The process's :class:`GraphCalls`.

    Raises
    ------
    RuntimeError
        When the driver library cannot be loaded or lacks conditional graph
        nodes (``cuGraphConditionalHandleCreate``, ``cuStreamBeginCaptureToGraph``:
        drivers of CUDA 12.3 and later).
    """
    global _GRAPH_CALLS, _GRAPH_ERROR
    with _GRAPH_LOCK:
        if _GRAPH_CALLS is not None:
            return _GRAPH_CALLS
        if _GRAPH_ERROR is not None:
            raise RuntimeError(_GRAPH_ERROR)
        errors = []
        for name in _LIBRARY_NAMES:
            try:
                lib = ctypes.CDLL(name)
                break
            except OSError as exc:
                errors.append(str(exc))
        else:
            _GRAPH_ERROR = "the CUDA driver library cannot be loaded: " + "; ".join(errors)
            raise RuntimeError(_GRAPH_ERROR)
        vp, u, ull, sz, i = (
            ctypes.c_void_p,
            ctypes.c_uint,
            ctypes.c_ulonglong,
            ctypes.c_size_t,
            ctypes.c_int,
        )
        signatures = {
            "cuCtxGetCurrent": [vp],
            "cuGraphCreate": [vp, u],
            "cuGraphDestroy": [vp],
            "cuGraphConditionalHandleCreate": [vp, vp, vp, u, u],
            "cuStreamBeginCaptureToGraph": [vp, vp, vp, vp, sz, i],
            "cuStreamEndCapture": [vp, vp],
            "cuGraphInstantiateWithFlags": [vp, vp, ull],
            "cuGraphExecDestroy": [vp],
            "cuGraphGetNodes": [vp, vp, vp],
            "cuGraphNodeGetType": [vp, vp],
        }
        try:
            for fname, argtypes in signatures.items():
                fn = getattr(lib, fname)
                fn.argtypes = argtypes
                fn.restype = ctypes.c_int
            try:
                add = lib.cuGraphAddNode_v2
                add.argtypes = [vp, vp, vp, vp, sz, vp]
                v2 = True
            except AttributeError:
                add = lib.cuGraphAddNode
                add.argtypes = [vp, vp, vp, sz, vp]
                v2 = False
            add.restype = ctypes.c_int
        except AttributeError as exc:
            _GRAPH_ERROR = f"the CUDA driver has no conditional graph nodes ({exc})"
            raise RuntimeError(_GRAPH_ERROR) from None
        _GRAPH_CALLS = GraphCalls(cp, lib, v2)
        return _GRAPH_CALLS
