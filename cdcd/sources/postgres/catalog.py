"""Catalog work over asyncpg: publication and slot management, table and type metadata.

``connect_sql`` lives in ``connection.py`` and is re-exported here.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import asyncpg

from cdcd.errors import SourceFatal
from cdcd.events import TableId
from cdcd.positions import format_lsn, parse_lsn
from cdcd.sources.postgres.connection import connect_sql as connect_sql
from cdcd.sources.postgres.types import PgType, TypeRegistry

HEARTBEAT_PREFIX = "cdcd_heartbeat"


def quote_ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def quote_table(t: TableId) -> str:
    return f"{quote_ident(t.schema)}.{quote_ident(t.name)}"


def quote_literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def escaped_literal(text: str) -> str:
    """A string constant that means the same whatever ``standard_conforming_strings`` says."""
    return "E'" + text.replace("\\", "\\\\").replace("'", "''") + "'"


def keyset_query(select: str, table: TableId, key: Sequence[str], types: dict[str, str],
                 after: Sequence[str] | None, limit: int) -> str:
    """One keyset chunk: the rows after ``after`` (the key's text values, cast to ``types``) in key order."""
    cols = ", ".join(quote_ident(k) for k in key)
    where = ""
    if after is not None:
        bounds = ", ".join(f"CAST({escaped_literal(v)} AS {types[k]})" for k, v in zip(key, after, strict=True))
        where = f" WHERE ({cols}) > ({bounds})"
    return f"SELECT {select} FROM {quote_table(table)}{where} ORDER BY {cols} LIMIT {limit}"


@dataclass(frozen=True, slots=True)
class SlotInfo:
    name: str
    plugin: str | None
    database: str | None
    confirmed_flush_lsn: int | None
    active_pid: int | None
    wal_status: str | None


async def slot_info(conn: Any, slot: str) -> SlotInfo | None:
    row = await conn.fetchrow(
        "SELECT slot_name, plugin, database, confirmed_flush_lsn::text AS flush, active_pid, wal_status "
        "FROM pg_replication_slots WHERE slot_name = $1", slot)
    if row is None:
        return None
    flush = parse_lsn(row["flush"]) if row["flush"] else None
    return SlotInfo(row["slot_name"], row["plugin"], row["database"], flush, row["active_pid"], row["wal_status"])


async def publication_tables(conn: Any, publication: str) -> set[TableId] | None:
    """The tables a publication covers; None when it does not exist."""
    exists = await conn.fetchval("SELECT count(*) FROM pg_publication WHERE pubname = $1", publication)
    if not exists:
        return None
    rows = await conn.fetch("SELECT schemaname, tablename FROM pg_publication_tables WHERE pubname = $1", publication)
    return {TableId(r["schemaname"], r["tablename"]) for r in rows}


async def ensure_publication(conn: Any, publication: str, tables: list[TableId],
                             infos: dict[TableId, TableInfo]) -> None:
    """Create the publication for ``tables`` when absent; when present it must cover them.

    A table without a replica identity in a publication that publishes updates makes PostgreSQL reject
    UPDATE and DELETE on it, so cdcd refuses to create such a publication (an operator may still create
    one by hand, e.g. ``WITH (publish = 'insert')``).
    """
    have = await publication_tables(conn, publication)
    publishes_changes = True
    if have is not None:
        publishes_changes = bool(await conn.fetchval(
            "SELECT pubupdate OR pubdelete FROM pg_publication WHERE pubname = $1", publication))
    # Before the publication is touched: a table without a usable replica identity in a publication that
    # publishes updates makes PostgreSQL reject the application's UPDATE and DELETE on it.
    problems = [p for t in tables if (p := identity_problem(infos[t])) is not None]
    if problems and publishes_changes:
        raise SourceFatal(" ".join(problems) + f" (Or create publication {publication!r} yourself, e.g. "
                          "WITH (publish = 'insert'), if updates and deletes need not be captured.)")
    if have is None:
        names = ", ".join(quote_table(t) for t in tables)
        try:
            # Via the partition root: changes of a partitioned table arrive under its own name, not its leaves'.
            # The comment records that cdcd made it, so cdcd may add the tables source.tables gains later.
            async with conn.transaction():
                await conn.execute(f"CREATE PUBLICATION {quote_ident(publication)} FOR TABLE {names} "
                                   "WITH (publish_via_partition_root = true)")
                await conn.execute(f"COMMENT ON PUBLICATION {quote_ident(publication)} IS "
                                   f"{quote_literal(OWN_PUBLICATION)}")
        except asyncpg.UndefinedTableError as exc:
            raise SourceFatal(f"creating publication {publication!r}: {exc}; check source.tables") from exc
        except asyncpg.InsufficientPrivilegeError as exc:
            raise SourceFatal(
                f"creating publication {publication!r}: {exc}; create it as the tables' owner: "
                f"CREATE PUBLICATION {quote_ident(publication)} FOR TABLE {names}") from exc
        return
    missing = [t for t in tables if t not in have]
    if missing:
        names = ", ".join(quote_table(t) for t in missing)
        statement = f"ALTER PUBLICATION {quote_ident(publication)} ADD TABLE {names}"
        if not await own_publication(conn, publication):
            raise SourceFatal(f"publication {publication!r} exists but does not cover {names}, and cdcd did not "
                              f"create it, so it does not change it; run: {statement}")
        try:
            await conn.execute(statement)
        except asyncpg.InsufficientPrivilegeError as exc:
            raise SourceFatal(f"adding {names} to publication {publication!r}: {exc}; run as the tables' owner: "
                              f"{statement}") from exc
    partitioned = [t for t in tables if infos[t].partitioned]
    via_root = await conn.fetchval("SELECT pubviaroot FROM pg_publication WHERE pubname = $1", publication)
    if partitioned and not via_root:
        raise SourceFatal(
            f"publication {publication!r} publishes the partitioned table(s) "
            f"{', '.join(quote_table(t) for t in partitioned)} under their partitions' names; "
            f"run: ALTER PUBLICATION {quote_ident(publication)} SET (publish_via_partition_root = true)")


#: The comment cdcd puts on a publication it creates: such a publication cdcd may extend (ALTER PUBLICATION ADD).
OWN_PUBLICATION = "created by cdcd: it adds the tables source.tables gains"


async def own_publication(conn: Any, publication: str) -> bool:
    """Did cdcd create ``publication`` (its comment says so)?"""
    text = await conn.fetchval("SELECT obj_description(oid, 'pg_publication') FROM pg_publication WHERE pubname = $1",
                               publication)
    return bool(text == OWN_PUBLICATION)


@dataclass(frozen=True, slots=True)
class ColumnInfo:
    name: str
    type_oid: int
    typmod: int
    ndims: int
    not_null: bool
    sql_type: str  # format_type(): what a text parameter is cast to
    attnum: int | None = None  # the column's identity in its table (a rename keeps it)


@dataclass(frozen=True, slots=True)
class TableInfo:
    table: TableId
    oid: int
    columns: tuple[ColumnInfo, ...]
    primary_key: tuple[str, ...]
    identity_key: tuple[str, ...]  # replica identity index columns (may equal the primary key); () if none usable
    replica_identity: str  # d, n, f, i
    estimate: int
    partitioned: bool = False
    primary_deferrable: bool = False  # a DEFERRABLE primary key cannot be the replica identity

    @property
    def key(self) -> tuple[str, ...]:
        """The landing (and merge) key: the columns old-row images are sure to carry.

        With REPLICA IDENTITY USING INDEX, deletes and key changes carry only
        the index's columns, so the index is the key even when there is a
        primary key; otherwise (DEFAULT, FULL) the primary key.
        """
        if self.replica_identity == "i" and self.identity_key:
            return self.identity_key
        return self.primary_key or self.identity_key


def identity_problem(info: TableInfo) -> str | None:
    """Why the table's updates and deletes cannot be captured (and would fail once published), with the fix."""
    t = quote_table(info.table)
    fix = (f"run ALTER TABLE {t} REPLICA IDENTITY FULL, or ALTER TABLE {t} REPLICA IDENTITY USING INDEX on a "
           "non-deferrable unique index over NOT NULL columns")
    if info.replica_identity == "f" or info.identity_key:
        return None
    if info.replica_identity == "n":
        return f"{t} has REPLICA IDENTITY NOTHING: updates and deletes cannot be captured; {fix}."
    if info.primary_key and info.primary_deferrable:
        return (f"{t}: its primary key ({', '.join(info.primary_key)}) is DEFERRABLE, which PostgreSQL cannot use "
                "as a replica identity: in a publication it would reject the application's UPDATE and DELETE on "
                f"the table; {fix}.")
    return (f"{t} has no primary key and REPLICA IDENTITY is not FULL: in a publication PostgreSQL would reject "
            f"UPDATE and DELETE on it; add a primary key, or {fix}.")


async def table_info(conn: Any, table: TableId) -> TableInfo:
    row = await conn.fetchrow(
        "SELECT c.oid, c.relreplident, c.reltuples::bigint AS est, c.relkind = 'p' AS partitioned FROM pg_class c "
        "JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = $1 AND c.relname = $2 "
        "AND c.relkind IN ('r', 'p')", table.schema, table.name)
    if row is None:
        raise SourceFatal(f"table {table} does not exist (source.tables); create it or remove it from the list")
    oid = row["oid"]
    cols = await conn.fetch(
        "SELECT attname, atttypid, atttypmod, attndims, attnotnull, format_type(atttypid, atttypmod) AS sqltype, "
        "attnum "
        "FROM pg_attribute "
        "WHERE attrelid = $1 AND attnum > 0 AND NOT attisdropped AND attgenerated = '' ORDER BY attnum", oid)
    keys = await conn.fetch(
        "SELECT i.indisprimary, i.indisreplident, i.indimmediate, array_agg(a.attname ORDER BY k.ord) AS cols "
        "FROM pg_index i CROSS JOIN LATERAL unnest(i.indkey) WITH ORDINALITY AS k(attnum, ord) "
        "JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum "
        "WHERE i.indrelid = $1 AND (i.indisprimary OR i.indisreplident) GROUP BY i.indexrelid, 1, 2, 3", oid)
    primary: tuple[str, ...] = ()
    identity: tuple[str, ...] = ()
    deferrable = False
    for k in keys:
        if k["indisprimary"]:
            primary = tuple(k["cols"])
            deferrable = not k["indimmediate"]
        if k["indisreplident"] and k["indimmediate"]:
            identity = tuple(k["cols"])
    ident = row["relreplident"]
    ident = ident.decode() if isinstance(ident, bytes) else str(ident)
    if ident == "d":
        # PostgreSQL's default identity is the primary key only when it is not DEFERRABLE
        identity = () if deferrable else primary
    return TableInfo(
        table, oid,
        tuple(ColumnInfo(c["attname"], c["atttypid"], c["atttypmod"], c["attndims"], c["attnotnull"], c["sqltype"],
                         c["attnum"])
              for c in cols),
        primary, identity, ident, max(int(row["est"]), 0), bool(row["partitioned"]), deferrable,
    )


async def load_types(conn: Any, registry: TypeRegistry, oids: set[int]) -> None:
    """Teach ``registry`` the non-built-in types among ``oids`` (enums, domains, arrays of them)."""
    todo = registry.missing(oids)
    while todo:
        rows = await conn.fetch(
            "SELECT oid, typname, typtype, typelem, typbasetype, typtypmod, typndims, typcategory "
            "FROM pg_type WHERE oid = any($1::oid[])", list(todo))
        for r in rows:
            kind = r["typtype"]
            kind = kind.decode() if isinstance(kind, bytes) else str(kind)
            category = r["typcategory"]
            category = category.decode() if isinstance(category, bytes) else str(category)
            elem = r["typelem"] if category == "A" else 0
            registry.add(PgType(r["oid"], r["typname"], kind, elem, r["typbasetype"], r["typtypmod"], r["typndims"]))
        unknown = todo - {r["oid"] for r in rows}
        for oid in unknown:
            registry.add(PgType(oid, f"oid:{oid}", "p"))
        todo = registry.missing(oids)


async def emit_heartbeat(conn: Any) -> int:
    """A non-transactional logical message: it travels the slot even when no captured table changes."""
    text = await conn.fetchval("SELECT pg_logical_emit_message(false, $1, '')::text", HEARTBEAT_PREFIX)
    return parse_lsn(str(text))


async def current_wal_lsn(conn: Any) -> int:
    return parse_lsn(str(await conn.fetchval("SELECT pg_current_wal_insert_lsn()::text")))


def require_version(version_num: int, where: str) -> None:
    if version_num < 140000:
        raise SourceFatal(f"{where}: PostgreSQL {version_num // 10000} is not supported; cdcd needs 14 or newer")


async def server_version(conn: Any) -> int:
    return int(await conn.fetchval("SHOW server_version_num"))


async def advance_slot_to_now(conn: Any, slot: str) -> int:
    """Advance a logical slot to the current WAL position (it only reaches flushed WAL, so wait for that)."""
    target = await current_wal_lsn(conn)
    while True:
        text = await conn.fetchval("SELECT end_lsn::text FROM pg_replication_slot_advance($1, $2::text::pg_lsn)",
                                   slot, format_lsn(target))
        reached = parse_lsn(str(text))
        if reached >= target:
            return reached
        await asyncio.sleep(0.05)


async def drop_slot(conn: Any, slot: str) -> None:
    """Drop a slot that lost WAL it needs (wal_status = lost): nothing can stream from it again, and its name is
    the one the recovery's new slot takes."""
    await conn.execute("SELECT pg_drop_replication_slot($1)", slot)
