"""Crash safety of the MariaDB source with the real daemon: `cdcd run`, SIGKILL, restart.

Batches are held unacked with ``landing.ack = "consumed"``; the test plays the consumer
by writing "consumed" markers for the batches it wants acked.
"""

from __future__ import annotations

import itertools
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pymysql
import pytest
from daemon_harness import DaemonHarness, rows

from devtools.servers import MariaDBServer

_server_ids = itertools.count(7001)


class Setup(DaemonHarness):
    def __init__(self, tmp: Path, server: MariaDBServer, db: str) -> None:
        super().__init__(tmp)
        self.server, self.db = server, db
        self.server_id = next(_server_ids)

    def source_sections(self) -> dict[str, dict[str, Any]]:
        return {
            "source": {"kind": "mariadb", "port": self.server.port, "user": "cdc", "password": "secret",
                       "database": self.db, "tables": [f"{self.db}.t"], "sslmode": "disable"},
            "source.mysql": {"server_id": self.server_id},
        }

    def sql(self, *statements: str) -> list[Any]:
        conn = pymysql.connect(host="127.0.0.1", port=self.server.port, user="root", password="", database=self.db,
                               autocommit=True)
        try:
            with conn.cursor() as cur:
                result: list[Any] = []
                for statement in statements:
                    cur.execute(statement)
                    result = list(cur.fetchall())
                return result
        finally:
            conn.close()


@pytest.fixture
def setup(tmp_path: Path, maria_server: MariaDBServer, maria_db: str) -> Iterator[Setup]:
    s = Setup(tmp_path, maria_server, maria_db)
    try:
        yield s
    finally:
        s.close()


@pytest.mark.parametrize("shape", ["one_large_transaction", "many_transactions"])
def test_sigkill_before_ack_redelivers_exactly_the_unacked_events(shape: str, setup: Setup) -> None:
    s = setup
    s.sql("CREATE TABLE t (id INT PRIMARY KEY, v INT)")
    s.start("consumed", snapshot={"mode": "never"})
    s.wait("the stream start in the checkpoint", lambda: s.checkpoint() is not None)
    if shape == "one_large_transaction":
        s.sql("INSERT INTO t SELECT seq, seq FROM seq_1_to_200")
    else:
        for i in range(20):
            s.sql(f"INSERT INTO t SELECT seq, seq FROM seq_{i * 10 + 1}_to_{i * 10 + 10}")
    # at most 4 batches wait unacked (runtime.max_inflight_batches): with small transactions that is ~40 events
    s.wait("30 events landed", lambda: sum(len(rows(b)) for b in s.batches()) >= 30)
    acked_rows, last_acked = s.consume_upto(15)
    acked = {r["_cdc_pos"] for r in acked_rows}
    s.wait("the checkpoint covers the acked batches",
           lambda: (c := s.checkpoint()) is not None and c.batch_seq >= last_acked)
    s.kill()
    landed_before = {r["_cdc_pos"] for b in s.batches() for r in rows(b)}
    unacked = landed_before - acked
    max_seq = max(b.seq for b in s.batches())
    assert unacked, "some landed events must still be unacked at the kill"
    s.start("landed", snapshot={"mode": "never"})
    s.wait("all 200 rows landed", lambda: {r["id"] for b in s.batches() for r in rows(b)} >= set(range(1, 201)))
    after = [r for b in s.batches() if b.seq > max_seq for r in rows(b)]
    positions = [r["_cdc_pos"] for r in after]
    assert len(positions) == len(set(positions)), "an event came twice after the restart"
    assert not set(positions) & acked, "an acked event came again"
    assert unacked <= set(positions), "an unacked event was lost"
    assert {r["id"] for r in after} == set(range(1, 201)) - {r["id"] for r in acked_rows}


def test_sigkill_mid_snapshot_resumes_after_the_acked_keys(setup: Setup) -> None:
    s = setup
    s.sql("CREATE TABLE t (id INT PRIMARY KEY, v INT)", "INSERT INTO t SELECT seq, seq FROM seq_1_to_300")
    s.start("consumed")
    s.wait("60 snapshot rows landed", lambda: sum(len(rows(b)) for b in s.batches()) >= 60)
    acked_rows, last_acked = s.consume_upto(40)
    s.wait("the checkpoint covers the acked batches",
           lambda: (c := s.checkpoint()) is not None and c.batch_seq >= last_acked)
    ckpt = s.checkpoint()
    assert ckpt is not None
    acked_ids = {r["id"] for r in acked_rows}
    assert len(acked_ids) == len(acked_rows) and all(r["_cdc_snapshot"] for r in acked_rows)
    assert ckpt.source_state["snapshot"]["tables"][f"{s.db}.t"]["last_key"] == [max(acked_ids)]
    s.kill()
    max_seq = max(b.seq for b in s.batches())
    s.sql("UPDATE t SET v = -v WHERE id = 300")
    s.start("landed")
    s.wait("all rows landed", lambda: {r["id"] for b in s.batches() for r in rows(b)} >= set(range(1, 301)))
    s.wait("the update streamed", lambda: any(r["v"] == -300 and not r["_cdc_snapshot"]
                                              for b in s.batches() if b.seq > max_seq for r in rows(b)))
    after = [r for b in s.batches() if b.seq > max_seq for r in rows(b) if r["_cdc_snapshot"]]
    assert not {r["id"] for r in after} & acked_ids, "an acked snapshot key was delivered again"
    assert acked_ids | {r["id"] for r in after} == set(range(1, 301))
    assert len({r["id"] for r in after}) == len(after)
    done = s.wait("snapshot done in the checkpoint",
                  lambda: (c := s.checkpoint()) and c.source_state["snapshot"]["done"] and c)
    assert done.source_state["snapshot"]["watermark"] == ckpt.source_state["snapshot"]["watermark"]


def test_clean_restart_delivers_nothing_again(setup: Setup) -> None:
    s = setup
    s.sql("CREATE TABLE t (id INT PRIMARY KEY, v INT)", "INSERT INTO t SELECT seq, seq FROM seq_1_to_30")
    proc = s.start("landed")
    s.wait("the snapshot landed", lambda: {r["id"] for b in s.batches() for r in rows(b)} >= set(range(1, 31)))
    s.sql("INSERT INTO t VALUES (31, 31)")
    s.wait("the insert landed", lambda: any(r["id"] == 31 for b in s.batches() for r in rows(b)))
    s.wait("checkpoint past the insert", lambda: (c := s.checkpoint()) and c.event_count >= 31)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0, s.log.read_text()[-3000:]
    max_seq = max(b.seq for b in s.batches())
    s.start("landed")
    s.sql("INSERT INTO t VALUES (32, 32)")  # a sentinel: once it landed, any replay would have too
    s.wait("the sentinel landed", lambda: any(r["id"] == 32 for b in s.batches() for r in rows(b)))
    assert [r["id"] for b in s.batches() if b.seq > max_seq for r in rows(b)] == [32]


def test_purged_binlog_stops_the_daemon(setup: Setup) -> None:
    s = setup
    s.sql("CREATE TABLE t (id INT PRIMARY KEY, v INT)", "INSERT INTO t VALUES (1, 1)")
    proc = s.start("landed")
    s.wait("a checkpoint", lambda: (c := s.checkpoint()) and c.event_count >= 1)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0
    ckpt = s.checkpoint()
    assert ckpt is not None
    s.sql("FLUSH BINARY LOGS", "INSERT INTO t VALUES (2, 2)", "FLUSH BINARY LOGS")
    file = ckpt.position.file  # type: ignore[union-attr]
    for _ in range(100):  # PURGE skips files the engine has not checkpointed yet
        s.sql(f"PURGE BINARY LOGS TO '{s.sql('SHOW BINARY LOGS')[-1][0]}'")
        if file not in [r[0] for r in s.sql("SHOW BINARY LOGS")]:
            break
        time.sleep(0.1)
    proc = s.start("landed")
    code = proc.wait(60)
    log = s.log.read_text()
    assert code != 0, log[-3000:]
    assert ckpt.position.file in log and "purged" in log  # type: ignore[union-attr]
    assert not any(r["id"] == 2 for b in s.batches() for r in rows(b))
