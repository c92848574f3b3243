"""PostgreSQL's part of incremental snapshots: watermarks and key-ordered chunk reads, writing nothing.

Per chunk (``PgChunkReader.read``), on two connections of its own:

1. the low watermark (LW): a non-transactional logical message (``pg_logical_emit_message(false, ...)``, the
   heartbeat's prefix), which travels the slot like a heartbeat;
2. transactions committed in the commit log but still listed as running (a commit waiting for synchronous
   replication, or caught between its WAL flush and leaving the process array) are waited out, so every
   transaction the stream delivered before the coordinator began recording is visible to the read;
3. ``BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY``; ``pg_current_snapshot()`` (the read's snapshot: its
   running-transaction list and xmax say exactly which transactions the read does not see); the chunk as one
   ``COPY (SELECT ... WHERE key > last [AND where] ORDER BY key LIMIT n) TO STDOUT``; the job's keys to read
   again (``SnapshotJob.reread``: a change in an earlier window did not carry an unchanged TOAST value) as one
   ``COPY (SELECT ... WHERE key IN (...) AND NOT <the chunk's range>) TO STDOUT``; ``COMMIT``;
4. the high watermark (HW): another logical message.

The chunk's rows are parsed with the snapshot's ``CopyDecoder`` (the same landed values as the initial snapshot).

Before the first chunk of a table that joined the publication (a reload or a restart added it, a re-created table
was published again) or of a snapshot resumed after a restart (``PgChunkReader.prepare``): pgoutput never sends
the changes a transaction made to a table before the table joined the publication, even when it commits later,
and a chunk read cannot see them while the transaction is open. So the first LW waits until every transaction
in progress when the job starts (``pg_current_snapshot()``'s list, which holds every transaction open before the
table joined and still open) has ended; the chunk reads after it see what they committed. The wait is bounded
(``source.postgres.open_transactions_wait_s``, default 600 s): past it the job fails, naming the transactions,
and ``cdcd snapshot`` starts it again.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

import asyncpg
import structlog

from cdcd.capture.incremental import Chunk, SnapshotJob
from cdcd.errors import SourceError, SourceFatal
from cdcd.events import TableId
from cdcd.positions import PgPosition
from cdcd.sources.postgres import catalog
from cdcd.sources.postgres.catalog import escaped_literal, quote_ident, quote_table
from cdcd.sources.postgres.copytext import CopyDecoder, last_row_fields
from cdcd.sources.postgres.shape import TableShape
from cdcd.sources.postgres.tables import PgTables
from cdcd.sources.postgres.types import key_text

log = structlog.get_logger("cdcd.source.postgres")

#: How often the lag wait (step 2) looks again.
_LAG_POLL_S = 0.01
_MASK = 0xFFFFFFFF
#: The longest the first chunk of a table that joined the publication waits for the transactions open when its
#: job started (docs/postgres.md, "Incremental snapshots"); past it the job fails, naming them.
#: How often that wait looks again, and how often it logs the transactions it waits for.
_OPEN_TX_POLL_S = 0.2
_OPEN_TX_LOG_S = 30.0
_OPEN = ("SELECT coalesce(array_agg(x::text ORDER BY x), '{}') FROM unnest($1::text[]::xid8[]) x "
         "WHERE pg_xact_status(x) = 'in progress'")
#: Who holds each open transaction: its session (pg_stat_activity shows another user's backend_xid only to a role
#: with pg_read_all_stats) or a prepared transaction.
_HOLDERS = """
SELECT x::text AS xid, a.pid, a.usename, a.application_name, a.state, a.xact_start::text AS since,
       p.gid, p.prepared::text AS prepared
FROM unnest($1::text[]::xid8[]) x
LEFT JOIN pg_stat_activity a ON a.backend_xid::text = (x::text::bigint & 4294967295)::text
LEFT JOIN pg_prepared_xacts p ON p.transaction::text = (x::text::bigint & 4294967295)::text
ORDER BY x
"""


def _key_row(tables: PgTables, job: SnapshotJob, values: list[Any]) -> str:
    """A row constructor of the key's columns, each value (the server's text) cast to its column's type."""
    info = tables.infos[job.table]
    types = {c.name: c.sql_type for c in info.columns}
    return "(" + ", ".join("NULL" if v is None else f"CAST({escaped_literal(v)} AS {types[k]})"
                           for k, v in zip(info.key, values, strict=True)) + ")"


def _range(tables: PgTables, job: SnapshotJob, until: list[Any] | None) -> list[str]:
    """The conditions of the chunk's range: after ``job.last_key``, up to ``until`` (None: to the end), in
    ``job.where``."""
    cols = ", ".join(quote_ident(k) for k in tables.infos[job.table].key)
    conds: list[str] = []
    if job.last_key is not None:
        conds.append(f"({cols}) > {_key_row(tables, job, job.last_key)}")
    if until is not None:
        conds.append(f"({cols}) <= {_key_row(tables, job, until)}")
    if job.where:
        conds.append(f"({job.where})")
    return conds


def chunk_query(tables: PgTables, job: SnapshotJob, limit: int, shape: TableShape) -> str:
    """The chunk's rows, with the columns of ``shape`` (the one the chunk's rows are converted with)."""
    info = tables.infos[job.table]
    cols = ", ".join(quote_ident(k) for k in info.key)
    conds = _range(tables, job, None)
    where = f" WHERE {' AND '.join(conds)}" if conds else ""
    select = ", ".join(quote_ident(c.name) for c in shape.schema.columns)
    return f"SELECT {select} FROM {quote_table(info.table)}{where} ORDER BY {cols} LIMIT {limit}"


def reread_query(tables: PgTables, job: SnapshotJob, keys: list[list[Any]], until: list[Any] | None,
                 shape: TableShape) -> str:
    """The rows of ``keys`` outside the chunk's range (which ends at ``until``; None: the table's end): the
    chunk read them already, in the same snapshot."""
    info = tables.infos[job.table]
    cols = ", ".join(quote_ident(k) for k in info.key)
    listed = ", ".join(_key_row(tables, job, k) for k in keys)
    conds = [f"({cols}) IN ({listed})"]
    chunk = _range(tables, job, until)
    if chunk:
        conds.append(f"NOT (({' AND '.join(chunk)}) IS TRUE)")
    else:  # the range is the whole table: every listed row is in the chunk
        conds.append("false")
    select = ", ".join(quote_ident(c.name) for c in shape.schema.columns)
    return f"SELECT {select} FROM {quote_table(info.table)} WHERE {' AND '.join(conds)}"


def invisible_to(snapshot: str) -> Callable[[str | None], bool]:
    """From ``pg_current_snapshot()``'s text (``xmin:xmax:xip,...``): is a streamed transaction id (32-bit, as
    pgoutput sends it) one the snapshot does not see? Compared modulo 2^32, as PostgreSQL compares xids."""
    _xmin, xmax, xip = snapshot.split(":")
    top = int(xmax) & _MASK
    running = {int(x) & _MASK for x in xip.split(",") if x}

    def invisible(tx: str | None) -> bool:
        if tx is None:
            return False
        x = int(tx) & _MASK
        return x in running or ((x - top) & _MASK) < 0x80000000

    return invisible


class PgChunkReader:
    """``cdcd.capture.incremental.ChunkReader`` for PostgreSQL."""

    def __init__(self, tables: PgTables, lag_timeout_s: float) -> None:
        self._t = tables
        self._lag_timeout_s = lag_timeout_s
        self._read_conn: Any = None
        self._mark_conn: Any = None
        #: Called between the chunk's read and its HW (tests change the chunk's rows there, on the real server).
        self.after_read: Callable[[SnapshotJob], Awaitable[None]] | None = None
        #: Tables that joined the publication in this process (a reload, a re-created table published again) or
        #: whose snapshot the checkpoint holds as started (a restart may have added them): their next job's first
        #: chunk waits for the transactions open when it starts (``prepare``).
        self.joined: set[TableId] = set()
        self.open_tx_limit_s = 600.0  # source.postgres.open_transactions_wait_s
        #: The wait ``prepare`` is in, for /status (``incremental_waiting``); None: none.
        self.waiting: dict[str, Any] | None = None

    @staticmethod
    def key_json(schema: Any, key: tuple[Any, ...]) -> list[Any]:
        """A landed key as the server's text of each column (the form of ``last_key``): a re-read key."""
        return [None if v is None else key_text(v) for v in key]

    async def _conns(self) -> tuple[Any, Any]:
        for name in ("_read_conn", "_mark_conn"):
            conn = getattr(self, name)
            if conn is None or conn.is_closed():
                setattr(self, name, await catalog.connect_sql(self._t.params))
        return self._read_conn, self._mark_conn

    async def read(self, job: SnapshotJob, limit: int) -> Chunk:
        info = self._t.infos.get(job.table)
        if info is None or not info.key:
            raise SourceFatal(f"incremental snapshot of {job.table}: the table has no primary key or replica "
                              "identity index, so it cannot be read in key order while it streams")
        shape = self._t.shapes[job.table]
        conn, marks = await self._conns()
        lw = await catalog.emit_heartbeat(marks)
        await self._wait_committing(marks)
        pieces: list[bytes] = []
        extra: list[bytes] = []
        names = shape.schema.column_names
        key_fields = [names.index(k) for k in info.key]
        reread = list(job.reread.values())[:limit]

        async def collect(data: bytes) -> None:
            pieces.append(data)

        async def collect_extra(data: bytes) -> None:
            extra.append(data)

        await conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
        try:
            snapshot = str(await conn.fetchval("SELECT pg_current_snapshot()::text"))
            await conn.copy_from_query(chunk_query(self._t, job, limit, shape), output=collect)
            rows = sum(p.count(b"\n") for p in pieces)
            last_key = last_row_fields(pieces, key_fields) if rows else None
            if reread:  # same snapshot: the window rule holds for them as for the chunk's rows
                until = last_key if rows >= limit else None
                await conn.copy_from_query(reread_query(self._t, job, reread, until, shape),
                                           output=collect_extra)
        finally:
            with contextlib.suppress(Exception):
                await conn.execute("ROLLBACK")  # read only: nothing to keep
        if self.after_read is not None:
            await self.after_read(job)
        hw = await catalog.emit_heartbeat(marks)
        found = sum(p.count(b"\n") for p in extra)
        decoder = CopyDecoder(shape, self._t.warnings, key_fields)
        data, texts = await asyncio.to_thread(decoder.decode_keyed, pieces + extra, rows + found)
        return Chunk(job, shape.schema, data, texts, last_key, PgPosition(lw, 0), PgPosition(hw, 0),
                     rows < limit, invisible_to(snapshot), reread)

    async def prepare(self, job: SnapshotJob) -> None:
        """Before the first chunk of a table in ``joined``: wait until every transaction in progress now has
        ended (module docstring). Bounded by ``open_tx_limit_s``: then a ``SourceFatal`` fails the job."""
        if job.table not in self.joined:
            return
        _conn, marks = await self._conns()
        xids = list(await marks.fetchval(
            "SELECT coalesce(array_agg(x::text ORDER BY x), '{}') FROM pg_snapshot_xip(pg_current_snapshot()) x"))
        open_ = list(await marks.fetchval(_OPEN, xids)) if xids else []
        loop = asyncio.get_running_loop()
        start = loop.time()
        logged: float | None = None
        waits = bool(open_)
        try:
            while open_:
                holders = await self._holders(marks, open_)
                waited = loop.time() - start
                self.waiting = {"table": str(job.table), "transactions": holders, "waited_s": round(waited, 1),
                                "limit_s": self.open_tx_limit_s}
                if waited >= self.open_tx_limit_s:
                    raise SourceFatal(
                        f"incremental snapshot of {job.table} on {self._t.params.where}: {len(holders)} transaction(s) "
                        f"open when the table joined the publication are still in progress after "
                        f"{self.open_tx_limit_s:g}s: {'; '.join(holders)}. pgoutput never streams what they wrote to "
                        "the table before it joined, so its snapshot cannot start before they end. Fix: end them "
                        "(COMMIT or ROLLBACK in their session, SELECT pg_terminate_backend(pid), or COMMIT PREPARED / "
                        f"ROLLBACK PREPARED 'gid'), then snapshot the table again: cdcd snapshot -c CONFIG {job.table}")
                if logged is None or loop.time() - logged >= _OPEN_TX_LOG_S:
                    (log.info if logged is None else log.warning)(
                        "incremental snapshot waits for transactions open when the table joined the publication",
                        table=str(job.table), transactions=holders, waited_s=round(waited, 1),
                        limit_s=self.open_tx_limit_s)
                    logged = loop.time()
                await asyncio.sleep(_OPEN_TX_POLL_S)
                open_ = list(await marks.fetchval(_OPEN, open_))
        finally:
            self.waiting = None
        if waits:
            log.info("transactions open when the table joined the publication ended; its snapshot starts",
                     table=str(job.table), waited_s=round(loop.time() - start, 1))
        self.joined.discard(job.table)

    @staticmethod
    async def _holders(conn: Any, xids: list[str]) -> list[str]:
        """Each open transaction of ``xids`` with who holds it, for the log, /status and the error."""
        out: list[str] = []
        for r in await conn.fetch(_HOLDERS, xids):
            if r["gid"] is not None:
                out.append(f"xid {r['xid']} (prepared transaction {r['gid']!r} since {r['prepared']})")
            elif r["pid"] is not None:
                out.append(f"xid {r['xid']} (pid {r['pid']}, user {r['usename']}, application "
                           f"{r['application_name']!r}, {r['state']} since {r['since']})")
            else:
                out.append(f"xid {r['xid']} (its session is not visible to this user: grant it pg_read_all_stats)")
        return out

    async def _wait_committing(self, conn: Any) -> None:
        """Wait until no transaction is both committed in the commit log and still listed as running."""
        query = ("SELECT coalesce(array_agg(x::text), '{}') FROM pg_snapshot_xip(pg_current_snapshot()) x "
                 "WHERE pg_xact_status(x) = 'committed'")
        waiting = set(await conn.fetchval(query))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._lag_timeout_s
        while waiting:
            if loop.time() > deadline:
                raise SourceError(
                    f"incremental snapshot on {self._t.params.where}: transactions {sorted(waiting)} committed but "
                    f"stayed listed as running for {self._lag_timeout_s:g}s (a synchronous standby not "
                    "answering?); the chunk is read again later")
            await asyncio.sleep(_LAG_POLL_S)
            still = set(await conn.fetchval(
                "SELECT coalesce(array_agg(x::text), '{}') FROM pg_snapshot_xip(pg_current_snapshot()) x"))
            waiting &= still

    def poke(self, chunk: Chunk) -> None:
        """Nothing to do: the HW is a logical message, which the stream delivers even when idle."""

    def job_error(self, exc: BaseException) -> str | None:
        # SQL the server rejects (class 42: a bad WHERE, a column or table gone; class 22: a bad value in it):
        # the request's fault; reading again cannot help.
        if isinstance(exc, asyncpg.PostgresError) and str(exc.sqlstate or "")[:2] in ("42", "22"):
            return f"{self._t.params.where}: {exc}"
        if isinstance(exc, SourceFatal):
            return str(exc)
        return None

    async def close(self) -> None:
        for name in ("_read_conn", "_mark_conn"):
            conn = getattr(self, name)
            setattr(self, name, None)
            if conn is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(conn.close(), 5)

    def terminate(self) -> None:
        for name in ("_read_conn", "_mark_conn"):
            conn = getattr(self, name)
            setattr(self, name, None)
            if conn is not None:
                with contextlib.suppress(Exception):
                    conn.terminate()
