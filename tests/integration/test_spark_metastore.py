"""Tables by name (docs/spark.md "Tables by name"): ``cdcd spark run --register-tables`` registers the Delta
mirrors and change-logs in a Hive metastore that another Spark process reads them from by name; Iceberg's
tables are in its catalog ``cdcd``.

Hive support is a static session setting: the Delta test runs the consumer and the reader as processes (two
JVM starts), not in the worker's shared session.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from pyspark.sql import SparkSession
from support.spark import consume_once
from test_spark_consumer import EXPECTED_ORDERS, history, land

pytestmark = pytest.mark.spark
CDCD = str(Path(sys.executable).with_name("cdcd"))

#: Another Spark process with the same metastore settings: reads the tables by name, registers them again as a
#: second run would, and tries a name that the catalog holds over another location.
READER = """
import json, sys
from pathlib import Path
from cdcd.spark.delta import Delta
from cdcd.spark.metastore import CatalogRefused, Registrar, java_options, local_settings, location_of
from cdcd.spark.session import session, use_metastore

target, other = Path(sys.argv[1]), sys.argv[2]
use_metastore(local_settings(target), java_options(target))
spark = session("delta", only=True)
out = {"orders": sorted(r["id"] for r in spark.table("public.orders").collect()),
       "log": sorted([r["k"], r["v"]] for r in spark.table("public.log").collect())}
for t in ("orders", "log"):
    by_path = spark.read.format("delta").load(str(target.resolve() / "changelog" / f"public.{t}"))
    out[t + "_changelog"] = [spark.table(f"public.{t}_changelog").count(), by_path.count()]
out["tables"] = sorted(r["tableName"] for r in spark.sql("SHOW TABLES IN public").collect())
Registrar(spark, Delta(target)).register(["public.log", "public.orders"])  # a second run: nothing changes
out["again"] = sorted(r["tableName"] for r in spark.sql("SHOW TABLES IN public").collect())
out["orders_location"] = location_of(spark, "public.orders")
spark.range(3).write.format("delta").save(other)
spark.sql(f"CREATE TABLE public.ghost USING DELTA LOCATION '{other}'")  # the operator's table
spark.range(1).write.format("delta").save(str(target.resolve() / "tables" / "public.ghost"))
try:
    Registrar(spark, Delta(target)).register(["public.ghost"])
    out["refused"] = None
except CatalogRefused as exc:
    out["refused"] = str(exc)
out["ghost_rows"] = spark.table("public.ghost").count()
print("RESULT " + json.dumps(out))
"""


def test_delta_tables_by_name_in_another_process(tmp_path: Path, spark: SparkSession) -> None:
    landing, target = tmp_path / "landing", tmp_path / "target"
    batches = history()
    asyncio.run(land(landing, batches[:1], [1]))
    consume_once(landing, target, "delta")  # public.orders made before the option was on
    asyncio.run(land(landing, batches[1:], [2, 3, 4, 5]))  # public.log is new in batch 2
    run = subprocess.run([CDCD, "spark", "run", "--landing", str(landing), "--target", str(target), "--once",
                          "--register-tables"], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    other = tmp_path / "elsewhere"
    read = subprocess.run([sys.executable, "-c", READER, str(target), str(other)], capture_output=True, text=True,
                          timeout=600, cwd=tmp_path)
    assert read.returncode == 0, read.stderr[-3000:]
    out = json.loads(read.stdout.split("RESULT ", 1)[1])
    assert out["orders"] == sorted(EXPECTED_ORDERS)
    assert out["log"] == [[1, "new"]]
    for t in ("orders", "log"):
        by_name, by_path = out[t + "_changelog"]
        assert by_name == by_path > 0
    assert out["tables"] == out["again"] == ["log", "log_changelog", "orders", "orders_changelog"]
    assert out["orders_location"].rstrip("/").endswith(str(target / "tables" / "public.orders"))
    refused = out["refused"]
    assert refused is not None and "public.ghost" in refused and str(other) in refused
    assert str(target / "tables" / "public.ghost") in refused and "RENAME" in refused
    assert out["ghost_rows"] == 3  # the operator's table is untouched
    # the embedded metastore lives under the target, not in the working directory
    assert (target / "state" / "metastore" / "metastore_db").is_dir()
    assert not (tmp_path / "derby.log").exists() and not (tmp_path / "metastore_db").exists()

    # the target copied elsewhere, its metastore with it: the names point at the original, so the consumer's run
    # on the copy is refused with the usage exit code before a merge, naming both locations
    moved = tmp_path / "moved"
    shutil.copytree(target, moved)
    clash = subprocess.run([CDCD, "spark", "run", "--landing", str(landing), "--target", str(moved), "--once",
                            "--register-tables"], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert clash.returncode == 2, clash.stderr[-3000:]
    assert str(target / "tables" / "public.") in clash.stderr and str(moved / "tables" / "public.") in clash.stderr
    assert "never re-points or drops a table it did not register" in clash.stderr


@pytest.mark.parametrize(("fmt", "target", "refusal"), [
    # a Parquet mirror's buckets are swapped under its journal: no name over it
    ("parquet", "target", "--register-tables with --format parquet: refused"),
    # a local session's Derby file would be on one host: the cluster's metastore under spark-submit
    ("delta", "s3a://bucket/target", "run under spark-submit with the cluster's metastore"),
])
def test_register_tables_refused_before_any_jvm(tmp_path: Path, fmt: str, target: str, refusal: str) -> None:
    landing = tmp_path / "landing"
    landing.mkdir()
    where = target if "://" in target else str(tmp_path / target)
    done = subprocess.run([CDCD, "spark", "run", "--landing", str(landing), "--target", where, "--once",
                           "--format", fmt], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "CDCD_SPARK_REGISTER_TABLES": "true"})
    assert done.returncode == 2, done.stderr[-2000:]
    assert refusal in done.stderr and "Tables by name" in done.stderr
    assert not (tmp_path / "target").exists()


def test_iceberg_tables_by_name(tmp_path: Path, spark: SparkSession) -> None:
    landing, target = tmp_path / "landing", tmp_path / "target"
    asyncio.run(land(landing, history(), [1, 2, 3, 4, 5]))
    consume_once(landing, target, "iceberg")
    ids = sorted(r["id"] for r in spark.table("cdcd.tables.public.orders").collect())
    assert ids == sorted(EXPECTED_ORDERS)
    assert [(r["k"], r["v"]) for r in spark.table("cdcd.tables.public.log").collect()] == [(1, "new")]
    assert spark.table("cdcd.changelog.public.orders").count() > 0
