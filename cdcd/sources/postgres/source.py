"""PostgresSource: the Source the runtime drives (connect, stream, fold, confirm).

The durable source state and ``fold`` live in ``state.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Sequence
from datetime import datetime
from typing import Any

import asyncpg
import structlog

from cdcd.config import Config
from cdcd.errors import SourceError, SourceFatal
from cdcd.events import ChangeEvent, Item, Mark, MarkKind, Op, TableId, snapshot_truncates
from cdcd.positions import PgPosition, Position, format_lsn, parse_lsn
from cdcd.retry import source_backoff
from cdcd.runtime.interfaces import CheckResult, ResumePoint, Source
from cdcd.sources.postgres import catalog, pgoutput
from cdcd.sources.postgres.catalog import HEARTBEAT_PREFIX, SlotInfo, TableInfo
from cdcd.sources.postgres.connection import connect_params
from cdcd.sources.postgres.identity import HistoryDiverged, SystemFacts, judge_system, needs_history
from cdcd.sources.postgres.protocol import ProtocolError
from cdcd.sources.postgres.replication import PgServerError, ReplicationConnection
from cdcd.sources.postgres.shape import (
    RowDecoder,
    TableShape,
    Warnings,
    same_columns,
    shape_from_info,
    shape_from_relation,
    warn_unknown,
)
from cdcd.sources.postgres.snapshot import SnapshotReader, SnapshotTable
from cdcd.sources.postgres.state import fold_state
from cdcd.sources.postgres.types import TypeRegistry

log = structlog.get_logger("cdcd.source.postgres")

STATUS_INTERVAL_S = 5.0

HISTORY_FIX = (
    "The mirror cannot be brought up to date from this server's history. Re-snapshot: stop cdcd (`cdcd stop -c "
    "CONFIG`), move the state directory (state.path) and the landing zone (landing.path) aside, drop the replication "
    "slot on the server (SELECT pg_drop_replication_slot('SLOT')), start again with snapshot.mode = \"initial\" and "
    "let `cdcd spark run` write to a fresh --target (see docs/postgres.md, identity checks)."
)


class PostgresSource(Source):
    kind = "postgres"

    def __init__(self, config: Config) -> None:
        src = config.source
        self._config = config
        self._params = connect_params(config)  # shared with `cdcd check` and verify
        self._slot = src.postgres.slot
        self._publication = src.postgres.publication
        self._heartbeat_s = src.postgres.heartbeat_s
        self._tables = src.table_ids
        self._table_set = set(self._tables)
        self._mode = config.snapshot.mode
        self._registry = TypeRegistry()
        self._warnings = Warnings()
        self._infos: dict[TableId, TableInfo] = {}
        self._shapes: dict[TableId, TableShape] = {}
        self._sql: Any = None
        self._repl: ReplicationConnection | None = None
        self._reader: SnapshotReader | None = None
        self._snapshot_tables: list[SnapshotTable] = []
        self._start_mark: Mark | None = None
        self._watermark = PgPosition(0, 0)
        self._stream_changes = True
        self._flush_lsn = 0
        self._last: PgPosition | None = None  # last streamed position yielded: dedupe after reconnects
        self._phase = "streaming"
        self._connected = False
        self._lag_ms: float | None = None
        self._closing = False
        self._hb_sql: Any = None  # heartbeats get a connection of their own: asyncpg allows one query at a time
        self._reconnects = 0  # replication reconnects inside stream(), for /status
        self._last_error: str | None = None
        self._system: dict[str, Any] | None = None  # the server identity the checkpoint records (identity.py)
        self._announce: list[Item] = []  # Marks to emit before anything else (a new identity record)
        self._resume_position: PgPosition | None = None  # the checkpoint's position at connect

    # ------------------------------------------------------------ connect

    async def connect(self, resume: ResumePoint) -> None:
        self._closing = False
        self._sql = await catalog.connect_sql(self._params)
        try:
            catalog.require_version(await catalog.server_version(self._sql), self._params.where)
            for t in self._tables:
                self._infos[t] = await catalog.table_info(self._sql, t)
            oids = {c.type_oid for info in self._infos.values() for c in info.columns}
            await catalog.load_types(self._sql, self._registry, oids)
            for t, info in self._infos.items():
                self._shapes[t] = shape_from_info(info, self._registry)
                warn_unknown(self._shapes[t], self._warnings)
            await self._plan(resume)
        except asyncpg.InsufficientPrivilegeError as exc:
            await self.close()
            raise SourceFatal(f"{self._params.where}: {exc}; run `cdcd check` for the privileges cdcd needs") from exc
        except (asyncpg.PostgresError, asyncpg.InterfaceError, OSError) as exc:
            await self.close()
            raise SourceError(f"{self._params.where}: connecting the source failed: {exc}") from exc
        except BaseException:
            await self.close()
            raise
        self._connected = True

    async def _plan(self, resume: ResumePoint) -> None:
        state = resume.state or {}
        snap = state.get("snapshot") or {}
        if self._mode == "initial_only":
            self._stream_changes = False
            if snap.get("status") == "done":
                return
            await self._open_snapshot(None, state, slot=None)
            return
        await catalog.ensure_publication(self._sql, self._publication, self._tables, self._infos)
        slot = await catalog.slot_info(self._sql, self._slot)
        if slot is not None:
            self._check_slot(slot)
        if state.get("slot"):
            if state["slot"] != self._slot:
                raise SourceFatal(f"the checkpoint was written for replication slot {state['slot']!r} but "
                                  f"source.postgres.slot is {self._slot!r}; restore the setting, or re-snapshot "
                                  "with a fresh state.path")
            if slot is None:
                if self._mode != "when_needed":
                    raise SourceFatal(self._slot_gone_message(str(state["slot"])))
                log.warning("the checkpoint's replication slot is gone; snapshot.mode=when_needed takes a new snapshot",
                            slot=state["slot"])
                self._system = None
                await self._verify_system(None)
                await self._new_slot_with_snapshot()
                return
            self._watermark = PgPosition(parse_lsn(state["watermark"]), 0)
            self._flush_lsn = max(parse_lsn(state.get("flush_lsn", state["watermark"])), slot.confirmed_flush_lsn or 0)
            if isinstance(resume.position, PgPosition):
                self._resume_position = resume.position
            if self._system is None:
                self._system = state.get("system")
            if await self._verify_system(None):
                at = self._resume_position or self._watermark
                self._announce = [Mark(MarkKind.IDENTITY, at, dict(self._system or {}))]
            if snap.get("status") == "running":
                await self._open_snapshot(None, state, slot=self._slot)
            return
        # No checkpoint state: a first start.
        self._system = None
        await self._verify_system(None)  # records the server's identity for the start Mark
        if slot is None:
            if self._mode == "never":
                repl = await ReplicationConnection.connect(self._params)
                try:
                    created = await repl.create_slot(self._slot, export_snapshot=False)
                finally:
                    await repl.close()
                self._begin(created.consistent_point, snapshot=False)
            else:
                await self._new_slot_with_snapshot()
            return
        start = slot.confirmed_flush_lsn or 0
        if self._mode == "never":
            self._begin(start, snapshot=False)
            return
        # A slot without a checkpoint (a crash before the first commit, or made by hand): keep it and
        # snapshot under a fresh snapshot; replaying from the slot's point onto that converges.
        # Move it to now first: its old point may predate the publication, which pgoutput cannot decode,
        # and everything before now is in the snapshot anyway.
        start = await catalog.advance_slot_to_now(self._sql, self._slot)
        log.warning("replication slot exists but there is no checkpoint; advanced it to now, snapshot under a "
                    "fresh snapshot and stream from there", slot=self._slot, lsn=format_lsn(start))
        self._begin(start, snapshot=True)
        await self._open_snapshot(None, {}, slot=self._slot)

    def _reached(self) -> int:
        """The highest WAL position cdcd committed or emitted: the server's history must contain it."""
        last = self._last.lsn if self._last is not None else 0
        ckpt = self._resume_position.lsn if self._resume_position is not None else 0
        return max(self._flush_lsn, last, ckpt)

    async def _verify_system(self, repl: ReplicationConnection | None) -> bool:
        """IDENTIFY_SYSTEM and judge it against the recorded identity and ``_reached()``; fatal when the server's
        history does not contain what cdcd captured. True when ``_system`` changed (first record, new timeline)."""
        own = repl is None
        conn = repl if repl is not None else await ReplicationConnection.connect(self._params)
        try:
            facts = SystemFacts.from_identify(await conn.identify_system())
            history: str | None = None
            if needs_history(self._system, facts):
                rows = await conn.query(f"TIMELINE_HISTORY {facts.timeline}")
                history = str(rows[0].get("content") or "") if rows else ""
        finally:
            if own:
                await conn.close()
        try:
            changed = judge_system(self._system, facts, self._reached(), history, self._params.where)
        except HistoryDiverged as exc:
            raise SourceFatal(f"{exc}. {HISTORY_FIX.replace('SLOT', self._slot)}") from None
        if changed:
            if self._system:
                log.warning("the server moved to a new timeline that contains everything captured; following it",
                            old=self._system.get("timeline"), new=facts.timeline)
            self._system = facts.record()
        return changed

    def _slot_gone_message(self, slot: str) -> str:
        return (f"replication slot {slot!r} named by the checkpoint does not exist on {self._params.where}: "
                "the changes since the checkpoint are lost to it, and a new slot would silently skip them. "
                "To re-snapshot: stop cdcd, move the state directory (state.path) aside and start again "
                "(a new slot and a full snapshot); or set snapshot.mode = \"when_needed\"")

    def _check_slot(self, slot: SlotInfo) -> None:
        if slot.plugin != "pgoutput" or slot.database != self._params.database:
            raise SourceFatal(
                f"replication slot {slot.name!r} uses plugin {slot.plugin!r} on database {slot.database!r}; cdcd needs "
                f"a pgoutput slot on {self._params.database!r}: set source.postgres.slot to another name")
        if slot.wal_status == "lost":
            raise SourceFatal(f"replication slot {slot.name!r} has lost WAL it needs (wal_status=lost, "
                              "max_slot_wal_keep_size exceeded): drop it and re-snapshot")

    def _begin(self, watermark: int, snapshot: bool, slot: str | None = "") -> None:
        """Record a first start: the Mark that puts slot and watermark into the checkpoint."""
        name = self._slot if slot == "" else slot
        self._watermark = PgPosition(watermark, 0)
        self._flush_lsn = watermark
        detail: dict[str, Any] = {"slot": name, "watermark": format_lsn(watermark)}
        if self._system:
            detail["system"] = dict(self._system)
        kind = MarkKind.SNAPSHOT_START if snapshot else MarkKind.STREAM_START
        self._start_mark = Mark(kind, self._watermark, detail)

    async def _new_slot_with_snapshot(self) -> None:
        repl = await ReplicationConnection.connect(self._params)
        try:
            created = await repl.create_slot(self._slot, export_snapshot=True)
            self._begin(created.consistent_point, snapshot=True)
            # The exported snapshot lives until the replication connection's next command:
            # every worker imports it before we let go of the connection.
            await self._open_snapshot(created.snapshot_name, {}, slot=self._slot)
        finally:
            await repl.close()

    async def _open_snapshot(self, snapshot_name: str | None, state: dict[str, Any], slot: str | None) -> None:
        progress = (state.get("snapshot") or {}).get("tables") or {}
        tables: list[SnapshotTable] = []
        for t in self._tables:
            entry = progress.get(str(t)) or {}
            info = self._infos[t]
            after = entry.get("last_key") if info.key else None
            tables.append(SnapshotTable(info, self._shapes[t], after, int(entry.get("rows", 0)) if after else 0,
                                        bool(entry.get("done", False))))
        self._snapshot_tables = tables
        reader = SnapshotReader(self._params, self._config.snapshot.parallelism, self._config.snapshot.chunk_rows,
                                self._warnings, self._config.snapshot.chunk_bytes)
        await reader.open(snapshot_name, sum(1 for t in tables if not t.done))
        self._reader = reader
        if not state and self._start_mark is None:
            # initial_only first start: no slot; the watermark is the WAL position of the fresh snapshot.
            self._begin(reader.watermark_lsn or 0, snapshot=True, slot=slot)
        elif state:
            self._watermark = PgPosition(parse_lsn(state["watermark"]), 0)

    # ------------------------------------------------------------ stream

    async def stream(self) -> AsyncIterator[Item]:
        start, self._start_mark = self._start_mark, None
        if start is not None:
            yield start
        announce, self._announce = self._announce, []
        for mark in announce:
            yield mark
        if start is not None and start.kind is MarkKind.SNAPSHOT_START:
            for truncate in snapshot_truncates([self._shapes[t].schema for t in self._tables], self._watermark):
                yield truncate
        if self._reader is not None:
            self._phase = "snapshot"
            try:
                async for item in self._reader.rows(self._snapshot_tables, self._watermark):
                    yield item
            finally:
                await self._reader.close()
                self._reader = None
            yield Mark(MarkKind.SNAPSHOT_DONE, self._watermark)
        self._phase = "streaming"
        if not self._stream_changes:
            return
        retry = source_backoff(self._config, f"the replication connection to {self._params.where}")
        while True:
            try:
                async for item in self._replicate():
                    if retry.attempts:
                        retry.success()
                    yield item
                raise SourceError(f"{self._params.where}: the server ended the replication stream")
            except (SourceError, OSError, asyncio.IncompleteReadError) as exc:
                if isinstance(exc, SourceError) and exc.fatal:
                    raise
                if self._closing:
                    raise SourceError(f"{self._params.where}: connection closed while stopping") from exc
                self._connected = False
                delay = retry.failure(exc)  # SourceFatal once runtime.source_retry_timeout_s is spent
                self._reconnects += 1
                self._last_error = str(exc) or repr(exc)
                log.warning("replication connection lost; reconnecting", error=self._last_error,
                            retry_in_s=round(delay, 2), attempt=retry.attempts,
                            failing_for_s=round(retry.failed_for_s(), 1))
                await asyncio.sleep(delay)

    async def _replicate(self) -> AsyncIterator[Item]:
        repl = await ReplicationConnection.connect(self._params)
        self._repl = repl
        repl.flush_lsn = self._flush_lsn
        heartbeat: asyncio.Task[None] | None = None
        try:
            if await self._verify_system(repl):  # a reconnect may reach a server restored or promoted meanwhile
                yield Mark(MarkKind.IDENTITY, self._last or self._resume_position or PgPosition(self._flush_lsn, 0),
                           dict(self._system or {}))
            interval = await repl.status_interval(STATUS_INTERVAL_S)
            await repl.start_replication(self._slot, 0, self._publication, interval)
            self._connected = True
            heartbeat = asyncio.create_task(self._heartbeats(), name="pg-heartbeat")
            async for item in self._decode(repl):
                yield item
        except PgServerError as exc:
            if exc.sqlstate == "42704" and "replication slot" in exc.server_message:
                raise SourceFatal(self._slot_gone_message(self._slot)) from exc
            if exc.sqlstate == "42704" and "publication" in exc.server_message:
                raise SourceFatal(
                    f"{exc}: the slot's decoding point is older than publication {self._publication!r} (the slot "
                    "was created before it); drop the slot and start again with an empty state.path") from exc
            raise
        except (asyncpg.PostgresError, asyncpg.InterfaceError) as exc:  # the catalog connection, for new types
            raise SourceError(f"{self._params.where}: {exc}") from exc
        except ProtocolError as exc:  # a message we cannot decode would be skipped data: never retry past it
            raise SourceFatal(f"{self._params.where}: {exc}") from exc
        finally:
            if heartbeat is not None:
                heartbeat.cancel()
                with contextlib.suppress(BaseException):
                    await heartbeat
            self._repl = None
            await repl.close()

    async def _decode(self, repl: ReplicationConnection) -> AsyncIterator[Item]:
        relations = pgoutput.RelationCache()
        decoders: dict[int, RowDecoder | None] = {}
        commit_lsn = 0
        seq = 0
        xid: str | None = None
        commit_ts: datetime | None = None
        last = self._last
        decode = pgoutput.decode
        async for chunk in repl.xlog():
            for x in chunk:
                msg = decode(x.data)
                if isinstance(msg, pgoutput.Insert | pgoutput.Update | pgoutput.Delete):
                    seq += 1
                    dec = decoders.get(msg.relation)
                    if dec is None:
                        continue
                    pos = PgPosition(commit_lsn, seq)
                    if last is not None and pos <= last:
                        continue
                    yield self._row_event(msg, dec, pos, xid, commit_ts)
                    self._last = last = pos
                elif isinstance(msg, pgoutput.Begin):
                    commit_lsn, seq, xid, commit_ts = msg.final_lsn, 0, str(msg.xid), msg.commit_ts
                    self._lag_ms = max(0.0, (time.time() - msg.commit_ts.timestamp()) * 1000)
                elif isinstance(msg, pgoutput.Commit):
                    seq += 1
                    pos = PgPosition(commit_lsn, seq)
                    if last is None or pos > last:
                        yield Mark(MarkKind.COMMIT, pos, {"lsn": format_lsn(commit_lsn),
                                                   "end_lsn": format_lsn(msg.end_lsn)})
                        self._last = last = pos
                elif isinstance(msg, pgoutput.Relation):
                    relations.add(msg)
                    decoders[msg.oid] = await self._relation(msg)
                elif isinstance(msg, pgoutput.Truncate):
                    for oid in msg.relations:
                        seq += 1
                        dec = decoders.get(oid)
                        pos = PgPosition(commit_lsn, seq)
                        if dec is None or (last is not None and pos <= last):
                            continue
                        yield ChangeEvent(Op.TRUNCATE, dec.shape.schema, pos, tx_id=xid, commit_ts=commit_ts)
                        self._last = last = pos
                elif isinstance(msg, pgoutput.LogicalMessage) and msg.prefix == HEARTBEAT_PREFIX \
                        and not msg.transactional:
                    pos = PgPosition(msg.lsn, 0)
                    if last is None or pos > last:
                        yield Mark(MarkKind.HEARTBEAT, pos)
                        self._last = last = pos

    def _row_event(self, msg: pgoutput.Insert | pgoutput.Update | pgoutput.Delete, dec: RowDecoder,
                   pos: PgPosition, xid: str | None, commit_ts: datetime | None) -> ChangeEvent:
        schema = dec.shape.schema
        if isinstance(msg, pgoutput.Insert):
            after, missing = dec.row(msg.new)
            return ChangeEvent(Op.CREATE, schema, pos, None, after, xid, commit_ts, False, tuple(missing))
        if isinstance(msg, pgoutput.Update):
            after, missing = dec.row(msg.new)
            before: dict[str, Any] | None = None
            if msg.old_kind == "O" and msg.old is not None:
                before, old_missing = dec.row(msg.old)
                for name in list(missing):  # unchanged TOAST: the full old row has the value
                    if name not in old_missing:
                        after[name] = before[name]
                        missing.remove(name)
            elif msg.old_kind == "K" and msg.old is not None:
                before = dec.key_row(msg.old)
            return ChangeEvent(Op.UPDATE, schema, pos, before, after, xid, commit_ts, False, tuple(missing))
        if msg.old_kind == "O":
            before, _ = dec.row(msg.old)
        else:
            before = dec.key_row(msg.old)
        return ChangeEvent(Op.DELETE, schema, pos, before, None, xid, commit_ts)

    async def _relation(self, rel: pgoutput.Relation) -> RowDecoder | None:
        table = TableId(rel.namespace, rel.name)
        if table not in self._table_set:
            return None
        oids = {c.type_oid for c in rel.columns}
        if self._registry.missing(oids):
            await self._ensure_sql()
            await catalog.load_types(self._sql, self._registry, oids)
        old = self._shapes.get(table)
        info = self._infos.get(table)
        shape = shape_from_relation(rel, info, self._registry, old.schema.version if old else 0)
        if old is not None and not same_columns(old.schema, shape.schema):
            # The schema changed: refresh key and dimensions from the catalog, bump the version.
            with contextlib.suppress(SourceError, OSError):
                await self._ensure_sql()
                self._infos[table] = info = await catalog.table_info(self._sql, table)
            shape = shape_from_relation(rel, info, self._registry, old.schema.version + 1)
            log.info("table schema changed", table=str(table), version=shape.schema.version,
                     columns=list(shape.schema.column_names))
        self._shapes[table] = shape
        warn_unknown(shape, self._warnings)
        return RowDecoder(shape, self._warnings)

    async def _ensure_sql(self) -> None:
        if self._sql is None or self._sql.is_closed():
            self._sql = await catalog.connect_sql(self._params)

    async def _heartbeats(self) -> None:
        while True:
            await asyncio.sleep(self._heartbeat_s)
            try:
                if self._hb_sql is None or self._hb_sql.is_closed():
                    self._hb_sql = await catalog.connect_sql(self._params)
                await catalog.emit_heartbeat(self._hb_sql)
            except Exception as exc:  # a missed heartbeat is harmless; the next one retries
                log.warning("heartbeat failed", error=str(exc))
                with contextlib.suppress(Exception):
                    self._hb_sql.terminate()
                self._hb_sql = None

    # ------------------------------------------------------------ commit

    def fold(self, state: dict[str, Any], items: Sequence[Item]) -> dict[str, Any]:
        return fold_state(state, items)

    async def confirm(self, position: Position, state: dict[str, Any]) -> None:
        text = state.get("flush_lsn")
        if not text:
            return
        lsn = parse_lsn(text)
        if lsn > self._flush_lsn:
            self._flush_lsn = lsn
        repl = self._repl
        if repl is not None:
            repl.flush_lsn = self._flush_lsn
            with contextlib.suppress(Exception):
                repl.send_status()

    # ------------------------------------------------------------ the rest

    async def preflight(self) -> list[CheckResult]:
        from cdcd.sources.postgres.preflight import run_preflight

        return await run_preflight(self._params, self._tables, self._slot, self._publication)

    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "connected": self._connected,
            "phase": self._phase,
            "lag_ms": self._lag_ms,
            "confirmed_flush_lsn": format_lsn(self._flush_lsn),
            "slot": self._slot if self._stream_changes else None,
            "reconnects": self._reconnects,
            "last_error": self._last_error,
        }
        if self._system:
            out["timeline"] = self._system.get("timeline")
        if self._snapshot_tables:
            out["snapshot"] = {
                str(t.info.table): {"rows": t.rows, "total_estimate": t.info.estimate, "done": t.done}
                for t in self._snapshot_tables
            }
        repl = self._repl
        if repl is not None:
            out["slot_lag_bytes"] = max(0, repl.received_lsn - self._flush_lsn)
            out["received_lsn"] = format_lsn(repl.received_lsn)
        return out

    async def close(self) -> None:
        self._closing = True
        self._connected = False
        if self._reader is not None:
            await self._reader.close()
            self._reader = None
        if self._repl is not None:
            await self._repl.close()
            self._repl = None
        for conn in (self._sql, self._hb_sql):
            if conn is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(conn.close(), 5)
        self._sql = self._hb_sql = None

    def terminate(self) -> None:
        self._closing = True
        self._connected = False
        if self._reader is not None:
            self._reader.terminate()
            self._reader = None
        if self._repl is not None:
            self._repl.terminate()
            self._repl = None
        for conn in (self._sql, self._hb_sql):
            if conn is not None:
                with contextlib.suppress(Exception):
                    conn.terminate()
        self._sql = self._hb_sql = None
