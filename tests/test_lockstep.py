"""advance_together: engines' steps resumed in rounds, the host waiting once per round."""

from __future__ import annotations

import pytest

from rh_dask.engines.lockstep import advance_together, can_advance_together


class _Wait:
    """A wait that is over once ``over`` polls have asked (None: never says, only waits)."""

    def __init__(self, log, name, error=None, over=None):
        self.log, self.name, self.error, self.over = log, name, error, over

    def synchronize(self):
        self.log.append(("wait", self.name))
        if self.error is not None:
            raise self.error

    def __getattr__(self, attr):
        if attr != "done" or self.over is None:
            raise AttributeError(attr)
        self.over -= 1
        return self.over < 0


def _steps(log, name, rounds, result, error_at=None, wait_error_at=None, over=None):
    """A generator of ``rounds`` steps returning ``result``; logs its steps and its close."""
    try:
        for k in range(rounds):
            log.append(("step", name, k))
            if k == error_at:
                raise RuntimeError(f"{name} failed")
            error = RuntimeError("wait failed") if k == wait_error_at else None
            yield _Wait(log, name, error, None if over is None else over[k])
        return result
    finally:
        log.append(("end", name))


def test_every_generator_starts_then_the_oldest_wait_is_waited_for():
    log = []
    out = advance_together(
        [_steps(log, "a", 2, 1), _steps(log, "b", 1, 2), _steps(log, "c", 0, 3)]
    )
    assert out == [1, 2, 3]
    assert log == [
        ("step", "a", 0),
        ("step", "b", 0),
        ("end", "c"),  # no step at all: done when started
        ("wait", "a"),
        ("step", "a", 1),
        ("wait", "b"),
        ("end", "b"),
        ("wait", "a"),
        ("end", "a"),
    ]


def test_a_wait_that_is_over_is_resumed_without_waiting():
    log = []
    # a's first wait is over only at the third poll, b's at once: b goes first
    out = advance_together(
        [_steps(log, "a", 2, 1, over=[2, 0]), _steps(log, "b", 2, 2, over=[0, 0])]
    )
    assert out == [1, 2]
    assert ("wait", "a") not in log and ("wait", "b") not in log
    assert log.index(("step", "b", 1)) < log.index(("step", "a", 1))


def test_an_error_closes_every_other_generator_where_it_stands():
    log = []
    with pytest.raises(RuntimeError, match="b failed"):
        advance_together(
            [_steps(log, "a", 3, 1), _steps(log, "b", 3, 2, error_at=1), _steps(log, "c", 3, 3)]
        )
    # b raised at its second step (its own close ran then); a and c were closed after
    assert log[-4:] == [("step", "b", 1), ("end", "b"), ("end", "a"), ("end", "c")]
    assert ("step", "c", 1) not in log


def test_a_failed_wait_closes_every_generator():
    log = []
    with pytest.raises(RuntimeError, match="wait failed"):
        advance_together([_steps(log, "a", 3, 1, wait_error_at=0), _steps(log, "b", 3, 2)])
    assert log == [
        ("step", "a", 0),
        ("step", "b", 0),
        ("wait", "a"),
        ("end", "a"),
        ("end", "b"),
    ]


def test_which_engines_can_advance_together():
    class Stepped:
        def batch_steps(self, X, y, w=None):
            yield from ()

        def hold(self):
            return None

        def put_back(self, held):
            pass

    class Plain:
        def partial_fit(self, X, y, w=None):
            pass

    assert can_advance_together([Stepped(), Stepped()])
    assert not can_advance_together([Stepped(), Plain()])
