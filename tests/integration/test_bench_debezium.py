"""The benchmark's Debezium peer: built with Maven, reads exactly the workload's range, says why when it cannot.

No figures are asserted: what matters is that Debezium counts the events the workload wrote (from its
first row, not earlier, not later), and that a run without Maven Central still reports every row.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from bench import peers, workloads
from bench.report import to_markdown
from devtools.servers import MariaDBServer, PostgresServer

EARLIER = [{"measure": "PostgreSQL streaming, narrow table", "cdcd": 1234.5, "cdcd_seconds": 2.0},
           {"measure": "MariaDB streaming, wide table", "cdcd": 678.9, "cdcd_seconds": 3.0}]
SIZES = {"stream": 100, "stream_wide": 10}


def _doc(rows: list[dict[str, object]]) -> dict[str, object]:
    machine = {"cores": 2, "memory_gb": 1, "os": "x", "python": "3", "postgres": "pg", "mariadb": "maria"}
    return {"mode": "test", "elapsed_s": 0, "machine": machine, "results": rows}


def test_without_maven_every_debezium_row_says_not_measured(tmp_path: Path) -> None:
    why = peers.build(tmp_path / "build", mvn=str(tmp_path / "no-such-mvn"))
    assert why is not None and "no-such-mvn" in why and "not installed" in why
    rows = peers.not_measured(why, SIZES, EARLIER)
    assert [r["measure"] for r in rows] == [f"{s} streaming, {t} table: cdcd vs Debezium" for s, t, _, _ in peers.CASES]
    markdown = to_markdown(_doc(rows))
    assert markdown.count(f"Debezium not measured: {why}") == 4
    assert "1,234 events/s" in markdown and "679 rows/s" in markdown  # cdcd's figures of the same run stay


@pytest.mark.skipif(shutil.which("mvn") is None, reason="Maven is not installed (scripts/bootstrap.sh installs it)")
def test_unreachable_maven_central_is_a_reason_not_a_crash(tmp_path: Path) -> None:
    # offline with an empty local repository: what a machine without Maven Central sees
    why = peers.build(tmp_path / "build", repo=tmp_path / "empty-m2", offline=True)
    assert why is not None and "mvn package" in why and "offline" in why, why
    assert not (tmp_path / "build" / ".sources-sha256").exists()  # the next run tries again


@pytest.fixture(scope="module")
def built() -> None:
    why = peers.build()
    if why is not None:
        pytest.skip(f"Debezium could not be built here: {why}")


def test_debezium_postgres_streams_the_workload_from_its_first_row(
        built: None, pg_server: PostgresServer, pg_db: str, tmp_path: Path) -> None:
    pg_server.psql(workloads.PG_NARROW, pg_db)
    pg_server.psql(workloads.PG_WIDE, pg_db)
    pg_server.psql("CREATE PUBLICATION dbz FOR TABLE narrow, wide", pg_db)
    workloads.pg_insert_narrow(pg_server, pg_db, 1_000_001, 300, 100)  # before the slot: not streamed
    run = peers.pg_run(pg_server, pg_db, "narrow", 500, workloads.pg_insert_narrow, tmp_path, timeout=300)
    assert run.events == 500
    assert run.first_key == "Struct{id=1}"
    assert run.seconds > run.from_first_event > 0


def test_debezium_mariadb_streams_from_the_workload_position(
        built: None, maria_server: MariaDBServer, maria_db: str, tmp_path: Path) -> None:
    # another database on the server with a type Debezium's DDL parser refuses: only captured DDL is read
    other = f"{maria_db}_other"
    maria_server.sql(f"CREATE DATABASE IF NOT EXISTS {other}", maria_db)
    maria_server.sql("CREATE TABLE IF NOT EXISTS ip (id int PRIMARY KEY, a inet4)", other)
    maria_server.sql(workloads.MARIA_NARROW, maria_db)
    maria_server.sql(workloads.MARIA_WIDE, maria_db)
    workloads.maria_insert_narrow(maria_server, maria_db, 1_000_001, 300, 100)  # before the preset position
    run = peers.maria_run(maria_server, maria_db, "narrow", 500, workloads.maria_insert_narrow, tmp_path,
                          timeout=300)
    assert run.events == 500
    assert run.first_key == "Struct{id=1}"
    assert run.seconds > run.from_first_event > 0
