"""Is the PostgreSQL server still the history the checkpoint came from? Pure judgement, no I/O.

On every (re)connect cdcd asks the server ``IDENTIFY_SYSTEM`` (system
identifier, timeline, current WAL flush position) and compares it with what
the checkpoint recorded and with the highest position cdcd has captured:

- another system identifier: another cluster (a new initdb, a logical copy):
  the slot's positions mean nothing there. Fatal.
- the WAL position behind what cdcd captured: the server was restored from an
  older copy of its data directory (slot included), or went back in time by
  any other means; changes cdcd landed are not in its history, and positions
  of new changes would repeat old ones. Fatal. (A slot that merely lags after a
  crash is normal: the slot's confirmed position may be behind the
  checkpoint, the WAL is not, since the server sends only flushed WAL.)
- a new timeline: a promotion or a point-in-time recovery. Accepted when the
  timeline history shows the old timeline ended at or after the highest
  position cdcd captured (everything captured is in the new history: a
  promoted standby that had all of it, with the slot on it); fatal otherwise,
  and when the timeline went down.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cdcd.positions import format_lsn, parse_lsn


class HistoryDiverged(Exception):
    """The server's history does not contain what cdcd captured; ``str()`` says what changed."""


@dataclass(frozen=True)
class SystemFacts:
    systemid: str
    timeline: int
    wal_lsn: int  # the server's WAL flush position now

    @classmethod
    def from_identify(cls, row: dict[str, str | None]) -> SystemFacts:
        return cls(str(row.get("systemid") or ""), int(row.get("timeline") or 0), parse_lsn(str(row.get("xlogpos"))))

    def record(self) -> dict[str, Any]:
        """What the checkpoint keeps (the ``system`` entry of the source state)."""
        return {"systemid": self.systemid, "timeline": self.timeline}


def timeline_switch(history: str, timeline: int) -> int | None:
    """The LSN where ``timeline`` ended, from a timeline history file (``parent<TAB>switchpoint<TAB>reason``)."""
    for line in history.splitlines():
        parts = line.strip().split()
        if len(parts) >= 2 and parts[0].isdigit() and int(parts[0]) == timeline:
            return parse_lsn(parts[1])
    return None


def needs_history(recorded: dict[str, Any] | None, facts: SystemFacts) -> bool:
    if not recorded:
        return False
    return facts.timeline > int(recorded.get("timeline", 0)) and str(recorded.get("systemid")) == facts.systemid


def judge_system(recorded: dict[str, Any] | None, facts: SystemFacts, reached: int, history: str | None,
                 where: str) -> bool:
    """Check the server against the checkpoint; True when the record must be updated (first record, new
    timeline accepted). ``reached`` is the highest LSN cdcd captured or committed; ``history`` the timeline
    history file of the server's timeline when ``needs_history``. Raises ``HistoryDiverged``."""
    if recorded and str(recorded.get("systemid")) != facts.systemid:
        raise HistoryDiverged(
            f"{where} is another PostgreSQL cluster than the one the checkpoint was taken from: its system "
            f"identifier is {facts.systemid}, the checkpoint's {recorded.get('systemid')} (a new initdb, or the "
            "address now points at another server)")
    if facts.wal_lsn < reached:
        raise HistoryDiverged(
            f"{where} went back in time: its WAL ends at {format_lsn(facts.wal_lsn)}, behind {format_lsn(reached)}, "
            "the position of changes cdcd already captured (timeline "
            f"{facts.timeline}). It was restored from an older copy of its data directory or a backup: the changes "
            "after that point are not in its history and new changes would reuse their positions")
    if not recorded:
        return True
    old = int(recorded.get("timeline", 0))
    if facts.timeline == old:
        return False
    if facts.timeline < old:
        raise HistoryDiverged(
            f"{where} is on timeline {facts.timeline}, older than the checkpoint's timeline {old}: it was restored "
            "from a backup taken before a promotion")
    switch = timeline_switch(history or "", old)
    if switch is None:
        raise HistoryDiverged(
            f"{where} moved from timeline {old} to {facts.timeline} and its timeline history does not name timeline "
            f"{old}: it is not a descendant of the history cdcd captured")
    if switch < reached:
        raise HistoryDiverged(
            f"{where} moved from timeline {old} to {facts.timeline} (a promotion or point-in-time recovery) that "
            f"forked at {format_lsn(switch)}, before {format_lsn(reached)}, the position of changes cdcd already "
            "captured: those changes are not in the new timeline's history")
    return True
