"""`cdcd run` applies runtime.memory at start-up and reports what it set in /status (cdcd/memory.py)."""

from __future__ import annotations

from pathlib import Path

from test_daemon_lifecycle import Daemon, create_orders, daemons, make_config

from cdcd.memory import glibc_version
from devtools.servers import PostgresServer

__all__ = ["daemons"]  # the fixture, used by name


def test_the_daemon_applies_the_tuned_memory_settings_at_start_up(
    pg_server: PostgresServer, pg_db: str, tmp_path: Path, daemons: list[Daemon]
) -> None:
    create_orders(pg_server, pg_db, 10)
    cfg, http = make_config(tmp_path, pg_server.port, pg_db)
    d = Daemon(cfg, http)
    daemons.append(d)
    d.wait_ready()
    memory = d.status()["memory"]
    assert memory["mode"] == "tuned"
    assert memory["arrow_pool"] == "system"
    assert memory["gc_threshold"] == [10_000, 10, 10]
    assert memory["gc_frozen"] > 1000  # the daemon's modules, frozen once loaded
    if glibc_version() is not None:
        assert memory["glibc"] == {"arena_max": 2, "mmap_threshold": 262144, "trim_threshold": 1048576}
    started = [line for line in d.log_lines() if line.get("event") == "cdcd starting"]
    assert started and {k: v for k, v in started[0]["memory"].items() if k != "gc_frozen"} == {
        k: v for k, v in memory.items() if k != "gc_frozen"}  # logged before the freeze


def test_memory_default_leaves_the_allocators_and_the_collector_alone(
    pg_server: PostgresServer, pg_db: str, tmp_path: Path, daemons: list[Daemon]
) -> None:
    create_orders(pg_server, pg_db, 10)
    cfg, http = make_config(tmp_path, pg_server.port, pg_db, runtime={"memory": "default"})
    d = Daemon(cfg, http)
    daemons.append(d)
    d.wait_ready()
    memory = d.status()["memory"]
    assert memory["mode"] == "default"
    assert memory["arrow_pool"] == "system"  # chosen when pyarrow is imported (cdcd/__init__.py)
    assert memory["glibc"] == {}
    assert memory["gc_threshold"] == [700, 10, 10] and memory["gc_frozen"] == 0
