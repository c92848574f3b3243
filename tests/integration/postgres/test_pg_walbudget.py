"""The slot's WAL budget on a real server (issue 29, section 2): a tiny max_slot_wal_keep_size and a consumer that
stops committing. The warning, /status, the metrics and the pause of a running incremental snapshot; its resume
once the consumer commits again; ``unreserved``; `cdcd check`'s line on this server and on the shared one."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import structlog
from pg_helpers import Driver, pg_config
from support.retention import pull, scrape, wait_until

from cdcd.events import ChangeEvent, Op
from cdcd.sources.postgres import PostgresSource
from devtools.servers import PostgresServer

KEEP_MB = 64  # four WAL segments


@pytest.fixture(scope="module")
def small_budget_server() -> Iterator[PostgresServer]:
    # a private server: the tiny limit must not invalidate the slots of the tests sharing the session's server;
    # no checkpoint by time or WAL volume during the test (a checkpoint would invalidate the unreserved slot)
    server = PostgresServer(settings={"max_slot_wal_keep_size": f"'{KEEP_MB}MB'", "max_wal_size": "'2GB'",
                                      "checkpoint_timeout": "'1h'"}).start()
    try:
        yield server
    finally:
        server.stop()


def burn_segments(server: PostgresServer, db: str, n: int) -> None:
    """Move the server's WAL on by ``n`` segments (16 MB each) without writing much: a row, then a switch."""
    for _ in range(n):
        server.psql("INSERT INTO burn VALUES (1); SELECT pg_switch_wal()", db)


def retention(src: PostgresSource) -> dict[str, Any]:
    return dict(src.status().get("retention") or {})


async def test_a_low_wal_budget_warns_pauses_the_incremental_snapshot_and_resumes_it(
        small_budget_server: PostgresServer, pg_server: PostgresServer, pg_db: str) -> None:
    server, db = small_budget_server, "budget"
    server.create_database(db)
    server.psql("CREATE TABLE t (id int PRIMARY KEY, v int); CREATE TABLE burn (x int); "
                "INSERT INTO t SELECT g, g FROM generate_series(1, 600) g", db)
    cfg = pg_config(server, db, ["public.t"], snapshot={"mode": "never", "chunk_rows": 20},
                    source={"retention": {"margin": 0.5, "margin_s": 0, "check_interval_s": 0.2}})
    with structlog.testing.capture_logs() as logs:
        async with Driver(cfg) as d:
            src = d.source
            assert isinstance(src, PostgresSource)
            puller = asyncio.create_task(pull(d))
            try:
                await wait_until(lambda: retention(src).get("state") == "ok", what="a first reading of the budget")
                first = retention(src)
                assert first["wal_status"] == "reserved" and first["max_slot_wal_keep_size_bytes"] == KEEP_MB << 20
                assert first["fraction_left"] > 0.5 and not first["incremental_paused"]

                src.request_snapshot("public.t")
                await wait_until(lambda: chunks(src) >= 2, what="the incremental snapshot's first chunks")
                # the consumer stops committing: the slot holds the WAL written from here on
                burn_segments(server, db, 3)
                await wait_until(lambda: retention(src).get("state") == "low", what="the budget within the margin")
                low = retention(src)
                assert low["low"] and low["fraction_left"] <= 0.5 and low["safe_wal_size"] < (KEEP_MB << 19)
                assert "may hold" in low["message"]
                await wait_until(lambda: src.status().get("incremental_paused") is not None, what="the pause")
                paused_at = chunks(src)
                metrics = scrape({"source": src.status()})
                assert metrics["cdcd_source_retention_low"] == 1 and metrics["cdcd_incremental_snapshots_paused"] == 1
                assert metrics['cdcd_postgres_slot_wal_status{wal_status="reserved"}'] == 1
                assert metrics["cdcd_postgres_max_slot_wal_keep_size_bytes"] == KEEP_MB << 20
                assert 0 < metrics["cdcd_postgres_slot_safe_wal_size_bytes"] < KEEP_MB << 19
                assert metrics["cdcd_source_retention_fraction_left"] <= 0.5
                # paused between chunks: at most the chunk read before the pause still lands, over several readings
                checked = retention(src)["checked_at"]
                await wait_until(lambda: retention(src)["checked_at"] > checked + 1, what="more readings")
                assert chunks(src) <= paused_at + 1 and job(src)["state"] == "running"

                # the consumer commits again: the slot lets go of the WAL and the snapshot goes on by itself
                async def release() -> bool:
                    await d.commit()
                    server.psql("UPDATE t SET v = v + 1 WHERE id = 1; CHECKPOINT", db)
                    await asyncio.sleep(0.3)
                    await d.commit()
                    return retention(src).get("state") == "ok"

                for _ in range(100):
                    if await release():
                        break
                assert retention(src)["state"] == "ok", retention(src)
                await wait_until(lambda: job(src)["state"] == "done", timeout=120, what="the snapshot's end")
                assert src.status().get("incremental_paused") is None

                # no commits again, past the limit: unreserved (the next checkpoint would invalidate the slot)
                burn_segments(server, db, KEEP_MB // 16 + 2)
                await wait_until(lambda: retention(src).get("state") == "unreserved", what="unreserved")
                assert retention(src)["wal_status"] == "unreserved" and retention(src)["left_s"] == 0
                metrics = scrape({"source": src.status()})
                assert metrics['cdcd_source_retention_state{state="unreserved"}'] == 1
                assert metrics["cdcd_postgres_slot_retained_wal_bytes"] > KEEP_MB << 20
            finally:
                puller.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await puller
    events = [e["event"] for e in logs if "retention budget" in e["event"]]
    assert any(e.startswith("source retention budget low: ") and "incremental snapshots paused" in e
               and "WAL budget and binlog expiry" in e for e in events), events
    assert any(e.startswith("source retention budget recovered (ok)") and "resume" in e for e in events), events
    assert any(e.startswith("source retention budget unreserved: ") and "next checkpoint invalidates" in e
               for e in events), events

    # `cdcd check`: the tiny limit here fails with its fix; the shared server's default (-1) passes, and says so
    check = {r.name: r for r in await PostgresSource(cfg).preflight()}["max_slot_wal_keep_size"]
    assert not check.ok and "64 MB is tiny" in check.detail and "ALTER SYSTEM SET max_slot_wal_keep_size" in check.fix
    shared = pg_config(pg_server, pg_db, ["public.t"])
    pg_server.psql("CREATE TABLE t (id int PRIMARY KEY)", pg_db)
    check = {r.name: r for r in await PostgresSource(shared).preflight()}["max_slot_wal_keep_size"]
    assert check.ok and "-1 (unlimited)" in check.detail and "disk is full" in check.detail


def job(src: PostgresSource) -> dict[str, Any]:
    return src.snapshot_progress()[-1]


def chunks(src: PostgresSource) -> int:
    progress = src.snapshot_progress()
    return int(progress[-1]["chunks"]) if progress else 0


async def test_the_budget_is_read_during_the_initial_snapshot(small_budget_server: PostgresServer) -> None:
    """The slot holds WAL from its creation: a long initial snapshot is when it fills first."""
    server, db = small_budget_server, "budget_initial"
    server.create_database(db)
    server.psql("CREATE TABLE t (id int PRIMARY KEY); INSERT INTO t SELECT generate_series(1, 100)", db)
    cfg = pg_config(server, db, ["public.t"], snapshot={"chunk_rows": 10},
                    source={"retention": {"check_interval_s": 0.2}})
    async with Driver(cfg) as d:
        src = d.source
        assert isinstance(src, PostgresSource)
        # the first snapshot rows: the snapshot is under way; nothing more is read, so it stays under way
        await d.take(lambda items: bool(items) and isinstance(items[-1], ChangeEvent) and items[-1].snapshot
                     and items[-1].op is Op.READ)
        await wait_until(lambda: retention(src).get("state") == "ok", what="a reading during the snapshot")
        assert src.status()["phase"] == "snapshot" and retention(src)["wal_status"] == "reserved"
