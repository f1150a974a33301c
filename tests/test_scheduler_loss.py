"""Losing the Dask scheduler mid-walk: a prompt SchedulerLostError naming it.

The scheduler and its worker run in subprocesses of their own, so that the
scheduler can be killed (SIGKILL, as a crashed or preempted host would go)
while a walk of slow chunks is in flight.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import dask.array as da
import numpy as np
import pytest

from rh_dask import RenewableHuberRegressor, StreamError
from rh_dask.distributed import ActorLostError
from rh_dask.exceptions import SchedulerLostError

pytestmark = pytest.mark.timeout(60)

SCHEDULER = """
import asyncio
from distributed import Scheduler

async def main():
    async with Scheduler(host="127.0.0.1", port=0, dashboard_address=":0") as scheduler:
        print(scheduler.address, flush=True)
        await scheduler.finished()

asyncio.run(main())
"""

WORKER = """
import asyncio, sys
from distributed import Worker

async def main():
    async with Worker(sys.argv[1], host="127.0.0.1", nthreads=2, dashboard=False) as worker:
        await worker.finished()

asyncio.run(main())
"""


def _start(code: str, *args: str) -> subprocess.Popen:
    # This module's path too: the worker unpickles the chunk function defined here.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    return subprocess.Popen(
        [sys.executable, "-c", code, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=10)


@pytest.fixture
def killable_scheduler():
    """``(address, scheduler process)`` with one 2-thread worker; both stopped after."""
    scheduler = _start(SCHEDULER)
    procs = [scheduler]
    try:
        address = scheduler.stdout.readline().strip()
        assert address.startswith("tcp://127.0.0.1:"), address
        procs.append(_start(WORKER, address))
        yield address, scheduler
    finally:
        for proc in procs:
            _stop(proc)


def _slow_chunk(block, marker, block_info=None):
    # Every chunk takes a while, so the walk is still running when the scheduler goes.
    index = block_info[0]["chunk-location"][0]
    if index == 2:
        Path(marker).touch()
    time.sleep(0.25)
    return block


def _kill_when(marker: Path, scheduler: subprocess.Popen, killed: list[float]) -> None:
    deadline = time.monotonic() + 30
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    killed.append(time.monotonic())
    os.kill(scheduler.pid, signal.SIGKILL)


@pytest.mark.parametrize("loader", ["actor", "engine-worker"])
def test_losing_the_scheduler_names_it_promptly_and_keeps_the_model(
    killable_scheduler, tmp_path, loader, snapshot, assert_unchanged
):
    from distributed import Client

    address, scheduler = killable_scheduler
    rng = np.random.default_rng(5)
    X = rng.normal(size=(6_000, 4))
    y = X @ np.array([1.0, 0.5, -1.0, 2.0]) + rng.standard_t(3, size=6_000)
    marker = tmp_path / "chunk-2-started"
    Xd = da.from_array(X, chunks=(150, 4)).map_blocks(_slow_chunk, str(marker), dtype=X.dtype)
    model = RenewableHuberRegressor(progress=False, loader=loader, lookahead=4)
    model.partial_fit(X[:500], y[:500])  # fitted in memory first: this state must survive
    before = snapshot(model)
    client = Client(address, set_as_default=False, timeout=20)
    try:
        client.wait_for_workers(1, timeout=20)
        killed: list[float] = []
        killer = threading.Thread(target=_kill_when, args=(marker, scheduler, killed))
        with client.as_current():
            killer.start()
            with pytest.raises(SchedulerLostError) as info:
                model.partial_fit(Xd, da.from_array(y, 150))
        raised = time.monotonic()
        killer.join()
    finally:
        client.close(timeout=5)
    assert killed, "the walk never reached chunk 2"
    assert raised - killed[0] < 5.0  # the connect timeout (30 s) is not waited out
    err = info.value
    assert isinstance(err, StreamError) and not isinstance(err, ActorLostError)
    assert err.address == address and address in str(err)
    assert "scheduler" in str(err) and "before this call" in str(err)
    assert err.chunk_index is not None and err.chunk_index < 40
    assert_unchanged(before, snapshot(model))


def test_a_client_without_its_scheduler_is_refused_at_once(killable_scheduler):
    from distributed import Client

    address, scheduler = killable_scheduler
    rng = np.random.default_rng(6)
    X = rng.normal(size=(400, 3))
    model = RenewableHuberRegressor(progress=False)
    client = Client(address, set_as_default=False, timeout=20)
    try:
        client.wait_for_workers(1, timeout=20)
        os.kill(scheduler.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while client.status == "running" and time.monotonic() < deadline:
            time.sleep(0.02)
        start = time.monotonic()
        with client.as_current(), pytest.raises(SchedulerLostError, match=address):
            model.fit(da.from_array(X, chunks=(100, 3)), da.from_array(X[:, 0], 100))
        assert time.monotonic() - start < 5.0
    finally:
        client.close(timeout=5)
    assert not hasattr(model, "n_features_in_")
