"""The GPU engine's queueing CUDA calls, on CPU: the driver library and CuPy stood in.

What is checked here is the routing (driver library or CuPy's bindings),
the error mapping, the retry on a thread without a context, and when a wait
blocks. ``tests/test_gpu_engine.py`` runs the same calls on a device and
checks that both routes give bit-identical fits.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from gpu_engine import driver


class _DriverError(Exception):
    def __init__(self, status: int) -> None:
        super().__init__(f"CUDA driver error {status}")
        self.status = status


class _Event:
    def __init__(self, ptr: int) -> None:
        self.ptr = ptr
        self.synchronized = 0

    def synchronize(self) -> None:
        self.synchronized += 1


def _fake_cupy(log: list, query_status: int = 0):
    runtime = SimpleNamespace(
        memcpyHostToDevice=1,
        memcpyAsync=lambda *a: log.append(("memcpyAsync", a)),
        streamWaitEvent=lambda *a: log.append(("streamWaitEvent", a)),
        graphLaunch=lambda *a: log.append(("graphLaunch", a)),
        eventQuery=lambda ptr: query_status,
        free=lambda ptr: log.append(("free", ptr)),
    )
    drv = SimpleNamespace(
        launchKernel=lambda *a: log.append(("launchKernel", a)), CUDADriverError=_DriverError
    )
    return SimpleNamespace(cuda=SimpleNamespace(runtime=runtime, driver=drv))


class _Library:
    """The driver entry points DriverCalls uses, answering with queued statuses."""

    def __init__(self, log: list) -> None:
        self.log = log
        self.statuses: dict[str, list[int]] = {}

    def __getattr__(self, name: str):
        if not name.startswith("cu"):
            raise AttributeError(name)

        def call(*args):
            self.log.append((name, args))
            queued = self.statuses.get(name)
            return queued.pop(0) if queued else 0

        return call


@pytest.fixture
def library(monkeypatch):
    log: list = []
    lib = _Library(log)
    monkeypatch.setattr(driver, "_LIBRARY", lib)
    return lib


def test_with_the_driver_library_the_calls_go_to_it(library):
    cupy_log: list = []
    calls = driver.DriverCalls(_fake_cupy(cupy_log))
    assert calls.holds_gil
    calls.launch(11, 4, 256, 64, 7, 99)
    calls.graph_launch(5, 7)
    calls.copy_to_device(1000, 2000, 64, 7)
    calls.stream_wait(7, 3)
    assert [name for name, _ in library.log] == [
        "cuLaunchKernel",
        "cuGraphLaunch",
        "cuMemcpyHtoDAsync_v2",
        "cuStreamWaitEvent",
    ]
    assert library.log[0][1] == (11, 4, 1, 1, 256, 1, 1, 64, 7, 99, None)
    assert library.log[2][1] == (1000, 2000, 64, 7)
    assert cupy_log == []  # nothing went through CuPy's lock-releasing bindings


def test_a_failed_driver_call_raises_cupys_driver_error(library):
    calls = driver.DriverCalls(_fake_cupy([]))
    library.statuses["cuGraphLaunch"] = [700]
    with pytest.raises(_DriverError) as info:
        calls.graph_launch(5, 7)
    assert info.value.status == 700


def test_a_thread_without_a_context_binds_one_and_retries(library):
    cupy_log: list = []
    calls = driver.DriverCalls(_fake_cupy(cupy_log))
    library.statuses["cuStreamWaitEvent"] = [201, 0]
    calls.stream_wait(7, 3)
    assert [name for name, _ in library.log] == ["cuStreamWaitEvent", "cuStreamWaitEvent"]
    assert cupy_log == [("free", 0)]


def test_event_wait_blocks_only_when_the_event_is_pending(library):
    calls = driver.DriverCalls(_fake_cupy([]))
    done, pending = _Event(1), _Event(2)
    library.statuses["cuEventQuery"] = [0, 600]
    calls.event_wait(done)
    calls.event_wait(pending)
    assert (done.synchronized, pending.synchronized) == (0, 1)
    library.statuses["cuEventQuery"] = [1]  # an error, not "not ready"
    with pytest.raises(_DriverError):
        calls.event_wait(_Event(3))


def test_synchronize_waits_on_the_stream_without_a_driver_call(library):
    calls = driver.DriverCalls(_fake_cupy([]))
    stream = _Event(9)  # has .ptr and .synchronize, like a stream
    calls.synchronize(stream)
    assert stream.synchronized == 1
    assert library.log == []  # the wait goes through CuPy, which releases the lock


def test_hold_gil_false_uses_cupys_bindings_even_with_the_library(library):
    cupy_log: list = []
    calls = driver.DriverCalls(_fake_cupy(cupy_log), hold_gil=False)
    assert not calls.holds_gil
    calls.launch(11, 4, 256, 0, 7, 99)
    calls.stream_wait(7, 3)
    assert [name for name, _ in cupy_log] == ["launchKernel", "streamWaitEvent"]
    assert library.log == []


def test_without_the_library_or_when_switched_off_cupys_bindings_are_used(monkeypatch):
    monkeypatch.setattr(driver, "_LIBRARY", None)
    monkeypatch.setattr(driver, "_LOAD_ERROR", None)
    monkeypatch.setattr(driver, "_LIBRARY_NAMES", ("librh-dask-no-such-driver.so",))
    for hold in (True, False):
        log: list = []
        calls = driver.DriverCalls(_fake_cupy(log, query_status=600), hold_gil=hold)
        assert not calls.holds_gil
        calls.launch(11, 4, 256, 0, 7, 99)
        calls.graph_launch(5, 7)
        calls.copy_to_device(1000, 2000, 64, 7)
        calls.stream_wait(7, 3)
        event = _Event(1)
        calls.event_wait(event)
        assert [name for name, _ in log] == [
            "launchKernel",
            "graphLaunch",
            "memcpyAsync",
            "streamWaitEvent",
        ]
        assert log[2][1] == (1000, 2000, 64, 1, 7)
        assert event.synchronized == 1
    assert driver._LOAD_ERROR  # the failed load says why
