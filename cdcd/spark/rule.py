"""The ordering rule, written once for every target format (DESIGN.md section 6).

Per key, the row with the highest position (``_cdc_pos``, then ``_cdc_batch``,
``_cdc_index``) wins; deletes and the old key of a key change remove it; a
truncate removes everything before its position; a column whose value was
unavailable keeps the previous value, and a key change carries the old key's
values of the columns unavailable in its new image. Existing mirror rows take
part in the same ordering, so applying an event twice changes nothing.

Used by the Parquet bucket rewrite (``cdcd.spark.parquet``) and by the MERGE
source of Delta Lake and Iceberg (``cdcd.spark.collapse``).
"""

from __future__ import annotations

from collections.abc import Callable

from pyspark.sql import Column, DataFrame, SparkSession, Window
from pyspark.sql import functions as F
from pyspark.sql.types import DataType, StructField, StructType

from cdcd.landing.columns import (
    CDC_BATCH,
    CDC_BEFORE_KEY,
    CDC_COMMIT_TS,
    CDC_INDEX,
    CDC_OP,
    CDC_POS,
    CDC_TX,
    CDC_UNAVAILABLE,
)
from cdcd.landing.reader import LandedFile

MIRROR_META = (CDC_OP, CDC_POS, CDC_TX, CDC_COMMIT_TS, CDC_BATCH)
KIND = "_cdc_kind"  # U upsert, D delete, E existing mirror row
RANK = "_cdc_rank"  # existing rows sort before events at the same position


def schema_groups(files: list[LandedFile]) -> list[list[LandedFile]]:
    """A table's landed files in runs of one schema (consecutive files with the same columns)."""
    groups: list[list[LandedFile]] = []
    for f in files:
        if groups and groups[-1][-1].entry.table.columns == f.entry.table.columns:
            groups[-1].append(f)
        else:
            groups.append([f])
    return groups


def read_events(spark: SparkSession, files: list[LandedFile]) -> DataFrame:
    """The landed rows of one table; files of different schema versions are unioned by name."""
    groups = schema_groups(files)
    frames = [spark.read.parquet(*[f.path for f in g]) for g in groups]
    out = frames[0]
    for df in frames[1:]:
        out = out.unionByName(df, allowMissingColumns=True)
    return out


def latest_per_key(
    cols: list[str], key: list[str], unavailable: set[str], order: Column
) -> tuple[list[Column], list[str], Callable[[str], Column]]:
    """The ordering rule as aggregates over rows grouped by key (shared by both target formats).

    The latest row by ``order`` gives the whole row (``_f``: its values, the mirror
    metadata and ``_cdc_kind``), except columns some event left unavailable: those
    take the latest non-delete row that has them (``_v<i>``, a null struct when no
    row has; one aggregate each, so only for the columns concerned). Returns the
    aggregates, those columns, and how to read a column's value after the grouping.
    """
    others = [c for c in cols if c not in key]
    kept = [c for c in others if c in unavailable]
    whole = [c for c in others if c not in unavailable]
    provides = [
        F.max_by(
            F.struct(F.col(c).alias("v")),
            F.when((F.col(KIND) != "D") & ~F.array_contains(CDC_UNAVAILABLE, c), order),
        ).alias(f"_v{i}")
        for i, c in enumerate(kept)
    ]
    final = F.max_by(F.struct(*[F.col(c) for c in (*whole, *MIRROR_META, KIND)]), order).alias("_f")

    def value(c: str) -> Column:
        if c in kept:
            return F.col(f"_v{kept.index(c)}").getField("v")
        return F.col("_f").getField(c) if c in whole else F.col(c)

    return [final, *provides], kept, value


FROM = "_cdc_from"  # an upsert of a key change: the old key (struct of the key columns), else null
MOVED = "_cdc_moved_out"  # the delete of a key change's old key
ORDER = (CDC_POS, RANK, CDC_BATCH, CDC_INDEX)
#: Moves of one row within one merge that an unavailable value is followed through (1 -> 2 -> 3 -> 4).
MOVE_CHAIN = 3


def from_type(key: list[str], types: dict[str, DataType]) -> StructType:
    return StructType([StructField(k, types[k]) for k in key])


def action_rows(events: DataFrame, cols: list[str], key: list[str], types: dict[str, DataType],
                key_changes: bool) -> DataFrame:
    """Upserts (U) and deletes (D) of the landed events in one shape, and a delete of each key change's old key.

    One scan of the landed files for upserts and deletes; a second only when some update moved a key.
    """
    moved_from = (F.when(F.col(CDC_BEFORE_KEY).isNotNull(),
                         F.struct(*[F.col(CDC_BEFORE_KEY).getField(k).cast(types[k]).alias(k) for k in key]))
                  if key_changes else F.lit(None)).cast(from_type(key, types))

    def shaped(df: DataFrame, kind: Column, moved: bool, key_from: dict[str, Column] | None = None) -> DataFrame:
        picks = [(key_from[c] if key_from and c in key_from else F.col(c)).cast(types[c]).alias(c) for c in cols]
        return df.select(
            *picks,
            *[F.col(m) for m in MIRROR_META],
            kind.alias(KIND),
            F.lit(1).alias(RANK),
            F.col(CDC_INDEX),
            F.col(CDC_UNAVAILABLE),
            (F.lit(None).cast(from_type(key, types)) if moved else moved_from).alias(FROM),
            F.lit(moved).alias(MOVED),
        )

    rows = events.filter(F.col(CDC_OP) != "t")
    out = shaped(rows, F.when(F.col(CDC_OP) == "d", F.lit("D")).otherwise(F.lit("U")), False)
    if key_changes:
        old_keys = {k: F.col(CDC_BEFORE_KEY).getField(k) for k in key}
        out = out.unionByName(shaped(rows.filter(F.col(CDC_BEFORE_KEY).isNotNull()), F.lit("D"), True, old_keys))
    return out


def existing_rows(old: DataFrame, cols: list[str], key: list[str], types: dict[str, DataType]) -> DataFrame:
    """Rows of the mirror (kind E) in the shape of ``action_rows``: they sort before events at their position."""
    have = set(old.columns)
    return old.select(
        *[(F.col(c) if c in have else F.lit(None)).cast(types[c]).alias(c) for c in cols],
        *[F.col(m) for m in MIRROR_META],
        F.lit("E").alias(KIND),
        F.lit(0).alias(RANK),
        F.lit(0).cast("long").alias(CDC_INDEX),
        F.array().cast("array<string>").alias(CDC_UNAVAILABLE),
        F.lit(None).cast(from_type(key, types)).alias(FROM),
        F.lit(False).alias(MOVED),
    )


def resolve_moves(rows: DataFrame, key: list[str], kept: list[str]) -> DataFrame:
    """Key changes, before the per-key rule: which old-key deletes stand, and the values a moved row keeps.

    ``rows``: ``action_rows`` and the ``existing_rows`` of every key a key change touches.

    - A key shift inside one statement (``UPDATE t SET id = id + 1`` with a deferrable key):
      row 1 moves to key 2 while row 2 still holds it, then row 2 moves on to key 3. The
      delete of key 2 that the second move lands is a later position than the row that
      moved into key 2, but it removes the row that held key 2 before. So an old-key delete
      whose key was last written by a move of the same transaction into an occupied key
      (the key's row before that move exists) is dropped. A row moved twice in one
      transaction (1 -> 2, then 2 -> 3) moved into a free key 2 and its delete stands.
    - Columns unavailable in a key change's new image (unchanged TOAST) take the old
      key's latest value before the change, from the events or the mirror; they stay
      listed as unavailable when neither has one.
    """
    w = Window.partitionBy(*key).orderBy(*ORDER)
    before = F.lag(F.struct(F.col(KIND).alias("k"), F.col(FROM).isNotNull().alias("moved_in"),
                            F.col(CDC_TX).alias("tx")), 1).over(w)
    rows = rows.withColumn("_p1", before).withColumn("_p2", F.lag(KIND, 2).over(w))
    # a move into a key that another row still held
    crowded = F.coalesce(F.col(FROM).isNotNull() & F.col("_p1").getField("k").isin("U", "E"), F.lit(False))
    stale_delete = F.coalesce(
        F.col(MOVED) & (F.col("_p1").getField("k") == "U") & F.col("_p1").getField("moved_in")
        & F.col("_p1").getField("tx").eqNullSafe(F.col(CDC_TX)) & F.col("_p2").isin("U", "E"),
        F.lit(False),
    )  # no row before: not stale
    rows = rows.withColumn("_crowded", crowded).filter(~stale_delete)
    for _ in range(MOVE_CHAIN if kept else 0):  # each pass follows one more move of a row moved repeatedly
        rows = _carry_moved_values(rows, key, kept)
    return rows.drop("_p1", "_p2", "_crowded")


def _carry_moved_values(rows: DataFrame, key: list[str], kept: list[str]) -> DataFrame:
    order = F.struct(*ORDER)
    ident = F.struct(CDC_POS, CDC_BATCH, CDC_INDEX)
    missing = F.size(F.array_intersect(CDC_UNAVAILABLE, F.array(*[F.lit(c) for c in kept]))) > 0
    movers = rows.filter(F.col(FROM).isNotNull() & (F.col(KIND) == "U") & missing).select(
        *[F.col(FROM).getField(k).alias(f"_k{i}") for i, k in enumerate(key)],
        order.alias("_mo"), F.col(CDC_TX).alias("_mtx"), ident.alias("_id"),
    )
    # the old key's rows before the move; not a row that moved into it crowded in the same transaction
    holders = rows.filter(F.col(KIND).isin("U", "E")).select(
        *[F.col(k).alias(f"_h{i}") for i, k in enumerate(key)],
        order.alias("_ho"), F.col(CDC_TX).alias("_htx"), F.col("_crowded").alias("_hc"),
        F.col(CDC_UNAVAILABLE).alias("_hu"), *[F.col(c).alias(f"_hv{i}") for i, c in enumerate(kept)],
    )
    cond = [movers[f"_k{i}"].eqNullSafe(holders[f"_h{i}"]) for i in range(len(key))]
    cond += [holders["_ho"] < movers["_mo"], ~(holders["_hc"] & holders["_htx"].eqNullSafe(movers["_mtx"]))]
    fills = movers.join(holders, on=cond).groupBy("_id").agg(*[
        F.max_by(F.struct(F.col(f"_hv{i}").alias("v")), F.when(~F.array_contains("_hu", c), F.col("_ho")))
        .alias(f"_fill{i}") for i, c in enumerate(kept)
    ])
    rows = rows.withColumn("_id", ident).join(fills, on="_id", how="left")
    mover = F.col(FROM).isNotNull() & (F.col(KIND) == "U")
    for i, c in enumerate(kept):
        found = mover & F.array_contains(CDC_UNAVAILABLE, c) & F.col(f"_fill{i}").isNotNull()
        rows = rows.withColumn(c, F.when(found, F.col(f"_fill{i}").getField("v")).otherwise(F.col(c)))
        rows = rows.withColumn(CDC_UNAVAILABLE, F.when(found, F.array_remove(CDC_UNAVAILABLE, c))
                               .otherwise(F.col(CDC_UNAVAILABLE)))
    return rows.drop("_id", *[f"_fill{i}" for i in range(len(kept))])
