"""The Newton device loop (a CUDA graph WHILE node) against the host loop, bit for bit.

The first tests run everywhere: the option's checks, the driver structures'
layout and the host side of both loops with the device parts stood in. The
rest are marked ``gpu`` and skip where CuPy or a CUDA device is missing; on a
GPU machine:

    PYTHONPATH=. pytest -q -m gpu tests/test_gpu_device_loop.py
"""

from __future__ import annotations

import ctypes
from types import SimpleNamespace

import numpy as np
import pytest

import gpu_engine
from gpu_engine import device_loop, driver, layout, newton
from gpu_engine.device_loop import DeviceLoop
from gpu_engine.launch import LoopGraph, describe_nodes
from rh_dask import HuberConfig
from rh_dask.datasets import StreamSpec
from rh_dask.exceptions import EngineUnavailableError, NotFittedError, ValidationError

try:
    import cupy as cp
except Exception:  # no CuPy, or a broken CUDA library underneath
    cp = None


def _device_count() -> int:
    try:
        return int(cp.cuda.runtime.getDeviceCount()) if cp is not None else 0
    except Exception:
        return 0


gpu = pytest.mark.gpu
needs_device = pytest.mark.skipif(_device_count() == 0, reason="no CUDA device visible to CuPy")


# -- everywhere ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "options, message",
    [
        ({"device_loop": "sometimes"}, "device_loop must be 'auto', 'on' or 'off'"),
        ({"device_loop": True}, "device_loop must be 'auto', 'on' or 'off'"),
        ({"device_loop": "on", "graphs": False}, "device_loop='on' needs graphs=True"),
    ],
)
def test_the_option_is_checked_before_the_device_is_touched(options, message):
    with pytest.raises(ValidationError, match=message):
        gpu_engine.GpuEngine(HuberConfig(), **options)


def test_driver_structures_have_the_cuda_h_layout():
    c = driver.ConditionalNodeParams
    assert (c.handle.offset, c.type.offset, c.size.offset) == (0, 8, 12)
    assert (c.phGraph_out.offset, c.ctx.offset) == (16, 24)
    assert ctypes.sizeof(c) == 32
    p = driver.GraphNodeParams
    assert (p.type.offset, p.conditional.offset, p.reserved2.offset) == (0, 16, 248)
    assert ctypes.sizeof(p) == 256
    params = p()
    assert bytes(params) == bytes(256)  # every unused byte starts zero


def _nvrtc_cubin(code: str) -> tuple[int, str, bytes]:
    """(NVRTC status, log, cubin) of ``code`` for sm_90, as the engine's options."""
    nvrtc = pytest.importorskip("test_kernel_compile").NVRTC
    if nvrtc is None:
        pytest.skip("NVRTC (nvidia-cuda-nvrtc) is not installed")
    program = ctypes.c_void_p()
    assert (
        nvrtc.nvrtcCreateProgram(ctypes.byref(program), code.encode(), b"loop.cu", 0, None, None)
        == 0
    )
    try:
        options = [b"--std=c++17", b"--gpu-architecture=sm_90"]
        status = nvrtc.nvrtcCompileProgram(
            program, len(options), (ctypes.c_char_p * len(options))(*options)
        )
        size = ctypes.c_size_t()
        nvrtc.nvrtcGetProgramLogSize(program, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        nvrtc.nvrtcGetProgramLog(program, log)
        cubin = b""
        if status == 0:
            nvrtc.nvrtcGetCUBINSize(program, ctypes.byref(size))
            buffer = ctypes.create_string_buffer(size.value)
            nvrtc.nvrtcGetCUBIN(program, buffer)
            cubin = buffer.raw
    finally:
        nvrtc.nvrtcDestroyProgram(ctypes.byref(program))
    return status, log.value.decode(errors="replace"), cubin


def test_the_loop_kernel_compiles_with_nvrtc_and_no_include_path():
    """``cudaGraphSetConditional`` needs only its declaration: no header, no ``-rdc``.

    The cubin leaves it an undefined function for the driver to bind at load
    time (as ``vprintf``); an ordinary extern function, the control, does not
    link without ``-rdc``.
    """
    source = layout.cuda_defines() + device_loop._PREAMBLES[0] + device_loop._KERNEL
    status, log, cubin = _nvrtc_cubin(source)
    assert status == 0, log
    assert not log.strip(), log
    assert cubin.startswith(b"\x7fELF") and b"cudaGraphSetConditional" in cubin
    control = source.replace("cudaGraphSetConditional", "rh_not_a_builtin")
    status, log, _ = _nvrtc_cubin(control)
    assert status != 0 and "Unresolved extern function" in log, log


class _FakeGraphCalls:
    """Records the driver calls a LoopGraph makes (no driver needed)."""

    def __init__(self, refuse_instantiate: bool = False) -> None:
        self.log: list = []
        self.refuse_instantiate = refuse_instantiate

    def create_graph(self):
        self.log.append("create")
        return 11

    def current_context(self):
        return 5

    def add_while_node(self, graph, ctx, default):
        self.log.append(("while", graph, ctx, default))
        return 77, 12

    def begin_capture_to_graph(self, stream, graph):
        self.log.append(("capture", stream, graph))

    def end_capture(self, stream, check=True):
        self.log.append(("end", check))

    def instantiate(self, graph):
        self.log.append(("instantiate", graph))
        if self.refuse_instantiate:
            raise RuntimeError("CUDA_ERROR_INVALID_VALUE")
        return 13

    def node_types(self, graph):
        self.log.append(("nodes", graph))
        return [0, 0, 10, 0, 11, 2]

    def destroy_exec(self, graph_exec):
        self.log.append(("destroy_exec", graph_exec))

    def destroy_graph(self, graph):
        self.log.append(("destroy", graph))


def test_a_loop_graph_captures_its_body_into_the_while_node_and_cleans_up_on_failure():
    calls = SimpleNamespace(launched=[])
    calls.graph_launch = lambda graph_exec, stream: calls.launched.append((graph_exec, stream))
    stream = SimpleNamespace(ptr=3)
    fake = _FakeGraphCalls()
    bodies = []
    graph = LoopGraph(fake, calls, stream, bodies.append)
    assert bodies == [77]  # the body gets the condition's handle
    assert fake.log == [
        "create",
        ("while", 11, 5, 1),  # the condition is 1 at every launch: one pass at least
        ("capture", 3, 12),
        ("end", True),
        ("instantiate", 11),
    ]
    graph.launch(3)
    assert calls.launched == [(13, 3)]
    assert graph.body_node_types() == [0, 0, 10, 0, 11, 2]
    assert fake.log[-1] == ("nodes", 12)  # the body graph's
    graph.close()
    assert fake.log[-2:] == [("destroy_exec", 13), ("destroy", 11)]

    def refused(handle):
        raise RuntimeError("not in a conditional body")

    fake = _FakeGraphCalls()
    with pytest.raises(RuntimeError, match="conditional body"):
        LoopGraph(fake, calls, stream, refused)
    assert fake.log[-2:] == [("end", False), ("destroy", 11)]


def test_a_refused_instantiation_names_the_body_nodes_and_cleans_up():
    calls = SimpleNamespace(graph_launch=None)
    fake = _FakeGraphCalls(refuse_instantiate=True)
    message = (
        "CUDA_ERROR_INVALID_VALUE; the loop body holds "
        "3 kernel, 1 memory allocation, 1 memory free, 1 memset"
    )
    with pytest.raises(RuntimeError, match=message):
        LoopGraph(fake, calls, SimpleNamespace(ptr=3), lambda handle: None)
    # the body graph (12) is listed; the graph (11) destroyed, no executable made
    assert fake.log[-3:] == [("instantiate", 11), ("nodes", 12), ("destroy", 11)]
    assert driver.NODE_TYPE_NAMES[driver.CU_GRAPH_NODE_TYPE_CONDITIONAL] == "conditional"
    assert describe_nodes([]) == "no nodes"
    assert describe_nodes([5, 42]) == "1 empty, 1 type 42"


class _FakeCupy:
    """What ``DeviceLoop.bind_blas_workspace`` asks of CuPy."""

    def __init__(self, capability: str) -> None:
        self.allocated: list[int] = []
        fake = self

        class Device:
            compute_capability = capability

            def __init__(self, device_id: int) -> None:
                pass

            def __enter__(self):
                return self

            def __exit__(self, *exc) -> None:
                pass

        self.cuda = SimpleNamespace(Device=Device)

        def empty(nbytes, dtype):
            fake.allocated.append(nbytes)
            return SimpleNamespace(data=SimpleNamespace(ptr=4096), nbytes=nbytes)

        self.empty = empty


@pytest.mark.parametrize("capability, mib", [("90", 32), ("100", 32), ("80", 4)])
def test_the_loop_gives_cublas_a_workspace_of_the_default_pool_size_once(
    capability, mib, monkeypatch
):
    set_calls = []
    status = [0]

    def set_workspace(handle, ptr, nbytes):
        set_calls.append((handle, ptr, nbytes))
        return status[0]

    monkeypatch.setattr(device_loop, "_set_blas_workspace", set_workspace)
    loop = DeviceLoop(_FakeCupy(capability), 0, None, None, "off", True)
    cp_fake = loop._cp
    loop.bind_blas_workspace(7)
    loop.bind_blas_workspace(7)  # the same handle: nothing to do
    assert set_calls == [(7, 4096, mib << 20)]
    loop.bind_blas_workspace(8)  # another handle gets the same buffer
    assert set_calls[-1] == (8, 4096, mib << 20) and cp_fake.allocated == [mib << 20]
    status[0] = 7  # CUBLAS_STATUS_INVALID_VALUE
    with pytest.raises(RuntimeError, match="cublasSetWorkspace failed with status 7"):
        loop.bind_blas_workspace(9)
    assert device_loop.blas_workspace_bytes(90) == 32 << 20


class _Status:
    """The host-mapped status block as the stand-in device leaves it."""

    def __init__(self) -> None:
        self.status_i = np.zeros(layout.N_INT, dtype=np.int32)


def _stand_in_driver(
    max_iter: int, passes: list[dict[int, int]], monkeypatch, prime_fails: bool = False
):
    """A NewtonDriver whose device work is replaced by ``passes``.

    Each launch of the loop graph (device loop) or of the step graph (host
    loop) applies the next entry of ``passes`` to the status block; the
    fallback clears I_FALLBACK and counts as one iteration. With
    ``prime_fails`` the prime graph's capture fails as the real launcher's
    would: graphs off, every graph dropped.
    """
    log: list[str] = []
    ws = _Status()
    queue = list(passes)

    def device_pass():
        log.append("pass")
        for index, value in queue.pop(0).items():
            ws.status_i[index] = value

    class Graph(LoopGraph):
        def __init__(self) -> None:  # no driver: the stand-in runs passes
            pass

        closed = False

        def launch(self, stream: int) -> None:
            assert not self.closed, "a dropped loop graph was launched"
            device_pass()

        def close(self) -> None:
            pass

    class Launcher:
        graphs = True

        def __init__(self) -> None:
            self.cache: dict = {}

        def run(self, key, body):
            if key[0] == "step":
                device_pass()
            else:
                log.append(key[0])
                if key[0] == "prime" and prime_fails and self.graphs:
                    self.graphs = False
                    for graph in self.cache.values():
                        graph.closed = True
                    self.cache.clear()

        def cached_graph(self, key):
            return self.cache.get(key)

        def keep_graph(self, key, graph):
            self.cache[key] = graph

    def fallback(n, p):
        log.append("fallback")
        ws.status_i[layout.I_FALLBACK] = 0
        ws.status_i[layout.I_ITER] += 1
        yield from ()  # the real fallback yields once, for the sync after its commit

    parts = SimpleNamespace(
        ws=ws,
        launcher=Launcher(),
        config=SimpleNamespace(max_iter=max_iter),
        calls=SimpleNamespace(synchronize=lambda stream: log.append("sync")),
        stream=SimpleNamespace(ptr=0),
        dense=SimpleNamespace(blas=21),
    )

    def build(ctl, body, blas):
        log.append(("build", blas))
        return Graph()

    loop = SimpleNamespace(enabled=True, mode="auto", build=build)
    solver = newton.NewtonDriver(parts, "auto", loop)
    # The device loop holds only the fused one-block solve (cuSOLVER allocates in a capture).
    monkeypatch.setattr(solver, "_fused_solve_fits", lambda p: True)
    monkeypatch.setattr(solver, "_fallback", fallback)
    # kernel attributes set before any capture: nothing to set without a device
    monkeypatch.setattr(newton, "allow_row_shared", lambda *args: None, raising=False)
    parts.ws.ctl = None
    return solver, log


@pytest.mark.parametrize("mode", ["auto", "on"])
def test_a_cusolver_solve_never_captures_a_device_loop(mode, monkeypatch):
    """cuSOLVER allocates inside a capture: no loop is built; "on" refuses, "auto" says why."""
    passes = [{layout.I_ITER: 1, layout.I_DONE: 1, layout.I_COMMITTED: 1}]
    solver, log = _stand_in_driver(100, passes, monkeypatch)
    monkeypatch.setattr(solver, "_fused_solve_fits", lambda p: False)
    solver._loop.mode = mode
    solver._loop.error = None
    if mode == "on":
        with pytest.raises(EngineUnavailableError, match="cuSOLVER"):
            solver.solve(10, 300)
        assert log == []  # refused before anything was queued
        return
    solver.solve(10, 300)
    assert not solver.device_loop
    assert "cuSOLVER" in solver._loop.error
    assert not any(isinstance(entry, tuple) and entry[0] == "build" for entry in log)


def test_the_device_loop_returns_to_the_host_only_for_a_singular_factor(monkeypatch):
    passes = [
        {layout.I_FALLBACK: 1, layout.I_ITER: 2},  # two iterations, then a singular factor
        {layout.I_ITER: 5, layout.I_DONE: 1, layout.I_COMMITTED: 1},
        {layout.I_ITER: 3, layout.I_DONE: 1, layout.I_COMMITTED: 1},  # the next batch
    ]
    solver, log = _stand_in_driver(100, passes, monkeypatch)
    solver.solve(10, 3)
    assert solver.device_loop
    # built (cuBLAS's workspace bound) before the prime graph's GEMM is queued
    assert log == [("build", 21), "prime", "pass", "sync", "fallback", "pass", "sync"]
    solver.solve(10, 3)  # the next batch of the same shape reuses the loop graph
    assert log[7:] == ["prime", "pass", "sync"]


@pytest.mark.parametrize("mode", ["auto", "on"])
def test_a_failed_prime_capture_never_launches_a_dropped_loop_graph(mode, monkeypatch):
    done = {layout.I_ITER: 2, layout.I_DONE: 1}
    passes = [{layout.I_ITER: 1}, done] if mode == "auto" else [done]  # steps, or one loop
    solver, log = _stand_in_driver(100, passes, monkeypatch, prime_fails=True)
    solver._loop.mode = mode
    solver.solve(10, 3)
    if mode == "auto":  # graphs are off: the host loop
        assert not solver.device_loop
        assert log == [("build", 21), "prime", "pass", "sync", "pass", "sync"]
    else:  # "on" builds the loop again, outside the graph cache's drop
        assert solver.device_loop
        assert log == [("build", 21), "prime", ("build", 21), "pass", "sync"]


def test_the_device_loop_stops_at_the_first_sync_of_a_refused_batch(monkeypatch):
    passes = [{layout.I_INVALID: 1, layout.I_DONE: 1}]
    solver, log = _stand_in_driver(100, passes, monkeypatch)
    with pytest.raises(ValidationError, match="finite"):
        solver.solve(10, 3)
    assert log == [("build", 21), "prime", "pass", "sync"]


def test_a_loop_that_cannot_be_built_falls_back_to_the_host_loop(monkeypatch):
    passes = [{layout.I_ITER: 1}, {layout.I_ITER: 2, layout.I_DONE: 1}]
    solver, log = _stand_in_driver(100, passes, monkeypatch)
    refused = RuntimeError("CUDA_ERROR_NOT_SUPPORTED")
    loop = DeviceLoop.__new__(DeviceLoop)
    loop.mode, loop.enabled, loop.error = "auto", True, None

    def build(ctl, body, blas):
        raise refused

    loop.build = build
    solver._loop = loop
    solver.solve(10, 3)
    assert not solver.device_loop and not loop.enabled
    assert loop.error == "RuntimeError: CUDA_ERROR_NOT_SUPPORTED"
    assert log == ["prime", "pass", "sync", "pass", "sync"]  # one sync per iteration
    loop.mode, loop.enabled = "on", True
    with pytest.raises(EngineUnavailableError, match="device_loop='on'"):
        solver.solve(10, 3)


# -- on a device -------------------------------------------------------------------------


def _stream(features: int, sizes: list[int], dtype: str, seed: int):
    spec = StreamSpec(n_features=features, seed=seed)
    X, y = spec.chunk(0, sum(sizes), "float64")
    out, start = [], 0
    for size in sizes:
        out.append((X[start : start + size].astype(dtype), y[start : start + size].astype(dtype)))
        start += size
    return out


def _fit(config, batches, weights=None, **options):
    """(diagnostics, state, β mirror bytes, fallback count, device loop used) of one stream."""
    engine = gpu_engine.GpuEngine(config, **options)
    calls = []
    original = engine._dense.fallback_direction

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    engine._dense.fallback_direction = counted
    diagnostics = []
    for i, (X, y) in enumerate(batches):
        w = None if weights is None else cp.asarray(weights[i])
        diagnostics.append(engine.partial_fit(cp.asarray(X), cp.asarray(y), w))
    used = engine._newton.device_loop
    state = engine.export_state()
    mirror = engine._ws.beta_host.tobytes()
    assert engine.coefficients().tobytes() == state.coefficients.tobytes()
    error = engine.device_loop_error
    engine.close()
    return diagnostics, state, mirror, len(calls), used, error


def _assert_bit_identical(config, batches, weights=None, **options):
    on = _fit(config, batches, weights, device_loop="on", **options)
    off = _fit(config, batches, weights, device_loop="off", **options)
    assert on[4] is True, f"the device loop was not used: {on[5]}"
    assert off[4] is False
    assert on[0] == off[0], "diagnostics differ"
    assert on[1].equals(off[1]), "states differ"
    assert on[1].previous_lambda == off[1].previous_lambda
    assert on[1].weight_sum == off[1].weight_sum
    assert on[2] == off[2], "β mirrors differ"
    assert on[3] == off[3], "fallback counts differ"
    return on


@gpu
@needs_device
@pytest.mark.parametrize("cholesky", ["auto", "kernel", "blocked", "columns", "tiles", "cusolver"])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize(
    "features, sizes",
    [(16, [4096, 4096]), (90, [32768, 32768, 1000]), (32, [65536, 5000]), (256, [4096, 4096])],
    ids=["latency", "reference", "streaming", "wide"],
)
def test_device_loop_gives_the_host_loops_bits(features, sizes, dtype, cholesky):
    if cholesky in ("kernel", "blocked", "columns", "tiles") and features > 200:
        pytest.skip("the one-block kernels hold the system in shared memory")
    config, batches = HuberConfig(dtype=dtype), _stream(features, sizes, dtype, 3)
    if _solves_with_cusolver(config, batches[0], cholesky):
        _assert_cusolver_keeps_the_host_loop(config, batches, cholesky)
    else:
        _assert_bit_identical(config, batches, cholesky=cholesky)


def _solves_with_cusolver(config, batch, cholesky):
    engine = gpu_engine.GpuEngine(config, device_loop="off", cholesky=cholesky)
    engine.partial_fit(cp.asarray(batch[0]), cp.asarray(batch[1]))
    fused = engine._newton.small_solve
    engine.close()
    return not fused


def _assert_cusolver_keeps_the_host_loop(config, batches, cholesky):
    """A solve through cuSOLVER: "on" refuses before committing, "auto" is the host loop."""
    engine = gpu_engine.GpuEngine(config, device_loop="on", cholesky=cholesky)
    X, y = batches[0]
    with pytest.raises(EngineUnavailableError, match="cuSOLVER"):
        engine.partial_fit(cp.asarray(X), cp.asarray(y))
    with pytest.raises(NotFittedError):
        engine.export_state()
    engine.close()
    auto = _fit(config, batches, device_loop="auto", cholesky=cholesky)
    off = _fit(config, batches, device_loop="off", cholesky=cholesky)
    assert auto[4] is False and "cuSOLVER" in auto[5]
    assert auto[0] == off[0] and auto[1].equals(off[1]) and auto[2] == off[2]


@gpu
@needs_device
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_weighted_batches_without_intercept_give_the_same_bits(dtype):
    batches = _stream(20, [6000, 6000, 1500], dtype, 8)
    rng = np.random.default_rng(8)
    weights = [rng.integers(0, 4, len(y)).astype(dtype) for _, y in batches]
    config = HuberConfig(dtype=dtype, fit_intercept=False)
    _assert_bit_identical(config, batches, weights)


@gpu
@needs_device
@pytest.mark.parametrize("cholesky", ["kernel", "blocked", "columns", "tiles", "cusolver"])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("features", [6, 70])
def test_singular_factors_exit_to_the_host_and_give_the_same_bits(features, dtype, cholesky):
    # the duplicate is the last feature: the factor fails there, after every warp
    # of the one-block kernels has factored columns
    batches = []
    for X, y in _stream(features, [800, 800, 500], dtype, 11):
        batches.append((np.ascontiguousarray(np.column_stack([X, X[:, 2]])), y))
    config = HuberConfig(ridge=0.0, dtype=dtype)
    if cholesky == "cusolver":
        _assert_cusolver_keeps_the_host_loop(config, batches, cholesky)
        return
    on = _assert_bit_identical(config, batches, cholesky=cholesky)
    assert on[3] > 0, "the duplicated column never reached the host's fallback"


@gpu
@needs_device
@pytest.mark.parametrize("max_iter", [1, 2, 3])
def test_the_iteration_cap_is_kept_on_the_device(max_iter):
    # p = 41: an explicit one-block kernel keeps the solve loopable
    config = HuberConfig(dtype="float64", max_iter=max_iter, tol=1e-14)
    on = _assert_bit_identical(config, _stream(40, [8000, 8000], "float64", 5), cholesky="kernel")
    assert all(d.iterations <= max_iter for d in on[0])
    assert any(d.iterations == max_iter and not d.converged for d in on[0])


@gpu
@needs_device
@pytest.mark.parametrize("max_iter", [1, 100])
def test_refused_batches_leave_everything_alone_with_the_device_loop(max_iter):
    config = HuberConfig(dtype="float32", max_iter=max_iter)
    (X0, y0), (X1, y1) = _stream(12, [3000, 2000], "float32", 6)
    engines = []
    for mode in ("on", "off"):
        engine = gpu_engine.GpuEngine(config, device_loop=mode)
        engine.partial_fit(cp.asarray(X0), cp.asarray(y0))
        before = engine.export_state()
        mirror = engine._ws.beta_host.tobytes()
        for row in (0, len(y1) - 1):
            bad = y1.copy()
            bad[row] = np.inf
            with pytest.raises(ValidationError, match="finite"):
                engine.partial_fit(cp.asarray(X1), cp.asarray(bad))
            assert engine.export_state().equals(before)
            assert engine._ws.beta_host.tobytes() == mirror
        engine.partial_fit(cp.asarray(X1), cp.asarray(y1))
        assert engine._newton.device_loop is (mode == "on")
        engines.append(engine)
    assert engines[0].export_state().equals(engines[1].export_state())
    for engine in engines:
        engine.close()


@gpu
@needs_device
def test_auto_uses_the_device_loop_and_graphs_off_the_host_loop():
    batches = _stream(10, [2000, 2000], "float64", 2)
    auto = _fit(HuberConfig(), batches, device_loop="auto")
    assert auto[4] is True and auto[5] is None, auto[5]
    eager = _fit(HuberConfig(), batches, device_loop="auto", graphs=False)
    assert eager[4] is False and eager[5] == "CUDA graphs are off (graphs=False)"
    assert auto[1].equals(eager[1])
    l1 = gpu_engine.GpuEngine(HuberConfig(penalty="l1"), device_loop="on")
    for X, y in batches:
        l1.partial_fit(cp.asarray(X), cp.asarray(y))
    assert not l1._newton.device_loop  # the LAMM queue is not the Newton loop
    l1.close()


@gpu
@needs_device
@pytest.mark.parametrize(
    "features, cholesky",
    [(16, "auto"), (90, "kernel"), (90, "blocked"), (90, "columns"), (90, "tiles")],
)
def test_the_loop_body_holds_kernels_and_cublas_has_the_loops_workspace(features, cholesky):
    """What the conditional body may hold, and the cuBLAS workspace that keeps it so."""
    engine = gpu_engine.GpuEngine(HuberConfig(), device_loop="on", cholesky=cholesky)
    (X, y), (X2, y2) = _stream(features, [4096, 1000], "float64", 4)
    engine.partial_fit(cp.asarray(X), cp.asarray(y))
    engine.partial_fit(cp.asarray(X2), cp.asarray(y2))  # a second shape, a second loop
    loops = [g for g in engine._launcher._graph_cache.values() if isinstance(g, LoopGraph)]
    assert len(loops) == 2
    allowed = {0, 1, 2, 4, 5, 13}  # kernel, memcpy, memset, child graph, empty, conditional
    for graph in loops:
        kinds = graph.body_node_types()
        assert set(kinds) <= allowed, describe_nodes(kinds)
        assert kinds.count(0) >= 5  # solve, search, eval, GEMM, finish, continue
    capability = int(cp.cuda.Device().compute_capability)
    assert engine._loop._blas_handle == engine._dense.blas
    assert engine._loop._blas_workspace.nbytes == device_loop.blas_workspace_bytes(capability)
    engine.close()
    assert not engine._launcher._graph_cache


@gpu
@needs_device
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_a_cublas_workspace_of_the_default_pool_size_leaves_the_host_loops_bits(dtype):
    """The loop's workspace must not change cuBLAS's choice of GEMM algorithm.

    Both engines run the host loop; one has the loop's workspace bound. If
    this fails, the device loop's bits differ from the host loop's through
    the GEMM alone, and the host loop should bind the same workspace.
    """
    batches = _stream(90, [32768, 32768, 1000], dtype, 3)
    plain = _fit(HuberConfig(dtype=dtype), batches, device_loop="off")
    engine = gpu_engine.GpuEngine(HuberConfig(dtype=dtype), device_loop="off")
    capability = int(cp.cuda.Device().compute_capability)
    workspace = cp.empty(device_loop.blas_workspace_bytes(capability), dtype=np.uint8)
    status = device_loop._set_blas_workspace(
        engine._dense.blas, int(workspace.data.ptr), int(workspace.nbytes)
    )
    assert status == 0
    diagnostics = [engine.partial_fit(cp.asarray(X), cp.asarray(y)) for X, y in batches]
    assert diagnostics == plain[0]
    assert engine.export_state().equals(plain[1])
    engine.close()


TOL = {"float64": (1e-8, 2e-9), "float32": (3e-4, 3e-5)}


@gpu
@needs_device
@pytest.mark.parametrize("cholesky", ["blocked", "columns", "tiles"])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("features", [16, 31, 40, 90, 95, 96, 127])
def test_the_one_block_cholesky_matches_the_reference_and_cusolver(features, dtype, cholesky):
    """``"blocked"`` and ``"tiles"``: one to four 32-column panels, a partial last one;
    ``"columns"``: each of its three kernels, at and below its largest p (p = features + 1)."""
    from rh_dask import NumpyEngine

    batches = _stream(features, [20000, 20000, 700], dtype, 12)
    config = HuberConfig(dtype=dtype)
    blocked = gpu_engine.GpuEngine(config, cholesky=cholesky)
    cusolver = gpu_engine.GpuEngine(config, cholesky="cusolver")
    ref = NumpyEngine(config)
    rtol, atol = TOL[dtype]
    for X, y in batches:
        d_blocked = blocked.partial_fit(cp.asarray(X), cp.asarray(y))
        d_cusolver = cusolver.partial_fit(cp.asarray(X), cp.asarray(y))
        d_ref = ref.partial_fit(X, y)
        assert blocked._newton.small_solve
        beta = blocked.coefficients().astype(np.float64)
        for other in (ref.export_state().coefficients, cusolver.coefficients()):
            other = np.asarray(other, dtype=np.float64)
            assert np.all(np.abs(beta - other) <= atol + rtol * np.abs(other))
        assert d_blocked.converged == d_ref.converged == d_cusolver.converged
        assert abs(d_blocked.objective - d_ref.objective) <= atol + rtol * abs(d_ref.objective)
    blocked.close()
    cusolver.close()


@gpu
@needs_device
def test_the_columns_kernels_refuse_systems_past_their_size():
    engine = gpu_engine.GpuEngine(HuberConfig(), cholesky="columns")
    ((X, y),) = _stream(128, [2000], "float64", 13)  # p = 129 with the intercept
    with pytest.raises(ValidationError, match="p ≤ 128"):
        engine.partial_fit(cp.asarray(X), cp.asarray(y))
    with pytest.raises(NotFittedError):
        engine.export_state()
    engine.close()


@gpu
@needs_device
@pytest.mark.parametrize("dtype, features", [("float64", 150), ("float32", 200)])
def test_the_tiles_kernel_holds_systems_past_the_columns_kernels(dtype, features):
    """Five and seven panels: the tiles kernel's only bound is shared memory."""
    from rh_dask import NumpyEngine

    batches = _stream(features, [6000, 6000], dtype, 14)
    config = HuberConfig(dtype=dtype)
    tiles, ref = gpu_engine.GpuEngine(config, cholesky="tiles"), NumpyEngine(config)
    rtol, atol = TOL[dtype]
    for X, y in batches:
        tiles.partial_fit(cp.asarray(X), cp.asarray(y))
        ref.partial_fit(X, y)
        assert tiles._newton.small_solve
        beta = tiles.coefficients().astype(np.float64)
        other = np.asarray(ref.export_state().coefficients, dtype=np.float64)
        assert np.all(np.abs(beta - other) <= atol + rtol * np.abs(other))
    tiles.close()
