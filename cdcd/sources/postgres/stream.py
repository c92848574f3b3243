"""The PostgreSQL stream reader: pgoutput over a replication connection, as the capture coordinator runs it.

``PgTables`` is what the planner, the snapshot and the stream share about the captured tables (catalog
facts, Arrow shapes, the type registry, the catalog connection). ``PgStream`` connects, starts replication
from the slot, decodes pgoutput into items and sends heartbeats; reconnects, backoff and the skip rule are
the coordinator's (``cdcd/capture/coordinator.py``).

Row changes go out as ``ChangeBlock``s (``columnar.py``): the consecutive row messages of one relation inside
one transaction, cut at any other message (Begin, Commit, Relation, Truncate, ...), at a row of another
relation and at ``BLOCK_ROWS`` rows or ``BLOCK_BYTES`` bytes. A block may span socket reads: the server sends
a transaction's changes after its commit (protocol 1) or cdcd replays it from its spool (protocol 2), so
its Commit follows its rows without waiting for the source, and a block per read would be a few dozen wide
rows, too few for the per-column work to pay. The other way round, the blocks of many small transactions
of one read are converted together (``_Pending``) and go out as slices, one per transaction.
``columnar=False`` keeps the row path (one ``ChangeEvent`` per row): the differential tests compare the two.
"""

from __future__ import annotations

import asyncio
import contextlib
import operator
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import asyncpg
import structlog

from cdcd.capture.coordinator import CaptureCoordinator
from cdcd.errors import PositionLost, SourceError, SourceFatal
from cdcd.events import ChangeEvent, Item, Mark, MarkKind, Op, TableId
from cdcd.positions import PgPosition, Position, format_lsn
from cdcd.sources.postgres import catalog, pgoutput
from cdcd.sources.postgres.catalog import HEARTBEAT_PREFIX, TableInfo
from cdcd.sources.postgres.columnar import BlockBuilder
from cdcd.sources.postgres.connection import ConnectParams
from cdcd.sources.postgres.inprogress import InProgress
from cdcd.sources.postgres.plan import slot_gone_message
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
from cdcd.sources.postgres.types import TypeRegistry

log = structlog.get_logger("cdcd.source.postgres")

STATUS_INTERVAL_S = 5.0
#: The first major version whose pgoutput streams in-progress transactions (protocol 2).
STREAMING_SINCE = 14
REPLACED_CHECK_S = 5.0  # how often the captured tables' relation OIDs are compared with the decoded ones
#: A ChangeBlock is cut at this many rows or wire bytes: bounds the memory a block holds while it is gathered
#: and converted (about three times its wire bytes at the peak: the joined messages, the Arrow columns, the
#: landed table), and is still enough rows for the per-column work to pay (700 rows of 1.5 kB).
BLOCK_ROWS = 8192
BLOCK_BYTES = 1 << 20
#: How long decoded rows may wait for the next socket reads, which then share their conversion: with small
#: transactions arriving one per read, a conversion per transaction is most of the event loop's time.
HOLD_S = 0.002
_ROW_TAGS = frozenset(b"IUD")
_ROW_RUN = re.compile(rb"[IUD]+")
_TAG = operator.itemgetter(0)
_OID_BYTES = operator.itemgetter(slice(1, 5))
_UNPACK_OID = pgoutput._I.unpack_from


def _segments(chunk: list[bytes]) -> list[tuple[bool, list[bytes]]]:
    """``chunk`` cut into runs of row messages (True) and the messages between them (False), in order."""
    tags = bytes(map(_TAG, chunk))
    out: list[tuple[bool, list[bytes]]] = []
    at = 0
    for run in _ROW_RUN.finditer(tags):
        a, b = run.span()
        if a > at:
            out.append((False, chunk[at:a]))
        out.append((True, chunk[a:b]))
        at = b
    if at < len(chunk):
        out.append((False, chunk[at:]))
    return out


def _bulk_run(part: list[bytes], builders: dict[int, BlockBuilder | None], block: BlockBuilder | None,
              rows: int, size: int) -> tuple[BlockBuilder | None, bool, int] | None:
    """A run of row messages taken whole: its table's builder (None: not captured), whether its first row cuts
    the open run (``block``, with ``rows`` rows of ``size`` wire bytes), its wire bytes. None when it spans
    tables or the open run would be cut inside it: the caller then takes it message by message, with the same
    cuts (``BLOCK_ROWS``, ``BLOCK_BYTES``) either way."""
    if len(set(map(_OID_BYTES, part))) != 1:
        return None
    (oid,) = _UNPACK_OID(part[0], 1)
    builder = builders.get(oid)
    cut = builder is not block or size >= BLOCK_BYTES or rows >= BLOCK_ROWS
    if builder is None:
        return None, cut, 0
    total = sum(map(len, part))
    held, had = (0, 0) if cut else (size, rows)
    if held + total - len(part[-1]) >= BLOCK_BYTES or had + len(part) - 1 >= BLOCK_ROWS:
        return None
    return builder, cut, total


@dataclass(slots=True)
class _Run:
    """Consecutive row messages of one relation in one transaction, waiting in their builder."""

    builder: BlockBuilder
    rows: int
    start: PgPosition
    tx_id: str | None
    commit_ts: datetime | None


class _Pending:
    """The items decoded from one socket read, in order, until they go out together.

    Each run of row messages becomes a ``ChangeBlock`` of its own (one transaction, as the runtime's skip
    rule and the landing's metadata columns expect), but the conversion runs once per builder for all its
    runs, and the block of each run is a zero-copy slice of that. At 400 commits of 50 rows per second, one
    per socket read, a build per transaction kept the event loop busy (profiled: 85% of its time in
    ``BlockBuilder.build``), so runs wait up to ``HOLD_S`` for the reads after them.
    """

    __slots__ = ("due", "items", "rows", "runs", "size")

    def __init__(self) -> None:
        self.items: list[Item | _Run] = []
        self.runs = 0
        self.rows = 0
        self.size = 0
        self.due = 0.0  # ``time.monotonic()`` by which the first run goes out

    def add(self, item: Item) -> None:
        self.items.append(item)

    def run(self, builder: BlockBuilder, rows: int, size: int, start: PgPosition, tx_id: str | None,
            commit_ts: datetime | None) -> None:
        if not self.runs:
            self.due = time.monotonic() + HOLD_S
        self.items.append(_Run(builder, rows, start, tx_id, commit_ts))
        self.runs += 1
        self.rows += rows
        self.size += size

    def full(self) -> bool:
        """Bounds what the runs hold in their builders, as the open run's cuts do."""
        return self.rows >= BLOCK_ROWS or self.size >= BLOCK_BYTES

    def flush(self) -> list[Item]:
        items, self.items, self.runs, self.rows, self.size = self.items, [], 0, 0, 0
        runs = [r for r in items if type(r) is _Run]
        if not runs:
            return items  # type: ignore[return-value]
        counts: dict[BlockBuilder, int] = {}
        for r in runs:
            counts[r.builder] = counts.get(r.builder, 0) + r.rows
        built = {b: b.build(PgPosition(0, 0), None, None, n) for b, n in counts.items()}
        offsets = dict.fromkeys(counts, 0)
        out: list[Item] = []
        for item in items:
            if type(item) is not _Run:
                out.append(item)  # type: ignore[arg-type]
                continue
            whole = built[item.builder]
            at = offsets[item.builder]
            offsets[item.builder] = at + item.rows
            part = whole if item.rows == whole.rows else whole.slice(at, item.rows)
            part.start, part.tx_id, part.commit_ts = item.start, item.tx_id, item.commit_ts
            out.append(part)
        return out


@dataclass
class PgTables:
    """The captured tables as the source knows them: shared by the planner, the snapshot and the stream."""

    params: ConnectParams
    tables: list[TableId]
    registry: TypeRegistry = field(default_factory=TypeRegistry)
    warnings: Warnings = field(default_factory=Warnings)
    infos: dict[TableId, TableInfo] = field(default_factory=dict)
    shapes: dict[TableId, TableShape] = field(default_factory=dict)
    sql: Any = None  # the catalog connection (asyncpg)

    async def load(self, absent_ok: frozenset[TableId] = frozenset()) -> list[TableId]:
        """Catalog facts, types and shapes of every table (``sql`` must be open). A table of ``absent_ok`` (one the
        checkpoint captured) may be gone: returned, not loaded, for the caller to flag; any other is an error."""
        absent: list[TableId] = []
        for t in self.tables:
            try:
                self.infos[t] = await catalog.table_info(self.sql, t)
            except SourceFatal:
                if t not in absent_ok:
                    raise
                absent.append(t)
                self.infos.pop(t, None)  # what an earlier connect of this process loaded is gone now
                self.shapes.pop(t, None)
        oids = {c.type_oid for info in self.infos.values() for c in info.columns}
        await catalog.load_types(self.sql, self.registry, oids)
        for t, info in self.infos.items():
            self.shapes[t] = shape_from_info(info, self.registry)
            warn_unknown(self.shapes[t], self.warnings)
        return absent

    def oids(self) -> dict[str, int]:
        """Each loaded table's relation OID, as the checkpoint keeps them (``state.py``, ``"oids"``)."""
        return {str(t): info.oid for t, info in self.infos.items() if t in self.tables}

    async def ensure_sql(self) -> Any:
        if self.sql is None or self.sql.is_closed():
            self.sql = await catalog.connect_sql(self.params)
        return self.sql


def replaced_why(publication: str, old: int, new: int | None) -> str:
    """Why a captured table whose relation OID was ``old`` needs a re-snapshot (``new``: its OID now, None: gone).
    The heartbeat's check and the check at connect (``source.py``) say the same."""
    if new is None:
        return f"it was dropped (relation OID {old} is gone), so publication {publication!r} no longer covers it"
    return (f"it was dropped and re-created (relation OID {old} is now {new}), so publication {publication!r} no "
            "longer covers it")


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
        relations = pgoutput.RelationCache()
        decoders: dict[int, RowDecoder | None] = {}
        builders: dict[int, BlockBuilder | None] = {}
        columnar = self.columnar
        commit_lsn = 0
        seq = 0
        xid: str | None = None
        commit_ts: datetime | None = None
        decode = pgoutput.decode
        row_tags = _ROW_TAGS
        unpack_oid = pgoutput._I.unpack_from
        out = _Pending()
        # the run of row messages being gathered: its builder, the seq of its first row, its rows and wire bytes
        block: BlockBuilder | None = None
        first = rows = size = 0
        generation = self._generation
        # Between transactions (no Begin without its Commit yet), and the highest WAL position an item took: a
        # keepalive's position becomes a mark only beyond it (``_keepalive``).
        in_tx = False
        reached = self.flush_lsn
        async for chunk in wire:
            if generation != self._generation:  # a reload changed the captured tables (``capture``)
                generation = self._generation
                await self._recapture(relations, decoders, builders)
            for is_rows, part in _segments(chunk) if columnar else ((False, chunk),):
                if is_rows:  # a run of row messages: in bulk when it is one table's and no cut falls inside it
                    bulk = _bulk_run(part, builders, block, rows, size)
                    if bulk is not None:
                        builder, cut, total = bulk
                        if cut:  # as the message-by-message path below cuts at the run's first row
                            if block is not None and rows:
                                out.run(block, rows, size, PgPosition(commit_lsn, first), xid, commit_ts)
                            block, first, rows, size = builder, seq + 1, 0, 0
                        if builder is not None:
                            builder.add_all(part)
                            rows += len(part)
                            size += total
                        seq += len(part)
                        if out.full():
                            for item in out.flush():
                                yield item
                        continue
                for data in part:
                    if columnar and data[0] in row_tags:
                        seq += 1
                        (oid,) = unpack_oid(data, 1)
                        builder = builders.get(oid)
                        if builder is not block or size >= BLOCK_BYTES or rows >= BLOCK_ROWS:
                            if block is not None and rows:
                                out.run(block, rows, size, PgPosition(commit_lsn, first), xid, commit_ts)
                                if out.full():
                                    for item in out.flush():
                                        yield item
                            block, first, rows, size = builder, seq, 0, 0
                        if builder is not None:  # None: a table not captured (a seq gap: the next row opens a run)
                            builder.add(data)
                            rows += 1
                            size += len(data)
                        continue
                    if block is not None:
                        if rows:
                            out.run(block, rows, size, PgPosition(commit_lsn, first), xid, commit_ts)
                        block, rows = None, 0
                    msg = decode(data)
                    if isinstance(msg, pgoutput.Insert | pgoutput.Update | pgoutput.Delete):
                        seq += 1
                        dec = decoders.get(msg.relation)
                        if dec is not None:
                            out.add(self._row_event(msg, dec, PgPosition(commit_lsn, seq), xid, commit_ts))
                    elif isinstance(msg, pgoutput.Begin):
                        commit_lsn, seq, xid, commit_ts = msg.final_lsn, 0, str(msg.xid), msg.commit_ts
                        in_tx = True
                        reached = max(reached, commit_lsn)
                        self.lag_ms = max(0.0, (time.time() - msg.commit_ts.timestamp()) * 1000)
                    elif isinstance(msg, pgoutput.Commit):
                        seq += 1
                        out.add(Mark(MarkKind.COMMIT, PgPosition(commit_lsn, seq),
                                     {"lsn": format_lsn(commit_lsn), "end_lsn": format_lsn(msg.end_lsn)}))
                        in_tx = False
                    elif isinstance(msg, pgoutput.Relation):
                        relations.add(msg)
                        dec = decoders[msg.oid] = await self._relation(msg)
                        builders[msg.oid] = None if dec is None else BlockBuilder(dec.shape, self._tables.warnings)
                    elif isinstance(msg, pgoutput.Truncate):
                        for oid in msg.relations:
                            seq += 1
                            dec = decoders.get(oid)
                            if dec is not None:
                                out.add(ChangeEvent(Op.TRUNCATE, dec.shape.schema, PgPosition(commit_lsn, seq),
                                                    tx_id=xid, commit_ts=commit_ts))
                    elif isinstance(msg, pgoutput.LogicalMessage) and msg.prefix == HEARTBEAT_PREFIX \
                            and not msg.transactional:
                        out.add(Mark(MarkKind.HEARTBEAT, PgPosition(msg.lsn, 0)))
                        reached = max(reached, msg.lsn)
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
            if not in_tx and self.repl is not None and self.repl.keepalive_pending:
                mark = self._keepalive(self.repl, reached)
                if mark is not None:
                    reached = mark.position.lsn  # type: ignore[union-attr]
                    yield mark
        for item in out.flush():  # the server ended the stream: what was decoded goes out
            yield item

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
        t = self._tables
        oids = {c.type_oid for c in rel.columns}
        if t.registry.missing(oids):
            await catalog.load_types(await t.ensure_sql(), t.registry, oids)
        old = t.shapes.get(table)
        info = t.infos.get(table)
        shape = shape_from_relation(rel, info, t.registry, old.schema.version if old else 0)
        if old is not None and not same_columns(old.schema, shape.schema):
            # The schema changed: refresh key and dimensions from the catalog, bump the version.
            with contextlib.suppress(SourceError, OSError):
                t.infos[table] = info = await catalog.table_info(await t.ensure_sql(), table)
            shape = shape_from_relation(rel, info, t.registry, old.schema.version + 1)
            log.info("table schema changed", table=str(table), version=shape.schema.version,
                     columns=list(shape.schema.column_names))
        t.shapes[table] = shape
        warn_unknown(shape, t.warnings)
        return RowDecoder(shape, t.warnings)

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

