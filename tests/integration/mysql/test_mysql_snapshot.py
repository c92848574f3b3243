"""Snapshot, handoff to the binlog under concurrent writes, resume mid-snapshot, snapshot modes."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from typing import Any

import aiomysql
import pytest
from my_helpers import Driver, apply, events_of
from source_driver import opening_truncate

from cdcd.config import Config
from cdcd.errors import SourceFatal
from cdcd.events import ChangeEvent, Mark
from devtools.servers import MariaDBServer


async def _writer(server: MariaDBServer, db: str, stop: asyncio.Event, seed: int) -> int:
    """Random inserts, updates (including key changes) and deletes until told to stop."""
    rnd = random.Random(seed)
    conn = await aiomysql.connect(host="127.0.0.1", port=server.port, user="root", password="", db=db,
                                  autocommit=True)
    n = 0
    try:
        async with conn.cursor() as cur:
            while not stop.is_set():
                k = rnd.randrange(1, 400)
                op = rnd.random()
                if op < 0.4:
                    await cur.execute("INSERT INTO t (id, v) VALUES (%s, %s) ON DUPLICATE KEY UPDATE v = v + 1",
                                      (k, n))
                elif op < 0.7:
                    await cur.execute("UPDATE t SET v = v + 1 WHERE id = %s", (k,))
                elif op < 0.85:
                    await cur.execute("UPDATE IGNORE t SET id = %s WHERE id = %s", (k + 1000, k))
                else:
                    await cur.execute("DELETE FROM t WHERE id = %s", (k,))
                n += 1
                if n % 20 == 0:
                    await asyncio.sleep(0)
    finally:
        conn.close()
    return n


async def _table(server: MariaDBServer, db: str) -> dict[Any, dict[str, Any]]:
    conn = await aiomysql.connect(host="127.0.0.1", port=server.port, user="root", password="", db=db)
    try:
        async with conn.cursor(aiomysql.DictCursor) as cur:
            await cur.execute("SELECT id, v FROM t")
            return {(r["id"],): dict(r) for r in await cur.fetchall()}
    finally:
        conn.close()


@pytest.mark.parametrize("parallelism", [1, 2])
async def test_handoff_under_concurrent_writes_converges(maria_server: MariaDBServer, maria_db: str,
                                                         make_config: Callable[..., Config],
                                                         sql: Callable[..., Any], parallelism: int) -> None:
    sql("CREATE TABLE t (id INT PRIMARY KEY, v INT)", "CREATE TABLE u (id INT PRIMARY KEY, v INT)")
    sql("INSERT INTO t (id, v) SELECT seq, 0 FROM seq_1_to_300", "INSERT INTO u SELECT seq, 0 FROM seq_1_to_50")
    config = make_config(["t", "u"], snapshot={"chunk_rows": 7, "parallelism": parallelism})
    stop = asyncio.Event()
    writer = asyncio.create_task(_writer(maria_server, maria_db, stop, seed=parallelism))
    await asyncio.sleep(0.2)
    mirror: dict[Any, dict[str, Any]] = {}
    async with Driver(config) as d:
        got = await d.until_mark("snapshot_done")
        snap = events_of(got)
        assert all(e.snapshot and e.position == got[-1].position for e in snap)
        assert {str(e.table) for e in snap} == {f"{maria_db}.t", f"{maria_db}.u"}
        apply(mirror, [e for e in snap if e.table.name == "t"])
        await asyncio.sleep(0.3)
        stop.set()
        writes = await writer
        assert writes > 0
        sql("INSERT INTO t VALUES (100000, 1)")  # a sentinel: everything before it has been streamed
        rest = await d.take(lambda items: any(isinstance(i, ChangeEvent) and i.key == (100000,) for i in items))
    stream = [e for e in events_of(rest) if e.table.name == "t"]
    assert all(not e.snapshot and e.position > got[-1].position for e in stream)
    apply(mirror, stream)
    assert mirror == await _table(maria_server, maria_db)


async def test_crash_mid_snapshot_resumes_after_the_last_committed_key(
        maria_server: MariaDBServer, maria_db: str, make_config: Callable[..., Config],
        sql: Callable[..., Any]) -> None:
    sql("CREATE TABLE t (a INT, b VARCHAR(5), v INT, PRIMARY KEY (b, a))",
        "INSERT INTO t SELECT seq % 7, CHAR(65 + seq % 5), seq FROM seq_1_to_35")
    config = make_config(["t"], snapshot={"chunk_rows": 4})
    async with Driver(config) as d:
        got = await d.events(13)
        await d.commit()  # 13 rows acked; the rest is lost with the "crash"
        position, state = d.position, d.state
    first = [e.key for e in got]
    assert state["snapshot"]["done"] is False and state["snapshot"]["tables"][f"{maria_db}.t"]["last_key"]
    sql("INSERT INTO t VALUES (100, 'Z', 1)", "DELETE FROM t WHERE v = 35")  # changes after the watermark
    async with Driver(config, position, state) as d2:
        items = await d2.until_mark("snapshot_done")
        again = [e.key for e in events_of(items)]
        assert not set(first) & set(again), "an acked key was snapshotted again"
        assert all(i.position == position for i in items)  # still at the original watermark
        rest = await d2.events(2)
    mirror = apply({}, events_of(got) + events_of(items) + rest)
    conn_rows = await _table_ab(maria_server, maria_db)
    assert mirror == conn_rows


async def _table_ab(server: MariaDBServer, db: str) -> dict[Any, dict[str, Any]]:
    conn = await aiomysql.connect(host="127.0.0.1", port=server.port, user="root", password="", db=db)
    try:
        async with conn.cursor(aiomysql.DictCursor) as cur:
            await cur.execute("SELECT a, b, v FROM t")
            return {(r["a"], r["b"]): dict(r) for r in await cur.fetchall()}
    finally:
        conn.close()


async def test_mode_initial_only_ends_after_the_snapshot(make_config: Callable[..., Config],
                                                         sql: Callable[..., Any]) -> None:
    sql("CREATE TABLE t (id INT PRIMARY KEY)", "INSERT INTO t VALUES (1), (2)")
    config = make_config(["t"], snapshot={"mode": "initial_only"})
    async with Driver(config) as d:
        items = await d.take(lambda _: False)
        assert d.ended
        await d.commit()
        state, position = d.state, d.position
    assert len(events_of(items)) == 2 and isinstance(items[-1], Mark) and items[-1].kind == "snapshot_done"
    async with Driver(config, position, state) as d2:
        assert await d2.take(lambda _: False) == [] and d2.ended


async def test_mode_never_streams_from_now(make_config: Callable[..., Config], sql: Callable[..., Any]) -> None:
    sql("CREATE TABLE t (id INT PRIMARY KEY)", "INSERT INTO t VALUES (1), (2)")
    async with Driver(make_config(["t"], snapshot={"mode": "never"})) as d:
        sql("INSERT INTO t VALUES (3)")
        evs = await d.events(1)
    assert [(e.snapshot, e.after) for e in evs] == [(False, {"id": 3})]


async def test_mode_when_needed_resnapshots_when_the_binlog_is_gone(
        make_config: Callable[..., Config], sql: Callable[..., Any]) -> None:
    from test_mysql_streaming import purge_until_gone

    sql("CREATE TABLE t (id INT PRIMARY KEY)", "INSERT INTO t VALUES (1)")
    strict = make_config(["t"])
    async with Driver(strict) as d:
        await d.until_mark("snapshot_done")
        await d.commit()
        position, state = d.position, d.state
    sql("FLUSH BINARY LOGS", "INSERT INTO t VALUES (2)", "FLUSH BINARY LOGS")
    purge_until_gone(sql, position.file)  # type: ignore[union-attr]
    refused = Driver(strict, position, state)
    with pytest.raises(SourceFatal):
        await refused.__aenter__()
    await refused.source.close()
    lenient = strict.model_copy(update={"snapshot": strict.snapshot.model_copy(update={"mode": "when_needed"})})
    async with Driver(lenient, position, state) as d2:
        items = await d2.until_mark("snapshot_done")
    assert sorted(e.after["id"] for e in events_of(items)) == [1, 2]  # type: ignore[index]
    assert items[0].position > position  # type: ignore[operator]
    # the re-snapshot supersedes what was landed before: it opens with a truncate at its own watermark
    opening = [i for i in items if opening_truncate(i)]
    assert len(opening) == 1 and opening[0].position == events_of(items)[0].position
