"""Read the captured tables from the source in one consistent snapshot, for `cdcd verify`.

Each column is read the way the source lands it: driver-native where the
driver's Python value is the landed value, else in PostgreSQL's text form
(with the sources' session settings) so that strings compare with strings.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from cdcd.config import Config
from cdcd.errors import CdcdError, SourceError
from cdcd.events import TableId

#: The PostgreSQL source's session settings: its text forms are what it lands.
PG_SESSION = {
    "TimeZone": "UTC",
    "DateStyle": "ISO, YMD",
    "IntervalStyle": "iso_8601",
    "extra_float_digits": "3",
    "bytea_output": "hex",
}
#: The first characters of a statement that a verify error names (a checksum query is long).
STATEMENT_SHOWN = 120
_PG_NATIVE = {"bool", "int2", "int4", "int8", "oid", "float4", "float8", "text", "varchar", "bpchar", "bytea",
              "date", "time", "timestamp", "timestamptz", "json", "jsonb", "name"}


@dataclass(slots=True)
class SourceColumn:
    name: str
    float32: bool
    is_json: bool


@dataclass(slots=True)
class SourceTable:
    table: TableId
    columns: list[SourceColumn]
    key: list[str]
    rows: list[tuple[Any, ...]]


class BoundedCursor:
    """A MariaDB/MySQL cursor whose every statement and fetch finishes within ``timeout_s``
    (runtime.source_read_timeout_s, as asyncpg's command_timeout bounds verify's PostgreSQL queries): a silent
    server or a query slower than the limit ends verify with a ``SourceError`` naming the statement (the
    connection is then unusable: a read was cut short)."""

    def __init__(self, cur: Any, timeout_s: float) -> None:
        self.cur, self.timeout_s = cur, timeout_s
        self._statement = ""

    async def execute(self, statement: str, args: Any = None) -> None:
        self._statement = statement
        await self._within(self.cur.execute(statement, args))

    async def fetchall(self) -> list[tuple[Any, ...]]:
        return list(await self._within(self.cur.fetchall()))

    async def fetchone(self) -> tuple[Any, ...] | None:
        row: tuple[Any, ...] | None = await self._within(self.cur.fetchone())
        return row

    async def _within(self, call: Awaitable[Any]) -> Any:
        try:
            async with asyncio.timeout(self.timeout_s):
                return await call
        except TimeoutError:
            shown = " ".join(self._statement.split())
            shown = shown if len(shown) <= STATEMENT_SHOWN else shown[:STATEMENT_SHOWN] + "..."
            raise SourceError(f"verify: {shown!r} did not finish within runtime.source_read_timeout_s "
                              f"({self.timeout_s:g} s): the server did not answer (check that it is up and "
                              "reachable) or the query takes longer on this table (raise the setting); then run "
                              "verify again") from None


def _qi(name: str, quote: str) -> str:
    return quote + name.replace(quote, quote * 2) + quote


async def read_postgres(config: Config, tables: list[TableId] | None = None) -> list[SourceTable]:
    # the source's own connection code: its TLS (source.sslmode, source.sslrootcert), timeouts, session settings
    from cdcd.sources.postgres.connection import connect_params, connect_sql

    src = config.source
    params = connect_params(config, application_name="cdcd-verify")
    try:
        conn = await connect_sql(params)
    except SourceError as exc:
        raise SourceError(f"verify: {exc}") from exc
    try:
        for name, value in PG_SESSION.items():  # what verify's text forms rely on, whatever the source sets
            await conn.execute(f"SELECT set_config('{name}', '{value}', false)")

        out = []
        async with conn.transaction(isolation="repeatable_read", readonly=True):
            for t in src.table_ids if tables is None else tables:
                out.append(await _pg_table(conn, t))
        return out
    finally:
        await conn.close()


@dataclass(slots=True)
class TableShape:
    """A source table as verify reads it: its columns, key, the SELECT list that reads each column the way
    the source lands it, and each column's canonical text for the range checksums (None: it has none)."""

    table: TableId
    quoted: str
    columns: list[SourceColumn]
    key: list[str]
    select: list[str]
    canonical: list[str | None]
    temporal: list[bool]


async def pg_shape(conn: Any, t: TableId) -> TableShape:
    from cdcd.sources.postgres.checksums import canonical

    quoted = f"{_qi(t.schema, chr(34))}.{_qi(t.name, chr(34))}"
    cols = await conn.fetch(
        """SELECT a.attname, ty.typname, a.atttypmod, ety.typname AS elem
             FROM pg_attribute a JOIN pg_type ty ON ty.oid = a.atttypid
             LEFT JOIN pg_type ety ON ety.oid = ty.typelem AND ty.typcategory = 'A'
            WHERE a.attrelid = $1::regclass AND a.attnum > 0 AND NOT a.attisdropped ORDER BY a.attnum""",
        quoted,
    )
    if not cols:
        raise SourceError(f"verify: table {t} does not exist in the source")
    key = [r[0] for r in await conn.fetch(
        """SELECT a.attname FROM pg_index i JOIN pg_attribute a ON a.attrelid = i.indrelid
            AND a.attnum = ANY(i.indkey) WHERE i.indrelid = $1::regclass AND i.indisprimary""",
        quoted,
    )]
    exprs, columns, canon = [], [], []
    for name, typ, typmod, elem in cols:
        q = _qi(name, '"')
        base = elem or typ
        numeric_native = base == "numeric" and typmod > 0 and ((typmod - 4) >> 16) <= 38
        if base in _PG_NATIVE or numeric_native:
            exprs.append(q)
        else:
            # format('%s') is the type's output function, what the source lands; ::text is not the same for
            # every type (inet's text() adds the netmask of a host address: '::1/128' where '::1' landed).
            exprs.append(f"{q}::text[]" if elem else f"CASE WHEN {q} IS NULL THEN NULL ELSE format('%s', {q}) END")
        columns.append(SourceColumn(name, base == "float4", base in ("json", "jsonb")))
        canon.append(None if elem else canonical(name, typ, typmod))
    return TableShape(t, quoted, columns, key or [c.name for c in columns], exprs, canon, [False] * len(cols))


def pg_rows(rows: list[Any]) -> list[tuple[Any, ...]]:
    # NaN and ±Infinity in a numeric(p,s) column land as NULL (docs/postgres.md): compare them as NULL.
    return [tuple(None if isinstance(v, Decimal) and not v.is_finite() else v for v in r) for r in rows]


async def _pg_table(conn: Any, t: TableId) -> SourceTable:
    shape = await pg_shape(conn, t)
    rows = pg_rows(await conn.fetch(f"SELECT {', '.join(shape.select)} FROM {shape.quoted}"))
    return SourceTable(t, shape.columns, shape.key, rows)


async def read_mysql(config: Config, tables: list[TableId] | None = None) -> list[SourceTable]:
    # the source's own connection code: its TLS (source.sslmode, source.sslrootcert), UTC session
    from cdcd.sources.mysql.connection import connect_params

    src = config.source
    try:
        conn = await connect_params(config).open()
    except CdcdError as exc:
        raise SourceError(f"verify: cannot connect to {src.kind} {src.host}:{src.effective_port}: {exc}") from exc
    try:
        async with conn.cursor() as raw:
            cur = BoundedCursor(raw, config.runtime.source_read_timeout_s)
            await cur.execute("START TRANSACTION WITH CONSISTENT SNAPSHOT")
            out = [await _my_table(cur, t) for t in (src.table_ids if tables is None else tables)]
            await cur.execute("COMMIT")
        return out
    finally:
        conn.close()


async def my_shape(cur: Any, t: TableId) -> TableShape:
    from cdcd.sources.mysql.checksums import canonical

    await cur.execute(
        """SELECT COLUMN_NAME, DATA_TYPE, COLUMN_KEY FROM information_schema.COLUMNS
            WHERE TABLE_SCHEMA = %s AND TABLE_NAME = %s ORDER BY ORDINAL_POSITION""",
        (t.schema, t.name),
    )
    cols = list(await cur.fetchall())
    if not cols:
        raise SourceError(f"verify: table {t} does not exist in the source")
    columns = [SourceColumn(c[0], c[1].lower() == "float", c[1].lower() == "json") for c in cols]
    key = [c[0] for c in cols if c[2] == "PRI"]
    # FLOAT as DOUBLE: the text protocol rounds it to 6 digits, the source lands it exactly.
    select = [f"({_qi(c.name, '`')} * 1E0)" if c.float32 else _qi(c.name, "`") for c in columns]
    temporal = [c[1].lower() in ("date", "datetime", "timestamp") for c in cols]
    return TableShape(t, f"{_qi(t.schema, '`')}.{_qi(t.name, '`')}", columns, key or [c.name for c in columns],
                      select, [canonical(c[0], c[1]) for c in cols], temporal)


def my_rows(shape: TableShape, rows: list[Any]) -> list[tuple[Any, ...]]:
    # Zero dates come as text and land as NULL (docs/mysql.md): compare them as NULL.
    return [tuple(None if z and isinstance(v, str) else v for v, z in zip(r, shape.temporal, strict=True))
            for r in rows]


async def _my_table(cur: Any, t: TableId) -> SourceTable:
    shape = await my_shape(cur, t)
    await cur.execute(f"SELECT {', '.join(shape.select)} FROM {shape.quoted}")
    return SourceTable(t, shape.columns, shape.key, my_rows(shape, list(await cur.fetchall())))


async def read_source(config: Config, tables: list[TableId] | None = None) -> list[SourceTable]:
    """The tables (default: every captured table) read whole, in one snapshot transaction."""
    if config.source.kind == "postgres":
        return await read_postgres(config, tables)
    return await read_mysql(config, tables)
