"""The consumer's tables, state and lease on object storage: PostgreSQL -> `cdcd run` -> s3:// landing zone on the
S3 server -> `cdcd spark run --target s3a://...` (a real process, its own local session with S3A) -> `cdcd verify
--target s3a://...`.

Delta Lake: a consumer SIGKILLed between the tables' commits of a merge and its commit record leaves the target
held until its lease expires, then a rerun takes the lease over and applies each batch exactly once (the mirror
equals the source, the change-log holds each event once), its record on the store. Iceberg: the JDBC catalog on
PostgreSQL, given as an operator would (spark-defaults.conf). The lease itself (one holder, renewal, refusal,
release, expiry) is tested without Spark in tests/integration/test_target_lease.py; a second consumer refused
while the first runs, in one more e2e test here, cost 4-5 minutes of the suite for nothing the two do not show."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.processes import daemon_phase, finished, spark_consumer
from support.s3 import client, keys, pg_daemon_config
from support.waits import wait_for

from cdcd.landing import reader
from cdcd.landing.objstore import Settings
from devtools.s3server import S3Server
from devtools.servers import PostgresServer

pytestmark = [pytest.mark.spark]
CDCD = str(Path(sys.executable).with_name("cdcd"))


@pytest.fixture
def s3_env(s3_server: S3Server) -> Iterator[dict[str, str]]:
    """The environment of the consumer and verify: the store's endpoint and keys, as boto3 and S3A read them."""
    yield {**os.environ, "AWS_ENDPOINT_URL": s3_server.endpoint, "AWS_REGION": s3_server.region,
           "AWS_ACCESS_KEY_ID": s3_server.access_key, "AWS_SECRET_ACCESS_KEY": s3_server.secret_key}


def daemon_config(tmp_path: Path, pg: PostgresServer, db: str, landing: str, s3: S3Server) -> Path:
    return pg_daemon_config(tmp_path, pg, db, landing, s3, ["public.orders", "public.items"], 500)


def landed_ids(landing: str) -> set[int]:
    return {r["id"] for b in reader.read_batches(landing) for t in b.tables.values() if "id" in t.column_names
            for r in t.select(["id"]).to_pylist()}


def workload(pg: PostgresServer, db: str, base: int) -> None:
    pg.psql(f"""INSERT INTO orders SELECT g, g * 1.5, 'n' || g FROM generate_series({base}, {base + 1999}) g;
                UPDATE orders SET amount = amount + 1 WHERE id % 7 = 0;
                UPDATE orders SET id = id + 500000 WHERE id BETWEEN {base} AND {base + 9};
                DELETE FROM orders WHERE id BETWEEN {base + 100} AND {base + 149};
                INSERT INTO items SELECT g, 'i' || g FROM generate_series({base}, {base + 499}) g;
                UPDATE items SET v = 'changed' WHERE k % 5 = 0;""", db)


def land(pg: PostgresServer, db: str, cfg: Path, landing: str, runs: int) -> None:
    """A snapshot, then the workload streamed by ``runs`` daemon runs (each ends with a sentinel row landed and a
    SIGKILL, so the next run lands unacknowledged batches again: one landing run, one merge, per daemon run)."""
    pg.psql("CREATE TABLE orders (id int PRIMARY KEY, amount numeric(12,2), note text);"
            "CREATE TABLE items (k int PRIMARY KEY, v text);"
            "INSERT INTO orders SELECT g, g, 'snap' FROM generate_series(1, 1000) g;", db)
    for run in range(1, runs + 1):
        log = cfg.parent / f"daemon-{run}.log"
        with open(log, "wb") as out:
            daemon = subprocess.Popen([CDCD, "run", "-c", str(cfg)], stdout=out, stderr=subprocess.STDOUT)
        try:
            # the workload streamed, not read by the snapshot: the sentinel, landed, then follows all of it (a
            # snapshot lands its tables side by side, so the sentinel may land before another table's rows)
            wait_for(f"daemon run {run} streaming", lambda: daemon_phase(cfg) == "streaming", 180, procs=daemon,
                     log=log, step=0.2)
            workload(pg, db, run * 10000)
            pg.psql(f"INSERT INTO orders VALUES ({900000 + run}, 0, 'sentinel')", db)
            wait_for(f"sentinel {run} landed", lambda r=run: 900000 + r in landed_ids(landing), 180, procs=daemon,
                     log=log)
        finally:
            daemon.kill()
            daemon.wait(timeout=60)


def consumer(tmp_path: Path, env: dict[str, str], landing: str, target: str, fmt: str, *args: str,
             name: str = "consumer") -> tuple[subprocess.Popen[bytes], Path]:
    log = tmp_path / f"{name}-{time.monotonic_ns()}.log"
    return spark_consumer(log, env, "--landing", landing, "--target", target, "--format", fmt, *args), log


def verify(cfg: Path, target: str, env: dict[str, str]) -> None:
    done = subprocess.run([CDCD, "verify", "-c", str(cfg), "--target", target], capture_output=True, text=True,
                          timeout=600, env=env)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]


def setup(s3: S3Server, bucket: str, pg: PostgresServer, db: str, tmp_path: Path, runs: int) -> tuple[str, Path]:
    landing = f"s3://{bucket}/landing"
    reader.use_store(landing, Settings(endpoint=s3.endpoint, region=s3.region, access_key_id=s3.access_key,
                                       secret_access_key=s3.secret_key))
    cfg = daemon_config(tmp_path, pg, db, landing, s3)
    land(pg, db, cfg, landing, runs)
    return landing, cfg


def delta_commits(s3: S3Server, bucket: str, prefix: str) -> list[str]:
    c = client(s3)
    return [c.get_object(Bucket=bucket, Key=k)["Body"].read().decode()
            for k in keys(s3, bucket, prefix) if k.endswith(".json")]


def recorded(s3: S3Server, bucket: str, kind: str, table: str, seq: int) -> bool:
    """Whether the table's Delta log records a commit of batch ``seq`` (its idempotent-write transaction)."""
    return any(f'"version":{seq},' in c for c in delta_commits(s3, bucket, f"target/{kind}/{table}/_delta_log/"))


def test_consumer_killed_between_table_commits_and_its_record_applies_each_batch_once(
        s3_server: S3Server, s3_bucket: str, pg_server: PostgresServer, pg_db: str, s3_env: dict[str, str],
        tmp_path: Path) -> None:
    from deltalake import DeltaTable

    landing, cfg = setup(s3_server, s3_bucket, pg_server, pg_db, tmp_path, runs=2)
    target = f"s3://{s3_bucket}/target"
    by_run: dict[str, list[Any]] = {}
    for b in reader.read_batches(landing):
        by_run.setdefault(b.manifest.run_id, []).append(b)
    assert len(by_run) >= 2, by_run.keys()
    second = list(by_run.values())[-1]
    last = {f"{t.schema}.{t.name}": b.seq for b in second for t in b.tables}  # each table's seq in its commits
    first_end = list(by_run.values())[-2][-1].seq

    def mid_merge() -> bool:
        if f"target/state/commits/{first_end:020d}.json" not in keys(s3_server, s3_bucket, "target/state/"):
            return False
        done = [recorded(s3_server, s3_bucket, kind, table, seq) for table, seq in last.items()
                for kind in ("changelog", "tables")]
        return any(done) and not all(done)

    # --delta-readers any: tables delta-rs reads, to count the change-log's rows outside Spark
    killed, killed_log = consumer(tmp_path, s3_env, landing, target, "delta", "--once", "--lease-seconds", "4",
                                  "--delta-readers", "any", name="killed")
    try:
        wait_for("the second merge's first table commits", mid_merge, 400, procs=killed, log=killed_log, step=0.2)
        killed.send_signal(signal.SIGKILL)
        killed.wait(timeout=60)
    finally:
        killed.kill()
        killed.wait(timeout=30)
    stored = keys(s3_server, s3_bucket, "target/state/")
    assert f"target/state/commits/{max(last.values()):020d}.json" not in stored  # killed before its record

    # the killed consumer's lease holds the target until it expires; then a rerun takes it over
    def rerun() -> tuple[int, str] | None:
        proc, log = consumer(tmp_path, s3_env, landing, target, "delta", "--once", "--delta-readers", "any",
                             name="rerun")
        code, out = finished(proc, log, 600)
        if code == 2 and "is in use by another cdcd spark consumer" in out:
            return None
        return code, out

    code, out = wait_for("the rerun after the lease's expiry", rerun, 900, step=0.5)
    assert code == 0, out[-3000:]
    assert "took over the target's expired lease" in out
    assert s3_server.secret_key not in out
    stored = keys(s3_server, s3_bucket, "target/state/")
    assert f"target/state/commits/{max(last.values()):020d}.json" in stored  # the record, on the store

    verify(cfg, target, s3_env)
    options = {"AWS_ENDPOINT_URL": s3_server.endpoint, "AWS_REGION": s3_server.region,
               "AWS_ACCESS_KEY_ID": s3_server.access_key, "AWS_SECRET_ACCESS_KEY": s3_server.secret_key,
               "AWS_ALLOW_HTTP": "true"}
    for table, key in (("public.orders", "id"), ("public.items", "k")):
        log = DeltaTable(f"s3://{s3_bucket}/target/changelog/{table}", storage_options=options).to_pyarrow_table()
        events = [(r["_cdc_pos"], r[key], r["_cdc_op"]) for r in log.select(["_cdc_pos", key, "_cdc_op"]).to_pylist()]
        assert events and len(events) == len(set(events)), f"{table}: events applied twice in the change-log"


def test_iceberg_target_on_object_storage_with_a_jdbc_catalog_on_postgresql(
        s3_server: S3Server, s3_bucket: str, pg_server: PostgresServer, pg_db: str, s3_env: dict[str, str],
        tmp_path: Path) -> None:
    landing, cfg = setup(s3_server, s3_bucket, pg_server, pg_db, tmp_path, runs=1)
    target = f"s3a://{s3_bucket}/target"
    # without a catalog: refused, naming the ones that work (the default SQLite file cannot be on the store)
    refused, refused_log = consumer(tmp_path, s3_env, landing, target, "iceberg", "--once", name="refused")
    code, out = finished(refused, refused_log, 600)
    assert code == 2 and "JDBC catalog on PostgreSQL" in out, out[-3000:]
    # the catalog as an operator gives it: spark-defaults.conf (or --conf), its database on the test's PostgreSQL
    catalog_db = f"{pg_db}_catalog"
    pg_server.psql(f"CREATE DATABASE {catalog_db}")
    conf = tmp_path / "spark-conf"
    conf.mkdir()
    prefix = "spark.sql.catalog.cdcd"
    (conf / "spark-defaults.conf").write_text(
        f"{prefix} org.apache.iceberg.spark.SparkCatalog\n{prefix}.type jdbc\n"
        f"{prefix}.uri jdbc:postgresql://127.0.0.1:{pg_server.port}/{catalog_db}\n{prefix}.jdbc.user postgres\n"
        f"{prefix}.jdbc.schema-version V1\n{prefix}.warehouse {target}\n")
    env = {**s3_env, "SPARK_CONF_DIR": str(conf)}
    run, run_log = consumer(tmp_path, env, landing, target, "iceberg", "--once")
    code, out = finished(run, run_log, 600)
    assert code == 0, out[-3000:]
    namespaces = pg_server.psql("SELECT DISTINCT table_namespace FROM iceberg_tables ORDER BY 1", catalog_db)
    assert "changelog.public" in namespaces and "tables.public" in namespaces, namespaces
    stored = keys(s3_server, s3_bucket, "target/")
    assert any("/metadata/" in k for k in stored) and any(k.endswith(".parquet") for k in stored), stored[:20]
    assert f"target/state/commits/{max(reader.landed_seqs(landing)):020d}.json" in stored
    verify(cfg, target, env)
