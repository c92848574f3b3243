"""Snapshot and handoff: concurrent writers, resume after a partial snapshot, snapshot modes, keyless tables."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from typing import Any

import asyncpg
import pytest
from pg_helpers import Driver, apply, changes, marks
from source_driver import opening_truncate

from cdcd.config import Config
from cdcd.events import ChangeEvent, MarkKind
from devtools.servers import PostgresServer

pytestmark = pytest.mark.pg18  # also on PostgreSQL 18 (docs/testing.md)


async def _writer(dsn: str, stop: asyncio.Event, seed: int, size: int) -> int:
    """Random inserts, updates (some of the key) and deletes until told to stop."""
    rnd = random.Random(seed)
    conn = await asyncpg.connect(dsn)
    n = 0
    try:
        while not stop.is_set():
            k = rnd.randrange(1, size * 2 + 10)
            action = rnd.random()
            async with conn.transaction():
                if action < 0.4:
                    await conn.execute("INSERT INTO t VALUES ($1, $2) ON CONFLICT (id) DO UPDATE SET v = t.v + 1", k,
                                       rnd.randrange(1000))
                elif action < 0.7:
                    await conn.execute("UPDATE t SET v = v + 1 WHERE id = $1", k)
                elif action < 0.8:
                    await conn.execute("UPDATE t SET id = -id WHERE id = $1 AND NOT EXISTS "
                                       "(SELECT 1 FROM t WHERE id = -$1)", k)
                else:
                    await conn.execute("DELETE FROM t WHERE id = $1", k)
                    await conn.execute("DELETE FROM u WHERE id = $1", k)
                    await conn.execute("INSERT INTO u VALUES ($1, $2) ON CONFLICT DO NOTHING", k + 1, "w")
            n += 1
            await asyncio.sleep(0)
    finally:
        await conn.close()
    return n


async def _table(conn: Any, name: str) -> dict[tuple[Any, ...], dict[str, Any]]:
    return {(r["id"],): dict(r) for r in await conn.fetch(f"SELECT * FROM {name}")}


@pytest.mark.parametrize("size", [0, 1, 400, 3000])
async def test_handoff_under_concurrent_writers(size: int, pg_server: PostgresServer, pg_db: str,
                                                make_config: Callable[..., Config], sql: Callable[[str], str]) -> None:
    sql("CREATE TABLE t (id int PRIMARY KEY, v int); CREATE TABLE u (id int PRIMARY KEY, s text);"
        f"INSERT INTO t SELECT g, g FROM generate_series(1, {size}) g;"
        f"INSERT INTO u SELECT g, 'u' FROM generate_series(1, {size // 2}) g")
    cfg = make_config(["public.t", "public.u"], snapshot={"chunk_rows": 97, "parallelism": 2})
    stop = asyncio.Event()
    dsn = pg_server.dsn(pg_db)
    writers = [asyncio.create_task(_writer(dsn, stop, seed, max(size, 10))) for seed in range(3)]
    try:
        await asyncio.sleep(0.05)
        async with Driver(cfg) as d:
            items = await d.take(lambda got: bool(marks(got, "snapshot_done")))
            stop.set()
            written = sum(await asyncio.gather(*writers))
            sql("INSERT INTO u VALUES (-1000000, 'sentinel')")
            items += await d.take(lambda got: any(e.key == (-1000000,) for e in changes(got)))
    finally:
        stop.set()
        await asyncio.gather(*writers, return_exceptions=True)
    assert written > 0
    conn = await asyncpg.connect(dsn)
    try:
        want_t, want_u = await _table(conn, "t"), await _table(conn, "u")
    finally:
        await conn.close()
    evs = changes(items)
    snap = [e for e in evs if e.snapshot]
    assert all(e.position == snap[0].position for e in snap)
    assert all(not e.snapshot and e.position > snap[0].position for e in evs[len(snap):])
    got_t: dict[tuple[Any, ...], dict[str, Any]] = {}
    got_u: dict[tuple[Any, ...], dict[str, Any]] = {}
    apply(got_t, [e for e in evs if str(e.table) == "public.t"])
    apply(got_u, [e for e in evs if str(e.table) == "public.u"])
    assert got_t == want_t
    assert got_u == want_u


async def test_resume_after_a_partial_snapshot(pg_server: PostgresServer, make_config: Callable[..., Config],
                                               sql: Callable[[str], str]) -> None:
    sql("CREATE TABLE t (id int PRIMARY KEY, v int); INSERT INTO t SELECT g, g FROM generate_series(1, 500) g;"
        "CREATE TABLE k (v int); ALTER TABLE k REPLICA IDENTITY FULL; INSERT INTO k SELECT generate_series(1, 30)")
    cfg = make_config(["public.t", "public.k"], snapshot={"chunk_rows": 50, "parallelism": 1})
    async with Driver(cfg) as d:
        items = await d.take(lambda got: sum(str(e.table) == "public.t" for e in changes(got)) >= 120)
        # Commit up to the 120th row of t: the rest (and anything of k) is "in flight" at the crash.
        cut = [i for i, e in enumerate(items) if isinstance(e, ChangeEvent) and not opening_truncate(e)
               and str(e.table) == "public.t"][119]
        await d.commit(cut + 1)
        position, state = d.position, d.state
        watermark = state["watermark"]
    assert state["snapshot"]["tables"]["public.t"]["last_key"] == ["120"]
    sql("UPDATE t SET v = -v WHERE id IN (5, 300); DELETE FROM t WHERE id = 301; INSERT INTO t VALUES (1000, 1)")
    async with Driver(cfg, position, state) as d2:
        items2 = await d2.take(lambda got: bool(marks(got, "snapshot_done")))
        sql("INSERT INTO t VALUES (2000, 2)")
        items2 += await d2.take(lambda got: any(e.key == (2000,) for e in changes(got)))
        await d2.commit()
        assert d2.state["watermark"] == watermark  # streaming still starts at the original watermark
        status = d2.source.status()
        assert status["phase"] == "streaming" and status["connected"] is True
        assert status["snapshot"]["public.t"]["done"] is True and status["snapshot"]["public.t"]["rows"] == 120 + 380
        assert status["snapshot"]["public.t"]["total_estimate"] >= 0 and status["snapshot"]["public.k"]["rows"] == 30
        assert d2.state["snapshot"]["status"] == "done"
    snap_t = [e.after["id"] for e in changes(items2) if e.snapshot and str(e.table) == "public.t" and e.after]
    assert snap_t == [i for i in range(121, 501) if i != 301] + [1000]  # no acked key again, fresh snapshot
    assert sorted(e.after["v"] for e in changes(items2) if e.snapshot and str(e.table) == "public.k" and e.after) == \
        list(range(1, 31))  # a keyless table is read whole again
    mirror: dict[tuple[Any, ...], dict[str, Any]] = {}
    apply(mirror, [e for e in changes(items[: cut + 1]) + changes(items2) if str(e.table) == "public.t"])
    conn = await asyncpg.connect(pg_server.dsn(cfg.source.database))
    try:
        assert mirror == await _table(conn, "t")
    finally:
        await conn.close()


async def test_snapshot_modes(pg_server: PostgresServer, make_config: Callable[..., Config],
                              sql: Callable[[str], str]) -> None:
    sql("CREATE TABLE t (id int PRIMARY KEY); INSERT INTO t VALUES (1), (2)")
    # initial_only: the snapshot, then the stream ends; no slot is left behind to hold WAL.
    only = make_config(["public.t"], snapshot={"mode": "initial_only"},
                       source={"postgres": {"slot": "only_s", "publication": "only_p"}})
    async with Driver(only) as d:
        items = await d.take(lambda got: False)
        assert d.ended
        await d.commit()
    assert [e.after for e in changes(items)] == [{"id": 1}, {"id": 2}]
    # a new snapshot opens with a truncate of its table at its watermark (it supersedes earlier attempts)
    opening = [i for i in items if opening_truncate(i)]
    assert len(opening) == 1 and opening[0].position == changes(items)[0].position
    assert marks(items, "snapshot_done") and d.state["snapshot"]["status"] == "done" and d.state["slot"] is None
    assert pg_server.psql("SELECT count(*) FROM pg_replication_slots WHERE slot_name = 'only_s'") == "0"
    async with Driver(only, d.position, d.state) as again:
        assert changes(await again.take(lambda got: False)) == [] and again.ended
    # never: no snapshot rows, only changes from the slot's point on.
    never = make_config(["public.t"], snapshot={"mode": "never"},
                        source={"postgres": {"slot": "never_s", "publication": "never_p"}})
    async with Driver(never) as d:
        sql("INSERT INTO t VALUES (3)")
        items = await d.take(lambda got: bool(changes(got)))
    assert [(e.after, e.snapshot) for e in changes(items)] == [({"id": 3}, False)]
    assert d.state == {} and marks(items, MarkKind.STREAM_START) and not marks(items, MarkKind.SNAPSHOT_START)
    # when_needed on a first start behaves like initial.
    needed = make_config(["public.t"], snapshot={"mode": "when_needed"},
                         source={"postgres": {"slot": "needed_s", "publication": "needed_p"}})
    async with Driver(needed) as d:
        items = await d.take(lambda got: bool(marks(got, "snapshot_done")))
    assert sorted(e.after["id"] for e in changes(items) if e.after) == [1, 2, 3]


async def test_an_existing_slot_without_checkpoint_is_reused(pg_server: PostgresServer,
                                                             make_config: Callable[..., Config],
                                                             sql: Callable[[str], str]) -> None:
    sql("CREATE TABLE t (id int PRIMARY KEY); INSERT INTO t VALUES (1)")
    cfg = make_config(["public.t"], source={"postgres": {"slot": "pre_s", "publication": "pre_p"}})
    sql("SELECT pg_create_logical_replication_slot('pre_s', 'pgoutput')")
    sql("INSERT INTO t VALUES (2)")  # after the slot's point, before the publication exists
    async with Driver(cfg) as d:
        items = await d.take(lambda got: bool(marks(got, "snapshot_done")))
        sql("INSERT INTO t VALUES (3)")
        items += await d.take(lambda got: any(not e.snapshot for e in changes(got)))
    mirror: dict[tuple[Any, ...], dict[str, Any]] = {}
    apply(mirror, changes(items))
    assert mirror == {(1,): {"id": 1}, (2,): {"id": 2}, (3,): {"id": 3}}
    assert pg_server.psql("SELECT count(*) FROM pg_replication_slots WHERE slot_name = 'pre_s'") == "1"


async def test_resume_with_a_composite_text_and_timestamp_key(make_config: Callable[..., Config],
                                                              sql: Callable[[str], str]) -> None:
    sql("CREATE TABLE c (region text, at timestamptz, n numeric(10,2), PRIMARY KEY (region, at, n));"
        "INSERT INTO c SELECT r, timestamptz '2024-01-01 00:00:00+00' + g * interval '1 second', g / 3.0 "
        "FROM unnest(array['nörth', 'South', 'east''s']) r, generate_series(1, 70) g")
    cfg = make_config(["public.c"], snapshot={"chunk_rows": 16, "parallelism": 1})
    async with Driver(cfg) as d:
        evs = await d.events(100)
        await d.commit(2 + 77)  # the start mark, the snapshot's opening truncate and 77 rows
        position, state = d.position, d.state
    acked, unacked = [e.key for e in evs[:77]], [e.key for e in evs[77:]]
    async with Driver(cfg, position, state) as d2:
        items = await d2.take(lambda got: bool(marks(got, "snapshot_done")))
    again = [e.key for e in changes(items)]
    assert len(again) == 210 - 77 and not set(again) & set(acked)
    assert again[: len(unacked)] == unacked  # the same key order, resumed exactly after the 77th key
    assert len(set(acked) | set(again)) == 210
