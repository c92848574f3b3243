"""MariaDB's part of incremental snapshots: watermarks and key-ordered chunk reads, writing nothing.

Per chunk (``MyChunkReader.read``), on a connection of its own:

1. ``START TRANSACTION WITH CONSISTENT SNAPSHOT`` and MariaDB's ``binlog_snapshot_file`` /
   ``binlog_snapshot_position``: the exact binlog position the read sees, the low watermark (LW). Every
   transaction before it in the binlog is visible to the read, none after it is: the read sees no transaction it
   should not (so nothing is "invisible" beyond the LW rule);
2. the chunk: ``SELECT ... WHERE key > last [AND (where)] ORDER BY key LIMIT n`` (the initial snapshot's keyset
   clause and converters), then ``COMMIT``;
3. ``SHOW MASTER STATUS`` and ``BINLOG_GTID_POS`` of it: the high watermark (HW), the binlog's end after the
   read. The rows go at the HW, a transaction boundary, so the position is also a valid resume point (like a
   snapshot watermark).

A binlog with no writes sends no event at the HW: when the binlog reader has read up to the HW (its heartbeats
carry the server's position) ``poke`` hands the stream a ``WATERMARK`` mark at the HW, which delivers the chunk.
MySQL has no snapshot position (its consistent snapshot is not tied to a binlog position without a global read
lock), so incremental snapshots are MariaDB's only.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import aiomysql
import pyarrow as pa

from cdcd.capture.incremental import Chunk, SnapshotJob
from cdcd.errors import SourceFatal
from cdcd.events import Mark, MarkKind
from cdcd.positions import MySqlPosition
from cdcd.sources.mysql.connection import open_connection
from cdcd.sources.mysql.failures import FATAL_CODES, code_of
from cdcd.sources.mysql.snapshot import (
    _after_clause,
    _ChunkReader,
    _select_expr,
    load_table_schema,
    parse_binlog_status,
    parse_snapshot_status,
    quote_ident,
)
from cdcd.sources.mysql.types import is_temporal_key, key_from_json, key_to_json, snapshot_converter

if TYPE_CHECKING:
    from cdcd.sources.mysql.source import MySqlSource


def _never(tx: str | None) -> bool:
    return False


class MyChunkReader:
    """``cdcd.capture.incremental.ChunkReader`` for MariaDB."""

    def __init__(self, src: MySqlSource) -> None:
        self._src = src
        self._conn: aiomysql.Connection | None = None
        #: Called between the chunk's read and its HW (tests change the chunk's rows there, on the real server).
        self.after_read: Callable[[SnapshotJob], Awaitable[None]] | None = None

    async def _connection(self) -> aiomysql.Connection:
        if self._conn is None or self._conn.closed:
            self._conn = await open_connection(self._src.conn.settings(), self._src.tls)
        return self._conn

    async def _rows(self, conn: aiomysql.Connection, sql: str, args: Any = None) -> list[Any]:
        async with conn.cursor() as cur:
            await cur.execute(sql, args)
            return list(await cur.fetchall())

    async def read(self, job: SnapshotJob, limit: int) -> Chunk:
        src = self._src
        if src.flavor != "mariadb":
            raise SourceFatal(f"incremental snapshot of {job.table}: MySQL reports no binlog position for a "
                              "consistent snapshot without a global read lock; incremental snapshots need MariaDB")
        timeout = src.config.runtime.source_read_timeout_s
        conn = await self._connection()
        async with asyncio.timeout(timeout):
            loaded, pk = await load_table_schema(conn, job.table)
        if not pk:
            raise SourceFatal(f"incremental snapshot of {job.table}: the table has no primary key, so it cannot be "
                              "read in key order while it streams")
        # The stream's schema of the table when it has one (its history), else the catalog's.
        schema = src.history.latest(job.table) or loaded
        names = schema.column_names
        convs = [snapshot_converter(c.source_type) for c in schema.columns]
        select = f"SELECT {', '.join(_select_expr(c) for c in schema.columns)} FROM " \
                 f"{quote_ident(job.table.schema)}.{quote_ident(job.table.name)}"
        key_types = [schema.column(k).source_type for k in pk]
        after = None
        if job.last_key is not None:
            by_name = dict(zip(schema.key, key_from_json(job.last_key), strict=True))
            after = tuple(by_name[k] for k in pk)
        where, params = _after_clause(pk, key_types, after)
        if job.where:
            # the query is formatted with its parameters (pymysql's %s): a literal % of the condition is %%
            cond = job.where.replace("%", "%%")
            where = f"{where} AND ({cond})" if where else f" WHERE ({cond})"
        sql = f"{select}{where} ORDER BY {', '.join(quote_ident(k) for k in pk)} LIMIT {limit}"
        zero_keys = [names.index(k) for k in schema.key if is_temporal_key(schema.column(k).source_type)]
        reader = _ChunkReader(schema, convs, 1 << 62, [names.index(k) for k in schema.key], zero_keys, timeout)
        parts: list[pa.Table] = []
        texts: list[Any] = []
        last: tuple[Any, ...] | None = None
        async with asyncio.timeout(timeout):
            await self._rows(conn, "START TRANSACTION WITH CONSISTENT SNAPSHOT")
            file, pos = parse_snapshot_status(await self._rows(conn, "SHOW STATUS LIKE 'binlog_snapshot_%'"))
        try:
            cur = await conn.cursor(aiomysql.SSCursor)
            async with asyncio.timeout(timeout):
                await cur.execute(sql, params)
            async for data, tail, block_texts in reader.blocks(cur):
                parts.append(data)
                texts.append(block_texts)
                last = tail
            async with asyncio.timeout(timeout):
                await cur.close()
                await self._rows(conn, "COMMIT")
            if self.after_read is not None:
                await self.after_read(job)
            async with asyncio.timeout(timeout):
                async with conn.cursor(aiomysql.DictCursor) as dcur:
                    await dcur.execute("SHOW MASTER STATUS")
                    end = parse_binlog_status(await dcur.fetchone())
                gtid = await self._rows(conn, "SELECT BINLOG_GTID_POS(%s, %s)", (end.file, end.pos))
        except BaseException:
            conn.close()  # abandoned mid-result: a new connection next time
            self._conn = None
            raise
        data = pa.concat_tables(parts).combine_chunks() if parts else reader_empty(schema)
        rows = data.num_rows
        key_text = None
        if texts and texts[0] is not None:
            key_text = tuple(None if cols[0] is None else pa.concat_arrays(list(cols))
                             for cols in zip(*texts, strict=True))
        last_key = None
        if last is not None:
            key = tuple(last[names.index(k)] for k in schema.key)
            last_key = key_to_json(key)
        lw = src._stamp(MySqlPosition.at(file, pos, 0))
        hw = src._stamp(MySqlPosition.at(end.file, end.pos, 0, str(gtid[0][0] or "")))
        return Chunk(job, schema, data, key_text, last_key, lw, hw, rows < limit, _never)

    def poke(self, chunk: Chunk) -> None:
        """The binlog may be idle: once the reader has read up to the HW, deliver the chunk with a mark there."""
        stream = self._src._stream
        reader, channel = stream.reader, stream.channel
        hw = chunk.hw
        assert isinstance(hw, MySqlPosition)
        if reader is None or channel is None or len(channel) or reader.read_upto is None:
            return
        file, pos = reader.read_upto
        at = MySqlPosition.at(file, pos, 0)
        if (at.file_index, at.pos) >= (hw.file_index, hw.pos):
            channel.put_many([Mark(MarkKind.WATERMARK, hw, {})])

    def job_error(self, exc: BaseException) -> str | None:
        code = code_of(exc)
        # SQL the server rejects (a bad WHERE: 1054 unknown column, 1064 syntax, 1146 no table) is the request's
        # fault; privileges too. Reading again cannot help.
        if code in (1054, 1064, 1146, 1292, 1305) or (code is not None and code in FATAL_CODES):
            return f"{self._src._where}: {exc}"
        if isinstance(exc, SourceFatal):
            return str(exc)
        return None

    async def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(conn.ensure_closed(), 5)

    def terminate(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()


def reader_empty(schema: Any) -> pa.Table:
    return pa.Table.from_arrays([pa.array([], c.type) for c in schema.columns],
                                schema=pa.schema([pa.field(c.name, c.type) for c in schema.columns]))
