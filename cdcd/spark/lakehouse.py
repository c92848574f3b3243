"""Delta Lake / Iceberg targets: only usable when their jars are on Spark's classpath."""

from __future__ import annotations

from pyspark.sql import SparkSession

_MARKER_CLASS = {
    "delta": ("io.delta.sql.DeltaSparkSessionExtension", "--packages io.delta:delta-spark_2.13:<version>"),
    "iceberg": (
        "org.apache.iceberg.spark.SparkCatalog",
        "--packages org.apache.iceberg:iceberg-spark-runtime-4.0_2.13:<version>",
    ),
}


def check_format(spark: SparkSession, fmt: str) -> str | None:
    """None when ``fmt``'s classes load, else what to do about it."""
    cls, packages = _MARKER_CLASS[fmt]
    jvm = spark._jvm
    try:
        assert jvm is not None
        jvm.java.lang.Class.forName(cls)
    except Exception:
        return f"--format {fmt}: {cls} is not on Spark's classpath; start the job with {packages} (docs/spark.md)"
    return f"--format {fmt}: the {fmt} MERGE INTO target is not built in this version; use --format parquet"
