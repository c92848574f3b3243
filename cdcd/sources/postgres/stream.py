"""The PostgreSQL stream reader: pgoutput over a replication connection, as the capture coordinator runs it.

``PgStream`` connects, starts replication from the slot, decodes pgoutput into items and sends heartbeats;
reconnects, backoff and the skip rule are the coordinator's (``cdcd/capture/coordinator.py``). What it knows of
the captured tables is the source's ``PgTables`` (``tables.py``), shared with the planner and the snapshot.

Row changes go out as ``ChangeBlock``s (``columnar.py``), cut and batched as ``blocks.py`` says: the
consecutive row messages of one relation inside one transaction, the blocks of one socket read converted
together. ``columnar=False`` keeps the row path (one ``ChangeEvent`` per row): the differential tests compare
the two.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import datetime
from typing import Any

import asyncpg
import structlog

from cdcd.capture.contracts import Replan
from cdcd.capture.coordinator import CaptureCoordinator
from cdcd.errors import PositionLost, SourceError, SourceFatal
from cdcd.events import ChangeEvent, Item, Mark, MarkKind, Op, TableId
from cdcd.positions import PgPosition, Position, format_lsn
from cdcd.sources.postgres import catalog
from cdcd.sources.postgres.blocks import ROW_TAGS, Blocks, segments
from cdcd.sources.postgres.catalog import HEARTBEAT_PREFIX
from cdcd.sources.postgres.columnar import BlockBuilder
from cdcd.sources.postgres.inprogress import InProgress
from cdcd.sources.postgres.plan import slot_gone_message
from cdcd.sources.postgres.shape import RowDecoder
from cdcd.sources.postgres.tables import PgTables, replaced_why
from cdcd.sources.postgres.wire import pgoutput
from cdcd.sources.postgres.wire.protocol import ProtocolError
from cdcd.sources.postgres.wire.replication import PgServerError, ReplicationConnection

log = structlog.get_logger("cdcd.source.postgres")

STATUS_INTERVAL_S = 5.0
#: The first major version whose pgoutput streams in-progress transactions (protocol 2).
STREAMING_SINCE = 14
REPLACED_CHECK_S = 5.0  # how often the captured tables' relation OIDs are compared with the decoded ones


class PgStream:
    """pgoutput from the slot (``cdcd.capture.contracts.StreamReader``)."""

    lost_event = "replication connection lost; reconnecting"

    def __init__(self, tables: PgTables, slot: str, publication: str, heartbeat_s: float, coord: CaptureCoordinator,
                 on_connect: Callable[[ReplicationConnection], Awaitable[list[Item]]],
                 inprogress: InProgress | None = None, stream_in_progress: bool = True,
                 columnar: bool = True) -> None:
        self._coord = coord
        self.columnar = columnar  # row changes as ChangeBlocks; False: one ChangeEvent per row
        self._tables = tables
        self._params = tables.params
        self._table_set = set(tables.tables)
        self._slot = slot
        self._publication = publication
        self._heartbeat_s = heartbeat_s
        self._on_connect = on_connect  # the identity check of every (re)connect: marks to emit first
        self.where = self._params.where
        self.what = f"the replication connection to {self.where}"
        self.ended = f"{self.where}: the server ended the replication stream"
        self.transient: tuple[type[BaseException], ...] = (OSError, asyncio.IncompleteReadError)
        self.flush_lsn = 0  # the flush position the server hears: never beyond a durable checkpoint
        self.replan_lost = False  # a slot gone while streaming: Replan (recovered by the planner), not PositionLost
        self.repl: ReplicationConnection | None = None
        self.lag_ms: float | None = None
        self._hb_sql: Any = None  # heartbeats get a connection of their own: asyncpg allows one query at a time
        self._inprogress = inprogress  # the spool of in-progress transactions; None: protocol 1 only
        self._stream_in_progress = stream_in_progress and inprogress is not None  # protocol 2 when the server has it
        self.proto_version = 0  # of the current connection, for /status
        #: Told of a captured table dropped or re-created (its relation OID changed): the publication no longer
        #: covers it. Checked with the heartbeats, at most every REPLACED_CHECK_S.
        self.replaced: Callable[[TableId, str], None] | None = None
        self._checked = 0.0
        self._generation = 0  # bumped by ``capture``: ``_decode`` rebuilds its decoders when it moved

    def capture(self, tables: list[TableId]) -> None:
        """The captured tables changed (a reload): from the next message ``_decode`` takes on, the relations of
        the added tables are decoded and those of the removed ones are not (``_recapture``)."""
        self._table_set = set(tables)
        self._generation += 1

    def handoff(self, watermark: Position) -> None:
        """Nothing to move: the slot starts at the snapshot's consistent point (the watermark) by itself."""

    async def run(self, reconnect: bool) -> AsyncIterator[Item]:
        if reconnect:  # the Relations of the new connection read the catalog: on a connection of the new path
            self._tables.drop_sql()
        repl = await ReplicationConnection.connect(self._params)
        self.repl = repl
        repl.flush_lsn = self.flush_lsn
        heartbeat: asyncio.Task[None] | None = None
        try:
            for mark in await self._on_connect(repl):  # a reconnect may reach a server restored or promoted
                yield mark
            interval = await repl.status_interval(STATUS_INTERVAL_S)
            spool = self._inprogress
            if spool is not None:
                # The server sends every uncommitted transaction again, from its first segment: what an earlier
                # connection or run spooled is of no use (also when this connection does not stream).
                spool.reset()
                if not self._stream_in_progress or repl.server_major() < STREAMING_SINCE:
                    spool = None
            await repl.start_replication(self._slot, 0, self._publication, interval, spool is not None)
            self.proto_version = 1 if spool is None else 2
            self._coord.connected = True
            heartbeat = asyncio.create_task(self._heartbeats(), name="pg-heartbeat")
            async for item in self._decode(self._wire(repl, spool)):
                yield item
        except PgServerError as exc:
            if exc.sqlstate == "42704" and "replication slot" in exc.server_message:
                if self.replan_lost:  # source.on_position_lost = "resnapshot": the planner recovers on the reconnect
                    raise Replan(f"{slot_gone_message(self._slot, self.where)}; recovering") from exc
                raise PositionLost(slot_gone_message(self._slot, self.where)) from exc
            if exc.sqlstate == "42704" and "publication" in exc.server_message:
                raise SourceFatal(
                    f"{exc}: the slot's decoding point is older than publication {self._publication!r} (the slot "
                    "was created before it); drop the slot and start again with an empty state.path") from exc
            raise
        except (asyncpg.PostgresError, asyncpg.InterfaceError) as exc:  # the catalog connection, for new types
            raise SourceError(f"{self.where}: {exc}") from exc
        except ProtocolError as exc:  # a message we cannot decode would be skipped data: never retry past it
            raise SourceFatal(f"{self.where}: {exc}") from exc
        finally:
            if heartbeat is not None:
                heartbeat.cancel()
                with contextlib.suppress(BaseException):
                    await heartbeat
            self.repl = None
            try:
                if self._inprogress is not None:
                    self._inprogress.close()
            finally:  # an open connection would keep the slot active: the reconnect could not start again
                await repl.close()

    @staticmethod
    async def _wire(repl: ReplicationConnection, spool: InProgress | None) -> AsyncIterator[list[bytes]]:
        """The pgoutput messages as protocol 1 carries them: protocol 2's in-progress transactions are
        spooled and come out whole at their commit (``inprogress.py``). An empty list: nothing came by
        ``repl.wake_at``."""
        if spool is None:
            async for chunk in repl.xlog():
                yield chunk
            return
        async for chunk in repl.xlog():
            if not chunk:
                yield chunk
                continue
            passed = False
            for messages in spool.translate(chunk):
                passed = True
                yield messages
                # A replay comes from a local file and never waits: let the runtime's timer seal batches, its
                # deliverer land them and the status updates go out meanwhile.
                await asyncio.sleep(0)
            if not passed and repl.keepalive_pending:
                yield []  # the read went to the spool whole: the reader may still take the keepalive after it

    async def _decode(self, wire: AsyncIterator[list[bytes]]) -> AsyncIterator[Item]:
        """The items of the socket reads: row messages gathered into blocks (``blocks.py``; ``columnar=False``:
        one ``ChangeEvent`` per row), the other messages decoded one by one (``_message``)."""
        relations = pgoutput.RelationCache()
        decoders: dict[int, RowDecoder | None] = {}
        at = Blocks(self.flush_lsn)
        builders, out = at.builders, at.pending
        columnar = self.columnar
        decode = pgoutput.decode
        row_tags = ROW_TAGS
        generation = self._generation
        async for chunk in wire:
            if generation != self._generation:  # a reload changed the captured tables (``capture``)
                generation = self._generation
                await self._recapture(relations, decoders, builders)
            for is_rows, part in segments(chunk) if columnar else ((False, chunk),):
                if is_rows and at.take_run(part):  # in bulk: one table's rows and no cut inside the run
                    if out.full():
                        for item in out.flush():
                            yield item
                    continue
                for data in part:
                    if columnar and data[0] in row_tags:
                        if at.add_row(data):
                            for item in out.flush():
                                yield item
                        continue
                    at.end_run()
                    msg = decode(data)
                    if isinstance(msg, pgoutput.Relation):
                        relations.add(msg)
                        dec = decoders[msg.oid] = await self._relation(msg, at.commit_lsn if at.in_tx else None)
                        builders[msg.oid] = None if dec is None else BlockBuilder(dec.shape, self._tables.warnings)
                        at.schema_changes(self._tables.changes)
                    else:
                        self._message(msg, at, decoders)
                if out.full():
                    for item in out.flush():
                        yield item
            # The socket is drained. Runs wait up to HOLD_S for the next reads to share their conversion (a run
            # still open continues in the next read); an empty chunk: nothing came meanwhile.
            if out.runs and chunk and time.monotonic() < out.due and self.repl is not None:
                self.repl.wake_at = out.due
                continue
            for item in out.flush():
                yield item
            if not at.in_tx and self.repl is not None and self.repl.keepalive_pending:
                mark = self._keepalive(self.repl, at.reached)
                if mark is not None:
                    at.reached = mark.position.lsn  # type: ignore[union-attr]
                    yield mark
        for item in out.flush():  # the server ended the stream: what was decoded goes out
            yield item

    def _message(self, msg: pgoutput.Message, at: Blocks, decoders: dict[int, RowDecoder | None]) -> None:
        """A message other than a Relation (and, ``columnar``, other than a row): its items to ``at.pending``, a
        Begin's or Commit's bounds of the transaction to ``at``."""
        out = at.pending
        if isinstance(msg, pgoutput.Insert | pgoutput.Update | pgoutput.Delete):
            at.seq += 1
            dec = decoders.get(msg.relation)
            if dec is not None:
                out.add(self._row_event(msg, dec, PgPosition(at.commit_lsn, at.seq), at.xid, at.commit_ts))
        elif isinstance(msg, pgoutput.Begin):
            at.commit_lsn, at.seq, at.xid, at.commit_ts = msg.final_lsn, 0, str(msg.xid), msg.commit_ts
            at.in_tx = True
            at.reached = max(at.reached, at.commit_lsn)
            self.lag_ms = max(0.0, (time.time() - msg.commit_ts.timestamp()) * 1000)
        elif isinstance(msg, pgoutput.Commit):
            at.seq += 1
            out.add(Mark(MarkKind.COMMIT, PgPosition(at.commit_lsn, at.seq),
                         {"lsn": format_lsn(at.commit_lsn), "end_lsn": format_lsn(msg.end_lsn)}))
            at.in_tx = False
        elif isinstance(msg, pgoutput.Truncate):
            for oid in msg.relations:
                at.seq += 1
                dec = decoders.get(oid)
                if dec is not None:
                    out.add(ChangeEvent(Op.TRUNCATE, dec.shape.schema, PgPosition(at.commit_lsn, at.seq),
                                        tx_id=at.xid, commit_ts=at.commit_ts))
        elif isinstance(msg, pgoutput.LogicalMessage) and msg.prefix == HEARTBEAT_PREFIX and not msg.transactional:
            out.add(Mark(MarkKind.HEARTBEAT, PgPosition(msg.lsn, 0)))
            at.reached = max(at.reached, msg.lsn)

    def _keepalive(self, repl: ReplicationConnection, reached: int) -> Mark | None:
        """A heartbeat mark at the position of the keepalive the server sent after its last data, taken between
        transactions, when one asked for a reply; None when none did or the position is not beyond ``reached``.

        The server sent every transaction whose commit lies before that position (``take_keepalive``), so the
        mark is a position like a heartbeat message's: checkpointed, then confirmed as ``flush``. It ends the
        server's fast shutdown, whose walsender asks for replies until its last keepalive's position is
        confirmed. A keepalive that asks for no reply (the answer to cdcd's status updates, every few seconds)
        is no mark: on an idle stream the heartbeats advance the slot already, and a mark per keepalive would
        double the checkpoint saves. The server asks for a reply otherwise only when it heard nothing from cdcd
        for half its ``wal_sender_timeout``, which the status updates prevent. Protocol 2: an in-progress
        transaction still spooled commits after the keepalive, beyond its position."""
        taken = repl.take_keepalive()
        if taken is None:
            return None
        lsn, reply = taken
        if not reply or lsn <= reached:
            return None
        return Mark(MarkKind.HEARTBEAT, PgPosition(lsn, 0), {"keepalive": format_lsn(lsn)})

    async def _recapture(self, relations: pgoutput.RelationCache, decoders: dict[int, RowDecoder | None],
                         builders: dict[int, BlockBuilder | None]) -> None:
        """The captured tables changed: decode the relations of the added tables from the Relation messages this
        connection received (pgoutput sends one per relation and connection, maybe while its table was not
        captured yet), stop decoding those of the removed ones. Tables whose status did not change keep their
        decoders and builders (an open run of rows stays in its builder).

        Called before the messages of the first socket read ``_decode`` takes on after the change. A message
        decoded the old way came in a read the wire handed out before ``capture`` ran, so its transaction had
        committed by then (the server sends a transaction at its commit; protocol 2's spool hands it out at its
        commit too): it lies below the low watermark of the added table's first chunk, which the chunk task
        writes after ``capture``. The snapshot's read sees such a transaction whether or not its rows were
        decoded, and every change after the low watermark is decoded."""
        for oid, rel in relations.items():
            captured = TableId(rel.namespace, rel.name) in self._table_set
            if captured == (decoders.get(oid) is not None):
                continue
            dec = decoders[oid] = await self._relation(rel) if captured else None
            builders[oid] = None if dec is None else BlockBuilder(dec.shape, self._tables.warnings)
        self._tables.changes.clear()  # a table newly captured: its snapshot lands its schema, no change to record

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

    async def _relation(self, rel: pgoutput.Relation, commit_lsn: int | None = None) -> RowDecoder | None:
        if TableId(rel.namespace, rel.name) not in self._table_set:
            return None
        return await self._tables.decoder(rel, commit_lsn)

    async def _heartbeats(self) -> None:
        while True:
            await asyncio.sleep(self._heartbeat_s)
            try:
                if self._hb_sql is None or self._hb_sql.is_closed():
                    self._hb_sql = await catalog.connect_sql(self._params)
                await catalog.emit_heartbeat(self._hb_sql)
                if time.monotonic() - self._checked >= REPLACED_CHECK_S:
                    self._checked = time.monotonic()
                    await self._check_replaced(self._hb_sql)
            except Exception as exc:  # a missed heartbeat is harmless; the next one retries
                log.warning("heartbeat failed", error=str(exc))
                with contextlib.suppress(Exception):
                    self._hb_sql.terminate()
                self._hb_sql = None

    async def _check_replaced(self, conn: Any) -> None:
        """A captured table dropped (and maybe re-created) leaves the publication: its changes stop arriving
        without any message in the stream. Compare each table's relation OID with the one cdcd decodes."""
        if self.replaced is None:
            return
        tables = sorted(self._table_set)
        rows = await conn.fetch(
            "SELECT n.nspname, c.relname, c.oid FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE (n.nspname, c.relname) IN (SELECT * FROM unnest($1::text[], $2::text[]))",
            [t.schema for t in tables], [t.name for t in tables], timeout=self._heartbeat_s + 10)
        now = {TableId(r["nspname"], r["relname"]): int(r["oid"]) for r in rows}
        for t in tables:
            info = self._tables.infos.get(t)
            if info is None:
                continue
            oid = now.get(t)
            if oid != info.oid:
                self.replaced(t, replaced_why(self._publication, info.oid, oid))

    def confirm(self, lsn: int) -> None:
        """A checkpoint with flush position ``lsn`` is durable: tell the server (standby status ``flush``)."""
        if lsn > self.flush_lsn:
            self.flush_lsn = lsn
        repl = self.repl
        if repl is not None:
            repl.flush_lsn = self.flush_lsn
            with contextlib.suppress(Exception):
                repl.send_status()

    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = {"lag_ms": self.lag_ms, "confirmed_flush_lsn": format_lsn(self.flush_lsn),
                               "proto_version": self.proto_version}
        if self.proto_version == 2 and self._inprogress is not None:
            out["in_progress"] = self._inprogress.status()
        repl = self.repl
        if repl is not None:
            out["slot_lag_bytes"] = max(0, repl.received_lsn - self.flush_lsn)
            out["received_lsn"] = format_lsn(repl.received_lsn)
        return out

    async def close(self) -> None:
        if self.repl is not None:
            await self.repl.close()
            self.repl = None
        if self._hb_sql is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._hb_sql.close(), 5)
        self._hb_sql = None

    def terminate(self) -> None:
        if self.repl is not None:
            self.repl.terminate()
            self.repl = None
        if self._hb_sql is not None:
            with contextlib.suppress(Exception):
                self._hb_sql.terminate()
        self._hb_sql = None

