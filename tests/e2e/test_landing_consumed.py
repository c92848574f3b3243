"""`landing.ack = "consumed"` end to end: with no consumer the daemon (a real process) stops
reading from PostgreSQL after `runtime.max_inflight_batches` batches, its memory stays flat and
its checkpoint stays put while a writer keeps inserting; a real `cdcd spark run` (streaming, into Delta Lake and
Iceberg) then drains it all and `cdcd verify` finds the mirror equal to the source. A following consumer into
Parquet is test_spark_stop's (issue 32: the daemon's side here is the same for every format)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from support.spark import verify_equal
from support.waits import wait_for

from cdcd.checkpoint.store import CheckpointStore
from cdcd.landing.reader import consumed_seqs, landed_seqs
from devtools.servers import PostgresServer, free_port

pytestmark = [pytest.mark.spark, pytest.mark.slow]
CDCD = str(Path(sys.executable).with_name("cdcd"))
INFLIGHT = 3
BATCH = 2000
ROW_BYTES = 1500
FIRST_ROWS = 6500  # more than may be in flight
MORE_ROWS = [2500] * 5  # ~19 MB of row data that the daemon must leave in the WAL
RSS_GROWTH_LIMIT = 12 * 1024 * 1024  # generous (the bounded source queue); holding the writes would take more


def vm_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def insert(pg: PostgresServer, db: str, first: int, n: int) -> None:
    pg.psql(f"INSERT INTO orders SELECT g, repeat(chr(65 + g % 26), {ROW_BYTES}) "
            f"FROM generate_series({first}, {first + n - 1}) g", db)


def checkpoint(state: Path) -> tuple[int, int] | None:
    ckpt = CheckpointStore(state).load()
    return None if ckpt is None else (ckpt.event_count, ckpt.batch_seq)


@pytest.mark.parametrize("fmt", ["delta", "iceberg"])
def test_consumed_mode_holds_the_backlog_in_the_database_then_drains(
    spark: object, pg_server: PostgresServer, pg_db: str, tmp_path: Path, fmt: str
) -> None:
    pg_server.psql("CREATE TABLE orders (id int PRIMARY KEY, pad text)", pg_db)
    landing, state, target = tmp_path / "landing", tmp_path / "state", tmp_path / "target"
    cfg = tmp_path / "cdcd.toml"
    cfg.write_text(f"""[source]
kind = "postgres"
port = {pg_server.port}
user = "postgres"
database = "{pg_db}"
tables = ["public.orders"]
[source.postgres]
slot = "s_{pg_db}"
publication = "p_{pg_db}"
[state]
path = "{state}"
[landing]
path = "{landing}"
ack = "consumed"
max_batch_events = {BATCH}
max_batch_delay_ms = 50
[runtime]
max_inflight_batches = {INFLIGHT}
[http]
listen = "127.0.0.1:{free_port()}"
[log]
format = "json"
""")
    procs: list[subprocess.Popen[bytes]] = []

    def spawn(*args: str) -> subprocess.Popen[bytes]:
        log = open(tmp_path / f"{args[0]}-{len(procs)}.log", "wb")  # noqa: SIM115 - owned by the child
        procs.append(subprocess.Popen([CDCD, *args], stdout=log, stderr=subprocess.STDOUT, env=os.environ))
        return procs[-1]

    try:
        daemon = spawn("run", "-c", str(cfg))
        insert(pg_server, pg_db, 1, FIRST_ROWS)
        wait_for(f"{INFLIGHT} batches landed", lambda: len(landed_seqs(landing)) >= INFLIGHT, 240, procs=daemon)
        held = checkpoint(state)
        rss_start = vm_rss(daemon.pid)
        landed, rss = [], []
        next_id = FIRST_ROWS + 1
        for n in MORE_ROWS:  # the writer keeps inserting while nothing is consumed
            insert(pg_server, pg_db, next_id, n)
            next_id += n
            landed.append(len(landed_seqs(landing)))
            rss.append(vm_rss(daemon.pid))
        total = next_id - 1 + 1  # the rows and the (empty) snapshot's opening truncate
        assert daemon.poll() is None
        assert landed == [INFLIGHT] * len(MORE_ROWS), "the daemon kept landing with no batch consumed"
        assert consumed_seqs(landing) == []
        assert max(rss) - rss_start < RSS_GROWTH_LIMIT, f"RSS grew from {rss_start} to {rss}"
        assert checkpoint(state) == held

        # the consumer drains everything: each commit frees a slot, the daemon lands the next batch
        consumer = spawn("spark", "run", "--landing", str(landing), "--target", str(target), "--format", fmt)
        # ten merges, each a Spark job: on a loaded 2-core machine this takes minutes
        wait_for(f"checkpoint at {total} events", lambda: (checkpoint(state) or (0, 0))[0] == total, 450,
                 procs=[daemon, consumer])
        consumer.send_signal(signal.SIGTERM)
        assert consumer.wait(120) == 0
        daemon.send_signal(signal.SIGTERM)
        assert daemon.wait(60) == 0
        assert len(landed_seqs(landing)) >= total // BATCH
        verify_equal(cfg, target)  # in the worker's Spark session: the consumer above is the process under test
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
