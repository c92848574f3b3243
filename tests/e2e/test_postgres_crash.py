"""Crash safety of the PostgreSQL source with the real daemon: `cdcd run`, SIGKILL, restart.

Batches are held unacked with ``landing.ack = "consumed"``; the test plays the consumer
by writing "consumed" markers for the batches it wants acked.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from daemon_harness import DaemonHarness, rows

from cdcd.positions import PgPosition, parse_lsn
from devtools.servers import PostgresServer


class Setup(DaemonHarness):
    def __init__(self, tmp: Path, server: PostgresServer, db: str) -> None:
        super().__init__(tmp)
        self.server, self.db = server, db
        self.slot = f"s_{db}"

    def source_sections(self) -> dict[str, dict[str, Any]]:
        return {
            "source": {"kind": "postgres", "port": self.server.port, "user": "postgres", "database": self.db,
                       "tables": ["public.t"], "sslmode": "disable"},
            "source.postgres": {"slot": self.slot, "publication": f"p_{self.db}", "heartbeat_s": 0.5},
        }

    def confirmed_flush(self) -> int:
        return parse_lsn(self.server.psql(
            f"SELECT confirmed_flush_lsn FROM pg_replication_slots WHERE slot_name = '{self.slot}'"))


@pytest.fixture
def setup(tmp_path: Path, pg_server: PostgresServer, pg_db: str) -> Iterator[Setup]:
    s = Setup(tmp_path, pg_server, pg_db)
    try:
        yield s
    finally:
        s.close()


def _check_flush_within_checkpoint(s: Setup) -> None:
    # The slot first, then the checkpoint: a running daemon saves a checkpoint before it confirms the flush,
    # so a checkpoint read afterwards is at least the one the flush was confirmed for (the other order races).
    flushed = s.confirmed_flush()
    ckpt = s.checkpoint()
    assert ckpt is not None and isinstance(ckpt.position, PgPosition)
    assert flushed <= ckpt.position.lsn


@pytest.mark.parametrize("shape", ["one_large_transaction", "many_transactions"])
def test_sigkill_before_ack_redelivers_exactly_the_unacked_events(shape: str, setup: Setup) -> None:
    s = setup
    s.server.psql("CREATE TABLE t (id int PRIMARY KEY, v int)", s.db)
    s.start("consumed", snapshot={"mode": "never"})
    s.wait("the start mark in the checkpoint", lambda: s.checkpoint() is not None)
    if shape == "one_large_transaction":
        s.server.psql("INSERT INTO t SELECT g, g FROM generate_series(1, 200) g", s.db)
    else:
        for i in range(20):
            s.server.psql(f"INSERT INTO t SELECT g, g FROM generate_series({i * 10 + 1}, {i * 10 + 10}) g", s.db)
    # With max_inflight_batches = 4 and small transactions, as few as 4 batches of ~10 events land before
    # backpressure holds the reader: wait for 30, ack about half.
    s.wait("30 events landed", lambda: sum(len(rows(b)) for b in s.batches()) >= 30)
    acked_rows, last_acked = s.consume_upto(15)
    acked = {r["_cdc_pos"] for r in acked_rows}
    s.wait("the checkpoint covers the acked batches",
           lambda: (c := s.checkpoint()) is not None and c.batch_seq >= last_acked)
    _check_flush_within_checkpoint(s)
    s.kill()
    # Only now: until the kill the daemon may land more batches (acks freed in-flight slots).
    landed_before = {r["_cdc_pos"] for b in s.batches() for r in rows(b)}
    unacked = landed_before - acked
    max_seq = max(b.seq for b in s.batches())
    assert unacked, "some landed events must still be unacked at the kill"
    _check_flush_within_checkpoint(s)
    s.start("landed", snapshot={"mode": "never"})
    s.wait("all 200 rows landed", lambda: {r["id"] for b in s.batches() for r in rows(b)} >= set(range(1, 201)))
    after = [r for b in s.batches() if b.seq > max_seq for r in rows(b)]
    positions = [r["_cdc_pos"] for r in after]
    assert len(positions) == len(set(positions)), "an event came twice after the restart"
    assert not set(positions) & acked, "an acked event came again"
    assert unacked <= set(positions), "an unacked event was lost"
    assert {r["id"] for r in after} == set(range(1, 201)) - {r["id"] for r in acked_rows}
    _check_flush_within_checkpoint(s)


def test_sigkill_mid_snapshot_resumes_after_the_acked_keys(setup: Setup) -> None:
    s = setup
    s.server.psql("CREATE TABLE t (id int PRIMARY KEY, v int);"
                  "INSERT INTO t SELECT g, g FROM generate_series(1, 300) g", s.db)
    s.start("consumed")
    s.wait("60 snapshot rows landed", lambda: sum(len(rows(b)) for b in s.batches()) >= 60)
    acked_rows, last_acked = s.consume_upto(40)
    s.wait("the checkpoint covers the acked batches",
           lambda: (c := s.checkpoint()) is not None and c.batch_seq >= last_acked)
    ckpt = s.checkpoint()
    acked_ids = {r["id"] for r in acked_rows}
    assert len(acked_ids) == len(acked_rows) and all(r["_cdc_snapshot"] for r in acked_rows)
    assert ckpt.source_state["snapshot"]["tables"]["public.t"]["last_key"] == [str(max(acked_ids))]
    s.kill()
    max_seq = max(b.seq for b in s.batches())  # after the kill: batches may land until then
    s.server.psql("UPDATE t SET v = -v WHERE id = 300", s.db)
    s.start("landed")
    s.wait("all rows landed", lambda: {r["id"] for b in s.batches() for r in rows(b)} >= set(range(1, 301)))
    s.wait("the update streamed", lambda: any(r["v"] == -300 and not r["_cdc_snapshot"]
                                              for b in s.batches() if b.seq > max_seq for r in rows(b)))
    after = [r for b in s.batches() if b.seq > max_seq for r in rows(b) if r["_cdc_snapshot"]]
    assert not {r["id"] for r in after} & acked_ids, "an acked snapshot key was delivered again"
    assert acked_ids | {r["id"] for r in after} == set(range(1, 301))
    assert len({r["id"] for r in after}) == len(after)
    ckpt = s.wait("snapshot done in the checkpoint",
                  lambda: (c := s.checkpoint()) and c.source_state["snapshot"]["status"] == "done" and c)
    assert ckpt.source_state["watermark"] == s.checkpoint().source_state["watermark"]
    _check_flush_within_checkpoint(s)


def test_clean_restart_without_writes_delivers_nothing(setup: Setup) -> None:
    s = setup
    s.server.psql("CREATE TABLE t (id int PRIMARY KEY, v int);"
                  "INSERT INTO t SELECT g, g FROM generate_series(1, 30) g", s.db)
    proc = s.start("landed")
    s.wait("the snapshot landed", lambda: {r["id"] for b in s.batches() for r in rows(b)} >= set(range(1, 31)))
    s.server.psql("INSERT INTO t VALUES (31, 31)", s.db)
    s.wait("the insert landed", lambda: any(r["id"] == 31 for b in s.batches() for r in rows(b)))
    s.wait("checkpoint past the insert", lambda: (c := s.checkpoint()) and c.event_count >= 31)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0, s.log.read_text()[-3000:]
    max_seq = max(b.seq for b in s.batches())
    saved = s.checkpoint()
    s.start("landed")
    # Heartbeats every 0.5s are committed (as event-less batches): wait for a few to be sure the stream is live.
    s.wait("three heartbeats committed after the restart",
           lambda: (c := s.checkpoint()) and c.batch_seq >= saved.batch_seq + 3)
    assert [r for b in s.batches() if b.seq > max_seq for r in rows(b)] == []
    assert s.checkpoint().position >= saved.position


def test_dropped_slot_stops_the_daemon_with_a_fatal_error(setup: Setup) -> None:
    s = setup
    s.server.psql("CREATE TABLE t (id int PRIMARY KEY, v int); INSERT INTO t VALUES (1, 1)", s.db)
    proc = s.start("landed")
    s.wait("a checkpoint", lambda: (c := s.checkpoint()) and c.event_count >= 1)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0
    s.server.psql(f"SELECT pg_drop_replication_slot('{s.slot}')")
    proc = s.start("landed")
    code = proc.wait(60)
    assert code == 9, s.log.read_text()[-3000:]  # POSITION_LOST
    assert "named by the checkpoint does not exist" in s.log.read_text()
    assert s.server.psql(f"SELECT count(*) FROM pg_replication_slots WHERE slot_name = '{s.slot}'") == "0"
    assert os.path.exists(s.state / "checkpoint.json")
