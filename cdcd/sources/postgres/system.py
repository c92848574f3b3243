"""PgSystem: the server identity cdcd recorded (system id, timeline) and the check that a server still holds it.

Split out of ``PostgresSource`` (``source.py``): at every plan and every replication (re)connect, IDENTIFY_SYSTEM
and, on a new timeline, TIMELINE_HISTORY are judged (``identity.py``, pure) against the recorded identity and the
highest position cdcd reached; a server whose history does not contain it is a lost position.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import structlog

from cdcd.errors import PositionLost
from cdcd.sources.postgres.connection import ConnectParams
from cdcd.sources.postgres.identity import HistoryDiverged, SystemFacts, judge_system, needs_history
from cdcd.sources.postgres.wire.replication import ReplicationConnection

log = structlog.get_logger("cdcd.source.postgres")

HISTORY_FIX = (
    "The mirror cannot be brought up to date from this server's history. Re-snapshot: stop cdcd (`cdcd stop -c "
    "CONFIG`), move the state directory (state.path) and the landing zone (landing.path) aside, drop the replication "
    "slot on the server (SELECT pg_drop_replication_slot('SLOT')), start again with snapshot.mode = \"initial\" and "
    "let `cdcd spark run` write to a fresh --target (see docs/postgres.md, identity checks)."
)


class PgSystem:
    """The recorded identity (``record``, what the checkpoint keeps) and its check against the server."""

    def __init__(self, params: ConnectParams, slot: str, reached: Callable[[], int]) -> None:
        self._params = params
        self._slot = slot
        self._reached = reached  # the highest WAL position cdcd committed or emitted
        self.record: dict[str, Any] | None = None

    async def verify(self, repl: ReplicationConnection | None) -> bool:
        """IDENTIFY_SYSTEM and judge it against ``record`` and ``reached()``; fatal when the server's history does
        not contain what cdcd captured. True when ``record`` changed (first record, new timeline)."""
        own = repl is None
        conn = repl if repl is not None else await ReplicationConnection.connect(self._params)
        try:
            facts = SystemFacts.from_identify(await conn.identify_system())
            history: str | None = None
            if needs_history(self.record, facts):
                rows = await conn.query(f"TIMELINE_HISTORY {facts.timeline}")
                history = str(rows[0].get("content") or "") if rows else ""
        finally:
            if own:
                await conn.close()
        try:
            changed = judge_system(self.record, facts, self._reached(), history, self._params.where)
        except HistoryDiverged as exc:
            raise PositionLost(f"{exc}. {HISTORY_FIX.replace('SLOT', self._slot)}") from None
        if changed:
            if self.record:
                log.warning("the server moved to a new timeline that contains everything captured; following it",
                            old=self.record.get("timeline"), new=facts.timeline)
            self.record = facts.record()
        return changed
