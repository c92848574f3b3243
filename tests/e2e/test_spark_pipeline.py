"""End to end: PostgreSQL -> `cdcd run` (real process) -> landing -> Spark consumer -> `cdcd verify`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from daemon_harness import streamed_values
from support.landed import landed_ids

from cdcd.config import load_config
from cdcd.verify import verify
from cdcd.verify.mirror import read_table
from devtools.servers import PostgresServer, free_port

pytestmark = pytest.mark.spark
CDCD = str(Path(sys.executable).with_name("cdcd"))
FORMATS = ["delta", "iceberg", "parquet"]


def config(tmp_path: Path, pg: PostgresServer, db: str) -> Path:
    cfg = tmp_path / "cdcd.toml"
    cfg.write_text(
        f"""[source]
kind = "postgres"
port = {pg.port}
user = "postgres"
database = "{db}"
tables = ["public.orders", "public.events"]
[source.postgres]
slot = "s_{db}"
publication = "p_{db}"
[state]
path = "{tmp_path / 'state'}"
[landing]
path = "{tmp_path / 'landing'}"
max_batch_events = 50
max_batch_delay_ms = 50
[http]
listen = "127.0.0.1:{free_port()}"
[log]
format = "json"
"""
    )
    return cfg


def start(cfg: Path) -> subprocess.Popen[bytes]:
    log = open(cfg.parent / f"daemon-{time.monotonic_ns()}.log", "wb")  # noqa: SIM115 - owned by the child
    return subprocess.Popen([CDCD, "run", "-c", str(cfg)], stdout=log, stderr=subprocess.STDOUT, env=os.environ)


def wait_landed(landing: Path, sentinel: int, proc: subprocess.Popen[bytes], streamed: bool = False) -> None:
    """Until row ``sentinel`` landed; ``streamed``: as a streamed change (``streamed_values``), for a row inserted
    last while the daemon was down, which a resumed snapshot may read before the stream delivers what came first."""
    deadline = time.monotonic() + 120
    while sentinel not in (streamed_values(landing) if streamed else landed_ids(landing)):
        assert proc.poll() is None, f"daemon exited with {proc.returncode}"
        assert time.monotonic() < deadline, f"row {sentinel} never landed"
        time.sleep(0.2)


BIG = "repeat(md5(random()::text), 400)"  # ~12 kB, incompressible enough to be TOASTed


def mixed_workload(pg: PostgresServer, db: str, base: int) -> None:
    pg.psql(
        f"""INSERT INTO orders SELECT g, g * 1.25, 'n' || g, {BIG} FROM generate_series({base}, {base + 59}) g;
            UPDATE orders SET amount = amount + 1 WHERE id % 3 = 0 AND id >= {base};
            UPDATE orders SET note = 'toast kept' WHERE id BETWEEN {base} AND {base + 9};
            UPDATE orders SET id = id + 100000 WHERE id BETWEEN {base + 10} AND {base + 14};
            DELETE FROM orders WHERE id BETWEEN {base + 20} AND {base + 24};
            INSERT INTO events SELECT g, 'e' FROM generate_series({base}, {base + 9}) g;
            TRUNCATE events;
            INSERT INTO events VALUES ({base}, 'after truncate');""",
        db,
    )


def rows(target: Path, table: str, kind: str = "tables") -> list[dict[str, Any]]:
    """A mirror or change-log of any format, as `cdcd verify` reads it."""
    found = read_table(target, table, kind)
    assert found is not None, f"no {kind} table {table}"
    return found.to_pylist()  # type: ignore[no-any-return]


@pytest.mark.slow
@pytest.mark.parametrize("fmt", FORMATS)
def test_mixed_workload_with_daemon_crash_converges(
    spark: object, pg_server: PostgresServer, pg_db: str, tmp_path: Path, fmt: str
) -> None:
    from cdcd.spark.job import run

    pg_server.psql(
        "CREATE TABLE orders (id int PRIMARY KEY, amount numeric(10,2), note text, big text);"
        "CREATE TABLE events (id int PRIMARY KEY, what text);"
        f"INSERT INTO orders SELECT g, g, 'snap', {BIG} FROM generate_series(1, 30) g;",
        pg_db,
    )
    cfg = config(tmp_path, pg_server, pg_db)
    landing, target = tmp_path / "landing", tmp_path / "target"
    daemon = start(cfg)
    try:
        mixed_workload(pg_server, pg_db, 1000)
        pg_server.psql("ALTER TABLE orders ADD COLUMN extra text; UPDATE orders SET extra = 'x' WHERE id < 5;"
                       "INSERT INTO orders (id, extra) VALUES (9001, 'sentinel')", pg_db)
        wait_landed(landing, 9001, daemon)
        daemon.kill()  # SIGKILL: unacknowledged batches are landed again after the restart
        daemon.wait()
        mixed_workload(pg_server, pg_db, 2000)
        pg_server.psql("ALTER TABLE orders DROP COLUMN extra; INSERT INTO orders (id) VALUES (9002)", pg_db)
        daemon = start(cfg)
        wait_landed(landing, 9002, daemon, streamed=True)
    finally:
        daemon.kill()
        daemon.wait()

    assert run(str(landing), str(target), once=True, fmt=fmt) == 0
    assert verify(load_config(cfg), str(target)) == 0
    log = rows(target, "public.orders", "changelog")
    streamed = [r["_cdc_pos"] for r in log if not r["_cdc_snapshot"]]
    assert len(streamed) == len(set(streamed))  # re-delivered events are in the change-log once
    toasted = rows(target, "public.orders")
    assert all(len(r["big"]) > 10000 for r in toasted if r["note"] == "toast kept")
    assert "extra" not in toasted[0] and {"id", "amount", "note", "big"} <= set(toasted[0])  # ADD, then DROP COLUMN

    # a landed batch applied twice: rewind the consumer's applied seq, as if Spark re-ran micro-batches
    state_path = target / "state" / "consumer.json"
    state = json.loads(state_path.read_text())
    state["applied_seq"] = 1
    state_path.write_text(json.dumps(state))
    assert run(str(landing), str(target), once=True, fmt=fmt) == 0
    assert verify(load_config(cfg), str(target)) == 0
    again = rows(target, "public.orders", "changelog")
    assert len(again) == len(log)
    assert sorted(rows(target, "public.orders"), key=lambda r: r["id"]) == sorted(toasted, key=lambda r: r["id"])
