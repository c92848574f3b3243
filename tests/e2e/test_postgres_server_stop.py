"""PostgreSQL with the real daemon: the server's own fast shutdown (``pg_ctl stop -m fast``, SIGINT) finishes
while cdcd streams, and cdcd resumes once the server is back, nothing lost or doubled.

At a fast shutdown the walsender waits, before it exits, for the client to confirm (standby status ``flush``)
everything it sent, which ends past the shutdown checkpoint record. cdcd confirms only what its durable
checkpoint covers, so it takes the keepalive the walsender sends then (asking for a reply) as a position of its
own (a heartbeat mark: checkpointed, then confirmed) — docs/postgres.md "The server's own shutdown". Without
that the shutdown never ends while cdcd is connected.

The server is the test's own: it is stopped and started again.
"""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from daemon_harness import DaemonHarness, rows

from devtools.servers import PostgresServer

pytestmark = pytest.mark.slow

#: A fast shutdown of an idle test server takes well under a second; this bounds a hung one.
SHUTDOWN_LIMIT_S = 30.0


class Setup(DaemonHarness):
    def __init__(self, tmp: Path, server: PostgresServer) -> None:
        super().__init__(tmp)
        self.server = server

    def source_sections(self) -> dict[str, dict[str, Any]]:
        return {
            "source": {"kind": "postgres", "port": self.server.port, "user": "postgres", "database": "app",
                       "tables": ["public.t"], "sslmode": "disable"},
            # heartbeats far apart: the idle stream's progress at the shutdown is not theirs
            "source.postgres": {"slot": "cdcd_stop", "publication": "cdcd_stop", "heartbeat_s": 3600},
        }

    def start(self, ack: str, **extra: dict[str, Any]) -> Any:
        return super().start(ack, runtime={"reconnect_max_s": 1.0}, **extra)

    def sql(self, statement: str) -> str:
        return self.server.psql(statement, "app")

    def streamed(self) -> list[dict[str, Any]]:
        return [r for b in self.batches() for r in rows(b) if not r["_cdc_snapshot"]]

    def replay(self) -> dict[int, int]:
        events = [r for b in self.batches() for r in rows(b)]
        mirror: dict[int, int] = {}
        for r in sorted(events, key=lambda r: r["_cdc_pos"]):
            if r["_cdc_op"] == "d":
                mirror.pop(r["id"], None)
            elif r["_cdc_op"] == "t":
                mirror.clear()
            else:
                mirror[r["id"]] = r["v"]
        return mirror

    def table(self) -> dict[int, int]:
        out = self.sql("SELECT id, v FROM t")
        return {int(i): int(v) for i, v in (line.split("|") for line in out.splitlines() if line)}

    def walsender(self) -> str:
        return self.server.psql("SELECT r.state, r.sent_lsn, r.write_lsn, r.flush_lsn, a.wait_event "
                                "FROM pg_stat_replication r JOIN pg_stat_activity a USING (pid)")

    def fast_shutdown(self) -> None:
        """The server's fast shutdown (SIGINT to the postmaster), bounded: a hung one fails the test with what the
        walsender had sent and what cdcd had confirmed, then is ended by an immediate shutdown."""
        before = self.walsender()
        proc = self.server.proc
        assert proc is not None
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=SHUTDOWN_LIMIT_S)
        except subprocess.TimeoutExpired:
            left = subprocess.run(["ps", "-o", "pid,args", "--ppid", str(proc.pid)], capture_output=True, text=True)
            self.server.halt(immediate=True)
            raise AssertionError(
                f"the server's fast shutdown did not finish within {SHUTDOWN_LIMIT_S:g}s while cdcd streamed; "
                f"pg_stat_replication before it (state|sent|write|flush|wait event): {before}; the server's "
                f"processes left:\n{left.stdout}\n{self.tail()}"
            ) from None
        self.server.proc = None


@pytest.fixture
def setup(tmp_path: Path) -> Iterator[Setup]:
    # a small logical_decoding_work_mem: a transaction of a few thousand rows is streamed in progress (protocol 2)
    server = PostgresServer(settings={"logical_decoding_work_mem": "64kB"}).start()
    server.create_database("app")
    s = Setup(tmp_path, server)
    s.sql("CREATE TABLE t (id int PRIMARY KEY, v int)")
    s.sql("INSERT INTO t SELECT g, g FROM generate_series(1, 50) g")
    try:
        yield s
    finally:
        s.close()
        server.stop()


def workload(s: Setup, lo: int) -> int:
    """Inserts, updates and deletes in a few transactions; the highest id inserted."""
    for at in range(lo, lo + 300, 100):
        s.sql(f"INSERT INTO t SELECT g, g FROM generate_series({at}, {at + 99}) g")
        s.sql(f"UPDATE t SET v = -v WHERE id % 7 = {at % 7}")
    s.sql(f"DELETE FROM t WHERE id % 11 = 0 AND id >= {lo}")
    s.sql(f"INSERT INTO t VALUES ({lo + 1000}, 0)")  # last: once it landed, everything before it did
    return lo + 1000


def psql_session(s: Setup, text: str) -> subprocess.Popen[str]:
    """A psql session of its own running ``text``, left open (the shutdown ends it)."""
    proc = subprocess.Popen(
        ["psql", "-X", "-q", "-h", "127.0.0.1", "-p", str(s.server.port), "-U", "postgres", "-d", "app"],
        stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True)
    assert proc.stdin is not None
    proc.stdin.write(text)
    proc.stdin.flush()
    return proc


@pytest.mark.parametrize("during", ["idle", "writes", "in-progress-transaction"])
def test_fast_shutdown_of_the_server_finishes_while_cdcd_streams_and_cdcd_resumes(during: str,
                                                                                   setup: Setup) -> None:
    s = setup
    s.start("landed")
    s.wait("the snapshot landed", lambda: {r["id"] for b in s.batches() for r in rows(b)} >= set(range(1, 51)))
    last = workload(s, 100)
    s.wait("the changes before the shutdown landed", lambda: last in {r["id"] for r in s.streamed()})
    landed = max(b.seq for b in s.batches())
    s.wait("the checkpoint covers them", lambda: (c := s.checkpoint()) is not None and c.batch_seq >= landed)
    holder: subprocess.Popen[str] | None = None
    if during == "in-progress-transaction":
        # a large transaction still open at the shutdown: the server streams it in progress (protocol 2) and cdcd
        # spools it; the fast shutdown ends its session, so it never commits
        holder = psql_session(s, "BEGIN;\nINSERT INTO t SELECT g, g FROM generate_series(50000, 60000) g;\n")
        s.wait("the open transaction streamed in progress", lambda: int(s.server.psql(
            "SELECT coalesce(sum(stream_txns), 0) FROM pg_stat_replication_slots") or 0) > 0)
    elif during == "writes":
        # small transactions one after another until the shutdown ends the session
        holder = psql_session(s, "DO $$ BEGIN FOR i IN 10000..19999 LOOP INSERT INTO t VALUES (i, i); COMMIT; "
                                 "PERFORM pg_sleep(0.002); END LOOP; END $$;\n")
        s.wait("the writes streamed", lambda: 10020 in {r["id"] for r in s.streamed()})
    s.fast_shutdown()
    if holder is not None:
        holder.kill()
        holder.wait(10)
    assert s.procs[-1].poll() is None, s.tail()  # cdcd waits for the server, as for any outage
    s.server.restart()
    written = [int(i) for i in s.sql("SELECT id FROM t WHERE id >= 10000 ORDER BY id").split()]
    assert (during == "writes") == bool(written), written
    last = workload(s, 2000)
    s.wait("the changes after the restart landed", lambda: last in {r["id"] for r in s.streamed()})
    assert s.procs[-1].poll() is None, s.tail()
    streamed = s.streamed()
    positions = [r["_cdc_pos"] for r in streamed]
    assert len(positions) == len(set(positions)), "a change landed twice"
    inserted = sorted(r["id"] for r in streamed if r["_cdc_op"] == "c")
    assert inserted == sorted([*range(100, 400), 1100, *written, *range(2000, 2300), 3000]), \
        "an insert lost or doubled"
    assert s.replay() == s.table()
    s.procs[-1].send_signal(signal.SIGTERM)
    assert s.procs[-1].wait(60) == 0, s.tail()
