"""In-progress transaction streaming (pgoutput protocol 2) against a real PostgreSQL.

Each test's database has ``logical_decoding_work_mem = 64kB``, so a transaction of a few thousand rows
exceeds it while still running and the server streams it in blocks (the status counters prove it did).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from pg_helpers import Driver, changes, marks

from cdcd.config import Config
from cdcd.events import ChangeEvent, Item, Mark, MarkKind, Op
from cdcd.runtime.interfaces import ResumePoint
from cdcd.sources.postgres import PostgresSource
from cdcd.sources.postgres.inprogress import SUFFIX, spool_dir
from devtools.servers import PostgresServer

pytestmark = pytest.mark.pg18  # also on PostgreSQL 18 (docs/testing.md)

NEVER = {"mode": "never"}


@pytest.fixture
def small_work_mem(pg_server: PostgresServer, pg_db: str) -> str:
    """The test database's walsenders stream any transaction above 64 kB of changes."""
    pg_server.psql(f"ALTER DATABASE \"{pg_db}\" SET logical_decoding_work_mem = '64kB'")
    return pg_db


def _config(make_config: Callable[..., Config], db: str, tables: list[str], slot: str = "",
            stream: bool = True) -> Config:
    slot = slot or f"s_{db}"
    return make_config(tables, snapshot=NEVER, source={"postgres": {"slot": slot, "publication": f"p_{db}",
                                                                    "stream_in_progress": stream}})


def _spool_files(config: Config) -> list[Path]:
    d = spool_dir(config.state.path)
    return sorted(p for p in d.iterdir() if p.name.endswith(SUFFIX)) if d.is_dir() else []


def _commit_marks(items: list[Item]) -> list[Mark]:
    return marks(items, "commit")


async def _until_commits(d: Driver, n: int) -> list[Item]:
    seen = 0

    def enough(got: list[Item]) -> bool:  # looks at the newest item only: take() asks after every item
        nonlocal seen
        if got and isinstance(got[-1], Mark) and got[-1].kind == MarkKind.COMMIT:
            seen += 1
        return seen >= n

    return await d.take(enough, timeout=120)


def _ids(evs: list[ChangeEvent]) -> list[int]:
    return [int((e.after or e.before or {})["id"]) for e in evs]


@pytest.mark.usefixtures("small_work_mem")
async def test_large_transaction_is_streamed_and_lands_once_at_commit(
        pg_db: str, make_config: Callable[..., Config], sql: Callable[[str], str]) -> None:
    sql("CREATE TABLE t (id int PRIMARY KEY, v text)")
    cfg = _config(make_config, pg_db, ["public.t"])
    async with Driver(cfg) as d:
        sql("BEGIN; INSERT INTO t SELECT g, repeat('x', 40) FROM generate_series(1, 20000) g;"
            " UPDATE t SET v = 'y' WHERE id <= 100; DELETE FROM t WHERE id > 19900; COMMIT")
        sql("INSERT INTO t VALUES (0, 'after')")
        items = await _until_commits(d, 2)
        status = d.source.status()
    assert status["proto_version"] == 2
    assert status["in_progress"]["committed"] == 1, status  # the big transaction came as a stream
    assert status["in_progress"]["transactions"] == 0 and status["in_progress"]["spool_bytes"] == 0
    evs = changes(items)
    big, after = evs[:-1], evs[-1]
    assert [e.op for e in big] == [Op.CREATE] * 20000 + [Op.UPDATE] * 100 + [Op.DELETE] * 100
    assert _ids(big) == list(range(1, 20001)) + list(range(1, 101)) + list(range(19901, 20001))
    assert big[20000].after == {"id": 1, "v": "y"}
    # Positions as protocol 1 gives them: one commit LSN, seq from 1, the commit mark right after.
    commit = _commit_marks(items)[0]
    assert {e.position.lsn for e in big} == {commit.position.lsn}  # type: ignore[attr-defined]
    assert [e.position.seq for e in big] == list(range(1, 20201))  # type: ignore[attr-defined]
    assert commit.position.seq == 20201  # type: ignore[attr-defined]
    assert len({e.tx_id for e in big}) == 1 and big[0].commit_ts is not None
    assert after.after == {"id": 0, "v": "after"} and after.position > commit.position
    assert _spool_files(cfg) == []


@pytest.mark.usefixtures("small_work_mem")
async def test_values_larger_than_the_spool_read_block_land_whole(
        make_config: Callable[..., Config], pg_db: str, sql: Callable[[str], str]) -> None:
    sql("CREATE TABLE t (id int PRIMARY KEY, v text); ALTER TABLE t ALTER COLUMN v SET STORAGE EXTERNAL")
    cfg = _config(make_config, pg_db, ["public.t"])
    async with Driver(cfg) as d:
        sql("BEGIN; INSERT INTO t SELECT g, repeat(chr(64 + g), 9000000) FROM generate_series(1, 3) g;"
            " INSERT INTO t SELECT g, 'small' FROM generate_series(4, 2000) g; COMMIT")
        items = await _until_commits(d, 1)
        status = d.source.status()
    assert status["in_progress"]["committed"] == 1, status
    evs = changes(items)
    assert _ids(evs) == list(range(1, 2001))
    assert [e.after["v"] for e in evs[:3]] == [chr(64 + g) * 9000000 for g in (1, 2, 3)]  # type: ignore[index]


def _aborted_streams(server: PostgresServer, before_18: int) -> int:
    """How many already-aborted transactions the server streams: PostgreSQL 18 checks the commit log before it
    streams a transaction and drops one that aborted (it never reaches cdcd); 14-17 stream it, then abort it."""
    return before_18 if int(server.psql("SHOW server_version_num")) < 180000 else 0


@pytest.mark.usefixtures("small_work_mem")
async def test_aborted_streamed_transaction_lands_nothing(
        pg_server: PostgresServer, pg_db: str, make_config: Callable[..., Config], sql: Callable[[str], str]) -> None:
    sql("CREATE TABLE t (id int PRIMARY KEY, v text)")
    cfg = _config(make_config, pg_db, ["public.t"])
    async with Driver(cfg) as d:
        sql("BEGIN; INSERT INTO t SELECT g, repeat('x', 40) FROM generate_series(1, 20000) g; ROLLBACK")
        sql("INSERT INTO t VALUES (0, 'kept')")
        items = await _until_commits(d, 1)
        status = d.source.status()
    # PostgreSQL 18 does not stream a transaction the commit log already shows aborted: it is dropped unsent
    assert status["in_progress"]["aborted"] == _aborted_streams(pg_server, 1), status
    assert status["in_progress"]["committed"] == 0, status
    assert [(e.op, e.after) for e in changes(items)] == [(Op.CREATE, {"id": 0, "v": "kept"})]
    assert _spool_files(cfg) == []


@pytest.mark.usefixtures("small_work_mem")
async def test_rolled_back_subtransactions_of_a_streamed_transaction_land_nothing(
        pg_db: str, make_config: Callable[..., Config], sql: Callable[[str], str]) -> None:
    sql("CREATE TABLE t (id int PRIMARY KEY, v text)")
    cfg = _config(make_config, pg_db, ["public.t"])
    ins = "INSERT INTO t SELECT g, repeat('x', 40) FROM generate_series({}, {}) g;"
    async with Driver(cfg) as d:
        sql("BEGIN;" + ins.format(1, 3000) + "SAVEPOINT a;" + ins.format(3001, 6000)
            + "UPDATE t SET v = 'gone' WHERE id <= 10; ROLLBACK TO a;" + ins.format(6001, 9000)
            + "SAVEPOINT b;" + ins.format(9001, 12000) + "SAVEPOINT c;" + ins.format(12001, 15000)
            + "ROLLBACK TO c; RELEASE b; UPDATE t SET v = 'kept' WHERE id <= 10; COMMIT")
        items = await _until_commits(d, 1)
        status = d.source.status()
    assert status["in_progress"]["committed"] == 1, status
    assert status["in_progress"]["aborted_subtransactions"] >= 2, status  # both rollbacks hit spooled changes
    evs = changes(items)
    assert _ids(evs) == list(range(1, 3001)) + list(range(6001, 12001)) + list(range(1, 11))
    assert [e.op for e in evs] == [Op.CREATE] * 9000 + [Op.UPDATE] * 10
    assert all(e.after is not None and e.after["v"] != "gone" for e in evs)
    assert [e.position.seq for e in evs] == list(range(1, 9011))  # type: ignore[attr-defined]
    assert sql("SELECT count(*) FROM t") == "9000"


@pytest.mark.usefixtures("small_work_mem")
async def test_a_streamed_transaction_with_a_replication_origin_lands(
        pg_server: PostgresServer, pg_db: str, make_config: Callable[..., Config], sql: Callable[[str], str]) -> None:
    """A transaction a logical replication subscriber applied has an origin: its stream blocks start with an
    Origin message, which carries no xid (capturing a database that is itself a subscriber)."""
    sql("CREATE TABLE t (id int PRIMARY KEY, v text)")
    cfg = _config(make_config, pg_db, ["public.t"])
    conn = await asyncpg.connect(pg_server.dsn(pg_db))
    try:
        async with Driver(cfg) as d:
            await conn.execute(f"SELECT pg_replication_origin_create('o_{pg_db}')")
            await conn.execute(f"SELECT pg_replication_origin_session_setup('o_{pg_db}')")
            await conn.execute("BEGIN; INSERT INTO t SELECT g, repeat('x', 40) FROM generate_series(1, 5000) g; "
                               "COMMIT")
            items = await _until_commits(d, 1)
            status = d.source.status()
    finally:
        await conn.execute("SELECT pg_replication_origin_session_reset()")
        await conn.execute(f"SELECT pg_replication_origin_drop('o_{pg_db}')")
        await conn.close()
    assert status["in_progress"]["committed"] == 1, status
    assert _ids(changes(items)) == list(range(1, 5001))


@pytest.mark.usefixtures("small_work_mem")
async def test_interleaved_streamed_transactions_arrive_whole_in_commit_order(
        pg_server: PostgresServer, pg_db: str, make_config: Callable[..., Config], sql: Callable[[str], str]) -> None:
    sql("CREATE TABLE t (id int PRIMARY KEY, who text)")
    cfg = _config(make_config, pg_db, ["public.t"])
    a = await asyncpg.connect(pg_server.dsn(pg_db))
    b = await asyncpg.connect(pg_server.dsn(pg_db))
    try:
        async with Driver(cfg) as d:
            await a.execute("BEGIN")
            await b.execute("BEGIN")
            for r in range(4):  # rounds of 2000 rows each, alternating: the server streams both in turns
                await a.execute(f"INSERT INTO t SELECT g, 'a' FROM generate_series({r * 2000 + 1}, "
                                f"{r * 2000 + 2000}) g")
                await b.execute(f"INSERT INTO t SELECT g, 'b' FROM generate_series({100000 + r * 2000 + 1}, "
                                f"{100000 + r * 2000 + 2000}) g")
            sql("INSERT INTO t VALUES (-1, 'small')")  # committed while both streams are open
            await b.execute("COMMIT")
            await a.execute("INSERT INTO t VALUES (0, 'a')")
            await a.execute("COMMIT")
            items = await _until_commits(d, 3)
            status = d.source.status()
    finally:
        await a.close()
        await b.close()
    assert status["in_progress"]["committed"] == 2, status
    evs = changes(items)
    assert _ids(evs) == [-1, *range(100001, 108001), *range(1, 8001), 0]
    commits = _commit_marks(items)
    assert [i.position for i in items if not isinstance(i, Mark) or i.kind != MarkKind.HEARTBEAT] == \
        sorted(i.position for i in items if not isinstance(i, Mark) or i.kind != MarkKind.HEARTBEAT)
    assert [e.position.seq for e in evs[1:8001]] == list(range(1, 8001))  # type: ignore[attr-defined]
    assert [e.position.seq for e in evs[8001:]] == list(range(1, 8002))  # type: ignore[attr-defined]
    assert commits[1].position < evs[8001].position  # b's commit mark precedes a's events
    assert len({e.tx_id for e in evs[1:8001]}) == 1 and evs[1].tx_id != evs[8001].tx_id


def _landed(items: list[Item]) -> list[tuple[Any, ...]]:
    """What lands of each event and commit: position, op, table, images, unavailable columns, transaction."""
    out: list[tuple[Any, ...]] = []
    for i in items:
        if isinstance(i, ChangeEvent):
            out.append((str(i.position), i.op.value, str(i.schema.table), i.before, i.after, i.unavailable, i.tx_id,
                        i.commit_ts))
        elif isinstance(i, Mark) and i.kind == MarkKind.COMMIT:
            out.append((str(i.position), "commit", i.detail))
    return out


@pytest.mark.usefixtures("small_work_mem")
async def test_protocol_1_and_2_land_identical_events(
        pg_server: PostgresServer, pg_db: str, make_config: Callable[..., Config], sql: Callable[[str], str]) -> None:
    """The same workload through two slots, one with protocol 1 (the forced-off fallback), one with protocol 2:
    every event and commit lands with the same position, op and row."""
    sql("CREATE TABLE t (id int PRIMARY KEY, v text, n numeric(12,2));"
        "CREATE TABLE f (id int, big text, note text); ALTER TABLE f REPLICA IDENTITY FULL;"
        "ALTER TABLE f ALTER COLUMN big SET STORAGE EXTERNAL;"
        "CREATE TABLE other (id int PRIMARY KEY)")  # in the publication's database, not captured
    tables = ["public.t", "public.f"]
    one = _config(make_config, pg_db, tables, slot=f"s1_{pg_db}", stream=False)
    two = _config(make_config, pg_db, tables, slot=f"s2_{pg_db}", stream=True)
    conn = await asyncpg.connect(pg_server.dsn(pg_db))
    other = await asyncpg.connect(pg_server.dsn(pg_db))
    try:
        async with Driver(one) as d1, Driver(two) as d2:
            ins = "INSERT INTO t SELECT g, 'v' || g, g / 7.0 FROM generate_series({}, {}) g;"
            sql("INSERT INTO f VALUES (1, repeat('b', 5000), 'n'), (2, NULL, 'n')")
            sql("BEGIN;" + ins.format(1, 4000) + "SAVEPOINT s;" + ins.format(4001, 6000)
                + "INSERT INTO other SELECT generate_series(1, 500); ROLLBACK TO s;"
                + "INSERT INTO other SELECT generate_series(1, 3000);" + ins.format(6001, 8000)
                + "UPDATE t SET id = id + 100000 WHERE id <= 50; DELETE FROM t WHERE id BETWEEN 7000 AND 7100;"
                + "UPDATE f SET note = 'toast untouched'; COMMIT")
            await conn.execute("BEGIN")
            await conn.execute(ins.format(20001, 24000))
            await other.execute("BEGIN")
            await other.execute(ins.format(30001, 34000))
            sql("UPDATE t SET v = 'small' WHERE id = 1000")
            await other.execute("COMMIT")
            await conn.execute("UPDATE t SET n = NULL WHERE id > 20000")
            await conn.execute("COMMIT")
            sql("BEGIN;" + ins.format(40001, 45000) + "ROLLBACK")
            sql("BEGIN;" + ins.format(50001, 53000) + "TRUNCATE f; INSERT INTO f VALUES (3, 'x', 'y'); COMMIT")
            sql("INSERT INTO t VALUES (-1, 'end', 0)")
            want = 7
            got1 = await _until_commits(d1, want)
            got2 = await _until_commits(d2, want)
            s1, s2 = d1.source.status(), d2.source.status()
    finally:
        await conn.close()
        await other.close()
    assert s1["proto_version"] == 1 and "in_progress" not in s1
    assert s2["proto_version"] == 2 and s2["in_progress"]["committed"] >= 4, s2
    assert s2["in_progress"]["aborted"] >= _aborted_streams(pg_server, 1), s2
    assert s2["in_progress"]["aborted_subtransactions"] >= 1, s2
    l1, l2 = _landed(got1), _landed(got2)
    assert len(l1) > 20000
    assert l1 == l2
    assert _spool_files(one) == [] and _spool_files(two) == []


async def test_a_start_without_streaming_removes_an_earlier_runs_spool(
        pg_db: str, make_config: Callable[..., Config], sql: Callable[[str], str]) -> None:
    sql("CREATE TABLE t (id int PRIMARY KEY)")
    cfg = _config(make_config, pg_db, ["public.t"], stream=False)
    d = spool_dir(cfg.state.path)
    d.mkdir(parents=True)
    (d / f"77{SUFFIX}").write_bytes(b"left by a killed run")
    async with Driver(cfg) as drv:
        sql("INSERT INTO t VALUES (1)")
        await _until_commits(drv, 1)
        assert drv.source.status()["proto_version"] == 1
    assert _spool_files(cfg) == []


@pytest.mark.usefixtures("small_work_mem")
async def test_the_replay_of_a_streamed_transaction_lets_other_tasks_run(
        pg_db: str, make_config: Callable[..., Config], sql: Callable[[str], str]) -> None:
    """The replay reads a local file and never waits for the network: it must still yield to the event loop, or
    the runtime could not seal and land batches, nor the connection send status updates, until it ends."""
    sql("CREATE TABLE t (id int PRIMARY KEY, v text)")
    cfg = _config(make_config, pg_db, ["public.t"])
    source = PostgresSource(cfg)
    await source.connect(ResumePoint(None, {}))
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    task: asyncio.Task[None] | None = None
    stream = source.stream()
    try:
        sql("BEGIN; INSERT INTO t SELECT g, repeat('x', 40) FROM generate_series(1, 20000) g; COMMIT")
        at_first = at_commit = -1
        task = asyncio.create_task(ticker())
        async with asyncio.timeout(120):
            async for item in stream:  # directly, as the runtime's reader does: no wait_for per item
                if isinstance(item, ChangeEvent) and at_first < 0:
                    at_first = ticks
                elif isinstance(item, Mark) and item.kind == MarkKind.COMMIT:
                    at_commit = ticks
                    break
        assert source.status()["in_progress"]["committed"] == 1
        assert at_commit - at_first >= 5, (at_first, at_commit)  # 20,000 rows: about 10 replay lists
    finally:
        if task is not None:
            task.cancel()
        await stream.aclose()  # type: ignore[attr-defined]
        await source.close()
