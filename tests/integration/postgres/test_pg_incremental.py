"""Incremental snapshots on a real PostgreSQL: chunks read while the stream runs, exact under concurrent writes."""

from __future__ import annotations

import asyncio
import itertools
import random
from collections.abc import Callable
from typing import Any

import asyncpg
import pytest
from pg_helpers import Driver, apply, marks, wait_for
from source_driver import replay_covered

from cdcd.capture.incremental import SnapshotJob
from cdcd.config import Config
from cdcd.errors import ConfigError
from cdcd.events import ChangeBlock, ChangeEvent, Item, Mark, MarkKind
from cdcd.positions import PgPosition
from cdcd.sources.postgres import PostgresSource
from devtools.servers import PostgresServer

NEVER = {"mode": "never"}
ROWS = 3000


def source_of(d: Driver) -> PostgresSource:
    assert isinstance(d.source, PostgresSource)
    return d.source


async def workload(dsn: str, stop: asyncio.Event, seed: int, counts: dict[str, int], toast: bool = False) -> None:
    """Small transactions of inserts, updates, key changes and deletes until ``stop``. ``toast``: inserts write a
    TOASTed ``pad`` and updates leave it unchanged (the stream then lacks it)."""
    rnd = random.Random(seed)
    insert = "repeat(md5($2::int::text), 100)" if toast else "'w'"
    update = "v = v + 1" if toast else "v = v + 1, pad = 'u'"
    conn = await asyncpg.connect(dsn)
    try:
        while not stop.is_set():
            done: list[str] = []
            try:
                async with conn.transaction():
                    for _ in range(rnd.randint(1, 4)):
                        k = rnd.randint(1, ROWS * 2)
                        op = rnd.choice(["insert", "update", "rekey", "delete"])
                        if op == "insert":
                            await conn.execute(f"INSERT INTO t VALUES ($1, $2, {insert}) ON CONFLICT (id) DO NOTHING",
                                               k, rnd.randint(0, 10**6))
                        elif op == "update":
                            await conn.execute(f"UPDATE t SET {update} WHERE id = $1", k)
                        elif op == "rekey":
                            await conn.execute("UPDATE t SET id = $2 WHERE id = $1 AND NOT EXISTS "
                                               "(SELECT 1 FROM t WHERE id = $2)", k, rnd.randint(1, ROWS * 2))
                        else:
                            await conn.execute("DELETE FROM t WHERE id = $1", k)
                        done.append(op)
            except (asyncpg.DeadlockDetectedError, asyncpg.UniqueViolationError):
                continue  # concurrent writers collided (a deadlock, or a key change racing another): rolled back
            for op in done:
                counts[op] = counts.get(op, 0) + 1
            await asyncio.sleep(0.003)  # paced: unpaced writers can outrun the reader on a loaded machine
    finally:
        await conn.close()


async def source_rows(dsn: str) -> dict[tuple[Any, ...], dict[str, Any]]:
    conn = await asyncpg.connect(dsn)
    try:
        return {(r["id"],): dict(r) for r in await conn.fetch("SELECT id, v, pad FROM t")}
    finally:
        await conn.close()


def replay(items: list[Item]) -> dict[tuple[Any, ...], dict[str, Any]]:
    mirror: dict[tuple[Any, ...], dict[str, Any]] = {}
    apply(mirror, [i for i in items if isinstance(i, ChangeEvent)])
    return mirror


def in_position_order(items: list[Item]) -> bool:
    positions = [i.position for i in items if not (isinstance(i, Mark) and i.kind is MarkKind.IDENTITY)]
    return all(a <= b for a, b in itertools.pairwise(positions))


async def catch_up(d: Driver, dsn: str, got: list[Item]) -> None:
    """Pull until the stream passed a heartbeat emitted now: everything committed before is delivered."""
    conn = await asyncpg.connect(dsn)
    try:
        text = await conn.fetchval("SELECT pg_logical_emit_message(false, 'cdcd_heartbeat', '')::text")
    finally:
        await conn.close()
    hi, lo = text.split("/")
    target = PgPosition((int(hi, 16) << 32) | int(lo, 16), 0)
    got += await d.take(lambda items: bool(items) and items[-1].position >= target, timeout=120)


async def test_incremental_snapshot_under_a_concurrent_workload_equals_the_source(
        pg_server: PostgresServer, pg_db: str, make_config: Callable[..., Config], sql: Callable[[str], str]) -> None:
    sql(f"CREATE TABLE t (id int PRIMARY KEY, v int, pad text); "
        f"INSERT INTO t SELECT g, g, repeat('x', 20) FROM generate_series(1, {ROWS}) g")
    dsn = pg_server.dsn(pg_db)
    cfg = make_config(["public.t"], snapshot={"mode": "never", "chunk_rows": 150},
                      source={"postgres": {"slot": f"s_{pg_db}", "publication": f"p_{pg_db}", "heartbeat_s": 0.2}})
    chunk_deletes: list[int] = []
    async with Driver(cfg) as d:
        src = source_of(d)
        fixer = await asyncpg.connect(dsn)

        async def change_the_chunk(job: SnapshotJob) -> None:
            # Between the chunk's read and its HW: delete a row the read returned, change another's value and a
            # third one's key. The deleted row must not come back, the others must end as the source has them.
            after = int(job.last_key[0]) if job.last_key else 0
            ids = [r["id"] for r in await fixer.fetch("SELECT id FROM t WHERE id > $1 ORDER BY id LIMIT 3", after)]
            if len(ids) == 3:
                await fixer.execute("DELETE FROM t WHERE id = $1", ids[0])
                await fixer.execute("UPDATE t SET v = -v WHERE id = $1", ids[1])
                await fixer.execute("UPDATE t SET id = -id WHERE id = $1", ids[2])
                chunk_deletes.append(ids[0])

        src._chunks.after_read = change_the_chunk
        got: list[Item] = []
        await catch_up(d, dsn, got)  # the stream runs
        with pytest.raises(ConfigError, match=r"'public\.nope' is not captured; source\.tables lists: public\.t"):
            src.request_snapshot("public.nope")
        stop = asyncio.Event()
        counts: dict[str, int] = {}
        writers = [asyncio.create_task(workload(dsn, stop, seed, counts)) for seed in range(3)]
        try:
            src.request_snapshot("public.t")
            got += await d.take(lambda items: bool(items) and isinstance(items[-1], Mark)
                                and items[-1].kind is MarkKind.INCREMENTAL_DONE, timeout=240)
        finally:
            stop.set()
            await asyncio.gather(*writers)
            await fixer.close()
        await catch_up(d, dsn, got)
        progress = src.snapshot_progress()
    assert min(counts.get(op, 0) for op in ("insert", "update", "rekey", "delete")) > 20, counts
    assert len(chunk_deletes) >= 10
    chunks = marks(got, MarkKind.INCREMENTAL_CHUNK)
    assert len(chunks) >= 20
    assert in_position_order(got)
    expected = await source_rows(dsn)
    mirror = replay(got)
    resurrected = [k for k in chunk_deletes if (k,) in mirror and (k,) not in expected]
    assert not resurrected, f"rows deleted while their chunk was read came back: {resurrected}"
    assert mirror == expected
    covered = marks(got, MarkKind.SNAPSHOT_COVERED)
    assert len(covered) == 1 and covered[0].detail["table"] == "public.t"
    below = covered[0].detail["below"]
    assert isinstance(below, PgPosition) and below.to_json() == chunks[0].detail["lw"] and below < chunks[0].position
    assert progress == [{"table": "public.t", "where": None, "state": "done", "chunks": len(chunks),
                         "rows": sum(c.detail["rows"] for c in chunks), "last_key": chunks[-1].detail["last_key"],
                         "reread": 0, "error": None}]


async def test_toasted_rows_under_a_concurrent_workload_land_whole(
        pg_server: PostgresServer, pg_db: str, make_config: Callable[..., Config], sql: Callable[[str], str]) -> None:
    """The workload's updates leave the TOASTed ``pad`` unchanged: rows they take in their chunk's window, and the
    keys they move, are read again; the replay equals the source with every ``pad``."""
    sql(f"CREATE TABLE t (id int PRIMARY KEY, v int, pad text); ALTER TABLE t ALTER pad SET STORAGE EXTERNAL; "
        f"INSERT INTO t SELECT g, g, repeat(md5(g::text), 100) FROM generate_series(1, {ROWS}) g")
    dsn = pg_server.dsn(pg_db)
    cfg = make_config(["public.t"], snapshot={"mode": "never", "chunk_rows": 150},
                      source={"postgres": {"slot": f"s_{pg_db}", "publication": f"p_{pg_db}", "heartbeat_s": 0.2}})
    async with Driver(cfg) as d:
        src = source_of(d)
        got: list[Item] = []
        await catch_up(d, dsn, got)
        stop = asyncio.Event()
        counts: dict[str, int] = {}
        writers = [asyncio.create_task(workload(dsn, stop, seed, counts, toast=True)) for seed in range(3)]
        try:
            src.request_snapshot("public.t")
            got += await d.take(lambda items: bool(items) and isinstance(items[-1], Mark)
                                and items[-1].kind is MarkKind.INCREMENTAL_DONE, timeout=240)
        finally:
            stop.set()
            await asyncio.gather(*writers)
        await catch_up(d, dsn, got)
    assert min(counts.get(op, 0) for op in ("insert", "update", "rekey", "delete")) > 20, counts
    chunks = marks(got, MarkKind.INCREMENTAL_CHUNK)
    assert any(c.detail["reread"] for c in chunks), "no row was taken without its TOAST value in a window"
    assert in_position_order(got)
    expected = await source_rows(dsn)
    mirror = replay(got)
    missing = sorted(k for k, row in mirror.items() if row.get("pad") is None)
    assert not missing, f"rows landed without their TOAST value: {missing}"
    assert mirror == expected


async def test_a_restart_resumes_after_the_last_committed_chunk(
        pg_server: PostgresServer, pg_db: str, make_config: Callable[..., Config], sql: Callable[[str], str]) -> None:
    sql("CREATE TABLE t (id int PRIMARY KEY, v int, pad text); "
        "INSERT INTO t SELECT g, g, 'p' FROM generate_series(1, 1000) g")
    dsn = pg_server.dsn(pg_db)
    cfg = make_config(["public.t"], snapshot={"mode": "never", "chunk_rows": 100})
    async with Driver(cfg) as d:
        got: list[Item] = []
        await catch_up(d, dsn, got)
        source_of(d).request_snapshot("public.t")
        got += await d.take(lambda items: len(marks(items, MarkKind.INCREMENTAL_CHUNK)) == 3)
        third = max(i for i, item in enumerate(d.pending) if isinstance(item, Mark)
                    and item.kind is MarkKind.INCREMENTAL_CHUNK)
        committed = list(d.pending[:third + 1])
        await d.commit(third + 1)
        state, position = d.state, d.position
    assert state["incremental"]["public.t"] == {"where": None, "last_key": ["300"], "rows": 300, "chunks": 3,
                                                "lw": state["incremental"]["public.t"]["lw"], "status": "running"}
    sql("DELETE FROM t WHERE id IN (5, 500); UPDATE t SET v = 0 WHERE id = 600")
    async with Driver(cfg, position, state) as d:
        more = await d.take(lambda items: bool(marks(items, MarkKind.INCREMENTAL_DONE)))
        await catch_up(d, dsn, more)
    rows = [i for i in more if isinstance(i, ChangeEvent) and i.snapshot]
    assert min(r.key for r in rows) == (301,), "the restart read again what the checkpoint held"
    assert not marks(more, MarkKind.INCREMENTAL_START)
    covered = marks(more, MarkKind.SNAPSHOT_COVERED)
    assert len(covered) == 1 and covered[0].detail["below"].to_json() == state["incremental"]["public.t"]["lw"]
    assert replay(committed + more) == await source_rows(dsn)


async def test_a_table_added_to_source_tables_is_snapshotted_while_streaming_and_a_removed_one_stops(
        pg_server: PostgresServer, pg_db: str, make_config: Callable[..., Config], sql: Callable[[str], str]) -> None:
    sql("CREATE TABLE a (id int PRIMARY KEY, v int); CREATE TABLE t (id int PRIMARY KEY, v int, pad text); "
        "INSERT INTO t SELECT g, g, 'p' FROM generate_series(1, 500) g")
    dsn = pg_server.dsn(pg_db)
    async with Driver(make_config(["public.a"], snapshot={"mode": "never", "chunk_rows": 100})) as d:
        got: list[Item] = []
        await catch_up(d, dsn, got)
        await d.commit()
        state, position = d.state, d.position
    assert state["tables"] == ["public.a"]
    sql("INSERT INTO t VALUES (1000, 1, 'before the restart')")
    async with Driver(make_config(["public.t"], snapshot={"mode": "never", "chunk_rows": 100}), position,
                      state) as d:
        got = await d.take(lambda items: bool(marks(items, MarkKind.INCREMENTAL_DONE)))
        sql("INSERT INTO a VALUES (1, 1); UPDATE t SET v = -1 WHERE id = 1")
        await catch_up(d, dsn, got)
        await d.commit()
        state = d.state
    assert [m.detail for m in marks(got, MarkKind.INCREMENTAL_START)] == [{"table": "public.t", "where": None}]
    assert marks(got, MarkKind.TABLES)[0].detail == {"tables": ["public.t"]}
    assert state["tables"] == ["public.t"] and state["incremental"]["public.t"]["status"] == "done"
    assert not [i for i in got if isinstance(i, ChangeEvent) and i.table.name == "a"], "a removed table streamed"
    assert replay(got) == await source_rows(dsn)
    assert pg_server.psql(f"SELECT string_agg(tablename, ',' ORDER BY tablename) FROM pg_publication_tables "
                          f"WHERE pubname = 'p_{pg_db}'", pg_db) == "a,t"


async def test_a_publication_cdcd_did_not_create_is_not_changed(
        pg_server: PostgresServer, pg_db: str, make_config: Callable[..., Config], sql: Callable[[str], str]) -> None:
    sql(f"CREATE TABLE a (id int PRIMARY KEY); CREATE TABLE t (id int PRIMARY KEY); CREATE PUBLICATION p_{pg_db} "
        "FOR TABLE a")
    with pytest.raises(Exception, match=rf"does not cover \"public\".\"t\", and cdcd did not create it.*run: "
                                        rf"ALTER PUBLICATION \"p_{pg_db}\" ADD TABLE \"public\".\"t\""):
        async with Driver(make_config(["public.a", "public.t"], snapshot=NEVER)):
            pass


async def test_reload_tables_on_the_running_source_and_a_where_snapshot(
        pg_server: PostgresServer, pg_db: str, make_config: Callable[..., Config], sql: Callable[[str], str]) -> None:
    sql("CREATE TABLE a (id int PRIMARY KEY, v int); CREATE TABLE t (id int PRIMARY KEY, v int, pad text); "
        "INSERT INTO t SELECT g, g, 'p' FROM generate_series(1, 400) g")
    dsn = pg_server.dsn(pg_db)
    async with Driver(make_config(["public.a"], snapshot={"mode": "never", "chunk_rows": 50})) as d:
        src = source_of(d)
        got: list[Item] = []
        await catch_up(d, dsn, got)
        with pytest.raises(ConfigError, match=r"must be written as 'schema\.table'"):
            src.reload_tables(["nodot"])
        src.reload_tables(["public.a", "public.t"])
        got += await d.take(lambda items: bool(marks(items, MarkKind.INCREMENTAL_DONE)))
        src.request_snapshot("public.t", "v % 100 = 0")
        sql("UPDATE t SET v = 7 WHERE id = 200")  # may land before, inside or after the WHERE snapshot's chunk
        where_items = await d.take(lambda items: bool(marks(items, MarkKind.INCREMENTAL_DONE)))
        await catch_up(d, dsn, where_items)
        progress = src.snapshot_progress()
    assert replay(got + where_items) == await source_rows(dsn)
    assert not marks(where_items, MarkKind.SNAPSHOT_COVERED), "a WHERE snapshot covers no whole table"
    reread = {i.key for i in where_items if isinstance(i, ChangeEvent) and i.snapshot}
    assert reread <= {(k,) for k in range(100, 401, 100)} and len(reread) >= 3
    assert [(p["table"], p["where"], p["state"]) for p in progress] == [
        ("public.t", None, "done"), ("public.t", "v % 100 = 0", "done")]


async def test_connections_dropped_mid_snapshot_are_retried_and_the_result_stays_exact(
        pg_server: PostgresServer, pg_db: str, make_config: Callable[..., Config], sql: Callable[[str], str]) -> None:
    sql("CREATE TABLE t (id int PRIMARY KEY, v int, pad text); "
        "INSERT INTO t SELECT g, g, 'p' FROM generate_series(1, 2000) g")
    dsn = pg_server.dsn(pg_db)
    cfg = make_config(["public.t"], snapshot={"mode": "never", "chunk_rows": 100},
                      runtime={"reconnect_max_s": 0.2})
    async with Driver(cfg) as d:
        src = source_of(d)
        killed: list[int] = []
        killer = await asyncpg.connect(dsn)

        async def drop_everything(job: SnapshotJob) -> None:
            await killer.execute("UPDATE t SET v = v + 1 WHERE id = $1", int(job.last_key[0]) + 1 if job.last_key
                                 else 1)
            if job.chunks in (2, 5) and job.chunks not in killed:  # between a read and its HW: every connection
                killed.append(job.chunks)
                await killer.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                                     "WHERE datname = $1 AND pid <> pg_backend_pid()", pg_db)

        src._chunks.after_read = drop_everything
        got: list[Item] = []
        await catch_up(d, dsn, got)
        src.request_snapshot("public.t")
        try:
            got += await d.take(lambda items: bool(marks(items, MarkKind.INCREMENTAL_DONE)), timeout=120)
            await catch_up(d, dsn, got)
        finally:
            await killer.close()
        progress = src.snapshot_progress()
    assert killed == [2, 5] and src._coord.reconnects >= 2
    assert progress[0]["state"] == "done"
    assert replay(got) == await source_rows(dsn)


async def test_a_reload_the_publication_cannot_take_fails_softly(
        pg_server: PostgresServer, pg_db: str, make_config: Callable[..., Config], sql: Callable[[str], str]) -> None:
    sql(f"CREATE TABLE a (id int PRIMARY KEY); CREATE TABLE t (id int PRIMARY KEY); CREATE PUBLICATION p_{pg_db} "
        "FOR TABLE a")
    dsn = pg_server.dsn(pg_db)
    async with Driver(make_config(["public.a"], snapshot=NEVER)) as d:
        src = source_of(d)
        got: list[Item] = []
        await catch_up(d, dsn, got)
        src.reload_tables(["public.a", "public.t"])
        sql("INSERT INTO a VALUES (1)")
        got = await d.take(lambda items: any(isinstance(i, ChangeEvent) and i.table.name == "a" for i in items))
        await catch_up(d, dsn, got)
        await wait_for(lambda: bool(src.status().get("table_reload_error")), what="the reload's error in the status")
        status = src.status()
    assert f'run: ALTER PUBLICATION "p_{pg_db}" ADD TABLE "public"."t"' in status["table_reload_error"]
    assert not marks(got, MarkKind.TABLES) and src.snapshot_progress() == []


async def test_a_table_dropped_and_recreated_is_named_and_cdcd_snapshot_repairs_it(
        pg_server: PostgresServer, pg_db: str, make_config: Callable[..., Config], sql: Callable[[str], str]) -> None:
    sql("CREATE TABLE a (id int PRIMARY KEY); CREATE TABLE t (id int PRIMARY KEY, v int, pad text); "
        "INSERT INTO t SELECT g, g, 'old' FROM generate_series(1, 300) g")
    dsn = pg_server.dsn(pg_db)
    cfg = make_config(["public.a", "public.t"], snapshot={"chunk_rows": 100},
                      source={"postgres": {"slot": f"s_{pg_db}", "publication": f"p_{pg_db}", "heartbeat_s": 0.2}})
    async with Driver(cfg) as d:
        src = source_of(d)
        got: list[Item] = []
        await catch_up(d, dsn, got)
        sql("DROP TABLE t; CREATE TABLE t (id int PRIMARY KEY, v int, pad text); "
            "INSERT INTO t SELECT g, -g, 'new' FROM generate_series(200, 450) g")
        sql("INSERT INTO a VALUES (1)")
        await wait_for(lambda: "public.t" in src.status().get("tables_needing_snapshot", {}), timeout=60,
                       what="the re-created table in the status")
        why = src.status()["tables_needing_snapshot"]["public.t"]
        await catch_up(d, dsn, got)
        assert not [i for i in got if isinstance(i, ChangeEvent) and str(i.table) == "public.t"
                    and (i.after or {}).get("pad") == "new"], "the re-created table streamed before it was published"
        src.request_snapshot("public.t")
        got += await d.take(lambda items: bool(marks(items, MarkKind.INCREMENTAL_DONE)))
        sql("UPDATE t SET v = 0 WHERE id = 450; INSERT INTO t VALUES (1000, 1, 'after')")
        await catch_up(d, dsn, got)
        status = src.status()
    assert "dropped and re-created (relation OID" in why and f"publication 'p_{pg_db}' no longer covers it" in why
    assert "tables_needing_snapshot" not in status
    assert replay_covered(got, "public.t") == await source_rows(dsn)
    assert [m.detail["table"] for m in marks(got, MarkKind.SNAPSHOT_COVERED)] == ["public.t"]


async def test_requests_queued_but_not_started_survive_a_restart(
        pg_server: PostgresServer, pg_db: str, make_config: Callable[..., Config], sql: Callable[[str], str]) -> None:
    sql("CREATE TABLE a (id int PRIMARY KEY, v int); CREATE TABLE t (id int PRIMARY KEY, v int, pad text); "
        "INSERT INTO t SELECT g, g, 'p' FROM generate_series(1, 300) g; INSERT INTO a VALUES (1, 1), (2, 2)")
    dsn = pg_server.dsn(pg_db)
    cfg = make_config(["public.a", "public.t"], snapshot={"mode": "never", "chunk_rows": 100})
    async with Driver(cfg) as d:
        src = source_of(d)
        never = asyncio.Event()

        async def hold(job: SnapshotJob) -> None:
            await never.wait()  # the first chunk of a is never delivered: the request after it stays queued

        src._chunks.after_read = hold
        got: list[Item] = []
        await catch_up(d, dsn, got)
        src.request_snapshot("public.a", "id > 1")
        src.request_snapshot("public.t", "id <= 10")
        await catch_up(d, dsn, got)
        await d.commit()
        state, position = d.state, d.position
    assert state["incremental_queued"] == [{"table": "public.t", "where": "id <= 10"}]
    assert state["incremental"]["public.a"]["status"] == "running"
    async with Driver(cfg, position, state) as d:
        src = source_of(d)
        more = await d.take(lambda items: len(marks(items, MarkKind.INCREMENTAL_DONE)) == 2)
        await catch_up(d, dsn, more)
        await d.commit()
        progress, state = src.snapshot_progress(), d.state
    assert [(p["table"], p["where"], p["state"]) for p in progress] == [
        ("public.a", "id > 1", "done"), ("public.t", "id <= 10", "done")]
    assert [r.key for r in more if isinstance(r, ChangeEvent) and r.table.name == "a"] == [(2,)]
    assert len([r for r in more if isinstance(r, ChangeEvent) and r.table.name == "t"]) == 10
    assert not state.get("incremental_queued")


TOASTED = "CREATE TABLE t (id int PRIMARY KEY, n int, big text); ALTER TABLE t ALTER big SET STORAGE EXTERNAL; "


async def toast_rows(dsn: str) -> dict[tuple[Any, ...], dict[str, Any]]:
    conn = await asyncpg.connect(dsn)
    try:
        return {(r["id"],): dict(r) for r in await conn.fetch("SELECT id, n, big FROM t")}
    finally:
        await conn.close()


def unavailable_updates(items: list[Item]) -> list[ChangeEvent]:
    """The streamed changes that lack the TOASTed value (the rows of ChangeBlocks too)."""
    events = [e for i in items
              for e in (i.events() if isinstance(i, ChangeBlock) else [i] if isinstance(i, ChangeEvent) else [])]
    return [e for e in events if not e.snapshot and e.unavailable == ("big",)]


async def test_rows_updated_in_their_chunk_window_without_their_toast_value_are_read_again(
        pg_server: PostgresServer, pg_db: str, make_config: Callable[..., Config], sql: Callable[[str], str]) -> None:
    """A row updated between its chunk's watermarks is taken from the stream, whose update lacks the unchanged
    TOASTed value (``unavailable``); the mirror never had the row, so the key is read again until a read of it
    has no such update in its window. A key change that lacks it moves a value the mirror does not have: the new
    key is read again too. The landed replay equals the source, TOAST values included."""
    sql(TOASTED + "INSERT INTO t SELECT g, 0, repeat(md5(g::text), 700) FROM generate_series(1, 45) g")
    dsn = pg_server.dsn(pg_db)
    async with Driver(make_config(["public.t"], snapshot={"mode": "never", "chunk_rows": 10})) as d:
        src = source_of(d)
        writer = await asyncpg.connect(dsn)
        again: list[int] = []

        async def touch(job: SnapshotJob) -> None:  # between the read and its HW
            after = int(job.last_key[0]) if job.last_key else 0
            ids = [r["id"] for r in await writer.fetch("SELECT id FROM t WHERE id > $1 ORDER BY id LIMIT 3", after)]
            if len(ids) == 3:  # a chunk of the range: update one row of it, move another one's key
                await writer.execute("UPDATE t SET n = n + 1 WHERE id = $1", ids[0])
                await writer.execute("UPDATE t SET id = -id WHERE id = $1", ids[1])
            if job.reread and len(again) < 3:  # a key being read again is updated again in its window
                k = int(next(iter(job.reread.values()))[0])
                await writer.execute("UPDATE t SET n = n + 10 WHERE id = $1", k)
                again.append(k)

        src._chunks.after_read = touch
        got: list[Item] = []
        await catch_up(d, dsn, got)
        try:
            src.request_snapshot("public.t")
            got += await d.take(lambda items: bool(marks(items, MarkKind.INCREMENTAL_DONE)), timeout=120)
            await catch_up(d, dsn, got)
        finally:
            await writer.close()
        progress = src.snapshot_progress()
    assert len(unavailable_updates(got)) >= 10, "the updates did not leave the TOAST value out"
    expected = await toast_rows(dsn)
    mirror = replay(got)
    missing = sorted(k for k, row in mirror.items() if row.get("big") is None)
    assert not missing, f"rows landed without their TOAST value: {missing}"
    assert mirror == expected
    assert len(again) == 3 and len(unavailable_updates(got)) >= 13
    assert marks(got, MarkKind.INCREMENTAL_REREAD), "no key change was read again"
    chunks = marks(got, MarkKind.INCREMENTAL_CHUNK)
    assert any(c.detail["reread"] for c in chunks) and not chunks[-1].detail["reread"]
    assert progress[0]["state"] == "done" and progress[0]["reread"] == 0
    assert in_position_order(got)
    covered = marks(got, MarkKind.SNAPSHOT_COVERED)
    assert replay_covered(got, "public.t") == expected and len(covered) == 1


async def test_keys_waiting_to_be_read_again_survive_a_restart(
        pg_server: PostgresServer, pg_db: str, make_config: Callable[..., Config], sql: Callable[[str], str]) -> None:
    sql(TOASTED + "INSERT INTO t SELECT g, 0, repeat(md5(g::text), 700) FROM generate_series(1, 30) g")
    dsn = pg_server.dsn(pg_db)
    cfg = make_config(["public.t"], snapshot={"mode": "never", "chunk_rows": 10})
    async with Driver(cfg) as d:
        src = source_of(d)
        writer = await asyncpg.connect(dsn)

        async def touch(job: SnapshotJob) -> None:
            if job.chunks == 0:  # the first chunk: row 1 updated, row 2 moved to key -2, both without the value
                await writer.execute("UPDATE t SET n = 5 WHERE id = 1; UPDATE t SET id = -2 WHERE id = 2")

        src._chunks.after_read = touch
        got: list[Item] = []
        await catch_up(d, dsn, got)
        try:
            src.request_snapshot("public.t")
            got += await d.take(lambda items: bool(marks(items, MarkKind.INCREMENTAL_CHUNK)))
        finally:
            await writer.close()
        first = max(i for i, item in enumerate(d.pending) if isinstance(item, Mark)
                    and item.kind is MarkKind.INCREMENTAL_CHUNK)
        committed = list(d.pending[:first + 1])
        await d.commit(first + 1)
        state, position = d.state, d.position  # the daemon dies here: nothing after the first chunk is committed
    assert sorted(state["incremental"]["public.t"]["reread"]) == [["-2"], ["1"]]
    assert len(unavailable_updates(committed)) == 2
    async with Driver(cfg, position, state) as d:
        more = await d.take(lambda items: bool(marks(items, MarkKind.INCREMENTAL_DONE)))
        await catch_up(d, dsn, more)
        await d.commit()
        state = d.state
    assert replay(committed + more) == await toast_rows(dsn)
    reread = [i.key for i in more if isinstance(i, ChangeEvent) and i.snapshot and i.key in ((1,), (-2,))]
    assert sorted(reread) == [(-2,), (1,)], "the restart did not read the checkpoint's keys again"
    assert "reread" not in state["incremental"]["public.t"] and state["incremental"]["public.t"]["status"] == "done"


async def test_a_replaced_table_stays_listed_across_a_restart_until_its_snapshot_completes(
        pg_server: PostgresServer, pg_db: str, make_config: Callable[..., Config], sql: Callable[[str], str]) -> None:
    sql("CREATE TABLE a (id int PRIMARY KEY); CREATE TABLE t (id int PRIMARY KEY, v int, pad text); "
        "INSERT INTO t SELECT g, g, 'old' FROM generate_series(1, 300) g")
    dsn = pg_server.dsn(pg_db)
    cfg = make_config(["public.a", "public.t"], snapshot={"chunk_rows": 100},
                      source={"postgres": {"slot": f"s_{pg_db}", "publication": f"p_{pg_db}", "heartbeat_s": 0.2}})
    async with Driver(cfg) as d:
        src = source_of(d)
        got: list[Item] = []
        await catch_up(d, dsn, got)
        sql("DROP TABLE t; CREATE TABLE t (id int PRIMARY KEY, v int, pad text); "
            "INSERT INTO t SELECT g, -g, 'new' FROM generate_series(200, 450) g")
        await wait_for(lambda: "public.t" in src.status().get("tables_needing_snapshot", {}), timeout=60,
                       what="the re-created table in the status")
        await catch_up(d, dsn, got)
        await d.commit()
        state, position = d.state, d.position
    why = state["tables_needing_snapshot"]["public.t"]
    assert "dropped and re-created (relation OID" in why
    async with Driver(cfg, position, state) as d:  # a restart: the stream no longer sees an OID change
        src = source_of(d)
        assert src.status()["tables_needing_snapshot"] == {"public.t": why}
        more: list[Item] = []
        await catch_up(d, dsn, more)
        src.request_snapshot("public.t")
        more += await d.take(lambda items: bool(marks(items, MarkKind.INCREMENTAL_DONE)))
        await catch_up(d, dsn, more)
        await d.commit()
        state, position, status = d.state, d.position, src.status()
    assert "tables_needing_snapshot" not in status and "tables_needing_snapshot" not in state
    assert [m.detail for m in marks(more, MarkKind.INCREMENTAL_START) if not m.detail.get("queued")] == [
        {"table": "public.t", "where": None, "repairs": True}]
    assert replay_covered(got + more, "public.t") == await source_rows(dsn)
    async with Driver(cfg, position, state) as d:
        assert "tables_needing_snapshot" not in source_of(d).status()
