"""`spark-submit cdcd/spark/consumer.py`: the job runs with the master spark-submit was given."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.dataset as ds
import pytest

import cdcd.spark.consumer
from cdcd.events import ChangeEvent, Column, Op, TableId, TableSchema
from cdcd.positions import PgPosition
from cdcd.runtime.interfaces import Batch
from cdcd.sinks.landing import LandingSink, consumed_seqs

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
    landing, target = tmp_path / "landing", tmp_path / "target"
    asyncio.run(_land(landing))
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable}
    proc = subprocess.run(
        [SPARK_SUBMIT, "--master", "local[1]", cdcd.spark.consumer.__file__,
         "--landing", str(landing), "--target", str(target), "--once"],
        capture_output=True, text=True, env=env, timeout=300,
    )
    output = proc.stdout + proc.stderr  # spark-submit passes the Python driver's stderr on to its stdout
    assert proc.returncode == 0, output[-3000:]
    # the consumer's own local default is local[2]: seeing local[1] means spark-submit's choice stood
    assert "Spark master local[1]" in output
    assert consumed_seqs(landing) == [1]
    mirror = ds.dataset(str(target / "tables" / "public.items"), format="parquet").to_table()
    assert sorted(mirror.column("id").to_pylist()) == [1, 2, 3]
