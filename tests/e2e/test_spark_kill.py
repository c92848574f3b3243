"""The Spark consumer as a real process, SIGKILLed while it applies a micro-batch, then rerun (in the worker's
Spark session: the killed process is the one under test): the mirror equals the source (`cdcd verify`), holds
each key once and the change-log holds each event once. The landing zone comes from two daemon runs (the first
SIGKILLed, so batches are re-delivered), which makes two merges: the kill lands in the second one, after the
first committed."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from daemon_harness import streamed_values
from support.landed import landed_ids
from support.spark import consume_once, verify_equal
from support.waits import wait_for

from cdcd.landing.reader import consumed_seqs, read_batches
from cdcd.verify.mirror import read_table
from devtools.servers import PostgresServer, free_port

pytestmark = [pytest.mark.spark, pytest.mark.slow]
CDCD = str(Path(sys.executable).with_name("cdcd"))


def table_rows(target: Path, table: str, kind: str = "tables") -> list[dict[str, Any]]:
    """A mirror or change-log of any format, as `cdcd verify` reads it."""
    found = read_table(target, table, kind)
    assert found is not None, f"no {kind} table {table}"
    return found.to_pylist()  # type: ignore[no-any-return]


def spawn(tmp_path: Path, *args: str) -> subprocess.Popen[bytes]:
    log = open(tmp_path / f"{args[0]}-{time.monotonic_ns()}.log", "wb")  # noqa: SIM115 - owned by the child
    return subprocess.Popen([CDCD, *args], stdout=log, stderr=subprocess.STDOUT, env=os.environ)


def runs(landing: Path) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for b in read_batches(landing):
        out.setdefault(b.manifest.run_id, []).append(b.seq)
    return out


def workload(pg: PostgresServer, db: str, base: int) -> None:
    pg.psql(
        f"""INSERT INTO orders SELECT g, g * 1.5, 'n' || g FROM generate_series({base}, {base + 1999}) g;
            UPDATE orders SET amount = amount + 1 WHERE id % 7 = 0;
            UPDATE orders SET id = id + 500000 WHERE id BETWEEN {base} AND {base + 9};
            DELETE FROM orders WHERE id BETWEEN {base + 100} AND {base + 149};
            INSERT INTO items SELECT g, 'i' || g FROM generate_series({base}, {base + 499}) g;
            UPDATE items SET v = 'changed' WHERE k % 5 = 0;""",
        db,
    )


def recorded(target: Path, fmt: str, kind: str, table: str, seq: int) -> bool:
    """Whether the table's own log records a commit for batch ``seq`` (Delta txn, Iceberg snapshot summary)."""
    if fmt == "delta":
        logs = (target / kind / table / "_delta_log").glob("*.json")
        return any(f'"version":{seq},' in f.read_text() for f in logs)
    schema, name = table.split(".", 1)
    found = re.compile(r'"cdcd\.batch"\s*:\s*"' + str(seq) + '"')
    return any(found.search(f.read_text()) for f in (target / kind / schema / name / "metadata").glob("*.json"))


def last_batches(landing: Path, seqs: list[int]) -> dict[str, int]:
    """Per table, the last of the batches ``seqs`` holding its events: the seq its merge's commits record."""
    out: dict[str, int] = {}
    for b in read_batches(landing):
        if b.seq in seqs:
            out.update({f"{t.schema}.{t.name}": b.seq for t in b.tables})
    return out


def mid_merge(target: Path, fmt: str, last: dict[str, int]) -> bool:
    """Inside the merge of the batches whose tables' last seqs are ``last``: some of its table commits (change-log
    and mirror of each table) are made, not all. Whichever comes first (the change-log's and the mirror's writes
    overlap, the Delta file adoption makes a change-log commit fast), the MERGE into an existing mirror keeps the
    window open for seconds."""
    if fmt == "parquet":
        return any((target / "work").glob("*/t*"))  # the merge is staging
    done = [recorded(target, fmt, kind, table, seq) for table, seq in last.items() for kind in ("changelog", "tables")]
    return any(done) and not all(done)


@pytest.mark.parametrize("fmt", ["delta", "iceberg", "parquet"])
def test_spark_consumer_killed_mid_micro_batch_converges(
    spark: object, pg_server: PostgresServer, pg_db: str, tmp_path: Path, fmt: str
) -> None:
    pg_server.psql(
        "CREATE TABLE orders (id int PRIMARY KEY, amount numeric(12,2), note text);"
        "CREATE TABLE items (k int PRIMARY KEY, v text);"
        "INSERT INTO orders SELECT g, g, 'snap' FROM generate_series(1, 1000) g;",
        pg_db,
    )
    landing, target = tmp_path / "landing", tmp_path / "target"
    cfg = tmp_path / "cdcd.toml"
    cfg.write_text(f"""[source]
kind = "postgres"
port = {pg_server.port}
user = "postgres"
database = "{pg_db}"
tables = ["public.orders", "public.items"]
[source.postgres]
slot = "s_{pg_db}"
publication = "p_{pg_db}"
[state]
path = "{tmp_path / 'state'}"
[landing]
path = "{landing}"
max_batch_events = 500
max_batch_delay_ms = 50
[http]
listen = "127.0.0.1:{free_port()}"
[log]
format = "json"
""")
    daemon = spawn(tmp_path, "run", "-c", str(cfg))
    try:
        workload(pg_server, pg_db, 10000)
        pg_server.psql("INSERT INTO orders VALUES (900001, 0, 'sentinel')", pg_db)
        wait_for("first sentinel landed", lambda: 900001 in landed_ids(landing), 180, procs=daemon)
        daemon.kill()  # unacknowledged batches are landed again by the next run, under new seqs
        daemon.wait()
        workload(pg_server, pg_db, 20000)
        pg_server.psql("INSERT INTO orders VALUES (900002, 0, 'sentinel')", pg_db)
        daemon = spawn(tmp_path, "run", "-c", str(cfg))
        # streamed, not read by the resumed snapshot: then every change committed before it has landed
        wait_for("second sentinel streamed", lambda: 900002 in streamed_values(landing), 180, procs=daemon)
    finally:
        daemon.kill()
        daemon.wait()
    first_run, second_run = runs(landing).values()
    second_tables = last_batches(landing, second_run)
    assert set(second_tables) == {"public.orders", "public.items"}

    # Kill once the first run's merge has committed (its batches are marked consumed) and the
    # second's is half done: the merge takes seconds, the poll 20 ms.
    consumer = spawn(tmp_path, "spark", "run", "--landing", str(landing), "--target", str(target), "--once",
                     "--format", fmt)
    try:
        wait_for(
            "the second merge half done",
            lambda: set(first_run) <= set(consumed_seqs(landing)) and mid_merge(target, fmt, second_tables),
            180, procs=consumer, step=0.02,
        )
        consumer.send_signal(signal.SIGKILL)
        consumer.wait()
    finally:
        if consumer.poll() is None:
            consumer.kill()
            consumer.wait()
    applied = json.loads((target / "state" / "consumer.json").read_text())["applied_seq"]
    assert applied == first_run[-1], "the kill did not land inside the second merge"
    assert not set(second_run) & set(consumed_seqs(landing))

    consume_once(landing, target, fmt)  # the restart, in the worker's Spark session (tests/support/spark.py)
    assert consumed_seqs(landing) == sorted(first_run + second_run)
    assert not any((target / "work").iterdir())
    verify_equal(cfg, target)

    for table, key in (("public.orders", "id"), ("public.items", "k")):
        keys = [r[key] for r in table_rows(target, table)]
        assert len(keys) == len(set(keys)), f"{table}: a key is in the mirror twice"
        log = table_rows(target, table, "changelog")
        events = [(r["_cdc_pos"], r["_cdc_op"], r[key]) for r in log]
        assert len(events) == len(set(events)), f"{table}: an event is in the change-log twice"
