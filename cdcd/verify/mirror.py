"""Read a mirror or change-log table of the target, whatever its format.

Parquet with pyarrow; Delta Lake and Iceberg through Spark, with the job's own
session and catalog settings (the format's strategy, ``cdcd.spark.formats``), imported only then.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.dataset as ds

from cdcd.errors import MirrorUnreadable
from cdcd.landing.objstore import is_object_url, zone_name
from cdcd.spark.objtarget import read_state
from cdcd.verify.source import SourceColumn


def target_format(target: Path) -> str:
    """The target's table format: TARGET/state/format (Delta Lake, Iceberg), else the Parquet mirror (never on
    object storage, where the consumer writes Delta Lake or Iceberg only)."""
    marker = read_state(target, "format")
    if marker is None and is_object_url(target):
        raise MirrorUnreadable(f"{zone_name(target)} holds no target of cdcd spark run (no state/format object): "
                               "give the consumer's --target")
    return marker.strip() if marker is not None else "parquet"


def read_table(target: Path, table: str, kind: str = "tables") -> pa.Table | None:
    """A mirror (``tables``) or change-log (``changelog``) of any format as an Arrow table; None when absent.

    Parquet with pyarrow; Delta Lake and Iceberg through Spark with the job's own
    session and catalog settings (the format's strategy, ``cdcd.spark.formats``).
    """
    fmt = target_format(target)
    if fmt == "parquet":
        path = target / kind / table
        return ds.dataset(path).to_table() if path.is_dir() else None
    frame = lakehouse_frame(target, fmt, table, kind)
    return None if frame is None else frame.toArrow()


def lakehouse_frame(target: Path, fmt: str, table: str, kind: str = "tables") -> Any:
    """A Delta Lake or Iceberg table as a Spark DataFrame (None when absent), read with the job's own session
    and catalog settings (the format's strategy, ``cdcd.spark.formats``)."""
    from cdcd.spark.formats import lakehouse_format

    names = lakehouse_format(fmt, target)
    problem = names.prepare_run()
    if problem is not None:
        raise ValueError(problem)
    from pyspark.sql import SparkSession

    # the session prepare_run started; another thread of the process (a test) finds it through the builder
    spark = SparkSession.getActiveSession() or SparkSession.builder.getOrCreate()
    schema, name = table.split(".", 1)
    if not names.exists(spark, kind, schema, name):
        return None
    return spark.table(names.ref(kind, schema, name))


def arrow_rows(data: pa.Table, columns: list[SourceColumn]) -> list[list[Any]]:
    """An Arrow table's rows as lists in the source's column order (a column the mirror lacks: NULL)."""
    have = set(data.column_names)
    cols = [data.column(c.name).to_pylist() if c.name in have else [None] * data.num_rows for c in columns]
    return [list(r) for r in zip(*cols, strict=True)] if cols else []


def read_mirror(target: Path, table: str, columns: list[SourceColumn]) -> list[list[Any]]:
    data = read_table(target, table)
    return [] if data is None else arrow_rows(data, columns)


def spark_running() -> bool:
    """A Spark session of this process is running (its caller's: a notebook, a test's shared session)."""
    if "pyspark" not in sys.modules:
        return False
    from pyspark import SparkContext

    return SparkContext._active_spark_context is not None


@contextlib.contextmanager
def spark_ended_after() -> Iterator[None]:
    """Reading Delta Lake or Iceberg mirrors inside may start a Spark session: it is stopped at the end and its
    local JVM ended (bounded), so the command leaves nothing running when it returns (the JVM would otherwise
    exit only after this process, on its own). A session that ran before is its caller's and is left running."""
    ours = not spark_running()
    try:
        yield
    finally:
        if ours and spark_running():
            _end_spark()


def _end_spark() -> None:
    from pyspark.sql import SparkSession

    from cdcd.spark.session import stop_local
    from cdcd.spark.stopping import JVM_EXIT_S

    spark = SparkSession.getActiveSession()
    if spark is not None:
        stop_local(spark, JVM_EXIT_S)
