"""The Parquet mirror (``--format parquet``): hash-bucket directories rewritten and swapped in.

Per micro-batch and table: the new events are written to the change-log,
then every mirror bucket the events touch (all of them on a truncate or a
schema change) is rewritten from its existing rows and the events, by the
ordering rule of ``cdcd.spark.rule``. The staged files and directories are
moved into place by the job's journal (``cdcd.spark.state``), so a
micro-batch is in the target entirely or not at all. Completed re-snapshots
(``Segment.covered``) remove the mirror rows below their threshold in the same
rewrite, or in a rewrite of their own for a table without events.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.parquet as pq
from pyspark import SparkContext
from pyspark.sql import Column, DataFrame, Observation, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import DataType

from cdcd.landing.columns import (
    CDC_BATCH,
    CDC_BEFORE_KEY,
    CDC_INDEX,
    CDC_OP,
    CDC_POS,
    CDC_SNAPSHOT,
    CDC_UNAVAILABLE,
    META_FIELDS,
)
from cdcd.landing.reader import LandedFile
from cdcd.spark import schemalog
from cdcd.spark.identity import (
    identity,
    mirror_rows_by_identity,
    older_rows_filled,
    read_by_identity,
    state_columns,
)
from cdcd.spark.lakehouse_sql import literal
from cdcd.spark.rule import (
    KIND,
    MIRROR_META,
    ORDER,
    action_rows,
    existing_rows,
    latest_per_key,
    resolve_moves,
)
from cdcd.spark.state import TableState, TargetStore
from cdcd.spark.strategy import Applied, Segment, applying

BUCKET = "cdc_bucket"


def threshold(truncate_pos: str | None, below: str | None) -> str | None:
    """The one position below which a table's mirror rows go: a truncate's, a covered record's, the higher."""
    if truncate_pos is None or below is None:
        return truncate_pos if below is None else below
    return max(truncate_pos, below)


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
    same_run_snapshot = F.col(CDC_SNAPSHOT) & F.lit(run_id == prev.run_id)
    ambiguous = (F.col(CDC_POS) == w) & ~same_run_snapshot
    if not any(changelog.glob("*.parquet")):
        return events
    logged = (
        spark.read.option("mergeSchema", "true")
        .parquet(str(changelog))
        .filter(F.col(CDC_POS) == w)
        .select(CDC_POS, CDC_OP, *key)
        .distinct()
    )
    return events.filter(~ambiguous).unionByName(
        _null_safe_join(events.filter(ambiguous), logged, [CDC_POS, CDC_OP, *key])
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
        got = observation.get
    except Exception:
        return None
    # pyspark 4.0 hands arrays back as Scala sequences (from 4.1 on, get converts through a pickled row)
    jvm = SparkContext._jvm
    convert = jvm.scala.jdk.javaapi.CollectionConverters.asJava if jvm is not None else None
    java = [k for k, v in got.items() if type(v).__module__.startswith("py4j")]
    return {**got, **{k: list(convert(got[k])) for k in java}} if convert is not None else got


def _parquet_rows(dirs: list[str]) -> int:
    """Rows in the Parquet files of these directories, from their footers."""
    return sum(pq.read_metadata(f).num_rows for d in dirs for f in Path(d).glob("*.parquet"))


def _bucket(key: list[Column], buckets: int) -> Column:
    return F.pmod(F.xxhash64(*key), F.lit(buckets)).cast("int")


@dataclass(slots=True)
class TableInput:
    """One table of a segment: its landed files, its state before the merge, where its output goes."""

    table: str
    files: list[LandedFile]
    prev: TableState
    run_id: str
    table_dir: Path
    changelog_dir: Path
    work: Path

    @property
    def cols(self) -> list[str]:
        """The table's columns, latest schema."""
        return self.files[-1].entry.table.column_names

    @property
    def key(self) -> list[str]:
        """The merge key: the key columns, or all columns when the table has none."""
        return list(self.files[-1].entry.table.key) or self.cols


@dataclass(slots=True)
class Measured:
    """What the mirror's plan depends on, measured while the change-log is written."""

    events: int
    truncate_pos: str | None
    unavailable: set[str]
    touched: set[int]  # buckets of the events' keys and of the old keys of key changes
    key_changes: bool


@dataclass(slots=True)
class Rewrite:
    """The mirror buckets one merge rewrites."""

    buckets: int  # the table's bucket count after the merge
    touched: set[int]  # the buckets rewritten
    existing: set[int]  # the buckets on disk before the merge
    dirs: list[str]  # the directories of the rewritten buckets that exist (their rows take part)


def apply_table(spark: SparkSession, t: TableInput, default_buckets: int, below: str | None = None,
                ranged: str | None = None) -> TableResult:
    """Stage the change-log files and the rewritten mirror buckets of one table.

    Two Spark jobs whatever the number of landed batches: the change-log write,
    which also measures what the mirror's plan needs (event count, truncate,
    touched buckets), and the mirror write.
    """
    events = read_by_identity(spark, t.files, fill=False)  # under the latest names (docs/spark.md, Schema changes)
    if t.prev.watermark:
        events = events.filter(F.col(CDC_POS) >= F.lit(t.prev.watermark))
    # Not cached: the landed files are read twice (change-log, mirror), which costs less than caching them.
    types = {f.name: f.dataType for f in events.schema.fields}
    columns = state_columns(t.cols, types, identity(t.files))
    last_pos = max(f.entry.last_position for f in t.files)
    state = TableState(max(t.prev.watermark, last_pos), t.run_id, columns, t.prev.buckets or default_buckets)
    result = TableResult(state)
    # the deduplicated events go on to the mirror too: a re-delivered event is already in it
    log, found = _write_changelog(spark, t, events, types, result)
    result.events = found.events
    found.truncate_pos = threshold(found.truncate_pos, below)  # a completed re-snapshot: the rows below go
    plan = _plan_rewrite(t, found, state, ranged is not None)
    _write_mirror(spark, t, _mirror_rows(spark, t, log, types, found, plan, ranged), plan, result)
    return result


def _write_changelog(spark: SparkSession, t: TableInput, events: DataFrame, types: dict[str, DataType],
                     result: TableResult) -> tuple[DataFrame, Measured]:
    """Stage the change-log files of the new events; the events without re-deliveries, and their measures."""
    buckets = result.state.buckets
    has_before_key = CDC_BEFORE_KEY in events.columns
    # change-log: every new event, each file in position order (no coalesce: it would serialise the job)
    first_pos = min(f.entry.first_position for f in t.files)
    log = events
    if t.prev.watermark and first_pos <= t.prev.watermark:
        log = _changelog_events(spark, events, t.key, t.prev, t.run_id, t.changelog_dir)
    # everything the mirror plan depends on, measured while the change-log is written (no job of its own)
    row_bucket = F.when(F.col(CDC_OP) != "t", _bucket([F.col(k).cast(types[k]) for k in t.key], buckets))
    touched_sets = [F.collect_set(row_bucket).alias("touched")]
    if has_before_key:
        moved = [F.col(CDC_BEFORE_KEY).getField(k).cast(types[k]) for k in t.key]
        touched_sets.append(
            F.collect_set(F.when(F.col(CDC_BEFORE_KEY).isNotNull(), _bucket(moved, buckets))).alias("moved")
        )
        touched_sets.append(F.count_if(F.col(CDC_BEFORE_KEY).isNotNull()).alias("key_changes"))
    measures = [
        F.count(F.lit(1)).alias("events"),
        F.max(F.when(F.col(CDC_OP) == "t", F.col(CDC_POS))).alias("truncate"),
        F.array_distinct(F.flatten(F.collect_set(CDC_UNAVAILABLE))).alias("unavailable"),
        *touched_sets,
    ]
    seen = Observation(f"cdcd-{uuid.uuid4().hex}")
    observed = log.observe(seen, *measures)
    staged_log = t.work / "changelog"
    with _job(spark, result, "changelog"):
        observed.sortWithinPartitions(CDC_POS, CDC_BATCH, CDC_INDEX).write.parquet(str(staged_log))
    tag = uuid.uuid4().hex[:12]  # a replayed batch must never overwrite the log files of its first application
    for n, part in enumerate(sorted(staged_log.glob("part-*.parquet"))):
        result.files.append((str(part), str(t.changelog_dir / f"{t.files[0].seq:020d}-{tag}-{n:04d}.parquet")))
    agg = _observed(seen)
    if agg is None:  # not reported (the optimizer dropped the node): measure with a job of its own
        first = log.agg(*measures).first()
        assert first is not None
        agg = first.asDict()
    return log, Measured(
        events=int(agg["events"]),
        truncate_pos=agg["truncate"],
        unavailable=set(agg["unavailable"] or ()),
        touched={int(b) for name in ("touched", "moved") for b in agg.get(name) or ()},
        key_changes=bool(int(agg.get("key_changes") or 0)),
    )


def _plan_rewrite(t: TableInput, found: Measured, state: TableState, ranged: bool = False) -> Rewrite:
    """Which buckets to rewrite, and how many the table has after the merge (updates ``state.buckets``)."""
    touched = set(found.touched)
    table_dir = t.table_dir
    existing = {int(d.name.split("=", 1)[1]) for d in table_dir.glob(f"{BUCKET}=*")} if table_dir.is_dir() else set()
    # (a column's id, the third item, is no change of the files: a state written before ids were kept has none)
    schema_changed = bool(t.prev.columns) and [c[:2] for c in t.prev.columns] != [c[:2] for c in state.columns]
    rewrite_all = found.truncate_pos is not None or ranged or schema_changed or touched >= existing
    if rewrite_all:
        touched |= existing
    # A new table gets buckets for its first rows; a table that outgrew its buckets gets more when
    # this merge rewrites all of them anyway, so that a small batch later rewrites a small part.
    buckets = state.buckets
    if not t.prev.buckets and not existing:
        buckets = sized_buckets(found.events, buckets)
    elif rewrite_all and t.prev.rows is not None:
        buckets = sized_buckets(t.prev.rows + found.events, buckets)
    if buckets != state.buckets:
        state.buckets = buckets
        touched |= set(range(buckets))
    dirs = [str(d) for d in (table_dir / f"{BUCKET}={b}" for b in sorted(touched)) if d.is_dir()]
    return Rewrite(buckets, touched, existing, dirs)


def _mirror_rows(spark: SparkSession, t: TableInput, log: DataFrame, types: dict[str, DataType], found: Measured,
                 plan: Rewrite, ranged: str | None = None) -> DataFrame:
    """The rewritten buckets' rows: the events and the buckets' existing rows, by the ordering rule; without the
    rows of ``ranged`` (ranged covered records' condition, ``Covered.gone``), as Delta's DELETE after the MERGE."""
    cols, key = t.cols, t.key
    ident = identity(t.files)
    actions = action_rows(older_rows_filled(log, t.files, ident, types), cols, key, types, found.key_changes)
    if found.truncate_pos is not None:
        actions = actions.filter(F.col(CDC_POS) >= F.lit(found.truncate_pos))
    if ranged is not None:
        actions = actions.filter(_kept(ranged))
    merged = actions
    if plan.dirs:
        held = spark.read.option("basePath", str(t.table_dir)).parquet(*plan.dirs)
        old = existing_rows(mirror_rows_by_identity(held, t.prev.columns, ident, types), cols, key, types)
        if found.truncate_pos is not None:
            old = old.filter(F.col(CDC_POS) >= F.lit(found.truncate_pos))
        if ranged is not None:
            old = old.filter(_kept(ranged))
        merged = actions.unionByName(old)
    if found.key_changes:
        merged = resolve_moves(merged, key, sorted(found.unavailable & set(cols)))
    # the bucket is recomputed for old rows too: a key column's type change moves them
    merged = merged.withColumn(BUCKET, _bucket([F.col(k) for k in key], plan.buckets))

    aggs, _, value = latest_per_key(cols, key, found.unavailable, F.struct(*ORDER))
    # partitioned by bucket first: the grouping reuses that shuffle and each task writes whole buckets
    grouped = merged.repartition(BUCKET).groupBy(BUCKET, *key).agg(*aggs)
    return grouped.filter(F.col("_f").getField(KIND) != "D").select(
        *[value(c).alias(c) for c in cols],
        *[F.col("_f").getField(m).alias(m) for m in MIRROR_META],
        F.col(BUCKET),
    )


def _write_mirror(spark: SparkSession, t: TableInput, out: DataFrame, plan: Rewrite, result: TableResult) -> None:
    """Stage the rewritten buckets and the swaps that put them in place; count the mirror's rows."""
    state = result.state
    written = Observation(f"cdcd-{uuid.uuid4().hex}")
    out = out.observe(written, F.count(F.lit(1)).alias("rows"))
    staged = t.work / "mirror"
    with _job(spark, result, "mirror"):
        out.write.partitionBy(BUCKET).parquet(str(staged))
    # the mirror's row count, for the bucket sizing: exact once every bucket has been rewritten
    counted = _observed(written)
    if counted is None:
        state.rows = None
    elif plan.touched >= plan.existing:
        state.rows = int(counted["rows"])
    elif t.prev.rows is not None:
        state.rows = t.prev.rows - _parquet_rows(plan.dirs) + int(counted["rows"])
    for b in sorted(plan.touched):
        new = staged / f"{BUCKET}={b}"
        result.buckets.append((str(new) if new.is_dir() else None, str(t.table_dir / f"{BUCKET}={b}")))


def _kept(gone: str) -> Column:
    """The rows a covered condition (``Covered.gone``, Spark SQL) does not remove (a NULL key stays)."""
    return ~F.coalesce(F.expr(gone), F.lit(False))


def rewrite_parquet(spark: SparkSession, table_dir: Path, prev: TableState, gone: str,
                    work: Path) -> tuple[TableState, list[tuple[str | None, str]]]:
    """A mirror table without events in the segment but with a covered record: rewrite the buckets that hold rows
    below.

    One job finds those buckets (and how many rows go), one writes them again without those rows;
    the returned swaps go into the job's journal like the bucket rewrite's.
    """
    if not any(table_dir.glob(f"{BUCKET}=*/*.parquet")):
        return prev, []
    mirror = spark.read.option("basePath", str(table_dir)).parquet(str(table_dir))
    counted = {int(r[BUCKET]): int(r["n"]) for r in mirror.filter(~_kept(gone))
               .groupBy(BUCKET).agg(F.count(F.lit(1)).alias("n")).collect()}
    if not counted:
        return prev, []
    dirs = [str(table_dir / f"{BUCKET}={b}") for b in sorted(counted)]
    staged = work / f"covered-{uuid.uuid4().hex[:12]}"
    kept = spark.read.option("basePath", str(table_dir)).parquet(*dirs).filter(_kept(gone))
    kept.write.partitionBy(BUCKET).parquet(str(staged))
    swaps: list[tuple[str | None, str]] = []
    for b in sorted(counted):
        new = staged / f"{BUCKET}={b}"
        swaps.append((str(new) if new.is_dir() else None, str(table_dir / f"{BUCKET}={b}")))
    rows = None if prev.rows is None else prev.rows - sum(counted.values())
    return replace(prev, rows=rows), swaps


def _logged_positions(log_dir: Path, op: str) -> list[str]:
    """The positions of a change-log's rows of ``op``, read with pyarrow: its files keep the types each merge
    wrote (a widened column's older files another type), which Spark's schema merging refuses."""
    fields = [f for f in META_FIELDS if f.name in (CDC_OP, CDC_POS)]
    table = ds.dataset(log_dir, schema=pa.schema(fields)).to_table(filter=pc.field(CDC_OP) == op)
    return [str(p) for p in table.column(CDC_POS).to_pylist()]


def _schema_change_rows(segment: Segment, tables: dict[str, TableState], store: TargetStore,
                        work: Path) -> list[tuple[str, str]]:
    """The segment's schema changes as change-log rows (``cdcd.spark.schemalog``): one staged file per table,
    moved into its change-log by the journal with the events. A change at or below the watermark (landed again
    after a daemon's crash) that the change-log holds already is left out."""
    staged: list[tuple[str, str]] = []
    for (schema, name), changes in sorted(schemalog.changes_by_table(segment.batches, tables).items()):
        table = f"{schema}.{name}"
        log_dir = store.changelog_dir(table)
        if not any(log_dir.glob("*.parquet")) and (schema, name) not in segment.tables():
            continue  # no row of the table applied yet: its first rows carry the schema as it is (as on Delta)
        rows = schemalog.change_rows(table, changes)
        watermark = tables[table].watermark if table in tables else ""
        if watermark and any(r[CDC_POS] <= watermark for r in rows) and any(log_dir.glob("*.parquet")):
            logged = set(_logged_positions(log_dir, schemalog.SCHEMA_OP))
            rows = [r for r in rows if r[CDC_POS] not in logged]
        if not rows:
            continue
        fields = [f for f in META_FIELDS if f.name in rows[0]] + [pa.field(schemalog.CDC_SCHEMA_CHANGE, pa.string())]
        arrow = pa.schema(fields)
        path = work / f"schema-{schema}.{name}.parquet"
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.Table.from_pylist(rows, arrow), path)
        seq = min(r[CDC_BATCH] for r in rows)
        staged.append((str(path), str(log_dir / f"{seq:020d}-{uuid.uuid4().hex[:12]}-schema.parquet")))
    return staged


class Parquet:
    """``--format parquet``: each table of a segment through ``apply_table``; the job's journal swaps them in."""

    name = "parquet"

    def __init__(self, store: TargetStore, buckets: int) -> None:
        self.store = store
        self.buckets = buckets  # of a new mirror table (sized up from its rows)

    def apply(self, spark: SparkSession, segment: Segment, tables: dict[str, TableState]) -> Applied:
        work = self.store.work_dir / f"{segment.first:020d}"
        out = Applied()
        cover = segment.covered()
        for n, ((schema, name), files) in enumerate(sorted(segment.tables().items())):
            table = f"{schema}.{name}"
            t = TableInput(table, files, tables.get(table, TableState()), segment.run_id,
                           self.store.table_dir(table), self.store.changelog_dir(table), work / f"t{n}")
            c = cover.pop((schema, name), None)
            with applying(table):
                r = apply_table(spark, t, self.buckets, c.below if c else None,
                                c.ranged_gone(CDC_POS, literal) if c else None)
            out.tables[table] = r.state
            out.events += r.events
            out.timings[table] = r.timings
            out.files += r.files
            out.buckets += r.buckets
        out.files += _schema_change_rows(segment, tables, self.store, work)
        for (schema, name), c in sorted(cover.items()):  # covered tables without events in the segment
            table = f"{schema}.{name}"
            if table in tables:
                out.tables[table], swaps = rewrite_parquet(spark, self.store.table_dir(table), tables[table],
                                                           c.gone(CDC_POS, literal), work)
                out.buckets += swaps
        return out

    def files_before(self, tables: list[tuple[str, str]]) -> None:
        pass

    def files_after(self, applied: Applied, tables: list[tuple[str, str]],
                    since: float) -> tuple[int | None, int | None]:
        """The change-log files staged and the buckets rewritten."""
        return len(applied.files), len(applied.buckets)
