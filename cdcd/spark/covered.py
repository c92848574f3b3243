"""Completed re-snapshots (the manifests' ``covered`` records) applied to the mirror, in every format.

A record says: every row the source still has was landed at a position at or above ``below``
(docs/landing-format.md), so the table's mirror rows with ``_cdc_pos < below`` were deleted
behind cdcd's back and go. It is the truncate rule with a threshold that is not the record's own
position, applied after the segment's events (a segment is one daemon run, whose positions
increase, so every event after the record is above ``below`` and nothing it writes is removed).
The change-log gets nothing: it holds what the source sent, and the source sent no delete.
"""

from __future__ import annotations

import uuid
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from cdcd.landing.reader import Covered, covered_tables
from cdcd.spark import lakehouse_sql as sql
from cdcd.spark.state import TableState
from cdcd.spark.strategy import Segment

if TYPE_CHECKING:
    from cdcd.spark.lakehouse import Names

#: The step name of the covered delete in the tables' own commit records (Delta appId ``cdcd-covered``).
STEP = "covered"


def covered(segment: Segment) -> dict[tuple[str, str], Covered]:
    """The segment's covered records per (schema, table)."""
    return covered_tables(segment.batches)


def threshold(truncate_pos: str | None, below: str | None) -> str | None:
    """The one position below which a table's mirror rows go: a truncate's, a covered record's, the higher."""
    if truncate_pos is None or below is None:
        return truncate_pos if below is None else below
    return max(truncate_pos, below)


def apply_lakehouse(spark: SparkSession, names: Names, segment: Segment) -> None:
    """``DELETE FROM mirror WHERE _cdc_pos < below`` per covered table (Delta, Iceberg).

    Runs after the tables' MERGEs. Idempotent by construction (a second run finds no row below);
    on Delta the commit also records the batch seq (appId ``cdcd-covered``), so a repeat after a
    crash before the job's journal is skipped by Delta itself. A table that has no mirror yet
    has nothing to remove.
    """
    from cdcd.spark.lakehouse import recorded  # lakehouse imports this module: no cycle at load time

    for (schema, table), c in sorted(covered(segment).items()):
        if not names.exists(spark, "tables", schema, table):
            continue
        with recorded(spark, names.fmt, STEP, c.seq):
            spark.sql(sql.truncate_before(names.mirror(schema, table), c.below))


def rewrite_parquet(spark: SparkSession, table_dir: Path, prev: TableState, below: str,
                    work: Path) -> tuple[TableState, list[tuple[str | None, str]]]:
    """A Parquet mirror table without events in the segment: rewrite the buckets that hold rows below.

    One job finds those buckets (and how many rows go), one writes them again without those rows;
    the returned swaps go into the job's journal like the bucket rewrite's (``cdcd.spark.parquet``).
    """
    from cdcd.spark.parquet import BUCKET  # parquet imports this module

    if not any(table_dir.glob(f"{BUCKET}=*/*.parquet")):
        return prev, []
    mirror = spark.read.option("basePath", str(table_dir)).parquet(str(table_dir))
    below_lit = F.lit(below)
    gone = {int(r[BUCKET]): int(r["n"]) for r in mirror.filter(F.col("_cdc_pos") < below_lit)
            .groupBy(BUCKET).agg(F.count(F.lit(1)).alias("n")).collect()}
    if not gone:
        return prev, []
    dirs = [str(table_dir / f"{BUCKET}={b}") for b in sorted(gone)]
    staged = work / f"covered-{uuid.uuid4().hex[:12]}"
    kept = spark.read.option("basePath", str(table_dir)).parquet(*dirs).filter(F.col("_cdc_pos") >= below_lit)
    kept.write.partitionBy(BUCKET).parquet(str(staged))
    swaps: list[tuple[str | None, str]] = []
    for b in sorted(gone):
        new = staged / f"{BUCKET}={b}"
        swaps.append((str(new) if new.is_dir() else None, str(table_dir / f"{BUCKET}={b}")))
    rows = None if prev.rows is None else prev.rows - sum(gone.values())
    return replace(prev, rows=rows), swaps
