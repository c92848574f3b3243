"""Incremental snapshots on a real MariaDB: chunks read while the binlog streams, exact under concurrent writes.

The tests marked with ``watermark`` run with both low-watermark strategies: MariaDB's exact snapshot position and the
bracketing position MySQL uses (``source.mysql.incremental_watermark = "bracketing"``; docs/mysql.md)."""

from __future__ import annotations

import asyncio
import itertools
import random
from collections.abc import Callable
from typing import Any

import aiomysql
import pymysql
import pytest
from my_helpers import Driver
from source_driver import replay_covered

from cdcd.capture.incremental import SnapshotJob
from cdcd.config import Config
from cdcd.errors import ConfigError
from cdcd.events import ChangeEvent, Item, Mark, MarkKind
from cdcd.positions import MySqlPosition
from cdcd.sources.mysql import MySqlSource
from devtools.servers import MariaDBServer

ROWS = 3000
pytestmark = pytest.mark.filterwarnings("ignore:Duplicate entry")  # the workload's INSERT IGNORE / UPDATE IGNORE
_sentinel = itertools.count(1)


#: Both low-watermark strategies ("auto" is MariaDB's exact snapshot position).
WATERMARKS = pytest.mark.parametrize("watermark", ["exact", "bracketing"])


def with_watermark(cfg: Config, watermark: str) -> Config:
    """``cfg`` with ``source.mysql.incremental_watermark`` set."""
    mysql = cfg.source.mysql.model_copy(update={"incremental_watermark": watermark})
    return cfg.model_copy(update={"source": cfg.source.model_copy(update={"mysql": mysql})})


async def connect(server: MariaDBServer, db: str) -> aiomysql.Connection:
    return await aiomysql.connect(host="127.0.0.1", port=server.port, user="root", password="", db=db,
                                  autocommit=True)


async def workload(server: MariaDBServer, db: str, stop: asyncio.Event, seed: int, counts: dict[str, int]) -> None:
    rnd = random.Random(seed)
    conn = await connect(server, db)
    try:
        while not stop.is_set():
            async with conn.cursor() as cur:
                await cur.execute("BEGIN")
                done: list[str] = []
                try:
                    for _ in range(rnd.randint(1, 4)):
                        k, op = rnd.randint(1, ROWS * 2), rnd.choice(["insert", "update", "rekey", "delete"])
                        if op == "insert":
                            await cur.execute("INSERT IGNORE INTO t VALUES (%s, %s, 'w')", (k, rnd.randint(0, 10**6)))
                        elif op == "update":
                            await cur.execute("UPDATE t SET v = v + 1, pad = 'u' WHERE id = %s", (k,))
                        elif op == "rekey":
                            await cur.execute("UPDATE IGNORE t SET id = %s WHERE id = %s",
                                              (rnd.randint(1, ROWS * 2), k))
                        else:
                            await cur.execute("DELETE FROM t WHERE id = %s", (k,))
                        done.append(op)
                    await cur.execute("COMMIT")
                except pymysql.err.OperationalError as exc:
                    if exc.args[0] not in (1205, 1213):  # lock wait timeout, deadlock: InnoDB rolled back, go on
                        raise
                    await cur.execute("ROLLBACK")
                    continue
                for op in done:
                    counts[op] = counts.get(op, 0) + 1
            # A short pause per transaction: unpaced writers outran the binlog reader on a loaded machine, and a
            # chunk waits for the stream to reach its high watermark, so the snapshot never ended.
            await asyncio.sleep(0.003)
    finally:
        conn.close()


async def source_rows(server: MariaDBServer, db: str) -> dict[tuple[Any, ...], dict[str, Any]]:
    conn = await connect(server, db)
    try:
        async with conn.cursor() as cur:
            await cur.execute("SELECT id, v, pad FROM t")
            return {(r[0],): {"id": r[0], "v": r[1], "pad": r[2]} for r in await cur.fetchall()}
    finally:
        conn.close()


def replay(items: list[Item]) -> dict[tuple[Any, ...], dict[str, Any]]:
    mirror: dict[tuple[Any, ...], dict[str, Any]] = {}
    for e in sorted((i for i in items if isinstance(i, ChangeEvent) and i.table.name == "t"),
                    key=lambda e: e.position):
        if e.op.value == "d":
            mirror.pop(e.key, None)  # type: ignore[arg-type]
        elif e.op.value == "t":
            mirror.clear()
        else:
            if e.before_key is not None:
                mirror.pop(e.before_key, None)
            mirror[e.key] = dict(e.after or {})  # type: ignore[index]
    return mirror


async def catch_up(d: Driver, server: MariaDBServer, db: str, got: list[Item]) -> None:
    """Pull until a sentinel row written now arrives: everything committed before is delivered."""
    n = next(_sentinel)
    conn = await connect(server, db)
    try:
        async with conn.cursor() as cur:
            await cur.execute("INSERT INTO s VALUES (%s)", (n,))
    finally:
        conn.close()
    got += await d.take(lambda items: bool(items) and isinstance(items[-1], ChangeEvent)
                        and items[-1].table.name == "s" and items[-1].key == (n,), timeout=120)


def marks(items: list[Item], kind: MarkKind) -> list[Mark]:
    return [i for i in items if isinstance(i, Mark) and i.kind is kind]


@WATERMARKS
async def test_incremental_snapshot_under_a_concurrent_workload_equals_the_source(
        maria_server: MariaDBServer, maria_db: str, make_config: Callable[..., Config],
        sql: Callable[..., list[Any]], watermark: str) -> None:
    sql("CREATE TABLE t (id int PRIMARY KEY, v int, pad varchar(20))", "CREATE TABLE s (id int PRIMARY KEY)",
        f"INSERT INTO t SELECT seq, seq, 'p' FROM seq_1_to_{ROWS}")
    cfg = with_watermark(make_config(["t", "s"], snapshot={"mode": "never", "chunk_rows": 150}), watermark)
    chunk_deletes: list[int] = []
    async with Driver(cfg) as d:
        src = d.source
        assert isinstance(src, MySqlSource)
        fixer = await connect(maria_server, maria_db)

        async def change_the_chunk(job: SnapshotJob) -> None:
            # Between the chunk's read and its HW: delete a row the read returned, change another's value and a
            # third one's key. The deleted row must not come back.
            after = int(job.last_key[0]) if job.last_key else 0
            async with fixer.cursor() as cur:
                await cur.execute("SELECT id FROM t WHERE id > %s ORDER BY id LIMIT 3", (after,))
                ids = [r[0] for r in await cur.fetchall()]
                if len(ids) == 3:
                    await cur.execute("DELETE FROM t WHERE id = %s", (ids[0],))
                    await cur.execute("UPDATE t SET v = -v WHERE id = %s", (ids[1],))
                    await cur.execute("UPDATE t SET id = -id WHERE id = %s", (ids[2],))
                    chunk_deletes.append(ids[0])

        src._chunks.after_read = change_the_chunk
        got: list[Item] = []
        await catch_up(d, maria_server, maria_db, got)
        with pytest.raises(ConfigError, match=r"'x\.nope' is not captured; source\.tables lists: "):
            src.request_snapshot("x.nope")
        stop = asyncio.Event()
        counts: dict[str, int] = {}
        writers = [asyncio.create_task(workload(maria_server, maria_db, stop, seed, counts)) for seed in range(3)]
        try:
            src.request_snapshot(f"{maria_db}.t")
            got += await d.take(lambda items: bool(items) and isinstance(items[-1], Mark)
                                and items[-1].kind is MarkKind.INCREMENTAL_DONE, timeout=240)
        finally:
            stop.set()
            await asyncio.gather(*writers)
            fixer.close()
        await catch_up(d, maria_server, maria_db, got)
        progress = src.snapshot_progress()
    assert src._chunks.strategy == watermark
    assert min(counts.get(op, 0) for op in ("insert", "update", "rekey", "delete")) > 20, counts
    assert len(chunk_deletes) >= 10
    chunks = marks(got, MarkKind.INCREMENTAL_CHUNK)
    assert len(chunks) >= 20
    expected = await source_rows(maria_server, maria_db)
    mirror = replay(got)
    resurrected = [k for k in chunk_deletes if (k,) in mirror and (k,) not in expected]
    assert not resurrected, f"rows deleted while their chunk was read came back: {resurrected}"
    assert mirror == expected
    covered = marks(got, MarkKind.SNAPSHOT_COVERED)
    assert len(covered) == 1 and covered[0].detail["table"] == f"{maria_db}.t"
    assert isinstance(covered[0].detail["below"], MySqlPosition)
    assert progress[0]["state"] == "done" and progress[0]["chunks"] == len(chunks)


@WATERMARKS
async def test_changes_committed_after_the_reads_snapshot_began_supersede_its_rows(
        maria_server: MariaDBServer, maria_db: str, make_config: Callable[..., Config],
        sql: Callable[..., list[Any]], watermark: str) -> None:
    """Once a chunk's snapshot is open (before its SELECT) another connection deletes one row of the chunk and
    changes another: the read cannot see either, so both changes must lie after the chunk's LW and supersede its
    rows. A bracketing LW read after the read's start would put them before it: the deleted row would come back
    and the changed one keep its old value."""
    sql("CREATE TABLE t (id int PRIMARY KEY, v int, pad varchar(20))", "CREATE TABLE s (id int PRIMARY KEY)",
        "INSERT INTO t SELECT seq, seq, 'p' FROM seq_1_to_1000")
    cfg = with_watermark(make_config(["t", "s"], snapshot={"mode": "never", "chunk_rows": 100}), watermark)
    hidden: list[tuple[int, int, int]] = []  # (chunk, deleted id, changed id)
    async with Driver(cfg) as d:
        src = d.source
        assert isinstance(src, MySqlSource)
        other = await connect(maria_server, maria_db)

        async def change_unseen(job: SnapshotJob) -> None:
            after = int(job.last_key[0]) if job.last_key else 0
            async with other.cursor() as cur:
                await cur.execute("SELECT id FROM t WHERE id > %s ORDER BY id LIMIT 2", (after,))
                ids = [r[0] for r in await cur.fetchall()]
                if len(ids) == 2:
                    await cur.execute("DELETE FROM t WHERE id = %s", (ids[0],))
                    await cur.execute("UPDATE t SET v = -v, pad = 'unseen' WHERE id = %s", (ids[1],))
                    hidden.append((job.chunks, ids[0], ids[1]))

        src._chunks.before_select = change_unseen
        got: list[Item] = []
        try:
            await catch_up(d, maria_server, maria_db, got)
            src.request_snapshot(f"{maria_db}.t")
            got += await d.take(lambda items: bool(marks(items, MarkKind.INCREMENTAL_DONE)), timeout=120)
            await catch_up(d, maria_server, maria_db, got)
        finally:
            other.close()
    assert src._chunks.strategy == watermark
    assert len(hidden) == 10, hidden  # one pair in each of the ten full chunks (the eleventh is empty)
    chunk_lw = [MySqlPosition.at(m.detail["lw"]["file"], m.detail["lw"]["pos"])
                for m in marks(got, MarkKind.INCREMENTAL_CHUNK)]
    for chunk, deleted, changed in hidden:
        for key, op in ((deleted, "d"), (changed, "u")):
            ev = [e for e in got if isinstance(e, ChangeEvent) and e.table.name == "t" and e.key == (key,)
                  and e.op.value == op and not e.snapshot]
            assert len(ev) == 1
            lw = chunk_lw[chunk]
            assert (ev[0].position.file_index, ev[0].position.pos) >= (lw.file_index, lw.pos), \
                f"chunk {chunk}: a change its read could not see ({ev[0].position}) lies before its LW ({lw})"
    rows = {e.key for e in got if isinstance(e, ChangeEvent) and e.snapshot}
    assert not rows & {(k,) for _, k, _ in hidden}, "a row deleted before the read's SELECT came back"
    assert not rows & {(k,) for _, _, k in hidden}, "a chunk row its read saw stale was not superseded"
    mirror = replay(got)
    assert mirror == await source_rows(maria_server, maria_db)
    assert all(mirror[(k,)]["pad"] == "unseen" for _, _, k in hidden)


async def test_the_bracketing_fence_waits_for_the_binlog_reader_to_reach_the_low_watermark(
        maria_server: MariaDBServer, maria_db: str, make_config: Callable[..., Config],
        sql: Callable[..., list[Any]]) -> None:
    """The binlog reader is held back (nothing is pulled while one transaction of 30,000 rows fills its
    hand-over queue): the chunk's snapshot must not begin before the reader has read up to the chunk's LW, or a
    transaction just before the LW could be one whose engine commit has not run. Without the fence the snapshot
    would begin while the reader is still inside that transaction."""
    sql("CREATE TABLE t (id int PRIMARY KEY, v int, pad varchar(20))", "CREATE TABLE s (id int PRIMARY KEY)",
        "INSERT INTO t SELECT seq, seq, 'p' FROM seq_1_to_300")
    cfg = with_watermark(make_config(["t", "s"], snapshot={"mode": "never", "chunk_rows": 100}), "bracketing")
    began: list[tuple[int, tuple[str, int] | None]] = []  # (chunk, where the binlog reader was) at each snapshot
    async with Driver(cfg) as d:
        src = d.source
        assert isinstance(src, MySqlSource)

        async def note(job: SnapshotJob) -> None:
            reader = src._stream.reader
            began.append((job.chunks, reader.read_upto if reader is not None else None))

        src._chunks.before_select = note
        got: list[Item] = []
        await catch_up(d, maria_server, maria_db, got)
        sql("INSERT INTO s SELECT seq FROM seq_1000001_to_1030000")  # more items than the hand-over queue holds
        src.request_snapshot(f"{maria_db}.t")
        await wait_for(lambda: bool(began) or src._chunks.waiting == "binlog reader",
                       "the first chunk read under way while nothing is pulled")
        assert not began, "the first chunk's snapshot began while the binlog reader was held back"
        got += await d.take(lambda items: bool(items) and isinstance(items[-1], Mark)
                            and items[-1].kind is MarkKind.INCREMENTAL_DONE, timeout=120)
        await catch_up(d, maria_server, maria_db, got)
    lws = [m.detail["lw"] for m in marks(got, MarkKind.INCREMENTAL_CHUNK)]
    assert len(began) == len(lws) == 4
    for chunk, upto in began:
        assert upto is not None
        at, lw = MySqlPosition.at(*upto), MySqlPosition.at(lws[chunk]["file"], lws[chunk]["pos"])
        assert (at.file_index, at.pos) >= (lw.file_index, lw.pos), f"chunk {chunk}: reader at {upto}, LW {lw}"
    assert replay(got) == await source_rows(maria_server, maria_db)


@WATERMARKS
async def test_an_idle_binlog_still_delivers_the_chunks_and_a_restart_resumes(
        maria_server: MariaDBServer, maria_db: str, make_config: Callable[..., Config],
        sql: Callable[..., list[Any]], watermark: str) -> None:
    sql("CREATE TABLE t (id int PRIMARY KEY, v int, pad varchar(20))", "CREATE TABLE s (id int PRIMARY KEY)",
        "INSERT INTO t SELECT seq, seq, 'p' FROM seq_1_to_1000")
    cfg = with_watermark(make_config(["t", "s"], snapshot={"mode": "never", "chunk_rows": 100}), watermark)
    async with Driver(cfg) as d:
        got: list[Item] = []
        await catch_up(d, maria_server, maria_db, got)
        d.source.request_snapshot(f"{maria_db}.t")
        got += await d.take(lambda items: len(marks(items, MarkKind.INCREMENTAL_CHUNK)) == 3, timeout=60)
        third = max(i for i, item in enumerate(d.pending) if isinstance(item, Mark)
                    and item.kind is MarkKind.INCREMENTAL_CHUNK)
        committed = list(d.pending[:third + 1])
        await d.commit(third + 1)
        state, position = d.state, d.position
    assert state["incremental"][f"{maria_db}.t"]["last_key"] == [300]
    sql("DELETE FROM t WHERE id IN (5, 500)", "UPDATE t SET v = 0 WHERE id = 600")
    async with Driver(cfg, position, state) as d:
        more = await d.take(lambda items: bool(marks(items, MarkKind.INCREMENTAL_DONE)), timeout=60)
        await catch_up(d, maria_server, maria_db, more)
    rows = [i for i in more if isinstance(i, ChangeEvent) and i.snapshot]
    assert min(r.key for r in rows) == (301,), "the restart read again what the checkpoint held"
    assert replay(committed + more) == await source_rows(maria_server, maria_db)


async def test_a_table_added_to_source_tables_is_snapshotted_while_streaming(
        maria_server: MariaDBServer, maria_db: str, make_config: Callable[..., Config],
        sql: Callable[..., list[Any]]) -> None:
    sql("CREATE TABLE a (id int PRIMARY KEY)", "CREATE TABLE s (id int PRIMARY KEY)",
        "CREATE TABLE t (id int PRIMARY KEY, v int, pad varchar(20))",
        "INSERT INTO t SELECT seq, seq, 'p' FROM seq_1_to_500")
    async with Driver(make_config(["a", "s"], snapshot={"mode": "never", "chunk_rows": 100})) as d:
        got: list[Item] = []
        await catch_up(d, maria_server, maria_db, got)
        await d.commit()
        state, position = d.state, d.position
    assert state["tables"] == [f"{maria_db}.a", f"{maria_db}.s"]
    sql("INSERT INTO t VALUES (1000, 1, 'before')", "INSERT INTO a VALUES (1)")
    async with Driver(make_config(["t", "s"], snapshot={"mode": "never", "chunk_rows": 100}), position, state) as d:
        got = await d.take(lambda items: bool(marks(items, MarkKind.INCREMENTAL_DONE)), timeout=60)
        sql("INSERT INTO a VALUES (2)", "UPDATE t SET v = -1 WHERE id = 1")
        await catch_up(d, maria_server, maria_db, got)
        await d.commit()
        state = d.state
    assert [m.detail for m in marks(got, MarkKind.INCREMENTAL_START)] == [{"table": f"{maria_db}.t", "where": None}]
    assert state["tables"] == [f"{maria_db}.s", f"{maria_db}.t"]
    assert state["incremental"][f"{maria_db}.t"]["status"] == "done"
    assert not [i for i in got if isinstance(i, ChangeEvent) and i.table.name == "a"], "a removed table streamed"
    assert replay(got) == await source_rows(maria_server, maria_db)
    # the chunks' rows (no schema history yet) carry the column ids the stream's table map gives the table
    t_events = [i for i in got if isinstance(i, ChangeEvent) and i.table.name == "t"]
    assert {e.snapshot for e in t_events} == {True, False}
    assert {tuple(c.id for c in e.schema.columns) for e in t_events} == {(1, 2, 3)}


async def wait_for(predicate: Callable[[], bool], what: str, timeout: float = 60) -> None:
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.05)
    assert predicate(), what


async def test_reload_tables_on_the_running_source_under_a_workload(
        maria_server: MariaDBServer, maria_db: str, make_config: Callable[..., Config],
        sql: Callable[..., list[Any]]) -> None:
    """The binlog reader's table filter follows a live reload: the stream is read again with it, the added table is
    snapshotted while a workload writes to it, the removed one stops; a table that does not exist changes nothing."""
    sql("CREATE TABLE a (id int PRIMARY KEY)", "CREATE TABLE s (id int PRIMARY KEY)",
        "CREATE TABLE t (id int PRIMARY KEY, v int, pad varchar(20))",
        f"INSERT INTO t SELECT seq, seq, 'p' FROM seq_1_to_{ROWS}")
    async with Driver(make_config(["a", "s"], snapshot={"mode": "never", "chunk_rows": 200})) as d:
        src = d.source
        assert isinstance(src, MySqlSource)
        got: list[Item] = []
        await catch_up(d, maria_server, maria_db, got)
        with pytest.raises(ConfigError, match=r"must be written as 'schema\.table'"):
            src.reload_tables(["nodot"])
        src.reload_tables([f"{maria_db}.a", f"{maria_db}.s", f"{maria_db}.nope"])
        await wait_for(lambda: bool(src.status().get("table_reload_error")), "the failed reload in the status")
        assert f"table {maria_db}.nope does not exist" in src.status()["table_reload_error"]
        sql("INSERT INTO a VALUES (1)")
        await catch_up(d, maria_server, maria_db, got)
        stop = asyncio.Event()
        counts: dict[str, int] = {}
        writers = [asyncio.create_task(workload(maria_server, maria_db, stop, seed, counts)) for seed in range(3)]
        try:
            await asyncio.sleep(0.3)  # the workload's changes of t before the reload are not captured
            src.reload_tables([f"{maria_db}.s", f"{maria_db}.t"])
            got += await d.take(lambda items: bool(marks(items, MarkKind.INCREMENTAL_DONE)), timeout=240)
        finally:
            stop.set()
            await asyncio.gather(*writers)
        sql("INSERT INTO a VALUES (2)", "UPDATE t SET v = -1 WHERE id = 1")
        await catch_up(d, maria_server, maria_db, got)
        await d.commit()
        state, status = d.state, src.status()
    assert min(counts.get(op, 0) for op in ("insert", "update", "rekey", "delete")) > 5, counts
    assert [m.detail for m in marks(got, MarkKind.INCREMENTAL_START)] == [{"table": f"{maria_db}.t", "where": None}]
    assert state["tables"] == [f"{maria_db}.s", f"{maria_db}.t"]
    assert state["incremental"][f"{maria_db}.t"]["status"] == "done"
    reloaded = got.index(marks(got, MarkKind.TABLES)[-1])
    assert [i.key for i in got[:reloaded] if isinstance(i, ChangeEvent) and i.table.name == "a"] == [(1,)]
    assert not [i for i in got[reloaded:] if isinstance(i, ChangeEvent) and i.table.name == "a"], \
        "a removed table streamed"
    assert status["reconnects"] == 0 and "table_reload_error" not in status
    assert replay(got) == await source_rows(maria_server, maria_db)


async def test_a_table_removed_while_its_snapshot_runs_is_cancelled(
        maria_server: MariaDBServer, maria_db: str, make_config: Callable[..., Config],
        sql: Callable[..., list[Any]]) -> None:
    sql("CREATE TABLE s (id int PRIMARY KEY)", "CREATE TABLE t (id int PRIMARY KEY, v int, pad varchar(20))",
        "INSERT INTO t SELECT seq, seq, 'p' FROM seq_1_to_1000")
    async with Driver(make_config(["s", "t"], snapshot={"mode": "never", "chunk_rows": 100})) as d:
        src = d.source
        assert isinstance(src, MySqlSource)

        async def remove_t(job: SnapshotJob) -> None:
            if job.chunks == 2 and not src._incr._work:  # the third chunk is read: reload before the fourth
                src.reload_tables([f"{maria_db}.s"])

        src._chunks.after_read = remove_t
        got: list[Item] = []
        await catch_up(d, maria_server, maria_db, got)
        src.request_snapshot(f"{maria_db}.t")

        async def writes() -> None:  # marks go with the next streamed item: keep the binlog moving
            for n in itertools.count(10**6):
                await asyncio.to_thread(sql, f"INSERT INTO s VALUES ({n})")
                await asyncio.sleep(0.2)

        writer = asyncio.create_task(writes())
        try:
            got += await d.take(lambda items: bool(marks(items, MarkKind.INCREMENTAL_DONE)), timeout=60)
        finally:
            writer.cancel()
            await asyncio.gather(writer, return_exceptions=True)
        sql("UPDATE t SET v = 0 WHERE id = 1")
        await catch_up(d, maria_server, maria_db, got)
        await d.commit()
        state, progress = d.state, src.snapshot_progress()
    done = marks(got, MarkKind.INCREMENTAL_DONE)
    assert [m.detail for m in done] == [{"table": f"{maria_db}.t",
                                         "cancelled": "the table was removed from source.tables"}]
    assert len(marks(got, MarkKind.INCREMENTAL_CHUNK)) == 3 and not marks(got, MarkKind.SNAPSHOT_COVERED)
    assert state["incremental"][f"{maria_db}.t"]["status"] == "cancelled"
    assert state["tables"] == [f"{maria_db}.s"]
    assert [(p["state"], p["chunks"]) for p in progress] == [("cancelled", 3)]
    assert not [i for i in got if isinstance(i, ChangeEvent) and i.table.name == "t" and not i.snapshot]


async def test_a_table_dropped_and_recreated_is_named_and_cdcd_snapshot_repairs_it(
        maria_server: MariaDBServer, maria_db: str, make_config: Callable[..., Config],
        sql: Callable[..., list[Any]]) -> None:
    sql("CREATE TABLE s (id int PRIMARY KEY)", "CREATE TABLE t (id int PRIMARY KEY, v int, pad varchar(20))",
        "INSERT INTO t SELECT seq, seq, 'old' FROM seq_1_to_300")
    async with Driver(make_config(["s", "t"], snapshot={"chunk_rows": 100})) as d:
        src = d.source
        assert isinstance(src, MySqlSource)
        got: list[Item] = []
        await catch_up(d, maria_server, maria_db, got)
        # in a thread: the DROP waits for metadata locks that the event loop's connections release
        await asyncio.to_thread(sql, "DROP TABLE t", "CREATE TABLE t (id int PRIMARY KEY, v int, pad varchar(20))",
                                "INSERT INTO t SELECT seq, -seq, 'new' FROM seq_200_to_450",
                                "DROP TEMPORARY TABLE IF EXISTS s")
        await catch_up(d, maria_server, maria_db, got)
        why = src.status()["tables_needing_snapshot"]
        src.request_snapshot(f"{maria_db}.t")
        got += await d.take(lambda items: bool(marks(items, MarkKind.INCREMENTAL_DONE)), timeout=60)
        sql("UPDATE t SET v = 0 WHERE id = 450", "INSERT INTO t VALUES (1000, 1, 'after')")
        await catch_up(d, maria_server, maria_db, got)
        status = src.status()
    assert list(why) == [f"{maria_db}.t"] and "the binlog has `DROP TABLE" in why[f"{maria_db}.t"]
    assert "tables_needing_snapshot" not in status
    assert replay_covered(got, f"{maria_db}.t") == await source_rows(maria_server, maria_db)
    assert [m.detail["table"] for m in marks(got, MarkKind.SNAPSHOT_COVERED)] == [f"{maria_db}.t"]


async def test_a_replaced_table_stays_listed_across_a_restart_until_its_snapshot_completes(
        maria_server: MariaDBServer, maria_db: str, make_config: Callable[..., Config],
        sql: Callable[..., list[Any]]) -> None:
    sql("CREATE TABLE s (id int PRIMARY KEY)", "CREATE TABLE t (id int PRIMARY KEY, v int, pad varchar(20))",
        "INSERT INTO t SELECT seq, seq, 'old' FROM seq_1_to_300")
    cfg = make_config(["s", "t"], snapshot={"chunk_rows": 100})
    async with Driver(cfg) as d:
        got: list[Item] = []
        await catch_up(d, maria_server, maria_db, got)
        await asyncio.to_thread(sql, "DROP TABLE t", "CREATE TABLE t (id int PRIMARY KEY, v int, pad varchar(20))",
                                "INSERT INTO t SELECT seq, -seq, 'new' FROM seq_200_to_450")
        await catch_up(d, maria_server, maria_db, got)
        await d.commit()
        state, position = d.state, d.position
    why = state["tables_needing_snapshot"][f"{maria_db}.t"]
    assert "the binlog has `DROP TABLE" in why
    async with Driver(cfg, position, state) as d:  # a restart: the DROP is behind the checkpoint
        src = d.source
        assert isinstance(src, MySqlSource)
        assert src.status()["tables_needing_snapshot"] == {f"{maria_db}.t": why}
        more: list[Item] = []
        await catch_up(d, maria_server, maria_db, more)
        src.request_snapshot(f"{maria_db}.t")
        more += await d.take(lambda items: bool(marks(items, MarkKind.INCREMENTAL_DONE)), timeout=60)
        await catch_up(d, maria_server, maria_db, more)
        await d.commit()
        state, status = d.state, src.status()
    assert "tables_needing_snapshot" not in status and "tables_needing_snapshot" not in state
    assert replay_covered(got + more, f"{maria_db}.t") == await source_rows(maria_server, maria_db)


async def test_a_snapshot_condition_the_server_cannot_plan_is_refused_with_its_words(
        maria_server: MariaDBServer, maria_db: str, make_config: Callable[..., Config],
        sql: Callable[..., list[Any]]) -> None:
    sql("CREATE TABLE t (id int PRIMARY KEY, v int)", "INSERT INTO t VALUES (1, 1)")
    async with Driver(make_config(["t"], snapshot={"mode": "never"})) as d:
        src = d.source
        await src.check_where(f"{maria_db}.t", "id > 0 AND id < 5")  # a good condition passes
        with pytest.raises(ConfigError, match="cannot be recorded as a key range"):  # planned, but not on the key
            await src.check_where(f"{maria_db}.t", "id > 0 AND v < 5")
        for bad, words in (("id >", "SQL syntax"), ("nope = 1", "Unknown column 'nope'"),
                           ("id > 0; DROP TABLE t", "SQL syntax")):
            with pytest.raises(ConfigError, match="does not work on") as refused:
                await src.check_where(f"{maria_db}.t", bad)
            assert words in str(refused.value)
        with pytest.raises(ConfigError, match="is not captured"):
            await src.check_where(f"{maria_db}.other", "id > 0")
    assert sql("SELECT COUNT(*) FROM t")[0][0] == 1
