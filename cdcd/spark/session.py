"""The Spark session of the job and of ``cdcd verify``'s Delta Lake / Iceberg reader, built in one place.

Started locally (``cdcd spark run``, tests), the session gets ``local[2]``, the
cached Delta Lake / Iceberg jars and both formats' settings
(``cdcd.spark.jars.local_settings``) and the heap for large rows. Under
spark-submit, the master and ``--conf`` values spark-submit was given stand; a
Delta Lake or Iceberg run adds its format's extension to them before the
session starts (the jars come from ``--packages`` or ``--jars``).
"""

from __future__ import annotations

import os
import sys

from pyspark import SparkConf, SparkContext
from pyspark.sql import SparkSession

from cdcd.spark import cds, jars
from cdcd.spark.jars import local_settings

#: Session settings of each table format, fixed when the session starts (Spark refuses to change them later).
FORMAT_SETTINGS = {
    "delta": {"spark.sql.extensions": jars.DELTA_EXTENSION, "spark.sql.catalog.spark_catalog": jars.DELTA_CATALOG},
    "iceberg": {"spark.sql.extensions": jars.ICEBERG_EXTENSION},
}


def log(message: str) -> None:
    """The job's log line (stderr, where spark-submit and `cdcd spark run` show it)."""
    print(f"cdcd-spark: {message}", file=sys.stderr, flush=True)


def under_spark_submit() -> bool:
    """True when spark-submit started the JVM: its --master and --conf values must stand."""
    return "PYSPARK_GATEWAY_PORT" in os.environ


#: JVM flags of a local session (``CDCD_SPARK_JAVA_OPTIONS`` replaces them; docs/spark.md, performance).
#: C1 only: a merge runs a wide variety of code (planning, Delta's log, code generated per statement) a few
#: times, and the C2 compiler spent more CPU compiling it than its code saved (a third of the JVM's CPU in a
#: one-shot run of a million events). The parallel collector: less CPU than G1 on two cores.
JAVA_OPTIONS = "-XX:TieredStopAtLevel=1 -XX:+UseParallelGC"


def large_row_settings() -> dict[str, str]:
    """Local-session settings that let one row hold a value of tens of MB (docs/spark.md, memory).

    The JVM heap is fixed when the local session starts: ``CDCD_SPARK_DRIVER_MEMORY`` (default 2g,
    Spark's own default of 1g runs out on a 51 MB value). Under spark-submit, pass them as --conf.
    The JVM's flags too (``CDCD_SPARK_JAVA_OPTIONS``, default ``JAVA_OPTIONS``), and the class-data
    sharing archive when the bootstrap built one (``cdcd.spark.cds``).
    """
    flags = " ".join(f for f in (os.environ.get("CDCD_SPARK_JAVA_OPTIONS", JAVA_OPTIONS), cds.java_options()) if f)
    return {"spark.driver.memory": os.environ.get("CDCD_SPARK_DRIVER_MEMORY", "2g"),
            "spark.kryoserializer.buffer.max": "1g",
            "spark.driver.extraJavaOptions": flags}


def _submitted_session(fmt: str) -> None:
    """Start spark-submit's session with the format's settings added to the ones given with ``--conf``."""
    SparkContext._ensure_initialized()  # attaches to spark-submit's JVM, so that SparkConf() shows its values
    conf = SparkConf()
    builder = SparkSession.builder
    for k, v in FORMAT_SETTINGS[fmt].items():
        have = conf.get(k, "") or ""
        if k == "spark.sql.extensions" and have and v not in have.split(","):
            v = f"{have},{v}"
        elif have:
            v = have
        builder = builder.config(k, v)
    builder.getOrCreate()


def session(fmt: str = "parquet", only: bool = False) -> SparkSession:
    """The active session; under spark-submit the one it configured, else a local one.

    ``fmt`` (``delta``, ``iceberg``) adds that format's settings to a session that
    spark-submit starts; a local session has both formats' settings, or with ``only``
    (a process that serves ``fmt`` alone: ``cdcd spark run``) that format's alone,
    which starts faster.
    """
    if SparkSession.getActiveSession() is None and under_spark_submit() and fmt in FORMAT_SETTINGS:
        _submitted_session(fmt)
    builder = SparkSession.builder.appName("cdcd-spark-consumer")
    if SparkSession.getActiveSession() is None and not under_spark_submit():
        builder = (builder.master("local[2]").config("spark.ui.enabled", "false")
                   .config("spark.sql.shuffle.partitions", "4"))
        # the cached Delta Lake / Iceberg jars (cdcd/spark/jars.py) and the heap for large rows
        for k, v in {**local_settings(fmt if only else None), **large_row_settings()}.items():
            builder = builder.config(k, v)
    spark = builder.getOrCreate()
    # the mirror must read back with pyarrow: no INT96, instants in UTC
    spark.conf.set("spark.sql.parquet.outputTimestampType", "TIMESTAMP_MICROS")
    spark.conf.set("spark.sql.session.timeZone", "UTC")
    # Parquet writes: a column's values are dictionary-encoded until the dictionary reaches this size, then
    # re-encoded plain. Positions, keys and most text values are unique: Parquet's default of 1 MB spent a
    # tenth of a merge's CPU building dictionaries it then dropped; columns of few values keep theirs
    spark.conf.set("parquet.dictionary.page.size", "65536")
    # a merge reads one landed file per batch: list them on the driver instead of in a Spark job
    spark.conf.set("spark.sql.sources.parallelPartitionDiscovery.threshold", "1000000")
    return spark
