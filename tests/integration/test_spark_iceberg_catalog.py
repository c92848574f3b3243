"""Iceberg's Hadoop catalog given as the job's catalog `cdcd` is refused (exit 2): its commits are not atomic
(a rename of the metadata file), so two commits could both succeed and one be lost (docs/spark.md)."""

from __future__ import annotations

from pathlib import Path

import pytest
from pyspark.sql import SparkSession

from cdcd.logging import configure_logging
from cdcd.spark.iceberg import Iceberg
from cdcd.spark.job import run

PREFIX = "spark.sql.catalog.cdcd"


@pytest.mark.parametrize(("key", "value"), [("type", "hadoop"),
                                            ("catalog-impl", "org.apache.iceberg.hadoop.HadoopCatalog")])
def test_a_hadoop_catalog_is_refused(spark: SparkSession, tmp_path: Path, key: str, value: str,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    landing, target = tmp_path / "landing", tmp_path / "target"
    landing.mkdir()
    spark.conf.set(PREFIX, "org.apache.iceberg.spark.SparkCatalog")
    spark.conf.set(f"{PREFIX}.{key}", value)
    spark.conf.set(f"{PREFIX}.warehouse", (tmp_path / "warehouse").as_uri())
    problem = Iceberg(target).check_target(spark)
    assert problem is not None and f"Hadoop catalog ({PREFIX}.{key}={value})" in problem and "type=jdbc" in problem
    configure_logging("info", "json", stream="stderr")
    assert run(str(landing), str(target), once=True, fmt="iceberg") == 2
    assert "Hadoop catalog" in capsys.readouterr().err
    # refused before anything was written: the target holds the consumer's lock file alone (taken first, so that a
    # second consumer is refused before its JVM starts)
    assert sorted(p.name for p in target.rglob("*")) == ["consumer.lock", "state"]


def test_a_jdbc_catalog_given_with_conf_is_used_as_it_is(spark: SparkSession, tmp_path: Path) -> None:
    spark.conf.set(PREFIX, "org.apache.iceberg.spark.SparkCatalog")
    spark.conf.set(f"{PREFIX}.type", "jdbc")
    spark.conf.set(f"{PREFIX}.uri", f"jdbc:sqlite:{tmp_path / 'given.db'}")
    spark.conf.set(f"{PREFIX}.warehouse", (tmp_path / "warehouse").as_uri())
    assert Iceberg(tmp_path / "target").check_target(spark) is None
    assert spark.conf.get(f"{PREFIX}.uri") == f"jdbc:sqlite:{tmp_path / 'given.db'}"  # not replaced by the job's
