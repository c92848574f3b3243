"""`spark-submit cdcd/spark/consumer.py`: the job runs with the master spark-submit was given."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pytest

import cdcd.spark.consumer
from cdcd.events import ChangeEvent, Column, Op, TableId, TableSchema
from cdcd.landing.reader import consumed_seqs
from cdcd.positions import PgPosition
from cdcd.runtime.interfaces import Batch
from cdcd.sinks.landing import LandingSink
from cdcd.spark import jars
from cdcd.verify.mirror import read_table

pytestmark = pytest.mark.spark

SPARK_SUBMIT = str(Path(sys.executable).with_name("spark-submit"))
ITEMS = TableSchema(TableId("public", "items"), (Column("id", pa.int64(), "bigint", nullable=False),
                                                 Column("v", pa.string(), "text")), ("id",))


async def _land(landing: Path) -> None:
    sink = LandingSink(landing)
    await sink.open()
    events = [ChangeEvent(Op.CREATE, ITEMS, PgPosition(100, i), after={"id": i, "v": f"v{i}"}, tx_id="1")
              for i in range(1, 4)]
    await sink.deliver(Batch(1, list(events)))
    await sink.close()


def test_spark_submit_keeps_its_master(tmp_path: Path) -> None:
    """Run as docs/spark.md tells spark-submit users, with the cached jars as --jars instead of --packages."""
    landing, target = tmp_path / "landing", tmp_path / "target"
    asyncio.run(_land(landing))
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable}
    found = jars.cached_jars(jars.DELTA_PACKAGES)
    assert found is not None, "run scripts/bootstrap.sh: it fetches the jars"
    proc = subprocess.run(
        [SPARK_SUBMIT, "--master", "local[1]", "--jars", ",".join(str(p) for p in found),
         "--conf", f"spark.sql.extensions={jars.DELTA_EXTENSION}",
         "--conf", f"spark.sql.catalog.spark_catalog={jars.DELTA_CATALOG}",
         cdcd.spark.consumer.__file__, "--landing", str(landing), "--target", str(target), "--once"],
        capture_output=True, text=True, env=env, timeout=300,
    )
    output = proc.stdout + proc.stderr  # spark-submit passes the Python driver's stderr on to its stdout
    assert proc.returncode == 0, output[-3000:]
    # the consumer's own local default is local[2]: seeing local[1] means spark-submit's choice stood
    assert '"master": "local[1]"' in output  # the `consumer starting` line (JSON: not a TTY)
    assert consumed_seqs(landing) == [1]
    assert (target / "state" / "format").read_text().strip() == "delta"  # the default format
    mirror = read_table(target, "public.items")
    assert mirror is not None and sorted(mirror.column("id").to_pylist()) == [1, 2, 3]
