"""One action per key for a MERGE INTO target (Delta Lake / Iceberg).

The rule of ``cdcd.spark.rule`` (DESIGN.md section 6): per key the
event with the highest (``_cdc_pos``, ``_cdc_batch``, ``_cdc_index``) wins;
deletes and the old key of a key change remove the row; a truncate drops
the events before it; a column an event left unavailable takes the latest
earlier value of that key in the micro-batch; key changes follow
``rule.resolve_moves``. It differs from the bucket rewrite of ``cdcd.spark.parquet``
in one way: the mirror's existing rows take part only for the keys that a
key change touches. The MERGE compares positions with the others instead,
and an unavailable column with no earlier value in the micro-batch stays
listed in ``_cdc_unavailable`` so that the MERGE keeps the mirror's value.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import DataType, StructType

from cdcd.landing.columns import CDC_BEFORE_KEY, CDC_OP, CDC_POS, CDC_UNAVAILABLE
from cdcd.landing.reader import LandedFile
from cdcd.spark.facts import RANGED, Facts, KeyRange, landed_facts, truncates_no_row
from cdcd.spark.identity import Identity, identity, read_by_identity
from cdcd.spark.lakehouse_sql import DELETE_FLAG, UNAVAILABLE
from cdcd.spark.rule import (
    KIND,
    MIRROR_META,
    ORDER,
    action_rows,
    existing_rows,
    latest_per_key,
    resolve_moves,
)


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
    ident: Identity | None = None  # the landed columns' identity (``cdcd.spark.identity``)

    @property
    def mirror_columns(self) -> list[str]:
        return [*self.cols, *MIRROR_META]


def table_layout(files: list[LandedFile]) -> tuple[list[str], list[str]]:
    """The columns and merge key of the latest schema (all columns when the table has no key)."""
    latest = files[-1].entry.table
    cols = latest.column_names
    return cols, list(latest.key) or cols


def new_events(spark: SparkSession, files: list[LandedFile], watermark: str, fill: bool = False) -> DataFrame:
    """The landed rows under the latest schema version's names (``identity.read_by_identity``; ``fill``: with the
    fills of added columns, for the mirror); below the table's watermark they are applied already (re-delivered
    after a crash)."""
    events = read_by_identity(spark, files, fill)
    return events.filter(F.col(CDC_POS) >= F.lit(watermark)) if watermark else events


def spark_facts(events: DataFrame, key: list[str]) -> Facts:
    """``facts.landed_facts`` as Spark jobs: counts, truncate, unavailable columns and key range in one
    aggregate; key uniqueness in a second one. For landed files whose key types differ between versions."""
    moved = CDC_BEFORE_KEY in events.columns
    moves = F.count_if(F.col(CDC_BEFORE_KEY).isNotNull()) if moved else F.lit(0)
    rows = F.col(CDC_OP) != "t"
    first = events.schema[key[0]].dataType
    ranged = isinstance(first, RANGED)
    k0 = F.when(rows, F.col(key[0]))
    old = (F.col(CDC_BEFORE_KEY).getField(key[0]).cast(first)
           if moved and key[0] in _fields(events.schema[CDC_BEFORE_KEY].dataType) else F.lit(None).cast(first))
    nulls = F.count_if(rows & F.col(key[0]).isNull())
    if moved:
        nulls = nulls + F.count_if(F.col(CDC_BEFORE_KEY).isNotNull() & old.isNull())
    row = events.agg(
        F.count(F.lit(1)),
        F.max(F.when(F.col(CDC_OP) == "t", F.col(CDC_POS))),
        F.array_distinct(F.flatten(F.collect_set(CDC_UNAVAILABLE))),
        moves,
        F.count_if(rows),
        F.least(F.min(k0), F.min(old)) if ranged else F.lit(None),
        F.greatest(F.max(k0), F.max(old)) if ranged else F.lit(None),
        nulls,
        F.min(F.when(rows, F.col(CDC_POS))),
    ).first()
    assert row is not None
    found = Facts(int(row[0]), row[1], set(row[2] or ()), int(row[3]),
                  key_range=KeyRange(key[0], row[5], row[6], int(row[7]) > 0) if ranged else None)
    if not found.key_changes and not found.unavailable and truncates_no_row(found.truncate_pos, row[8]):
        # a separate aggregate: next to the ones above, Spark would group those by key as well
        keys = events.filter(rows).select(*key).dropna().distinct().count()
        found.unique = keys == int(row[4])
    return found


def _fields(dt: DataType) -> list[str]:
    return dt.fieldNames() if isinstance(dt, StructType) else []


def collapse(
    events: DataFrame, cols: list[str], key: list[str], types: dict[str, DataType], found: Facts,
    mirror: DataFrame | None = None,
) -> tuple[DataFrame, list[str]]:
    """The MERGE source (one row per key) and the columns whose value it may leave unknown.

    ``mirror`` (the target table) is read only when the events change a key: the
    key-change rule (``rule.resolve_moves``) needs the mirror's rows of the keys
    involved; then, as in the Parquet rewrite, they take part in the ordering and
    a key whose latest row is the mirror's own gets no action.
    """
    if found.unique:
        return _one_per_key(events, cols, types), []
    actions = action_rows(events, cols, key, types, found.key_changes > 0)
    if found.truncate_pos is not None:  # the truncate removes what came before it
        actions = actions.filter(F.col(CDC_POS) >= F.lit(found.truncate_pos))
    kept_cols = sorted(found.unavailable & set(cols))
    if found.key_changes:
        if mirror is not None:
            moved = events.filter(F.col(CDC_BEFORE_KEY).isNotNull())
            old_keys = [F.col(CDC_BEFORE_KEY).getField(k).cast(types[k]).alias(k) for k in key]
            keys = moved.select(*old_keys).unionByName(moved.select(*[F.col(k).cast(types[k]).alias(k) for k in key]))
            # materialised: the MERGE source must not read the table it merges into (Spark 4.1 cannot plan an
            # Iceberg table reference inside the source view); these are the few rows of the moved keys
            held = mirror.join(F.broadcast(keys.distinct()), on=key, how="left_semi").localCheckpoint(eager=True)
            old = existing_rows(held, cols, key, types)
            if found.truncate_pos is not None:
                old = old.filter(F.col(CDC_POS) >= F.lit(found.truncate_pos))
            actions = actions.unionByName(old)
        actions = resolve_moves(actions, key, kept_cols)
    aggs, keep, value = latest_per_key(cols, key, found.unavailable, F.struct(*ORDER))
    grouped = actions.groupBy(*key).agg(*aggs).filter(F.col("_f").getField(KIND) != "E")
    deleted = F.col("_f").getField(KIND) == "D"
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


def _one_per_key(events: DataFrame, cols: list[str], types: dict[str, DataType]) -> DataFrame:
    """The MERGE source when each key has one event and no rule beyond "delete or upsert" applies.

    The same rows ``collapse`` would give, without its per-key grouping: no shuffle, and the
    rows keep their landed order (keys inserted in order give the mirror files of narrow key ranges).
    """
    deleted = F.col(CDC_OP) == "d"
    return events.filter(F.col(CDC_OP) != "t").select(
        *[F.col(c).cast(types[c]).alias(c) for c in cols],  # a delete's non-key values are NULL as landed
        *[F.col(m) for m in MIRROR_META],
        deleted.alias(DELETE_FLAG),
        F.array().cast("array<string>").alias(UNAVAILABLE),
    )


def prepare(spark: SparkSession, files: list[LandedFile], watermark: str, mirror: DataFrame | None = None) -> Prepared:
    """Read one table's landed files and build the MERGE source.

    The events are not cached: every statement reads the columns it needs from the landed
    files (immutable until consumed), which costs less than building an in-memory copy.
    """
    cols, key = table_layout(files)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="cdcd-facts") as pool:
        # pyarrow reads the facts while Spark reads the files' schema (the first reading in a fresh JVM is slow)
        landed = pool.submit(landed_facts, files, key, watermark)
        events = new_events(spark, files, watermark)
        found = landed.result()
    types = {f.name: f.dataType for f in events.schema.fields}
    if found is not None and found.key_range is not None and not isinstance(types[key[0]], RANGED):
        found.key_range = None  # a type Spark reads otherwise than Arrow suggests: no pruning literal for it
    found = found or spark_facts(events, key)
    ident = identity(files)
    versions = any(f.entry.table.columns != files[0].entry.table.columns for f in files)
    filled = versions and any(c.fill is not None for c in ident.latest)
    collapsed, keep = collapse(new_events(spark, files, watermark, True) if filled else events, cols, key, types,
                               found, mirror)
    return Prepared(cols, key, types, events, found, keep, collapsed, ident)


def release(prepared: Prepared) -> None:
    prepared.events.unpersist()  # nothing cached by ``prepare``; kept for callers that cache


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
