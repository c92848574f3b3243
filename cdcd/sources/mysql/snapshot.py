"""The initial snapshot over aiomysql, consistent with an exact binlog position.

MariaDB: ``START TRANSACTION WITH CONSISTENT SNAPSHOT`` and the
``binlog_snapshot_file`` / ``binlog_snapshot_position`` status values of that
transaction: no lock. With ``snapshot.parallelism`` > 1 every connection opens
its own consistent snapshot; they share one watermark only when all report
the same binlog position (no commit in between), so that is retried a few
times and otherwise the snapshot runs on one connection.

MySQL: ``FLUSH TABLES WITH READ LOCK`` on one connection, consistent
snapshots opened on every connection, the position read with ``SHOW MASTER
STATUS`` (``SHOW BINARY LOG STATUS`` from 8.4), then ``UNLOCK TABLES``: the
lock is held only around those statements, never during the table reads.

Rows are read in primary-key order in chunks of ``snapshot.chunk_rows``
(``WHERE key > last ORDER BY key LIMIT n``), so a restarted snapshot resumes
after the last committed key; key columns are compared in the order ``ORDER
BY`` sorts them (ENUM/SET by number). Each chunk is streamed (server-side
cursor) and becomes columnar ``RowBlock``s of at most ``snapshot.chunk_bytes``
(at least one row): every column is built with one ``pa.array`` call on the
driver's values, and the per-value converter runs only for a column Arrow
refuses as it comes. Tables without a key are one streamed read, cut the same
way. FLOAT is read as a DOUBLE (exact; the text protocol rounds it).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import aiomysql
import pyarrow as pa
import structlog

from cdcd.events import Item, Mark, MarkKind, RowBlock, TableId, TableSchema
from cdcd.positions import MySqlPosition
from cdcd.sources.mysql import bulkread
from cdcd.sources.mysql.connection import open_connection as open_connection
from cdcd.sources.mysql.failures import query_error, raise_query_error
from cdcd.sources.mysql.queries import (
    Watermark,
    after_clause,
    load_table_schema,
    parse_binlog_status,
    parse_snapshot_status,
    quote_ident,
    select_expr,
)
from cdcd.sources.mysql.rowarrays import rows_to_table
from cdcd.sources.mysql.schema import SchemaHistory, schema_to_json
from cdcd.sources.mysql.tls import ClientTls, Tls
from cdcd.sources.mysql.types import (
    Converter,
    is_temporal_key,
    snapshot_converter,
)

log = structlog.get_logger("cdcd.source.mysql")
_told: set[str] = set()  # why the bulk reader is off, each said once per process

SAME_POSITION_ATTEMPTS = 8
#: Default bytes per snapshot RowBlock (``snapshot.chunk_bytes``).
CHUNK_BYTES = 32 << 20
#: The snapshot streams rows (server-side cursor); rows may wait while the pipeline is paused.
NET_WRITE_TIMEOUT_S = 3600


@dataclass
class TableProgress:
    rows: int = 0
    total_estimate: int = 0
    done: bool = False


@dataclass
class SnapshotTask:
    table: TableId
    after_key: tuple[Any, ...] | None = None  # resume strictly after this key


async def _execute(conn: aiomysql.Connection, sql: str) -> list[Any]:
    async with conn.cursor() as cur:
        await cur.execute(sql)
        return list(await cur.fetchall())


async def begin_consistent(conns: list[aiomysql.Connection], flavor: str,
                           bulks: list[bulkread.BulkConnection] | None = None) -> tuple[Watermark, int]:
    """Open a consistent snapshot on the connections; returns the watermark and how many share it.

    ``bulks`` (the bulk reader's connections, one per connection) join the same snapshot; when MariaDB
    cannot give them the shared position, they are closed and the list emptied (the aiomysql reader runs).
    """
    extra = bulks if bulks is not None else []

    async def on_bulks(sql: str) -> list[list[tuple[Any, ...]]]:
        return list(await asyncio.gather(*(asyncio.to_thread(b.execute, sql) for b in extra)))

    if flavor == "mariadb":
        for _ in range(SAME_POSITION_ATTEMPTS):
            start = "START TRANSACTION WITH CONSISTENT SNAPSHOT"
            await asyncio.gather(*(_execute(c, start) for c in conns), on_bulks(start))
            status = "SHOW STATUS LIKE 'binlog_snapshot_%'"
            seen = [parse_snapshot_status(await _execute(c, status)) for c in conns]
            seen += [parse_snapshot_status(rows) for rows in await on_bulks(status)]
            if all(s == seen[0] for s in seen):
                file, pos = seen[0]
                gtid_rows = await _execute(conns[0], f"SELECT BINLOG_GTID_POS('{file}', {pos})")
                return Watermark(file, pos, str(gtid_rows[0][0] or "")), len(conns)
            await asyncio.gather(*(_execute(c, "ROLLBACK") for c in conns), on_bulks("ROLLBACK"))
        # writes kept landing between the snapshots: one connection is always consistent with itself
        for b in extra:
            await asyncio.to_thread(b.close)
        extra.clear()
        await _execute(conns[0], "START TRANSACTION WITH CONSISTENT SNAPSHOT")
        file, pos = parse_snapshot_status(await _execute(conns[0], "SHOW STATUS LIKE 'binlog_snapshot_%'"))
        gtid_rows = await _execute(conns[0], f"SELECT BINLOG_GTID_POS('{file}', {pos})")
        return Watermark(file, pos, str(gtid_rows[0][0] or "")), 1
    await _execute(conns[0], "FLUSH TABLES WITH READ LOCK")
    try:
        start = "START TRANSACTION WITH CONSISTENT SNAPSHOT"
        await asyncio.gather(*(_execute(c, start) for c in conns), on_bulks(start))
        async with conns[0].cursor(aiomysql.DictCursor) as cur:
            try:
                await cur.execute("SHOW BINARY LOG STATUS")
            except aiomysql.ProgrammingError:
                await cur.execute("SHOW MASTER STATUS")
            wm = parse_binlog_status(await cur.fetchone())
    finally:
        await _execute(conns[0], "UNLOCK TABLES")
    return wm, len(conns)


class Snapshotter:
    """Reads the tasks' rows at one watermark and yields items (rows, table-done and schema marks)."""

    def __init__(self, settings: dict[str, Any], flavor: str, parallelism: int, chunk_rows: int,
                 history: SchemaHistory, queue_chunks: int = 8, tls: Tls | None = None,
                 read_timeout_s: float = 300.0, chunk_bytes: int = CHUNK_BYTES, bulk: bool | None = None) -> None:
        """``bulk``: read through mysqlclient (``bulkread.py``); None: when it is installed. Either way only
        when its connections can be as safe as the aiomysql ones (``Tls.for_mysqlclient``)."""
        self.settings = settings
        self.bulk = bulkread.available() if bulk is None else bulk
        self.reader = "aiomysql"  # the reader that runs, once open: "bulk" or "aiomysql"
        self._bulks: dict[int, bulkread.BulkConnection] = {}  # id(aiomysql connection) -> its bulk connection
        self.read_timeout_s = read_timeout_s  # each query, each chunk included, ends within this
        self.tls = tls
        self.history = history
        self.flavor = flavor
        self.parallelism = parallelism
        self.chunk_rows = chunk_rows
        self.chunk_bytes = chunk_bytes
        self.queue_chunks = queue_chunks
        self.progress: dict[str, TableProgress] = {}
        self._conns: list[aiomysql.Connection] = []

    async def open(self) -> Watermark:
        """Connect and open the consistent snapshot; returns its binlog position."""
        bulks: list[bulkread.BulkConnection] = []
        try:
            async with asyncio.timeout(self.read_timeout_s):
                self._conns = [await open_connection(self.settings, self.tls) for _ in range(self.parallelism)]
                client_tls = await self._bulk_tls() if self.bulk else None
                if client_tls is not None:
                    for _ in self._conns:
                        bulks.append(bulkread.BulkConnection(self.settings, self.read_timeout_s, client_tls))
                        await asyncio.to_thread(bulks[-1].open)
                wm, shared = await begin_consistent(self._conns, self.flavor,
                                                    bulks if client_tls is not None else None)
        except Exception as exc:
            for b in bulks:
                b.close()
            raise_query_error(exc, f"opening the snapshot on {self._where}")
        for c in self._conns[shared:]:
            c.close()
        for b in bulks[shared:]:
            b.close()
        self._conns = self._conns[:shared]
        self._bulks = {id(c): b for c, b in zip(self._conns, bulks, strict=False)}
        self.reader = "bulk" if self._bulks else "aiomysql"
        log.info("mysql.snapshot.reader", reader=self.reader, where=self._where,
                 sslmode=self.tls.sslmode if self.tls is not None else "disable",
                 tls=bool(self._bulks) and all(b.cipher for b in self._bulks.values()))
        return wm

    async def _bulk_tls(self) -> ClientTls | None:
        """The bulk connections' TLS, from what the first snapshot connection negotiated; None (the
        aiomysql reader) when mysqlclient cannot be made as safe (said once per reason)."""
        tls = self.tls if self.tls is not None else Tls.build("disable", None, self.settings["host"],
                                                              self.settings["port"])
        rows = await _execute(self._conns[0], "SHOW SESSION STATUS LIKE 'Ssl_cipher'")
        encrypted = bool(rows and rows[0][1])
        transport = getattr(getattr(self._conns[0], "_writer", None), "transport", None)
        tls_object = transport.get_extra_info("ssl_object") if transport is not None else None
        peer_cert = tls_object.getpeercert(binary_form=True) if tls_object is not None else None
        mapped = tls.for_mysqlclient(encrypted, peer_cert)
        if isinstance(mapped, str):
            if mapped not in _told:
                _told.add(mapped)
                log.warning("mysql.snapshot.bulk_reader_off", where=self._where, sslmode=tls.sslmode, reason=mapped,
                            detail="the snapshot reads through aiomysql (slower) for this source")
            return None
        return mapped

    async def run(self, tasks: list[SnapshotTask], at: MySqlPosition) -> AsyncIterator[list[Item]]:
        """Chunks of items for every task, all at position ``at`` (the original watermark)."""
        queue: asyncio.Queue[list[Item] | BaseException | None] = asyncio.Queue(self.queue_chunks)
        todo: asyncio.Queue[SnapshotTask] = asyncio.Queue()
        for t in tasks:
            todo.put_nowait(t)
            self.progress.setdefault(str(t.table), TableProgress())

        async def worker(conn: aiomysql.Connection) -> None:
            try:
                while True:
                    try:
                        task = todo.get_nowait()
                    except asyncio.QueueEmpty:
                        break
                    async for chunk in self._read_table(conn, task, at):
                        await queue.put(chunk)
                await _execute(conn, "COMMIT")  # ends the snapshot: releases its metadata locks and undo
                bulk = self._bulks.get(id(conn))
                if bulk is not None:
                    await asyncio.to_thread(bulk.execute, "COMMIT")
                await queue.put(None)
            except Exception as exc:  # connection loss, a server restart: transient, the runtime resumes
                await queue.put(query_error(exc, f"snapshot on {self._where}"))
            except BaseException as exc:
                await queue.put(exc)

        workers = [asyncio.create_task(worker(c)) for c in self._conns]
        running = len(workers)
        try:
            while running:
                got = await queue.get()
                if got is None:
                    running -= 1
                elif isinstance(got, BaseException):
                    raise got
                else:
                    yield got
        finally:
            for w in workers:
                w.cancel()
            for w in workers:
                with contextlib.suppress(BaseException):
                    await w

    async def _read_table(self, conn: aiomysql.Connection, task: SnapshotTask,
                          at: MySqlPosition) -> AsyncIterator[list[Item]]:
        table = task.table
        async with asyncio.timeout(self.read_timeout_s):
            schema, pk = await load_table_schema(conn, table)
        schema = self.history.record(at, schema)
        prog = self.progress[str(table)]
        async with asyncio.timeout(self.read_timeout_s), conn.cursor() as cur:
            await cur.execute("SELECT TABLE_ROWS FROM information_schema.TABLES WHERE TABLE_SCHEMA = %s "
                              "AND TABLE_NAME = %s", (table.schema, table.name))
            est = await cur.fetchone()
            prog.total_estimate = int(est[0] or 0) if est else 0
        yield [Mark(MarkKind.SNAPSHOT_TABLE_START, at, {"table": str(table), "schema": schema_to_json(schema)})]
        names = schema.column_names
        convs = [snapshot_converter(c.source_type) for c in schema.columns]
        select = f"SELECT {', '.join(select_expr(c) for c in schema.columns)} FROM {quote_ident(table.schema)}." \
                 f"{quote_ident(table.name)}"
        key_idx = [names.index(k) for k in pk]
        key_types = [schema.column(k).source_type for k in pk]
        after = task.after_key
        if after is not None and len(after) == len(schema.key):
            # the checkpoint keeps the key in column order; the query wants index order
            by_name = dict(zip(schema.key, after, strict=True))
            after = tuple(by_name[k] for k in pk)
        # Key columns whose driver value may be a zero date: landed NULL, so the resume key keeps the text.
        zero_keys = [names.index(k) for k in schema.key if is_temporal_key(schema.column(k).source_type)]
        reader = _ChunkReader(schema, convs, self.chunk_bytes, [names.index(k) for k in schema.key], zero_keys,
                              self.read_timeout_s)
        async with asyncio.timeout(self.read_timeout_s), conn.cursor() as cur:
            # Rows are streamed (server-side cursor) and may wait in the queue while the pipeline is paused:
            # the server must not give up writing them meanwhile.
            await cur.execute(f"SET SESSION net_write_timeout = {NET_WRITE_TIMEOUT_S}")
        while True:
            if pk:
                where, params = after_clause(pk, key_types, after)
                sql = f"{select}{where} ORDER BY {', '.join(quote_ident(k) for k in pk)} LIMIT {self.chunk_rows}"
            else:
                sql, params = select, []  # no key to paginate by: one streamed read, cut into blocks by size
            rows = 0
            last: tuple[Any, ...] | None = None
            bulk = self._bulks.get(id(conn))
            cur = None if bulk is not None else await conn.cursor(aiomysql.SSCursor)
            try:
                if cur is not None:
                    # Every read from the server has the limit, not the whole streamed chunk: its blocks may
                    # wait in the queue while the pipeline is paused.
                    async with asyncio.timeout(self.read_timeout_s):
                        await cur.execute(sql, params)
                blocks = reader.blocks(cur) if cur is not None else reader.bulk_blocks(bulk, sql, params)  # type: ignore[arg-type]
                async for data, tail, texts in blocks:
                    rows += data.num_rows
                    prog.rows += data.num_rows
                    last = tail
                    yield [RowBlock(schema, at, data, key_text=texts)]
            except BaseException:
                # Abandoned mid-result (stop, error): closing the cursor would read the rest of the result
                # (a whole keyless table); the connections are dropped instead, a retry opens new ones.
                conn.close()
                if bulk is not None:
                    self._bulks.pop(id(conn), None)
                    bulk.close()
                raise
            if cur is not None:
                async with asyncio.timeout(self.read_timeout_s):
                    await cur.close()
            if not pk or rows < self.chunk_rows or last is None:
                break
            after = tuple(last[i] for i in key_idx)
        prog.done = True
        yield [Mark(MarkKind.SNAPSHOT_TABLE_DONE, at, {"table": str(table)})]

    @property
    def _where(self) -> str:
        return f"{self.flavor} {self.settings['host']}:{self.settings['port']}"

    async def close(self) -> None:
        bulks, self._bulks = list(self._bulks.values()), {}
        for b in bulks:
            await asyncio.to_thread(b.close)
        for c in self._conns:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(c.ensure_closed(), 5)
        self._conns = []

    def terminate(self) -> None:
        bulks, self._bulks = list(self._bulks.values()), {}
        for b in bulks:
            b.close()
        for c in self._conns:
            with contextlib.suppress(Exception):
                c.close()
        self._conns = []


_Texts = tuple[pa.Array | None, ...] | None  # RowBlock.key_text


class _ChunkReader:
    """Cuts a streamed result into Arrow blocks of at most ``chunk_bytes`` (or one row, if larger).

    Rows are fetched in groups whose size follows the observed row size (starting with one row, so a
    table of huge rows never has many in memory); groups are converted at once and gathered into a
    block until it reaches ``chunk_bytes`` or the result ends.
    """

    MAX_GROUP = 8192

    def __init__(self, schema: TableSchema, convs: list[Converter | None], chunk_bytes: int,
                 key_fields: list[int], text_fields: list[int], read_timeout_s: float = 300.0) -> None:
        self.schema = schema
        self.read_timeout_s = read_timeout_s
        self.convs = convs
        self.key_fields = key_fields
        self.text_fields = text_fields
        self.chunk_bytes = chunk_bytes
        self.group = 1
        self.row_bytes = 0.0  # observed bytes per row (Arrow), 0 until a group was read

    def _next_group(self) -> int:
        if self.row_bytes <= 0:
            return self.group
        fit = int(self.chunk_bytes // (4 * self.row_bytes))  # a few groups per block
        return max(1, min(self.MAX_GROUP, self.group * 8, fit))

    def _add(self, pending: _Pending, part: pa.Table, texts: _Texts, last: tuple[Any, ...]) -> None:
        self.row_bytes = max(part.nbytes / part.num_rows, 1.0)
        pending.parts.append(part)
        pending.texts.append(texts)
        pending.size += part.nbytes
        pending.last = last

    def _texts(self, raw: list[tuple[Any, ...]]) -> _Texts:
        """RowBlock.key_text: the driver's text of zero dates in key columns (None elsewhere)."""
        if not self.text_fields:
            return None
        return tuple(pa.array([r[i] if isinstance(r[i], str) else None for r in raw], pa.string())
                     if i in self.text_fields else None for i in self.key_fields)

    async def blocks(self, cur: Any) -> AsyncIterator[tuple[pa.Table, tuple[Any, ...], _Texts]]:
        """(block, its last driver row, key_text) triples; the last row gives the keyset resume point."""
        pending = _Pending()
        while True:
            self.group = self._next_group()
            async with asyncio.timeout(self.read_timeout_s):
                raw = await cur.fetchmany(self.group)
            if raw:
                self._add(pending, rows_to_table(self.schema, self.convs, raw), self._texts(raw), raw[-1])
            ended = len(raw) < self.group
            if pending.parts and (ended or pending.size >= self.chunk_bytes):
                yield pending.take()
            if ended:
                return


    async def bulk_blocks(self, bulk: bulkread.BulkConnection, sql: str,
                          params: list[Any]) -> AsyncIterator[tuple[pa.Table, tuple[Any, ...], _Texts]]:
        """As ``blocks``, from the bulk reader: the result is read and converted in a worker thread."""
        types = await asyncio.to_thread(bulk.start, sql, params)
        blocks = self._bulk_blocks(bulk, types)
        while (got := await asyncio.to_thread(next, blocks, None)) is not None:
            yield got
        await asyncio.to_thread(bulk.end_result)

    def _bulk_blocks(self, bulk: bulkread.BulkConnection,
                     types: list[int]) -> Iterator[tuple[pa.Table, tuple[Any, ...], _Texts]]:
        pending = _Pending()
        while True:
            self.group = self._next_group()
            raw = bulk.fetch(self.group)
            if raw:
                # driver rows (as aiomysql's) only where they matter: zero-date key texts, the resume key
                texts = self._texts([bulkread.driver_row(r, types) for r in raw]) if self.text_fields else None
                self._add(pending, bulkread.raw_rows_to_table(self.schema, self.convs, raw, types), texts,
                          bulkread.driver_row(raw[-1], types))
            ended = len(raw) < self.group
            if pending.parts and (ended or pending.size >= self.chunk_bytes):
                yield pending.take()
            if ended:
                return


@dataclass(slots=True)
class _Pending:
    """The groups read since the last block was handed on, and the last driver row among them."""

    parts: list[pa.Table] = field(default_factory=list)
    texts: list[_Texts] = field(default_factory=list)
    size: int = 0
    last: tuple[Any, ...] = ()

    def take(self) -> tuple[pa.Table, tuple[Any, ...], _Texts]:
        """(block, its last driver row, key_text), and start over."""
        parts = self.parts
        block = parts[0] if len(parts) == 1 else pa.concat_tables(parts).combine_chunks()
        out = block, self.last, _concat_texts(self.texts)
        self.parts, self.texts, self.size = [], [], 0
        return out


def _concat_texts(texts: list[_Texts]) -> _Texts:
    if not texts or texts[0] is None:
        return None
    return tuple(None if cols[0] is None else pa.concat_arrays(cols)
                 for cols in zip(*texts, strict=True))
