"""`cdcd repair` (issue 29, section 4): rows changed, inserted and deleted behind cdcd's back in a few key ranges
of a 3,000-row table (MariaDB with sql_log_bin = 0, so the binlog never carries them) are found by verify's bucket
checksums and re-synced as one key list through the running daemon; the Delta mirror, merged by the consumer the
test runs as an operator's scheduler would, then equals the source. ``--dry-run`` reports the same keys and changes
nothing; a second repair finds nothing to do. The same for an Iceberg mirror of PostgreSQL tampered in Spark (rows
deleted, changed and added in the mirror)."""

from __future__ import annotations

import io
import threading
from collections.abc import Iterator
from contextlib import contextmanager, redirect_stderr
from pathlib import Path
from typing import Any

import pymysql
import pytest
from daemon_harness import rows
from test_verify_ranges import Setup

from cdcd.config import load_config
from cdcd.repair import repair
from devtools.servers import MariaDBServer, PostgresServer, free_port

pytestmark = pytest.mark.spark

ROWS = 3000


@contextmanager
def consumer_merging(landing: Path, target: Path, fmt: str) -> Iterator[None]:
    """The operator's consumer: `--once` runs every half second in a thread until the block ends (its failure
    fails the test at the end of the block)."""
    from cdcd.spark.job import run

    done, failed = threading.Event(), []

    def merge() -> None:
        while not done.is_set():
            code = run(str(landing), str(target), once=True, fmt=fmt)
            if code != 0:
                failed.append(code)
                return
            done.wait(0.5)  # a scheduler's runs come every so often, not back to back (each costs Spark's CPU)

    consumer = threading.Thread(target=merge)
    consumer.start()
    try:
        yield
    finally:
        done.set()
        consumer.join(120)
    assert not consumer.is_alive() and not failed, f"the consumer failed: exit {failed}"


def test_mariadb_drift_behind_cdcds_back_is_repaired_key_by_key(spark: Any, maria_server: MariaDBServer,
                                                               maria_db: str, tmp_path: Path) -> None:
    from cdcd.spark.job import run

    conn = pymysql.connect(host="127.0.0.1", port=maria_server.port, user="root", password="", database=maria_db,
                           autocommit=True)
    s = Setup(tmp_path, {
        "source": {"kind": "mariadb", "port": maria_server.port, "user": "root", "database": maria_db,
                   "tables": [f"{maria_db}.t"], "sslmode": "disable"},
        "source.mysql": {"server_id": 7911},
    })
    landing, target = tmp_path / "landing", tmp_path / "target"
    try:
        with conn.cursor() as cur:
            cur.execute("CREATE TABLE t (id int PRIMARY KEY, v int, s varchar(40))")
            cur.execute("SET SESSION max_recursive_iterations = 100000")
            cur.execute("INSERT INTO t WITH RECURSIVE g(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM g "
                        f"WHERE n < {ROWS}) SELECT n, n * 7, CONCAT('r', n) FROM g")
        http = free_port()
        s.start("landed", http={"listen": f"127.0.0.1:{http}"}, snapshot={"chunk_rows": 1000})
        s.wait("the snapshot landed", lambda: len(s.landed_ids()) >= ROWS)
        assert run(str(landing), str(target), once=True, fmt="delta") == 0
        config = load_config(s.config("landed", http={"listen": f"127.0.0.1:{http}"}, snapshot={"chunk_rows": 1000}))

        with conn.cursor() as cur:  # behind cdcd's back, in three key ranges: 5 changed, 4 deleted, 3 inserted
            cur.execute("SET SESSION sql_log_bin = 0")
            cur.execute("UPDATE t SET v = -1 WHERE id IN (10, 11, 12, 1500, 2999)")
            cur.execute("DELETE FROM t WHERE id IN (1501, 1502, 1503, 2998)")
            cur.execute("INSERT INTO t VALUES (3001, 1, 'new'), (3002, 2, 'new'), (5000, 3, 'new')")
            cur.execute("SET SESSION sql_log_bin = 1")
            cur.execute("UPDATE t SET s = 'streamed' WHERE id = 7")  # an ordinary change, merged before repair

        s.wait("the streamed change landed",
               lambda: any(r.get("s") == "streamed" for b in s.batches() for r in rows(b)))
        assert run(str(landing), str(target), once=True, fmt="delta") == 0

        out, notes = io.StringIO(), io.StringIO()
        with redirect_stderr(notes):
            assert repair(config, str(target), out, dry_run=True, settle_timeout_s=30) == 1, out.getvalue()
        assert f"repair: {maria_db}.t: would re-sync 12 keys" in out.getvalue(), out.getvalue()
        # re-checked at one position of both sides, although the daemon's checkpoint stands at the start of the
        # last streamed transaction, below the binlog's end: its GTID set shows that it holds every transaction
        assert "not re-checked" not in notes.getvalue(), notes.getvalue()

        out = io.StringIO()
        with consumer_merging(landing, target, "delta"), redirect_stderr(notes):
            assert repair(config, str(target), out, settle_timeout_s=30, wait_timeout_s=300) == 0, out.getvalue()
        assert "not re-checked" not in notes.getvalue(), notes.getvalue()
        text = out.getvalue()
        assert f"repair: {maria_db}.t: re-syncing 12 keys" in text, text
        assert "re-synced 12 keys in 1 tables; the re-synced tables equal the source" in text, text
        jobs = [j for j in _status(s, http) if j["table"] == f"{maria_db}.t" and j["where"]]
        assert len(jobs) == 1 and jobs[0]["rows"] == 8, jobs  # re-read: the 5 changed and 3 inserted rows

        out = io.StringIO()
        assert repair(config, str(target), out, settle_timeout_s=30) == 0, out.getvalue()
        assert "nothing to re-sync" in out.getvalue()
    finally:
        s.close()
        conn.close()


def _status(s: Setup, port: int) -> list[dict[str, Any]]:
    import json
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=10) as resp:
        return list(json.loads(resp.read()).get("incremental_snapshots") or [])


def test_postgres_iceberg_mirror_tampered_is_repaired_key_by_key(spark: Any, pg_server: PostgresServer, pg_db: str,
                                                                tmp_path: Path) -> None:
    from pyspark.sql import functions as F

    from cdcd.spark.formats import lakehouse_format
    from cdcd.spark.job import run

    pg_server.psql(f"CREATE TABLE t (id int PRIMARY KEY, v int, s text);"
                   f"INSERT INTO t SELECT g, g * 7, 'r' || g FROM generate_series(1, {ROWS}) g", pg_db)
    http = free_port()
    sections = {"http": {"listen": f"127.0.0.1:{http}"}}
    s = Setup(tmp_path, {
        "source": {"kind": "postgres", "port": pg_server.port, "user": "postgres", "database": pg_db,
                   "tables": ["public.t"], "sslmode": "disable"},
        "source.postgres": {"slot": f"s_{pg_db}", "publication": f"p_{pg_db}", "heartbeat_s": 0.5},
    })
    landing, target = tmp_path / "landing", tmp_path / "target"
    try:
        s.start("landed", **sections)
        s.wait("the snapshot landed", lambda: len(s.landed_ids()) >= ROWS)
        assert run(str(landing), str(target), once=True, fmt="iceberg") == 0
        config = load_config(s.config("landed", **sections))
        names = lakehouse_format("iceberg", target)
        assert names.prepare_run() is None
        ref = names.ref("tables", "public", "t")
        # the mirror tampered: 2 rows gone, 1 changed, 2 that the source never had
        spark.sql(f"DELETE FROM {ref} WHERE id IN (10, 11)")
        spark.sql(f"UPDATE {ref} SET v = -1 WHERE id = 1500")
        extra = spark.table(ref).where("id IN (5, 6)").withColumn("id", F.col("id") + 9000)
        extra.writeTo(ref).append()

        out = io.StringIO()
        assert repair(config, str(target), out, dry_run=True, settle_timeout_s=30) == 1, out.getvalue()
        assert "repair: public.t: would re-sync 5 keys" in out.getvalue(), out.getvalue()

        out = io.StringIO()
        with consumer_merging(landing, target, "iceberg"):
            assert repair(config, str(target), out, settle_timeout_s=30, wait_timeout_s=300) == 0, out.getvalue()
        assert "re-synced 5 keys in 1 tables; the re-synced tables equal the source" in out.getvalue(), out.getvalue()
        jobs = [j for j in _status(s, http) if j["table"] == "public.t" and j["where"]]
        assert len(jobs) == 1 and jobs[0]["rows"] == 3, jobs  # re-read: 10, 11 and 1500
    finally:
        s.close()
