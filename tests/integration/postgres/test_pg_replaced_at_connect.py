"""A captured table replaced or dropped while cdcd was stopped is flagged at connect (the checkpoint keeps each
table's relation OID), on a real PostgreSQL; the other tables stream on and `cdcd snapshot TABLE` repairs it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import asyncpg
import pytest
from pg_helpers import Driver, marks
from source_driver import replay_covered
from test_pg_incremental import catch_up, source_of, source_rows

from cdcd.config import Config
from cdcd.errors import SourceFatal
from cdcd.events import ChangeEvent, Item, MarkKind
from devtools.servers import PostgresServer

SETUP = ("CREATE TABLE a (id int PRIMARY KEY); CREATE TABLE t (id int PRIMARY KEY, v int, pad text); "
         "INSERT INTO t SELECT g, g, 'old' FROM generate_series(1, 300) g")
REPLACE = ("DROP TABLE t; CREATE TABLE t (id int PRIMARY KEY, v int, pad text); "
           "INSERT INTO t SELECT g, -g, 'new' FROM generate_series(200, 450) g")


def config(make_config: Callable[..., Config], pg_db: str) -> Config:
    return make_config(["public.a", "public.t"], snapshot={"chunk_rows": 100},
                       source={"postgres": {"slot": f"s_{pg_db}", "publication": f"p_{pg_db}", "heartbeat_s": 0.2}})


async def oid_of(dsn: str, table: str) -> int:
    conn = await asyncpg.connect(dsn)
    try:
        return int(await conn.fetchval("SELECT $1::regclass::oid", table))
    finally:
        await conn.close()


def ids_of(items: list[Item], table: str) -> set[int]:
    """The keys inserted or updated in ``table`` (the driver hands out blocks as ChangeEvents)."""
    return {int(i.after["id"]) for i in items if isinstance(i, ChangeEvent) and str(i.table) == table and i.after}


async def first_run(cfg: Config, dsn: str) -> tuple[Any, dict[str, Any], list[Item]]:
    """Start, stream up to now, commit: the checkpoint a stopped daemon leaves."""
    async with Driver(cfg) as d:
        got: list[Item] = []
        await catch_up(d, dsn, got)
        await d.commit()
        return d.position, d.state, got


async def test_a_table_replaced_while_stopped_is_flagged_at_restart_and_its_snapshot_repairs_it(
        pg_server: PostgresServer, pg_db: str, make_config: Callable[..., Config], sql: Callable[[str], str]) -> None:
    sql(SETUP)
    dsn = pg_server.dsn(pg_db)
    cfg = config(make_config, pg_db)
    old_oid = await oid_of(dsn, "t")
    position, state, got = await first_run(cfg, dsn)
    assert state["oids"]["public.t"] == old_oid
    sql(REPLACE)  # while cdcd is stopped
    sql("INSERT INTO a VALUES (1)")
    new_oid = await oid_of(dsn, "t")
    async with Driver(cfg, position, state) as d:
        src = source_of(d)
        why = src.status()["tables_needing_snapshot"]["public.t"]
        more: list[Item] = []
        sql("INSERT INTO a VALUES (2)")
        await catch_up(d, dsn, more)
        await d.commit()
        flagged = d.state
        src.request_snapshot("public.t")
        more += await d.take(lambda items: bool(marks(items, MarkKind.INCREMENTAL_DONE)))
        sql("UPDATE t SET v = 0 WHERE id = 450; INSERT INTO t VALUES (1000, 1, 'after')")
        await catch_up(d, dsn, more)
        await d.commit()
        position, state, status = d.position, d.state, src.status()
    assert why == (f"it was dropped and re-created (relation OID {old_oid} is now {new_oid}), so publication "
                   f"'p_{pg_db}' no longer covers it")
    assert {1, 2} <= ids_of(more, "public.a")  # the other table streams on
    assert flagged["tables_needing_snapshot"] == {"public.t": why}
    assert flagged["oids"]["public.t"] == old_oid  # kept until the re-snapshot: a crash before it flags again
    assert "tables_needing_snapshot" not in status and "tables_needing_snapshot" not in state
    assert state["oids"]["public.t"] == new_oid
    assert replay_covered(got + more, "public.t") == await source_rows(dsn)
    async with Driver(cfg, position, state) as d:  # the new OID is the baseline now
        assert "tables_needing_snapshot" not in source_of(d).status()


async def test_a_replacement_whose_flag_was_not_committed_is_flagged_again_at_restart(
        pg_server: PostgresServer, pg_db: str, make_config: Callable[..., Config], sql: Callable[[str], str]) -> None:
    sql(SETUP)
    dsn = pg_server.dsn(pg_db)
    cfg = config(make_config, pg_db)
    position, state, _ = await first_run(cfg, dsn)
    async with Driver(cfg, position, state) as d:  # the heartbeat flags it; then a SIGKILL before any checkpoint
        src = source_of(d)
        sql(REPLACE)
        more: list[Item] = []
        await catch_up(d, dsn, more)
        await d.take(lambda items: "public.t" in src.status().get("tables_needing_snapshot", {}), timeout=60)
    async with Driver(cfg, position, state) as d:
        status = source_of(d).status()
    assert "dropped and re-created (relation OID" in status["tables_needing_snapshot"]["public.t"]


async def test_a_table_dropped_while_stopped_is_flagged_and_the_others_stream(
        pg_server: PostgresServer, pg_db: str, make_config: Callable[..., Config], sql: Callable[[str], str]) -> None:
    sql(SETUP)
    dsn = pg_server.dsn(pg_db)
    cfg = config(make_config, pg_db)
    old_oid = await oid_of(dsn, "t")
    position, state, _ = await first_run(cfg, dsn)
    # the checkpoint holds an incremental snapshot of t as running (stopped in its middle)
    state["incremental"] = {"public.t": {"where": None, "last_key": ["100"], "rows": 100, "chunks": 1,
                                         "lw": None, "status": "running"}}
    sql("DROP TABLE t")
    async with Driver(cfg, position, state) as d:
        src = source_of(d)
        why = src.status()["tables_needing_snapshot"]["public.t"]
        sql("INSERT INTO a VALUES (7)")
        more: list[Item] = []
        await catch_up(d, dsn, more)
        await d.commit()
        state = d.state
    assert why == f"it was dropped (relation OID {old_oid} is gone), so publication 'p_{pg_db}' no longer covers it"
    assert 7 in ids_of(more, "public.a")
    assert state["tables_needing_snapshot"] == {"public.t": why}
    assert state["incremental"]["public.t"]["status"] == "cancelled"  # nothing left to read
    assert state["oids"]["public.t"] == old_oid


async def test_a_checkpoint_without_oids_starts_without_a_flag_and_keeps_them_from_then_on(
        pg_server: PostgresServer, pg_db: str, make_config: Callable[..., Config], sql: Callable[[str], str]) -> None:
    sql(SETUP)
    dsn = pg_server.dsn(pg_db)
    cfg = config(make_config, pg_db)
    position, state, _ = await first_run(cfg, dsn)
    old = {k: v for k, v in state.items() if k != "oids"}  # as written before the OIDs were kept
    async with Driver(cfg, position, old) as d:
        status = source_of(d).status()
        sql("INSERT INTO a VALUES (3)")
        more: list[Item] = []
        await catch_up(d, dsn, more)
        await d.commit()
        position, state = d.position, d.state
    assert "tables_needing_snapshot" not in status
    assert state["oids"] == {"public.a": await oid_of(dsn, "a"), "public.t": await oid_of(dsn, "t")}
    sql(REPLACE)
    async with Driver(cfg, position, state) as d:
        assert "public.t" in source_of(d).status()["tables_needing_snapshot"]


async def test_a_publication_cdcd_did_not_create_names_the_statement_then_the_table_is_flagged(
        pg_server: PostgresServer, pg_db: str, make_config: Callable[..., Config], sql: Callable[[str], str]) -> None:
    sql(SETUP + f"; CREATE PUBLICATION p_{pg_db} FOR TABLE a, t")
    dsn = pg_server.dsn(pg_db)
    cfg = config(make_config, pg_db)
    position, state, _ = await first_run(cfg, dsn)
    sql(REPLACE)  # while cdcd is stopped: the re-created table is in no publication
    statement = f'ALTER PUBLICATION "p_{pg_db}" ADD TABLE "public"."t"'
    with pytest.raises(SourceFatal, match=f"cdcd did not create it, so it does not change it; run: {statement}"):
        async with Driver(cfg, position, state):
            pass
    sql(statement)  # what the error says to run
    async with Driver(cfg, position, state) as d:
        status = source_of(d).status()
    assert "dropped and re-created (relation OID" in status["tables_needing_snapshot"]["public.t"]
