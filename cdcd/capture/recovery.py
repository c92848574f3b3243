"""Recovery from a lost position, shared by the sources' planners (docs/operations.md, "A lost position").

A source whose position is lost (PostgreSQL: the slot is gone or lost WAL; MariaDB/MySQL: binlogs purged or reset)
recovers when the operator allows it: ``source.on_position_lost = "resnapshot"``, or `cdcd recover`. Its planner
takes a new position (a new slot; the server's current binlog position in a new epoch) and hands ``Recoveries.plan``
what was lost. The plan is one POSITION_LOST mark, which the landing zone records as the gap (docs/landing-format.md,
"Lost positions") and the source's fold as the new position, then a whole-table incremental snapshot of every
captured table (``cdcd/capture/incremental/``): each lands its covered record, so the merge drops the mirror rows
the gap deleted, and the re-read rows carry the gap's updates and key changes.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from cdcd.capture.incremental import SnapshotJob
from cdcd.config import Config
from cdcd.errors import NothingToRecover
from cdcd.events import Mark, MarkKind, TableId
from cdcd.positions import Position

__all__ = ["Recoveries", "Recovering", "fold_position_lost", "nothing_to_recover"]


class Recoveries:
    """A source's recoveries: whether it may recover, and what it recovered from (``/status``, the metric)."""

    def __init__(self, config: Config) -> None:
        self._config = config
        self.only = False  # `cdcd recover`: recover, and refuse a position that is not lost
        self.count = 0  # recoveries of this process
        self.last: dict[str, Any] | None = None  # the last POSITION_LOST mark's detail (this process or the checkpoint)
        self.jobs: list[SnapshotJob] = []  # the re-snapshots the last plan asks for, until the source queues them

    @property
    def allowed(self) -> bool:
        return self.only or self._config.source.on_position_lost == "resnapshot"

    def loaded(self, state: Mapping[str, Any]) -> None:
        """The checkpoint's record of the last recovery, for ``/status`` until this process makes one."""
        if self.last is None:
            self.last = (state.get("position_lost") or {}).get("last")

    def plan(self, tables: list[TableId], at: Position, lost: str, before: Position | None, log: Any,
             **detail: Any) -> list[Mark]:
        """The marks that record the gap and start a whole-table re-snapshot of each table at ``at`` (the new
        position); ``self.jobs`` holds the jobs for the source's ``Incremental.resume``. ``detail``: what the
        source's fold needs of the new position (PostgreSQL: the slot and its LSN)."""
        record = {"lost": lost, "from": before.encoded if before is not None else None, "to": at.encoded,
                  "tables": [str(t) for t in tables], "at": time.time(), **detail}
        self.count += 1
        self.last = record
        log.error("the source position is lost; going on from a new position and re-snapshotting every table "
                  "incrementally (the gap is recorded in the landing zone)", lost=lost, lost_from=record["from"],
                  new_position=record["to"], tables=record["tables"],
                  how="cdcd recover" if self.only else "source.on_position_lost = resnapshot")
        self.jobs = [SnapshotJob(t, None, started=True) for t in tables]
        return [Mark(MarkKind.POSITION_LOST, at, record),
                *(Mark(MarkKind.INCREMENTAL_START, at, {"table": str(t), "where": None}) for t in tables)]

    def queue(self, incremental: Any) -> None:
        """Hand the last plan's jobs to the source's ``Incremental``: they replace the jobs the checkpoint held."""
        if self.jobs:
            incremental.resume(self.jobs, None)
            self.jobs = []

    def status(self) -> dict[str, Any]:
        return {"recoveries": self.count, "last": self.last}


class Recovering:
    """``Source.recover_only`` and ``Source.recovered`` for a source that keeps its ``Recoveries`` as
    ``_recoveries`` (listed before ``Source`` among its bases)."""

    _recoveries: Recoveries

    def recover_only(self) -> None:
        self._recoveries.only = True

    def recovered(self) -> dict[str, Any] | None:
        return self._recoveries.last if self._recoveries.count else None


def fold_position_lost(state: dict[str, Any], mark: Mark) -> None:
    """The source-independent part of folding a POSITION_LOST mark (``state`` is the fold's own copy): the old
    position's incremental snapshots and flags are void (the INCREMENTAL_STARTs after the mark re-read every
    table), the recovery is recorded."""
    for key in ("incremental", "incremental_queued", "tables_needing_snapshot"):
        state.pop(key, None)
    held = state.get("position_lost") or {}
    state["position_lost"] = {"count": int(held.get("count", 0)) + 1, "last": dict(mark.detail)}


def nothing_to_recover(what: str) -> NothingToRecover:
    return NothingToRecover(f"nothing to recover: {what}. `cdcd recover` is for a lost position (the daemon exited "
                            "with code 9); start the daemon with `cdcd run -c CONFIG`")
