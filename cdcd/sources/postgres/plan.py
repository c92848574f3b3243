"""The PostgreSQL planner's decision, pure: what a run does, from the checkpoint state, the slot and the mode.

``PostgresSource.connect`` gathers the facts (the checkpoint's ``PgState``, the slot as the server reports it,
``snapshot.mode``) and carries the decision out (create or advance the slot, open the snapshot, start the
stream); the decision itself has no I/O, so every case is a unit test (tests/unit/test_pg_plan.py).
"""

from __future__ import annotations

import enum

from cdcd.errors import PositionLost, SourceFatal
from cdcd.sources.postgres.catalog import SlotInfo
from cdcd.sources.postgres.state import PgState


class Step(enum.Enum):
    SNAPSHOT_DONE = "initial_only and its snapshot is done: nothing to do"
    SNAPSHOT_ONLY = "initial_only: (the rest of) a snapshot without a slot"
    RESUME = "stream from the checkpoint's slot (and finish its snapshot if it was running)"
    NEW_SLOT_AFTER_LOSS = "the checkpoint's slot is gone and snapshot.mode = when_needed: a new slot and snapshot"
    RECOVER = "the checkpoint's slot is gone, recovery allowed: a new slot, every table re-snapshotted incrementally"
    NEW_SLOT_SNAPSHOT = "a first start: a new slot exporting its snapshot"
    NEW_SLOT_STREAM = "a first start with snapshot.mode = never: a new slot, no snapshot"
    SLOT_STREAM = "a first start with snapshot.mode = never on an existing slot: stream from its point"
    SLOT_SNAPSHOT = "a first start on an existing slot: advance it to now, snapshot under a fresh snapshot"


def decide(state: PgState, slot: SlotInfo | None, configured_slot: str, mode: str, where: str,
           recover: bool = False) -> Step:
    """The run to plan; raises ``SourceFatal`` when the checkpoint cannot be honoured. ``recover``: a lost slot may
    be recovered (source.on_position_lost = "resnapshot", `cdcd recover`)."""
    if mode == "initial_only":
        return Step.SNAPSHOT_DONE if state.snapshot == "done" else Step.SNAPSHOT_ONLY
    if state.slot:
        if state.slot != configured_slot:
            raise SourceFatal(f"the checkpoint was written for replication slot {state.slot!r} but "
                              f"source.postgres.slot is {configured_slot!r}; restore the setting, or re-snapshot "
                              "with a fresh state.path")
        if slot is None:
            if recover:  # asked for: wins over when_needed's full snapshot
                return Step.RECOVER
            if mode == "when_needed":
                return Step.NEW_SLOT_AFTER_LOSS
            raise PositionLost(slot_gone_message(state.slot, where))
        return Step.RESUME
    if slot is None:
        return Step.NEW_SLOT_STREAM if mode == "never" else Step.NEW_SLOT_SNAPSHOT
    return Step.SLOT_STREAM if mode == "never" else Step.SLOT_SNAPSHOT


def check_slot(slot: SlotInfo, database: str) -> None:
    """An existing slot cdcd can use: pgoutput on the configured database, its WAL still there."""
    if slot.plugin != "pgoutput" or slot.database != database:
        raise SourceFatal(
            f"replication slot {slot.name!r} uses plugin {slot.plugin!r} on database {slot.database!r}; cdcd needs "
            f"a pgoutput slot on {database!r}: set source.postgres.slot to another name")
    if slot.wal_status == "lost":
        raise PositionLost(f"replication slot {slot.name!r} has lost WAL it needs (wal_status=lost, "
                           f"max_slot_wal_keep_size exceeded): {RECOVER_FIX}")


def slot_gone_message(slot: str, where: str) -> str:
    return (f"replication slot {slot!r} named by the checkpoint does not exist on {where}: "
            "the changes since the checkpoint are lost to it, and a new slot would silently skip them. "
            f"{RECOVER_FIX}")


RECOVER_FIX = (
    "run `cdcd recover -c CONFIG` (a new slot, the gap recorded in the landing zone, every table re-snapshotted "
    "incrementally into the same mirror), then `cdcd run`; or set source.on_position_lost = \"resnapshot\" to "
    "do that by itself (docs/operations.md, \"A lost position\")")
