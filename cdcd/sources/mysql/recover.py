"""Recovery from a lost binlog position (cdcd/capture/recovery.py): the server's current position in a new epoch,
and what `cdcd recover` says when there is nothing to recover."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from cdcd.capture.recovery import Recoveries, nothing_to_recover
from cdcd.config import Config
from cdcd.errors import PositionLost
from cdcd.events import Item, TableId
from cdcd.positions import MySqlPosition, Position
from cdcd.sources.mysql.gtid import check_not_purged
from cdcd.sources.mysql.identity import BinlogFacts
from cdcd.sources.mysql.plan import Step, lost_problem
from cdcd.sources.mysql.server import MySqlServer


class MyRecoveries(Recoveries):
    """The MariaDB/MySQL source's recoveries; ``lost`` is what the last judged position lost."""

    def __init__(self, config: Config, server: MySqlServer) -> None:
        super().__init__(config)
        self._server = server
        self.lost = ""
        self.at: MySqlPosition | None = None  # this plan's new position after a lost one

    async def take(self, facts: BinlogFacts, tables: list[TableId], before: Position | None,
                   log: Any) -> tuple[MySqlPosition, list[Item]]:
        """Go on from the server's current position in a new epoch (it sorts above everything landed, also after a
        RESET MASTER); the marks of the identity and of the recovery, at that position."""
        server = self._server
        server.history = server.history.successor()  # the columns keep their ids (a consumer matches them by id)
        server.epoch += 1
        server.adopt(facts, None)
        at = self.at = server.stamp((await server.current_position()).position())
        return at, [*server.marks(at), *self.plan(tables, at, self.lost, before, log)]

    def judged(self, decided: Any, verdict: Any, pos: MySqlPosition, facts: BinlogFacts, what: str) -> None:
        """``after_verdict`` decided ``decided`` on ``verdict``: a recovery records what was lost."""
        if decided is Step.RECOVER:
            self.lost = lost_problem(verdict, pos, facts, what)

    def gtids_purged(self, gtid: str, purged: str) -> bool:
        """MySQL: GTIDs of the position purged (``check_not_purged``): True when that is to be recovered."""
        try:
            check_not_purged("mysql", gtid, purged)
        except PositionLost as exc:
            if not self.allowed:
                raise
            self.lost = str(exc).split(". ", 1)[0]
            return True
        return False

    def check_step(self, step: Step, state: Mapping[str, Any]) -> None:
        """A new plan from the checkpoint's ``state``; `cdcd recover` refuses one that asks for no stream to resume."""
        self.at = None
        self.loaded(state)
        if self.only and step not in (Step.RESUME_SNAPSHOT, Step.RESUME_STREAM):
            raise nothing_to_recover("snapshot.mode = \"initial_only\" finished its snapshot and streams nothing"
                                     if step is Step.DONE else "state.path holds no checkpoint of a stream")

    def not_lost(self) -> None:
        if self.only:
            raise nothing_to_recover(f"the binlog on {self._server.where} still holds the checkpoint's position")
