"""Row blocks: fixed by the shape, run on any number of threads, results in order."""

from __future__ import annotations

import itertools
import threading
import time

import pytest

from rh_dask.engines import row_blocks as rb


@pytest.mark.parametrize(
    ("rows", "cols", "itemsize"),
    [(0, 5, 8), (1, 5, 8), (4096, 17, 8), (32768, 91, 4), (32768, 91, 8), (10**6, 33, 8)],
)
def test_blocks_cover_the_rows_in_order_and_depend_on_the_shape_alone(rows, cols, itemsize):
    blocks = rb.row_blocks(rows, cols, itemsize)
    assert blocks[0][0] == 0 and blocks[-1][1] == rows
    assert all(a[1] == b[0] for a, b in itertools.pairwise(blocks))
    assert all(start % rb.ROW_ALIGN == 0 for start, _ in blocks)
    assert 1 <= len(blocks) <= rb.MAX_BLOCKS
    if len(blocks) > 1:
        assert min(stop - start for start, stop in blocks) * cols * itemsize >= (
            rb.MIN_BLOCK_BYTES // 2
        )
    assert rb.row_blocks(rows, cols, itemsize) == blocks


def test_a_small_operand_is_one_block_and_a_large_one_is_cut_at_most_max_blocks():
    assert len(rb.row_blocks(4096, 17, 8)) == 1  # 557 KB: the latency shape
    assert len(rb.row_blocks(32768, 91, 4)) == 11  # 11.9 MB of float32
    assert len(rb.row_blocks(32768, 91, 8)) == rb.MAX_BLOCKS


@pytest.mark.parametrize("threads", [1, 2, 3, 8])
def test_run_tasks_returns_results_in_task_order(threads):
    names: set[str] = set()

    def task(i: int):
        def run():
            names.add(threading.current_thread().name)
            time.sleep(0.002 * (i % 3))
            return i

        return run

    assert rb.run_tasks([task(i) for i in range(11)], threads) == list(range(11))
    if threads == 1:
        assert names == {threading.current_thread().name}


def test_run_tasks_raises_the_first_error_only_once_every_task_has_ended():
    ended: list[int] = []

    def slow():
        time.sleep(0.2)
        ended.append(1)

    def fail(message: str):
        def run():
            raise ValueError(message)

        return run

    with pytest.raises(ValueError, match="first"):
        rb.run_tasks([fail("first"), slow, fail("second"), slow], 2)
    assert ended == [1, 1]  # nothing left running on the caller's buffers


def test_thread_counts_are_powers_of_two_up_to_the_tasks_and_cores():
    assert rb.thread_counts(16, cores=16) == (1, 2, 4, 8, 16)
    assert rb.thread_counts(5, cores=16) == (1, 2, 4, 5)
    assert rb.thread_counts(16, cores=2) == (1, 2)
    assert rb.thread_counts(1, cores=8) == (1,)
    assert rb.thread_counts(6, cores=1) == (1,)


def test_the_chooser_tries_each_count_takes_the_fastest_and_probes_its_neighbours():
    chooser = rb.ThreadChooser(keep=3, warmup=2, probe_every=4)
    counts = (1, 2, 4)
    cost = {1: 3.0, 2: 1.0, 4: 2.0}
    taken = []
    for _ in range(30):
        count = chooser.choose("k", counts)
        taken.append(count)
        chooser.record("k", count, cost[count])
    assert taken[:6] == [4, 4, 2, 2, 1, 1]  # uncalibrated: each count, the largest first
    steady = taken[6:]
    assert steady.count(2) >= len(steady) * 3 // 4 - 1
    assert {1, 4} <= set(steady)  # the probes take the others in turn
    assert chooser.chosen() == {"k": 2}
    assert chooser.choose("other", (1,)) == 1  # one count: nothing to measure


def test_the_chooser_keeps_what_each_calibration_cost():
    chooser = rb.ThreadChooser()
    assert not chooser.calibrated("k")
    chooser.add_calibration("k", 0.25)
    assert chooser.calibrated("k") and not chooser.calibrated("other")
    assert chooser.calibration_seconds() == {"k": 0.25}


def test_the_chooser_follows_a_change_of_load():
    chooser = rb.ThreadChooser(keep=3, warmup=1, probe_every=3)
    cost = {1: 2.0, 2: 1.0}
    for step in range(60):
        if step == 20:
            cost = {1: 1.0, 2: 5.0}  # another process now takes the second core
        count = chooser.choose("k", (1, 2))
        chooser.record("k", count, cost[count])
    assert chooser.chosen() == {"k": 1}


def test_a_forked_child_makes_its_own_pool():
    import os

    if not hasattr(os, "fork"):
        pytest.skip("no fork here")
    parent = rb.block_pool()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        ok = rb.block_pool() is not parent and rb.run_tasks([lambda: 1, lambda: 2], 2) == [1, 2]
        os.write(write, b"1" if ok else b"0")
        os._exit(0)
    os.close(write)
    assert os.read(read, 1) == b"1"
    os.waitpid(pid, 0)
