"""The operator's requests to the running daemon: re-snapshot a table, reload ``source.tables``.

Both reach the source's incremental snapshots (``Source.request_snapshot`` and
``Source.reload_tables``). A request that cannot be honoured changes nothing and
says why: an unknown table, a config file that does not load (the daemon keeps
running with what it has). ``cdcd snapshot`` and ``cdcd tables reload`` send them
over the HTTP listener (``POST /snapshot``, ``POST /tables/reload``); SIGHUP is
the same reload without an answer (docs/operations.md).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog

from cdcd.config import Config, load_config
from cdcd.errors import CdcdError, ConfigError, SourceError
from cdcd.logging import set_level
from cdcd.runtime.runtime import Runtime, RuntimeState

_log = structlog.get_logger("cdcd.operator")

#: How long a reload's answer waits for the source to apply a changed table list (below the 10 s the cdcd
#: commands wait for an answer, ``control.post``).
RELOAD_WAIT_S = 8.0
#: Config sections a reload applies while running; every other change waits for a restart.
_RELOADED = ("log.level", "source.tables")


class Answer:
    """An HTTP status and a JSON document: what a request did, or why it did nothing."""

    def __init__(self, status: int, doc: dict[str, Any]) -> None:
        self.status, self.doc = status, doc

    @property
    def ok(self) -> bool:
        return self.status < 300


class Operator:
    """The daemon's side of ``cdcd snapshot`` and ``cdcd tables reload`` (and SIGHUP)."""

    def __init__(self, config: Config, config_path: Path, runtime: Callable[[], Runtime | None]) -> None:
        self.config = config  # as running: the start's config with the reloaded log level and tables
        self.config_path = config_path
        self._runtime = runtime

    def _running(self, what: str) -> Runtime | Answer:
        rt = self._runtime()
        if rt is None or rt.state is not RuntimeState.RUNNING:
            state = "starting" if rt is None else rt.state.value
            return Answer(503, {"error": f"{what}: the daemon is {state}, not running its pipeline; retry once "
                                         "`cdcd status` says it is ready"})
        return rt

    async def snapshot(self, doc: dict[str, Any]) -> Answer:
        """Queue an incremental snapshot of ``doc["table"]`` (rows matching ``doc["where"]`` if given)."""
        table, where = doc.get("table"), doc.get("where")
        if not isinstance(table, str) or not (where is None or isinstance(where, str)):
            return Answer(400, {"error": "snapshot request: give {\"table\": \"schema.table\", \"where\": SQL or "
                                         f"null}}, got {doc!r}"})
        rt = self._running("snapshot request")
        if isinstance(rt, Answer):
            return rt
        where = (where.strip() or None) if where is not None else None  # an empty condition: the whole table
        try:
            if where is not None:  # refused now with the server's words, not later in the daemon's snapshot task
                await rt.source.check_where(table, where)
            rt.source.request_snapshot(table, where)
        except ConfigError as exc:
            _log.error("snapshot request refused", table=table, where=where, error=str(exc))
            return Answer(400, {"error": str(exc)})
        except SourceError as exc:  # the source could not be asked: nothing was queued
            _log.error("snapshot request not checked", table=table, where=where, error=str(exc))
            return Answer(503, {"error": f"snapshot request: the condition could not be checked on the source: "
                                         f"{exc}; nothing was queued, retry"})
        _log.info("incremental snapshot requested", table=table, where=where)
        return Answer(202, {"queued": {"table": table, "where": where},
                            "progress": rt.source.snapshot_progress()})

    async def reload(self, origin: str) -> Answer:
        """Re-read the config file: apply ``log.level`` and ``source.tables``; nothing at all on an error.

        A changed table list is answered once the source applied it (RELOAD_WAIT_S at most): 200 with what was
        added and removed, 400 with why nothing changed (an added table missing or without a key; also in
        ``/status`` as ``table_reload_error``), 202 while it is still being applied (never "added" before it is)."""
        try:
            new = load_config(self.config_path)
        except ConfigError as exc:
            msg = f"{origin}: config not reloaded, the running daemon is unchanged: {exc}"
            _log.error(msg)
            return Answer(400, {"error": msg})
        tables, before = list(new.source.tables), list(self.config.source.tables)
        if tables != before:
            rt = self._running(f"{origin}: source.tables")
            if isinstance(rt, Answer):
                _log.error("config not reloaded", error=rt.doc["error"])
                return rt
            try:
                applied = rt.source.reload_tables(tables)
                await asyncio.wait_for(asyncio.shield(applied), RELOAD_WAIT_S)
            except TimeoutError:
                msg = (f"{origin}: source.tables {tables!r} is still being applied after {RELOAD_WAIT_S:.0f} s (the "
                       "source may be reconnecting); `cdcd status` shows the tables once captured, or the reload's "
                       "error (table_reload_error)")
                _log.warning(msg)
                return Answer(202, {"pending": tables, "error": msg})
            except CdcdError as exc:  # ConfigError at once; the source's refusal once it tried (logged there)
                msg = f"{origin}: source.tables not reloaded, the running daemon is unchanged: {exc}"
                _log.error(msg)
                return Answer(400, {"error": msg})
        set_level(new.log.level)
        later = _restart_only(self.config, new)
        self.config = self.config.model_copy(update={
            "source": self.config.source.model_copy(update={"tables": tables}),
            "log": self.config.log.model_copy(update={"level": new.log.level}),
        })
        added = [t for t in tables if t not in before]
        removed = [t for t in before if t not in tables]
        # a warning so that it shows at any log level
        _log.warning(f"{origin}: config reloaded", level=new.log.level, tables_added=added, tables_removed=removed,
                     needs_restart=later or None)
        return Answer(200, {"log_level": new.log.level, "tables": tables, "added": added, "removed": removed,
                            "needs_restart": later})


def _restart_only(running: Config, new: Config) -> list[str]:
    """The changed settings a reload does not apply (``section.key``), for the operator to know."""
    old_doc, new_doc = running.model_dump(), new.model_dump()
    changed = []
    for section, values in new_doc.items():
        before = old_doc.get(section)
        if isinstance(values, dict) and isinstance(before, dict):
            changed += [f"{section}.{k}" for k, v in values.items() if before.get(k) != v]
        elif before != values:
            changed.append(section)
    return [c for c in changed if c not in _RELOADED]
