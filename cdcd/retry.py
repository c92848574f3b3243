"""The one retry policy of cdcd: capped exponential backoff with jitter and a time budget.

Every loop that retries a transient failure (the runtime's source reconnect and
sink delivery, the sources' own stream reconnects) uses ``Backoff``:

* the delay starts at ``first_s`` and doubles per failure up to ``max_s``
  (``runtime.reconnect_max_s``), with up to ``jitter`` (a fraction) added so
  that many daemons do not hammer a recovering server in step;
* ``success()`` resets it; an attempt that ran for ``stable_s`` or more
  before failing also counts as a success (a stream that was up for minutes and
  then broke is a new outage, not the same one);
* with a ``budget_s`` (``runtime.source_retry_timeout_s``), an outage that
  lasts longer turns the next failure into the error ``give_up`` builds
  (a fatal one: exit 4 for the source), naming how long it failed and the last
  error.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable

from cdcd.config import Config
from cdcd.errors import SourceFatal

__all__ = ["Backoff", "source_backoff"]

FIRST_DELAY_S = 0.5


class Backoff:
    def __init__(self, *, max_s: float, first_s: float = FIRST_DELAY_S, budget_s: float | None = None,
                 jitter: float = 0.2, stable_s: float | None = None,
                 give_up: Callable[[float, BaseException], BaseException] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.first_s = min(first_s, max_s)
        self.max_s = max_s
        self.budget_s = budget_s if budget_s else None  # 0 or None: retry for ever
        self.jitter = jitter
        self.stable_s = max_s if stable_s is None else stable_s
        self._give_up = give_up
        self._clock = clock
        self.attempts = 0  # failures in the current outage
        self.failing_since: float | None = None
        self.last_error: BaseException | None = None
        self._attempt_started = clock()

    def success(self) -> None:
        """The operation worked: the next failure starts a new outage with the first delay."""
        self.attempts = 0
        self.failing_since = None

    def failed_for_s(self) -> float:
        return 0.0 if self.failing_since is None else self._clock() - self.failing_since

    def failure(self, error: BaseException) -> float:
        """Record a failure; the delay before the next attempt. Raises ``give_up``'s error when the budget is spent."""
        now = self._clock()
        if self.attempts and now - self._attempt_started >= self.stable_s:
            self.success()  # the last attempt held for a good while: this is a new outage
        if self.failing_since is None:
            self.failing_since = now
        self.last_error = error
        elapsed = now - self.failing_since
        if self.budget_s is not None and elapsed >= self.budget_s and self._give_up is not None:
            raise self._give_up(elapsed, error) from error
        delay = min(self.max_s, self.first_s * 2.0 ** min(self.attempts, 60))
        self.attempts += 1
        if self.jitter:
            delay = min(self.max_s, delay * (1 + random.random() * self.jitter))
        if self.budget_s is not None:
            # wake up in time to report the spent budget rather than sleeping past it
            delay = max(0.0, min(delay, self.budget_s - elapsed + 0.01))
        self._attempt_started = now + delay
        return delay

    async def wait(self, error: BaseException) -> float:
        """``failure`` then sleep the delay; returns the delay slept."""
        delay = self.failure(error)
        await asyncio.sleep(delay)
        return delay


def source_backoff(config: Config, what: str) -> Backoff:
    """The backoff for reconnecting to the source: capped by ``runtime.reconnect_max_s``, given up as a
    ``SourceFatal`` (exit 4) after ``runtime.source_retry_timeout_s`` of continuous failure."""
    rt = config.runtime

    def give_up(elapsed: float, error: BaseException) -> BaseException:
        return SourceFatal(
            f"{what} has failed for {elapsed:.0f}s without recovering (runtime.source_retry_timeout_s = "
            f"{rt.source_retry_timeout_s:g}); last error: {error}. Check that the source is up and reachable "
            "(host, port, firewall); cdcd resumes from its checkpoint when started again, or raise "
            "runtime.source_retry_timeout_s (0 retries for ever)"
        )

    return Backoff(max_s=rt.reconnect_max_s, budget_s=rt.source_retry_timeout_s, give_up=give_up)
