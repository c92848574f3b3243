"""Binlog expiry: how long the checkpoint's binlog file stays on the server (``cdcd.capture.retention`` warns
and pauses; docs/operations.md, "WAL budget and binlog expiry").

The server removes a binlog file once it was last written more than ``binlog_expire_logs_seconds`` (or
``expire_logs_days``) ago, at the next rotation. The newest file is never removed; an older one was closed at
some moment after the newest event cdcd read from it, so its age is counted from that event's commit time (the
file may be younger: the warning comes early, never late). A file cdcd read nothing from in this process (a
restart after it was closed) is counted from the moment this process first saw it closed (then the file may be
older: the status says so, ``age_from``).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any

from cdcd.capture.retention import Retention, judge_margin, left_text
from cdcd.config import RetentionOptions
from cdcd.positions import binlog_index
from cdcd.runtime.interfaces import CheckResult
from cdcd.sources.mysql.connection import ConnectParams

EXPIRY_VARIABLES = "SHOW GLOBAL VARIABLES WHERE Variable_name IN ('binlog_expire_logs_seconds', 'expire_logs_days')"


def expire_seconds(variables: dict[str, str]) -> float:
    """The effective expiry in seconds; 0: binlogs never expire by age. ``binlog_expire_logs_seconds`` wins when it
    is set (MySQL 8, MariaDB 10.6+), else ``expire_logs_days`` (MariaDB keeps the two in step)."""
    seconds = float(variables.get("binlog_expire_logs_seconds") or 0)
    if seconds > 0:
        return seconds
    return float(variables.get("expire_logs_days") or 0) * 86400


@dataclass(frozen=True, slots=True)
class BinlogReading:
    files: list[str]  # SHOW BINARY LOGS, oldest first
    expire_s: float
    checkpoint_file: str | None
    closed_after: float | None  # epoch seconds: the file was closed after this (None: it is the newest, or unknown)
    age_from: str  # "event" (the newest event cdcd read in it) or "first seen closed"


def judge(r: BinlogReading, now: float, options: RetentionOptions) -> Retention:
    """The budget of one reading (pure)."""
    ckpt = r.checkpoint_file
    facts: dict[str, Any] = {"checkpoint_binlog": ckpt, "oldest_binlog": r.files[0] if r.files else None,
                             "newest_binlog": r.files[-1] if r.files else None,
                             "binlog_expire_seconds": r.expire_s, "checkpoint_binlog_age_s": None}
    if not r.files or not ckpt:
        why = "the server lists no binary logs" if not r.files else "the checkpoint names no binlog file yet"
        return Retention("binlog", "unknown", why, facts=facts)
    if ckpt not in r.files:
        if binlog_index(ckpt) < binlog_index(r.files[0]):
            return Retention("binlog", "lost", f"the checkpoint's binlog {ckpt} is gone: the oldest on the server is "
                             f"{r.files[0]}; the daemon stops with exit 9 (or recovers, on_position_lost = "
                             "resnapshot)", fraction_left=0.0, left_s=0.0, facts=facts)
        return Retention("binlog", "unknown", f"the checkpoint's binlog {ckpt} is not on the server (newest "
                         f"{r.files[-1]})", facts=facts)
    behind = len(r.files) - 1 - r.files.index(ckpt)
    facts["binlogs_after_checkpoint"] = behind
    if r.expire_s <= 0:
        return Retention("binlog", "unlimited", f"binlogs never expire by age (binlog_expire_logs_seconds and "
                         f"expire_logs_days are 0): the checkpoint's {ckpt} stays until purged by hand; the disk is "
                         "the limit", facts=facts)
    if behind == 0 or r.closed_after is None:
        return Retention("binlog", "ok", f"the checkpoint's binlog {ckpt} is the newest: it cannot expire before the "
                         f"server rotates it and {r.expire_s:.0f} s pass", left_s=r.expire_s, fraction_left=1.0,
                         facts=facts)
    age = max(0.0, now - r.closed_after)
    facts["checkpoint_binlog_age_s"] = round(age, 1)
    facts["age_from"] = r.age_from
    left = max(0.0, r.expire_s - age)
    fraction = left / r.expire_s
    state = "low" if judge_margin(options, fraction, left) else "ok"
    return Retention("binlog", state, f"the checkpoint's binlog {ckpt} was closed about {age:.0f} s ago ({behind} "
                     f"newer on the server) and expires {r.expire_s:.0f} s after it was closed: {left_text(left)}",
                     left_s=left, fraction_left=fraction, facts=facts)


class BinlogExpiry:
    """The probe ``RetentionWatch`` calls: one short connection per reading (the control connection serves the
    stream and the chunks)."""

    def __init__(self, conn: ConnectParams, options: RetentionOptions, newest_event: dict[str, float]) -> None:
        self._conn = conn
        self._options = options
        self.checkpoint_file: str | None = None  # the binlog file of the checkpoint (the source sets it)
        self._newest_event = newest_event  # the stream's: file -> commit time of the newest change read in it
        self._first_seen_closed: dict[str, float] = {}

    async def read(self) -> tuple[list[str], dict[str, str]]:
        conn = await self._conn.open()
        try:
            async with conn.cursor() as cur:
                await cur.execute("SHOW BINARY LOGS")
                files = [str(row[0]) for row in await cur.fetchall()]
                await cur.execute(EXPIRY_VARIABLES)
                variables = {str(k).lower(): str(v) for k, v in await cur.fetchall()}
        finally:
            with contextlib.suppress(Exception):  # the reading is done; a failed close changes nothing
                conn.close()
        return files, variables

    async def probe(self) -> Retention:
        files, variables = await self.read()
        now = time.time()
        ckpt = self.checkpoint_file
        closed_after, age_from = None, "event"
        if ckpt and files and ckpt in files and ckpt != files[-1]:
            first = self._first_seen_closed.setdefault(ckpt, now)
            closed_after = self._newest_event.get(ckpt)
            if closed_after is None:
                closed_after, age_from = first, "first seen closed"
        # what no checkpoint can need any more is forgotten
        keep = set(files)
        for gone in [f for f in self._newest_event if f not in keep]:
            del self._newest_event[gone]
        self._first_seen_closed = {f: t for f, t in self._first_seen_closed.items() if f in keep}
        return judge(BinlogReading(files, expire_seconds(variables), ckpt, closed_after, age_from), now,
                     self._options)


def expiry_check(variables: dict[str, str]) -> CheckResult:
    """`cdcd check`'s line for the binlog expiry: never (the disk is the limit) or short (a stop of the daemon for
    longer loses the position)."""
    seconds = expire_seconds(variables)
    name = "binlog expiry"
    setting = (f"binlog_expire_logs_seconds = {variables.get('binlog_expire_logs_seconds', '(absent)')}, "
               f"expire_logs_days = {variables.get('expire_logs_days', '(absent)')}")
    if seconds <= 0:
        return CheckResult(name, True, f"{setting}: binlogs never expire by age, so cdcd's position is never "
                           "expired away, but binlogs grow until purged by hand (PURGE BINARY LOGS past the "
                           "checkpoint loses it; docs/mysql.md)")
    if seconds < 86400:
        return CheckResult(name, False, f"{setting}: a binlog file expires {seconds:.0f} s after it is closed; a "
                           "daemon stopped or behind for longer loses its position (exit 9, `cdcd recover` "
                           "re-snapshots every table)",
                           "keep binlogs for longer than the longest outage to ride out, at least a day: "
                           "SET GLOBAL binlog_expire_logs_seconds = 604800 (and in the server's config file)")
    return CheckResult(name, True, f"{setting}: a binlog file expires {seconds / 86400:.1f} days after it is closed; "
                       "cdcd warns and pauses incremental snapshots when source.retention.margin of it is left "
                       "(docs/operations.md, \"WAL budget and binlog expiry\")")
