"""MariaDB with the real daemon: a GTID failover is followed exactly; a server whose binlog went back is refused.

The primary and its GTID replica (log_slave_updates, gtid_strict_mode) are the test's own servers; the
daemon reaches them through a TCP forwarder of the test's own (the "same address" a proxy or a virtual IP
gives across a failover). Exactness is checked by replaying what landed, in ``_cdc_pos`` order, against the
table on the server that ends up primary.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pymysql
import pytest
from daemon_harness import DaemonHarness, rows
from pymysqlreplication import BinLogStreamReader
from switch_proxy import SwitchProxy

from cdcd.daemon.exitcodes import ExitCode
from cdcd.events import ChangeEvent, TableId
from cdcd.positions import MySqlPosition
from cdcd.sources.mysql.binlog import _EVENTS
from cdcd.sources.mysql.decode import Decoder
from cdcd.sources.mysql.schema import SchemaHistory
from devtools.servers import MariaDBServer

pytestmark = pytest.mark.slow
_server_ids = itertools.count(7501)
REPLICATION = {"log_slave_updates": "1", "gtid_strict_mode": "1"}


def run_sql(server: MariaDBServer, db: str | None, *statements: str) -> list[Any]:
    conn = pymysql.connect(host="127.0.0.1", port=server.port, user="root", password="", database=db,
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


class Setup(DaemonHarness):
    def __init__(self, tmp: Path, port: int, db: str = "app") -> None:
        super().__init__(tmp)
        self.port, self.db = port, db
        self.server_id = next(_server_ids)

    def source_sections(self) -> dict[str, dict[str, Any]]:
        return {
            "source": {"kind": "mariadb", "port": self.port, "user": "cdc", "password": "secret",
                       "database": self.db, "tables": [f"{self.db}.t"], "sslmode": "disable"},
            "source.mysql": {"server_id": self.server_id},
        }

    def start(self, ack: str, **extra: dict[str, Any]) -> Any:
        return super().start(ack, runtime={"reconnect_max_s": 1.0}, **extra)

    def replay(self) -> dict[int, tuple[Any, ...]]:
        """The mirror a position-ordered merge builds from everything landed (highest position wins)."""
        events = [r for b in self.batches() for r in rows(b)]  # batch order; sorted() is stable
        mirror: dict[int, tuple[Any, ...]] = {}
        for r in sorted(events, key=lambda r: r["_cdc_pos"]):
            if r["_cdc_op"] == "d":
                mirror.pop(r["id"], None)
            elif r["_cdc_op"] == "t":
                mirror.clear()
            else:
                mirror[r["id"]] = (r["v"], r["note"])
        return mirror

    def exit_code(self, timeout: float = 90) -> int:
        return self.procs[-1].wait(timeout)


def table(server: MariaDBServer, db: str = "app") -> dict[int, tuple[Any, ...]]:
    return {int(i): (v, n) for i, v, n in run_sql(server, db, "SELECT id, v, note FROM t")}


def workload(server: MariaDBServer, rng: random.Random, ids: range, ops: int, tag: str) -> None:
    """Inserts, updates and deletes in single- and multi-statement transactions."""
    conn = pymysql.connect(host="127.0.0.1", port=server.port, user="root", password="", database="app",
                           autocommit=False)
    try:
        with conn.cursor() as cur:
            for n in range(ops):
                for _ in range(rng.choice((1, 1, 3))):
                    i = rng.choice(ids)
                    kind = rng.random()
                    if kind < 0.5:
                        cur.execute("REPLACE INTO t VALUES (%s, %s, %s)", (i, n, f"{tag}-{n}"))
                    elif kind < 0.8:
                        cur.execute("UPDATE t SET v = v + 1, note = %s WHERE id = %s", (f"{tag}-u{n}", i))
                    else:
                        cur.execute("DELETE FROM t WHERE id = %s", (i,))
                conn.commit()
    finally:
        conn.close()


@pytest.fixture
def pair() -> Iterator[tuple[MariaDBServer, MariaDBServer]]:
    primary = MariaDBServer(settings=dict(REPLICATION), server_id=1).start()
    replica = MariaDBServer(settings=dict(REPLICATION), server_id=2)
    try:
        replica.start()
        # the primary's binlog is further along than the replica's will be (more files, larger offsets), as
        # it is on any replica that started from a backup: positions of the two never line up
        run_sql(primary, None, "FLUSH BINARY LOGS", "FLUSH BINARY LOGS", "FLUSH BINARY LOGS")
        replica.replicate_from(primary)
        run_sql(primary, None, "CREATE DATABASE app")
        run_sql(primary, "app", "CREATE TABLE app.t (id INT PRIMARY KEY, v INT, note VARCHAR(40))",
                "INSERT INTO app.t SELECT seq, seq, 'initial' FROM seq_1_to_50")
        replica.wait_replicated(primary)
        yield primary, replica
    finally:
        replica.stop()
        primary.stop()


@pytest.fixture
def proxy_to(pair: tuple[MariaDBServer, MariaDBServer]) -> Iterator[SwitchProxy]:
    proxy = SwitchProxy(pair[0].port)
    try:
        yield proxy
    finally:
        proxy.close()


def fail_over(primary: MariaDBServer, replica: MariaDBServer, proxy: SwitchProxy) -> None:
    primary.stop()
    proxy.switch(replica.port)
    replica.promote()


def test_gtid_failover_to_a_replica_lands_everything_written_on_it(
        spark: object, tmp_path: Path, pair: tuple[MariaDBServer, MariaDBServer], proxy_to: SwitchProxy) -> None:
    primary, replica = pair
    s = Setup(tmp_path, proxy_to.port)
    try:
        s.start("landed")
        s.wait("the snapshot landed", lambda: s.landed_ids() >= set(range(1, 51)))
        rng = random.Random(7)
        workload(primary, rng, range(1, 120), 150, "p")
        run_sql(primary, "app", "INSERT INTO t VALUES (1000, 0, 'primary-sentinel')")
        s.wait("the primary's writes landed", lambda: 1000 in s.landed_ids())
        replica.wait_replicated(primary)
        fail_over(primary, replica, proxy_to)
        workload(replica, rng, range(1, 120), 150, "r")
        run_sql(replica, "app", "INSERT INTO t VALUES (2000, 0, 'replica-sentinel')")
        s.wait("the new primary's writes landed", lambda: 2000 in s.landed_ids())
        assert s.replay() == table(replica)
        assert "the source server changed" in s.log.read_text()
        # a restart keeps following the new primary: the checkpoint recorded it and the new epoch
        s.procs[-1].send_signal(signal.SIGTERM)
        assert s.exit_code(60) == 0, s.tail()
        ckpt = s.checkpoint()
        assert ckpt is not None and ckpt.source_state["server"]["server_id"] == 2
        assert ckpt.source_state["server"]["epoch"] == 1 and ckpt.position.encoded.startswith("my:e000001:")
        s.start("landed")
        workload(replica, rng, range(1, 120), 30, "x")
        run_sql(replica, "app", "INSERT INTO t VALUES (3000, 0, 'after-restart')")
        s.wait("writes after the restart landed", lambda: 3000 in s.landed_ids())
        assert s.replay() == table(replica)
        s.spark_and_verify()  # through the proxy, which now leads to the new primary
    finally:
        s.close()


def test_failover_while_stopped_is_followed_at_start(
        tmp_path: Path, pair: tuple[MariaDBServer, MariaDBServer]) -> None:
    primary, replica = pair
    s = Setup(tmp_path, primary.port)
    try:
        s.start("landed")
        s.wait("the snapshot landed", lambda: s.landed_ids() >= set(range(1, 51)))
        rng = random.Random(11)
        workload(primary, rng, range(1, 120), 60, "p")
        run_sql(primary, "app", "INSERT INTO t VALUES (1000, 0, 'primary-sentinel')")
        s.wait("the primary's writes landed", lambda: 1000 in s.landed_ids())
        s.procs[-1].send_signal(signal.SIGTERM)
        assert s.exit_code(60) == 0, s.tail()
        workload(primary, rng, range(1, 120), 20, "q")  # written while cdcd is down, replicated
        replica.wait_replicated(primary)
        primary.stop()
        replica.promote()
        workload(replica, rng, range(1, 120), 40, "r")
        s.port = replica.port  # the operator points cdcd at the new primary and starts it
        s.start("landed")
        run_sql(replica, "app", "INSERT INTO t VALUES (2000, 0, 'replica-sentinel')")
        s.wait("the new primary's writes landed", lambda: 2000 in s.landed_ids())
        assert s.replay() == table(replica)
    finally:
        s.close()


def test_failover_after_a_kill_inside_a_transaction_delivers_the_rest_of_it_once(
        tmp_path: Path, pair: tuple[MariaDBServer, MariaDBServer]) -> None:
    primary, replica = pair
    s = Setup(tmp_path, primary.port)
    try:
        s.start("consumed", snapshot={"mode": "never"})
        s.wait("the stream start in the checkpoint", lambda: s.checkpoint() is not None)
        run_sql(primary, "app", "INSERT INTO t SELECT seq, seq, 'big' FROM seq_1001_to_1200")  # one transaction
        s.wait("60 events landed", lambda: sum(len(rows(b)) for b in s.batches()) >= 60)
        acked_rows, last_acked = s.consume_upto(30)
        s.wait("the checkpoint covers the acked batches",
               lambda: (c := s.checkpoint()) is not None and c.batch_seq >= last_acked)
        ckpt = s.checkpoint()
        assert ckpt is not None and ckpt.source_state.get("inside_tx") is True
        s.kill()
        max_seq = max(b.seq for b in s.batches())
        replica.wait_replicated(primary)
        primary.stop()
        replica.promote()
        s.port = replica.port
        s.start("landed", snapshot={"mode": "never"})
        s.wait("the whole transaction landed", lambda: s.landed_ids() >= set(range(1001, 1201)))
        after = [r for b in s.batches() if b.seq > max_seq for r in rows(b)]
        acked = {r["id"] for r in acked_rows}
        assert not {r["id"] for r in after} & acked, "an acked event of the transaction came again"
        assert {r["id"] for r in after} == set(range(1001, 1201)) - acked
        assert len(after) == len({r["id"] for r in after})
        assert all(r["_cdc_pos"].startswith("my:e000001:") for r in after)
    finally:
        s.close()


def test_failover_inside_a_group_committed_transaction_delivers_the_rest_of_it_once(
        tmp_path: Path, pair: tuple[MariaDBServer, MariaDBServer]) -> None:
    """The transaction was group-committed on the primary (its GTID event carries a commit id) and committed
    alone by the replica (a shorter GTID event): the same rows sit at other byte offsets in the two copies. The
    rest of it after the checkpoint lands once, nothing of it is skipped."""
    primary, replica = pair
    s = Setup(tmp_path, primary.port)
    try:
        s.start("consumed", snapshot={"mode": "never"})
        s.wait("the stream start in the checkpoint", lambda: s.checkpoint() is not None)
        # the primary's binlog group commit waits for a second transaction: the two commit as one group
        run_sql(primary, None, "SET GLOBAL binlog_commit_wait_count = 2",
                "SET GLOBAL binlog_commit_wait_usec = 5000000")
        other = threading.Thread(target=run_sql, args=(primary, "app", "INSERT INTO t VALUES (3000, 0, 'grouped')"))
        other.start()
        run_sql(primary, "app", "INSERT INTO t SELECT seq, seq, 'big' FROM seq_1001_to_1200")  # one transaction
        other.join(30)
        run_sql(primary, None, "SET GLOBAL binlog_commit_wait_count = 0")
        gtids = [e for e in run_sql(primary, None, "SHOW BINLOG EVENTS IN 'mysql-bin.000004'") if e[2] == "Gtid"]
        assert any("cid=" in str(e[5]) for e in gtids), gtids  # the group's commit id, in the primary's copy only
        s.wait("60 events landed", lambda: sum(len(rows(b)) for b in s.batches()) >= 60)
        acked_rows, last_acked = s.consume_upto(30)
        s.wait("the checkpoint covers the acked batches",
               lambda: (c := s.checkpoint()) is not None and c.batch_seq >= last_acked)
        ckpt = s.checkpoint()
        assert ckpt is not None and ckpt.source_state.get("inside_tx") is True
        acked = {r["id"] for r in acked_rows}
        assert acked and acked < set(range(1001, 1201)) | {3000}, "the checkpoint is inside the big transaction"
        s.kill()
        max_seq = max(b.seq for b in s.batches())
        replica.wait_replicated(primary)
        replica_gtids = [e for e in run_sql(replica, None, "SHOW BINLOG EVENTS IN 'mysql-bin.000001'")
                         if e[2] == "Gtid"]
        assert replica_gtids and not any("cid=" in str(e[5]) for e in replica_gtids), replica_gtids
        primary.stop()
        replica.promote()
        s.port = replica.port
        s.start("landed", snapshot={"mode": "never"})
        s.wait("the whole transaction landed", lambda: s.landed_ids() >= set(range(1001, 1201)) | {3000})
        after = [r for b in s.batches() if b.seq > max_seq for r in rows(b)]
        assert not {r["id"] for r in after} & acked, "an acked event of the transaction came again"
        assert {r["id"] for r in after} == (set(range(1001, 1201)) | {3000}) - acked
        assert len(after) == len({r["id"] for r in after})
    finally:
        s.close()


def _byte_offset_seq(server: MariaDBServer, pos: MySqlPosition) -> int:
    """The seq an earlier cdcd (byte offsets in the transaction) gave the row that has ``pos`` now: the
    transaction read from its start by the decoder both ways."""
    items: dict[bool, list[int]] = {}
    for legacy in (False, True):
        reader = BinLogStreamReader(
            connection_settings={"host": "127.0.0.1", "port": server.port, "user": "root", "password": ""},
            server_id=next(_server_ids), log_file=pos.file, log_pos=pos.pos, resume_stream=True, blocking=False,
            only_events=_EVENTS, filter_non_implemented_events=False)
        decoder = Decoder("mariadb", {TableId("app", "t")}, SchemaHistory(), pos.file, "", columnar=False,
                          legacy_tx=(pos.epoch, pos.file_index, pos.pos) if legacy else None)
        seqs: list[int] = []
        try:
            for ev in reader:
                for item in decoder.feed(ev):
                    if isinstance(item, ChangeEvent) and isinstance(item.position, MySqlPosition) and \
                            item.position.pos == pos.pos:
                        seqs.append(item.position.seq)
        finally:
            reader.close()
        items[legacy] = seqs
    return items[True][items[False].index(pos.seq)]


def test_a_checkpoint_of_byte_offset_seqs_inside_a_transaction_resumes_it_exactly(
        tmp_path: Path, lone: MariaDBServer) -> None:
    """A checkpoint an earlier cdcd wrote inside a transaction (its seq a byte offset, no "seqs" entry in the
    source state): after the upgrade the rest of that transaction lands once, nothing of it skipped, and the
    transactions after it are numbered by content."""
    s = Setup(tmp_path, lone.port)
    try:
        s.start("consumed", snapshot={"mode": "never"})
        s.wait("the stream start in the checkpoint", lambda: s.checkpoint() is not None)
        run_sql(lone, "app", "INSERT INTO t SELECT seq, seq, 'big' FROM seq_1001_to_1200")  # one transaction
        s.wait("60 events landed", lambda: sum(len(rows(b)) for b in s.batches()) >= 60)
        acked_rows, last_acked = s.consume_upto(30)
        s.wait("the checkpoint covers the acked batches",
               lambda: (c := s.checkpoint()) is not None and c.batch_seq >= last_acked)
        s.kill()
        ckpt = s.checkpoint()
        assert ckpt is not None and ckpt.source_state.get("inside_tx") is True
        assert ckpt.source_state.get("seqs") == "content"
        pos = ckpt.position
        assert isinstance(pos, MySqlPosition)
        old_seq = _byte_offset_seq(lone, pos)
        assert old_seq > pos.seq  # byte offsets run ahead of the content numbering
        ckpt.position = dataclasses.replace(pos, seq=old_seq)  # what the earlier version saved
        del ckpt.source_state["seqs"]
        (s.state / "checkpoint.json").write_bytes(ckpt.to_bytes())
        max_seq = max(b.seq for b in s.batches())
        s.start("landed", snapshot={"mode": "never"})
        run_sql(lone, "app", "INSERT INTO t VALUES (3000, 0, 'after')")
        s.wait("the transaction and the next one landed", lambda: s.landed_ids() >= set(range(1001, 1201)) | {3000})
        after = [r for b in s.batches() if b.seq > max_seq for r in rows(b)]
        acked = {r["id"] for r in acked_rows}
        assert not {r["id"] for r in after} & acked, "an acked event of the transaction came again"
        assert {r["id"] for r in after} == (set(range(1001, 1201)) | {3000}) - acked
        assert len(after) == len({r["id"] for r in after})
        s.wait("a checkpoint after the transaction", lambda: (c := s.checkpoint()) is not None
               and c.source_state.get("seqs") == "content" and not c.source_state.get("inside_tx"))
    finally:
        s.close()


def test_failover_to_a_replica_lacking_gtids_stops_naming_them(
        tmp_path: Path, pair: tuple[MariaDBServer, MariaDBServer], proxy_to: SwitchProxy) -> None:
    primary, replica = pair
    s = Setup(tmp_path, proxy_to.port)
    try:
        s.start("landed")
        s.wait("the snapshot landed", lambda: s.landed_ids() >= set(range(1, 51)))
        replica.sql("STOP SLAVE")  # the replica falls behind
        for i in range(10):
            run_sql(primary, "app", f"INSERT INTO t VALUES ({100 + i}, {i}, 'unreplicated')")
        s.wait("the unreplicated writes landed", lambda: 109 in s.landed_ids())
        captured = primary.sql("SELECT @@GLOBAL.gtid_binlog_pos")
        fail_over(primary, replica, proxy_to)
        run_sql(replica, "app", "INSERT INTO t VALUES (2000, 0, 'replica-sentinel')")
        assert s.exit_code() == ExitCode.POSITION_LOST, s.tail()
        log = s.log.read_text()
        assert "lacks GTIDs" in log and f"up to {captured}" in log, s.tail()
        assert 2000 not in s.landed_ids()
    finally:
        s.close()


@pytest.fixture
def lone() -> Iterator[MariaDBServer]:
    server = MariaDBServer(settings=dict(REPLICATION), server_id=1).start()
    try:
        run_sql(server, None, "CREATE DATABASE app")
        run_sql(server, "app", "CREATE TABLE app.t (id INT PRIMARY KEY, v INT, note VARCHAR(40))",
                "INSERT INTO app.t SELECT seq, seq, 'initial' FROM seq_1_to_20")
        yield server
    finally:
        server.stop()


def test_reset_master_under_writes_stops_the_daemon_and_stays_refused_once_the_new_history_passes_it(
        tmp_path: Path, lone: MariaDBServer) -> None:
    """RESET MASTER while a writer runs: the daemon exits POSITION_LOST. The writes go on until the new binlog
    history is past the checkpoint's file offset and GTID sequence number (a comparison of GTID sets or of file
    sizes then sees nothing wrong); a restart still refuses with the same code and lands nothing."""
    s = Setup(tmp_path, lone.port)
    stop = threading.Event()
    next_id = itertools.count(1000)

    def writer() -> None:
        conn = pymysql.connect(host="127.0.0.1", port=lone.port, user="root", password="", database="app",
                               autocommit=True)
        try:
            with conn.cursor() as cur:
                while not stop.is_set():
                    cur.execute("INSERT INTO t VALUES (%s, 0, 'writer')", (next(next_id),))
        finally:
            conn.close()

    thread = threading.Thread(target=writer, name="writer", daemon=True)
    try:
        s.start("landed")
        s.wait("the snapshot landed", lambda: s.landed_ids() >= set(range(1, 21)))
        thread.start()
        s.wait("the writer's rows land", lambda: len(s.landed_ids()) >= 120)
        run_sql(lone, None, "RESET MASTER")
        assert s.exit_code() == ExitCode.POSITION_LOST, s.tail()
        log = s.log.read_text()
        assert "RESET MASTER" in log, s.tail()
        ckpt = s.checkpoint()
        assert ckpt is not None and isinstance(ckpt.position, MySqlPosition)
        pos = ckpt.position
        ckpt_seq = int(pos.gtid.split("-")[-1])

        def past_the_checkpoint() -> bool:
            size = {str(r[0]): int(r[1]) for r in run_sql(lone, None, "SHOW BINARY LOGS")}.get(pos.file, 0)
            seq = int(str(run_sql(lone, None, "SELECT @@GLOBAL.gtid_binlog_pos")[0][0]).split("-")[-1])
            return size > pos.pos + 10_000 and seq > ckpt_seq + 100

        s.wait("the new history passes the checkpoint's offset and GTID seq", past_the_checkpoint)
        stop.set()
        thread.join(30)
        landed_batches = len(s.batches())
        landed = s.landed_ids()
        written = {int(r[0]) for r in run_sql(lone, "app", "SELECT id FROM t WHERE id >= 1000")}
        s.start("landed")
        assert s.exit_code() == ExitCode.POSITION_LOST, s.tail()
        log = s.log.read_text()
        assert "another history" in log and pos.file in log, s.tail()
        assert len(s.batches()) == landed_batches and s.landed_ids() == landed
        assert written - landed, "the new history's rows are not landed"
    finally:
        stop.set()
        if thread.is_alive():
            thread.join(30)
        s.close()


def test_reset_master_while_stopped_is_refused_at_start(tmp_path: Path, lone: MariaDBServer) -> None:
    s = Setup(tmp_path, lone.port)
    try:
        s.start("landed")
        s.wait("the snapshot landed", lambda: s.landed_ids() >= set(range(1, 21)))
        for i in range(5):
            run_sql(lone, "app", f"INSERT INTO t VALUES ({100 + i}, {i}, 'streamed')")
        s.wait("the checkpoint covers the writes", lambda: (c := s.checkpoint()) and c.event_count >= 25)
        s.procs[-1].send_signal(signal.SIGTERM)
        assert s.exit_code(60) == 0, s.tail()
        run_sql(lone, None, "RESET MASTER")
        run_sql(lone, "app", "INSERT INTO t VALUES (200, 0, 'after-reset')")
        s.start("landed")
        assert s.exit_code() == ExitCode.POSITION_LOST, s.tail()
        log = s.log.read_text()
        assert "no longer has GTIDs" in log and "domain 0" in log, s.tail()
        assert 200 not in s.landed_ids()
    finally:
        s.close()
