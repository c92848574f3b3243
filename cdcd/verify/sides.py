"""The source's side of the range checksums: one open snapshot transaction, per table its shape, row count,
bucket checksums (computed in the database) and the rows of chosen buckets.

Everything verify reads of the source comes from that one transaction, so the checksums and the rows it
compares later are of the same moment.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, Protocol

import pymysql
import structlog

from cdcd.config import Config
from cdcd.errors import CdcdError, SourceError
from cdcd.events import TableId
from cdcd.positions import MySqlPosition, PgPosition, Position, parse_lsn
from cdcd.sources.mysql.gtid import GtidSet, MariaGtidSet, parse_gtid_set
from cdcd.verify.source import PG_SESSION, BoundedCursor, TableShape, my_rows, my_shape, pg_rows, pg_shape

Digests = dict[int, tuple[int, int, int]]
log = structlog.get_logger("cdcd.verify")


class SourceSide(Protocol):
    #: where the source stood when the snapshot began: ``before`` is at or below every change the snapshot
    #: may lack, ``at`` at or above every change it holds (None: the source does not tell)
    before: Position | None
    at: Position | None

    def holds_snapshot(self, checkpoint: Position) -> bool:
        """Whether a checkpoint at ``checkpoint`` holds every change the snapshot holds, known by more than the
        order of positions (``cdcd.verify.settle`` asks it when the checkpoint is below ``at``)."""
        ...

    async def shape(self, t: TableId) -> TableShape: ...
    async def count(self, shape: TableShape) -> int: ...
    async def digests(self, shape: TableShape, buckets: int) -> Digests: ...
    async def rows(self, shape: TableShape, buckets: int, chosen: list[int]) -> list[tuple[Any, ...]]: ...
    async def all_rows(self, shape: TableShape) -> list[tuple[Any, ...]]: ...


def _key_exprs(shape: TableShape) -> list[str]:
    names = [c.name for c in shape.columns]
    exprs = [shape.canonical[names.index(k)] for k in shape.key]
    if any(e is None for e in exprs):
        raise ValueError(f"{shape.table}: a key column has no canonical text")  # callers check first
    return [e for e in exprs if e is not None]


def _all_exprs(shape: TableShape) -> list[str]:
    return [e for e in shape.canonical if e is not None]


class PgSide:
    def __init__(self, conn: Any, before: Position | None = None, at: Position | None = None) -> None:
        self.conn, self.before, self.at = conn, before, at

    def holds_snapshot(self, checkpoint: Position) -> bool:
        return False  # the daemon's checkpoint follows the server's WAL position when idle (its keepalives)

    async def shape(self, t: TableId) -> TableShape:
        return await pg_shape(self.conn, t)

    async def count(self, shape: TableShape) -> int:
        return int(await self.conn.fetchval(f"SELECT count(*) FROM {shape.quoted}"))

    async def digests(self, shape: TableShape, buckets: int) -> Digests:
        from cdcd.sources.postgres.checksums import digest_sql

        rows = await self.conn.fetch(digest_sql(shape.quoted, _all_exprs(shape), _key_exprs(shape), buckets))
        return {int(r[0]): (int(r[1]), int(r[2]), int(r[3])) for r in rows}

    async def rows(self, shape: TableShape, buckets: int, chosen: list[int]) -> list[tuple[Any, ...]]:
        from cdcd.sources.postgres.checksums import bucket_expr

        sql = (f"SELECT {', '.join(shape.select)} FROM {shape.quoted} "
               f"WHERE {bucket_expr(_key_exprs(shape), buckets)} = ANY($1::int[])")
        return pg_rows(await self.conn.fetch(sql, chosen))

    async def all_rows(self, shape: TableShape) -> list[tuple[Any, ...]]:
        return pg_rows(await self.conn.fetch(f"SELECT {', '.join(shape.select)} FROM {shape.quoted}"))


class MySide:
    def __init__(self, cur: BoundedCursor, before: Position | None = None, at: Position | None = None,
                 gtids: GtidSet | None = None) -> None:
        self.cur, self.before, self.at = cur, before, at
        self.gtids = gtids  # the server's binlogged GTID set, read once the snapshot began (None: not known)

    def holds_snapshot(self, checkpoint: Position) -> bool:
        """By GTIDs: a binlog position cannot tell, since the checkpoint of a delivered transaction stands at its
        start (``MySqlPosition``) and ``at`` is the binlog's end, so on an idle source it stays below ``at``. A
        checkpoint's GTID set holds the transactions it completed; when it holds every transaction the server
        had binlogged once the snapshot began, it holds every change the snapshot can see."""
        if self.gtids is None or not isinstance(checkpoint, MySqlPosition) or not checkpoint.gtid:
            return False
        mine = parse_gtid_set("mariadb" if isinstance(self.gtids, MariaGtidSet) else "mysql", checkpoint.gtid)
        return mine.contains(self.gtids)  # type: ignore[arg-type]  # both of the server's flavor

    async def shape(self, t: TableId) -> TableShape:
        return await my_shape(self.cur, t)

    async def count(self, shape: TableShape) -> int:
        await self.cur.execute(f"SELECT COUNT(*) FROM {shape.quoted}")
        return int((await self.cur.fetchall())[0][0])

    async def digests(self, shape: TableShape, buckets: int) -> Digests:
        from cdcd.sources.mysql.checksums import digest_sql

        await self.cur.execute(digest_sql(shape.quoted, _all_exprs(shape), _key_exprs(shape), buckets))
        return {int(r[0]): (int(r[1]), int(r[2]), int(r[3])) for r in await self.cur.fetchall()}

    async def rows(self, shape: TableShape, buckets: int, chosen: list[int]) -> list[tuple[Any, ...]]:
        from cdcd.sources.mysql.checksums import bucket_expr

        await self.cur.execute(f"SELECT {', '.join(shape.select)} FROM {shape.quoted} "
                               f"WHERE {bucket_expr(_key_exprs(shape), buckets)} IN ({', '.join(map(str, chosen))})")
        return my_rows(shape, list(await self.cur.fetchall()))

    async def all_rows(self, shape: TableShape) -> list[tuple[Any, ...]]:
        await self.cur.execute(f"SELECT {', '.join(shape.select)} FROM {shape.quoted}")
        return my_rows(shape, list(await self.cur.fetchall()))


async def _binlog_position(cur: BoundedCursor, statement: str) -> Position | None:
    """The binlog file and offset a statement reports (SHOW MASTER STATUS, or MariaDB's binlog_snapshot_file
    and _position status variables); None without a binlog or the privilege to see it (the epoch is the
    checkpoint's, set by ``cdcd.verify.settle``)."""
    try:
        await cur.execute(statement)
        rows = await cur.fetchall()
    except pymysql.MySQLError as exc:  # no binlog, no privilege: the differences are then not re-checked
        log.warning("verify cannot read the binlog position", statement=statement, error=str(exc))
        return None
    if statement.startswith("SHOW STATUS"):
        found = {str(r[0]).lower(): r[1] for r in rows}
        file, pos = found.get("binlog_snapshot_file"), found.get("binlog_snapshot_position")
    else:
        file, pos = (rows[0][0], rows[0][1]) if rows else (None, None)
    return MySqlPosition.at(str(file), int(pos)) if file and pos is not None else None


async def _binlogged_gtids(cur: BoundedCursor, flavor: str) -> GtidSet | None:
    """The GTID set of every transaction the server has binlogged (MariaDB ``gtid_binlog_pos``; MySQL
    ``gtid_executed`` with ``gtid_mode`` ON); None when it has none, GTIDs are off or the variable is unreadable.
    Read after the snapshot began, it holds every binlogged transaction the snapshot sees (a transaction is
    binlogged before its engine commit)."""
    statement = ("SELECT @@GLOBAL.gtid_binlog_pos, 'ON'" if flavor == "mariadb"
                 else "SELECT @@GLOBAL.gtid_executed, @@GLOBAL.gtid_mode")
    try:
        await cur.execute(statement)
        row = await cur.fetchone()
        gtids = parse_gtid_set(flavor, str(row[0] or "")) if row and str(row[1]).upper() == "ON" else None
    except (pymysql.MySQLError, ValueError) as exc:  # the position order alone decides then
        log.warning("verify cannot read the server's GTID set", statement=statement, error=str(exc))
        return None
    empty = gtids is None or (not gtids.domains if isinstance(gtids, MariaGtidSet) else not gtids.sids)
    return None if empty else gtids


@asynccontextmanager
async def source_side(config: Config) -> AsyncIterator[SourceSide]:
    """The source in one read-only snapshot transaction, with the source's own connection and TLS code."""
    if config.source.kind == "postgres":
        from cdcd.sources.postgres.connection import connect_params, connect_sql

        try:
            conn = await connect_sql(connect_params(config, application_name="cdcd-verify"))
        except SourceError as exc:
            raise SourceError(f"verify: {exc}") from exc
        try:
            for name, value in PG_SESSION.items():  # what verify's text forms rely on, whatever the source sets
                await conn.execute(f"SELECT set_config('{name}', '{value}', false)")
            before = parse_lsn(await conn.fetchval("SELECT pg_current_wal_lsn()::text"))
            async with conn.transaction(isolation="repeatable_read", readonly=True):
                # the transaction's first statement takes its snapshot: every commit it sees is below this LSN
                at = parse_lsn(await conn.fetchval("SELECT pg_current_wal_lsn()::text"))
                yield PgSide(conn, PgPosition(before), PgPosition(at))
        finally:
            await conn.close()
        return
    from cdcd.sources.mysql.connection import connect_params as my_params

    src = config.source
    try:
        myconn = await my_params(config).open()
    except CdcdError as exc:
        raise SourceError(f"verify: cannot connect to {src.kind} {src.host}:{src.effective_port}: {exc}") from exc
    try:
        async with myconn.cursor() as raw:
            cur = BoundedCursor(raw, config.runtime.source_read_timeout_s)
            my_before = await _binlog_position(cur, "SHOW MASTER STATUS")
            await cur.execute("START TRANSACTION WITH CONSISTENT SNAPSHOT")
            # MariaDB names the binlog position of the snapshot itself; MySQL only the position now
            my_at = (await _binlog_position(cur, "SHOW STATUS LIKE 'binlog_snapshot_%'")
                     or await _binlog_position(cur, "SHOW MASTER STATUS"))
            flavor = "mariadb" if config.source.kind == "mariadb" else "mysql"
            gtids = await _binlogged_gtids(cur, flavor)
            yield MySide(cur, my_at if flavor == "mariadb" else my_before, my_at, gtids)
            await cur.execute("COMMIT")
    finally:
        myconn.close()
