"""Recovery from a lost replication slot (cdcd/capture/recovery.py): the slot judged, the new slot taken, and what
`cdcd recover` says when there is nothing to recover."""

from __future__ import annotations

from typing import Any

from cdcd.capture.recovery import Recoveries, nothing_to_recover
from cdcd.config import Config
from cdcd.errors import NothingToRecover, PositionLost
from cdcd.events import Mark, TableId
from cdcd.positions import PgPosition, Position, format_lsn
from cdcd.sources.postgres import catalog
from cdcd.sources.postgres.catalog import SlotInfo
from cdcd.sources.postgres.connection import ConnectParams
from cdcd.sources.postgres.plan import Step, check_slot
from cdcd.sources.postgres.state import PgState
from cdcd.sources.postgres.wire.replication import ReplicationConnection


class PgRecoveries(Recoveries):
    """The PostgreSQL source's recoveries: a lost slot is replaced by a new one of the same name."""

    def __init__(self, config: Config, params: ConnectParams, slot: str) -> None:
        super().__init__(config)
        self._params, self._slot = params, slot
        self._failover = config.source.postgres.failover_slot  # the new slot is one the standbys keep, like the old

    def judge(self, slot: SlotInfo | None, state: PgState) -> tuple[SlotInfo | None, str | None]:
        """``check_slot``; a slot that lost its WAL is, when a recovery may follow, no slot: (None, what was lost)."""
        if slot is None:
            return None, None
        try:
            check_slot(slot, self._params.database)
        except PositionLost:
            if not (self.allowed and state.slot):
                raise
            return None, f"replication slot {slot.name!r} lost WAL it needs (wal_status = lost) on {self._params.where}"
        return slot, None

    async def take(self, sql: Any, state: PgState, lost: str | None, before: Position | None,
                   tables: list[TableId], log: Any) -> tuple[PgPosition, list[Mark]]:
        """The new slot (the one that lost its WAL dropped first), and the marks of the recovery at its point."""
        lsn = await new_slot(self._params, sql, self._slot, drop=lost is not None, failover=self._failover)
        at = PgPosition(lsn, 0)
        what = lost or f"replication slot {state.slot!r} does not exist on {self._params.where}"
        return at, self.plan(tables, at, what, before, log, slot=self._slot, lsn=format_lsn(lsn))


async def new_slot(params: ConnectParams, sql: Any, name: str, drop: bool, failover: bool = False) -> int:
    """Create the slot ``name`` again (``drop``: first drop the one that lost its WAL); its consistent point, where
    streaming goes on. No exported snapshot: the tables are re-read by incremental snapshots while streaming."""
    if drop:
        await catalog.drop_slot(sql, name)
    repl = await ReplicationConnection.connect(params)
    try:
        created = await repl.create_slot(name, export_snapshot=False, failover=failover)
    finally:
        await repl.close()
    return created.consistent_point


def not_lost(step: Step, slot: SlotInfo | None, name: str) -> NothingToRecover:
    """`cdcd recover`'s refusal for a plan that is no recovery."""
    if step is Step.RESUME and slot is not None:
        return nothing_to_recover(f"replication slot {name!r} exists (wal_status = {slot.wal_status}) and still "
                                  "holds the checkpoint's position")
    if step in (Step.SNAPSHOT_DONE, Step.SNAPSHOT_ONLY):
        return nothing_to_recover("snapshot.mode = \"initial_only\" keeps no replication slot")
    return nothing_to_recover("state.path holds no checkpoint of a stream (a first start takes a new slot and "
                              "snapshot by itself)")
