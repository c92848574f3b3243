"""A table reload on a real PostgreSQL source is applied or reported failed, never lost.

A source reconnect (the runtime's: ``terminate`` then ``connect``) while the reload is being applied (here held
in ``ALTER PUBLICATION ... ADD TABLE`` by a lock on the table) must not drop it: it completes after the
reconnect. A table without a primary key or replica identity index (REPLICA IDENTITY FULL) cannot be
snapshotted while streaming: the reload is refused, naming the table and the fix, and the table is not recorded
as captured.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import asyncpg
import pytest
from pg_helpers import Driver, marks
from test_pg_incremental import catch_up, source_of

from cdcd.config import Config
from cdcd.events import Item, MarkKind
from cdcd.runtime.interfaces import ResumePoint
from devtools.servers import PostgresServer


async def test_a_reconnect_while_a_reload_is_applied_completes_it_after_the_reconnect(
        pg_server: PostgresServer, pg_db: str, make_config: Callable[..., Config], sql: Callable[[str], str]) -> None:
    sql("CREATE TABLE a (id int PRIMARY KEY); CREATE TABLE t (id int PRIMARY KEY, v int);"
        "INSERT INTO t SELECT g, g FROM generate_series(1, 50) g")
    dsn = pg_server.dsn(pg_db)
    async with Driver(make_config(["public.a"], snapshot={"mode": "never", "chunk_rows": 20})) as d:
        src = source_of(d)
        got: list[Item] = []
        await catch_up(d, dsn, got)
        await d.commit()
        locker = await asyncpg.connect(dsn)
        try:
            tx = locker.transaction()
            await tx.start()
            await locker.execute("LOCK TABLE t IN ACCESS EXCLUSIVE MODE")  # ALTER PUBLICATION ADD TABLE waits
            applied = src.reload_tables(["public.a", "public.t"])
            async with asyncio.timeout(30):
                while not await locker.fetchval("SELECT count(*) FROM pg_locks WHERE NOT granted"):
                    await asyncio.sleep(0.05)
            assert not applied.done()
            src.terminate()  # what the runtime does on a source error: a new connection, a new stream
            await src.connect(ResumePoint(d.position, d.state))
            d._iter = src.stream().__aiter__()
            await tx.rollback()
        finally:
            await locker.close()
        sql("INSERT INTO a VALUES (1)")  # marks go out with the next streamed item
        got += await d.take(lambda items: bool(marks(items, MarkKind.INCREMENTAL_DONE)), timeout=60)
        await asyncio.wait_for(applied, 10)  # done, without an error
        sql("UPDATE t SET v = -1 WHERE id = 1")
        await catch_up(d, dsn, got)
        await d.commit()
        state, status = d.state, src.status()
    assert state["tables"] == ["public.a", "public.t"]
    assert state["incremental"]["public.t"]["status"] == "done"
    assert "table_reload_error" not in status
    assert [i.after for i in got if getattr(i, "table", None) is not None and i.table.name == "t"  # type: ignore[attr-defined]
            and not i.snapshot][-1] == {"id": 1, "v": -1}  # type: ignore[attr-defined]


async def test_a_keyless_table_is_refused_at_reload_and_not_recorded_as_captured(
        pg_server: PostgresServer, pg_db: str, make_config: Callable[..., Config], sql: Callable[[str], str]) -> None:
    # REPLICA IDENTITY FULL: the publication takes it (its changes can be streamed), but no key to read it by
    sql("CREATE TABLE a (id int PRIMARY KEY); CREATE TABLE k (id int, v int); ALTER TABLE k REPLICA IDENTITY FULL;"
        "INSERT INTO k VALUES (1, 1)")
    dsn = pg_server.dsn(pg_db)
    async with Driver(make_config(["public.a"], snapshot={"mode": "never"})) as d:
        src = source_of(d)
        got: list[Item] = []
        await catch_up(d, dsn, got)
        applied = src.reload_tables(["public.a", "public.k"])
        with pytest.raises(Exception, match=r"public\.k .*no primary key.*REPLICA IDENTITY"):
            await asyncio.wait_for(applied, 30)
        assert "public.k" in src.status()["table_reload_error"]
        sql("INSERT INTO k VALUES (2, 2); INSERT INTO a VALUES (1)")
        await catch_up(d, dsn, got)
        await d.commit()
        state = d.state
    assert not marks(got, MarkKind.INCREMENTAL_START)
    assert not [m for m in marks(got, MarkKind.TABLES) if "public.k" in m.detail["tables"]]
    assert "public.k" not in (state.get("tables") or [])
