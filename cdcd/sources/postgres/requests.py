"""The operator's requests to a streaming PostgreSQL source (issue 13): an incremental snapshot of a captured table
(``cdcd snapshot``; a table re-created under its name is published again first), the check of its ``--where``,
and a reload of ``source.tables`` (the publication extended, the new tables learnt and snapshotted while
streaming, the removed ones no longer captured). What touches the catalog or the captured set runs in the chunk
task, between chunks (``Incremental.submit``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import asyncpg
import structlog

from cdcd.capture.incremental import Incremental, SnapshotJob, check_table, parse_tables
from cdcd.config import Config
from cdcd.errors import ConfigError, SourceError
from cdcd.events import Mark, MarkKind, TableId
from cdcd.landing.keyrange import key_kind, parse_where
from cdcd.positions import PgPosition
from cdcd.sources.postgres import catalog
from cdcd.sources.postgres.chunks import PgChunkReader
from cdcd.sources.postgres.shape import shape_from_info, warn_unknown
from cdcd.sources.postgres.stream import PgStream
from cdcd.sources.postgres.tables import PgTables

log = structlog.get_logger("cdcd.source.postgres")


class PgRequests:
    """The requests of one source. ``tables`` is the source's (its ``tables`` list is the captured set, which a
    reload replaces); ``last``: the position marks are emitted at; ``streaming``: False under
    ``snapshot.mode = "initial_only"`` (no stream to snapshot into)."""

    def __init__(self, config: Config, tables: PgTables, publication: str, incr: Incremental, chunks: PgChunkReader,
                 stream: PgStream, last: Callable[[], PgPosition], streaming: Callable[[], bool]) -> None:
        self._config = config
        self._t = tables
        self._publication = publication
        self._incr = incr
        self._chunks = chunks
        self._stream = stream
        self._last = last
        self._streaming = streaming

    def snapshot(self, table: str, where: str | None = None) -> None:
        """Queue an incremental snapshot of ``table`` (a re-created one is published again first)."""
        if not self._streaming():
            raise ConfigError("snapshot request: snapshot.mode = \"initial_only\" has no stream to snapshot into")
        t = check_table(table, self._t.tables)
        if t in self._incr.stale:
            # dropped and re-created: publish the new table and learn it first (in the chunk task, before the job)
            self._incr.submit(lambda: self._republish(t))
        self._incr.request(t, where)

    async def check_where(self, table: str, where: str) -> None:
        t = check_table(table, self._t.tables)
        conn = await catalog.connect_sql(self._t.params)
        try:  # fetch: the extended protocol plans exactly one statement
            await conn.fetch(f"EXPLAIN SELECT 1 FROM {catalog.quote_table(t)} WHERE ({where})",
                             timeout=self._config.runtime.source_read_timeout_s)
        except asyncpg.PostgresError as exc:
            raise ConfigError(f"snapshot request: the condition {where!r} does not work on {t}: {exc} (the "
                              f"server's words on {self._t.params.where}); correct --where") from None
        finally:
            await conn.close(timeout=5)
        info = self._t.infos.get(t)
        key = list(info.key) if info is not None else []
        kind = key_kind(next(c.sql_type for c in info.columns if c.name == key[0])) if info and len(key) == 1 else ""
        parse_where(where, key, str(t), kind)  # a condition the merge can record as a key range, else refused

    async def _republish(self, t: TableId) -> None:
        """A table re-created under a captured name: add it to the publication again (when cdcd created it;
        else the error names the statement to run) and decode it with its new catalog facts."""
        try:
            sql = await self._t.ensure_sql()
            info = await catalog.table_info(sql, t)
            known = {**self._t.infos, t: info}
            await catalog.ensure_publication(sql, self._publication, [x for x in self._t.tables if x in known], known)
            await catalog.load_types(sql, self._t.registry, {c.type_oid for c in info.columns})
        except Exception as exc:  # its snapshot would read rows whose later changes never arrive: none
            why = f"publishing the re-created table {t} failed: {exc}"
            self._incr.cancel({t}, why)
            self._incr.mark_stale(t, why)
            raise
        self._t.infos[t] = info
        self._t.shapes[t] = shape_from_info(info, self._t.registry)
        self._chunks.joined.add(t)  # its snapshot waits for transactions open when it joined the publication
        # its new OID is the baseline from now on; the flag stays in the checkpoint until the re-snapshot completes
        self._incr.emit(Mark(MarkKind.TABLES, self._last(),
                             {"tables": [str(x) for x in self._t.tables], "oids": {str(t): info.oid}}))
        log.info("re-created table published again; re-snapshotting it", table=str(t), oid=info.oid)

    def reload(self, tables: list[str]) -> asyncio.Future[None]:
        """Apply a reloaded ``source.tables`` in the chunk task; the future says how it went."""
        new = parse_tables(tables)
        if not self._streaming():
            raise ConfigError("table reload: snapshot.mode = \"initial_only\" captures no stream")
        return self._incr.submit(lambda: self._apply_tables(new))

    async def _apply_tables(self, new: list[TableId]) -> None:
        """A reload (in the chunk task, between chunks): extend the publication, learn the new tables, snapshot
        them incrementally; removed tables stop being captured."""
        added = [t for t in new if t not in self._t.tables]
        removed = [t for t in self._t.tables if t not in new]
        if not added and not removed:
            return
        sql = await self._t.ensure_sql()
        infos = {t: await catalog.table_info(sql, t) for t in added}
        keyless = [str(t) for t, info in infos.items() if not info.key]
        if keyless:  # its incremental snapshot reads in key order: refused before the publication is touched
            raise SourceError(f"table reload: {', '.join(keyless)} has no primary key or replica identity index, so "
                              "it cannot be snapshotted while streaming; not added. Fix: ALTER TABLE ... ADD PRIMARY "
                              "KEY (...), or ALTER TABLE ... REPLICA IDENTITY USING INDEX on a unique index of NOT "
                              "NULL columns, and reload again, or leave it out of source.tables")
        known = {**self._t.infos, **infos}
        await catalog.ensure_publication(sql, self._publication, [t for t in new if t in known], known)
        oids = {c.type_oid for info in infos.values() for c in info.columns}
        await catalog.load_types(sql, self._t.registry, oids)
        for t, info in infos.items():
            self._t.infos[t] = info
            self._t.shapes[t] = shape_from_info(info, self._t.registry)
            warn_unknown(self._t.shapes[t], self._t.warnings)
        self._t.tables = list(new)
        self._stream.capture(self._t.tables)
        self._chunks.joined.update(added)  # their snapshots wait for transactions open when they joined
        self._incr.dropped = (self._incr.dropped | set(removed)) - set(added)
        self._incr.cancel(set(removed), "the table was removed from source.tables")
        at = self._last()
        for t in added:
            self._incr.emit(Mark(MarkKind.INCREMENTAL_START, at, {"table": str(t), "where": None}))
            self._incr.jobs.append(SnapshotJob(t, None, started=True))
        self._incr.emit(Mark(MarkKind.TABLES, at, {"tables": [str(t) for t in self._t.tables],
                                                   "oids": {str(t): info.oid for t, info in infos.items()}}))
        log.info("captured tables reloaded", added=[str(t) for t in added], removed=[str(t) for t in removed])
