"""PostgreSQL -> the daemon -> a landing zone on a real S3 server (versitygw), read back with the landing reader
and compared with the source; in the same run, the store unreachable while the daemon lands (the batch is
retried with backoff, the checkpoint does not move, nothing is lost once the store returns), a graceful stop,
and a restart with rejected credentials (exit 5, naming the bucket and the setting, never the secret)."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from daemon_harness import DaemonHarness
from faultproxy import FaultProxy

from cdcd.daemon.exitcodes import ExitCode
from cdcd.landing import objstore, reader
from devtools.s3server import S3Server
from devtools.servers import PostgresServer


class Setup(DaemonHarness):
    def __init__(self, tmp: Path, server: PostgresServer, db: str, s3: S3Server, bucket: str) -> None:
        super().__init__(tmp)
        self.server, self.db, self.s3 = server, db, s3
        self.url = f"s3://{bucket}/cdc/{db}"
        reader.use_store(self.url, objstore.Settings(endpoint=s3.endpoint, region=s3.region, timeout_s=5,
                                                     access_key_id=s3.access_key, secret_access_key=s3.secret_key))

    def source_sections(self) -> dict[str, dict[str, Any]]:
        return {
            "source": {"kind": "postgres", "port": self.server.port, "user": "postgres", "database": self.db,
                       "tables": ["public.t"], "sslmode": "disable"},
            "source.postgres": {"slot": f"s_{self.db}", "publication": f"p_{self.db}", "heartbeat_s": 0.5},
        }

    def start_on_s3(self, port: int, secret: str) -> None:
        secret_file = self.tmp / f"s3-secret-{len(self.procs)}"
        secret_file.write_text(secret + "\n")
        self.start("landed", landing={"path": self.url},
                   **{"landing.s3": {"endpoint": f"http://127.0.0.1:{port}", "region": self.s3.region,
                                     "access_key_id": self.s3.access_key, "secret_access_key_file": str(secret_file),
                                     "timeout_s": 3}})

    def mirror(self) -> dict[int, str]:
        """The landed changes replayed by position: what a consumer's mirror of public.t holds."""
        rows = [r for b in reader.read_batches(self.url) for t in b.tables.values() for r in t.to_pylist()]
        out: dict[int, str] = {}
        for r in sorted(rows, key=lambda r: r["_cdc_pos"]):
            if r["_cdc_op"] == "d":
                out.pop(r["id"], None)
            elif r["_cdc_op"] in ("r", "c", "u"):
                out[r["id"]] = r["v"]
        return out

    def source(self) -> dict[int, str]:
        text = self.server.psql("SELECT id, v FROM t ORDER BY id", self.db)
        return {int(i): v for i, v in (line.split("|") for line in text.splitlines() if line)}


@pytest.fixture
def setup(tmp_path: Path, pg_server: PostgresServer, pg_db: str, s3_server: S3Server,
          s3_bucket: str) -> Iterator[Setup]:
    s = Setup(tmp_path, pg_server, pg_db, s3_server, s3_bucket)
    try:
        yield s
    finally:
        s.close()


def test_postgres_to_object_storage_through_an_outage(setup: Setup) -> None:
    s = setup
    s.server.psql("CREATE TABLE t (id int PRIMARY KEY, v text NOT NULL)", s.db)
    s.server.psql("INSERT INTO t SELECT g, 'v' || g FROM generate_series(1, 60) g", s.db)
    with FaultProxy(s.s3.port) as proxy:
        s.start_on_s3(proxy.port, s.s3.secret_key)
        s.wait("the snapshot on object storage", lambda: len(s.mirror()) == 60)
        s.server.psql("INSERT INTO t VALUES (61, 'streamed')", s.db)
        s.wait("a streamed row", lambda: 61 in s.mirror())
        # (batches of heartbeat marks alone are checkpointed without landing: the checkpoint may be past it)
        s.wait("the checkpoint past the streamed row", lambda: (c := s.checkpoint()) and c.batch_seq
               >= max(reader.landed_seqs(s.url)))
        before = s.checkpoint()
        assert before is not None

        proxy.refuse(3600)  # the store goes away: new connections refused, open ones cut
        proxy.reset()
        s.server.psql("INSERT INTO t SELECT g, 'outage' FROM generate_series(62, 90) g", s.db)
        s.server.psql("UPDATE t SET v = 'changed' WHERE id <= 10; DELETE FROM t WHERE id BETWEEN 20 AND 25", s.db)
        s.wait("the daemon retrying the landing",
               lambda: s.log.read_text().count("landing the batch failed, retrying") >= 2)
        during = s.checkpoint()
        failing = min(json.loads(line)["batch"] for line in s.log.read_text().splitlines()
                      if "landing the batch failed, retrying" in line)
        # batches of progress marks alone may still commit before the failing batch, never past it; no event moves
        assert during is not None and during.batch_seq < failing and during.event_count == before.event_count
        assert s.procs[-1].poll() is None  # still running, waiting for the store

        proxy.refuse(0)  # the store is back
        s.wait("every change landed after the outage", lambda: s.mirror() == s.source())
        s.wait("the checkpoint moved on", lambda: (c := s.checkpoint()) and c.batch_seq > before.batch_seq)
        s.procs[-1].send_signal(signal.SIGTERM)
        assert s.procs[-1].wait(60) == ExitCode.OK, s.tail()
    assert s.mirror() == s.source() and len(s.source()) == 84
    assert s.s3.secret_key not in s.tail()
    assert f'"landing": "{s.url}"' in s.log.read_text()  # the start line names the zone as configured

    s.start_on_s3(s.s3.port, "not-the-secret")
    code = s.procs[-1].wait(60)
    log = s.tail()
    assert code == ExitCode.SINK_FATAL, log
    assert f"bucket {s.url.split('/')[2]}" in log and "landing.s3.access_key_id" in log
    assert "not-the-secret" not in log and s.s3.secret_key not in log
