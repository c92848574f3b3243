"""Incremental snapshots with the real daemon: a table added to source.tables and the daemon restarted is
snapshotted while it streams and a workload runs; SIGKILL mid-snapshot, restart, the landing replays equal to the
source and Spark + `cdcd verify` agree."""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from daemon_harness import DaemonHarness

from cdcd.devservers import PostgresServer
from cdcd.events import TableId
from cdcd.landing.reader import mark_consumed
from cdcd.positions import PgPosition, parse_lsn

ROWS = 2000


class Setup(DaemonHarness):
    def __init__(self, tmp: Path, server: PostgresServer, db: str) -> None:
        super().__init__(tmp)
        self.server, self.db = server, db
        self.tables = ["public.a"]

    def source_sections(self) -> dict[str, dict[str, Any]]:
        return {
            "source": {"kind": "postgres", "port": self.server.port, "user": "postgres", "database": self.db,
                       "tables": self.tables, "sslmode": "disable"},
            "source.postgres": {"slot": f"s_{self.db}", "publication": f"p_{self.db}", "heartbeat_s": 0.3},
        }

    def sql(self, text: str) -> str:
        return self.server.psql(text, self.db)

    def landed_t(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for b in self.batches():
            data = b.tables.get(TableId("public", "t"))
            if data is not None:
                out += [dict(r, _seq=b.seq) for r in data.to_pylist()]
        return out

    def replay(self) -> dict[int, tuple[int, str]]:
        mirror: dict[int, tuple[int, str]] = {}
        for r in sorted(self.landed_t(), key=lambda r: r["_cdc_pos"]):
            if r["_cdc_op"] == "t":
                mirror.clear()
            elif r["_cdc_op"] == "d":
                mirror.pop(r["id"], None)
            else:
                if r["_cdc_before_key"] is not None:
                    mirror.pop(r["_cdc_before_key"]["id"], None)
                mirror[r["id"]] = (r["v"], r["pad"])
        return mirror

    def table(self) -> dict[int, tuple[int, str]]:
        out = self.sql("SELECT id, v, pad FROM t")
        return {int(i): (int(v), p) for i, v, p in (line.split("|") for line in out.splitlines() if line)}

    def incremental(self) -> dict[str, Any] | None:
        ckpt = self.checkpoint()
        return None if ckpt is None else (ckpt.source_state.get("incremental") or {}).get("public.t")


@pytest.fixture
def setup(tmp_path: Path, pg_server: PostgresServer, pg_db: str) -> Iterator[Setup]:
    s = Setup(tmp_path, pg_server, pg_db)
    try:
        yield s
    finally:
        s.close()


def writes(s: Setup, stop: threading.Event, counts: dict[str, int]) -> None:
    """Inserts, updates, key changes and deletes in small transactions until ``stop``."""
    rnd = random.Random(7)
    while not stop.is_set():
        stmts = []
        for _ in range(rnd.randint(1, 5)):
            k, op = rnd.randint(1, ROWS * 2), rnd.choice(["insert", "update", "rekey", "delete"])
            counts[op] = counts.get(op, 0) + 1
            stmts.append({"insert": f"INSERT INTO t VALUES ({k}, {k}, 'w') ON CONFLICT (id) DO NOTHING",
                          "update": f"UPDATE t SET v = v + 1, pad = 'u' WHERE id = {k}",
                          "rekey": f"UPDATE t SET id = {rnd.randint(1, ROWS * 2)} WHERE id = {k} AND NOT EXISTS "
                                   f"(SELECT 1 FROM t WHERE id = {rnd.randint(1, ROWS * 2)})",
                          "delete": f"DELETE FROM t WHERE id = {k}"}[op])
        # a key change's target is checked with a different random key: a clash aborts the transaction, fine
        try:
            s.sql("BEGIN; " + "; ".join(stmts) + "; COMMIT")
        except Exception:  # a unique violation of a key change: the transaction is rolled back
            counts["aborted"] = counts.get("aborted", 0) + 1


def test_table_added_on_restart_snapshotted_while_streaming_survives_sigkill(setup: Setup) -> None:
    s = setup
    s.sql(f"CREATE TABLE a (id int PRIMARY KEY); CREATE TABLE t (id int PRIMARY KEY, v int, pad text); "
          f"INSERT INTO t SELECT g, g, 'p' FROM generate_series(1, {ROWS}) g")
    s.start("landed", snapshot={"mode": "never"})
    s.wait("the first checkpoint", lambda: (c := s.checkpoint()) is not None and c.source_state.get("tables"))
    s.kill()
    stop, counts = threading.Event(), {}
    writer = threading.Thread(target=writes, args=(s, stop, counts))
    writer.start()
    try:
        s.tables = ["public.a", "public.t"]
        s.start("consumed", snapshot={"mode": "never"})
        acked, last = 0, 0
        while acked < 300:  # play the consumer: batches are acked only once consumed
            fresh = s.wait("a batch landed", lambda seen=last: [b for b in s.batches()
                                                                if not b.consumed and b.seq > seen])
            for b in fresh:
                mark_consumed(s.landing, b.seq)
                data = b.tables.get(TableId("public", "t"))
                acked += 0 if data is None else sum(data.column("_cdc_snapshot").to_pylist())
                last = max(last, b.seq)
        s.wait("the checkpoint covers the acked batches", lambda: (c := s.checkpoint()) and c.batch_seq >= last)
        s.wait("unacked batches landed", lambda: max(b.seq for b in s.batches()) > last + 1)
        held = s.incremental()
        assert held is not None and held["status"] == "running" and held["chunks"] >= 1, held
        s.kill()
        before_restart = max(b.seq for b in s.batches())
        s.start("landed", snapshot={"mode": "never"})
        s.wait("the incremental snapshot done", lambda: (j := s.incremental()) and j["status"] == "done",
               timeout=180)
    finally:
        stop.set()
        writer.join(60)
    assert min(counts.get(op, 0) for op in ("insert", "update", "rekey", "delete")) > 10, counts
    lsn = parse_lsn(s.sql("SELECT pg_logical_emit_message(false, 'cdcd_heartbeat', '')"))
    s.wait("the checkpoint passed the last write",
           lambda: (c := s.checkpoint()) and isinstance(c.position, PgPosition) and c.position.lsn >= lsn)
    after = [r for r in s.landed_t() if r["_seq"] > before_restart and r["_cdc_snapshot"]]
    assert after and min(r["id"] for r in after) > int(held["last_key"][0]), "acked chunks were read again"
    assert s.replay() == s.table()
    s.spark_and_verify()
