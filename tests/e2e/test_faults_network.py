"""Network faults with the real daemon, a TCP fault proxy between it and the database, and a concurrent
write workload; afterwards what landed (replayed in position order, or Spark + `cdcd verify`) must equal
the source.

* every connection reset and new ones refused for 20 s in the middle of the snapshot: the daemon keeps
  running, reconnects once the server answers again, and resumes the snapshot at the last acked chunk;
* the MariaDB server restarted in the middle of the snapshot: the same;
* every open connection silenced for good in the middle of the snapshot: the read timeout ends the
  chunk query, the daemon reconnects and resumes;
* every open connection silenced for good while streaming (no FIN, no RST; new connections work): the
  stall detector notices, the daemon reconnects, nothing is lost, /status shows the reconnect;
* the source unreachable for longer than runtime.source_retry_timeout_s: exit 4 naming the outage;
* a table added by SIGHUP while the source refuses connections: captured once the source answers.
"""

from __future__ import annotations

import itertools
import json
import random
import signal
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pymysql
import pytest
from daemon_harness import DaemonHarness
from faultproxy import FaultProxy
from support.landed import landed_ids

from cdcd.landing.reader import landed_seqs, mark_consumed, read_batch
from devtools.servers import MariaDBServer, PostgresServer, binary, free_port, service_user, wait_port

pytestmark = pytest.mark.slow

ROWS = 2000
_server_ids = itertools.count(7301)


# ------------------------------------------------------------------ what landed, replayed


class Landed:
    """The landing zone read incrementally (each batch once), replayed into a mirror keyed by id."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.rows: dict[int, list[dict[str, Any]]] = {}

    def refresh(self) -> None:
        if not self.path.exists():
            return
        for seq in landed_seqs(self.path):
            if seq not in self.rows:
                batch = read_batch(self.path, seq)
                self.rows[seq] = [r for t in batch.tables.values() for r in t.to_pylist()]

    def count(self) -> int:
        self.refresh()
        return sum(len(r) for r in self.rows.values())

    def ids(self) -> set[int]:
        self.refresh()
        return {r["id"] for rows in self.rows.values() for r in rows if r["id"] is not None}

    def mirror(self) -> dict[int, tuple[Any, ...]]:
        """The merge's rule: per key the latest position wins, a later batch wins a tie."""
        self.refresh()
        events = [(r["_cdc_pos"], seq, i, r) for seq, rows in self.rows.items() for i, r in enumerate(rows)]
        out: dict[int, tuple[Any, ...]] = {}
        for _, _, _, r in sorted(events, key=lambda e: e[:3]):
            if r["_cdc_op"] == "t":
                out.clear()
            elif r["_cdc_op"] == "d":
                out.pop(r["id"], None)
            else:
                out[r["id"]] = (r["v"], r["note"])
        return out


class Consumer(threading.Thread):
    """Plays the downstream consumer for landing.ack = "consumed": marks landed batches consumed while on."""

    def __init__(self, landing: Path) -> None:
        super().__init__(daemon=True)
        self.landing = landing
        self.on = threading.Event()
        self.done = threading.Event()
        self.marked: set[int] = set()

    def run(self) -> None:
        while not self.done.is_set():
            if self.on.is_set() and self.landing.exists():
                for seq in landed_seqs(self.landing):
                    if seq not in self.marked:
                        mark_consumed(self.landing, seq)
                        self.marked.add(seq)
            time.sleep(0.05)


class Workload(threading.Thread):
    """Inserts, updates and deletes in small transactions on the source (not through the proxy)."""

    def __init__(self, execute: Callable[[str], None]) -> None:
        super().__init__(daemon=True)
        self.execute = execute
        self.stop_ = threading.Event()
        self.error: BaseException | None = None
        self.statements = 0

    def run(self) -> None:
        rnd = random.Random(7)
        next_id = 100_000
        try:
            while not self.stop_.is_set():
                victim = rnd.randint(1, ROWS)
                self.execute(f"INSERT INTO t VALUES ({next_id}, {next_id}, 'new');"
                             f"UPDATE t SET v = v + 1, note = 'upd' WHERE id = {rnd.randint(1, ROWS)};"
                             f"DELETE FROM t WHERE id = {victim}")
                next_id += 1
                self.statements += 3
                time.sleep(0.02)
        except BaseException as exc:  # reported by stop()
            self.error = exc

    def finish(self) -> None:
        self.stop_.set()
        self.join(60)
        assert self.error is None, f"the workload failed: {self.error!r}"
        assert self.statements > 0


# ------------------------------------------------------------------ per-source set-up


class Setup(DaemonHarness):
    proxy: FaultProxy
    port: int

    def __init__(self, tmp: Path) -> None:
        super().__init__(tmp)
        self.landed = Landed(self.landing)
        self.consumer = Consumer(self.landing)
        self.consumer.start()
        self.http_port = free_port()

    def run(self, ack: str, **extra: dict[str, Any]) -> subprocess.Popen[bytes]:
        extra.setdefault("runtime", {}).setdefault("reconnect_max_s", 2)
        extra.setdefault("http", {})["listen"] = f"127.0.0.1:{self.http_port}"
        return self.start(ack, **extra)

    def status(self) -> dict[str, Any]:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/status", timeout=10) as r:
            doc: dict[str, Any] = json.loads(r.read())
            return doc

    def source_table(self) -> dict[int, tuple[Any, ...]]:
        raise NotImplementedError

    def execute(self, sql: str) -> None:
        raise NotImplementedError

    def snapshot_running(self) -> bool:
        raise NotImplementedError

    table_name = ""

    def snapshot_key(self) -> int:
        """The last snapshot key the checkpoint holds as acked."""
        c = self.checkpoint()
        assert c is not None
        return int(c.source_state["snapshot"]["tables"][self.table_name]["last_key"][0])

    def close(self) -> None:
        self.consumer.done.set()
        super().close()
        self.proxy.close()


class PgSetup(Setup):
    table_name = "public.t"

    def __init__(self, tmp: Path, server: PostgresServer, db: str) -> None:
        super().__init__(tmp)
        self.server, self.db = server, db
        self.proxy = FaultProxy(server.port).start()

    def source_sections(self) -> dict[str, dict[str, Any]]:
        return {
            "source": {"kind": "postgres", "port": self.proxy.port, "user": "postgres", "database": self.db,
                       "tables": ["public.t"], "sslmode": "disable", "connect_timeout_s": 3},
            "source.postgres": {"slot": f"s_{self.db}", "publication": f"p_{self.db}", "heartbeat_s": 1},
        }

    def execute(self, sql: str) -> None:
        self.server.psql(sql, self.db)

    def source_table(self) -> dict[int, tuple[Any, ...]]:
        out = self.server.psql("SELECT id, v, note FROM t ORDER BY id", self.db)
        rows = [line.split("|") for line in out.splitlines() if line]
        return {int(i): (int(v), n) for i, v, n in rows}

    def snapshot_running(self) -> bool:
        c = self.checkpoint()
        return c is not None and (c.source_state.get("snapshot") or {}).get("status") == "running"


class MariaSetup(Setup):
    def __init__(self, tmp: Path, server: MariaDBServer, db: str) -> None:
        super().__init__(tmp)
        self.server, self.db = server, db
        self.table_name = f"{db}.t"
        self.proxy = FaultProxy(server.port).start()
        self.server_id = next(_server_ids)
        self._conn: pymysql.connections.Connection | None = None

    def source_sections(self) -> dict[str, dict[str, Any]]:
        return {
            "source": {"kind": "mariadb", "port": self.proxy.port, "user": "cdc", "password": "secret",
                       "database": self.db, "tables": [f"{self.db}.t"], "sslmode": "disable",
                       "connect_timeout_s": 3},
            "source.mysql": {"server_id": self.server_id},
        }

    def execute(self, sql: str) -> None:
        for attempt in range(200):  # the restart test restarts the server under the workload
            try:
                if self._conn is None:
                    self._conn = pymysql.connect(host="127.0.0.1", port=self.server.port, user="root", password="",
                                                 database=self.db, autocommit=False)
                with self._conn.cursor() as cur:
                    for statement in sql.split(";"):
                        cur.execute(statement)
                self._conn.commit()
                return
            except pymysql.err.OperationalError:
                if self._conn is not None:
                    self._conn.close()
                self._conn = None
                if attempt == 199:
                    raise
                time.sleep(0.1)

    def source_table(self) -> dict[int, tuple[Any, ...]]:
        conn = pymysql.connect(host="127.0.0.1", port=self.server.port, user="root", password="", database=self.db)
        try:
            with conn.cursor() as cur:
                cur.execute("SELECT id, v, note FROM t")
                return {int(i): (int(v), n) for i, v, n in cur.fetchall()}
        finally:
            conn.close()

    def snapshot_running(self) -> bool:
        c = self.checkpoint()
        snap = (c.source_state.get("snapshot") or {}) if c is not None else {}
        return bool(snap) and not snap.get("done")


@pytest.fixture
def pg(tmp_path: Path, pg_server: PostgresServer, pg_db: str) -> Iterator[PgSetup]:
    pg_server.psql("CREATE TABLE t (id int PRIMARY KEY, v int, note text);"
                   f"INSERT INTO t SELECT g, g, 'snap' FROM generate_series(1, {ROWS}) g", pg_db)
    s = PgSetup(tmp_path, pg_server, pg_db)
    try:
        yield s
    finally:
        s.close()


def _maria(tmp: Path, server: MariaDBServer, db: str) -> MariaSetup:
    server.sql(f"CREATE TABLE t (id INT PRIMARY KEY, v INT, note VARCHAR(20));"
               f"INSERT INTO t SELECT seq, seq, 'snap' FROM seq_1_to_{ROWS}", db)
    return MariaSetup(tmp, server, db)


@pytest.fixture
def maria(tmp_path: Path, maria_server: MariaDBServer, maria_db: str) -> Iterator[MariaSetup]:
    s = _maria(tmp_path, maria_server, maria_db)
    try:
        yield s
    finally:
        s.close()


@pytest.fixture
def own_maria(tmp_path: Path) -> Iterator[MariaSetup]:
    """A MariaDB of this test's own: the test restarts it."""
    server = MariaDBServer().start()
    s = _maria(tmp_path, server, server.create_database("faults"))
    try:
        yield s
    finally:
        s.close()
        server.stop()


def restart(server: MariaDBServer) -> None:
    """Stop the server (SIGTERM: a clean shutdown, clients see 'server shutting down') and start it again."""
    assert server.proc is not None
    server.proc.terminate()
    server.proc.wait(60)
    owner = service_user()
    server.proc = subprocess.Popen(
        [binary("mariadbd"), f"--defaults-file={server.root / 'my.cnf'}", *([f"--user={owner}"] if owner else [])],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    wait_port(server.port, server.proc, server.root / "server.log")


# ------------------------------------------------------------------ the scenarios


def _mid_snapshot(s: Setup, fault: Callable[[], None], **extra: dict[str, Any]) -> None:
    """Snapshot under a workload, ``fault`` once part of it is checkpointed, then converge."""
    proc = s.run("consumed", **extra)
    work = Workload(s.execute)
    work.start()
    s.consumer.on.set()
    s.wait("part of the snapshot checkpointed",
           lambda: (c := s.checkpoint()) is not None and c.event_count >= 200 and s.snapshot_running())
    s.consumer.on.clear()  # the snapshot waits for acks with its connections open
    landed = s.landed.count()
    assert landed < ROWS, "the snapshot must still be running when the fault comes"
    acked_key = s.snapshot_key()
    last_seq = max(s.landed.rows)
    fault()
    s.consumer.on.set()
    s.wait("the snapshot finished after the fault", lambda: not s.snapshot_running() and
           (c := s.checkpoint()) is not None and c.event_count > landed, timeout=180)
    work.finish()
    s.execute("INSERT INTO t VALUES (999999, 1, 'sentinel')")
    s.wait("the sentinel landed", lambda: 999999 in s.landed.ids(), timeout=120)
    assert proc.poll() is None, "the daemon must survive the fault"
    assert s.status()["stats"]["source_reconnects"] >= 1
    assert s.landed.mirror() == s.source_table()
    # resumed after the acked key, not started over: no snapshot row at or below it came again
    again = {r["id"] for seq, rows in s.landed.rows.items() if seq > last_seq for r in rows if r["_cdc_snapshot"]}
    assert again and min(again) > acked_key


def _reset_and_refuse(s: Setup) -> None:
    s.proxy.refuse(20)
    assert s.proxy.reset() >= 1


def test_pg_reset_and_refused_mid_snapshot_recovers(spark: object, pg: PgSetup) -> None:
    _mid_snapshot(pg, lambda: _reset_and_refuse(pg))
    assert "source error, reconnecting" in pg.log.read_text()
    pg.spark_and_verify()


def test_mariadb_reset_and_refused_mid_snapshot_recovers(spark: object, maria: MariaSetup) -> None:
    _mid_snapshot(maria, lambda: _reset_and_refuse(maria))
    assert "source error, reconnecting" in maria.log.read_text()
    maria.spark_and_verify()


def test_mariadb_server_restart_mid_snapshot_recovers(spark: object, own_maria: MariaSetup) -> None:
    _mid_snapshot(own_maria, lambda: restart(own_maria.server))
    own_maria.spark_and_verify()


@pytest.mark.parametrize("source", ["pg", "maria"])
def test_blackhole_mid_snapshot_ends_in_the_read_timeout(spark: object, source: str,
                                                         request: pytest.FixtureRequest) -> None:
    s: Setup = request.getfixturevalue(source)
    _mid_snapshot(s, s.proxy.blackhole, runtime={"source_read_timeout_s": 5})
    assert "read timeout" in s.log.read_text() or "runtime.source_read_timeout_s" in s.log.read_text()


def _blackhole_while_streaming(s: Setup) -> dict[str, Any]:
    proc = s.run("landed")
    s.wait("the snapshot landed", lambda: s.landed.count() >= ROWS)
    work = Workload(s.execute)
    work.start()
    s.wait("streamed changes landed", lambda: s.landed.count() >= ROWS + 30)
    assert s.proxy.blackhole() >= 1
    before = s.landed.count()
    s.wait("changes land again after the stall", lambda: s.landed.count() >= before + 60, timeout=120)
    work.finish()
    s.execute("INSERT INTO t VALUES (999999, 1, 'sentinel')")
    s.wait("the sentinel landed", lambda: 999999 in s.landed.ids(), timeout=120)
    assert proc.poll() is None
    assert s.landed.mirror() == s.source_table()
    with urllib.request.urlopen(f"http://127.0.0.1:{s.http_port}/metrics", timeout=10) as r:
        metrics = r.read().decode()
    reconnects = [line for line in metrics.splitlines() if line.startswith("cdcd_source_stream_reconnects_total ")]
    assert reconnects and float(reconnects[0].split()[1]) >= 1, metrics
    status = s.status()
    s.spark_and_verify()
    return status


def test_pg_blackhole_while_streaming_is_detected(pg: PgSetup) -> None:
    # the stall bound follows the server's wal_sender_timeout; this database's walsenders get a short one
    pg.server.psql(f"ALTER DATABASE {pg.db} SET wal_sender_timeout = '4s'")
    status = _blackhole_while_streaming(pg)
    assert status["source"]["reconnects"] >= 1, status
    assert "no message from the server" in status["source"]["last_error"], status


def test_mariadb_blackhole_while_streaming_is_detected(maria: MariaSetup) -> None:
    status = _blackhole_while_streaming(maria)
    assert status["source"]["reconnects"] >= 1, status
    assert "no binlog event and no heartbeat" in status["source"]["last_error"], status


def _outage_beyond_the_budget(s: Setup) -> str:
    proc = s.run("landed", runtime={"source_retry_timeout_s": 5, "reconnect_max_s": 1})
    s.wait("the snapshot landed", lambda: s.landed.count() >= ROWS)
    s.proxy.refuse(600)
    s.proxy.reset()
    code = proc.wait(120)
    log = s.log.read_text()
    assert code == 4, log[-3000:]
    return log


def test_pg_outage_longer_than_the_retry_budget_exits_4(pg: PgSetup) -> None:
    log = _outage_beyond_the_budget(pg)
    assert "has failed for" in log and "runtime.source_retry_timeout_s = 5" in log, log[-3000:]


def test_mariadb_outage_longer_than_the_retry_budget_exits_4(maria: MariaSetup) -> None:
    log = _outage_beyond_the_budget(maria)
    assert "has failed for" in log and "runtime.source_retry_timeout_s = 5" in log, log[-3000:]


def _reload_during_an_outage(s: Setup, added: str) -> None:
    """A table added (SIGHUP) while the source is unreachable: the reload is retried with the backoff and applies
    once the source answers, like the stream; it is not dropped with an error while the config file lists it."""
    s.execute("CREATE TABLE t2 (id INT PRIMARY KEY, v INT, note VARCHAR(20));"
              "INSERT INTO t2 VALUES (1, 1, 'a'), (2, 2, 'b'), (3, 3, 'c')")
    proc = s.run("landed")
    s.wait("the snapshot landed", lambda: s.landed.count() >= ROWS)
    cfg = s.tmp / "cdcd-0.toml"
    text = cfg.read_text()
    assert f'tables = ["{s.table_name}"]' in text
    cfg.write_text(text.replace(f'tables = ["{s.table_name}"]', f'tables = ["{s.table_name}", "{added}"]'))
    s.proxy.refuse(8)
    assert s.proxy.reset() >= 1
    proc.send_signal(signal.SIGHUP)
    s.wait("the reload met the outage", lambda: "table reload interrupted; retrying" in s.log.read_text())
    s.wait("the added table captured once the source answers", lambda: added in s.status()["source"]["tables"],
           timeout=120)
    s.execute("INSERT INTO t2 VALUES (4, 4, 'streamed')")
    s.wait("its rows and a streamed one landed", lambda: landed_ids(s.landing, added) == {1, 2, 3, 4}, timeout=120)
    assert "table_reload_error" not in s.status()["source"]
    assert "source stream restored" in s.log.read_text()  # the outage's end is said, not only its start
    assert proc.poll() is None


def test_pg_table_reload_during_an_outage_applies_once_the_source_returns(pg: PgSetup) -> None:
    _reload_during_an_outage(pg, "public.t2")


def test_mariadb_table_reload_during_an_outage_applies_once_the_source_returns(maria: MariaSetup) -> None:
    _reload_during_an_outage(maria, f"{maria.db}.t2")
