"""The one retry policy: capped doubling, reset after success, a budget that ends a long outage."""

from __future__ import annotations

import pytest

from cdcd.config import parse_config
from cdcd.errors import SourceError, SourceFatal
from cdcd.retry import Backoff, source_backoff


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_delays_double_up_to_the_cap_and_reset_after_success() -> None:
    clock = Clock()
    b = Backoff(max_s=4, jitter=0, clock=clock)
    delays = [b.failure(OSError("x")) for _ in range(5)]
    assert delays == [0.5, 1.0, 2.0, 4.0, 4.0]
    b.success()
    assert b.failure(OSError("x")) == 0.5


def test_jitter_stays_within_its_fraction_and_the_cap() -> None:
    b = Backoff(max_s=10, jitter=0.5, clock=Clock())
    first = b.failure(OSError())
    assert 0.5 <= first <= 0.75
    for _ in range(10):
        assert b.failure(OSError()) <= 10


def test_an_attempt_that_held_for_a_while_starts_a_new_outage() -> None:
    clock = Clock()
    b = Backoff(max_s=4, jitter=0, stable_s=30, budget_s=60, give_up=lambda s, e: SourceFatal("gone"), clock=clock)
    for _ in range(4):
        clock.now += b.failure(OSError())
    clock.now += 45  # the reconnect worked and held for 45 s before this failure
    assert b.failure(OSError()) == 0.5 and b.failed_for_s() == 0


def test_the_budget_turns_a_long_outage_into_the_fatal_error() -> None:
    clock = Clock()
    cfg = parse_config({"source": {"kind": "postgres", "user": "u", "database": "d", "tables": ["public.t"]},
                        "runtime": {"source_retry_timeout_s": 30, "reconnect_max_s": 4}}, env={})
    b = source_backoff(cfg, "reading the source")
    b._clock = clock  # type: ignore[attr-defined]
    b.failing_since = None
    with pytest.raises(SourceFatal) as caught:
        while True:
            delay = b.failure(SourceError("connection refused"))
            assert delay <= 4
            clock.now += delay
    msg = str(caught.value)
    assert "has failed for 30s" in msg and "connection refused" in msg and "source_retry_timeout_s" in msg
    assert 30 <= clock.now - 1000.0 < 31  # the last sleep ended at the budget, not a cap later


def test_zero_budget_retries_for_ever() -> None:
    clock = Clock()
    b = Backoff(max_s=1, budget_s=0, give_up=lambda s, e: SourceFatal("gone"), clock=clock)
    for _ in range(10000):
        clock.now += b.failure(OSError())
