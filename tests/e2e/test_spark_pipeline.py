"""End to end: PostgreSQL -> `cdcd run` (real process) -> landing -> Spark consumer -> `cdcd verify`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cdcd.config import load_config
from cdcd.devservers import PostgresServer, free_port
from cdcd.sinks.landing import read_batches
from cdcd.spark.verify import read_table, verify

pytestmark = pytest.mark.spark
CDCD = str(Path(sys.executable).with_name("cdcd"))
FORMATS = ["delta", "iceberg", "parquet"]


@pytest.fixture(scope="module")
def spark() -> Iterator[object]:
    from cdcd.spark.consumer import session

    s = session()
    yield s
    s.stop()


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


def landed_ids(landing: Path) -> set[Any]:
    return {r.get("id") for b in read_batches(landing) for t in b.tables.values() for r in t.to_pylist()}


def wait_landed(landing: Path, sentinel: int, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 120
    while sentinel not in landed_ids(landing):
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
    from cdcd.spark.consumer import run

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
        wait_landed(landing, 9002, daemon)
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


def wait_all_landed(pg: PostgresServer, db: str, landing: Path, proc: subprocess.Popen[bytes], marker: int) -> None:
    """Insert a marker row into `events` and wait until it landed: everything before it did too."""
    pg.psql(f"INSERT INTO events VALUES ({marker}, 'marker')", db)
    wait_landed(landing, marker, proc)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", FORMATS)
def test_key_change_with_unchanged_toast_and_a_key_shift(
    spark: object, pg_server: PostgresServer, pg_db: str, tmp_path: Path, fmt: str
) -> None:
    """`UPDATE orders SET id = 2 WHERE id = 1` leaves the TOASTed `big` unchanged: the mirror keeps it.

    The old row's last update, the key change and a second key change land in
    different batches, each merged by its own consumer run; then a key shift inside
    one statement on a deferrable key with REPLICA IDENTITY FULL (`id = id + 1` over
    ids 1..3 leaves ids 2..4). `cdcd verify` exits 0 after each step.
    """
    from cdcd.spark.consumer import run

    pg_server.psql(
        "CREATE TABLE orders (id int PRIMARY KEY, amount numeric(10,2), note text, big text);"
        "CREATE TABLE events (id int PRIMARY KEY, what text);"
        "CREATE TABLE shift (id int PRIMARY KEY DEFERRABLE, v text, big text);"
        "ALTER TABLE shift REPLICA IDENTITY FULL;"
        f"INSERT INTO orders SELECT g, g, 'snap', {BIG} FROM generate_series(1, 5) g;"
        f"INSERT INTO shift SELECT g, 'v' || g, {BIG} FROM generate_series(1, 3) g;",
        pg_db,
    )
    cfg = config(tmp_path, pg_server, pg_db)
    text = cfg.read_text().replace('tables = ["public.orders", "public.events"]',
                                   'tables = ["public.orders", "public.events", "public.shift"]')
    cfg.write_text(text)
    landing, target = tmp_path / "landing", tmp_path / "target"
    daemon = start(cfg)
    steps = [
        "UPDATE orders SET amount = 7 WHERE id = 1",  # the old row's last update: `big` unchanged TOAST
        "UPDATE orders SET id = 2000 WHERE id = 1",  # the key change, in a later batch
        "UPDATE orders SET id = 3000 WHERE id = 2000; UPDATE orders SET note = 'n' WHERE id = 3",
        "UPDATE shift SET id = id + 1",  # a key shift inside one statement
    ]
    try:
        for n, step in enumerate(steps):
            pg_server.psql(step, pg_db)
            wait_all_landed(pg_server, pg_db, landing, daemon, 100 + n)
            assert run(str(landing), str(target), once=True, fmt=fmt) == 0
            assert verify(load_config(cfg), str(target)) == 0, f"drift after {step!r}"
    finally:
        daemon.kill()
        daemon.wait()
    orders = {r["id"]: r for r in rows(target, "public.orders")}
    assert set(orders) == {2, 3, 4, 5, 3000} and len(orders[3000]["big"]) > 10000
    assert sorted(r["id"] for r in rows(target, "public.shift")) == [2, 3, 4]
