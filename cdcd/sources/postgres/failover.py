"""Failover slots (PostgreSQL 17+): ``source.postgres.failover_slot`` and what ``cdcd check`` says about them.

A slot created with ``failover`` is copied to every standby that runs with ``sync_replication_slots = on``; the
primary's ``synchronized_standby_slots`` holds logical changes back until those standbys have the WAL, so a
promoted standby's history contains everything cdcd captured and its copy of the slot goes on where cdcd stood.
Without it a promotion leaves no slot: cdcd stops with the lost-position exit code (docs/postgres.md).
"""

from __future__ import annotations

from typing import Any

from cdcd.errors import ConfigError
from cdcd.runtime.interfaces import CheckResult

FAILOVER_MIN = 170000  # server_version_num: failover slots and slot synchronisation came with 17

STANDBY_FIX = ("on the standby set sync_replication_slots = on, hot_standby_feedback = on, primary_slot_name = "
               "'<its physical slot on the primary>' and dbname=<database> in primary_conninfo, then reload")
PRIMARY_FIX = ("on the primary set synchronized_standby_slots = '<the standbys' physical slots>' and reload, so "
               "that cdcd never receives a change the standbys do not have yet")


def require_failover(version_num: int, wanted: bool, where: str) -> None:
    """``failover_slot = true`` needs a server that has failover slots."""
    if wanted and version_num < FAILOVER_MIN:
        raise ConfigError(f"source.postgres.failover_slot = true: {where} runs PostgreSQL {version_num // 10000}, "
                          "failover slots need 17 or newer; set failover_slot = false (a promotion then ends in "
                          "exit 9 and `cdcd recover`, docs/postgres.md) or upgrade the server")


async def failover_checks(conn: Any, slot: str, wanted: bool) -> list[CheckResult]:
    """The failover lines of ``cdcd check``: on a primary the slot's ``failover`` flag and
    ``synchronized_standby_slots``; on a standby ``sync_replication_slots`` and whether it holds a synchronised
    copy of the slot. On a server older than 17 only the refusal of ``failover_slot = true``."""
    version = int(await conn.fetchval("SHOW server_version_num"))
    if version < FAILOVER_MIN:
        if not wanted:
            return []
        return [CheckResult("failover_slot", False, f"failover_slot = true on PostgreSQL {version // 10000}",
                            "failover slots need PostgreSQL 17+: set source.postgres.failover_slot = false or "
                            "upgrade the server")]
    if await conn.fetchval("SELECT pg_is_in_recovery()"):
        return await _standby(conn, slot, wanted)
    return await _primary(conn, slot, wanted)


async def _primary(conn: Any, slot: str, wanted: bool) -> list[CheckResult]:
    out: list[CheckResult] = []
    failover = await conn.fetchval("SELECT failover FROM pg_replication_slots WHERE slot_name = $1", slot)
    if failover is None:
        detail = f"slot {slot!r} not created yet: cdcd creates it {'with' if wanted else 'without'} failover"
        out.append(CheckResult("failover_slot", True, detail))
    elif failover or not wanted:
        meaning = ("standbys with sync_replication_slots = on keep a copy; cdcd goes on after a promotion"
                   if failover else "a promoted standby has no copy: cdcd would stop with exit 9 (position lost)")
        out.append(CheckResult("failover_slot", True, f"slot {slot!r} failover = {str(failover).lower()}: {meaning}"))
    else:
        out.append(CheckResult(
            "failover_slot", False, f"slot {slot!r} exists without failover, source.postgres.failover_slot = true",
            f"with cdcd stopped run ALTER_REPLICATION_SLOT \"{slot}\" (FAILOVER true) on a replication connection "
            f"(psql \"dbname=<database> replication=database\"), or set failover_slot = false"))
    sync = str(await conn.fetchval("SHOW synchronized_standby_slots") or "")
    names = [n.strip().strip('"') for n in sync.split(",") if n.strip()]
    missing = [n for n in names if not await conn.fetchval(
        "SELECT 1 FROM pg_replication_slots WHERE slot_name = $1 AND slot_type = 'physical'", n)]
    if missing:
        out.append(CheckResult("synchronized_standby_slots", False,
                               f"synchronized_standby_slots = '{sync}' names no physical slot {missing}: logical "
                               "decoding waits for them", "create the standbys' physical slots or fix the list"))
    elif names:
        out.append(CheckResult("synchronized_standby_slots", True,
                               f"synchronized_standby_slots = '{sync}': cdcd receives only changes those standbys "
                               "have, so a promoted one holds everything cdcd captured"))
    else:
        out.append(CheckResult("synchronized_standby_slots", not wanted,
                               "synchronized_standby_slots is empty: cdcd may receive changes a standby does not "
                               "have yet; after its promotion cdcd stops with exit 9 (another history)",
                               PRIMARY_FIX if wanted else ""))
    return out


async def _standby(conn: Any, slot: str, wanted: bool) -> list[CheckResult]:
    out: list[CheckResult] = []
    sync = await conn.fetchval("SHOW sync_replication_slots")
    feedback = await conn.fetchval("SHOW hot_standby_feedback")
    primary_slot = str(await conn.fetchval("SHOW primary_slot_name") or "")
    ready = sync == "on" and feedback == "on" and bool(primary_slot)
    out.append(CheckResult(
        "sync_replication_slots", ready or not wanted,
        f"standby: sync_replication_slots = {sync}, hot_standby_feedback = {feedback}, primary_slot_name = "
        f"'{primary_slot}': {'the failover slots of the primary are copied here' if ready else 'no slot is copied'}",
        "" if ready else STANDBY_FIX))
    synced = await conn.fetchval("SELECT synced FROM pg_replication_slots WHERE slot_name = $1", slot)
    ok = bool(synced) or not wanted
    out.append(CheckResult(
        "synced_slot", ok,
        f"standby: slot {slot!r} " + ("is a synchronised copy: after a promotion cdcd goes on from it" if synced
                                      else "is not here: after a promotion cdcd would stop with exit 9"),
        "" if ok else "create the slot on the primary with failover_slot = true and set up the standby: "
                      + STANDBY_FIX))
    return out
