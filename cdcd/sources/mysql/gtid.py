"""GTID sets of both flavors: pure parsing, formatting and set arithmetic.

MariaDB: a position is one ``domain-server-seq`` per replication domain
(``0-1-42,1-7-3``); within a domain, seq numbers are strictly increasing, so
"everything up to seq N of domain D" is the whole set.

MySQL: a set is ``uuid:interval[:interval...]`` per source server
(``3e11fa47-71ca-11e1-9e33-c80aa9429562:1-5:11-18``); intervals are closed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from cdcd.errors import PositionLost

_MARIA_ITEM = re.compile(r"^(\d+)-(\d+)-(\d+)$")
_UUID = re.compile(r"^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$")


@dataclass
class MariaGtidSet:
    """MariaDB GTID position: per domain, the last (server_id, seq)."""

    domains: dict[int, tuple[int, int]] = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str) -> MariaGtidSet:
        out = cls()
        for raw in text.replace("\n", "").split(","):
            item = raw.strip()
            if not item:
                continue
            m = _MARIA_ITEM.match(item)
            if m is None:
                raise ValueError(f"MariaDB GTID {item!r} must look like 'domain-server-seq' (e.g. 0-1-42)")
            out.add(int(m.group(1)), int(m.group(2)), int(m.group(3)))
        return out

    def add(self, domain: int, server: int, seq: int) -> None:
        """Record a completed transaction; positions never move backwards within a domain."""
        cur = self.domains.get(domain)
        if cur is None or seq >= cur[1]:
            self.domains[domain] = (server, seq)

    def union(self, other: MariaGtidSet) -> MariaGtidSet:
        out = MariaGtidSet(dict(self.domains))
        for d, (srv, seq) in other.domains.items():
            out.add(d, srv, seq)
        return out

    def contains(self, other: MariaGtidSet) -> bool:
        """True when every transaction of ``other`` is also in this set."""
        for d, (_, seq) in other.domains.items():
            mine = self.domains.get(d)
            if mine is None or mine[1] < seq:
                return False
        return True

    def __str__(self) -> str:
        return ",".join(f"{d}-{srv}-{seq}" for d, (srv, seq) in sorted(self.domains.items()))

    def copy(self) -> MariaGtidSet:
        return MariaGtidSet(dict(self.domains))


Interval = tuple[int, int]  # closed [start, end]


def _normalize(intervals: list[Interval]) -> list[Interval]:
    out: list[Interval] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1] + 1:
            if end > out[-1][1]:
                out[-1] = (out[-1][0], end)
        else:
            out.append((start, end))
    return out


@dataclass
class MySqlGtidSet:
    """MySQL GTID set: per source UUID, sorted disjoint closed intervals."""

    sids: dict[str, list[Interval]] = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str) -> MySqlGtidSet:
        out = cls()
        # SHOW MASTER STATUS prints long sets over several lines ("...,\n").
        for raw in text.replace("\n", "").replace("\r", "").split(","):
            item = raw.strip()
            if not item:
                continue
            sid, _, rest = item.partition(":")
            if not _UUID.match(sid) or not rest:
                raise ValueError(f"MySQL GTID set item {item!r} must look like 'uuid:1-5[:7-9]'")
            for part in rest.split(":"):
                lo, dash, hi = part.partition("-")
                if not lo.isdigit() or (dash and not hi.isdigit()):
                    raise ValueError(f"MySQL GTID interval {part!r} in {item!r} is not 'N' or 'N-M'")
                start, end = int(lo), int(hi) if dash else int(lo)
                if end < start or start < 1:
                    raise ValueError(f"MySQL GTID interval {part!r} in {item!r} is empty or starts below 1")
                out.add_interval(sid, start, end)
        return out

    def add_interval(self, sid: str, start: int, end: int) -> None:
        key = sid.lower()
        self.sids[key] = _normalize([*self.sids.get(key, []), (start, end)])

    def add(self, sid: str, gno: int) -> None:
        key = sid.lower()
        cur = self.sids.get(key)
        # the common case, the next transaction of the same source, without re-sorting
        if cur and cur[-1][1] + 1 == gno:
            cur[-1] = (cur[-1][0], gno)
            return
        self.add_interval(key, gno, gno)

    def add_gtid(self, gtid: str) -> None:
        """Add one ``uuid:gno``."""
        sid, _, gno = gtid.rpartition(":")
        if not _UUID.match(sid) or not gno.isdigit():
            raise ValueError(f"MySQL GTID {gtid!r} must look like 'uuid:N'")
        self.add(sid, int(gno))

    def union(self, other: MySqlGtidSet) -> MySqlGtidSet:
        out = self.copy()
        for sid, ivs in other.sids.items():
            out.sids[sid] = _normalize([*out.sids.get(sid, []), *ivs])
        return out

    def contains(self, other: MySqlGtidSet) -> bool:
        """True when ``other`` is a subset of this set."""
        for sid, ivs in other.sids.items():
            mine = self.sids.get(sid, [])
            for start, end in ivs:
                if not any(a <= start and end <= b for a, b in mine):
                    return False
        return True

    def missing_from(self, other: MySqlGtidSet) -> MySqlGtidSet:
        """The part of this set that ``other`` lacks (this minus other)."""
        out = MySqlGtidSet()
        for sid, ivs in self.sids.items():
            theirs = other.sids.get(sid, [])
            for start, end in ivs:
                cur = start
                for a, b in theirs:
                    if b < cur or a > end:
                        continue
                    if a > cur:
                        out.add_interval(sid, cur, a - 1)
                    cur = max(cur, b + 1)
                if cur <= end:
                    out.add_interval(sid, cur, end)
        return out

    def __str__(self) -> str:
        parts = []
        for sid, ivs in sorted(self.sids.items()):
            spans = ":".join(f"{a}" if a == b else f"{a}-{b}" for a, b in ivs)
            parts.append(f"{sid}:{spans}")
        return ",".join(parts)

    def __bool__(self) -> bool:
        return bool(self.sids)

    def copy(self) -> MySqlGtidSet:
        return MySqlGtidSet({k: list(v) for k, v in self.sids.items()})


GtidSet = MariaGtidSet | MySqlGtidSet


def parse_gtid_set(flavor: str, text: str) -> GtidSet:
    """Parse a GTID set of the given flavor (``mariadb`` or ``mysql``)."""
    if flavor == "mariadb":
        return MariaGtidSet.parse(text)
    return MySqlGtidSet.parse(text)


def check_not_purged(flavor: str, have: str, purged: str) -> None:
    """MySQL: ``gtid_purged`` must be a subset of what the checkpoint already has.

    Raises PositionLost naming the missing transactions otherwise.
    """
    if flavor != "mysql" or not purged.strip():
        return
    mine = MySqlGtidSet.parse(have)
    gone = MySqlGtidSet.parse(purged)
    missing = gone.missing_from(mine)
    if missing:
        raise PositionLost(
            f"the server purged GTIDs {missing} that the checkpoint (executed set {have or 'empty'}) has not seen: "
            "those changes are lost to cdcd. Re-snapshot: stop cdcd, remove the state directory (state.path) and "
            "the landing zone, and start again with snapshot.mode = \"initial\" (or use snapshot.mode = "
            "\"when_needed\" to re-snapshot automatically); keep binlogs longer (binlog_expire_logs_seconds)."
        )
