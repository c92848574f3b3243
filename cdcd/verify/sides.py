"""The source's side of the range checksums: one open snapshot transaction, per table its shape, row count,
bucket checksums (computed in the database) and the rows of chosen buckets.

Everything verify reads of the source comes from that one transaction, so the checksums and the rows it
compares later are of the same moment.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, Protocol

from cdcd.config import Config
from cdcd.errors import CdcdError, SourceError
from cdcd.events import TableId
from cdcd.verify.source import PG_SESSION, TableShape, my_rows, my_shape, pg_rows, pg_shape

Digests = dict[int, tuple[int, int, int]]


class SourceSide(Protocol):
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
    def __init__(self, conn: Any) -> None:
        self.conn = conn

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
    def __init__(self, cur: Any) -> None:
        self.cur = cur

    async def shape(self, t: TableId) -> TableShape:
        return await my_shape(self.cur, t)

    async def count(self, shape: TableShape) -> int:
        await self.cur.execute(f"SELECT COUNT(*) FROM {shape.quoted}")
        return int((await self.cur.fetchone())[0])

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
            async with conn.transaction(isolation="repeatable_read", readonly=True):
                yield PgSide(conn)
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
        async with myconn.cursor() as cur:
            await cur.execute("START TRANSACTION WITH CONSISTENT SNAPSHOT")
            yield MySide(cur)
            await cur.execute("COMMIT")
    finally:
        myconn.close()
