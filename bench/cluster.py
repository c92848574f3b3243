"""The consumer on a Spark standalone cluster next to the local one (docs/benchmarks.md, ``spark_cluster``).

The daemon lands the narrow table's inserts into ``s3://`` on a local S3 server (versitygw, devtools.s3server.S3Server);
then the same landing zone is applied twice into two new Delta targets: by ``cdcd spark run --once`` (the consumer's
own local session, ``local[2]``) and by ``spark-submit --master spark://...`` to a standalone master and one worker
started from the installed pyspark (devtools.sparkcluster.SparkCluster, ``submit_command``: the line the cluster test
and the demo submit). Each consumer reads the landing zone by its own target's commit record, so the second one reads
every batch again; the rates are events per second with the start-up (JVM, session, executor) and without it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from bench import workloads
from bench.common import Row
from bench.consumer import SPARK_FORMAT, _applied, _log_events
from bench.harness import VENV_BIN, run_daemon_until
from bench.objstore import landing_config
from devtools.s3server import S3Server
from devtools.servers import PostgresServer
from devtools.sparkcluster import SparkCluster

#: The worker offers both of the machine's cores, as the local consumer's ``local[2]`` uses them.
CLUSTER_CORES = 2
#: Seconds one consumer run may take (start-up included).
RUN_TIMEOUT_S = 3600


def _consume(command: list[str], env: dict[str, str], what: str) -> tuple[float, str]:
    """Run one consumer to the end: its seconds and its output (the consumer's JSON log lines)."""
    began = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=RUN_TIMEOUT_S)
    seconds = time.perf_counter() - began
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed (exit {proc.returncode}): {(proc.stdout + proc.stderr)[-3000:]}")
    return seconds, proc.stdout + proc.stderr


def spark_cluster(pg: PostgresServer, work: Path, sizes: dict[str, int]) -> list[Row]:
    count = sizes["cluster"]
    db = pg.create_database("bench_cluster")
    pg.psql(workloads.PG_NARROW, db)
    pg.psql("CREATE PUBLICATION cdcd FOR TABLE narrow", db)
    pg.psql("SELECT pg_create_logical_replication_slot('cluster', 'pgoutput')", db)
    workloads.pg_insert_narrow(pg, db, 1, count, 1000)
    s3 = S3Server().start()
    cluster: SparkCluster | None = None
    try:
        s3.create_bucket("bench")
        # the default batching: batches as the daemon lands a catching-up stream (the ``spark`` measure's)
        config = landing_config(pg, db, work / "daemon", "cluster", s3, batch_delay_ms=None)
        run_daemon_until(config, work / "daemon", count)
        landing = "s3://bench/cluster"
        # the store's endpoint and keys as boto3 (the landing reader) and the consumer's S3A settings read them
        env = {**os.environ, "AWS_ENDPOINT_URL": s3.endpoint, "AWS_REGION": s3.region,
               "AWS_ACCESS_KEY_ID": s3.access_key, "AWS_SECRET_ACCESS_KEY": s3.secret_key,
               "PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable}
        command = [str(VENV_BIN / "cdcd"), "spark", "run", "--once", "--format", SPARK_FORMAT, "--landing", landing,
                 "--target", str(work / "local")]
        local_s, local_log = _consume(command, env, "the local consumer")
        cluster = SparkCluster(cores=CLUSTER_CORES).start()
        remote_s, remote_log = _consume(cluster.submit_command(landing, str(work / "cluster"), SPARK_FORMAT,
                                                               name="cdcd-bench"), env, "the consumer on the cluster")
    finally:
        if cluster is not None:
            cluster.stop()
        s3.stop()
    local, remote = _applied(local_log), _applied(remote_log)
    for who, applied, log in (("local", local, local_log), ("cluster", remote, remote_log)):
        if applied is None or applied[0] != count:
            raise RuntimeError(f"the {who} consumer did not report {count} events applied: {log[-3000:]}")
    assert local is not None and remote is not None
    row: Row = {
        "measure": f"Spark consumer ({SPARK_FORMAT}) on a standalone cluster (spark-submit, one worker with "
                   f"{CLUSTER_CORES} cores), events applied from object storage (local S3 server)",
        "unit": "events/s", "cdcd": round(count / remote_s, 1), "cdcd_seconds": round(remote_s, 2), "items": count,
        "baseline": "the local consumer (cdcd spark run --once, local[2]) over the same landing zone; "
                    "both include Spark start-up",
        "baseline_rate": round(count / local_s, 1), "baseline_seconds": round(local_s, 2),
        "ratio": round(local_s / remote_s, 3),
        "applied_rate": round(count / remote[1], 1), "applied_seconds": round(remote[1], 2),
        "applied_ratio": round(local[1] / remote[1], 3),
        "notes": [f"the local consumer without start-up: {count / local[1]:,.0f} events/s ({local[1]:.2f} s "
                  f"in merges); merges: {len(_log_events(remote_log, 'merge applied'))} on the cluster, "
                  f"{len(_log_events(local_log, 'merge applied'))} local"],
    }
    return [row]
