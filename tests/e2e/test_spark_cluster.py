"""The consumer on a real Spark standalone cluster with the landing zone and the tables on object storage:
PostgreSQL -> `cdcd run` -> s3:// landing zone on the S3 server (tests/conftest.py `s3_server`) -> `spark-submit
--master spark://...` (a master and a worker, `spark_cluster`) into Delta Lake tables at s3a:// on the same
server, registered by name in a metastore database the cluster's jobs share (a Derby network server) ->
`cdcd verify --target s3a://...`, and the tables read by name from another Spark process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.s3 import client, keys, pg_daemon_config
from support.waits import wait_for

from cdcd.landing import reader
from cdcd.landing.objstore import Settings
from devtools.derby import DerbyServer
from devtools.s3server import S3Server
from devtools.servers import PostgresServer
from devtools.sparkcluster import SparkCluster

CDCD = str(Path(sys.executable).with_name("cdcd"))
SPARK_SUBMIT = str(Path(sys.executable).with_name("spark-submit"))


def daemon_config(tmp_path: Path, pg: PostgresServer, db: str, landing: str, s3: S3Server) -> Path:
    return pg_daemon_config(tmp_path, pg, db, landing, s3, ["public.orders"], 50)


def landed_ids(landing: str) -> set[int]:
    return {r["id"] for b in reader.read_batches(landing) for t in b.tables.values() for r in t.to_pylist()}


def land(pg: PostgresServer, db: str, cfg: Path, landing: str) -> None:
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


def store_env(s3: S3Server) -> dict[str, str]:
    """The store's endpoint and keys in the environment, as boto3, S3A and the consumer read them."""
    return {**os.environ, "PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable,
            "AWS_ENDPOINT_URL": s3.endpoint, "AWS_REGION": s3.region, "AWS_ACCESS_KEY_ID": s3.access_key,
            "AWS_SECRET_ACCESS_KEY": s3.secret_key}


def submit(cluster: SparkCluster, s3: S3Server, landing: str, target: str, metastore: DerbyServer,
           warehouse: str, s3a: dict[str, str]) -> str:
    """`spark-submit --master spark://...` the consumer (``SparkCluster.submit_command``) with the store in its
    environment (``store_env``), registering its tables in the metastore database; its output."""
    env = store_env(s3)
    command = cluster.submit_command(landing, target, name="cdcd-on-the-cluster",
                                     settings={**metastore.session_conf("metastore", warehouse), **s3a},
                                     driver_jars=(metastore.client_jar,), args=("--register-tables",))
    proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    assert s3.secret_key not in output  # the keys are never logged
    return output


#: Another Spark process with the same metastore database: the tables by name, as the cluster's other jobs read
#: them.
READER = """
import json, sys
from pyspark.sql import SparkSession
from cdcd.spark import jars
from cdcd.spark.session import object_store_conf
settings = {**jars.local_settings("delta", object_store=True), **json.loads(sys.argv[1])}
settings["spark.driver.extraClassPath"] += ":" + sys.argv[2]
b = SparkSession.builder.master("local[1]").config("spark.ui.enabled", "false")
for k, v in settings.items():
    b = b.config(k, v)
spark = b.getOrCreate()
object_store_conf(spark)
print("RESULT " + json.dumps({"tables": sorted(r["tableName"] for r in spark.sql("SHOW TABLES IN public").collect()),
                              "ids": sorted(r["id"] for r in spark.table("public.orders").collect()),
                              "changes": spark.table("public.orders_changelog").count()}))
"""


@pytest.fixture
def metastore() -> Iterator[DerbyServer]:
    server = DerbyServer().start()
    try:
        yield server
    finally:
        server.stop()


def test_consumer_on_a_standalone_cluster_from_object_storage(
        spark_cluster: SparkCluster, s3_server: S3Server, s3_bucket: str, pg_server: PostgresServer, pg_db: str,
        metastore: DerbyServer, tmp_path: Path) -> None:
    landing, target = f"s3://{s3_bucket}/landing", f"s3a://{s3_bucket}/target"
    reader.use_store(landing, Settings(endpoint=s3_server.endpoint, region=s3_server.region,
                                       access_key_id=s3_server.access_key, secret_access_key=s3_server.secret_key))
    cfg = daemon_config(tmp_path, pg_server, pg_db, landing, s3_server)
    land(pg_server, pg_db, cfg, landing)

    # the metastore's Hive client checks the tables' locations with the Hadoop settings the session starts with:
    # S3A's endpoint there, as a cluster's spark-defaults.conf has it (the keys come from the environment)
    s3a = {"spark.hadoop.fs.s3a.endpoint": s3_server.endpoint, "spark.hadoop.fs.s3a.path.style.access": "true",
           "spark.hadoop.fs.s3a.endpoint.region": s3_server.region}
    warehouse = f"s3a://{s3_bucket}/warehouse"
    output = submit(spark_cluster, s3_server, landing, target, metastore, warehouse, s3a)
    assert f'"master": "{spark_cluster.url}"' in output  # the `consumer starting` line: the cluster's master stood
    assert f'"landing": "{landing}"' in output
    apps = [a for a in spark_cluster.status()["completedapps"] if a["name"] == "cdcd-on-the-cluster"]
    assert len(apps) == 1, spark_cluster.status()  # it ran as an application of the cluster
    # its tasks ran in an executor the worker started (the worker's work dir: app id / executor id / stderr)
    executor_log = spark_cluster.root / "work" / apps[0]["id"] / "0" / "stderr"
    assert "Finished task" in executor_log.read_text(errors="replace")
    assert reader.consumed_seqs(landing) == reader.landed_seqs(landing)  # consumed markers written to the store
    stored = keys(s3_server, s3_bucket, "target/")
    for kind in ("tables", "changelog"):  # Spark wrote every table file: landed files on a store are not adopted
        files = [k.rsplit("/", 1)[1] for k in stored if k.startswith(f"target/{kind}/public.orders/")
                 and k.endswith(".parquet")]
        assert files and all(f.startswith("part-") for f in files), files
    last = max(reader.landed_seqs(landing))
    assert f"target/state/commits/{last:020d}.json" in stored  # the consumer's record, on the store too
    newest = max(k for k in stored if k.startswith("target/state/lease/"))  # the lease: released at the end
    assert json.loads(client(s3_server).get_object(Bucket=s3_bucket, Key=newest)["Body"].read())["expires"] == 0
    assert not (tmp_path / "target").exists() and not Path("s3a:").exists()  # nothing on a local disk

    verified = subprocess.run([CDCD, "verify", "-c", str(cfg), "--target", target], capture_output=True,
                              text=True, timeout=600, env=store_env(s3_server))
    assert verified.returncode == 0, (verified.stdout + verified.stderr)[-3000:]

    # the tables by name from another Spark process on the same metastore database (docs/spark.md, Tables by name)
    read = subprocess.run([sys.executable, "-c", READER,
                           json.dumps({**metastore.session_conf("metastore", warehouse), **s3a}),
                           str(metastore.client_jar)], capture_output=True, text=True, timeout=600,
                          env=store_env(s3_server), cwd=tmp_path)
    assert read.returncode == 0, read.stderr[-3000:]
    out = json.loads(read.stdout.split("RESULT ", 1)[1])
    assert out["tables"] == ["orders", "orders_changelog"]
    source = pg_server.psql("SELECT id FROM orders ORDER BY id", pg_db).split()
    assert out["ids"] == [int(i) for i in source] and out["changes"] > len(source)
