"""A new snapshot supersedes what an abandoned one landed; a consumer refuses a landing zone it does not belong to.

Real PostgreSQL, the real daemon (`cdcd run`, SIGKILL), the real Spark consumer (parquet) and `cdcd verify`.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from daemon_harness import DaemonHarness

from cdcd.config import load_config
from cdcd.verify import verify
from devtools.servers import PostgresServer

pytestmark = [pytest.mark.spark, pytest.mark.slow]


class Setup(DaemonHarness):
    def __init__(self, tmp: Path, server: PostgresServer, db: str) -> None:
        super().__init__(tmp)
        self.server, self.db = server, db
        self.target = tmp / "target"

    def source_sections(self) -> dict[str, dict[str, Any]]:
        return {
            "source": {"kind": "postgres", "port": self.server.port, "user": "postgres", "database": self.db,
                       "tables": ["public.t"], "sslmode": "disable"},
            "source.postgres": {"slot": f"s_{self.db}", "publication": f"p_{self.db}", "heartbeat_s": 0.5},
        }

    def run_until_landed(self, sentinel: int, **extra: dict[str, Any]) -> None:
        """Start the daemon (ack = landed), insert ``sentinel`` and wait until it landed, then stop it."""
        proc = self.start("landed", **extra)
        self.server.psql(f"INSERT INTO t VALUES ({sentinel}, 0)", self.db)
        self.wait(f"row {sentinel} landed", lambda: sentinel in self.landed_ids())
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, self.tail()

    def consume(self) -> None:
        from cdcd.spark.job import run

        assert run(str(self.landing), str(self.target), once=True) == 0

    def verify(self) -> int:
        return verify(load_config(self.config("landed")), str(self.target))


@pytest.fixture
def setup(tmp_path: Path, pg_server: PostgresServer, pg_db: str) -> Iterator[Setup]:
    pg_server.psql("CREATE TABLE t (id int PRIMARY KEY, v int); "
                   "INSERT INTO t SELECT g, g FROM generate_series(1, 100) g", pg_db)
    s = Setup(tmp_path, pg_server, pg_db)
    try:
        yield s
    finally:
        s.close()


def test_restart_before_the_first_checkpoint_does_not_bring_a_deleted_row_back(spark: object, setup: Setup) -> None:
    s = setup
    # The first run lands snapshot batches but nothing is consumed, so nothing is checkpointed.
    s.start("consumed")
    s.wait("row 5 of the first snapshot landed", lambda: 5 in s.landed_ids())
    s.kill()
    assert s.checkpoint() is None or s.checkpoint().batch_seq == 0  # type: ignore[union-attr]
    s.server.psql("DELETE FROM t WHERE id = 5", s.db)
    # The restart takes a fresh snapshot (the slot stays, no checkpoint) and streams from there.
    s.run_until_landed(1000)
    s.consume()
    assert s.verify() == 0  # the mirror has 100 rows (99 + 1000), not row 5 of the abandoned snapshot


def test_when_needed_resnapshot_supersedes_the_consumed_generation(spark: object, setup: Setup) -> None:
    s = setup
    s.run_until_landed(1000, snapshot={"mode": "when_needed"})
    s.consume()
    assert s.verify() == 0
    # the slot is lost while cdcd is down, and a row is deleted meanwhile: its delete is never streamed
    s.server.psql(f"SELECT pg_drop_replication_slot('s_{s.db}')", s.db)
    s.server.psql("DELETE FROM t WHERE id = 5", s.db)
    s.run_until_landed(1001, snapshot={"mode": "when_needed"})
    s.consume()
    assert s.verify() == 0


def test_consumer_refuses_a_recreated_landing_zone(spark: object, setup: Setup, capsys: Any) -> None:
    import shutil

    from cdcd.logging import configure_logging
    from cdcd.spark.job import run

    s = setup
    s.run_until_landed(1000)
    s.consume()
    # the documented re-snapshot: state directory and landing zone removed, the daemon starts again
    shutil.rmtree(s.state)
    shutil.rmtree(s.landing)
    s.server.psql(f"SELECT pg_drop_replication_slot('s_{s.db}')", s.db)
    s.server.psql("DELETE FROM t WHERE id = 5; INSERT INTO t VALUES (2000, 0)", s.db)
    s.run_until_landed(1001)
    # as `cdcd spark run` sets it up (an earlier in-process test of this worker may have set up another stream)
    configure_logging("info", "json", stream="stderr")
    assert run(str(s.landing), str(s.target), once=True) == 2
    assert "does not belong" in capsys.readouterr().err
    # nothing of the new zone was marked consumed: it stays for a fresh target
    assert not list((s.landing / "consumed").iterdir())
    s.target = s.tmp / "target-2"
    s.consume()
    assert s.verify() == 0
