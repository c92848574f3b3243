"""The retention budget's pure parts: PostgreSQL's and MariaDB/MySQL's judgements, the metrics, `cdcd status`'s
line, the config keys and the example configs. The real servers drive the watch and the pause
(tests/integration/postgres/test_pg_walbudget.py, tests/integration/mysql/test_mysql_expiry.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import structlog
from support.retention import scrape

from cdcd.capture.incremental.gate import Gate
from cdcd.capture.retention import RetentionWatch
from cdcd.config import RetentionOptions, load_config, parse_config
from cdcd.daemon.progress import status_lines
from cdcd.errors import ConfigError
from cdcd.sources.mysql.expiry import BinlogReading, expire_seconds, expiry_check
from cdcd.sources.mysql.expiry import judge as judge_binlog
from cdcd.sources.postgres.connection import ConnectParams
from cdcd.sources.postgres.walbudget import MB, WalBudget, WalReading
from cdcd.sources.postgres.walbudget import judge as judge_wal

OPTIONS = RetentionOptions(margin=0.25, margin_s=600)
ROOT = Path(__file__).resolve().parents[2]


def wal(status: str | None, safe: int | None, keep_mb: int = 1024, retained: int = 0) -> WalReading:
    return WalReading("cdcd", status, safe, retained, 0, keep_mb)


def test_the_wal_budget_by_state_share_and_time_left() -> None:
    assert judge_wal(wal(None, None), None, OPTIONS).state == "unknown"
    lost = judge_wal(wal("lost", None), None, OPTIONS)
    assert lost.state == "lost" and not lost.low and "exit 9" in lost.message
    unlimited = judge_wal(wal("extended", None, keep_mb=-1, retained=5 * MB), 100.0, OPTIONS)
    assert unlimited.state == "unlimited" and not unlimited.low and "5.0 MiB" in unlimited.message
    assert unlimited.facts["max_slot_wal_keep_size_bytes"] == -1
    past = judge_wal(wal("unreserved", -MB, retained=1100 * MB), 1.0, OPTIONS)
    assert past.state == "unreserved" and past.low and past.left_s == 0 and "next checkpoint" in past.message
    # half left, no rate yet: ok; a quarter left: low by the share
    assert judge_wal(wal("reserved", 512 * MB), None, OPTIONS).state == "ok"
    low = judge_wal(wal("reserved", 200 * MB), None, OPTIONS)
    assert low.state == "low" and low.fraction_left == pytest.approx(200 / 1024) and low.left_s is None
    # plenty left by share, but 512 MB at 1 MB/s lasts 512 s, under margin_s
    fast = judge_wal(wal("reserved", 512 * MB), float(MB), OPTIONS)
    assert fast.state == "low" and fast.left_s == pytest.approx(512) and "about 512 s left" in fast.message
    assert judge_wal(wal("reserved", 512 * MB), float(MB), RetentionOptions(margin=0.25, margin_s=0)).state == "ok"


def binlog(files: list[str], ckpt: str | None, closed_after: float | None, expire_s: float = 1000) -> BinlogReading:
    return BinlogReading(files, expire_s, ckpt, closed_after, "event")


def test_the_binlog_budget_from_the_checkpoint_file_its_age_and_the_expiry() -> None:
    files = ["b.000003", "b.000004", "b.000005"]
    assert judge_binlog(binlog([], "b.000003", None), 0, OPTIONS).state == "unknown"
    assert judge_binlog(binlog(files, None, None), 0, OPTIONS).state == "unknown"
    lost = judge_binlog(binlog(files, "b.000002", None), 0, OPTIONS)
    assert lost.state == "lost" and "oldest on the server is b.000003" in lost.message
    assert judge_binlog(binlog(files, "b.000005", None), 0, OPTIONS).state == "ok"
    assert judge_binlog(binlog(files, "b.000003", 0, expire_s=0), 10**6, OPTIONS).state == "unlimited"
    ok = judge_binlog(binlog(files, "b.000004", 1000.0, expire_s=86400), 1000.0 + 3600, OPTIONS)
    assert ok.state == "ok" and ok.left_s == pytest.approx(86400 - 3600) and ok.facts["binlogs_after_checkpoint"] == 1
    low = judge_binlog(binlog(files, "b.000003", 0.0, expire_s=86400), 86400 * 0.8, OPTIONS)
    assert low.state == "low" and low.fraction_left == pytest.approx(0.2) and low.facts["checkpoint_binlog_age_s"]
    assert expire_seconds({"binlog_expire_logs_seconds": "0", "expire_logs_days": "2.000000"}) == 172800
    assert expire_seconds({"binlog_expire_logs_seconds": "600", "expire_logs_days": "2"}) == 600
    assert expiry_check({"binlog_expire_logs_seconds": "600"}).ok is False
    assert expiry_check({"binlog_expire_logs_seconds": "604800"}).ok is True


def test_the_metrics_and_cdcd_status_show_the_budget() -> None:
    reading = judge_wal(wal("reserved", 200 * MB, retained=824 * MB), None, OPTIONS).to_json()
    source = {"retention": {**reading, "incremental_paused": True}}
    metrics = scrape({"source": source})
    assert metrics["cdcd_source_retention_low"] == 1 and metrics["cdcd_incremental_snapshots_paused"] == 1
    assert metrics['cdcd_source_retention_state{state="low"}'] == 1
    assert metrics["cdcd_postgres_slot_safe_wal_size_bytes"] == 200 * MB
    assert metrics["cdcd_postgres_slot_retained_wal_bytes"] == 824 * MB
    assert "cdcd_mysql_binlog_expire_seconds" not in metrics and "cdcd_source_retention_seconds_left" not in metrics
    assert "cdcd_source_retention_low" not in scrape({"source": {}})  # before the first reading: nothing
    line = next(x for x in status_lines({"running": True, "pid": 1, "source": source}) if "retention" in x)
    assert line.startswith("  WARNING: retention budget low: slot 'cdcd' may hold 200.0 MiB more WAL")
    assert line.endswith("; incremental snapshots paused")


def test_the_retention_keys_are_checked_and_in_the_example_configs() -> None:
    base = {"kind": "postgres", "user": "u", "database": "d", "tables": ["public.t"]}
    with pytest.raises(ConfigError, match=r"source\.retention\.margin"):
        parse_config({"source": {**base, "retention": {"margin": 1.5}}}, env={})
    with pytest.raises(ConfigError, match=r"source\.retention\.check_interval_s"):
        parse_config({"source": {**base, "retention": {"check_interval_s": 0}}}, env={})
    for name in ("cdcd.example.toml", "cdcd.mariadb.example.toml"):
        assert load_config(ROOT / "config" / name, env={}, connects=False).source.retention == RetentionOptions()


def test_the_watch_logs_each_change_of_state_and_pauses_while_low() -> None:
    gate = Gate()
    probe = WalBudget(ConnectParams("127.0.0.1", 1, "u", "d"), "cdcd", OPTIONS).probe  # apply() reads nothing
    watch = RetentionWatch(OPTIONS, probe, gate, structlog.get_logger("test"), 1.0)
    readings = [wal("reserved", 900 * MB), wal("reserved", 100 * MB), wal("reserved", 90 * MB),
                wal("unreserved", -MB, retained=1100 * MB), wal("lost", None), wal("reserved", 900 * MB),
                wal("reserved", 100 * MB), wal("reserved", 900 * MB)]
    paused: list[bool] = []
    with structlog.testing.capture_logs() as logs:
        for r in readings:
            watch.apply(judge_wal(r, None, OPTIONS))
            paused.append(gate.reason is not None)
    assert paused == [False, True, True, True, False, False, True, False]
    said = [(e["log_level"], e["event"].split(":")[0]) for e in logs]
    assert said == [("warning", "source retention budget low"), ("warning", "source retention budget unreserved"),
                    ("error", "source retention budget lost"), ("info", "source retention budget ok"),
                    ("warning", "source retention budget low"), ("info", "source retention budget recovered (ok)")]
    assert "incremental snapshots resume" in logs[2]["event"] and "A lost position" in logs[2]["event"]
    assert "stay paused" in logs[1]["event"] and watch.status()["retention"]["incremental_paused"] is False
