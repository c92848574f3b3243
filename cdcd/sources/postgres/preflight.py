"""`cdcd check` for PostgreSQL: settings, privileges and replica identity, each with its fix."""

from __future__ import annotations

import contextlib
from typing import Any

from cdcd.errors import SourceError
from cdcd.events import TableId
from cdcd.runtime.interfaces import CheckResult
from cdcd.sources.postgres import catalog
from cdcd.sources.postgres.failover import failover_checks
from cdcd.sources.postgres.walbudget import keep_size_check
from cdcd.sources.postgres.wire.replication import ConnectParams, ReplicationConnection


async def run_preflight(params: ConnectParams, tables: list[TableId], slot: str, publication: str,
                        failover: bool = False) -> list[CheckResult]:
    try:
        conn = await catalog.connect_sql(params)
    except SourceError as exc:
        return [CheckResult("connect", False, str(exc), "check host, port, user, password and pg_hba.conf")]
    try:
        return [
            CheckResult("connect", True, f"connected to {params.where}"),
            *await _server(conn),
            *await _privileges(conn, params, tables),
            *await _tables(conn, tables),
            *await _publication(conn, publication, tables),
            await _slot(conn, slot, params.database),
            await keep_size_check(conn),
            *await failover_checks(conn, slot, failover),
            await _replication_connection(params),
        ]
    finally:
        with contextlib.suppress(Exception):
            await conn.close()


async def _server(conn: Any) -> list[CheckResult]:
    out: list[CheckResult] = []
    version = await catalog.server_version(conn)
    out.append(CheckResult("server_version", version >= 140000, f"server_version_num = {version}",
                           "" if version >= 140000 else "upgrade to PostgreSQL 14 or newer"))
    wal_level = await conn.fetchval("SHOW wal_level")
    out.append(CheckResult("wal_level", wal_level == "logical", f"wal_level = {wal_level}",
                           "" if wal_level == "logical" else
                           "set wal_level = logical in postgresql.conf (ALTER SYSTEM SET wal_level = logical) "
                           "and restart PostgreSQL"))
    slots_max = int(await conn.fetchval("SHOW max_replication_slots"))
    slots_used = int(await conn.fetchval("SELECT count(*) FROM pg_replication_slots"))
    ok = slots_used < slots_max
    out.append(CheckResult("max_replication_slots", ok, f"{slots_used} of {slots_max} replication slots in use",
                           "" if ok else "raise max_replication_slots (restart needed) or drop unused slots"))
    senders_max = int(await conn.fetchval("SHOW max_wal_senders"))
    senders_used = int(await conn.fetchval("SELECT count(*) FROM pg_stat_replication"))
    ok = senders_used < senders_max
    out.append(CheckResult("max_wal_senders", ok, f"{senders_used} of {senders_max} WAL senders in use",
                           "" if ok else "raise max_wal_senders (restart needed)"))
    return out


async def _privileges(conn: Any, params: ConnectParams, tables: list[TableId]) -> list[CheckResult]:
    row = await conn.fetchrow("SELECT rolreplication, rolsuper FROM pg_roles WHERE rolname = current_user")
    ok = bool(row and (row["rolreplication"] or row["rolsuper"]))
    out = [CheckResult("replication_privilege", ok, f"role {params.user!r} "
                       + ("may" if ok else "may not") + " use replication",
                       "" if ok else f"ALTER ROLE {catalog.quote_ident(params.user)} REPLICATION")]
    for t in tables:
        exists = await conn.fetchval("SELECT to_regclass($1) IS NOT NULL", catalog.quote_table(t))
        if not exists:
            continue
        can = await conn.fetchval("SELECT has_table_privilege($1, 'SELECT')", catalog.quote_table(t))
        out.append(CheckResult(f"select:{t}", bool(can), f"SELECT on {t} " + ("granted" if can else "missing"),
                               "" if can else
                               f"GRANT SELECT ON {catalog.quote_table(t)} TO {catalog.quote_ident(params.user)}"))
    return out


async def _tables(conn: Any, tables: list[TableId]) -> list[CheckResult]:
    out: list[CheckResult] = []
    for t in tables:
        try:
            info = await catalog.table_info(conn, t)
        except SourceError as exc:
            out.append(CheckResult(f"table:{t}", False, str(exc), f"create {t} or remove it from source.tables"))
            continue
        ident = info.replica_identity
        problem = catalog.identity_problem(info)
        if problem is not None:
            detail, _, fix = problem.partition("; ")
            out.append(CheckResult(f"replica_identity:{t}", False, detail, fix.rstrip(".")))
            continue
        if ident == "f":
            detail = "REPLICA IDENTITY FULL" + (f", keyed on the primary key ({', '.join(info.key)})"
                                                if info.key else ", no key: rows are matched on every column")
        elif ident == "i":
            detail = (f"REPLICA IDENTITY USING INDEX ({', '.join(info.identity_key)}): events and the mirror are "
                      "keyed on the index's columns")
        else:
            detail = f"primary key ({', '.join(info.primary_key)})"
        out.append(CheckResult(f"replica_identity:{t}", True, detail))
    return out


async def _publication(conn: Any, publication: str, tables: list[TableId]) -> list[CheckResult]:
    have = await catalog.publication_tables(conn, publication)
    if have is None:
        can = await conn.fetchval(
            "SELECT has_database_privilege(current_database(), 'CREATE') "
            "AND bool_and(pg_has_role(c.relowner, 'USAGE')) FROM pg_class c WHERE c.oid IN "
            "(SELECT to_regclass(x) FROM unnest($1::text[]) x)",
            [catalog.quote_table(t) for t in tables])
        create = (f"CREATE PUBLICATION {catalog.quote_ident(publication)} FOR TABLE "
                  + ", ".join(catalog.quote_table(t) for t in tables))
        verdict = "will create it" if can else "may not create it"
        return [CheckResult("publication", bool(can), f"publication {publication!r} is absent; cdcd {verdict}",
                            "" if can else f"as the tables' owner: {create}")]
    missing = [t for t in tables if t not in have]
    return [CheckResult("publication", not missing,
                        f"publication {publication!r} " + (f"misses {', '.join(map(str, missing))}" if missing
                                                           else "covers every table"),
                        "" if not missing else f"ALTER PUBLICATION {catalog.quote_ident(publication)} ADD TABLE "
                        + ", ".join(catalog.quote_table(t) for t in missing))]


async def _slot(conn: Any, slot: str, database: str) -> CheckResult:
    info = await catalog.slot_info(conn, slot)
    if info is None:
        return CheckResult("slot", True, f"replication slot {slot!r} is absent; cdcd creates it on first start")
    ok = info.plugin == "pgoutput" and info.database == database and info.wal_status != "lost"
    detail = (f"replication slot {slot!r}: plugin {info.plugin}, database {info.database}, wal_status {info.wal_status}"
              + (f", in use by pid {info.active_pid}" if info.active_pid else ""))
    return CheckResult("slot", ok, detail, "" if ok else
                       f"drop it (SELECT pg_drop_replication_slot('{slot}')) or set source.postgres.slot")


async def _replication_connection(params: ConnectParams) -> CheckResult:
    try:
        repl = await ReplicationConnection.connect(params)
    except SourceError as exc:
        return CheckResult("replication_connection", False, str(exc),
                           "allow the user in pg_hba.conf for the 'replication' database (host replication USER ...)")
    try:
        ident = await repl.identify_system()
        return CheckResult("replication_connection", True,
                           f"replication connection works (system {ident.get('systemid')}, tls={repl.tls})")
    except SourceError as exc:
        return CheckResult("replication_connection", False, str(exc), "grant the REPLICATION attribute")
    finally:
        await repl.close()
