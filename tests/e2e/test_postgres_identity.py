"""PostgreSQL with the real daemon: a server that went back in time is refused; a crash is not a false alarm.

The server is the test's own (it is stopped, copied and restored). Exactness is checked by replaying what
landed, in ``_cdc_pos`` order, against the table on the server.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from daemon_harness import DaemonHarness, rows

from devtools.servers import PostgresServer

pytestmark = pytest.mark.slow


class Setup(DaemonHarness):
    def __init__(self, tmp: Path, server: PostgresServer) -> None:
        super().__init__(tmp)
        self.server = server

    def source_sections(self) -> dict[str, dict[str, Any]]:
        return {
            "source": {"kind": "postgres", "port": self.server.port, "user": "postgres", "database": "app",
                       "tables": ["public.t"], "sslmode": "disable"},
            "source.postgres": {"slot": "cdcd_ident", "publication": "cdcd_ident", "heartbeat_s": 0.5},
        }

    def start(self, ack: str, **extra: dict[str, Any]) -> Any:
        return super().start(ack, runtime={"reconnect_max_s": 1.0}, **extra)

    def sql(self, statement: str) -> str:
        return self.server.psql(statement, "app")

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


@pytest.fixture
def setup(tmp_path: Path) -> Iterator[Setup]:
    server = PostgresServer().start()
    server.create_database("app")
    s = Setup(tmp_path, server)
    s.sql("CREATE TABLE t (id int PRIMARY KEY, v int)")
    s.sql("INSERT INTO t SELECT g, g FROM generate_series(1, 50) g")
    try:
        yield s
    finally:
        s.close()
        server.stop()


def copy_tree(src: Path, dst: Path) -> None:
    subprocess.run(["cp", "-a", str(src), str(dst)], check=True)  # keeps the owner the server runs as


@pytest.mark.parametrize("daemon", ["streaming", "stopped"])
def test_server_restored_from_an_older_copy_of_its_data_directory_stops_the_daemon(daemon: str, setup: Setup) -> None:
    s = setup
    s.start("landed")
    s.wait("the snapshot landed", lambda: s.landed_ids() >= set(range(1, 51)))
    s.sql("INSERT INTO t SELECT g, g FROM generate_series(51, 60) g")
    s.wait("the first changes landed", lambda: 60 in s.landed_ids())
    backup = s.server.root / "data.old"
    # immediate stops: a fast shutdown waits for the walsender to see the shutdown checkpoint confirmed
    s.server.halt(immediate=True)
    copy_tree(s.server.data, backup)
    s.server.restart()
    for lo in range(61, 2001, 100):  # more changes captured after the copy was taken
        s.sql(f"INSERT INTO t SELECT g, g FROM generate_series({lo}, {lo + 99}) g")
    s.wait("the later changes landed", lambda: 2000 in s.landed_ids())
    s.wait("the checkpoint covers them", lambda: (c := s.checkpoint()) and c.event_count >= 2000)
    if daemon == "stopped":
        s.procs[-1].send_signal(signal.SIGTERM)
        assert s.procs[-1].wait(60) == 0, s.tail()
    s.server.halt(immediate=True)
    shutil.rmtree(s.server.data)
    copy_tree(backup, s.server.data)
    s.server.restart()
    s.sql("INSERT INTO t VALUES (5000, 5000)")
    if daemon == "stopped":
        s.start("landed")
    assert s.procs[-1].wait(90) == 9, s.tail()  # POSITION_LOST
    log = s.log.read_text()
    assert "went back in time" in log and "restored from an older copy" in log, s.tail()
    assert 5000 not in s.landed_ids()


def test_server_crash_with_a_lagging_slot_is_no_false_alarm(setup: Setup) -> None:
    s = setup
    s.start("landed")
    s.wait("the snapshot landed", lambda: s.landed_ids() >= set(range(1, 51)))
    for lo in range(51, 551, 50):
        s.sql(f"INSERT INTO t SELECT g, g FROM generate_series({lo}, {lo + 49}) g")
        s.sql(f"UPDATE t SET v = -v WHERE id % 7 = {lo % 7}")
    s.sql("DELETE FROM t WHERE id % 11 = 0")
    s.wait("the changes landed", lambda: 550 in s.landed_ids())
    s.server.halt(immediate=True)  # a crash: the slot's confirmed position on disk lags the checkpoint
    s.server.restart()
    s.sql("UPDATE t SET v = v + 1000 WHERE id < 100")
    s.sql("INSERT INTO t VALUES (9000, 9000)")
    s.wait("the changes after the crash landed", lambda: 9000 in s.landed_ids())
    assert s.procs[-1].poll() is None, s.tail()
    assert s.replay() == s.table()
    assert "went back in time" not in s.log.read_text()


def test_promotion_to_a_new_timeline_that_has_everything_captured_is_followed(setup: Setup) -> None:
    s = setup
    s.start("landed")
    s.wait("the snapshot landed", lambda: s.landed_ids() >= set(range(1, 51)))
    s.sql("INSERT INTO t SELECT g, g FROM generate_series(51, 300) g")
    s.wait("the changes landed", lambda: 300 in s.landed_ids())
    # the server comes back as a standby of nothing and is promoted: timeline 2, forked after everything
    # captured, the slot still there (as on a standby that had a copy of it)
    s.server.halt(immediate=True)
    signal_file = s.server.data / "standby.signal"
    signal_file.write_text("")
    shutil.chown(signal_file, s.server.data.owner())
    s.server.restart()
    s.server.psql("SELECT pg_promote()")
    s.sql("UPDATE t SET v = -v WHERE id % 3 = 0")
    s.sql("INSERT INTO t VALUES (9000, 9000)")
    s.wait("the changes on the new timeline landed", lambda: 9000 in s.landed_ids())
    assert s.procs[-1].poll() is None, s.tail()
    assert "the server moved to a new timeline" in s.log.read_text()
    assert s.replay() == s.table()
    s.wait("the checkpoint records timeline 2",
           lambda: (c := s.checkpoint()) and c.source_state.get("system", {}).get("timeline") == 2)
