"""Disk faults with the real daemon: the state directory or the landing zone on a small tmpfs that a
filler file makes full (ENOSPC) for a while as a write workload streams, then freed.

The daemon must not wedge: checkpoint saves and batch landings are retried until the disk has room
again, `/readyz` (at once) and `/healthz` (after 30 s) report the failure, nothing partial becomes
visible, the checkpoint does not move while saves fail, and once space returns the pipeline resumes
by itself. At the end the landing zone, replayed in position order (and merged by Spark, checked by
`cdcd verify`), equals the source.
"""

from __future__ import annotations

import itertools
import json
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from daemon_harness import DaemonHarness, rows
from support.disk import fill, tmpfs

from cdcd.landing.reader import landed_seqs
from devtools.servers import MariaDBServer, PostgresServer, free_port

pytestmark = pytest.mark.slow
CDCD = str(Path(sys.executable).with_name("cdcd"))
MAX_INFLIGHT = 4
_server_ids = itertools.count(7301)


# ---- the daemon, its endpoints, a workload ---------------------------------------------------------


class Disk(DaemonHarness):
    def __init__(self, tmp: Path) -> None:
        super().__init__(tmp)
        self.port = free_port()

    def start_streaming(self, grace: float = 20) -> subprocess.Popen[bytes]:
        return self.start("landed", http={"listen": f"127.0.0.1:{self.port}"},
                          runtime={"max_inflight_batches": MAX_INFLIGHT, "shutdown_grace_s": grace,
                                   "reconnect_max_s": 2.0})

    def get(self, endpoint: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{endpoint}", timeout=10) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()
        except (urllib.error.URLError, ConnectionError) as exc:  # not listening yet (starting)
            return 0, str(exc)

    def status(self) -> dict[str, Any]:
        """/status, or {} while the daemon is not listening yet."""
        code, body = self.get("/status")
        doc: dict[str, Any] = json.loads(body) if code == 200 else {}
        return doc

    def temp_files(self) -> list[str]:
        return [p.name for d in ("data", "manifests") for p in (self.landing / d).glob(".*.tmp")]

    def replay(self) -> dict[Any, dict[str, Any]]:
        """The landing zone applied in position order: the mirror a consumer builds."""
        state: dict[Any, dict[str, Any]] = {}
        for r in sorted((r for b in self.batches() for r in rows(b)), key=lambda r: r["_cdc_pos"]):
            if r["_cdc_op"] == "d":
                state.pop(r["id"], None)
            else:
                state[r["id"]] = {k: v for k, v in r.items() if not k.startswith("_cdc_")}
        return state


class PgDisk(Disk):
    def __init__(self, tmp: Path, server: PostgresServer, db: str) -> None:
        super().__init__(tmp)
        self.server, self.db = server, db

    def source_sections(self) -> dict[str, dict[str, Any]]:
        return {
            "source": {"kind": "postgres", "port": self.server.port, "user": "postgres", "database": self.db,
                       "tables": ["public.t"], "sslmode": "disable"},
            "source.postgres": {"slot": f"s_{self.db}", "publication": f"p_{self.db}", "heartbeat_s": 0.5},
        }

    def sql(self, statement: str) -> None:
        self.server.psql(statement, self.db)

    def source_rows(self) -> dict[Any, dict[str, Any]]:
        out = self.server.psql("SELECT id, v FROM t ORDER BY id", self.db)
        return {int(i): {"id": int(i), "v": int(v)} for i, v in (line.split("|") for line in out.splitlines())}


class MariaDisk(Disk):
    def __init__(self, tmp: Path, server: MariaDBServer, db: str) -> None:
        super().__init__(tmp)
        self.server, self.db = server, db

    def source_sections(self) -> dict[str, dict[str, Any]]:
        return {
            "source": {"kind": "mariadb", "port": self.server.port, "user": "cdc", "password": "secret",
                       "database": self.db, "tables": [f"{self.db}.t"], "sslmode": "disable"},
            "source.mysql": {"server_id": next(_server_ids)},
        }

    def sql(self, statement: str) -> None:
        self.server.sql(statement, self.db)

    def source_rows(self) -> dict[Any, dict[str, Any]]:
        out = self.server.sql("SELECT id, v FROM t ORDER BY id", self.db)
        return {int(i): {"id": int(i), "v": int(v)} for i, v in (line.split("\t") for line in out.splitlines())}


class Workload:
    """Inserts, updates and deletes in small transactions on a thread until stopped."""

    def __init__(self, sql: Callable[[str], None], series: Callable[[int, int], str], base: int = 1000) -> None:
        self.sql, self.series, self.base = sql, series, base
        self.rounds = 0
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                i = self.base + self.rounds * 10
                self.sql(f"INSERT INTO t (id, v) {self.series(i, i + 9)}")
                # a bounded update: the backlog an outage builds grows with its length, not with the table
                self.sql(f"UPDATE t SET v = v + 1 WHERE id BETWEEN {i - 70} AND {i} AND id % 7 = {self.rounds % 7}")
                self.sql(f"DELETE FROM t WHERE id = {i + 3}")
                self.rounds += 1
                time.sleep(0.05)
        except BaseException as exc:
            self.error = exc

    def __enter__(self) -> Workload:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(60)
        assert self.error is None, f"the workload failed: {self.error!r}"


def pg_series(a: int, b: int) -> str:
    return f"SELECT g, g FROM generate_series({a}, {b}) g"


def maria_series(a: int, b: int) -> str:
    return f"SELECT seq, seq FROM seq_{a}_to_{b}"


@pytest.fixture
def pg(tmp_path: Path, pg_server: PostgresServer, pg_db: str) -> Iterator[PgDisk]:
    s = PgDisk(tmp_path, pg_server, pg_db)
    try:
        yield s
    finally:
        s.close()


@pytest.fixture
def maria(tmp_path: Path, maria_server: MariaDBServer, maria_db: str) -> Iterator[MariaDisk]:
    s = MariaDisk(tmp_path, maria_server, maria_db)
    try:
        yield s
    finally:
        s.close()


# ---- the scenarios -----------------------------------------------------------------------------


def _start_with_rows(s: Disk, series: Callable[[int, int], str]) -> subprocess.Popen[bytes]:
    s.sql("CREATE TABLE t (id INT PRIMARY KEY, v INT)")
    s.sql(f"INSERT INTO t (id, v) {series(1, 100)}")
    proc = s.start_streaming()
    s.wait("the snapshot checkpointed", lambda: (c := s.checkpoint()) is not None and c.event_count >= 100)
    return proc


def _finish(s: Disk, proc: subprocess.Popen[bytes]) -> None:
    """A last row lands and is checkpointed, SIGTERM exits 0, the replayed landing zone equals the source."""
    s.sql("INSERT INTO t (id, v) VALUES (999999, 1)")
    s.wait("the last row landed", lambda: 999999 in s.landed_ids(), timeout=300)
    last = max(b.seq for b in s.batches() if any(r["id"] == 999999 for r in rows(b)))
    s.wait("the checkpoint covers the last row", lambda: (c := s.checkpoint()) is not None and c.batch_seq >= last)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0, s.tail()
    source = s.source_rows()
    mirror = s.replay()
    assert mirror.keys() == source.keys(), (
        f"missing {sorted(source.keys() - mirror.keys())[:10]}, extra {sorted(mirror.keys() - source.keys())[:10]}")
    assert mirror == source


def _checkpoint_outage(s: Disk, proc: subprocess.Popen[bytes], hold: Callable[[], None]) -> None:
    """Fill the state tmpfs while the workload streams; check the daemon holds still and says why; free it."""
    filler = fill(s.state)
    s.wait("a checkpoint save failing", lambda: s.status().get("checkpoint_failing"))
    # Reading pauses: every in-flight slot taken, none can free up while saves fail.
    s.wait("all in-flight slots taken",
           lambda: s.status()["stats"]["batches_inflight"] == MAX_INFLIGHT)
    frozen = s.checkpoint()
    assert frozen is not None
    # No ack can come now: further failures are the retry timer's attempts.
    failures = s.status()["stats"]["checkpoint_failures"]
    s.wait("the save retried on its timer", lambda: s.status()["stats"]["checkpoint_failures"] >= failures + 2)
    code, body = s.get("/readyz")
    assert code == 503 and "checkpoint saves are failing" in body and "free space" in body, body
    hold()
    status = s.status()
    assert status["checkpoint_failing"], status["stats"]
    assert str(s.state) in status["stats"]["checkpoint_error"]
    assert s.checkpoint() == frozen, "the checkpoint moved while it could not be saved"
    _, metrics = s.get("/metrics")
    assert "cdcd_checkpoint_failing 1.0" in metrics
    filler.unlink()
    s.wait("checkpoint saves working again", lambda: not s.status()["checkpoint_failing"])
    s.wait("the checkpoint moved on", lambda: (c := s.checkpoint()) is not None and c.batch_seq > frozen.batch_seq)
    s.wait("/readyz 200 again", lambda: s.get("/readyz")[0] == 200)
    assert s.get("/healthz")[0] == 200
    assert proc.poll() is None


def test_postgres_checkpoint_disk_full_recovers_then_spark_and_verify_agree(spark: object, pg: PgDisk) -> None:
    s = pg
    with tmpfs(s.state, "1m"):
        proc = _start_with_rows(s, pg_series)
        with Workload(s.sql, pg_series) as work:

            def hold() -> None:
                # Past the 30 s bound /healthz turns 503 too, naming the failing checkpoint.
                _, body = s.wait("/healthz 503", lambda: (r := s.get("/healthz"))[0] == 503 and r)
                assert "checkpoint saves are failing" in body, body
                rounds = work.rounds
                s.wait("the workload went on meanwhile", lambda: work.rounds > rounds + 5)

            _checkpoint_outage(s, proc, hold)
        _finish(s, proc)
        s.spark_and_verify()


def test_mariadb_checkpoint_disk_full_recovers(spark: object, maria: MariaDisk) -> None:
    s = maria
    with tmpfs(s.state, "1m"):
        proc = _start_with_rows(s, maria_series)
        with Workload(s.sql, maria_series) as work:

            def hold() -> None:
                rounds = work.rounds
                s.wait("the workload went on meanwhile", lambda: work.rounds > rounds + 20)

            _checkpoint_outage(s, proc, hold)
        _finish(s, proc)
        s.spark_and_verify()


def test_postgres_landing_disk_full_recovers(pg: PgDisk) -> None:
    _landing_outage(pg, pg_series)


def test_mariadb_landing_disk_full_recovers(maria: MariaDisk) -> None:
    _landing_outage(maria, maria_series)


def _landing_outage(s: Disk, series: Callable[[int, int], str]) -> None:
    """Fill the landing tmpfs while the workload streams: nothing partial, nothing checkpointed; then free it."""
    with tmpfs(s.landing, "16m"):
        proc = _start_with_rows(s, series)
        with Workload(s.sql, series) as work:
            filler = fill(s.landing)
            s.wait("a batch failing to land", lambda: s.status()["sink"].get("failing_since"))
            # The failing batch holds the one in-flight slot left: everything before it is checkpointed.
            s.wait("only the failing batch in flight", lambda: s.status()["stats"]["batches_inflight"] == 1)
            frozen, visible = s.checkpoint(), landed_seqs(s.landing)
            assert frozen is not None
            code, body = s.get("/readyz")
            assert code == 503 and "landing writes are failing" in body and str(s.landing) in body, body
            assert "free space" in body, body
            rounds = work.rounds
            s.wait("the workload went on meanwhile", lambda: work.rounds > rounds + 20)
            status = s.status()
            assert status["sink"]["write_failures"] >= 2, status["sink"]
            # Nothing partial: no temp file kept, no new visible batch, the checkpoint where it was.
            assert s.temp_files() == []
            assert landed_seqs(s.landing) == visible
            assert s.checkpoint() == frozen
            assert "cdcd_landing_failing 1.0" in s.get("/metrics")[1]
            filler.unlink()
            s.wait("landing working again", lambda: not s.status()["sink"]["failing_since"])
            s.wait("the checkpoint moved on",
                   lambda: (c := s.checkpoint()) is not None and c.batch_seq > frozen.batch_seq)
            s.wait("/readyz 200 again", lambda: s.get("/readyz")[0] == 200)
        _finish(s, proc)


def test_postgres_sigterm_while_checkpoint_disk_full(pg: PgDisk) -> None:
    """SIGTERM while saves fail: the stop keeps retrying; space back within the grace period -> exit 0.
    Still full when the grace period ends -> exit 3, checkpoint unmoved, and the restart loses nothing."""
    s = pg
    with tmpfs(s.state, "1m"):
        proc = _start_with_rows(s, pg_series)
        with Workload(s.sql, pg_series):
            filler = fill(s.state)
            s.wait("all in-flight slots taken by unsaved batches",
                   lambda: (st := s.status())["checkpoint_failing"]
                   and st["stats"]["batches_inflight"] == MAX_INFLIGHT)
        proc.send_signal(signal.SIGTERM)
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(3)  # the stop waits for the save (grace period: 20 s)
        filler.unlink()
        assert proc.wait(60) == 0, s.tail()
        ckpt = s.checkpoint()
        assert ckpt is not None and ckpt.batch_seq >= max(landed_seqs(s.landing)), "landed batches not checkpointed"

        filler = fill(s.state)
        proc = s.start_streaming(grace=3)
        with Workload(s.sql, pg_series, base=500000):
            s.wait("a checkpoint save failing after the restart", lambda: s.status().get("checkpoint_failing"))
            frozen = s.checkpoint()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 3, s.tail()
        assert "the checkpoint cannot be saved" in s.log.read_text()
        assert s.checkpoint() == frozen
        filler.unlink()
        proc = s.start_streaming()
        s.wait("the restart checkpointed", lambda: (c := s.checkpoint()) is not None and c.batch_seq > frozen.batch_seq)
        _finish(s, proc)
