"""Recovery from a lost replication slot (cdcd/capture/recovery.py): the new slot, and what `cdcd recover` says when
there is nothing to recover."""

from __future__ import annotations

from typing import Any

from cdcd.capture.recovery import nothing_to_recover
from cdcd.errors import NothingToRecover
from cdcd.sources.postgres import catalog
from cdcd.sources.postgres.catalog import SlotInfo
from cdcd.sources.postgres.connection import ConnectParams
from cdcd.sources.postgres.plan import Step
from cdcd.sources.postgres.wire.replication import ReplicationConnection


async def new_slot(params: ConnectParams, sql: Any, name: str, drop: bool) -> int:
    """Create the slot ``name`` again (``drop``: first drop the one that lost its WAL); its consistent point, where
    streaming goes on. No exported snapshot: the tables are re-read by incremental snapshots while streaming."""
    if drop:
        await catalog.drop_slot(sql, name)
    repl = await ReplicationConnection.connect(params)
    try:
        created = await repl.create_slot(name, export_snapshot=False)
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
