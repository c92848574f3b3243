"""The consumer against an object store that goes away in the middle of a merge: `cdcd spark run --target
s3a://...` (a real process, S3A and the lease through a TCP proxy in front of the real S3 server), the store
unreachable while the consumer writes a merge's data files. The consumer must end within a bound (S3A's
timeouts and retries as cdcd sets them: docs/spark.md, "Waits on object storage") with the failure exit code
and a clear error, leave no half-applied batch (each table's commit is all or nothing, the commit record names
only what committed), and a rerun once the store is back must apply every batch exactly once.

The landing zone is local (the landing side's own faults are tests/e2e/test_daemon_s3.py); its batches are
written by the landing sink directly, from a workload whose end state the test computes."""

from __future__ import annotations

import os
import random
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pytest
from faultproxy import FaultProxy
from support.processes import finished, spark_consumer
from support.s3 import keys
from support.waits import wait_for

from cdcd.events import ChangeEvent, Column, Op, TableId, TableSchema
from cdcd.positions import PgPosition
from cdcd.runtime.interfaces import Batch
from cdcd.sinks.landing import LandingSink
from devtools.s3server import S3Server

pytestmark = [pytest.mark.spark]
SCHEMA = TableSchema(TableId("public", "t"), (Column("k", pa.int64(), "bigint", nullable=False),
                                              Column("v", pa.string(), "text")), ("k",))
#: How long the store stays away: past the consumer's bounded retries, so that the merge must fail.
OUTAGE_S = 600
#: How long the consumer may take to end once the store went away: its lease (10 s) and the JVM's kill, with
#: room for a loaded machine; without the fence it waits out S3A's timeouts and retries (over 200 s a request).
FENCE_WAIT_S = 120


class Workload:
    """Batches of inserts, updates and deletes on one table; ``expected`` is the table after all of them."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.expected: dict[int, str] = {}
        self.lsn = 0
        self.events = 0

    def batch(self, size: int) -> list[ChangeEvent]:
        out = []
        for _ in range(size):
            self.lsn += 1
            keys_now = list(self.expected)
            roll = self.rng.random()
            if keys_now and roll < 0.3:
                k = self.rng.choice(keys_now)
                v = f"u{self.lsn}"
                out.append(self.event(Op.UPDATE, before={"k": k}, after={"k": k, "v": v}))
                self.expected[k] = v
            elif keys_now and roll < 0.4:
                k = self.rng.choice(keys_now)
                out.append(self.event(Op.DELETE, before={"k": k}))
                del self.expected[k]
            else:
                k = self.lsn
                out.append(self.event(Op.CREATE, after={"k": k, "v": f"i{k}"}))
                self.expected[k] = f"i{k}"
        self.events += len(out)
        return out

    def event(self, op: Op, **kw: object) -> ChangeEvent:
        return ChangeEvent(op, SCHEMA, PgPosition(self.lsn, 0), tx_id=str(self.lsn), **kw)  # type: ignore[arg-type]


async def land(landing: Path, batches: list[list[ChangeEvent]], first_seq: int) -> None:
    sink = LandingSink(landing)
    await sink.open()
    for n, events in enumerate(batches):
        await sink.deliver(Batch(first_seq + n, events))
    await sink.close()


@pytest.fixture
def proxy(s3_server: S3Server) -> Iterator[FaultProxy]:
    with FaultProxy(s3_server.port) as p:
        yield p


def consumer(tmp_path: Path, s3: S3Server, port: int, landing: Path, target: str, name: str) -> \
        tuple[subprocess.Popen[bytes], Path]:
    env = {**os.environ, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_REGION": s3.region,
           "AWS_ACCESS_KEY_ID": s3.access_key, "AWS_SECRET_ACCESS_KEY": s3.secret_key}
    log = tmp_path / f"{name}.log"
    return spark_consumer(log, env, "--landing", str(landing), "--target", target, "--format", "delta", "--once",
                          "--lease-seconds", "10", "--delta-readers", "any"), log


def table_rows(s3: S3Server, url: str) -> list[dict[str, object]]:
    """A Delta table on the store read with delta-rs (the consumer wrote it with --delta-readers any)."""
    from deltalake import DeltaTable

    options = {"AWS_ENDPOINT_URL": s3.endpoint, "AWS_REGION": s3.region, "AWS_ACCESS_KEY_ID": s3.access_key,
               "AWS_SECRET_ACCESS_KEY": s3.secret_key, "AWS_ALLOW_HTTP": "true"}
    return DeltaTable(url, storage_options=options).to_pyarrow_table().to_pylist()  # type: ignore[no-any-return]


def java_left(pid: int) -> list[str]:
    """The JVMs still running in the consumer's process tree (its children)."""
    found = subprocess.run(["ps", "-o", "pid=,args=", "--ppid", str(pid)], capture_output=True, text=True, timeout=30)
    return [line for line in found.stdout.splitlines() if "java" in line]


async def test_store_unreachable_mid_merge_fences_the_jvm_and_a_rerun_applies_each_batch_once(
        s3_server: S3Server, s3_bucket: str, proxy: FaultProxy, tmp_path: Path) -> None:
    landing, target = tmp_path / "landing", f"s3a://{s3_bucket}/target"
    work = Workload(int(os.environ.get("CDCD_TEST_SEED", "7")))
    await land(landing, [work.batch(200) for _ in range(3)], 1)
    first, log = consumer(tmp_path, s3_server, proxy.port, landing, target, "first")
    code, out = finished(first, log, 600)
    assert code == 0, out[-3000:]
    table = f"target/tables/{SCHEMA.table}/"
    files_before = [k for k in keys(s3_server, s3_bucket, table) if k.endswith(".parquet")]

    await land(landing, [work.batch(2000) for _ in range(20)], 4)
    cut, cut_log = consumer(tmp_path, s3_server, proxy.port, landing, target, "cut")
    try:
        wait_for("the merge writing its data files",
                 lambda: len([k for k in keys(s3_server, s3_bucket, table) if k.endswith(".parquet")])
                 > len(files_before), 600, procs=cut, log=cut_log, step=0.1)
        # the store goes away: new connections refused, open ones silent (S3A's own timeouts and retries would
        # wait for minutes); the lease's expiry, 10 s after its last renewal, ends the merge
        proxy.refuse(OUTAGE_S)
        proxy.blackhole()
        started = time.monotonic()
        code, out = finished(cut, cut_log, FENCE_WAIT_S)
        took = time.monotonic() - started
    finally:
        cut.kill()
    print(f"the consumer exited {code} {took:.0f} s after the store went away")
    assert code == 1, out[-3000:]
    assert "the consumer lost its target" in out, out[-3000:]
    failed = [line for line in out.splitlines() if '"merge failed"' in line]  # its cause, not the JVM's socket
    assert failed and "the lease was not renewed within 10 s" in failed[0], out[-3000:]
    assert not java_left(cut.pid)
    assert f"target/state/commits/{23:020d}.json" not in keys(s3_server, s3_bucket, "target/state/")

    proxy.refuse(0)  # the store is back: a rerun takes the expired lease over and applies each batch once
    rerun, rerun_log = consumer(tmp_path, s3_server, proxy.port, landing, target, "rerun")
    code, out = finished(rerun, rerun_log, 600)
    assert code == 0, out[-3000:]
    assert "took over the target's expired lease" in out
    jvm_warnings = [line for line in out.splitlines() if '"logger": "jvm"' in line and '"level": "warning"' in line]
    assert not jvm_warnings, jvm_warnings  # e.g. a class-data sharing archive refused for S3A's class path
    mirror = {r["k"]: r["v"] for r in table_rows(s3_server, f"s3://{s3_bucket}/target/tables/{SCHEMA.table}")}
    assert mirror == work.expected
    log_rows = table_rows(s3_server, f"s3://{s3_bucket}/target/changelog/{SCHEMA.table}")
    events = {(r["_cdc_pos"], r["k"], r["_cdc_op"]) for r in log_rows}
    assert len(log_rows) == len(events) == work.events, "an event is missing from the change-log, or twice in it"
