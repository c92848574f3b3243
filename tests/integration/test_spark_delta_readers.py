"""``--delta-readers``: Delta mirrors that delta-rs (and so pandas, DuckDB, Polars) opens, beside the default ones.

The same landed batches merged into two targets, one per setting; delta-rs reads each as it can, and what it
reads equals what Spark reads.
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from deltalake import DeltaTable
from pyspark.sql import SparkSession
from test_spark_consumer import COLS, T, ev, history, land, row

from cdcd.events import Column, Op, TableSchema
from cdcd.spark.delta import READERS_ENV

pytestmark = pytest.mark.spark
#: ``note`` added (V2 of the consumer's history), then ``big`` dropped: a drop needs column mapping.
V3 = TableSchema(T, (*(c for c in COLS if c.name != "big"), Column("note", pa.string(), "text")), ("id",), version=3)


def _same(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Sorted by key, instants as UTC seconds: Spark gives a naive local time, delta-rs an aware one."""
    def value(v: Any) -> Any:
        return v.timestamp() if isinstance(v, datetime) else v
    return sorted(({k: value(v) for k, v in r.items()} for r in rows), key=lambda r: r["id"])


def spark_rows(spark: SparkSession, path: Path) -> list[dict[str, Any]]:
    return _same([r.asDict() for r in spark.read.format("delta").load(str(path)).collect()])


def rs_rows(path: Path) -> list[dict[str, Any]]:
    return _same(DeltaTable(str(path)).to_pyarrow_table().to_pylist())


def features(path: Path) -> set[str]:
    return set(DeltaTable(str(path)).protocol().reader_features or ())


async def test_mirrors_for_any_reader_open_in_delta_rs(spark: SparkSession, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from cdcd.spark.job import run

    h = history()
    for setting in ("any", "spark"):
        monkeypatch.setenv(READERS_ENV, setting)
        await land(tmp_path / setting / "landing", h, [1, 2, 3, 4, 5])
        assert run(str(tmp_path / setting / "landing"), str(tmp_path / setting / "target"), once=True) == 0
    portable = tmp_path / "any" / "target" / "tables" / "public.orders"
    default = tmp_path / "spark" / "target" / "tables" / "public.orders"

    # --delta-readers any: no deletion vectors, no column mapping (no drop yet), no type widening
    assert not features(portable) & {"deletionVectors", "columnMapping", "typeWidening"}
    assert rs_rows(portable) == spark_rows(spark, portable)
    assert {r["id"] for r in rs_rows(portable)} == {1, 2, 3, 40}
    log = tmp_path / "any" / "target" / "changelog" / "public.orders"
    assert len(DeltaTable(str(log)).to_pyarrow_table()) == spark.read.format("delta").load(str(log)).count()

    # the default: delta-rs refuses to read it at all (type widening, deletion vectors, column mapping)
    with pytest.raises(Exception, match="not yet supported") as refused:
        rs_rows(default)
    assert "deletionVectors" in str(refused.value)
    with pytest.raises(Exception, match="TypeWidening"):
        DeltaTable(str(default)).scan()
    assert features(default) >= {"deletionVectors", "columnMapping", "typeWidening"}

    # a dropped column switches column mapping on for that mirror only (Delta cannot drop without it): reader
    # version 2, which delta-rs opens too
    monkeypatch.setenv(READERS_ENV, "any")
    await land(tmp_path / "any" / "landing", [[ev(Op.CREATE, 700, 1, schema=V3, after=_v3(7))]], [6])
    assert run(str(tmp_path / "any" / "landing"), str(tmp_path / "any" / "target"), once=True) == 0
    table = DeltaTable(str(portable))
    assert table.metadata().configuration["delta.columnMapping.mode"] == "name"
    assert table.protocol().min_reader_version == 2 and not features(portable)
    assert "big" not in spark_rows(spark, portable)[0]
    assert rs_rows(portable) == spark_rows(spark, portable)
    assert {r["id"] for r in spark_rows(spark, portable)} == {1, 2, 3, 7, 40}


def _v3(i: int) -> dict[str, object]:
    r = row(i)
    del r["big"]
    return {**r, "note": "v3"}
