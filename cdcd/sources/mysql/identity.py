"""Is the server still the binlog history the checkpoint came from? Pure judgement, no I/O.

A checkpoint names a place in one server's binlog: a file and offset, and
(with GTIDs) the set of transactions completed up to there. Before cdcd
resumes, on every start and every reconnect, it compares that place with what
the server says now (``BinlogFacts``) and with the server identity recorded in
the checkpoint (``server_id``; MySQL also ``server_uuid``):

- the same server, and it still has the checkpoint's GTIDs and binlog file:
  resume there;
- the same server, but its binlog went back (``RESET MASTER``, a restore from
  an older backup): the GTID set no longer contains the checkpoint's GTIDs, or
  the file sequence restarted below the checkpoint's file, or the checkpoint's
  file is shorter than the checkpoint's offset, or (with GTIDs) the binlog at
  the checkpoint's file and offset is not the checkpoint's transaction
  (``BinlogAt``: no event starts there, or the GTID state there is not the
  checkpoint's). The last one catches a reset binlog whose new history has
  grown past the checkpoint's file, offset and GTID sequence numbers, which
  comparing GTID sets cannot tell from the old history. The changes since are
  lost to cdcd: ``PositionLost``;
- another server (a failover): with GTIDs, and when the new server has every
  GTID of the checkpoint, resume from the GTID set in a new *epoch* (positions
  of the new server sort above all earlier ones, see ``MySqlPosition``);
  without GTIDs, or when GTIDs are missing: ``PositionLost`` naming them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from cdcd.errors import PositionLost
from cdcd.positions import MySqlPosition, binlog_index
from cdcd.sources.mysql.gtid import MariaGtidSet, MySqlGtidSet

__all__ = ["BinlogFacts", "PositionLost", "PurgedFile", "Verdict", "judge", "missing_gtids", "same_server"]


@dataclass(frozen=True)
class BinlogAt:
    """What the server's binlog holds at one file and offset: the place of the position being judged."""

    file: str
    pos: int
    boundary: bool  # an event starts at the offset, or the file ends there
    #: MariaDB: BINLOG_GTID_POS(file, pos), the GTID state before the event there; None on MySQL
    gtid_before: str | None = None
    #: the GTID of the event group starting at the offset ("0-1-7" / "uuid:7"); None: no GTID event starts there
    event_gtid: str | None = None


@dataclass(frozen=True)
class BinlogFacts:
    """What the server says about itself now."""

    flavor: str  # mariadb | mysql
    server_id: int
    uuid: str  # MySQL's server_uuid; "" on MariaDB
    gtid: str  # MariaDB gtid_binlog_pos; MySQL gtid_executed ("" when GTIDs are off)
    gtid_mode: bool  # MySQL gtid_mode = ON (MariaDB: always usable)
    binlogs: list[tuple[str, int]] = field(default_factory=list)  # SHOW BINARY LOGS: (name, size)
    at: BinlogAt | None = None  # the binlog at the judged position's file and offset, when it was read

    @property
    def files(self) -> list[str]:
        return [name for name, _ in self.binlogs]

    def identity(self, epoch: int) -> dict[str, Any]:
        """What the checkpoint records about the server (the ``server`` entry of the source state)."""
        return {"server_id": self.server_id, "uuid": self.uuid, "epoch": epoch}

    def describe(self) -> str:
        return f"server_id {self.server_id}" + (f", server_uuid {self.uuid}" if self.uuid else "")


def same_server(recorded: dict[str, Any] | None, facts: BinlogFacts) -> bool:
    """True when the recorded identity is this server (no record: assumed, it is recorded from now on)."""
    if not recorded:
        return True
    if int(recorded.get("server_id", -1)) != facts.server_id:
        return False
    old_uuid = str(recorded.get("uuid") or "")
    return not (old_uuid and facts.uuid and old_uuid.lower() != facts.uuid.lower())


def describe_recorded(recorded: dict[str, Any]) -> str:
    uuid = recorded.get("uuid") or ""
    return f"server_id {recorded.get('server_id')}" + (f", server_uuid {uuid}" if uuid else "")


def missing_gtids(flavor: str, have: str, need: str) -> str:
    """The GTIDs of ``need`` that ``have`` lacks, as text ("" when none are missing)."""
    if flavor == "mariadb":
        mine, theirs = MariaGtidSet.parse(have), MariaGtidSet.parse(need)
        parts = []
        for domain, (srv, seq) in sorted(theirs.domains.items()):
            cur = mine.domains.get(domain)
            if cur is None:
                parts.append(f"domain {domain}: {domain}-{srv}-1 to {domain}-{srv}-{seq} (the server has none)")
            elif cur[1] < seq:
                parts.append(f"domain {domain}: seq {cur[1] + 1} to {seq} (up to {domain}-{srv}-{seq}; the server "
                             f"ends at {domain}-{cur[0]}-{cur[1]})")
        return "; ".join(parts)
    if not need.strip():
        return ""
    return str(MySqlGtidSet.parse(need).missing_from(MySqlGtidSet.parse(have)))


def gtid_usable(flavor: str, facts: BinlogFacts, gtid: str) -> bool:
    """GTID positioning works: the checkpoint has a GTID set and the server uses GTIDs."""
    return bool(gtid) and (flavor == "mariadb" or facts.gtid_mode)


@dataclass(frozen=True)
class Verdict:
    """Where to resume: ``by_gtid`` from ``position.gtid``, else from its file and offset, in ``epoch``."""

    epoch: int
    by_gtid: bool
    switched: bool  # another server than the recorded one: a new epoch


def judge(facts: BinlogFacts, recorded: dict[str, Any] | None, epoch: int, pos: MySqlPosition,
          what: str) -> Verdict:
    """Decide how to resume from ``pos`` (``what`` names it in messages) on the server of ``facts``.

    ``recorded`` is the identity the checkpoint recorded (None before one was), ``epoch`` the current
    epoch. Raises ``PositionLost`` when the server's history does not contain ``pos``.
    """
    flavor = facts.flavor
    usable = gtid_usable(flavor, facts, pos.gtid)
    gtid_name = "gtid_binlog_pos" if flavor == "mariadb" else "gtid_executed"
    if not same_server(recorded, facts):
        assert recorded is not None
        change = f"the source server changed from {describe_recorded(recorded)} to {facts.describe()}"
        if not usable:
            raise PositionLost(
                f"{change} (a failover or another server behind the same address), and {what} ({pos}) is a binlog "
                "file and offset of the old server, which mean nothing on this one: cdcd can follow a failover only "
                "with GTIDs (MariaDB: always; MySQL: gtid_mode = ON and enforce_gtid_consistency = ON)")
        missing = missing_gtids(flavor, facts.gtid, pos.gtid)
        if missing:
            raise PositionLost(
                f"{change}, and the new server lacks GTIDs that {what} has seen: {missing} (the checkpoint has "
                f"{pos.gtid}, the server's {gtid_name} is {facts.gtid or 'empty'}): those transactions are not in "
                "its binlog, so it is not a replica that caught up with the old server. Point cdcd at a server "
                "that has them (a replica with log_slave_updates / log_replica_updates that replicated them)")
        return Verdict(epoch + 1, True, True)
    if usable:
        missing = missing_gtids(flavor, facts.gtid, pos.gtid)
        if missing:
            raise PositionLost(
                f"the server ({facts.describe()}) no longer has GTIDs that {what} has seen: {missing} (the "
                f"checkpoint has {pos.gtid}, the server's {gtid_name} is {facts.gtid or 'empty'}): its binlog was "
                "reset (RESET MASTER / RESET BINARY LOGS AND GTIDS) or it was restored from an older backup")
    if pos.file and pos.epoch >= epoch:
        _check_file(facts, pos, what)
        if usable:
            check_transaction(facts, pos, what)
    elif not usable:  # an epoch's start, or a position of an earlier server: only its GTID set locates it
        raise PositionLost(f"{what} ({pos}) is known by its GTID set only, and the server does not use GTIDs")
    return Verdict(epoch, usable, False)


def _check_file(facts: BinlogFacts, pos: MySqlPosition, what: str) -> None:
    sizes = dict(facts.binlogs)
    if pos.file in sizes:
        if sizes[pos.file] < pos.pos:
            raise PositionLost(
                f"binlog file {pos.file} on the server ({facts.describe()}) is {sizes[pos.file]} bytes long, shorter "
                f"than the offset {pos.pos} of {what} ({pos}): its binlog was reset (RESET MASTER) or it was "
                "restored from an older backup")
        return
    indexes = [binlog_index(name) for name in sizes if _has_index(name)]
    if indexes and max(indexes) < pos.file_index:
        raise PositionLost(
            f"the server's ({facts.describe()}) binlog files restarted below {what}'s file {pos.file}: the newest is "
            f"{max(sizes, key=lambda n: binlog_index(n) if _has_index(n) else -1)}. Its binlog was reset "
            "(RESET MASTER) or it was restored from an older backup")
    # An older file than the oldest on the server: purged (the caller says so, with the oldest file).
    raise PurgedFile(pos.file)


def check_transaction(facts: BinlogFacts, pos: MySqlPosition, what: str) -> None:
    """The server's binlog at ``pos``'s file and offset is the place ``pos`` names, judged by GTIDs.

    A position's offset is the start of its transaction (or, for a snapshot watermark, where the binlog ended
    then); its GTID set is the state before that transaction (items inside it, watermarks) or after it (its
    commit). MariaDB: ``BINLOG_GTID_POS`` at the offset must equal the set, or equal it with the transaction
    starting there added. MySQL (no such function): the GTID of the transaction starting there must be the
    next one of its source after the set, or the last one in it. A new history (``RESET MASTER``, a restore)
    passes only if a transaction of the very same GTID starts at the very same offset. Not judged without
    ``facts.at`` for this place (read only when the file is on the server)."""
    at = facts.at
    if at is None or at.file != pos.file or at.pos != pos.pos:
        return
    reset = ("its binlog was reset (RESET MASTER / RESET BINARY LOGS AND GTIDS) and has grown again, or the "
             "server was restored from another backup: this binlog is another history than the one cdcd read")
    if not at.boundary:
        raise PositionLost(
            f"no binlog event starts at {pos.file}:{pos.pos} on the server ({facts.describe()}), where {what} ({pos}) "
            f"does: {reset}")
    if facts.flavor == "mariadb":
        have = MariaGtidSet.parse(at.gtid_before or "")
        want = MariaGtidSet.parse(pos.gtid)
        if str(have) == str(want):
            return
        g = MariaGtidSet.parse(at.event_gtid or "")
        if at.event_gtid and str(have.union(g)) == str(want):
            return
        raise PositionLost(
            f"the server's ({facts.describe()}) binlog at {pos.file}:{pos.pos} is not {what} ({pos}): the GTID state "
            f"there is {str(have) or 'empty'}"
            + (f" and the transaction starting there is {at.event_gtid}" if at.event_gtid else "")
            + f", where cdcd read {pos.gtid or 'an empty set'}: {reset}")
    if not at.event_gtid:
        return  # no transaction starts there yet (the end of the binlog): the file and GTID checks stand
    sid, _, gno_text = at.event_gtid.rpartition(":")
    gno = int(gno_text)
    have_set = MySqlGtidSet.parse(pos.gtid)

    def has(n: int) -> bool:
        return n >= 1 and have_set.contains(MySqlGtidSet({sid.lower(): [(n, n)]}))

    if (not has(gno) and (gno == 1 or has(gno - 1))) or (has(gno) and not has(gno + 1)):
        return
    raise PositionLost(
        f"the server's ({facts.describe()}) binlog at {pos.file}:{pos.pos} is not {what} ({pos}): the transaction "
        f"starting there is {at.event_gtid}, which is neither the next nor the last transaction of its source in the "
        f"GTID set cdcd read there ({pos.gtid or 'empty'}): {reset}")


def parse_event_gtid(event_type: str, info: str) -> str | None:
    """The GTID of a ``SHOW BINLOG EVENTS`` row (MariaDB ``Gtid`` "BEGIN GTID 0-1-7", MySQL ``Gtid``
    "SET @@SESSION.GTID_NEXT= 'uuid:7'"); None for any other event."""
    if event_type.lower() != "gtid":
        return None
    text = info.strip().rstrip(";").strip()
    if "GTID_NEXT" in text.upper():
        return text.split("=", 1)[1].strip().strip("'\"")
    for word in text.split():
        if word.count("-") == 2 and word.replace("-", "").isdigit():
            return word
    return None


class PurgedFile(PositionLost):
    """The checkpoint's binlog file was purged (expiry, PURGE BINARY LOGS)."""


def _has_index(name: str) -> bool:
    try:
        binlog_index(name)
    except ValueError:
        return False
    return True
