"""Kernel launches and CUDA graphs: how the engine's work is queued on its stream.

:class:`Launch` is one kernel launch with its parameters packed once;
:class:`CapturedGraph` is a CUDA graph captured from a stream; :class:`Launcher`
is the engine's cache of both, and of :class:`LoopGraph`, a graph of one
WHILE conditional node whose body is a captured launch body. A *launch body*
(a callable that queues a fixed sequence of launches and library calls) is
captured into a graph on its first use and replayed from then on, or run
directly when graphs are off.
Prepared launches and graphs hold device addresses, so they are dropped
whenever the workspace's buffers move (:attr:`Workspace.generation`).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from types import ModuleType
from typing import Any

from . import layout
from .driver import NODE_TYPE_NAMES, DriverCalls, GraphCalls
from .kernels import Kernels


class Launch:
    """One kernel launch with its parameters packed once.

    CuPy's ``RawKernel.__call__`` inspects and converts every argument on
    every call (several microseconds for a dozen arguments); the iteration
    kernels are launched with the same arguments thousands of times, so they
    are packed into a ctypes parameter block once and launched through
    ``cuLaunchKernel`` directly (:class:`gpu_engine.driver.DriverCalls`).
    Every parameter of these kernels is 8 bytes (a pointer or a ``long long``).

    Parameters
    ----------
    calls : DriverCalls
        Makes the launch.
    kernel : cupy.RawKernel
        The kernel (its device's context must be current).
    grid, block : int
        One-dimensional launch shape.
    args : sequence
        CuPy arrays (passed as device pointers) and Python ints.
    shared_mem : int
        Dynamic shared memory in bytes.
    """

    __slots__ = ("_block", "_calls", "_fptr", "_grid", "_params", "_ptrs", "_shared", "_values")

    def __init__(
        self,
        calls: DriverCalls,
        kernel: Any,
        grid: int,
        block: int,
        args: Any,
        shared_mem: int = 0,
    ) -> None:
        values = [int(a.data.ptr) if hasattr(a, "data") else int(a) for a in args]
        self._values = (ctypes.c_int64 * len(values))(*values)
        base = ctypes.addressof(self._values)
        self._ptrs = (ctypes.c_void_p * len(values))(*[base + 8 * i for i in range(len(values))])
        self._params = ctypes.addressof(self._ptrs)
        self._fptr = int(kernel.kernel.ptr)
        self._calls = calls
        self._grid, self._block, self._shared = int(grid), int(block), int(shared_mem)

    def __call__(self, stream_ptr: int) -> None:
        self._calls.launch(
            self._fptr, self._grid, self._block, self._shared, stream_ptr, self._params
        )


class CapturedGraph:
    """A CUDA graph captured from a stream, launched through :class:`DriverCalls`.

    ``cupy.cuda.Graph`` keeps its executable handle private, so the engine
    captures and instantiates through CuPy's runtime bindings itself and owns
    the handles.

    Parameters
    ----------
    cp : module
        CuPy.
    calls : DriverCalls
        Launches the graph.
    stream : cupy.cuda.Stream
        The stream to capture from (not the legacy default stream).
    body : callable
        Queues the work to capture on ``stream``.
    """

    def __init__(self, cp: ModuleType, calls: DriverCalls, stream: Any, body: Any) -> None:
        rt = cp.cuda.runtime
        self._rt = rt
        self._calls = calls
        self._graph = self._exec = 0
        # Relaxed, as CuPy's own capture: nothing in the bodies is an unsafe call.
        rt.streamBeginCapture(stream.ptr, rt.streamCaptureModeRelaxed)
        try:
            body()
        finally:
            self._graph = rt.streamEndCapture(stream.ptr)
        self._exec = rt.graphInstantiate(self._graph)

    def launch(self, stream: int) -> None:
        self._calls.graph_launch(self._exec, stream)

    def close(self) -> None:
        if self._exec:
            self._rt.graphExecDestroy(self._exec)
            self._exec = 0
        if self._graph:
            self._rt.graphDestroy(self._graph)
            self._graph = 0

    def __del__(self) -> None:  # pragma: no cover - interpreter shutdown order varies
        try:
            self.close()
        except Exception:
            pass


def describe_nodes(kinds: list[int]) -> str:
    """``kinds`` (``CUgraphNodeType`` values) as counts by name: "12 kernel, 1 memset"."""
    counts: dict[str, int] = {}
    for kind in kinds:
        name = NODE_TYPE_NAMES[kind] if 0 <= kind < len(NODE_TYPE_NAMES) else f"type {kind}"
        counts[name] = counts.get(name, 0) + 1
    return ", ".join(f"{count} {name}" for name, count in counts.items()) or "no nodes"


class LoopGraph:
    """A CUDA graph of one WHILE conditional node, launched through :class:`DriverCalls`.

    The body is captured from a stream into the node's body graph; the node
    runs it again and again while its condition is non-zero. The condition
    is 1 at every launch (so the body runs at least once) and a kernel of
    the body sets it with ``cudaGraphSetConditional`` (the body callable
    receives the condition's handle to pass to that kernel). One launch and
    one synchronisation then cover as many bodies as the device decides.

    Parameters
    ----------
    graph_calls : GraphCalls
        Builds the graph (driver entry points of CUDA 12.3 and later).
    calls : DriverCalls
        Launches it.
    stream : cupy.cuda.Stream
        The stream to capture the body from (not the legacy default stream).
    body : callable
        ``body(handle)`` queues one pass of the loop on ``stream``, its last
        kernel setting the condition through ``handle``.

    Raises
    ------
    Exception
        Whatever the driver refuses (a node type a conditional body may not
        hold, a driver without conditional nodes); nothing is left allocated.
    """

    def __init__(
        self, graph_calls: GraphCalls, calls: DriverCalls, stream: Any, body: Callable[[int], None]
    ) -> None:
        self._g = graph_calls
        self._calls = calls
        self._exec = 0
        self._body = 0
        self._graph = graph_calls.create_graph()
        try:
            ctx = graph_calls.current_context()
            handle, body_graph = graph_calls.add_while_node(self._graph, ctx, default=1)
            self._body = body_graph
            graph_calls.begin_capture_to_graph(stream.ptr, body_graph)
            try:
                body(handle)
            except BaseException:
                graph_calls.end_capture(stream.ptr, check=False)
                raise
            graph_calls.end_capture(stream.ptr)
            try:
                self._exec = graph_calls.instantiate(self._graph)
            except Exception as exc:
                # Most likely a node that a conditional body may not hold:
                # say which kinds of node the capture put there.
                try:
                    nodes = describe_nodes(graph_calls.node_types(body_graph))
                except Exception as listing:
                    nodes = f"nodes that cannot be listed ({listing})"
                raise RuntimeError(
                    f"{type(exc).__name__}: {exc}; the loop body holds {nodes}"
                ) from exc
        except BaseException:
            self.close()
            raise

    def launch(self, stream: int) -> None:
        self._calls.graph_launch(self._exec, stream)

    def body_node_types(self) -> list[int]:
        """The ``CUgraphNodeType`` of each node of the body (GPU tests check the kinds)."""
        return self._g.node_types(self._body)

    def close(self) -> None:
        """Destroy the executable and the graph (the body graph is the node's)."""
        if self._exec:
            self._g.destroy_exec(self._exec)
            self._exec = 0
        if self._graph:
            self._g.destroy_graph(self._graph)
            self._graph = 0
            self._body = 0

    def __del__(self) -> None:  # pragma: no cover - interpreter shutdown order varies
        try:
            self.close()
        except Exception:
            pass


class Launcher:
    """The engine's prepared launches and captured graphs on its one stream.

    Parameters
    ----------
    cp : module
        CuPy.
    kernels : Kernels
        The compiled kernels of the engine's device and dtype.
    calls : DriverCalls
        Makes the launches and graph replays.
    stream : cupy.cuda.Stream
        The engine's stream.
    max_grid : int
        The largest grid a row kernel is launched with.
    graphs : bool
        Replay launch bodies as captured CUDA graphs.
    """

    def __init__(
        self,
        cp: ModuleType,
        kernels: Kernels,
        calls: DriverCalls,
        stream: Any,
        max_grid: int,
        graphs: bool,
    ) -> None:
        self._cp = cp
        self._kernels = kernels
        self._calls = calls
        self._stream = stream
        self.max_grid = max_grid
        self.graphs = graphs
        #: Why graph capture was turned off, if it failed.
        self.graph_error: str | None = None
        self._graph_cache: dict[tuple[Any, ...], CapturedGraph | LoopGraph] = {}
        self._generation = -1
        self._launches: dict[tuple[Any, ...], Launch] = {}

    def grid(self, n: int, warps: int = layout.ROW_THREADS // 32) -> int:
        """Blocks of a row kernel over ``n`` rows, ``warps`` rows per block at a time."""
        return max(1, min(self.max_grid, -(-n // warps)))

    def launch(
        self, key: tuple[Any, ...], name: str, grid: int, block: int, args: Any, shared: int = 0
    ) -> None:
        """Queue kernel ``name``, packing its launch under ``key`` on first use."""
        launch = self._launches.get(key)
        if launch is None:
            kernel = getattr(self._kernels, name)
            launch = Launch(self._calls, kernel, grid, block, args, shared)
            self._launches[key] = launch
        launch(self._stream.ptr)

    def run(self, key: tuple[Any, ...], body: Callable[[], None]) -> None:
        """Run a launch body: replay its captured graph, capturing it on first use."""
        if not self.graphs:
            body()
            return
        graph = self._graph_cache.get(key)
        if graph is None:
            graph = self._capture(body)
            if graph is None:
                body()
                return
            self._graph_cache[key] = graph
        graph.launch(self._stream.ptr)

    def cached_graph(self, key: tuple[Any, ...]) -> CapturedGraph | LoopGraph | None:
        """The graph kept under ``key``, if any."""
        return self._graph_cache.get(key)

    def keep_graph(self, key: tuple[Any, ...], graph: LoopGraph) -> None:
        """Keep a graph built elsewhere: dropped with the others when the workspace moves."""
        self._graph_cache[key] = graph

    def follow(self, generation: int) -> None:
        """Drop launches and graphs made for another workspace generation."""
        if self._generation != generation:
            self.drop()
            self._generation = generation

    def drop(self) -> None:
        """Destroy every captured graph and forget every prepared launch."""
        for graph in self._graph_cache.values():
            graph.close()
        self._graph_cache.clear()
        self._launches.clear()

    def _capture(self, body: Callable[[], None]) -> CapturedGraph | None:
        try:
            return CapturedGraph(self._cp, self._calls, self._stream, body)
        except Exception as exc:  # e.g. a library call that cannot be captured
            self.graphs = False
            self.graph_error = f"{type(exc).__name__}: {exc}"
            self.drop()
            return None
