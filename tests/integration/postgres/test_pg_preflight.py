"""`cdcd check` for PostgreSQL against the real server."""

from __future__ import annotations

from collections.abc import Callable

from cdcd.config import Config
from cdcd.sources.postgres import PostgresSource


async def test_preflight_passes_and_names_offenders(make_config: Callable[..., Config],
                                                    sql: Callable[[str], str]) -> None:
    sql("CREATE TABLE good (id int PRIMARY KEY); CREATE TABLE nokey (v int); CREATE TABLE full_ident (v int);"
        "ALTER TABLE full_ident REPLICA IDENTITY FULL; CREATE TABLE byindex (v int NOT NULL);"
        "CREATE UNIQUE INDEX byindex_v ON byindex (v); ALTER TABLE byindex REPLICA IDENTITY USING INDEX byindex_v")
    cfg = make_config(["public.good", "public.nokey", "public.full_ident", "public.byindex", "public.missing"])
    results = {r.name: r for r in await PostgresSource(cfg).preflight()}
    for name in ("connect", "server_version", "wal_level", "max_replication_slots", "max_wal_senders",
                 "replication_privilege", "select:public.good", "replica_identity:public.good",
                 "replica_identity:public.full_ident", "replica_identity:public.byindex", "slot",
                 "replication_connection"):
        assert results[name].ok, results[name]
    bad = results["replica_identity:public.nokey"]
    assert not bad.ok and "no primary key" in bad.detail and "REPLICA IDENTITY FULL" in bad.fix
    missing = results["table:public.missing"]
    assert not missing.ok and "does not exist" in missing.detail
    assert results["publication"].ok and "will create it" in results["publication"].detail


async def test_preflight_without_replication_privilege(make_config: Callable[..., Config],
                                                       sql: Callable[[str], str], pg_db: str) -> None:
    sql(f"CREATE TABLE t (id int PRIMARY KEY); CREATE ROLE plain_{pg_db} LOGIN;"
        f"CREATE PUBLICATION pub_{pg_db} FOR TABLE t")
    cfg = make_config(["public.t"], source={"user": f"plain_{pg_db}",
                                            "postgres": {"publication": "other", "slot": "s"}})
    results = {r.name: r for r in await PostgresSource(cfg).preflight()}
    assert not results["replication_privilege"].ok
    assert results["replication_privilege"].fix == f'ALTER ROLE "plain_{pg_db}" REPLICATION'
    assert not results["select:public.t"].ok and "GRANT SELECT" in results["select:public.t"].fix
    assert not results["replication_connection"].ok
    assert not results["publication"].ok and "CREATE PUBLICATION" in results["publication"].fix
