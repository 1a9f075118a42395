"""The circuit breaker in front of the lookup server and the shared tier: open, half-open, closed."""

from __future__ import annotations

import threading

import pytest

from holeblend_runtime.kv.circuit_breaker import CircuitBreaker


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _opened(clock: Clock, max_failures: int = 3, open_s: float = 2.0) -> CircuitBreaker:
    breaker = CircuitBreaker(max_failures, open_s, clock)
    for _ in range(max_failures - 1):
        assert breaker.failed() is False
    assert breaker.failed() is True
    return breaker


def test_consecutive_failures_open_the_breaker_for_its_open_period():
    clock = Clock()
    breaker = _opened(clock)
    assert breaker.is_open and breaker.num_opened == 1
    clock.now = 1.9
    assert breaker.is_open


def test_a_success_between_failures_starts_the_count_again():
    breaker = CircuitBreaker(2, 2.0, Clock())
    breaker.failed()
    breaker.succeeded()
    assert breaker.failed() is False and not breaker.is_open


def test_a_failed_trial_call_reopens_the_breaker_at_once():
    """After the open period one call goes through; if the remote is still down, that one
    failure reopens the breaker: each period costs one call's timeout, not max_failures."""
    clock = Clock()
    breaker = _opened(clock)
    clock.now = 2.5
    assert not breaker.is_open  # the trial
    assert breaker.failed() is True
    assert breaker.is_open and breaker.num_opened == 2
    clock.now = 4.4
    assert breaker.is_open
    clock.now = 4.6
    assert not breaker.is_open


def test_a_successful_trial_call_closes_the_breaker():
    clock = Clock()
    breaker = _opened(clock)
    clock.now = 2.5
    assert not breaker.is_open
    breaker.succeeded()
    assert not breaker.is_open and not breaker.is_open
    # Closed again: it takes max_failures failures to open it.
    assert breaker.failed() is False and breaker.failed() is False and not breaker.is_open
    assert breaker.failed() is True and breaker.is_open


def test_while_the_trial_runs_other_callers_are_skipped():
    clock = Clock()
    breaker = _opened(clock)
    clock.now = 2.5
    assert not breaker.is_open
    assert breaker.is_open and breaker.is_open
    breaker.succeeded()
    assert not breaker.is_open


def test_a_trial_that_never_reports_is_given_up_after_the_open_period():
    """A caller that raised instead of reporting must not keep the breaker open for good."""
    clock = Clock()
    breaker = _opened(clock)
    clock.now = 2.5
    assert not breaker.is_open  # its caller never reports
    clock.now = 4.4
    assert breaker.is_open
    clock.now = 4.6
    assert not breaker.is_open  # the next trial


def test_a_failure_of_a_call_started_before_the_breaker_opened_does_not_extend_it():
    clock = Clock()
    breaker = _opened(clock)
    clock.now = 1.0
    assert breaker.failed() is False
    clock.now = 2.1
    assert not breaker.is_open


def test_threads_asking_at_once_after_the_open_period_let_exactly_one_call_through():
    clock = Clock()
    breaker = _opened(clock)
    clock.now = 2.5
    start = threading.Barrier(8)
    through: list[bool] = []

    def ask() -> None:
        start.wait()
        for _ in range(200):
            through.append(not breaker.is_open)

    threads = [threading.Thread(target=ask) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert through.count(True) == 1


def test_bad_settings_are_refused_with_the_names():
    with pytest.raises(ValueError, match="max_failures"):
        CircuitBreaker(0, 1.0)
    with pytest.raises(ValueError, match="open_s"):
        CircuitBreaker(1, -1.0)
