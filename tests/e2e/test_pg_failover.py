"""A PostgreSQL 18 failover (issue 29, section 3): a primary and a physical standby with slot synchronisation
(tests/support/pg_standby.py); two daemons stream from the primary through one address (a switch proxy), one with
source.postgres.failover_slot = true, one without. Under a workload the primary crashes, the address moves to the
standby and the standby is promoted: the daemon with the failover slot goes on from the standby's synchronised copy
(Spark + `cdcd verify` equal to the new primary); the other stops with the lost-position exit code and no slot is
created behind the operator's back. `cdcd check` reports both servers' failover settings on the way."""

from __future__ import annotations

import random
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from daemon_harness import CDCD, DaemonHarness
from support.pg_standby import promote, start_standby, wait_slot_synced
from switch_proxy import SwitchProxy

from cdcd.daemon.exitcodes import ExitCode
from devtools.servers import PostgresServer, pg18_bindir

pytestmark = pytest.mark.spark  # `cdcd spark run` (Parquet) before verify
ROWS = 50


class Setup(DaemonHarness):
    def __init__(self, tmp: Path, port: int, slot: str, failover: bool) -> None:
        tmp.mkdir()
        super().__init__(tmp)
        self.port, self.slot, self.failover = port, slot, failover

    def source_sections(self) -> dict[str, dict[str, Any]]:
        return {"source": {"kind": "postgres", "port": self.port, "user": "postgres", "database": "app",
                           "tables": ["public.t"], "sslmode": "disable", "connect_timeout_s": 5},
                "source.postgres": {"slot": self.slot, "publication": f"p_{self.slot}", "heartbeat_s": 0.3,
                                    "failover_slot": self.failover}}

    def start(self, ack: str, **extra: dict[str, Any]) -> Any:
        return super().start(ack, runtime={"reconnect_max_s": 1.0}, **extra)

    def check(self, port: int) -> str:
        """`cdcd check` against the server on ``port`` (its output; some checks fail on a standby)."""
        cfg = self.config("landed", source={"port": port})
        return subprocess.run([CDCD, "check", "-c", str(cfg)], capture_output=True, text=True, timeout=120).stdout


def workload_until_gone(server: PostgresServer, rng: random.Random, ops: int, tag: str,
                        stop: threading.Event) -> None:
    """``workload`` on a primary that crashes under it: the statement running then fails, and the writer ends."""
    try:
        workload(server, rng, ops, tag, stop)
    except subprocess.CalledProcessError as e:
        if "connection" not in e.stderr and "terminat" not in e.stderr:
            raise  # not the crash: a real failure of the workload


def workload(server: PostgresServer, rng: random.Random, ops: int, tag: str, stop: threading.Event) -> None:
    """Inserts, updates and deletes in one- and three-statement transactions until ``ops`` or ``stop``."""
    for n in range(ops):
        if stop.is_set():
            return
        statements = []
        for _ in range(rng.choice((1, 1, 3))):
            i, kind = rng.randrange(1, 120), rng.random()
            if kind < 0.5:
                statements.append(f"INSERT INTO t VALUES ({i}, {n}, '{tag}-{n}') "
                                  f"ON CONFLICT (id) DO UPDATE SET v = {n}, note = '{tag}-{n}'")
            elif kind < 0.8:
                statements.append(f"UPDATE t SET v = v + 1, note = '{tag}-u{n}' WHERE id = {i}")
            else:
                statements.append(f"DELETE FROM t WHERE id = {i}")
        server.psql("BEGIN;" + ";".join(statements) + ";COMMIT", "app", timeout_s=60)


@pytest.fixture
def pair() -> Iterator[tuple[PostgresServer, PostgresServer]]:
    primary = PostgresServer(bindir=pg18_bindir()).start()
    standby: PostgresServer | None = None
    try:
        primary.create_database("app")
        primary.psql("CREATE TABLE t (id int PRIMARY KEY, v int, note text);"
                     f"INSERT INTO t SELECT g, g, 'initial' FROM generate_series(1, {ROWS}) g", "app")
        standby = start_standby(primary, "standby1", "app")
        # logical changes of failover slots reach cdcd only once the standby has them
        primary.psql("ALTER SYSTEM SET synchronized_standby_slots = 'standby1'")
        primary.psql("SELECT pg_reload_conf()")
        yield primary, standby
    finally:
        if standby is not None:
            standby.stop()
        primary.stop()


def test_promotion_with_and_without_a_failover_slot(
        spark: object, tmp_path: Path, pair: tuple[PostgresServer, PostgresServer]) -> None:
    primary, standby = pair
    proxy = SwitchProxy(primary.port)
    kept = Setup(tmp_path / "failover", proxy.port, "cdcd_failover", True)
    plain = Setup(tmp_path / "plain", proxy.port, "cdcd_plain", False)
    stop = threading.Event()
    try:
        kept.start("landed")
        plain.start("landed")
        for s in (kept, plain):
            s.wait("the snapshot landed", lambda s=s: s.landed_ids() >= set(range(1, ROWS + 1)))
        out = kept.check(primary.port)
        assert "ok    failover_slot: slot 'cdcd_failover' failover = true" in out, out
        assert "ok    synchronized_standby_slots: synchronized_standby_slots = 'standby1'" in out, out
        wait_slot_synced(standby, "cdcd_failover")
        out = kept.check(standby.port)
        assert "ok    sync_replication_slots: standby: sync_replication_slots = on" in out, out
        assert "ok    synced_slot: standby: slot 'cdcd_failover' is a synchronised copy" in out, out
        assert "slot 'cdcd_plain' is not here: after a promotion cdcd would stop with exit 9" in plain.check(
            standby.port)

        rng = random.Random(29)
        writer = threading.Thread(target=workload_until_gone, args=(primary, rng, 100_000, "p", stop))
        writer.start()
        kept.wait("changes of the workload landed", lambda: len(kept.batches()) > 5)
        # the promotion, under the workload: the primary crashes (its last commits may never reach the standby),
        # the address leads to the standby, which becomes the primary
        primary.halt(immediate=True)
        writer.join(60)
        assert not writer.is_alive()
        proxy.switch(standby.port)
        promote(standby)

        assert plain.procs[-1].wait(120) == ExitCode.POSITION_LOST, plain.tail()
        assert "replication slot 'cdcd_plain'" in plain.log.read_text() and "does not exist" in plain.log.read_text()
        assert standby.psql("SELECT count(*) FROM pg_replication_slots WHERE slot_name = 'cdcd_plain'") == "0"

        stop.clear()
        workload(standby, rng, 150, "s", stop)
        standby.psql("INSERT INTO t VALUES (2000, 0, 'standby-sentinel')", "app")
        kept.wait("the new primary's writes landed", lambda: 2000 in kept.landed_ids(), timeout=180)
        assert kept.procs[-1].poll() is None, kept.tail()
        assert "the server moved to a new timeline that contains everything captured" in kept.log.read_text()
        kept.spark_and_verify()  # through the proxy: the new primary
    finally:
        stop.set()
        kept.close()
        plain.close()
        proxy.close()
