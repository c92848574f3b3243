"""End to end with MariaDB: a mixed workload (inserts, updates including a key change, deletes, a
TRUNCATE, an ADD COLUMN) -> `cdcd run` (SIGKILLed, restarted) -> landing -> `cdcd spark run --once`
-> `cdcd verify` exits 0; the mirror holds each key once. The consumer runs in the worker's Spark session
(tests/support/spark.py), `cdcd verify` as a process.

Into Delta Lake only: what this test adds is the daemon's side (MariaDB's binlog across a SIGKILL), the same
for every format. MariaDB's changes reach Iceberg in test_incremental_snapshot, test_position_lost,
test_schema_changes and test_verify_ranges, and Parquet in test_spark_types_large and the fault tests; the
format's own apply is tested format by format in the Spark integration files (issue 32)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from daemon_harness import streamed_values
from support.landed import landed_ids
from support.processes import processes_mentioning
from support.spark import consume_once
from support.waits import wait_for

from cdcd.verify.mirror import read_table
from devtools.servers import MariaDBServer

pytestmark = [pytest.mark.spark, pytest.mark.slow]
CDCD = str(Path(sys.executable).with_name("cdcd"))
SERVER_ID = 7901  # unique among the replicas of the session's MariaDB


def workload(maria: MariaDBServer, db: str, base: int) -> None:
    maria.sql(
        f"""INSERT INTO orders (id, amount, note) SELECT seq, seq * 1.25, CONCAT('n', seq)
              FROM seq_{base}_to_{base + 59};
            UPDATE orders SET amount = amount + 1 WHERE id % 3 = 0 AND id >= {base};
            UPDATE orders SET id = id + 100000 WHERE id BETWEEN {base + 10} AND {base + 14};
            DELETE FROM orders WHERE id BETWEEN {base + 20} AND {base + 24};
            INSERT INTO events SELECT seq, 'e' FROM seq_{base}_to_{base + 9};
            TRUNCATE TABLE events;
            INSERT INTO events VALUES ({base}, 'after truncate');""",
        db,
    )


def test_mariadb_mixed_workload_with_daemon_crash_converges(
    spark: object, maria_server: MariaDBServer, maria_db: str, tmp_path: Path
) -> None:
    db = maria_db
    maria_server.sql(
        "CREATE TABLE orders (id int PRIMARY KEY, amount decimal(10,2), note varchar(100));"
        "CREATE TABLE events (id int PRIMARY KEY, what varchar(100));"
        "INSERT INTO orders SELECT seq, seq, 'snap' FROM seq_1_to_30;",
        db,
    )
    landing, target = tmp_path / "landing", tmp_path / "target"
    cfg = tmp_path / "cdcd.toml"
    cfg.write_text(f"""[source]
kind = "mariadb"
host = "127.0.0.1"
port = {maria_server.port}
user = "root"
password = ""
database = "{db}"
tables = ["{db}.orders", "{db}.events"]
sslmode = "disable"
[source.mysql]
server_id = {SERVER_ID}
[state]
path = "{tmp_path / 'state'}"
[landing]
path = "{landing}"
max_batch_events = 50
max_batch_delay_ms = 50
[http]
listen = ""
[log]
format = "json"
""")

    def start(n: int) -> tuple[subprocess.Popen[bytes], Path]:
        log = tmp_path / f"daemon-{n}.log"
        out = open(log, "wb")  # noqa: SIM115 - owned by the child
        return subprocess.Popen([CDCD, "run", "-c", str(cfg)], stdout=out, stderr=subprocess.STDOUT,
                                env=os.environ), log

    daemon, log = start(1)
    try:
        workload(maria_server, db, 1000)
        maria_server.sql("ALTER TABLE orders ADD COLUMN extra varchar(20);"
                         "UPDATE orders SET extra = 'x' WHERE id < 5;"
                         "INSERT INTO orders (id, extra) VALUES (9001, 'sentinel')", db)
        wait_for("row 9001 landed", lambda: 9001 in landed_ids(landing), 120, procs=daemon, log=log)
        daemon.kill()  # SIGKILL: unacknowledged batches are landed again after the restart
        daemon.wait()
        workload(maria_server, db, 2000)
        maria_server.sql("INSERT INTO orders (id) VALUES (9002)", db)
        daemon, log = start(2)
        wait_for("row 9002 streamed", lambda: 9002 in streamed_values(landing), 120, procs=daemon, log=log)
    finally:
        daemon.kill()
        daemon.wait()

    consume_once(landing, target, "delta")
    # `cdcd verify` as a process: its own TMPDIR names whatever it starts (Spark's JVM), and nothing of it may
    # still run once the command returned
    verify_tmp = tmp_path / "verify-tmp"
    verify_tmp.mkdir()
    verify = subprocess.run([CDCD, "verify", "-c", str(cfg), "--target", str(target)], capture_output=True,
                            text=True, env={**os.environ, "TMPDIR": str(verify_tmp)})
    assert processes_mentioning(verify_tmp) == []
    report = verify.stdout + verify.stderr
    assert verify.returncode == 0, report
    assert f"{db}.orders" in report and f"{db}.events" in report
    mirror = read_table(target, f"{db}.orders")
    assert mirror is not None
    ids = mirror.column("id").to_pylist()
    assert len(ids) == len(set(ids)) and {9001, 9002, 101010} <= set(ids) and 1020 not in ids
