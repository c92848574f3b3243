"""Unusual types and a large value, end to end: `cdcd run` -> landing -> `cdcd spark run --once` (every format
for PostgreSQL, Parquet for MariaDB)
-> `cdcd verify` exits 0, for MariaDB (UUID, INET4/6, zero dates, FLOAT, an ENUM key) and PostgreSQL
(an inet host address, ±infinity, a numeric NaN). The large value is 20 MB (snapshot and stream): the
Spark job on this 2-core test machine runs with its default local settings (CDCD_SPARK_DRIVER_MEMORY
unset: 2g)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow.dataset as ds
import pytest
from support.spark import consume_once, verify_equal

from cdcd.landing.reader import read_batches
from devtools.servers import MariaDBServer, PostgresServer

pytestmark = [pytest.mark.spark, pytest.mark.slow]
CDCD = str(Path(sys.executable).with_name("cdcd"))
BIG = int(os.environ.get("CDCD_TEST_BIG_MB", "20")) * 1024 * 1024  # passes with 51 too (run by hand)


def _wait(what: str, predicate: Callable[[], Any], proc: subprocess.Popen[bytes], log: Path,
          timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None:
            raise AssertionError(f"daemon exited with {proc.returncode} waiting for {what}:\n{log.read_text()[-3000:]}")
        assert time.monotonic() < deadline, f"timed out waiting for {what}:\n{log.read_text()[-3000:]}"
        time.sleep(0.2)


def _landed(landing: Path, table: str, column: str) -> set[Any]:
    return {r.get(column) for b in read_batches(landing) for t, data in b.tables.items() if str(t).endswith(table)
            for r in data.select([column]).to_pylist()}


def _run_pipeline(tmp_path: Path, source_toml: str, sentinel: Callable[[Path], bool], writes: Callable[[], None],
                  table: str, key: tuple[str, ...], fmt: str = "parquet") -> str:
    landing, target = tmp_path / "landing", tmp_path / "target"
    cfg = tmp_path / "cdcd.toml"
    cfg.write_text(source_toml + f"""
[state]
path = "{tmp_path / 'state'}"
[landing]
path = "{landing}"
max_batch_delay_ms = 50
[http]
listen = ""
[log]
format = "json"
""")
    log = tmp_path / "daemon.log"
    with open(log, "wb") as out:
        daemon = subprocess.Popen([CDCD, "run", "-c", str(cfg)], stdout=out, stderr=subprocess.STDOUT, env=os.environ)
    try:
        _wait("the snapshot", lambda: bool(_landed(landing, table, "id")), daemon, log)
        writes()
        _wait("the sentinel row", lambda: sentinel(landing), daemon, log)
    finally:
        daemon.terminate()
        daemon.wait(60)
    text = log.read_text()
    consume_once(landing, target, fmt)
    verify_equal(cfg, target)
    if fmt != "parquet":
        return text  # verify read the Delta or Iceberg table through Spark; the files below are Parquet-mirror only
    mirror = ds.dataset(target / "tables" / table).to_table()
    keys = list(zip(*(mirror.column(k).to_pylist() for k in key), strict=True))
    assert len(keys) == len(set(keys)) and max(len(v or "") for v in mirror.column("big").to_pylist()) >= BIG
    return text


def test_mariadb_types_and_a_large_value_verify_equal(spark: object, maria_server: MariaDBServer, maria_db: str,
                                                      tmp_path: Path) -> None:
    db = maria_db
    maria_server.sql(
        "SET SESSION sql_mode = '';"
        "CREATE TABLE t (id INT, e ENUM('zeta','alpha'), u UUID, i4 INET4, i6 INET6, zd DATE, zts TIMESTAMP NULL,"
        " f FLOAT, big LONGTEXT, PRIMARY KEY (id, e));"
        "INSERT INTO t VALUES (1, 'zeta', '123e4567-e89b-12d3-a456-426655440000', '10.0.0.1', '::1', '0000-00-00',"
        " '0000-00-00 00:00:00', 1.2345678, NULL), (1, 'alpha', UUID(), '0.0.0.0', '::ffff:1.2.3.4', NULL, NULL,"
        f" 16777216, REPEAT('s', {BIG})), (2, 'zeta', NULL, NULL, '2001:db8::1', '2024-00-01', NULL, 0.1, 'x');",
        db)

    def writes() -> None:
        maria_server.sql(
            "SET SESSION sql_mode = '';"
            "INSERT INTO t VALUES (3, 'alpha', '00000000-0000-0000-0000-000000000000', '255.255.255.255', '::',"
            f" '0000-00-00', '0000-00-00 00:00:00', -3.4e38, CONCAT(REPEAT('b', {BIG}), 'é'));"
            "UPDATE t SET f = 1e-38, i6 = '::2' WHERE id = 2; INSERT INTO t (id, e) VALUES (9, 'zeta');", db)

    text = _run_pipeline(tmp_path, f"""[source]
kind = "mariadb"
host = "127.0.0.1"
port = {maria_server.port}
user = "root"
password = ""
database = "{db}"
tables = ["{db}.t"]
sslmode = "disable"
[source.mysql]
server_id = 7911
[snapshot]
chunk_rows = 1
""", lambda landing: 9 in _landed(landing, ".t", "id"), writes, f"{db}.t", ("id", "e"))
    assert "zero date has no value in Arrow" in text


@pytest.mark.parametrize("fmt", ["parquet", "delta", "iceberg"])
def test_postgres_inet_infinity_and_a_large_value_verify_equal(spark: object, pg_server: PostgresServer, pg_db: str,
                                                               tmp_path: Path, fmt: str) -> None:
    pg_server.psql(
        "CREATE TABLE t (id int PRIMARY KEY, ip inet, ts timestamptz, d date, n numeric(10,2), big text);"
        "INSERT INTO t VALUES (1, '::1', 'infinity', '-infinity', 1.5, NULL),"
        f" (2, '10.0.0.1', '-infinity', 'infinity', 'NaN', repeat('s', {BIG})),"
        " (3, '10.0.0.0/8', now(), now(), 0, 'x')",
        pg_db)

    def writes() -> None:
        pg_server.psql(f"INSERT INTO t VALUES (4, '::ffff:1.2.3.4', 'infinity', 'infinity', 2, repeat('b', {BIG}));"
                       "UPDATE t SET ip = '192.168.0.1/32' WHERE id = 3; INSERT INTO t (id) VALUES (9)", pg_db)

    text = _run_pipeline(tmp_path, f"""[source]
kind = "postgres"
host = "127.0.0.1"
port = {pg_server.port}
user = "postgres"
database = "{pg_db}"
tables = ["public.t"]
sslmode = "disable"
[source.postgres]
slot = "s_{pg_db}"
publication = "p_{pg_db}"
""", lambda landing: 9 in _landed(landing, ".t", "id"), writes, "public.t", ("id",), fmt)
    assert "infinite date/timestamp landed" in text
