"""One action per key for a MERGE INTO target (Delta Lake / Iceberg).

The same rule as ``cdcd.spark.merge`` (DESIGN.md section 6): per key the
event with the highest (``_cdc_pos``, ``_cdc_batch``, ``_cdc_index``) wins;
deletes and the old key of a key change remove the row; a truncate drops
the events before it; a column an event left unavailable takes the latest
earlier value of that key in the micro-batch. It differs from the bucket
rewrite of ``merge.py`` in one way: the mirror's existing rows do not take
part here. The MERGE compares positions with them instead, and an
unavailable column with no earlier value in the micro-batch stays listed in
``_cdc_unavailable`` so that the MERGE keeps the mirror's value.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import DataType, StructType

from cdcd.spark.lakehouse_sql import DELETE_FLAG, UNAVAILABLE
from cdcd.spark.merge import MIRROR_META, LandedFile, latest_per_key, read_events

_KIND = "_cdc_kind"  # U upsert, D delete
_ORDER = ("_cdc_pos", "_cdc_batch", "_cdc_index")


@dataclass(slots=True)
class Facts:
    """What the statements of a micro-batch depend on, from one aggregate over its events."""

    events: int = 0
    truncate_pos: str | None = None
    unavailable: set[str] = field(default_factory=set)


@dataclass(slots=True)
class Prepared:
    """One table's events of a micro-batch and the collapsed MERGE source built from them."""

    cols: list[str]  # the table's columns, latest schema
    key: list[str]
    types: dict[str, DataType]
    events: DataFrame  # every landed column, events at or above the watermark
    facts: Facts
    keep: list[str]  # columns whose value may be unknown in the source
    mirror: DataFrame  # one row per key: cols, MIRROR_META, _cdc_delete, _cdc_unavailable

    @property
    def mirror_columns(self) -> list[str]:
        return [*self.cols, *MIRROR_META]


def table_layout(files: list[LandedFile]) -> tuple[list[str], list[str]]:
    """The columns and merge key of the latest schema (all columns when the table has no key)."""
    latest = files[-1].entry["table"]
    cols: list[str] = [c["name"] for c in latest["columns"]]
    return cols, list(latest["key"]) or cols


def new_events(spark: SparkSession, files: list[LandedFile], watermark: str) -> DataFrame:
    """The landed rows; below the table's watermark they are applied already (re-delivered after a crash)."""
    events = read_events(spark, files)
    return events.filter(F.col("_cdc_pos") >= F.lit(watermark)) if watermark else events


def facts(events: DataFrame) -> Facts:
    row = events.agg(
        F.count(F.lit(1)),
        F.max(F.when(F.col("_cdc_op") == "t", F.col("_cdc_pos"))),
        F.array_distinct(F.flatten(F.collect_set("_cdc_unavailable"))),
    ).first()
    assert row is not None
    return Facts(int(row[0]), row[1], set(row[2] or ()))


def _actions(events: DataFrame, cols: list[str], key: list[str], types: dict[str, DataType]) -> DataFrame:
    """Upserts, deletes, and a delete of the old key for each key change, in one shape."""

    def shaped(df: DataFrame, kind: str, key_from: dict[str, Column] | None = None) -> DataFrame:
        picks = [(key_from[c] if key_from and c in key_from else F.col(c)).cast(types[c]).alias(c) for c in cols]
        return df.select(
            *picks,
            *[F.col(m) for m in MIRROR_META],
            F.col("_cdc_index"),
            F.col("_cdc_unavailable"),
            F.lit(kind).alias(_KIND),
        )

    rows = events.filter(F.col("_cdc_op") != "t")
    out = shaped(rows.filter(F.col("_cdc_op").isin("c", "u", "r")), "U").unionByName(
        shaped(rows.filter(F.col("_cdc_op") == "d"), "D")
    )
    if "_cdc_before_key" in events.columns:
        moved = {k: F.col("_cdc_before_key").getField(k) for k in key}
        out = out.unionByName(shaped(rows.filter(F.col("_cdc_before_key").isNotNull()), "D", moved))
    return out


def collapse(
    events: DataFrame, cols: list[str], key: list[str], types: dict[str, DataType], found: Facts
) -> tuple[DataFrame, list[str]]:
    """The MERGE source (one row per key) and the columns whose value it may leave unknown."""
    actions = _actions(events, cols, key, types)
    if found.truncate_pos is not None:  # the truncate removes what came before it
        actions = actions.filter(F.col("_cdc_pos") >= F.lit(found.truncate_pos))
    aggs, keep, value = latest_per_key(cols, key, found.unavailable, F.struct(*_ORDER))
    grouped = actions.groupBy(*key).agg(*aggs)
    deleted = F.col("_f").getField(_KIND) == "D"
    unknown = [F.when(F.col(f"_v{i}").isNull(), F.lit(c)) for i, c in enumerate(keep)]
    still_unknown = F.filter(F.array(*unknown), lambda x: x.isNotNull()) if unknown else F.array()
    out = grouped.select(
        # a delete carries only its key: the values of the event it came from are of no use
        *[(value(c) if c in key else F.when(~deleted, value(c))).cast(types[c]).alias(c) for c in cols],
        *[F.col("_f").getField(m).alias(m) for m in MIRROR_META],
        deleted.alias(DELETE_FLAG),
        F.when(deleted, F.array()).otherwise(still_unknown).cast("array<string>").alias(UNAVAILABLE),
    )
    return out, keep


def prepare(spark: SparkSession, files: list[LandedFile], watermark: str) -> Prepared:
    """Read one table's landed files and build the MERGE source; the events are cached until ``release``."""
    cols, key = table_layout(files)
    events = new_events(spark, files, watermark).persist()
    types = {f.name: f.dataType for f in events.schema.fields}
    found = facts(events)
    mirror, keep = collapse(events, cols, key, types, found)
    return Prepared(cols, key, types, events, found, keep, mirror)


def release(prepared: Prepared) -> None:
    prepared.events.unpersist()


def conform(expr: Column, have: DataType | None, want: DataType) -> Column:
    """``expr`` (of type ``have``, or absent) as type ``want``, struct fields matched by name."""
    if have is None:
        return F.lit(None).cast(want)
    if have == want:
        return expr
    if isinstance(have, StructType) and isinstance(want, StructType):
        inner = {f.name: f.dataType for f in have.fields}
        fields = [conform(expr.getField(f.name) if f.name in inner else expr, inner.get(f.name), f.dataType)
                  .alias(f.name) for f in want.fields]
        return F.when(expr.isNull(), F.lit(None).cast(want)).otherwise(F.struct(*fields))
    return expr.cast(want)


def conformed(df: DataFrame, schema: StructType) -> DataFrame:
    """``df`` with exactly the columns of ``schema`` (missing ones NULL), for a MERGE that inserts every column."""
    have = {f.name: f.dataType for f in df.schema.fields}
    return df.select(
        *[conform(F.col(f.name) if f.name in have else F.lit(None), have.get(f.name), f.dataType).alias(f.name)
          for f in schema.fields]
    )
