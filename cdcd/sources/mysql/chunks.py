"""MariaDB's and MySQL's part of incremental snapshots: watermarks and key-ordered chunk reads, writing nothing.

Per chunk (``MyChunkReader.read``), on a connection of its own:

1. the low watermark (LW), by the strategy chosen for the server (``watermarks.py``,
   ``source.mysql.incremental_watermark``):

   * exact (MariaDB): ``START TRANSACTION WITH CONSISTENT SNAPSHOT`` and MariaDB's ``binlog_snapshot_file`` /
     ``binlog_snapshot_position``, the exact binlog position the read sees: every transaction before it is visible
     to the read, none after it. Taken again (a new snapshot) while it is not past what the stream already
     delivered (a delivered transaction whose engine commit had not run yet when the snapshot began);
   * bracketing (MySQL, MariaDB on request): the binlog's end P (``SHOW MASTER STATUS`` or, from MySQL 8.2,
     ``SHOW BINARY LOG STATUS``) read before the read starts, then the fence: the binlog reader has read up to P,
     and the server's committed GTID set (MySQL ``gtid_executed``; MariaDB the GTID position of its last engine
     commit) holds every transaction the reader has read, so every transaction before P is visible to a snapshot
     begun after it. Then ``START TRANSACTION WITH CONSISTENT SNAPSHOT``. A transaction after P may or may not be
     visible: it is streamed after the LW and supersedes the chunk's rows either way;

2. the chunk: ``SELECT ... WHERE key > last [AND (where)] ORDER BY key LIMIT n`` (the initial snapshot's keyset
   clause and converters), then ``COMMIT``;
3. the binlog's end again, with its GTID set: the high watermark (HW). The rows go at the HW, a transaction
   boundary, so the position is also a valid resume point (like a snapshot watermark).

A binlog with no writes sends no event at the HW: when the binlog reader has read up to the HW (its heartbeats
carry the server's position) ``poke`` hands the stream a ``WATERMARK`` mark at the HW, which delivers the chunk.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

import aiomysql
import pyarrow as pa
import structlog

from cdcd.capture.coordinator import CaptureCoordinator
from cdcd.capture.incremental import Chunk, SnapshotJob
from cdcd.errors import SourceError, SourceFatal
from cdcd.events import Mark, MarkKind
from cdcd.positions import MySqlPosition
from cdcd.sources.mysql.connection import open_connection
from cdcd.sources.mysql.failures import FATAL_CODES, code_of
from cdcd.sources.mysql.gtid import GtidSet, parse_gtid_set
from cdcd.sources.mysql.queries import (
    Watermark,
    after_clause,
    load_table_schema,
    parse_binlog_status,
    parse_snapshot_status,
    quote_ident,
    select_expr,
)
from cdcd.sources.mysql.schema import with_ids
from cdcd.sources.mysql.server import MySqlServer
from cdcd.sources.mysql.snapshot import _ChunkReader
from cdcd.sources.mysql.stream import MySqlStream
from cdcd.sources.mysql.types import is_temporal_key, key_from_json, key_to_json, snapshot_converter
from cdcd.sources.mysql.watermarks import Strategy, binlog_status_statement, choose_strategy, covers

log = structlog.get_logger("cdcd.source.mysql")

#: How often the LW's fence looks again (the stream reaching P, the server's engine commits catching up).
FENCE_POLL_S = 0.01


def _never(tx: str | None) -> bool:
    return False


class MyChunkReader:
    """``cdcd.capture.incremental.ChunkReader`` for MariaDB and MySQL: reads on a connection of its own to the
    ``server``, fences its low watermark with what the binlog ``stream`` has read and ``coord`` has delivered."""

    def __init__(self, server: MySqlServer, stream: MySqlStream, coord: CaptureCoordinator) -> None:
        self._server = server
        self._stream = stream
        self._coord = coord
        self._conn: aiomysql.Connection | None = None
        #: Called between the chunk's read and its HW (tests change the chunk's rows there, on the real server).
        self.after_read: Callable[[SnapshotJob], Awaitable[None]] | None = None
        #: Called once the read's snapshot is open, before its SELECT (tests commit changes there that the read
        #: cannot see, on another connection).
        self.before_select: Callable[[SnapshotJob], Awaitable[None]] | None = None
        self.strategy: Strategy | None = None  # the last read's, for tests and the log
        #: What the bracketing LW's fence waits for right now ("binlog reader", "engine commits"), else None.
        self.waiting: str | None = None

    async def _connection(self) -> aiomysql.Connection:
        if self._conn is None or self._conn.closed:
            self._conn = await open_connection(self._server.conn.settings(), self._server.tls)
        return self._conn

    async def _rows(self, conn: aiomysql.Connection, sql: str, args: Any = None) -> list[Any]:
        async with conn.cursor() as cur:
            await cur.execute(sql, args)
            return list(await cur.fetchall())

    async def read(self, job: SnapshotJob, limit: int) -> Chunk:
        src = self._server
        strategy = choose_strategy(src.flavor, src.config.source.mysql.incremental_watermark)
        if src.flavor == "mysql" and not src.gtid_mode:
            raise SourceFatal(f"incremental snapshot of {job.table}: on MySQL the low watermark's fence needs GTIDs "
                              "(gtid_mode = ON, enforce_gtid_consistency = ON); see docs/mysql.md")
        if strategy != self.strategy:
            log.info("incremental snapshot low watermark", strategy=strategy, flavor=src.flavor,
                     setting=src.config.source.mysql.incremental_watermark,
                     statement=binlog_status_statement(src.flavor, src.version))
        self.strategy = strategy
        timeout = src.config.runtime.source_read_timeout_s
        conn = await self._connection()
        async with asyncio.timeout(timeout):
            loaded, pk = await load_table_schema(conn, job.table)
        if not pk:
            raise SourceFatal(f"incremental snapshot of {job.table}: the table has no primary key, so it cannot be "
                              "read in key order while it streams")
        # The stream's schema of the table when it has one (its history), else the catalog's, with the column ids
        # the stream's first table map will give it (1..n in column order).
        schema = src.history.latest(job.table) or with_ids(loaded, None, src.history.next_id(job.table))
        names = schema.column_names
        convs = [snapshot_converter(c.source_type) for c in schema.columns]
        select = f"SELECT {', '.join(select_expr(c) for c in schema.columns)} FROM " \
                 f"{quote_ident(job.table.schema)}.{quote_ident(job.table.name)}"
        key_types = [schema.column(k).source_type for k in pk]
        after = None
        if job.last_key is not None:
            by_name = dict(zip(schema.key, key_from_json(job.last_key), strict=True))
            after = tuple(by_name[k] for k in pk)
        where, params = after_clause(pk, key_types, after)
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
        try:
            if strategy == "exact":
                lw = await self._exact_lw(conn, timeout)
            else:
                lw = await self._bracketing_lw(conn, timeout)
            if self.before_select is not None:
                await self.before_select(job)
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
                end = await self._binlog_end(conn)
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
        hw = src.stamp(MySqlPosition.at(end.file, end.pos, 0, end.gtid))
        return Chunk(job, schema, data, key_text, last_key, lw, hw, rows < limit, _never)

    async def _binlog_end(self, conn: aiomysql.Connection) -> Watermark:
        """The binlog's end and the GTID set of the transactions before it (MariaDB: ``BINLOG_GTID_POS`` of it;
        MySQL: the status row's ``Executed_Gtid_Set``, read by the server just before the position)."""
        src = self._server
        async with conn.cursor(aiomysql.DictCursor) as dcur:
            await dcur.execute(binlog_status_statement(src.flavor, src.version))
            end = parse_binlog_status(await dcur.fetchone())
        if src.flavor == "mariadb":
            gtid = await self._rows(conn, "SELECT BINLOG_GTID_POS(%s, %s)", (end.file, end.pos))
            end.gtid = str(gtid[0][0] or "")
        return end

    async def _exact_lw(self, conn: aiomysql.Connection, timeout: float) -> MySqlPosition:
        """MariaDB: open the read's snapshot; its ``binlog_snapshot_position`` is the LW. The stream may have
        delivered a transaction whose engine commit had not run when the snapshot began (the binlog is sent before
        the engine commits): it is not in the window (recording began after it) and the read did not see it, so
        the snapshot is taken again until its position is past everything delivered."""
        src = self._server
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            delivered = self._coord.last
            async with asyncio.timeout(timeout):
                await self._rows(conn, "START TRANSACTION WITH CONSISTENT SNAPSHOT")
                file, pos = parse_snapshot_status(await self._rows(conn, "SHOW STATUS LIKE 'binlog_snapshot_%'"))
            lw = src.stamp(MySqlPosition.at(file, pos, 0))
            if not isinstance(delivered, MySqlPosition) or lw >= delivered:
                return lw
            async with asyncio.timeout(timeout):
                await self._rows(conn, "COMMIT")
            if loop.time() > deadline:
                raise SourceError(f"{src.where}: the read's snapshot (binlog {file}:{pos}) is still not past the last "
                                  f"delivered position {delivered} after {timeout:g} s (the engine commit of a "
                                  "delivered transaction has not run); the chunk is read again")
            await asyncio.sleep(FENCE_POLL_S)

    async def _bracketing_lw(self, conn: aiomysql.Connection, timeout: float) -> MySqlPosition:
        """The binlog's end P before the read, the fence, then the read's snapshot: P is the LW.

        The fence makes every transaction before P visible to the snapshot: a transaction is written to the binlog
        (and counted in P) before its engine commit, so one just before P may not be committed yet. The binlog
        reader reading up to P gives the GTIDs of every transaction before P; the server's committed GTID set
        holding them all says their engine commits ran. Each wait is bounded by runtime.source_read_timeout_s."""
        src = self._server
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        async with asyncio.timeout(timeout):
            p = await self._binlog_end(conn)
        lw = src.stamp(MySqlPosition.at(p.file, p.pos, 0))
        try:
            self.waiting = "binlog reader"
            read = self._read_gtids(lw, deadline)
            while read is None:
                await asyncio.sleep(FENCE_POLL_S)
                read = self._read_gtids(lw, deadline)
            self.waiting = "engine commits"
            while True:
                async with asyncio.timeout(timeout):
                    committed = await self._committed(conn)
                if covers(committed, read):
                    break
                if loop.time() > deadline:
                    raise SourceError(f"{src.where}: the binlog holds transactions whose commit has not completed "
                                      f"after {timeout:g} s (committed GTIDs {committed}, binlog read up to {read}); "
                                      "the chunk is read again (runtime.source_read_timeout_s bounds this wait)")
                await asyncio.sleep(FENCE_POLL_S)
        finally:
            self.waiting = None
        async with asyncio.timeout(timeout):
            await self._rows(conn, "START TRANSACTION WITH CONSISTENT SNAPSHOT")
        return lw

    def _read_gtids(self, at: MySqlPosition, deadline: float) -> GtidSet | None:
        """The GTID set of every transaction the binlog reader has read, once it has read up to ``at``; None until
        then (an idle binlog: the server's heartbeat, every second, tells the reader where the binlog ends)."""
        src = self._server
        reader = self._stream.reader
        upto = reader.read_upto if reader is not None else None
        if upto is not None and (MySqlPosition.at(*upto).file_index, upto[1]) >= (at.file_index, at.pos):
            # read after read_upto: the set only grows, so it holds every transaction before ``at``
            return reader.decoder.gtids_read()  # type: ignore[union-attr]
        if asyncio.get_running_loop().time() > deadline:
            raise SourceError(f"{src.where}: the binlog stream has not read up to the chunk's low watermark "
                              f"{at.file}:{at.pos} (read up to {upto}); the chunk is read again")
        return None

    async def _committed(self, conn: aiomysql.Connection) -> GtidSet:
        """The transactions whose engine commit has run. MySQL adds a commit group's GTIDs to ``gtid_executed``
        after the engine commits of the group (with ``binlog_order_commits``, the default). MariaDB's
        ``binlog_snapshot_position`` outside a transaction is the binlog position of its last engine commit
        (``commit_ordered``, in binlog order): the GTID position there."""
        src = self._server
        if src.flavor == "mysql":
            rows = await self._rows(conn, "SELECT @@GLOBAL.gtid_executed, @@GLOBAL.binlog_order_commits")
            if str(rows[0][1]) not in ("1", "ON"):
                raise SourceFatal(f"{src.where}: binlog_order_commits is OFF, so gtid_executed may name transactions "
                                  "before their engine commit and an incremental snapshot's low watermark cannot be "
                                  "fenced: SET GLOBAL binlog_order_commits = ON (the default; also in my.cnf)")
            return parse_gtid_set("mysql", str(rows[0][0] or ""))
        file, pos = parse_snapshot_status(await self._rows(conn, "SHOW STATUS LIKE 'binlog_snapshot_%'"))
        gtid = await self._rows(conn, "SELECT BINLOG_GTID_POS(%s, %s)", (file, pos))
        return parse_gtid_set("mariadb", str(gtid[0][0] or ""))

    async def prepare(self, job: SnapshotJob) -> None:
        """Nothing to wait for: the binlog carries every transaction that commits after the LW, whenever it began."""

    def poke(self, chunk: Chunk) -> None:
        """The binlog may be idle: once the reader has read up to the HW, deliver the chunk with a mark there."""
        stream = self._stream
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
            return f"{self._server.where}: {exc}"
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
