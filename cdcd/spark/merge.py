"""Apply the landed events of one table to its change-log and current-state mirror.

The rule (DESIGN.md section 6): per key, the row with the highest position
wins; deletes and the old key of a key change remove it; a truncate removes
everything before its position; a column whose value was unavailable keeps
the previous value. Existing mirror rows take part in the same ordering, so
applying an event twice changes nothing. Only the hash buckets the events
touch are rewritten (all of them on a truncate or a schema change).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
from pyspark.sql import Column, DataFrame, Observation, SparkSession, Window
from pyspark.sql import functions as F
from pyspark.sql.types import DataType, StructField, StructType

from cdcd.landing.reader import LandedFile
from cdcd.spark.state import TableState

MIRROR_META = ("_cdc_op", "_cdc_pos", "_cdc_tx", "_cdc_commit_ts", "_cdc_batch")
BUCKET = "cdc_bucket"
_KIND = "_cdc_kind"  # U upsert, D delete, E existing mirror row
_RANK = "_cdc_rank"  # existing rows sort before events at the same position


@dataclass(slots=True)
class TableResult:
    state: TableState
    files: list[tuple[str, str]] = field(default_factory=list)  # changelog renames
    buckets: list[tuple[str | None, str]] = field(default_factory=list)  # (new dir or None, mirror bucket dir)
    events: int = 0
    timings: dict[str, float] = field(default_factory=dict)  # seconds per Spark job, for the log


@contextmanager
def _job(spark: SparkSession, result: TableResult, name: str) -> Iterator[None]:
    """Name the Spark job (event log) and time it (the consumer's log line)."""
    spark.sparkContext.setJobDescription(f"cdcd {name}")
    began = time.monotonic()
    try:
        yield
    finally:
        result.timings[name] = result.timings.get(name, 0.0) + time.monotonic() - began
        spark.sparkContext.setJobDescription(None)  # type: ignore[arg-type]


def read_events(spark: SparkSession, files: list[LandedFile]) -> DataFrame:
    """The landed rows of one table; files of different schema versions are unioned by name."""
    groups: list[list[LandedFile]] = []
    for f in files:
        if groups and groups[-1][-1].entry["table"]["columns"] == f.entry["table"]["columns"]:
            groups[-1].append(f)
        else:
            groups.append([f])
    frames = [spark.read.parquet(*[f.path for f in g]) for g in groups]
    out = frames[0]
    for df in frames[1:]:
        out = out.unionByName(df, allowMissingColumns=True)
    return out


def _null_safe_join(left: DataFrame, right: DataFrame, cols: list[str]) -> DataFrame:
    cond = [left[c].eqNullSafe(right[c]) for c in cols]
    return left.join(right, on=cond, how="left_anti")


def _changelog_events(
    spark: SparkSession, events: DataFrame, key: list[str], prev: TableState, run_id: str, changelog: Path
) -> DataFrame:
    """Drop events the change-log already holds (re-delivered after a daemon crash).

    Positions below the watermark were applied in order before; at the
    watermark itself only snapshot rows of the same landing run are surely
    new (they share one position), anything else is checked against the log.
    """
    w = F.lit(prev.watermark)
    same_run_snapshot = F.col("_cdc_snapshot") & F.lit(run_id == prev.run_id)
    ambiguous = (F.col("_cdc_pos") == w) & ~same_run_snapshot
    if not any(changelog.glob("*.parquet")):
        return events
    logged = (
        spark.read.option("mergeSchema", "true")
        .parquet(str(changelog))
        .filter(F.col("_cdc_pos") == w)
        .select("_cdc_pos", "_cdc_op", *key)
        .distinct()
    )
    return events.filter(~ambiguous).unionByName(
        _null_safe_join(events.filter(ambiguous), logged, ["_cdc_pos", "_cdc_op", *key])
    )


#: Target rows per mirror bucket: a batch that touches one bucket rewrites about this many rows.
ROWS_PER_BUCKET = 262_144
MAX_BUCKETS = 4096


def sized_buckets(rows: int, minimum: int) -> int:
    """Buckets for a mirror of ``rows`` rows: a power of two, at least ``minimum``."""
    want = -(-rows // ROWS_PER_BUCKET)
    n = 1
    while n < want and n < MAX_BUCKETS:
        n *= 2
    return max(minimum, n)


def _observed(observation: Observation) -> dict[str, Any] | None:
    """The metrics an action reported, or None when the node was optimised away."""
    try:
        return observation.get
    except Exception:
        return None


def _parquet_rows(dirs: list[str]) -> int:
    """Rows in the Parquet files of these directories, from their footers."""
    return sum(pq.read_metadata(f).num_rows for d in dirs for f in Path(d).glob("*.parquet"))


def _bucket(key: list[Column], buckets: int) -> Column:
    return F.pmod(F.xxhash64(*key), F.lit(buckets)).cast("int")


def apply_table(
    spark: SparkSession,
    table: str,
    files: list[LandedFile],
    prev: TableState,
    run_id: str,
    table_dir: Path,
    changelog_dir: Path,
    work: Path,
    default_buckets: int,
) -> TableResult:
    """Stage the change-log files and the rewritten mirror buckets of one table.

    Three Spark jobs whatever the number of landed batches: the change-log
    write, one aggregate (event count, truncate, touched buckets) and the
    mirror write. The events are cached for them when more than one file is read.
    """
    latest = files[-1].entry["table"]
    cols: list[str] = [c["name"] for c in latest["columns"]]
    key: list[str] = list(latest["key"]) or cols
    buckets = prev.buckets or default_buckets
    events = read_events(spark, files)
    if prev.watermark:
        events = events.filter(F.col("_cdc_pos") >= F.lit(prev.watermark))
    # Not cached: the landed files are read twice (change-log, mirror), which costs less than caching them.
    return _apply(spark, events, table, files, cols, key, buckets, prev, run_id, table_dir, changelog_dir, work)

def _apply(
    spark: SparkSession,
    events: DataFrame,
    table: str,
    files: list[LandedFile],
    cols: list[str],
    key: list[str],
    buckets: int,
    prev: TableState,
    run_id: str,
    table_dir: Path,
    changelog_dir: Path,
    work: Path,
) -> TableResult:
    types = {f.name: f.dataType for f in events.schema.fields}
    columns = [[c, types[c].simpleString()] for c in cols]
    last_pos = max(f.entry["last_position"] for f in files)
    state = TableState(max(prev.watermark, last_pos), run_id, columns, buckets)
    result = TableResult(state)
    has_before_key = "_cdc_before_key" in events.columns

    # change-log: every new event, each file in position order (no coalesce: it would serialise the job)
    first_pos = min(f.entry["first_position"] for f in files)
    log = events
    if prev.watermark and first_pos <= prev.watermark:
        log = _changelog_events(spark, events, key, prev, run_id, changelog_dir)
    # everything the mirror plan depends on, measured while the change-log is written (no job of its own)
    row_bucket = F.when(F.col("_cdc_op") != "t", _bucket([F.col(k).cast(types[k]) for k in key], buckets))
    touched_sets = [F.collect_set(row_bucket).alias("touched")]
    if has_before_key:
        moved = [F.col("_cdc_before_key").getField(k).cast(types[k]) for k in key]
        touched_sets.append(
            F.collect_set(F.when(F.col("_cdc_before_key").isNotNull(), _bucket(moved, buckets))).alias("moved")
        )
        touched_sets.append(F.count_if(F.col("_cdc_before_key").isNotNull()).alias("key_changes"))
    measures = [
        F.count(F.lit(1)).alias("events"),
        F.max(F.when(F.col("_cdc_op") == "t", F.col("_cdc_pos"))).alias("truncate"),
        F.array_distinct(F.flatten(F.collect_set("_cdc_unavailable"))).alias("unavailable"),
        *touched_sets,
    ]
    seen = Observation(f"cdcd-{uuid.uuid4().hex}")
    observed = log.observe(seen, *measures)
    staged_log = work / "changelog"
    with _job(spark, result, "changelog"):
        observed.sortWithinPartitions("_cdc_pos", "_cdc_batch", "_cdc_index").write.parquet(str(staged_log))
    tag = uuid.uuid4().hex[:12]  # a replayed batch must never overwrite the log files of its first application
    for n, part in enumerate(sorted(staged_log.glob("part-*.parquet"))):
        result.files.append((str(part), str(changelog_dir / f"{files[0].seq:020d}-{tag}-{n:04d}.parquet")))
    agg = _observed(seen)
    if agg is None:  # not reported (the optimizer dropped the node): measure with a job of its own
        first = log.agg(*measures).first()
        assert first is not None
        agg = first.asDict()
    # the deduplicated events go on to the mirror too: a re-delivered event is already in it
    events = log
    result.events = int(agg["events"])
    truncate_pos: str | None = agg["truncate"]
    unavailable = set(agg["unavailable"] or ())
    touched = {int(b) for name in ("touched", "moved") for b in agg.get(name) or ()}
    existing = {int(d.name.split("=", 1)[1]) for d in table_dir.glob(f"{BUCKET}=*")} if table_dir.is_dir() else set()
    schema_changed = bool(prev.columns) and prev.columns != columns
    rewrite_all = truncate_pos is not None or schema_changed or touched >= existing
    if rewrite_all:
        touched |= existing
    # A new table gets buckets for its first rows; a table that outgrew its buckets gets more when
    # this merge rewrites all of them anyway, so that a small batch later rewrites a small part.
    if not prev.buckets and not existing:
        buckets = sized_buckets(result.events, buckets)
    elif rewrite_all and prev.rows is not None:
        buckets = sized_buckets(prev.rows + result.events, buckets)
    if buckets != state.buckets:
        state.buckets = buckets
        touched |= set(range(buckets))

    actions = action_rows(events, cols, key, types, bool(int(agg.get("key_changes") or 0)))
    if truncate_pos is not None:
        actions = actions.filter(F.col("_cdc_pos") >= F.lit(truncate_pos))
    merged = actions
    existing_dirs = [str(d) for d in (table_dir / f"{BUCKET}={b}" for b in sorted(touched)) if d.is_dir()]
    if existing_dirs:
        old = existing_rows(spark.read.option("basePath", str(table_dir)).parquet(*existing_dirs), cols, key, types)
        if truncate_pos is not None:
            old = old.filter(F.col("_cdc_pos") >= F.lit(truncate_pos))
        merged = actions.unionByName(old)
    if int(agg.get("key_changes") or 0):
        merged = resolve_moves(merged, key, sorted(unavailable & set(cols)))
    # the bucket is recomputed for old rows too: a key column's type change moves them
    merged = merged.withColumn(BUCKET, _bucket([F.col(k) for k in key], buckets))

    aggs, _, value = latest_per_key(cols, key, unavailable, F.struct(*ORDER))
    # partitioned by bucket first: the grouping reuses that shuffle and each task writes whole buckets
    grouped = merged.repartition(BUCKET).groupBy(BUCKET, *key).agg(*aggs)
    out = grouped.filter(F.col("_f").getField(_KIND) != "D").select(
        *[value(c).alias(c) for c in cols],
        *[F.col("_f").getField(m).alias(m) for m in MIRROR_META],
        F.col(BUCKET),
    )
    written = Observation(f"cdcd-{uuid.uuid4().hex}")
    out = out.observe(written, F.count(F.lit(1)).alias("rows"))
    staged = work / "mirror"
    with _job(spark, result, "mirror"):
        out.write.partitionBy(BUCKET).parquet(str(staged))
    # the mirror's row count, for the bucket sizing: exact once every bucket has been rewritten
    counted = _observed(written)
    if counted is None:
        state.rows = None
    elif touched >= existing:
        state.rows = int(counted["rows"])
    elif prev.rows is not None:
        state.rows = prev.rows - _parquet_rows(existing_dirs) + int(counted["rows"])
    for b in sorted(touched):
        new = staged / f"{BUCKET}={b}"
        result.buckets.append((str(new) if new.is_dir() else None, str(table_dir / f"{BUCKET}={b}")))
    return result


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
            F.when((F.col(_KIND) != "D") & ~F.array_contains("_cdc_unavailable", c), order),
        ).alias(f"_v{i}")
        for i, c in enumerate(kept)
    ]
    final = F.max_by(F.struct(*[F.col(c) for c in (*whole, *MIRROR_META, _KIND)]), order).alias("_f")

    def value(c: str) -> Column:
        if c in kept:
            return F.col(f"_v{kept.index(c)}").getField("v")
        return F.col("_f").getField(c) if c in whole else F.col(c)

    return [final, *provides], kept, value


FROM = "_cdc_from"  # an upsert of a key change: the old key (struct of the key columns), else null
MOVED = "_cdc_moved_out"  # the delete of a key change's old key
ORDER = ("_cdc_pos", _RANK, "_cdc_batch", "_cdc_index")
#: Moves of one row within one merge that an unavailable value is followed through (1 -> 2 -> 3 -> 4).
MOVE_CHAIN = 3


def from_type(key: list[str], types: dict[str, DataType]) -> StructType:
    return StructType([StructField(k, types[k]) for k in key])


def action_rows(events: DataFrame, cols: list[str], key: list[str], types: dict[str, DataType],
                key_changes: bool) -> DataFrame:
    """Upserts (U) and deletes (D) of the landed events in one shape, and a delete of each key change's old key.

    One scan of the landed files for upserts and deletes; a second only when some update moved a key.
    """
    moved_from = (F.when(F.col("_cdc_before_key").isNotNull(),
                         F.struct(*[F.col("_cdc_before_key").getField(k).cast(types[k]).alias(k) for k in key]))
                  if key_changes else F.lit(None)).cast(from_type(key, types))

    def shaped(df: DataFrame, kind: Column, moved: bool, key_from: dict[str, Column] | None = None) -> DataFrame:
        picks = [(key_from[c] if key_from and c in key_from else F.col(c)).cast(types[c]).alias(c) for c in cols]
        return df.select(
            *picks,
            *[F.col(m) for m in MIRROR_META],
            kind.alias(_KIND),
            F.lit(1).alias(_RANK),
            F.col("_cdc_index"),
            F.col("_cdc_unavailable"),
            (F.lit(None).cast(from_type(key, types)) if moved else moved_from).alias(FROM),
            F.lit(moved).alias(MOVED),
        )

    rows = events.filter(F.col("_cdc_op") != "t")
    out = shaped(rows, F.when(F.col("_cdc_op") == "d", F.lit("D")).otherwise(F.lit("U")), False)
    if key_changes:
        old_keys = {k: F.col("_cdc_before_key").getField(k) for k in key}
        out = out.unionByName(shaped(rows.filter(F.col("_cdc_before_key").isNotNull()), F.lit("D"), True, old_keys))
    return out


def existing_rows(old: DataFrame, cols: list[str], key: list[str], types: dict[str, DataType]) -> DataFrame:
    """Rows of the mirror (kind E) in the shape of ``action_rows``: they sort before events at their position."""
    have = set(old.columns)
    return old.select(
        *[(F.col(c) if c in have else F.lit(None)).cast(types[c]).alias(c) for c in cols],
        *[F.col(m) for m in MIRROR_META],
        F.lit("E").alias(_KIND),
        F.lit(0).alias(_RANK),
        F.lit(0).cast("long").alias("_cdc_index"),
        F.array().cast("array<string>").alias("_cdc_unavailable"),
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
    before = F.lag(F.struct(F.col(_KIND).alias("k"), F.col(FROM).isNotNull().alias("moved_in"),
                            F.col("_cdc_tx").alias("tx")), 1).over(w)
    rows = rows.withColumn("_p1", before).withColumn("_p2", F.lag(_KIND, 2).over(w))
    # a move into a key that another row still held
    crowded = F.coalesce(F.col(FROM).isNotNull() & F.col("_p1").getField("k").isin("U", "E"), F.lit(False))
    stale_delete = F.coalesce(
        F.col(MOVED) & (F.col("_p1").getField("k") == "U") & F.col("_p1").getField("moved_in")
        & F.col("_p1").getField("tx").eqNullSafe(F.col("_cdc_tx")) & F.col("_p2").isin("U", "E"),
        F.lit(False),
    )  # no row before: not stale
    rows = rows.withColumn("_crowded", crowded).filter(~stale_delete)
    for _ in range(MOVE_CHAIN if kept else 0):  # each pass follows one more move of a row moved repeatedly
        rows = _carry_moved_values(rows, key, kept)
    return rows.drop("_p1", "_p2", "_crowded")


def _carry_moved_values(rows: DataFrame, key: list[str], kept: list[str]) -> DataFrame:
    order = F.struct(*ORDER)
    ident = F.struct("_cdc_pos", "_cdc_batch", "_cdc_index")
    missing = F.size(F.array_intersect("_cdc_unavailable", F.array(*[F.lit(c) for c in kept]))) > 0
    movers = rows.filter(F.col(FROM).isNotNull() & (F.col(_KIND) == "U") & missing).select(
        *[F.col(FROM).getField(k).alias(f"_k{i}") for i, k in enumerate(key)],
        order.alias("_mo"), F.col("_cdc_tx").alias("_mtx"), ident.alias("_id"),
    )
    # the old key's rows before the move; not a row that moved into it crowded in the same transaction
    holders = rows.filter(F.col(_KIND).isin("U", "E")).select(
        *[F.col(k).alias(f"_h{i}") for i, k in enumerate(key)],
        order.alias("_ho"), F.col("_cdc_tx").alias("_htx"), F.col("_crowded").alias("_hc"),
        F.col("_cdc_unavailable").alias("_hu"), *[F.col(c).alias(f"_hv{i}") for i, c in enumerate(kept)],
    )
    cond = [movers[f"_k{i}"].eqNullSafe(holders[f"_h{i}"]) for i in range(len(key))]
    cond += [holders["_ho"] < movers["_mo"], ~(holders["_hc"] & holders["_htx"].eqNullSafe(movers["_mtx"]))]
    fills = movers.join(holders, on=cond).groupBy("_id").agg(*[
        F.max_by(F.struct(F.col(f"_hv{i}").alias("v")), F.when(~F.array_contains("_hu", c), F.col("_ho")))
        .alias(f"_fill{i}") for i, c in enumerate(kept)
    ])
    rows = rows.withColumn("_id", ident).join(fills, on="_id", how="left")
    mover = F.col(FROM).isNotNull() & (F.col(_KIND) == "U")
    for i, c in enumerate(kept):
        found = mover & F.array_contains("_cdc_unavailable", c) & F.col(f"_fill{i}").isNotNull()
        rows = rows.withColumn(c, F.when(found, F.col(f"_fill{i}").getField("v")).otherwise(F.col(c)))
        rows = rows.withColumn("_cdc_unavailable", F.when(found, F.array_remove("_cdc_unavailable", c))
                               .otherwise(F.col("_cdc_unavailable")))
    return rows.drop("_id", *[f"_fill{i}" for i in range(len(kept))])
