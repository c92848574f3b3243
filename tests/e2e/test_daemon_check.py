"""`cdcd check` against real PostgreSQL servers: a ready one passes, wal_level=replica fails by name."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from devtools.servers import PostgresServer

CDCD = str(Path(sys.executable).with_name("cdcd"))


def _config(tmp_path: Path, port: int, database: str) -> Path:
    cfg = tmp_path / "cdcd.toml"
    cfg.write_text(textwrap.dedent(f"""
        [source]
        kind = "postgres"
        port = {port}
        user = "postgres"
        database = "{database}"
        tables = ["public.orders"]
        [state]
        path = "{tmp_path / 'state'}"
        [landing]
        path = "{tmp_path / 'landing'}"
        [http]
        listen = ""
    """))
    return cfg


@pytest.fixture(scope="module")
def replica_pg() -> Iterator[PostgresServer]:
    server = PostgresServer(settings={"wal_level": "replica"}).start()
    try:
        yield server
    finally:
        server.stop()


def test_check_fails_naming_wal_level(replica_pg: PostgresServer, tmp_path: Path) -> None:
    replica_pg.create_database("app")
    replica_pg.psql("CREATE TABLE orders (id int PRIMARY KEY, amount numeric)", "app")
    proc = subprocess.run([CDCD, "check", "-c", str(_config(tmp_path, replica_pg.port, "app"))],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    fail = [line for line in proc.stdout.splitlines() if line.startswith("FAIL")]
    assert any("wal_level" in line and "replica" in line for line in fail), proc.stdout
    assert "wal_level = logical" in proc.stdout  # the fix is printed
    assert "checks failed" in proc.stdout


def test_check_passes_on_a_ready_server(pg_server: PostgresServer, pg_db: str, tmp_path: Path) -> None:
    pg_server.psql("CREATE TABLE orders (id int PRIMARY KEY, amount numeric)", pg_db)
    proc = subprocess.run([CDCD, "check", "-c", str(_config(tmp_path, pg_server.port, pg_db))],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ok    wal_level" in proc.stdout and "FAIL" not in proc.stdout


def test_check_reports_an_unreachable_server(tmp_path: Path) -> None:
    from devtools.servers import free_port

    proc = subprocess.run([CDCD, "check", "-c", str(_config(tmp_path, free_port(), "app"))],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "FAIL  connect" in proc.stdout
