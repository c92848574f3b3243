"""The source's retention budget: how much the server keeps for cdcd's position before it drops it.

A PostgreSQL slot is invalidated once it holds more WAL than ``max_slot_wal_keep_size``; a MariaDB/MySQL binlog
file expires ``binlog_expire_logs_seconds`` after it was closed. Either loses the position (exit 9, the runbook
in docs/operations.md). Each source reads its own facts (``sources/postgres/walbudget.py``,
``sources/mysql/expiry.py``) into one shape, ``Retention``, which /status, the metrics and ``cdcd status`` show;
``RetentionWatch`` reads it on a bounded interval, warns on the way down and pauses the incremental snapshots
(their chunk reads) while it is low, so the stream and the checkpoint catch up first.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from cdcd.capture.incremental.gate import Gate
from cdcd.config import RetentionOptions

#: The runbook the warnings point to.
RUNBOOK = 'docs/operations.md, "WAL budget and binlog expiry"'

#: States: ok; low (within the margin); unreserved (PostgreSQL: past max_slot_wal_keep_size, invalidated at the
#: next checkpoint); lost; unlimited (nothing is ever dropped: the disk is the limit); unknown (nothing to judge).
LOW_STATES = ("low", "unreserved")


@dataclass(frozen=True, slots=True)
class Retention:
    """One reading of the budget, the same for every source."""

    kind: str  # "wal" (PostgreSQL) or "binlog" (MariaDB/MySQL)
    state: str
    message: str  # one sentence: what is kept, what is left, what it means
    left_bytes: int | None = None  # PostgreSQL: safe_wal_size
    left_s: float | None = None  # time left at the current WAL rate, or before the binlog file expires
    fraction_left: float | None = None  # of the whole budget
    facts: dict[str, Any] = field(default_factory=dict)  # the source's own readings

    @property
    def low(self) -> bool:
        return self.state in LOW_STATES

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind, "state": self.state, "low": self.low, "message": self.message,
                               "left_bytes": self.left_bytes,
                               "left_s": None if self.left_s is None else round(self.left_s, 1),
                               "fraction_left": None if self.fraction_left is None else round(self.fraction_left, 4)}
        out.update(self.facts)
        return out


def judge_margin(options: RetentionOptions, fraction_left: float | None, left_s: float | None) -> bool:
    """Whether a budget with this much left is within the configured margin."""
    if fraction_left is not None and options.margin > 0 and fraction_left < options.margin:
        return True
    return left_s is not None and options.margin_s > 0 and left_s < options.margin_s


def left_text(left_s: float | None) -> str:
    if left_s is None:
        return "time left unknown (no rate yet)"
    if left_s <= 0:
        return "no time left"
    return f"about {left_s:.0f} s left" if left_s < 5400 else f"about {left_s / 3600:.1f} h left"


Probe = Callable[[], Awaitable[Retention]]


class RetentionWatch:
    """Reads the budget every ``check_interval_s`` while the stream runs; logs each change of state and closes the
    incremental snapshots' gate while it is low."""

    def __init__(self, options: RetentionOptions, probe: Probe, gate: Gate, log: Any, timeout_s: float) -> None:
        self.options = options
        self._probe = probe
        self._gate = gate
        self._log = log
        self._timeout_s = timeout_s
        self.last: Retention | None = None
        self.checked_at: float | None = None
        self.error: str | None = None  # why the last reading failed (None: it worked)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name="cdcd-retention")

    def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()

    def status(self) -> dict[str, Any]:
        """The ``retention`` part of a source's /status (empty before the first reading)."""
        if self.last is None and self.error is None:
            return {}
        doc: dict[str, Any] = self.last.to_json() if self.last is not None else {"state": "unknown", "low": False}
        doc["checked_at"] = self.checked_at
        doc["check_error"] = self.error
        doc["incremental_paused"] = self._gate.reason is not None
        return {"retention": doc}

    async def _run(self) -> None:
        while True:
            await self.check()
            await asyncio.sleep(self.options.check_interval_s)

    async def check(self) -> Retention | None:
        """One reading, bounded by the timeout; a failed one is logged, kept in /status and tried again at the next
        interval (the stream's own errors stop or retry the daemon; the budget is a warning)."""
        try:
            async with asyncio.timeout(self._timeout_s):
                reading = await self._probe()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # kept: /status check_error, the log; the next interval reads again
            self.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            self._log.warning("reading the source's retention budget failed; reading again later",
                              error=self.error, retry_in_s=self.options.check_interval_s)
            return None
        self.error = None
        self.checked_at = time.time()
        self.apply(reading)
        return reading

    def apply(self, reading: Retention) -> None:
        """Log a change of state; pause or resume the incremental snapshots."""
        before, self.last = self.last, reading
        if before is not None and before.state == reading.state:
            return
        fields = reading.to_json()
        fields.pop("message")
        if reading.low:
            paused = self._gate.reason is None
            self._gate.close(f"source retention budget {reading.state}: {reading.message}")
            self._log.warning(f"source retention budget {reading.state}: {reading.message}; incremental snapshots "
                              f"{'paused' if paused else 'stay paused'} so the stream catches up. What to do: "
                              f"{RUNBOOK}", **fields)
            return
        if reading.state == "lost":  # nothing left to protect: the stream stops (exit 9) or recovers
            resume = "; incremental snapshots resume" if self._gate.reason is not None else ""
            self._gate.open()
            self._log.error(f"source retention budget lost: {reading.message}{resume}. What to do: "
                            'docs/operations.md, "A lost position"', **fields)
        elif self._gate.reason is not None:
            self._gate.open()
            self._log.info(f"source retention budget recovered ({reading.state}): {reading.message}; incremental "
                           "snapshots resume", **fields)
        elif reading.state == "unlimited" or before is not None:
            self._log.info(f"source retention budget {reading.state}: {reading.message}", **fields)
