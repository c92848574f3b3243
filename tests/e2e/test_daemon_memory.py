"""`cdcd run` applies runtime.allocator at start-up and reports what it set in /status (cdcd/memory.py)."""

from __future__ import annotations

from pathlib import Path

from test_daemon_lifecycle import Daemon, create_orders, daemons, make_config

from cdcd.devservers import PostgresServer
from cdcd.memory import glibc_version

__all__ = ["daemons"]  # the fixture, used by name


def test_the_daemon_applies_the_tuned_allocator_at_start_up(
    pg_server: PostgresServer, pg_db: str, tmp_path: Path, daemons: list[Daemon]
) -> None:
    create_orders(pg_server, pg_db, 10)
    cfg, http = make_config(tmp_path, pg_server.port, pg_db)
    d = Daemon(cfg, http)
    daemons.append(d)
    d.wait_ready()
    memory = d.status()["memory"]
    assert memory["allocator"] == "tuned"
    assert memory["arrow_pool"] == "system"
    if glibc_version() is not None:
        assert memory["glibc"] == {"arena_max": 2, "mmap_threshold": 262144, "trim_threshold": 1048576}
    started = [line for line in d.log_lines() if line.get("event") == "cdcd starting"]
    assert started and started[0]["memory"] == memory


def test_allocator_default_leaves_the_allocators_alone(
    pg_server: PostgresServer, pg_db: str, tmp_path: Path, daemons: list[Daemon]
) -> None:
    create_orders(pg_server, pg_db, 10)
    cfg, http = make_config(tmp_path, pg_server.port, pg_db, runtime={"allocator": "default"})
    d = Daemon(cfg, http)
    daemons.append(d)
    d.wait_ready()
    memory = d.status()["memory"]
    assert memory["allocator"] == "default"
    assert memory["arrow_pool"] != "system"
    assert memory["glibc"] == {}
