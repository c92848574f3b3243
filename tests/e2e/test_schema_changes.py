"""Routine schema migrations under writes, end to end (issue 28): a real source -> `cdcd run` -> landing -> the
Spark consumer into Delta Lake and Iceberg, applied after every migration ("separate merges") or once at the
end ("one merge") -> `cdcd verify` equal. Each source feeds two targets; across both, each format meets both
shapes (the Spark integration tests, tests/integration/test_spark_schema_*.py, cover every pairing).

The migrations: ADD COLUMN with a constant DEFAULT (rows that existed keep no change event), int -> bigint and a
wider numeric, RENAME COLUMN, DROP COLUMN then ADD COLUMN of the same name with another type, and on MariaDB
column order (FIRST/AFTER), MODIFY varchar(20) -> varchar(200) and CHANGE COLUMN. Each has writes around it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from support.landed import landed_ids

from cdcd.config import load_config
from cdcd.verify import verify
from devtools.servers import MariaDBServer, PostgresServer

pytestmark = pytest.mark.spark
CDCD = str(Path(sys.executable).with_name("cdcd"))
SERVER_ID = 7917  # unique among the replicas of the session's MariaDB
#: (format, shape) per source: across the two sources every format meets both shapes; fewer targets keep it short
PG_TARGETS = [("delta", "separate"), ("iceberg", "one-merge")]
MARIA_TARGETS = [("iceberg", "separate"), ("delta", "one-merge")]

#: Each migration step: its statements and what the schema then is (the writes after it follow that).
PG_STEPS = [
    ("ALTER TABLE items ADD COLUMN note text DEFAULT 'new';"
     "ALTER TABLE items ALTER COLUMN qty TYPE bigint; ALTER TABLE items ALTER COLUMN price TYPE numeric(14,2)",
     {"widened"}),
    ("ALTER TABLE items RENAME COLUMN label TO title;"
     "ALTER TABLE items DROP COLUMN extra; ALTER TABLE items ADD COLUMN extra int",
     {"widened", "renamed", "extra int"}),
]
MARIA_STEPS = [
    ("ALTER TABLE items ADD COLUMN note varchar(20) DEFAULT 'new', MODIFY qty bigint, MODIFY price decimal(14,2)",
     {"widened"}),
    ("ALTER TABLE items RENAME COLUMN label TO title;"
     "ALTER TABLE items DROP COLUMN extra; ALTER TABLE items ADD COLUMN extra int",
     {"widened", "renamed", "extra int"}),
    ("ALTER TABLE items ADD COLUMN lead int DEFAULT 7 FIRST, MODIFY title varchar(200), CHANGE COLUMN note remark "
     "varchar(20) AFTER id",
     {"widened", "renamed", "extra int", "long title"}),
]


def writes(schema: set[str], step: int, base: int, rows: str) -> str:
    """Writes in the schema ``schema`` describes: inserts (``rows``: the ids ``g``), updates and deletes. Once
    widened, qty and price take values the old types could not hold."""
    label = "title" if "renamed" in schema else "label"
    qty, price = ("g + 3000000000", "g * 1.5 + 10000000000") if "widened" in schema else ("g", "g * 1.5")
    extra = "g" if "extra int" in schema else f"'x{base}'"  # text, then (dropped and added again) int
    text = f"REPEAT('w', 150 + {step})" if "long title" in schema else "CONCAT('l', g)"
    return (f"INSERT INTO items (id, qty, price, {label}, extra) SELECT g, {qty}, {price}, {text}, {extra} "
            f"FROM {rows};"
            f"UPDATE items SET qty = qty + 1, {label} = 'u{base}' WHERE id % 7 = {step};"
            f"DELETE FROM items WHERE id % 11 = {step};")


def pg_writes(schema: set[str], step: int, base: int) -> str:
    return writes(schema, step, base, f"generate_series({base}, {base + 19}) g")


def maria_writes(schema: set[str], step: int, base: int) -> str:
    return writes(schema, step, base, f"(SELECT seq AS g FROM seq_{base}_to_{base + 19}) AS s")


def pg_config(tmp_path: Path, pg: PostgresServer, db: str) -> str:
    return f"""[source]
kind = "postgres"
port = {pg.port}
user = "postgres"
database = "{db}"
tables = ["public.items"]
[source.postgres]
slot = "s_{db}"
publication = "p_{db}"
"""


def maria_config(tmp_path: Path, maria: MariaDBServer, db: str) -> str:
    return f"""[source]
kind = "mariadb"
host = "127.0.0.1"
port = {maria.port}
user = "root"
password = ""
database = "{db}"
tables = ["{db}.items"]
sslmode = "disable"
[source.mysql]
server_id = {SERVER_ID}
"""


Step = tuple[str, set[str]]


def migrate_under_writes(tmp_path: Path, source: str, run_sql: Callable[[str], object], steps: list[Step],
                         writes: Callable[[set[str], int, int], str], targets: list[tuple[str, str]]) -> Path:
    """Run the migrations with the daemon streaming; apply the "separate" targets after each one. The config."""
    landing = tmp_path / "landing"
    cfg = tmp_path / "cdcd.toml"
    cfg.write_text(source + f"""[state]
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
    log = open(tmp_path / "daemon.log", "wb")  # noqa: SIM115 - owned by the child
    daemon = subprocess.Popen([CDCD, "run", "-c", str(cfg)], stdout=log, stderr=subprocess.STDOUT, env=os.environ)
    try:
        for step in range(len(steps) + 1):
            schema: set[str] = set()
            if step:
                statements, schema = steps[step - 1]
                run_sql(statements)
            base = 1000 * (step + 1)
            run_sql(writes(schema, step, base))
            sentinel = base + 999
            run_sql(f"INSERT INTO items (id) VALUES ({sentinel})")  # every other column nullable in every step
            deadline = time.monotonic() + 180
            while sentinel not in landed_ids(landing, column="id"):
                assert daemon.poll() is None, f"the daemon exited with {daemon.returncode}: see {log.name}"
                assert time.monotonic() < deadline, f"step {step}: row {sentinel} never landed"
                time.sleep(0.2)
            for fmt, shape in targets:
                if shape == "separate":
                    assert spark_run(landing, tmp_path / f"{fmt}-{shape}", fmt) == 0, f"step {step}, {fmt}"
        daemon.send_signal(signal.SIGTERM)
        assert daemon.wait(120) == 0
    finally:
        if daemon.poll() is None:
            daemon.kill()
            daemon.wait()
        log.close()
    return cfg


def check_targets(tmp_path: Path, cfg: Path, targets: list[tuple[str, str]]) -> None:
    for fmt, shape in targets:
        target = tmp_path / f"{fmt}-{shape}"
        assert spark_run(tmp_path / "landing", target, fmt) == 0, f"{fmt}, {shape}"
        assert verify(load_config(cfg), str(target)) == 0, f"{fmt}, {shape}: the mirror differs from the source"


def spark_run(landing: Path, target: Path, fmt: str) -> int:
    from cdcd.spark.job import run

    return run(str(landing), str(target), once=True, fmt=fmt)


def test_postgres_migrations_reach_delta_and_iceberg_unchanged(
    spark: object, pg_server: PostgresServer, pg_db: str, tmp_path: Path
) -> None:
    pg_server.psql("CREATE TABLE items (id int PRIMARY KEY, qty int, price numeric(10,2), label varchar(20), "
                   "extra text); INSERT INTO items SELECT g, g, g * 1.5, 'l' || g, 'e' || g "
                   "FROM generate_series(1, 200) g", pg_db)
    cfg = migrate_under_writes(tmp_path, pg_config(tmp_path, pg_server, pg_db), lambda s: pg_server.psql(s, pg_db),
                               PG_STEPS, pg_writes, PG_TARGETS)
    check_targets(tmp_path, cfg, PG_TARGETS)


def test_mariadb_migrations_reach_delta_and_iceberg_unchanged(
    spark: object, maria_server: MariaDBServer, maria_db: str, tmp_path: Path
) -> None:
    maria_server.sql("CREATE TABLE items (id int PRIMARY KEY, qty int, price decimal(10,2), label varchar(20), "
                     "extra varchar(40)); INSERT INTO items SELECT seq, seq, seq * 1.5, CONCAT('l', seq), "
                     "CONCAT('e', seq) FROM seq_1_to_200", maria_db)
    cfg = migrate_under_writes(tmp_path, maria_config(tmp_path, maria_server, maria_db),
                               lambda s: maria_server.sql(s, maria_db), MARIA_STEPS, maria_writes, MARIA_TARGETS)
    check_targets(tmp_path, cfg, MARIA_TARGETS)
