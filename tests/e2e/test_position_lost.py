"""A lost position on the real servers (issue 29, section 1): the daemon exits 9, `cdcd recover` takes a new slot or
binlog position, records the gap in the landing zone and makes the next run re-snapshot every table incrementally;
with source.on_position_lost = "resnapshot" the daemon does the same by itself, at start and while streaming.
Deletes, updates and key changes during the gaps; Spark (Delta for PostgreSQL, Iceberg for MariaDB) + `cdcd verify`
find the mirror equal to the source."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from daemon_harness import CDCD, DaemonHarness
from support.waits import wait_for

from cdcd.config import load_config
from cdcd.daemon.exitcodes import ExitCode
from cdcd.landing.reader import read_batches
from cdcd.positions import MySqlPosition
from cdcd.verify import verify
from devtools.servers import MariaDBServer, PostgresServer, free_port

ROWS = 300
SENTINEL = 900_000
TABLES = ("t", "u")


class Setup(DaemonHarness):
    def __init__(self, tmp: Path, server: PostgresServer | MariaDBServer, db: str) -> None:
        super().__init__(tmp)
        self.server, self.db = server, db
        self.pg = isinstance(server, PostgresServer)

    def qualified(self, name: str) -> str:
        return f"public.{name}" if self.pg else f"{self.db}.{name}"

    def source_sections(self) -> dict[str, dict[str, Any]]:
        tables = [self.qualified(t) for t in TABLES]
        if isinstance(self.server, PostgresServer):
            return {"source": {"kind": "postgres", "port": self.server.port, "user": "postgres", "database": self.db,
                               "tables": tables, "sslmode": "disable"},
                    "source.postgres": {"slot": f"s_{self.db}", "publication": f"p_{self.db}", "heartbeat_s": 0.3}}
        return {"source": {"kind": "mariadb", "port": self.server.port, "user": "cdc", "password": "secret",
                           "database": self.db, "tables": tables, "sslmode": "disable"},
                "source.mysql": {"server_id": 7901}}

    def sql(self, text: str) -> None:
        if isinstance(self.server, PostgresServer):
            self.server.psql(text, self.db)
        else:
            self.server.sql(text, self.db)

    def cli(self, command: str, cfg: Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run([CDCD, command, "-c", str(cfg)], capture_output=True, text=True, timeout=180)

    def recovered(self) -> dict[str, Any]:
        ckpt = self.checkpoint()
        return {} if ckpt is None else dict(ckpt.source_state.get("position_lost") or {})

    def resnapshotted(self, count: int) -> bool:
        """The checkpoint holds ``count`` recoveries and every table's re-snapshot after the last is done."""
        ckpt = self.checkpoint()
        if ckpt is None or int((ckpt.source_state.get("position_lost") or {}).get("count", 0)) != count:
            return False
        jobs = ckpt.source_state.get("incremental") or {}
        return all((jobs.get(self.qualified(t)) or {}).get("status") == "done" for t in TABLES)

    def gap_writes(self, n: int) -> None:
        """Deletes, updates and key changes in ranges of their own (``n`` tells the rounds apart), and inserts."""
        base = 1 + 40 * n
        self.sql(f"DELETE FROM t WHERE id BETWEEN {base} AND {base + 9}; "
                 f"UPDATE t SET v = v + 1000, pad = 'gap{n}' WHERE id BETWEEN {base + 10} AND {base + 19}; "
                 f"UPDATE t SET id = id + 500000 WHERE id BETWEEN {base + 20} AND {base + 29}; "
                 f"INSERT INTO t VALUES ({600000 + n}, {n}, 'new'); "
                 f"DELETE FROM u WHERE id BETWEEN {1 + 5 * n} AND {3 + 5 * n}")

    def finish(self, proc: subprocess.Popen[bytes]) -> None:
        """A last row lands, then a graceful stop."""
        self.sql(f"INSERT INTO t VALUES ({SENTINEL}, 0, 'end')")
        self.wait("the last row landed", lambda: SENTINEL in self.landed_ids())
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 0, self.tail()


def writes(s: Setup, stop: threading.Event) -> None:
    """Small transactions of inserts, updates, key changes and deletes above the gap writes' ranges."""
    rnd = random.Random(29)
    while not stop.is_set():
        k, k2 = rnd.randint(200, ROWS + 200), rnd.randint(200, ROWS + 200)
        ins = (f"INSERT INTO t VALUES ({k}, {k}, 'w') ON CONFLICT (id) DO NOTHING" if s.pg
               else f"INSERT IGNORE INTO t VALUES ({k}, {k}, 'w')")
        s.sql(rnd.choice([ins, f"UPDATE t SET v = v + 1, pad = 'u' WHERE id = {k}",
                          f"UPDATE t SET id = {k2} WHERE id = {k} AND NOT EXISTS "
                          f"(SELECT 1 FROM (SELECT id FROM t) x WHERE id = {k2})",
                          f"DELETE FROM t WHERE id = {k}"]))


def writer(s: Setup) -> tuple[threading.Thread, threading.Event]:
    stop = threading.Event()
    thread = threading.Thread(target=writes, args=(s, stop), name="writer", daemon=True)
    thread.start()
    return thread, stop


def make_tables(s: Setup) -> None:
    if s.pg:
        s.sql(f"CREATE TABLE t (id int PRIMARY KEY, v int, pad text); CREATE TABLE u (id int PRIMARY KEY, w text); "
              f"INSERT INTO t SELECT g, g, 'p' || g FROM generate_series(1, {ROWS}) g; "
              "INSERT INTO u SELECT g, 'w' || g FROM generate_series(1, 50) g")
    else:
        s.sql(f"CREATE TABLE t (id int PRIMARY KEY, v int, pad varchar(20)); "
              "CREATE TABLE u (id int PRIMARY KEY, w varchar(20)); "
              f"INSERT INTO t SELECT seq, seq, CONCAT('p', seq) FROM seq_1_to_{ROWS}; "
              "INSERT INTO u SELECT seq, CONCAT('w', seq) FROM seq_1_to_50")


def gap_in_landing(s: Setup) -> list[dict[str, Any]]:
    """The landing zone's lost-position records."""
    return [r.to_json() for b in read_batches(s.landing) for r in b.manifest.position_lost]


def spark_and_verify(s: Setup, cfg: Path, fmt: str) -> None:
    from cdcd.spark.job import run

    target = s.tmp / fmt
    assert run(str(s.landing), str(target), once=True, fmt=fmt) == 0
    assert verify(load_config(cfg), str(target)) == 0, "the mirror differs from the source"


def get(port: int, path: str) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as answer:
        return str(answer.read().decode())


def drop_slot(s: Setup) -> None:
    """End the slot's walsender and drop the slot, before the daemon's reconnect takes it again."""
    slot = f"s_{s.db}"
    s.sql(f"""DO $$ BEGIN
      FOR i IN 1..400 LOOP
        PERFORM pg_terminate_backend(active_pid) FROM pg_replication_slots
          WHERE slot_name = '{slot}' AND active_pid IS NOT NULL;
        BEGIN
          PERFORM pg_drop_replication_slot('{slot}');
          RETURN;
        EXCEPTION WHEN object_in_use THEN PERFORM pg_sleep(0.02);
        END;
      END LOOP;
      RAISE EXCEPTION 'slot {slot} stayed in use';
    END $$""")


def purge_past(s: Setup) -> None:
    """FLUSH and PURGE BINARY LOGS until the checkpoint's binlog file is gone (PURGE skips files the engine has not
    checkpointed yet)."""
    ckpt = s.checkpoint()
    assert ckpt is not None and isinstance(ckpt.position, MySqlPosition)
    s.sql("FLUSH BINARY LOGS")

    def purged() -> bool:
        files = [line.split("\t")[0] for line in s.server.sql("SHOW BINARY LOGS").splitlines()]
        s.sql(f"PURGE BINARY LOGS TO '{files[-1]}'")
        return ckpt.position.file not in s.server.sql("SHOW BINARY LOGS")  # type: ignore[union-attr]

    wait_for("the checkpoint's binlog file purged", purged)


@pytest.fixture
def pg(pg_server: PostgresServer, pg_db: str, tmp_path: Path) -> Iterator[Setup]:
    s = Setup(tmp_path, pg_server, pg_db)
    try:
        yield s
    finally:
        s.close()


@pytest.fixture
def maria(tmp_path: Path) -> Iterator[Setup]:
    server = MariaDBServer().start()  # its own: the test purges and resets its binlog
    s = Setup(tmp_path, server, server.create_database("lost"))
    try:
        yield s
    finally:
        s.close()
        server.stop()


def test_postgres_slot_dropped_under_writes_recover_then_resnapshot_mode_delta_equal(spark: object, pg: Setup) -> None:
    s = pg
    make_tables(s)
    daemon = s.start("landed")
    s.wait("the snapshot landed", lambda: len(s.landed_ids()) >= ROWS)
    thread, stop = writer(s)
    try:
        drop_slot(s)  # with writes running: what they wrote until the recovery is lost to the stream
        assert daemon.wait(120) == ExitCode.POSITION_LOST, s.tail()
        assert "does not exist" in s.tail(), s.tail()
        s.gap_writes(0)
        cfg = s.config("consumed")  # the recovery does not wait for a consumer
        recovered = s.cli("recover", cfg)
        assert recovered.returncode == 0, recovered.stdout + recovered.stderr
        assert f"replication slot 's_{s.db}' does not exist" in recovered.stdout, recovered.stdout
        again = s.cli("recover", cfg)
        assert again.returncode == ExitCode.FAILURE and "nothing to recover" in again.stderr, again.stderr
        [gap] = gap_in_landing(s)
        assert "does not exist" in gap["lost"] and gap["from"] < gap["to"], gap

        port = free_port()
        daemon = s.start("landed", source={"on_position_lost": "resnapshot"}, http={"listen": f"127.0.0.1:{port}"})
        s.wait("the recovery's re-snapshots are done", lambda: s.resnapshotted(1))
        s.gap_writes(1)
        drop_slot(s)  # while streaming: the daemon recovers by itself and goes on
        s.gap_writes(2)
        s.wait("the daemon recovered while streaming", lambda: s.resnapshotted(2), timeout=180)
        assert daemon.poll() is None, s.tail()
        status = json.loads(get(port, "/status"))
        assert status["source"]["position_lost"]["recoveries"] == 1, status["source"]
        assert "cdcd_position_lost_recoveries_total 1.0" in get(port, "/metrics")
        assert len(gap_in_landing(s)) == 2
    finally:
        stop.set()
        thread.join(60)
    s.finish(daemon)
    spark_and_verify(s, s.config("landed"), "delta")


def test_mariadb_purged_then_reset_recover_and_resnapshot_mode_iceberg_equal(spark: object, maria: Setup) -> None:
    s = maria
    make_tables(s)
    daemon = s.start("landed")
    s.wait("the snapshot landed", lambda: len(s.landed_ids()) >= ROWS)
    thread, stop = writer(s)
    try:
        cfg = s.config("landed")
        beside = s.cli("recover", cfg)
        assert beside.returncode == ExitCode.STATE_DIR_LOCKED and "locked by pid" in beside.stderr, beside.stderr
        daemon.send_signal(signal.SIGTERM)
        assert daemon.wait(120) == 0, s.tail()
        s.gap_writes(0)
        purge_past(s)
        daemon = s.start("landed")
        assert daemon.wait(120) == ExitCode.POSITION_LOST, s.tail()
        recovered = s.cli("recover", cfg)
        assert recovered.returncode == 0, recovered.stdout + recovered.stderr
        assert "purged" in recovered.stdout, recovered.stdout

        daemon = s.start("landed", source={"on_position_lost": "resnapshot"})
        s.wait("the recovery's re-snapshots are done", lambda: s.resnapshotted(1))
        s.gap_writes(1)
        s.sql("RESET MASTER")  # while streaming: the daemon recovers by itself and goes on
        s.gap_writes(2)
        s.wait("the daemon recovered while streaming", lambda: s.resnapshotted(2), timeout=180)
        assert daemon.poll() is None, s.tail()
        assert "the source position is lost" in s.log.read_text()
        assert len(gap_in_landing(s)) == 2
    finally:
        stop.set()
        thread.join(60)
    s.finish(daemon)
    spark_and_verify(s, s.config("landed"), "iceberg")


def test_recover_without_a_checkpoint_says_there_is_nothing_to_recover(pg: Setup) -> None:
    make_tables(pg)
    answer = pg.cli("recover", pg.config("landed"))
    assert answer.returncode == ExitCode.FAILURE, answer.stdout + answer.stderr
    assert "nothing to recover" in answer.stderr and "cdcd run" in answer.stderr, answer.stderr

