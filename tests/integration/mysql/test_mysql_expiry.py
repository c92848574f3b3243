"""Binlog expiry on a real MariaDB (issue 29, section 2): a short binlog_expire_logs_seconds, a consumer that stops
committing and binlog rotation. The warning, /status, the metrics and the pause of a running incremental snapshot;
its resume once the checkpoint moves to the newest binlog; the checkpoint's binlog purged (lost); `cdcd check`'s
line on this server and on the shared one."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import structlog
from my_helpers import Driver, execute, my_config
from support.retention import pull, scrape, wait_until

from cdcd.config import Config
from cdcd.runtime.interfaces import CheckResult
from cdcd.sources.mysql import MySqlSource
from devtools.servers import MariaDBServer

EXPIRE_S = 40


@pytest.fixture(scope="module")
def short_expiry_server() -> Iterator[MariaDBServer]:
    # a private server: the short expiry and the purges must not take binlogs of the tests sharing the session's
    server = MariaDBServer(settings={"binlog_expire_logs_seconds": str(EXPIRE_S)}).start()
    try:
        yield server
    finally:
        server.stop()


def retention(src: MySqlSource) -> dict[str, Any]:
    return dict(src.status().get("retention") or {})


def job(src: MySqlSource) -> dict[str, Any]:
    return src.snapshot_progress()[-1]


def chunks(src: MySqlSource) -> int:
    progress = src.snapshot_progress()
    return int(progress[-1]["chunks"]) if progress else 0


async def test_an_expiring_checkpoint_binlog_warns_pauses_the_incremental_snapshot_and_resumes_it(
        short_expiry_server: MariaDBServer, maria_server: MariaDBServer, maria_db: str) -> None:
    server = short_expiry_server
    db = server.create_database("expiry")
    execute(server, db, "CREATE TABLE t (id int PRIMARY KEY, v int)",
            "INSERT INTO t SELECT seq, seq FROM seq_1_to_300")
    # within the margin once the checkpoint's binlog is 2 s closed (38 s of 40 left is under 0.95 of the expiry)
    cfg = my_config(server, db, ["t"], snapshot={"mode": "never", "chunk_rows": 20},
                    source={"retention": {"margin": 0.95, "margin_s": 0, "check_interval_s": 0.2}})
    with structlog.testing.capture_logs() as logs:
        async with Driver(cfg) as d:
            src = d.source
            assert isinstance(src, MySqlSource)
            puller = asyncio.create_task(pull(d))
            try:
                await wait_until(lambda: retention(src).get("state") == "ok", what="a first reading of the expiry")
                first = retention(src)
                assert first["checkpoint_binlog"] == first["newest_binlog"] and "is the newest" in first["message"]
                assert first["binlog_expire_seconds"] == EXPIRE_S

                src.request_snapshot(f"{db}.t")
                await wait_until(lambda: chunks(src) >= 2, what="the incremental snapshot's first chunks")
                # the consumer stops committing; the checkpoint's binlog is rotated away and starts to age
                execute(server, db, "UPDATE t SET v = v + 1 WHERE id = 1", "FLUSH BINARY LOGS")
                await wait_until(lambda: retention(src).get("state") == "low", what="the expiry within the margin")
                low = retention(src)
                assert low["low"] and low["binlogs_after_checkpoint"] >= 1 and low["age_from"] == "event"
                assert 0 < low["left_s"] <= EXPIRE_S * 0.95 and "expires 40 s after it was closed" in low["message"]
                await wait_until(lambda: src.status().get("incremental_paused") is not None, what="the pause")
                paused_at = chunks(src)
                metrics = scrape({"source": src.status()})
                assert metrics["cdcd_source_retention_low"] == 1 and metrics["cdcd_incremental_snapshots_paused"] == 1
                assert metrics["cdcd_mysql_binlog_expire_seconds"] == EXPIRE_S
                assert metrics["cdcd_mysql_checkpoint_binlog_age_seconds"] >= EXPIRE_S * 0.05
                assert metrics["cdcd_mysql_binlogs_after_checkpoint"] >= 1
                checked = retention(src)["checked_at"]
                await wait_until(lambda: retention(src)["checked_at"] > checked + 1, what="more readings")
                assert chunks(src) <= paused_at + 1 and job(src)["state"] == "running"

                # the consumer commits a change of the newest binlog: the checkpoint is there, the snapshot goes on
                execute(server, db, "UPDATE t SET v = v + 1 WHERE id = 2")
                newest = str(execute(server, db, "SHOW MASTER STATUS")[0][0])
                await wait_until(lambda: any(getattr(i.position, "file", "") == newest for i in d.pending),
                               what="a change of the newest binlog read")
                await d.commit()
                await wait_until(lambda: retention(src).get("state") == "ok", what="the budget back")
                await wait_until(lambda: job(src)["state"] == "done", timeout=120, what="the snapshot's end")
                assert src.status().get("incremental_paused") is None

                # no commits again; the checkpoint's binlog rotated and purged: lost
                execute(server, db, "UPDATE t SET v = v + 1 WHERE id = 3", "FLUSH BINARY LOGS")
                newest = str(execute(server, db, "SHOW MASTER STATUS")[0][0])
                # the server keeps a file a dump thread still reads, or whose binlog checkpoint is not written yet
                await wait_until(lambda: src.status().get("binlog_file") == newest, what="the stream in the newest")
                await wait_until(lambda: purge_to(server, db, newest), what="the older binlogs purged")
                await wait_until(lambda: retention(src).get("state") == "lost", what="lost")
                assert retention(src)["oldest_binlog"] == newest and "is gone" in retention(src)["message"]
            finally:
                puller.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await puller
    events = [e["event"] for e in logs if "retention budget" in e["event"]]
    assert any(e.startswith("source retention budget low: ") and "incremental snapshots paused" in e
               and "WAL budget and binlog expiry" in e for e in events), events
    assert any(e.startswith("source retention budget recovered (ok)") and "resume" in e for e in events), events
    assert any(e.startswith("source retention budget lost: ") for e in events), events

    # `cdcd check`: 40 s fails with its fix; the shared server's default (0: never) passes, and says so
    check = (await preflight(cfg))["binlog expiry"]
    assert not check.ok and "expires 40 s after it is closed" in check.detail
    assert "binlog_expire_logs_seconds = 604800" in check.fix
    execute(maria_server, maria_db, "CREATE TABLE t (id int PRIMARY KEY)")
    check = (await preflight(my_config(maria_server, maria_db, ["t"])))["binlog expiry"]
    assert check.ok and "never expire" in check.detail


def purge_to(server: MariaDBServer, db: str, newest: str) -> bool:
    execute(server, db, f"PURGE BINARY LOGS TO '{newest}'")
    return str(execute(server, db, "SHOW BINARY LOGS")[0][0]) == newest


async def preflight(cfg: Config) -> dict[str, CheckResult]:
    """`cdcd check`'s results by name."""
    source = MySqlSource(cfg)
    try:
        return {r.name: r for r in await source.preflight()}
    finally:
        await source.close()
