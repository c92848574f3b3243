"""Tables added to a running or restarted PostgreSQL source: every later change is captured (issue 27, 1 and 2).

1. A Relation message of a table not captured yet, sent before the table is added: pgoutput sends it once per
   connection, so the table's decoders must be built from it when the table is added (a publication made by a DBA
   that covers the table already, and the gap between ``ALTER PUBLICATION ... ADD TABLE`` and the switch).
2. A transaction that wrote to the table before it joined the publication and commits after: pgoutput never sends
   its changes, so the table's incremental snapshot waits for it before its first chunk (a reload, a restart).

Each test replays what the source delivered (position order, ``SNAPSHOT_COVERED``) and compares it with the table.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import asyncpg
import pytest
from pg_helpers import Driver, marks, wait_for
from source_driver import replay_covered
from test_pg_incremental import catch_up, source_of, source_rows

from cdcd.config import Config
from cdcd.events import Item, Mark, MarkKind
from cdcd.positions import PgPosition, parse_lsn
from cdcd.sources.postgres import catalog
from devtools.servers import PostgresServer

TABLES = ("CREATE TABLE a (id int PRIMARY KEY, v int); CREATE TABLE t (id int PRIMARY KEY, v int, pad text); "
          "INSERT INTO t SELECT g, g, 'p' FROM generate_series(1, 300) g; ")
FAST = {"mode": "never", "chunk_rows": 100}
#: the transaction of item 2: an update, a delete and an insert of t, open while t joins the publication
OPEN_TX = ("UPDATE t SET v = -v, pad = 'open' WHERE id BETWEEN 10 AND 19",
           "DELETE FROM t WHERE id BETWEEN 20 AND 29",
           "INSERT INTO t SELECT g, g, 'open' FROM generate_series(1000, 1009) g")


def config(make_config: Callable[..., Config], pg_db: str, tables: list[str]) -> Config:
    return make_config(tables, snapshot=FAST,
                       source={"postgres": {"slot": f"s_{pg_db}", "publication": f"p_{pg_db}", "heartbeat_s": 0.2}})


def later_changes(sql: Callable[[str], str]) -> None:
    """Updates, deletes, inserts and a key change of t after its snapshot."""
    sql("UPDATE t SET v = 0, pad = 'later' WHERE id BETWEEN 100 AND 109; DELETE FROM t WHERE id BETWEEN 200 AND 209; "
        "INSERT INTO t SELECT g, g, 'later' FROM generate_series(2000, 2009) g; UPDATE t SET id = 3000 WHERE id = 1")


def snapshot_done(items: list[Item]) -> bool:
    return bool(items) and isinstance(items[-1], Mark) and items[-1].kind is MarkKind.INCREMENTAL_DONE


async def test_a_table_the_publication_covered_already_streams_after_a_reload(
        pg_server: PostgresServer, pg_db: str, make_config: Callable[..., Config], sql: Callable[[str], str]) -> None:
    """A DBA's publication covers t; t's Relation message came (an update) while only a was captured."""
    sql(TABLES + f"CREATE PUBLICATION p_{pg_db} FOR TABLE a, t")
    dsn = pg_server.dsn(pg_db)
    async with Driver(config(make_config, pg_db, ["public.a"])) as d:
        src = source_of(d)
        got: list[Item] = []
        await catch_up(d, dsn, got)
        sql("UPDATE t SET v = 5 WHERE id = 5")  # t's Relation message, while t is not captured
        await catch_up(d, dsn, got)
        src.reload_tables(["public.a", "public.t"])
        got += await d.take(snapshot_done)
        later_changes(sql)
        await catch_up(d, dsn, got)
    assert replay_covered(got, "public.t") == await source_rows(dsn)


async def test_a_commit_between_the_publication_change_and_the_switch_does_not_stop_the_table(
        pg_server: PostgresServer, pg_db: str, make_config: Callable[..., Config], sql: Callable[[str], str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """cdcd's own publication: the reload adds t to it, and a commit to t is decoded before t is captured."""
    sql(TABLES)
    dsn = pg_server.dsn(pg_db)
    async with Driver(config(make_config, pg_db, ["public.a"])) as d:
        src = source_of(d)
        real = catalog.ensure_publication
        gap: list[PgPosition] = []

        async def then_a_commit(conn: Any, publication: str, tables: list[Any], infos: Any) -> None:
            await real(conn, publication, tables, infos)
            if len(tables) < 2 or gap:
                return
            # t is in the publication, not yet captured: a commit to it, decoded before the reload goes on
            await conn.execute("UPDATE t SET v = 7 WHERE id = 7")
            text = await conn.fetchval("SELECT pg_logical_emit_message(false, 'cdcd_heartbeat', '')::text")
            gap.append(PgPosition(parse_lsn(text), 0))
            await wait_for(lambda: src._coord.last is not None and src._coord.last >= gap[0], timeout=60,
                           what="the stream decoding the commit made in the gap")

        monkeypatch.setattr(catalog, "ensure_publication", then_a_commit)
        got: list[Item] = []
        await catch_up(d, dsn, got)
        src.reload_tables(["public.a", "public.t"])
        got += await d.take(snapshot_done)
        assert gap, "the reload did not change the publication"
        later_changes(sql)
        await catch_up(d, dsn, got)
    assert replay_covered(got, "public.t") == await source_rows(dsn)


async def until_done_or_waiting(d: Driver, got: list[Item]) -> None:
    """Pull until t's snapshot is done (it did not wait) or its first chunk waits for the open transaction."""
    src = source_of(d)
    got += await d.take(lambda items: snapshot_done(items) or bool(src.status().get("incremental_waiting")),
                        timeout=120)


async def test_a_transaction_open_when_a_reload_adds_the_table_is_delivered(
        pg_server: PostgresServer, pg_db: str, make_config: Callable[..., Config], sql: Callable[[str], str]) -> None:
    sql(TABLES)
    dsn = pg_server.dsn(pg_db)
    async with Driver(config(make_config, pg_db, ["public.a"])) as d:
        src = source_of(d)
        got: list[Item] = []
        await catch_up(d, dsn, got)
        writer = await asyncpg.connect(dsn)
        try:
            tx = writer.transaction()
            await tx.start()
            for statement in OPEN_TX:
                await writer.execute(statement)
            src.reload_tables(["public.a", "public.t"])
            await until_done_or_waiting(d, got)
            waiting = src.status().get("incremental_waiting")
            await tx.commit()
        finally:
            await writer.close()
        if not snapshot_done(got):
            got += await d.take(snapshot_done)
        later_changes(sql)
        await catch_up(d, dsn, got)
    assert replay_covered(got, "public.t") == await source_rows(dsn)
    assert waiting and waiting["table"] == "public.t" and waiting["transactions"], waiting


async def test_a_transaction_open_when_a_restart_adds_the_table_is_delivered(
        pg_server: PostgresServer, pg_db: str, make_config: Callable[..., Config], sql: Callable[[str], str]) -> None:
    sql(TABLES)
    dsn = pg_server.dsn(pg_db)
    async with Driver(config(make_config, pg_db, ["public.a"])) as d:
        got: list[Item] = []
        await catch_up(d, dsn, got)
        await d.commit()
        state, position = d.state, d.position
    writer = await asyncpg.connect(dsn)
    try:
        tx = writer.transaction()
        await tx.start()
        for statement in OPEN_TX:
            await writer.execute(statement)
        async with Driver(config(make_config, pg_db, ["public.a", "public.t"]), position, state) as d:
            src = source_of(d)
            got = []
            await until_done_or_waiting(d, got)
            waiting = src.status().get("incremental_waiting")
            await tx.commit()
            if not snapshot_done(got):
                got += await d.take(snapshot_done)
            later_changes(sql)
            await catch_up(d, dsn, got)
    finally:
        await writer.close()
    assert [m.detail["table"] for m in marks(got, MarkKind.INCREMENTAL_START)] == ["public.t"]
    assert replay_covered(got, "public.t") == await source_rows(dsn)
    assert waiting and waiting["table"] == "public.t" and waiting["transactions"], waiting


async def test_a_transaction_open_past_the_limit_fails_the_job_and_cdcd_snapshot_runs_it_again(
        pg_server: PostgresServer, pg_db: str, make_config: Callable[..., Config], sql: Callable[[str], str]) -> None:
    """The wait is bounded: the job fails naming the session and the fix; a new request, once the transaction
    ended, snapshots the table whole."""
    sql(TABLES)
    dsn = pg_server.dsn(pg_db)
    async with Driver(config(make_config, pg_db, ["public.a"])) as d:
        src = source_of(d)
        src._chunks.open_tx_limit_s = 0.5
        got: list[Item] = []
        await catch_up(d, dsn, got)
        writer = await asyncpg.connect(dsn)
        try:
            pid = await writer.fetchval("SELECT pg_backend_pid()")
            tx = writer.transaction()
            await tx.start()
            for statement in OPEN_TX:
                await writer.execute(statement)
            src.reload_tables(["public.a", "public.t"])
            got += await d.take(snapshot_done)
            failed = marks(got, MarkKind.INCREMENTAL_DONE)[-1].detail
            await tx.commit()
        finally:
            await writer.close()
        assert not marks(got, MarkKind.INCREMENTAL_CHUNK), "a chunk was read while the transaction was open"
        src.request_snapshot("public.t")
        got += await d.take(snapshot_done)
        later_changes(sql)
        await catch_up(d, dsn, got)
        progress = src.snapshot_progress()
    assert failed["table"] == "public.t" and f"pid {pid}," in failed["failed"], failed
    assert "cdcd snapshot -c CONFIG public.t" in failed["failed"]
    assert [(p["table"], p["state"]) for p in progress] == [("public.t", "failed"), ("public.t", "done")]
    assert replay_covered(got, "public.t") == await source_rows(dsn)
