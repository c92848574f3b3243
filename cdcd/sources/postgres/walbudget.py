"""The slot's WAL budget: ``wal_status``, ``safe_wal_size`` and ``max_slot_wal_keep_size``, and the time left at
the current WAL rate (``cdcd.capture.retention`` warns and pauses; docs/operations.md, "WAL budget and binlog
expiry").

A slot whose consumer falls behind holds WAL; past ``max_slot_wal_keep_size`` it is ``unreserved`` and the next
checkpoint invalidates it (``lost``). ``safe_wal_size`` is how much more WAL the server may write before that.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any

from cdcd.capture.retention import Retention, judge_margin, left_text
from cdcd.config import RetentionOptions
from cdcd.runtime.interfaces import CheckResult
from cdcd.sources.postgres.connection import ConnectParams, connect_sql

_QUERY = """
SELECT s.wal_status, s.safe_wal_size,
       pg_wal_lsn_diff(w.lsn, s.restart_lsn)::bigint AS retained,
       pg_wal_lsn_diff(w.lsn, '0/0')::bigint AS lsn,
       (SELECT setting::bigint FROM pg_settings WHERE name = 'max_slot_wal_keep_size') AS keep_mb
FROM (SELECT CASE WHEN pg_is_in_recovery() THEN pg_last_wal_receive_lsn() ELSE pg_current_wal_lsn() END AS lsn) w
LEFT JOIN pg_replication_slots s ON s.slot_name = $1
"""

MB = 1024 * 1024


@dataclass(frozen=True, slots=True)
class WalReading:
    slot: str
    wal_status: str | None  # None: no such slot
    safe_wal_size: int | None  # None: unlimited, or lost
    retained: int | None  # WAL the slot holds (bytes from its restart_lsn to now)
    lsn: int  # the server's WAL position now
    keep_mb: int  # max_slot_wal_keep_size in MB; -1: unlimited


def mib(n: int | None) -> str:
    return "?" if n is None else f"{n / MB:.1f} MiB"


def judge(r: WalReading, rate: float | None, options: RetentionOptions) -> Retention:
    """The budget of one reading (pure). ``rate``: WAL bytes written per second since the previous reading."""
    keep = None if r.keep_mb < 0 else r.keep_mb * MB
    facts: dict[str, Any] = {"slot": r.slot, "wal_status": r.wal_status, "safe_wal_size": r.safe_wal_size,
                             "max_slot_wal_keep_size_bytes": -1 if keep is None else keep,
                             "retained_bytes": r.retained, "wal_rate_bytes_s": None if rate is None else round(rate)}
    if r.wal_status is None:
        return Retention("wal", "unknown", f"replication slot {r.slot!r} does not exist (yet)", facts=facts)
    if r.wal_status == "lost":
        return Retention("wal", "lost", f"replication slot {r.slot!r} lost WAL it needs (wal_status = lost): the "
                         "position is gone; the daemon stops with exit 9 (or recovers, on_position_lost = "
                         "resnapshot)", facts=facts)
    if keep is None:
        return Retention("wal", "unlimited", f"max_slot_wal_keep_size = -1: slot {r.slot!r} keeps WAL without a limit "
                         f"({mib(r.retained)} now); the disk is the limit", facts=facts)
    left_s = None
    if r.safe_wal_size is not None and rate is not None and rate > 0:
        left_s = max(0.0, r.safe_wal_size / rate)
    if r.wal_status == "unreserved":
        return Retention("wal", "unreserved", f"slot {r.slot!r} holds {mib(r.retained)} of WAL, past "
                         f"max_slot_wal_keep_size = {mib(keep)} (wal_status = unreserved): the server's next "
                         "checkpoint invalidates it", left_bytes=r.safe_wal_size, left_s=0.0, fraction_left=0.0,
                         facts=facts)
    safe = r.safe_wal_size
    fraction = None if safe is None or keep == 0 else max(0.0, min(1.0, safe / keep))
    state = "low" if judge_margin(options, fraction, left_s) else "ok"
    rate_text = "" if rate is None else f" at {mib(round(rate))}/s"
    message = (f"slot {r.slot!r} may hold {mib(safe)} more WAL before max_slot_wal_keep_size = {mib(keep)} is "
               f"reached (wal_status = {r.wal_status}, holding {mib(r.retained)}), {left_text(left_s)}{rate_text}")
    return Retention("wal", state, message, left_bytes=safe, left_s=left_s, fraction_left=fraction, facts=facts)


class WalBudget:
    """The probe ``RetentionWatch`` calls: one short connection per reading (the catalog connection serves the
    stream), the WAL rate from the previous reading."""

    def __init__(self, params: ConnectParams, slot: str, options: RetentionOptions) -> None:
        self._params = params
        self._slot = slot
        self._options = options
        self._prev: tuple[int, float] | None = None  # (lsn, monotonic time) of the previous reading

    async def read(self) -> WalReading:
        conn = await connect_sql(self._params)
        try:
            row = await conn.fetchrow(_QUERY, self._slot)
        finally:
            with contextlib.suppress(Exception):  # the reading is done; a failed close changes nothing
                await conn.close(timeout=self._params.connect_timeout_s)
        return WalReading(self._slot, row["wal_status"], row["safe_wal_size"], row["retained"], int(row["lsn"]),
                          int(row["keep_mb"]))

    async def probe(self) -> Retention:
        reading = await self.read()
        now = time.monotonic()
        rate = None
        if self._prev is not None and now > self._prev[1]:
            rate = max(0, reading.lsn - self._prev[0]) / (now - self._prev[1])
        self._prev = (reading.lsn, now)
        return judge(reading, rate, self._options)


#: Below this ``max_slot_wal_keep_size`` (in MB) `cdcd check` fails: a short outage or a slow consumer
#: invalidates the slot (a few minutes of WAL on a busy server).
TINY_KEEP_MB = 1024


async def keep_size_check(conn: Any) -> CheckResult:
    """`cdcd check`'s line for ``max_slot_wal_keep_size``: unlimited (the disk is the limit) or tiny (the slot is
    invalidated soon after cdcd falls behind)."""
    keep_mb = int(await conn.fetchval("SELECT setting::bigint FROM pg_settings WHERE name = 'max_slot_wal_keep_size'"))
    name = "max_slot_wal_keep_size"
    if keep_mb < 0:
        return CheckResult(name, True, "max_slot_wal_keep_size = -1 (unlimited): the slot is never invalidated, but "
                           "the WAL it holds while cdcd is stopped or behind grows without a limit until the disk is "
                           "full; set a limit the disk can hold (docs/postgres.md) and watch "
                           "cdcd_postgres_slot_retained_wal_bytes")
    if keep_mb < TINY_KEEP_MB:
        return CheckResult(name, False, f"max_slot_wal_keep_size = {keep_mb} MB is tiny: once cdcd is that much WAL "
                           "behind (a restart, a slow consumer, a long snapshot) the slot is invalidated and the "
                           "position lost (exit 9, `cdcd recover` re-snapshots every table)",
                           f"raise it to hold hours of WAL at the peak write rate, at least {TINY_KEEP_MB} MB "
                           "(ALTER SYSTEM SET max_slot_wal_keep_size = '16GB'; SELECT pg_reload_conf()), or -1")
    return CheckResult(name, True, f"max_slot_wal_keep_size = {keep_mb} MB: the slot is invalidated once it holds "
                       "that much WAL; cdcd warns and pauses incremental snapshots when source.retention.margin of it "
                       "is left (docs/operations.md, \"WAL budget and binlog expiry\")")
