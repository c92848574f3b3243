"""`cdcd verify` by bucket checksums on a Delta Lake (PostgreSQL) and an Iceberg (MariaDB) mirror.

The daemon snapshots the tables (snapshot.mode = initial_only), the Spark consumer applies them in the
worker's session, and verify compares: equal tables have every bucket's checksum equal on both sides (so
the canonical texts of the database and of Spark agree for every type of the table), drift behind cdcd's
back (the mirror tampered in Spark; MariaDB rows changed with sql_log_bin = 0) is found by reading only the
differing buckets, and a table with a type without canonical text is compared bucket by bucket by rows.
"""

from __future__ import annotations

import io
import re
import threading
import time
from pathlib import Path
from typing import Any

import pymysql
import pytest
from daemon_harness import DaemonHarness

from cdcd.config import Config, load_config
from cdcd.verify import verify
from devtools.servers import MariaDBServer, PostgresServer

pytestmark = pytest.mark.spark

ROWS = 6000  # 6 buckets


class Setup(DaemonHarness):
    def __init__(self, tmp: Path, sections: dict[str, dict[str, Any]]) -> None:
        super().__init__(tmp)
        self.sections = sections

    def source_sections(self) -> dict[str, dict[str, Any]]:
        return self.sections

    def mirror(self, fmt: str) -> tuple[Path, Config]:
        """Snapshot with the daemon, apply with the consumer: the target and the config verify reads."""
        proc = self.start("landed", snapshot={"mode": "initial_only", "chunk_rows": 5000},
                          landing={"max_batch_events": 5000})
        assert proc.wait(180) == 0, self.tail()
        from cdcd.spark.job import run

        target = self.tmp / "target"
        assert run(str(self.landing), str(target), once=True, fmt=fmt) == 0
        return target, load_config(self.config("landed"))


def check(config: Config, target: Path, tables: list[str] | None = None,
          settle_timeout_s: float = 60.0) -> tuple[int, str]:
    out = io.StringIO()
    return verify(config, str(target), out, tables=tables, settle_timeout_s=settle_timeout_s), out.getvalue()


def buckets(text: str, table: str) -> tuple[int, int]:
    m = re.search(rf"^{re.escape(table)}: .* buckets=(\d+) differing=(\d+)", text, re.M)
    assert m, text
    return int(m[1]), int(m[2])


PG_TABLES = f"""
CREATE TABLE t (id bigint PRIMARY KEY, n int, sm smallint, s text, v varchar(20), b bool, d date, ts timestamp,
                tz timestamptz, amt numeric(12,3), u uuid, bin bytea);
INSERT INTO t SELECT g, CASE WHEN g % 7 = 0 THEN NULL ELSE g * 3 - 9000 END, (g % 300)::smallint,
       CASE WHEN g % 11 = 0 THEN NULL WHEN g % 13 = 0 THEN '' ELSE 'é' || md5(g::text) END, 'v' || g,
       g % 2 = 0, DATE '2024-01-01' + g, TIMESTAMP '2024-01-01 00:00:00.123456' + g * interval '1 minute 1.5 s',
       TIMESTAMPTZ '2024-06-01 12:00:00+02' + g * interval '1 hour', CASE WHEN g % 5 = 0 THEN 10 ELSE g / 7.0 END,
       md5(g::text)::uuid, CASE WHEN g % 3 = 0 THEN NULL ELSE decode(md5(g::text), 'hex') END
  FROM generate_series(1, {ROWS}) g;
CREATE TABLE other (k text PRIMARY KEY, f float8, j jsonb);
INSERT INTO other SELECT 'k' || g, g / 3.0, jsonb_build_object('g', g) FROM generate_series(1, 1500) g;
"""


def test_postgres_delta_equal_then_tampered_mirror(spark: Any, pg_server: PostgresServer, pg_db: str,
                                                   tmp_path: Path) -> None:
    pg_server.psql(PG_TABLES, pg_db)
    s = Setup(tmp_path, {
        "source": {"kind": "postgres", "port": pg_server.port, "user": "postgres", "database": pg_db,
                   "tables": ["public.t", "public.other"], "sslmode": "disable"},
        "source.postgres": {"slot": f"s_{pg_db}", "publication": f"p_{pg_db}"},
    })
    try:
        target, config = s.mirror("delta")
    finally:
        s.close()
    code, text = check(config, target)
    assert code == 0, text
    assert f"public.t: OK source={ROWS} mirror={ROWS} missing=0 extra=0 changed=0" in text
    assert buckets(text, "public.t") == (6, 0)  # every checksum equal: the canonical texts agree
    assert buckets(text, "public.other") == (2, 2)  # float8, jsonb: no canonical text, compared by rows

    ref = f"delta.`{(target / 'tables' / 'public.t').resolve().as_uri()}`"
    spark.sql(f"UPDATE {ref} SET s = 'tampered' WHERE id = 10")
    spark.sql(f"DELETE FROM {ref} WHERE id IN (20, 21)")
    spark.sql(f"INSERT INTO {ref} (id, n) VALUES (-5, 1)")
    # no re-check (--settle-timeout 0): the daemon has exited (initial_only), so its checkpoint stays below the WAL
    # position the other tests' writes move on, and the re-check would wait the whole timeout for nothing (a
    # live re-check is test_live_postgres_lag_is_rechecked_and_only_persisting_drift_reported's subject)
    code, text = check(config, target, tables=["public.t"], settle_timeout_s=0)
    assert code == 1, text
    assert "public.t: DRIFT" in text and "missing=2 extra=1 changed=1" in text
    assert "public.other" not in text  # --table
    checked, differing = buckets(text, "public.t")
    assert checked == 6 and 1 <= differing <= 4, text
    assert "changed key=['10']" in text and "'s': 'tampered'" in text and "extra key=['-5']" in text

    code, text = check(config, target, tables=["public.nope"])
    assert code == 2 and text == ""


MY_TABLE = """
CREATE TABLE t (id int PRIMARY KEY, u bigint unsigned, s varchar(40), x text, amt decimal(10,2), d date,
                dt datetime(6), ts timestamp(6) NULL, bin varbinary(16)) CHARACTER SET utf8mb4
"""


def test_mariadb_iceberg_drift_behind_cdcds_back(spark: Any, maria_server: MariaDBServer, maria_db: str,
                                                 tmp_path: Path) -> None:
    conn = pymysql.connect(host="127.0.0.1", port=maria_server.port, user="root", password="", database=maria_db,
                           autocommit=True)
    try:
        with conn.cursor() as cur:
            cur.execute(MY_TABLE)
            cur.execute("SET SESSION max_recursive_iterations = 100000")
            cur.execute(f"""INSERT INTO t WITH RECURSIVE g(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM g
                                                               WHERE n < {ROWS})
                SELECT n, IF(n % 9 = 0, 18446744073709551615, n * 1000), IF(n % 11 = 0, NULL, CONCAT('ü', MD5(n))),
                       IF(n % 13 = 0, '', REPEAT('t', n % 50)), IF(n % 5 = 0, 7, n / 3),
                       DATE_ADD('2024-01-01', INTERVAL n DAY), DATE_ADD('2020-02-03 04:05:06.5', INTERVAL n SECOND),
                       IF(n % 4 = 0, NULL, FROM_UNIXTIME(1700000000 + n * 61.25)), UNHEX(MD5(n)) FROM g""")
        s = Setup(tmp_path, {
            "source": {"kind": "mariadb", "port": maria_server.port, "user": "root", "database": maria_db,
                       "tables": [f"{maria_db}.t"], "sslmode": "disable"},
            "source.mysql": {"server_id": 7907},
        })
        try:
            target, config = s.mirror("iceberg")
        finally:
            s.close()
        code, text = check(config, target)
        assert code == 0, text
        assert buckets(text, f"{maria_db}.t") == (6, 0), text

        with conn.cursor() as cur:  # behind cdcd's back: not in the binlog
            cur.execute("SET SESSION sql_log_bin = 0")
            cur.execute("UPDATE t SET amt = 1.5 WHERE id IN (100, 2000)")
            cur.execute("DELETE FROM t WHERE id = 3000")
            cur.execute("INSERT INTO t (id, s) VALUES (9999, 'new')")
        code, text = check(config, target)
        assert code == 1, text
        assert "missing=1 extra=1 changed=2 buckets=6" in text and "rechecked=4" in text, text  # it persists
        assert "missing key=['9999']" in text and "extra key=['3000']" in text
        checked, differing = buckets(text, f"{maria_db}.t")
        assert checked == 6 and 1 <= differing <= 4, text
    finally:
        conn.close()


def test_live_postgres_lag_is_rechecked_and_only_persisting_drift_reported(
        spark: Any, pg_server: PostgresServer, pg_db: str, tmp_path: Path) -> None:
    """A mirror behind its source is not drift: verify finds the keys changed since the consumer's last batch
    differing, waits until the mirror reached the source's position (the daemon's checkpoint, the consumer's
    commit record) and compares them again: equal then. A row tampered in the mirror stays different. A row
    the source changes all the time (a writer runs through the whole verify) is never drift: each round finds
    it changed in the change-log since its snapshot, so it is re-checked, then counted unsettled if it never
    settles; and the steady writes do not keep the re-check from finding the mirror at the snapshot's position
    (the checkpoint moves past it at every batch)."""
    from cdcd.spark.job import run

    pg_server.psql("CREATE TABLE t (id bigint PRIMARY KEY, s text);"
                   "INSERT INTO t SELECT g, 'r' || g FROM generate_series(1, 2000) g", pg_db)
    s = Setup(tmp_path, {
        "source": {"kind": "postgres", "port": pg_server.port, "user": "postgres", "database": pg_db,
                   "tables": ["public.t"], "sslmode": "disable"},
        "source.postgres": {"slot": f"s_{pg_db}", "publication": f"p_{pg_db}", "heartbeat_s": 0.5},
    })
    landing, target = tmp_path / "landing", tmp_path / "target"
    writing = threading.Event()
    writing.set()
    steady: threading.Thread | None = None
    written: list[int] = []  # the writer's psql exit code
    try:
        s.start("landed")
        s.wait("the snapshot landed", lambda: len(s.landed_ids()) >= 2000)
        assert run(str(landing), str(target), once=True, fmt="delta") == 0
        # the consumer does not run now: the mirror lags these three changes
        pg_server.psql("BEGIN; UPDATE t SET s = 'new' WHERE id = 5; DELETE FROM t WHERE id = 6;"
                       "INSERT INTO t VALUES (5001, 'x'); UPDATE t SET s = 'w0' WHERE id = 7; COMMIT", pg_db)
        s.wait("the changes landed", lambda: 5001 in s.landed_ids())
        def writer() -> None:  # key 7 changes every few milliseconds until verify is done
            psql = pg_server.psql_reading(pg_db)
            assert psql.stdin is not None
            n = 0
            while writing.is_set() and psql.poll() is None:
                n += 1
                psql.stdin.write(f"UPDATE t SET s = 'w{n}' WHERE id = 7;\n")
                psql.stdin.flush()
                time.sleep(0.01)
            psql.stdin.close()
            written.append(psql.wait(60))

        steady = threading.Thread(target=writer)
        steady.start()
        ref = f"delta.`{(target / 'tables' / 'public.t').resolve().as_uri()}`"
        spark.sql(f"UPDATE {ref} SET s = 'tampered' WHERE id = 100")  # drift: the source never changes it
        config = load_config(s.config("landed"))
        result: list[tuple[int, str]] = []
        worker = threading.Thread(target=lambda: result.append(check(config, target, settle_timeout_s=300)))
        worker.start()
        # verify's re-check opened its second snapshot: the consumer catches up from here on
        s.wait("verify's re-check", lambda: not worker.is_alive() or int(pg_server.psql(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'cdcd-verify'", pg_db)) >= 2)
        for _ in range(30):
            if not worker.is_alive():
                break
            assert run(str(landing), str(target), once=True, fmt="delta") == 0
            worker.join(2)
        worker.join(60)
        assert not worker.is_alive()
    finally:
        writing.clear()
        if steady is not None:
            steady.join(60)
        s.close()
    assert written == [0], "the steady writer's psql failed (its error is above)"
    code, text = result[0]
    assert code == 1, text
    assert "missing=0 extra=0 changed=1" in text and "rechecked=5" in text, text
    assert "key=['7']" not in text and "did not reach" not in text, text
    assert "changed key=['100']" in text and "'s': 'tampered'" in text
