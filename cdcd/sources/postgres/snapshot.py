"""The initial snapshot: tables read in key order under one snapshot, in parallel.

Every worker connection runs one ``REPEATABLE READ READ ONLY`` transaction
that imports the same snapshot (the slot's exported one on a first start, a
fresh exported one when resuming), so all tables are read as of one instant.
Tables are spread over the workers; each table is read by one worker in
key-ordered chunks (keyset pagination), so "last key acked" is a resume
point.

Tables with a key take the columnar path. With the ADBC PostgreSQL driver
installed (the default), each chunk is one ``SELECT ... ORDER BY key LIMIT n``
read as binary COPY straight into Arrow by libpq and the driver's C++ in a
worker thread (bulkread.py), on a second connection per worker that imports
the same snapshot; columns the driver does not decode exactly as cdcd lands
them are selected as text and converted by the text path. Without it, each
chunk is one ``COPY (SELECT ... LIMIT n) TO STDOUT`` in text format, parsed in
bulk into Arrow columns in a worker thread (copytext.py) while the next chunk
is read. Either way a chunk is handed on as ``RowBlock``s. Tables without a key fall back to the row path: read whole
with a cursor, one ChangeEvent per row (they cannot be paginated by key, and
a COPY of the whole table would have to be split into chunks by scanning its
bytes for row ends).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import asyncpg
import pyarrow as pa

from cdcd.errors import SourceError, SourceFatal
from cdcd.events import ChangeEvent, Item, Mark, MarkKind, Op, RowBlock, TableSchema
from cdcd.positions import PgPosition, Position, parse_lsn
from cdcd.sources.postgres import bulkread
from cdcd.sources.postgres.catalog import TableInfo, connect_sql, keyset_query, quote_ident, quote_literal, quote_table
from cdcd.sources.postgres.copytext import CopyDecoder, RowRuns, last_row_fields
from cdcd.sources.postgres.shape import INFINITE, TableShape, Warnings
from cdcd.sources.postgres.state import PgState, TableProgress
from cdcd.sources.postgres.tables import PgTables
from cdcd.sources.postgres.types import Unrepresentable
from cdcd.sources.postgres.wire.replication import ConnectParams

_DONE = object()
#: Landed types whose ±infinity is clamped (and warned about): read as text on the row path.
_CLAMPED = (pa.date32(), pa.timestamp("us"), pa.timestamp("us", tz="UTC"))

#: Text bytes per RowBlock: small enough that parsing starts early and overlaps the COPY, big enough to
#: keep per-block overhead negligible.
BLOCK_BYTES = 4 << 20
#: RowBlocks being parsed (or parsed, not handed on yet) per worker.
_PARSING = 2


@dataclass(slots=True)
class SnapshotTable:
    info: TableInfo
    shape: TableShape
    after: list[str] | None = None  # key (as text) of the last committed row: resume after it
    rows: int = 0  # rows produced so far (including committed ones from earlier runs)
    done: bool = False

    def select_list(self) -> str:
        exprs = []
        for col, t in zip(self.shape.schema.columns, self.shape.types, strict=True):
            q = quote_ident(col.name)
            # Non-native types are read in their text output form, exactly what pgoutput sends.
            # Dates and timestamps too: asyncpg gives ±infinity as the type's max/min, indistinguishable from
            # real values, and an infinite value must be warned about.
            native = t.driver_native and col.type not in _CLAMPED
            exprs.append(q if native else f"CASE WHEN {q} IS NULL THEN NULL ELSE format('%s', {q}) END")
        return ", ".join(exprs)

    def chunk_query(self, limit: int) -> str:
        """The next chunk, for a COPY: every column as is (COPY sends its text output), the resume key inlined."""
        types = {c.name: c.sql_type for c in self.info.columns}
        select = ", ".join(quote_ident(c.name) for c in self.shape.schema.columns)
        return keyset_query(select, self.info.table, self.info.key, types, self.after, limit)


def resume_tables(t: PgTables, state: PgState) -> list[SnapshotTable]:
    """Every captured table as the snapshot reads it, after the last key the checkpoint acked (``state``)."""
    tables: list[SnapshotTable] = []
    for table in t.tables:
        entry = state.tables.get(str(table)) or TableProgress()
        info = t.infos[table]
        after = entry.last_key if info.key else None
        tables.append(SnapshotTable(info, t.shapes[table], after, entry.rows if after else 0, entry.done))
    return tables


def snapshot_status(tables: list[SnapshotTable]) -> dict[str, Any]:
    """The snapshot's progress for /status: rows read, the catalog's estimate, done."""
    return {str(t.info.table): {"rows": t.rows, "total_estimate": t.info.estimate, "done": t.done} for t in tables}


async def _copy(conn: Any, query: str) -> list[bytes]:
    """``query``'s rows in COPY text format, as the pieces the driver received."""
    chunks: list[bytes] = []

    async def collect(data: bytes) -> None:
        chunks.append(data)

    await conn.copy_from_query(query, output=collect)  # COPY (query) TO STDOUT, text format
    return chunks


def _record_bytes(record: Any) -> int:
    """About the memory a row's values take (strings and bytes dominate; others count a few bytes)."""
    return sum(len(v) if isinstance(v, str | bytes) else 16 for v in record)


class SnapshotReader:
    """Opens the snapshot transactions, then yields snapshot rows and per-table Marks."""

    def __init__(self, params: ConnectParams, parallelism: int, chunk_rows: int, warnings: Warnings,
                 chunk_bytes: int = BLOCK_BYTES, bulk: bool | None = None) -> None:
        """``bulk``: read keyed tables with the ADBC bulk reader (None: when the driver is installed)."""
        self._params = params
        self._bulk = bulkread.available() if bulk is None else bulk
        self._bulk_conns: list[bulkread.BulkConnection] = []
        self._parallelism = parallelism
        self._chunk_rows = chunk_rows
        self._chunk_bytes = chunk_bytes
        self._warnings = warnings
        self._conns: list[Any] = []
        self._exporter: Any = None
        self.watermark_lsn: int | None = None

    async def open(self, snapshot_name: str | None, workers: int) -> None:
        """Start the worker transactions. With ``snapshot_name`` None, export a fresh snapshot first."""
        workers = max(1, min(self._parallelism, workers))
        try:
            if snapshot_name is None:
                self._exporter = await connect_sql(self._params)
                await self._exporter.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
                row = await self._exporter.fetchrow(
                    "SELECT pg_export_snapshot() AS s, pg_current_wal_insert_lsn()::text AS l")
                snapshot_name = str(row["s"])
                self.watermark_lsn = parse_lsn(row["l"])
            for _ in range(workers):
                conn = await connect_sql(self._params)
                self._conns.append(conn)
                await conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
                await conn.execute(f"SET TRANSACTION SNAPSHOT {quote_literal(snapshot_name)}")
            if self._bulk:
                for _ in range(workers):
                    bulk = bulkread.BulkConnection(self._params, min(bulkread.BATCH_BYTES, self._chunk_bytes))
                    self._bulk_conns.append(bulk)
                    await bulkread.call(functools.partial(bulk.open, snapshot_name),
                                        self._params.connect_timeout_s + self._params.read_timeout_s,
                                        f"opening the snapshot's bulk reader on {self._params.where}")
        except BaseException:
            await self.close()
            raise

    async def rows(self, tables: list[SnapshotTable], watermark: PgPosition) -> AsyncIterator[Item]:
        """Snapshot rows of every table not done, a ``snapshot_table_done`` Mark after each table."""
        todo: asyncio.Queue[SnapshotTable] = asyncio.Queue()
        for t in tables:
            if not t.done:
                todo.put_nowait(t)
        out: asyncio.Queue[Any] = asyncio.Queue(maxsize=2 * len(self._conns))
        bulks: list[bulkread.BulkConnection | None] = [*self._bulk_conns] or [None] * len(self._conns)
        tasks = [asyncio.create_task(self._work(conn, bulk, todo, out, watermark))
                 for conn, bulk in zip(self._conns, bulks, strict=True)]
        running = len(tasks)
        try:
            while running:
                got = await out.get()
                if got is _DONE:
                    running -= 1
                    continue
                if isinstance(got, BaseException):
                    raise got
                for item in got:
                    yield item
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(BaseException):
                    await task

    async def _work(self, conn: Any, bulk: bulkread.BulkConnection | None, todo: asyncio.Queue[SnapshotTable],
                    out: asyncio.Queue[Any], watermark: PgPosition) -> None:
        try:
            while not todo.empty():
                table = todo.get_nowait()
                if table.info.key and bulk is not None:
                    await self._keyed_bulk(bulk, table, out, watermark)
                elif table.info.key:
                    await self._keyed(conn, table, out, watermark)
                else:
                    await self._whole(conn, table, out, watermark)
                table.done = True
                await out.put([Mark(MarkKind.SNAPSHOT_TABLE_DONE, watermark, {"table": str(table.info.table)})])
            await out.put(_DONE)
        except asyncio.CancelledError:
            raise
        except SourceFatal as exc:  # e.g. COPY output that cannot be parsed: a retry would fail the same way
            await out.put(exc)
        except asyncpg.InsufficientPrivilegeError as exc:
            err: SourceError = SourceFatal(f"snapshot of {self._params.where}: {exc}; grant SELECT on the table "
                                           "to source.user")
            err.__cause__ = exc
            await out.put(err)
        except TimeoutError as exc:  # asyncpg's command_timeout: a silent or stuck connection
            err = SourceError(f"snapshot of {self._params.where}: a chunk query got no answer within "
                              f"{self._params.read_timeout_s:g}s (runtime.source_read_timeout_s); the connection "
                              "is taken for dead, reconnecting")
            err.__cause__ = exc
            await out.put(err)
        except Exception as exc:  # handed to the consumer, which raises it in stream()
            err = SourceError(f"snapshot of {self._params.where}: {exc}")
            err.__cause__ = exc
            await out.put(err)

    async def _keyed(self, conn: Any, table: SnapshotTable, out: asyncio.Queue[Any], watermark: PgPosition) -> None:
        """Key-ordered chunks as RowBlocks, parsed in threads while the COPY goes on.

        A chunk's rows are cut into runs of about ``BLOCK_BYTES`` as they arrive; each run is parsed in a
        worker thread while the rest (and the next chunk) is read. At most ``_PARSING`` runs are parsed
        or waiting at once, so memory stays bounded; blocks are handed on in key order.
        """
        names = table.shape.schema.column_names
        key_fields = [names.index(k) for k in table.info.key]
        decoder = CopyDecoder(table.shape, self._warnings, key_fields)
        parsing: collections.deque[asyncio.Future[tuple[pa.Table, tuple[pa.Array | None, ...]]]] = \
            collections.deque()

        async def hand_on(keep: int) -> None:
            while len(parsing) > keep:
                data, texts = await parsing.popleft()
                table.rows += data.num_rows
                # key_text: the checkpoint's resume key is the server's text, not rebuilt from landed values
                await out.put([RowBlock(table.shape.schema, watermark, data, key_text=texts)])

        async def parse(run: list[bytes]) -> None:
            rows = sum(piece.count(b"\n") for piece in run)
            parsing.append(asyncio.ensure_future(asyncio.to_thread(decoder.decode_keyed, run, rows)))
            await hand_on(_PARSING)

        try:
            while True:
                runs = RowRuns(min(BLOCK_BYTES, self._chunk_bytes))
                last: list[bytes] = []

                async def collect(data: bytes) -> None:
                    nonlocal last
                    run = runs.feed(data)  # noqa: B023 - called only while this iteration's COPY runs
                    if run:
                        last = run
                        await parse(run)

                await conn.copy_from_query(table.chunk_query(self._chunk_rows), output=collect)
                run = runs.rest()
                if run:
                    last = run
                    await parse(run)
                if runs.rows:
                    # The next chunk starts after this one's last key, taken from the raw text: no need to wait
                    # for the parse, and the key's text output casts back to exactly the same value.
                    table.after = last_row_fields(last, key_fields)
                if runs.rows < self._chunk_rows:
                    await hand_on(0)
                    return
        finally:
            for fut in parsing:
                fut.cancel()

    async def _keyed_bulk(self, bulk: bulkread.BulkConnection, table: SnapshotTable, out: asyncio.Queue[Any],
                          watermark: PgPosition) -> None:
        """Key-ordered chunks read by the bulk reader (binary COPY into Arrow, in a thread), one RowBlock per
        batch the driver hands out (about ``bulkread.BATCH_BYTES``).

        The next batch (the next chunk's query included) is read and converted in its thread while this one
        is handed on, so the server, the driver and the landing overlap.
        """
        names = table.shape.schema.column_names
        key_fields = [names.index(k) for k in table.info.key]
        bulk_plan = bulkread.plan(table.shape, key_fields)
        convert = bulkread.BatchConverter(table.shape, self._warnings, key_fields, bulk_plan)
        types = {c.name: c.sql_type for c in table.info.columns}
        chunks = bulkread.ChunkCursor(bulk, convert, lambda after: keyset_query(
            bulk_plan.select, table.info.table, table.info.key, types, after, self._chunk_rows),
            self._chunk_rows, table.after)

        def read_ahead() -> asyncio.Future[tuple[pa.Table, tuple[pa.Array | None, ...], list[str]] | None]:
            fut = asyncio.ensure_future(bulkread.call(chunks.next, self._params.read_timeout_s,
                                                      f"snapshot of {self._params.where}: a chunk"))
            # abandoned (the worker stops): the thread's error, if any, is not this worker's to raise
            fut.add_done_callback(lambda f: f.cancelled() or f.exception())
            return fut

        pending = read_ahead()
        try:
            while (got := await pending) is not None:
                pending = read_ahead()
                data, texts, after = got
                table.rows += data.num_rows
                table.after = after  # where the next chunk starts: the last row's key as the server's text
                # key_text: the checkpoint's resume key is the server's text, not rebuilt from landed values
                await out.put([RowBlock(table.shape.schema, watermark, data, key_text=texts)])
        finally:
            pending.cancel()

    async def _whole(self, conn: Any, table: SnapshotTable, out: asyncio.Queue[Any], watermark: PgPosition) -> None:
        """A keyless table through a server-side cursor, in batches of ``chunk_rows`` rows or ``chunk_bytes``.

        Rows are fetched in groups sized from the rows seen so far (starting with one), so huge rows never
        pile up: memory stays about ``chunk_bytes`` whatever the row size.
        """
        sql = f"SELECT {table.select_list()} FROM {quote_table(table.info.table)}"
        cursor = await conn.cursor(sql)
        batch: list[Any] = []
        size, group, row_bytes = 0, 1, 0.0
        while True:
            if row_bytes:
                group = max(1, min(10000, group * 8, int(self._chunk_bytes // (4 * row_bytes))))
            group = max(1, min(group, self._chunk_rows - len(batch)))  # a batch holds chunk_rows at most
            records = await cursor.fetch(group)
            got = sum(_record_bytes(r) for r in records)
            row_bytes = max(got / len(records), 1.0) if records else row_bytes
            batch.extend(records)
            size += got
            ended = len(records) < group
            if batch and (ended or len(batch) >= self._chunk_rows or size >= self._chunk_bytes):
                table.rows += len(batch)
                await out.put(self._events(table, batch, watermark))
                batch, size = [], 0
            if ended:
                return

    def _events(self, table: SnapshotTable, records: list[Any], watermark: PgPosition) -> list[ChangeEvent]:
        schema = table.shape.schema
        convs = [(c.name, t.from_driver if t.driver_native and c.type not in _CLAMPED else t.from_text)
                 for c, t in zip(schema.columns, table.shape.types, strict=True)]
        clamped = {c.name for c in schema.columns if c.type in _CLAMPED}
        events: list[ChangeEvent] = []
        for rec in records:
            row: dict[str, Any] = {}
            for i, (name, conv) in enumerate(convs):
                v = rec[i]
                if v is not None:
                    if name in clamped and v in ("infinity", "-infinity"):
                        self._warnings.once(schema.table, name, INFINITE)
                    try:
                        v = conv(v)
                    except (Unrepresentable, ValueError) as exc:
                        self._warnings.once(schema.table, name, "value cannot be represented: landed as NULL",
                                            error=str(exc))
                        v = None
                row[name] = v
            events.append(ChangeEvent(Op.READ, schema, watermark, after=row, snapshot=True))
        return events

    async def close(self) -> None:
        conns = [*self._conns, *([self._exporter] if self._exporter is not None else [])]
        bulks, self._bulk_conns = self._bulk_conns, []
        for bulk in bulks:
            await asyncio.to_thread(bulk.close)
        self._conns, self._exporter = [], None
        for conn in conns:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(conn.close(), 5)

    def terminate(self) -> None:
        conns = [*self._conns, *([self._exporter] if self._exporter is not None else [])]
        bulks, self._bulk_conns = self._bulk_conns, []
        for bulk in bulks:
            bulk.close(wait_s=0)  # cancels its query; closes it unless a thread is reading from it
        self._conns, self._exporter = [], None
        for conn in conns:
            with contextlib.suppress(Exception):
                conn.terminate()


class PgSnapshot:
    """The snapshot as the capture coordinator runs it (``cdcd.capture.contracts.SnapshotReader``).

    Its transactions are opened while planning (``PostgresSource.connect``): an exported snapshot must be
    imported before the replication connection that exported it runs another command.
    """

    def __init__(self, reader: SnapshotReader, tables: list[SnapshotTable], watermark: PgPosition,
                 fresh: bool) -> None:
        self._reader = reader
        self.tables = tables
        self._watermark = watermark
        self.fresh = fresh

    async def open(self) -> PgPosition:
        return self._watermark

    def opening(self, watermark: Position) -> list[Item]:
        return []  # the start Mark (slot, watermark) is part of the plan's announce

    async def schemas(self) -> list[TableSchema]:
        return [t.shape.schema for t in self.tables]

    def rows(self, watermark: Position) -> AsyncIterator[Item]:
        assert isinstance(watermark, PgPosition)
        return self._reader.rows(self.tables, watermark)

    async def close(self) -> None:
        await self._reader.close()

    def terminate(self) -> None:
        self._reader.terminate()
