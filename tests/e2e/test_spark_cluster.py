"""The consumer on a real Spark standalone cluster: PostgreSQL -> `cdcd run` -> landing zone ->
`spark-submit --master spark://...` (a master and a worker, tests/conftest.py `spark_cluster`) -> `cdcd verify`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from support.landed import landed_ids
from support.waits import wait_for

import cdcd.spark.consumer
from cdcd.spark import jars
from cdcd.spark.session import JAVA_OPTIONS
from devtools.servers import PostgresServer, SparkCluster, free_port

CDCD = str(Path(sys.executable).with_name("cdcd"))
SPARK_SUBMIT = str(Path(sys.executable).with_name("spark-submit"))


def daemon_config(tmp_path: Path, pg: PostgresServer, db: str, landing: str) -> Path:
    cfg = tmp_path / "cdcd.toml"
    cfg.write_text(f"""[source]
kind = "postgres"
port = {pg.port}
user = "postgres"
database = "{db}"
tables = ["public.orders"]
[source.postgres]
slot = "s_{db}"
publication = "p_{db}"
[state]
path = "{tmp_path / 'state'}"
[landing]
path = "{landing}"
max_batch_events = 50
max_batch_delay_ms = 50
[http]
listen = "127.0.0.1:{free_port()}"
[log]
format = "json"
""")
    return cfg


def land(pg: PostgresServer, db: str, cfg: Path, landing: Path) -> None:
    """A snapshot, then inserts, updates, a key change and deletes streamed, until the sentinel row landed."""
    pg.psql("CREATE TABLE orders (id int PRIMARY KEY, amount numeric(10,2), note text);"
            "INSERT INTO orders SELECT g, g * 1.5, 'snap' FROM generate_series(1, 40) g;", db)
    with open(cfg.parent / "daemon.log", "wb") as log:
        daemon = subprocess.Popen([CDCD, "run", "-c", str(cfg)], stdout=log, stderr=subprocess.STDOUT)
    try:
        pg.psql("INSERT INTO orders SELECT g, g, 'stream' FROM generate_series(100, 159) g;"
                "UPDATE orders SET amount = amount + 1, note = 'updated' WHERE id % 3 = 0;"
                "UPDATE orders SET id = id + 1000 WHERE id BETWEEN 100 AND 104;"
                "DELETE FROM orders WHERE id BETWEEN 10 AND 14;"
                "INSERT INTO orders VALUES (9001, 0, 'sentinel');", db)
        wait_for("the sentinel row to land", lambda: 9001 in landed_ids(landing), procs=daemon,
                 log=cfg.parent / "daemon.log")
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(timeout=60)


def submit(cluster: SparkCluster, landing: str, target: str, *conf: str) -> str:
    """`spark-submit --master spark://...` the consumer with the cached Delta Lake jars (as --jars); its output."""
    found = jars.cached_jars(jars.DELTA_PACKAGES)
    assert found is not None, "run scripts/bootstrap.sh: it fetches the jars"
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable}
    proc = subprocess.run(
        [SPARK_SUBMIT, "--master", cluster.url, "--name", "cdcd-on-the-cluster",
         "--jars", ",".join(str(p) for p in found), "--driver-memory", "1g", "--executor-memory", "1g",
         "--conf", "spark.sql.shuffle.partitions=2", "--conf", "spark.databricks.delta.snapshotPartitions=2",
         "--conf", "spark.ui.enabled=false",
         # the JVM flags of the job's local session (cdcd.spark.session.JAVA_OPTIONS): C1 only, the parallel
         # collector; measured here: the merge took 24 s instead of 123 s with the JVM's defaults
         "--conf", f"spark.executor.extraJavaOptions={JAVA_OPTIONS}", "--driver-java-options", JAVA_OPTIONS, *conf,
         cdcd.spark.consumer.__file__, "--landing", landing, "--target", target, "--format", "delta", "--once"],
        capture_output=True, text=True, env=env, timeout=600,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    return output


def test_consumer_on_a_standalone_cluster(spark_cluster: SparkCluster, pg_server: PostgresServer, pg_db: str,
                                          tmp_path: Path) -> None:
    landing, target = tmp_path / "landing", tmp_path / "target"
    cfg = daemon_config(tmp_path, pg_server, pg_db, str(landing))
    land(pg_server, pg_db, cfg, landing)

    output = submit(spark_cluster, str(landing), str(target))
    assert f'"master": "{spark_cluster.url}"' in output  # the `consumer starting` line: the cluster's master stood
    apps = [a for a in spark_cluster.status()["completedapps"] if a["name"] == "cdcd-on-the-cluster"]
    assert len(apps) == 1, spark_cluster.status()  # it ran as an application of the cluster
    # its tasks ran in an executor the worker started (the worker's work dir: app id / executor id / stderr)
    executor_log = spark_cluster.root / "work" / apps[0]["id"] / "0" / "stderr"
    assert "Finished task" in executor_log.read_text(errors="replace")

    verified = subprocess.run([CDCD, "verify", "-c", str(cfg), "--target", str(target)], capture_output=True,
                              text=True, timeout=600)
    assert verified.returncode == 0, (verified.stdout + verified.stderr)[-3000:]
