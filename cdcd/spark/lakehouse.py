"""Delta Lake / Iceberg targets (``--format delta|iceberg``): MERGE INTO with the position rule.

Per micro-batch and table: the events are collapsed to one action per key
(``cdcd.spark.collapse``), a truncate becomes ``DELETE ... WHERE _cdc_pos <
<truncate>``, then one ``MERGE INTO`` applies the actions to the mirror and
an insert-only ``MERGE INTO`` adds the new events to the change-log. Every
statement is idempotent, so the job's journal (``cdcd.spark.state``)
records the applied batch after all of them and a crash in between is
repaired by applying the batch again (``LakehouseStrategy``, the job's
``ApplyStrategy`` for both formats). Only usable when the format's jars
are on Spark's classpath.
"""

from __future__ import annotations

import json
import math
import re
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import (
    ArrayType,
    ByteType,
    DataType,
    DateType,
    DecimalType,
    DoubleType,
    FloatType,
    IntegerType,
    LongType,
    MapType,
    ShortType,
    StringType,
    StructField,
    StructType,
    TimestampNTZType,
    TimestampType,
)

from cdcd.landing.reader import LandedFile
from cdcd.spark import jars
from cdcd.spark import lakehouse_sql as sql
from cdcd.spark.adopt import adopt, one_version, same_columns
from cdcd.spark.collapse import Prepared, conformed, prepare, release
from cdcd.spark.covered import apply_lakehouse as apply_covered
from cdcd.spark.session import FORMAT_SETTINGS, session
from cdcd.spark.state import TableState, TargetStore
from cdcd.spark.strategy import Applied, Segment, applying

ICEBERG_CATALOG = "cdcd"
_FETCH = "run scripts/bootstrap.sh (it fetches the jars into .jars/) or set CDCD_SPARK_JARS to a directory holding them"
_MARKER_CLASS = {
    "delta": ("io.delta.sql.DeltaSparkSessionExtension", jars.packages_line(jars.DELTA_PACKAGES)),
    "iceberg": ("org.apache.iceberg.spark.SparkCatalog", jars.packages_line(jars.ICEBERG_PACKAGES)),
}
#: Delta can drop a column (the mirror follows the source's DROP COLUMN) only with column mapping. A small
#: batch must not rewrite the data files of a large mirror: Delta marks changed rows in deletion vectors,
#: Iceberg writes position deletes (merge-on-read) instead of copying the files.
_MIRROR_PROPERTIES = {
    "delta": {"delta.columnMapping.mode": "name", "delta.enableDeletionVectors": "true"},
    "iceberg": {"format-version": "2", "write.merge.mode": "merge-on-read", "write.delete.mode": "merge-on-read",
                "write.update.mode": "merge-on-read"},
}
_LOG_PROPERTIES = {"delta": {}, "iceberg": {"format-version": "2"}}
#: Types Delta keeps statistics for (``delta.dataSkippingStatsColumns`` refuses others).
_DELTA_STATS_TYPES = (ByteType, ShortType, IntegerType, LongType, FloatType, DoubleType, DateType, TimestampType,
                      TimestampNTZType, StringType, DecimalType)
FORMAT_MARKER = "format"  # TARGET/state/format: the target's table format


def check_format(spark: SparkSession, fmt: str) -> str | None:
    """None when ``fmt`` can be used in this session, else what to do about it."""
    cls, packages = _MARKER_CLASS[fmt]
    jvm = spark._jvm
    try:
        assert jvm is not None
        jvm.java.lang.Class.forName(cls, True, jvm.Thread.currentThread().getContextClassLoader())
    except Exception:
        return (f"--format {fmt}: {cls} is not on Spark's classpath; {_FETCH}, or start the job with "
                f"spark-submit {packages} (docs/spark.md)")
    for k, v in FORMAT_SETTINGS[fmt].items():
        have = spark.conf.get(k, "") or ""
        if v not in have.split(","):
            return f"--format {fmt}: the session was started without --conf {k}={v} (docs/spark.md)"
    return None


#: The catalog settings this process registered itself (a catalog the user configured is left alone).
_REGISTERED: dict[str, str] = {}


def iceberg_settings(target: Path) -> dict[str, str]:
    """The default Iceberg catalog: JDBC on an embedded SQLite file under TARGET, warehouse TARGET."""
    prefix = f"spark.sql.catalog.{ICEBERG_CATALOG}"
    root = target.resolve()
    return {prefix: "org.apache.iceberg.spark.SparkCatalog", f"{prefix}.type": "jdbc",
            f"{prefix}.uri": f"jdbc:sqlite:{root / 'state' / 'iceberg-catalog.db'}",
            f"{prefix}.jdbc.schema-version": "V1", f"{prefix}.warehouse": root.as_uri()}


def check_target(spark: SparkSession, fmt: str, target: Path) -> str | None:
    """None when TARGET can take ``fmt`` tables (registers the Iceberg catalog), else why not."""
    marker = target / "state" / FORMAT_MARKER
    if marker.exists() and marker.read_text().strip() != fmt:
        return f"--format {fmt}: {target} holds {marker.read_text().strip()} tables; use a new --target"
    if not marker.exists() and (target / "state" / "consumer.json").exists():
        return f"--format {fmt}: {target} holds a Parquet mirror (--format parquet); use a new --target"
    if fmt == "iceberg":
        prefix = f"spark.sql.catalog.{ICEBERG_CATALOG}"
        ours = bool(_REGISTERED) and all(spark.conf.get(k, None) == v for k, v in _REGISTERED.items())
        if spark.conf.get(prefix, None) is not None and not ours:
            return None  # a catalog given with --conf (JDBC on PostgreSQL, REST, ...): used as it is
        wanted = iceberg_settings(target)
        if any(spark.conf.get(k, None) != v for k, v in wanted.items()):
            (target / "state").mkdir(parents=True, exist_ok=True)
            for k, v in wanted.items():
                spark.conf.set(k, v)
                _REGISTERED[k] = v
            jsession = spark._jsparkSession
            jsession.sessionState().catalogManager().reset()  # another target before, in this process
    return None


def prepare_run(fmt: str, target: Path, only: bool = False) -> str | None:
    """Start the session for ``fmt`` (``only``: for it alone, ``session``); None when the run can go on, else the
    problem (exit 2)."""
    spark = session(fmt, only)
    return check_format(spark, fmt) or check_target(spark, fmt, target)


@dataclass(frozen=True, slots=True)
class Names:
    """Where a source table's mirror and change-log live, as SQL table references."""

    fmt: str
    target: Path

    def mirror(self, schema: str, table: str) -> str:
        return self.ref("tables", schema, table)

    def changelog(self, schema: str, table: str) -> str:
        return self.ref("changelog", schema, table)

    def namespaces(self, schema: str) -> list[str]:
        """Iceberg namespaces to create first (Delta's path tables need none)."""
        if self.fmt != "iceberg":
            return []
        return [sql.catalog_table(ICEBERG_CATALOG, kind, schema) for kind in ("tables", "changelog")]

    def location(self, kind: str, schema: str, table: str) -> Path:
        """A Delta table's directory: TARGET/tables/<schema>.<table>/, as in Parquet mode."""
        return self.target.resolve() / kind / f"{schema}.{table}"

    def exists(self, spark: SparkSession, kind: str, schema: str, table: str) -> bool:
        """Whether the table was created, asked of the format (works on object storage too)."""
        jvm = spark._jvm
        assert jvm is not None
        if self.fmt == "delta":
            jsession = spark._jsparkSession
            path = self.location(kind, schema, table).as_uri()
            return bool(jvm.io.delta.tables.DeltaTable.isDeltaTable(jsession, path))
        return bool(spark.catalog.tableExists(self.ref(kind, schema, table)))

    def ref(self, kind: str, schema: str, table: str) -> str:
        if self.fmt == "delta":
            return sql.delta_table(self.location(kind, schema, table).as_uri())
        return sql.catalog_table(ICEBERG_CATALOG, kind, schema, table)


@dataclass(slots=True)
class Changes:
    adds: list[tuple[list[str], DataType]] = field(default_factory=list)
    drops: list[list[str]] = field(default_factory=list)
    retypes: list[tuple[list[str], DataType]] = field(default_factory=list)


def stored_type(dt: DataType, fmt: str) -> str:
    """How the format stores ``dt``, nullability aside: Iceberg keeps tinyint and smallint as int."""
    if isinstance(dt, StructType):
        return "struct<" + ",".join(f"{f.name}:{stored_type(f.dataType, fmt)}" for f in dt.fields) + ">"
    if isinstance(dt, ArrayType):
        return f"array<{stored_type(dt.elementType, fmt)}>"
    if isinstance(dt, MapType):
        return f"map<{stored_type(dt.keyType, fmt)},{stored_type(dt.valueType, fmt)}>"
    if fmt == "iceberg" and isinstance(dt, ByteType | ShortType):
        return "int"
    return dt.simpleString()


_INT_RANK = {"tinyint": 1, "smallint": 2, "int": 3, "bigint": 4}


def holds(old: DataType, new: DataType) -> bool:
    """Whether a column of type ``old`` stores every value of ``new`` exactly (a narrowed source column)."""
    if isinstance(old, DecimalType) and isinstance(new, DecimalType):
        return old.precision - old.scale >= new.precision - new.scale and old.scale >= new.scale
    o, n = old.simpleString(), new.simpleString()
    if o in _INT_RANK and n in _INT_RANK:
        return _INT_RANK[o] >= _INT_RANK[n]
    return (o, n) == ("double", "float")


def schema_changes(have: StructType, want: StructType, fmt: str, drop: bool,
                   prefix: list[str] | None = None) -> Changes:
    """The ALTERs that make table schema ``have`` hold ``want`` (struct fields compared by name)."""
    path = prefix or []
    out = Changes()
    current = {f.name: f.dataType for f in have.fields}
    wanted = {f.name for f in want.fields}
    for f in want.fields:
        old = current.get(f.name)
        if old is None:
            out.adds.append(([*path, f.name], f.dataType))
        elif isinstance(old, StructType) and isinstance(f.dataType, StructType):
            inner = schema_changes(old, f.dataType, fmt, drop, [*path, f.name])
            out.adds += inner.adds
            out.drops += inner.drops
            out.retypes += inner.retypes
        elif stored_type(old, fmt) != stored_type(f.dataType, fmt) and not holds(old, f.dataType):
            # a narrowed column keeps its wider type (the MERGE casts up); anything else is altered
            out.retypes.append(([*path, f.name], f.dataType))
    if drop:
        out.drops += [[*path, f.name] for f in have.fields if f.name not in wanted]
    return out


#: Characters Delta refuses in a column name unless column mapping is on.
_MAPPED_ONLY = re.compile(r"[ ,;{}()\n\t=]")
_MAPPING = {"delta.columnMapping.mode": "name"}


def plain_names(schema: StructType) -> bool:
    """Whether Delta takes every column name of ``schema`` without column mapping."""
    return not any(_MAPPED_ONLY.search(f.name) for f in schema.fields)


def ddl(table: str, have: StructType | None, want: StructType, fmt: str, properties: dict[str, str],
        drop: bool) -> list[str]:
    """CREATE TABLE for a new table, else the ALTER TABLEs of the schema change (none: same schema).

    A Delta table with column mapping whose column names Delta takes without it is created without it,
    then column mapping is switched on: its first columns keep their names as physical names (a new
    table with column mapping would get generated ones), so landed Parquet files can become its data
    files as they are (``cdcd.spark.adopt``). A drop switches it on again first (a no-op when on): a crash
    between the two statements must not leave a mirror that cannot drop a column.
    """
    mapped = fmt == "delta" and properties.get("delta.columnMapping.mode") == "name"
    if have is None:
        if mapped and plain_names(want):
            plain = {k: v for k, v in properties.items() if k not in _MAPPING}
            return [sql.create_table(table, want, fmt, plain), sql.set_properties(table, _MAPPING)]
        return [sql.create_table(table, want, fmt, properties)]
    changes = schema_changes(have, want, fmt, drop)
    out = [sql.add_columns(table, changes.adds)] if changes.adds else []
    out += [sql.change_type(table, p, t) for p, t in changes.retypes]
    if changes.drops:
        out += [sql.set_properties(table, _MAPPING)] if mapped else []
        out.append(sql.drop_columns(table, changes.drops))
    return out


def mirror_schema(p: Prepared) -> StructType:
    return StructType([StructField(c, p.types[c]) for c in p.mirror_columns])


def table_schema(spark: SparkSession, names: Names, kind: str, schema: str, table: str) -> StructType | None:
    """The table's schema, None when it does not exist yet."""
    if not names.exists(spark, kind, schema, table):
        return None
    return spark.table(names.ref(kind, schema, table)).schema


@dataclass(slots=True)
class Statements:
    """Everything one table's micro-batch runs, in order."""

    namespaces: list[str]
    changelog_ddl: list[str]
    changelog_merge: str
    changelog_append: str
    mirror_ddl: list[str]
    truncate: str | None
    mirror_merge: str
    mirror_insert: str  # instead of mirror_merge when the mirror was created by this batch
    mirror_holds_a_key: str  # a row when the mirror holds a key of the batch (``_appends_new_keys``)


def statements(p: Prepared, names: Names, schema: str, table: str, log_have: StructType | None,
               mirror_have: StructType | None, sources: tuple[str, str], positions: tuple[str, str]) -> Statements:
    """The SQL of one table's micro-batch given the tables' current schemas (None: not created yet)."""
    using = names.fmt
    log, mirror = names.changelog(schema, table), names.mirror(schema, table)
    log_want = _union(log_have, p.events.schema)
    r = p.facts.key_range
    prune = sql.key_range(r.column, p.types[r.column], r.lowest, r.highest, r.nulls) if r is not None else None
    return Statements(
        [sql.create_namespace(ns) for ns in names.namespaces(schema)],
        ddl(log, log_have, log_want, using, changelog_properties(using, p), drop=False),
        sql.changelog_merge(log, sources[0], p.key, log_want.fieldNames(), *positions),
        sql.append(log, sources[0], log_want.fieldNames()),
        ddl(mirror, mirror_have, mirror_schema(p), using, mirror_properties(using, p), drop=True),
        sql.truncate_before(mirror, p.facts.truncate_pos) if p.facts.truncate_pos is not None else None,
        sql.mirror_merge(mirror, sources[1], p.key, p.mirror_columns, p.keep, prune),
        sql.mirror_insert(mirror, sources[1], p.mirror_columns),
        sql.holds_a_key(mirror, sources[1], p.key, prune),
    )


def mirror_properties(fmt: str, p: Prepared) -> dict[str, str]:
    """A new mirror's properties: see ``_MIRROR_PROPERTIES``; on Delta, file statistics on the key columns and
    ``_cdc_pos`` only (``stats_columns``): the MERGE prunes by the first key column, and statistics of every
    other column cost a fifth of a merge's CPU in the tasks that write the mirror."""
    props = dict(_MIRROR_PROPERTIES[fmt])
    if fmt == "delta":
        props["delta.dataSkippingStatsColumns"] = stats_columns(p)
    return props


def stats_columns(p: Prepared) -> str:
    """The position and the key columns of a type Delta keeps statistics for, as a Delta property value."""
    stats = ["_cdc_pos", *[k for k in p.key if isinstance(p.types[k], _DELTA_STATS_TYPES)]]
    return ",".join(sql.q(c) for c in dict.fromkeys(stats))


def changelog_properties(fmt: str, p: Prepared) -> dict[str, str]:
    """A new change-log's properties. Delta collects file statistics on the position and the key columns only:
    the change-log's MERGE prunes on ``_cdc_pos``, and statistics of every other column (Delta's default: the
    first 32) cost time in every append and are of little use for a log read by position or key."""
    props = dict(_LOG_PROPERTIES[fmt])
    if fmt == "delta":
        props["delta.dataSkippingStatsColumns"] = stats_columns(p)
    return props


def _union(have: StructType | None, landed: StructType) -> StructType:
    """The change-log keeps every column it ever had (old events keep their values); new ones are added."""
    if have is None:
        return StructType([StructField(f.name, f.dataType) for f in landed.fields])
    names = set(have.fieldNames())
    fields = [StructField(f.name, _merged(f.dataType, landed[f.name].dataType) if f.name in landed.fieldNames()
                          else f.dataType) for f in have.fields]
    return StructType(fields + [StructField(f.name, f.dataType) for f in landed.fields if f.name not in names])


def _merged(have: DataType, landed: DataType) -> DataType:
    if isinstance(have, StructType) and isinstance(landed, StructType):
        return _union(have, landed)
    return landed


ICEBERG_PROPERTY = "spark.sql.iceberg.snapshot-property."
DELTA_TXN = ("spark.databricks.delta.write.txnAppId", "spark.databricks.delta.write.txnVersion")
BATCH_PROPERTY = "cdcd.batch"  # Iceberg snapshot summary: the last landed batch seq this commit applied
STEP_PROPERTY = "cdcd.step"  # Iceberg snapshot summary: which statement (changelog, truncate, mirror)


@contextmanager
def recorded(spark: SparkSession, fmt: str, step: str, seq: int) -> Iterator[None]:
    """Run a statement whose commit records that it applied landed batches up to ``seq``.

    Delta: the idempotent-write transaction (appId ``cdcd-<step>``, version ``seq``), kept
    in the table's log; Delta itself skips a statement whose version it already holds.
    Iceberg: snapshot summary properties ``cdcd.step`` and ``cdcd.batch`` on the commit.
    """
    if fmt == "delta":
        settings = {DELTA_TXN[0]: f"cdcd-{step}", DELTA_TXN[1]: str(seq)}
    else:
        settings = {ICEBERG_PROPERTY + STEP_PROPERTY: step, ICEBERG_PROPERTY + BATCH_PROPERTY: str(seq)}
    for k, v in settings.items():
        spark.conf.set(k, v)
    try:
        yield
    finally:
        for k in settings:
            spark.conf.unset(k)


def applied_seq(spark: SparkSession, names: Names, kind: str, schema: str, table: str, step: str) -> int:
    """The highest batch seq the table's own commits record for ``step`` (0: none)."""
    if names.fmt == "delta":
        jvm = spark._jvm
        assert jvm is not None
        log = jvm.org.apache.spark.sql.delta.DeltaLog.forTable(
            spark._jsparkSession, names.location(kind, schema, table).as_uri())
        version = log.update(False, jvm.scala.Option.empty(), jvm.scala.Option.empty()).transactions().get(
            f"cdcd-{step}")
        return int(version.get()) if version.isDefined() else 0
    snapshots = names.ref(kind, schema, table) + ".`snapshots`"
    row = spark.sql(f"SELECT max(CAST(summary[{sql.literal(BATCH_PROPERTY)}] AS BIGINT)) FROM {snapshots} "
                    f"WHERE summary[{sql.literal(STEP_PROPERTY)}] = {sql.literal(step)}").first()
    return int(row[0]) if row is not None and row[0] is not None else 0


@dataclass(slots=True)
class Held:
    """Per table and step, the highest batch seq the table's commits record: read from the table the first
    time (``applied_seq``, a Spark job over its log), then kept from this process's own commits. Exact
    because one consumer applies to a target (``state.lock_target``); forgotten after a failed merge,
    whose commits are not known."""

    seqs: dict[tuple[str, str, str], int] = field(default_factory=dict)  # (kind, "schema.table", step)

    def seq(self, spark: SparkSession, names: Names, kind: str, schema: str, table: str, step: str) -> int:
        key = (kind, f"{schema}.{table}", step)
        if key not in self.seqs:
            self.seqs[key] = applied_seq(spark, names, kind, schema, table, step)
        return self.seqs[key]

    def applied(self, kind: str, schema: str, table: str, step: str, seq: int) -> None:
        """Record that the table's commits now record ``seq`` (or a later batch) for ``step``."""
        key = (kind, f"{schema}.{table}", step)
        self.seqs[key] = max(self.seqs.get(key, 0), seq)


@contextmanager
def _timed(timings: dict[str, float], name: str) -> Iterator[None]:
    began = time.monotonic()
    try:
        yield
    finally:
        timings[name] = timings.get(name, 0.0) + time.monotonic() - began


def apply_lakehouse_table(spark: SparkSession, names: Names, schema: str, table: str, files: list[LandedFile],
                          prev: TableState, run_id: str, timings: dict[str, float] | None = None,
                          held: Held | None = None) -> tuple[TableState, int]:
    """Apply one table's landed files to its change-log and mirror; the new table state and the event count.

    Each statement's commit records the last batch seq it applied (``recorded``), and a
    statement the table already holds is skipped: a batch applied twice, or again after
    a crash between two statements, leaves the tables as they are. The change-log takes
    a plain append when it holds none of the events yet, else an insert-only MERGE. On
    Delta Lake the append records its batch in its own write options (or its own commit,
    when the landed files join the table as they are: ``cdcd.spark.adopt``, also for a new
    mirror of one insert or update per key), not in the session, so it runs in a second
    thread while the mirror's statements run: the two writes share the cores, and one's
    driver-side work (planning, the Delta commit) overlaps the other's tasks.
    """
    seq = files[-1].seq
    took = timings if timings is not None else {}
    record = held if held is not None else Held()
    with _timed(took, "prepare"):
        mirror_have = table_schema(spark, names, "tables", schema, table)
        target = spark.table(names.mirror(schema, table)) if mirror_have is not None else None
        p = prepare(spark, files, prev.watermark, target)
    try:
        last_pos = max(f.entry["last_position"] for f in files)
        state = TableState(max(prev.watermark, last_pos), run_id,
                           [[c, p.types[c].simpleString()] for c in p.cols], 0)
        if p.facts.events == 0:  # everything re-delivered below the watermark
            return state, 0
        lowest = max(prev.watermark, min(f.entry["first_position"] for f in files))
        tag = uuid.uuid4().hex[:12]
        views = (f"cdcd_log_{tag}", f"cdcd_src_{tag}")
        with _timed(took, "ddl"):
            log_have = table_schema(spark, names, "changelog", schema, table)
            plan = statements(p, names, schema, table, log_have, mirror_have, views, (lowest, last_pos))
            _run(spark, plan.namespaces)

            def changelog_side() -> tuple[int, StructType]:
                _run(spark, plan.changelog_ddl)
                # a table created by this merge holds no batch yet: no need to read its log for one
                found = record.seq(spark, names, "changelog", schema, table, "changelog") if log_have is not None else 0
                return found, (log_have if log_have is not None and not plan.changelog_ddl
                              else _required(spark, names, schema, table))

            # on Delta the two tables' DDL and log reads run side by side (driver work of separate tables, each
            # its own commits); Iceberg's catalog (SQLite by default) takes one statement at a time
            with ThreadPoolExecutor(max_workers=1, thread_name_prefix="cdcd-changelog-ddl") as pool:
                log_side = pool.submit(changelog_side) if names.fmt == "delta" else None
                _run(spark, plan.mirror_ddl)
                mirror_held = (record.seq(spark, names, "tables", schema, table, "mirror")
                               if mirror_have is not None else 0)
                log_held, log_schema = log_side.result() if log_side is not None else changelog_side()
        # an append unless the table may hold some of these events already: a batch of this
        # merge (an earlier attempt), or events the daemon landed again after its crash
        fresh = log_held < files[0].seq and min(f.entry["first_position"] for f in files) > prev.watermark
        beside = names.fmt == "delta" and fresh and log_held < seq
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="cdcd-changelog") as pool:
            side = None
            if beside and one_version(files) and same_columns(p.events.schema, log_schema):
                # the landed files are the change-log's rows as they are: no Spark write (cdcd.spark.adopt)
                side = pool.submit(_timed_call, took, "changelog", adopt, spark,
                                   names.location("changelog", schema, table), files, "cdcd-changelog", seq)
            elif beside:
                side = pool.submit(_timed_call, took, "changelog", _append_changelog, spark, names, schema, table,
                                   conformed(p.events, log_schema), seq)
            if not beside and log_held < seq:
                with _timed(took, "changelog"):
                    _register(spark, conformed(p.events, log_schema), views[0])
                    with recorded(spark, names.fmt, "changelog", seq):
                        _run(spark, [plan.changelog_append if fresh else plan.changelog_merge])
            with _timed(took, "mirror"):
                # the truncate comes first: a mirror that records the merge holds it. It is idempotent (rows
                # below its position) and Delta records it too; Iceberg may drop whole files without a snapshot
                # summary of ours (a metadata-only delete)
                if mirror_held < seq:
                    new_only = min(f.entry["first_position"] for f in files) > prev.watermark
                    _apply_mirror(spark, names, schema, table, p, plan, views[1], seq, mirror_have,
                                  files=files if new_only else None)
            if side is not None:
                side.result()  # the change-log's failure, if any, fails the merge
        record.applied("changelog", schema, table, "changelog", seq)
        record.applied("tables", schema, table, "mirror", seq)
        for v in views:
            spark.catalog.dropTempView(v)
        return state, p.facts.events
    finally:
        release(p)


def _apply_mirror(spark: SparkSession, names: Names, schema: str, table: str, p: Prepared, plan: Statements,
                  view: str, seq: int, have: StructType | None, files: list[LandedFile] | None) -> None:
    """``have``: the mirror's schema before this merge (None: created by it); ``files``: the landed files when
    every event in them is new to the table (none below its watermark)."""
    created = have is None
    if plan.truncate is not None:
        with recorded(spark, names.fmt, "truncate", seq):
            _run(spark, [plan.truncate])
    if (names.fmt == "delta" and files is not None and adoptable_mirror(p, files)
            and (created or _new_keys_only(spark, names, schema, table, p, plan, have))):
        # every landed row is a mirror row as it is (one insert or update per key, nothing else)
        adopt(spark, names.location("tables", schema, table), files, "cdcd-mirror", seq, key_stats(p))
        return
    if created and names.fmt == "delta":  # a mirror this merge created is empty: an append (no join)
        rows = p.mirror.filter(~F.col(sql.DELETE_FLAG)).select(*[F.col(c) for c in p.mirror_columns])
        _delta_append(in_key_ranges(rows, p), names.location("tables", schema, table), "mirror", seq)
        return
    _register(spark, in_key_ranges(p.mirror, p) if created else p.mirror, view)
    if names.fmt == "delta" and _appends_new_keys(spark, p, plan, have):
        rows = p.mirror.select(*[F.col(c) for c in p.mirror_columns])
        _delta_append(in_key_ranges(rows, p), names.location("tables", schema, table), "mirror", seq)
        return
    with recorded(spark, names.fmt, "mirror", seq):
        # a retry after a crash finds the mirror created (not empty, perhaps): MERGE
        _run(spark, [plan.mirror_insert if created else plan.mirror_merge])


#: A new mirror is written in key order, in files of about this many rows (``in_key_ranges``).
ROWS_PER_MIRROR_FILE = 1_000_000


def in_key_ranges(rows: DataFrame, p: Prepared) -> DataFrame:
    """The rows of a new mirror range-partitioned by key: each written file holds a range of keys of its own.

    The MERGE of a later small batch reads only the files whose key range meets the batch's (``key_range``).
    Written as they come, a new mirror's files each spanned the whole key range: the per-key collapse
    distributes rows by a hash of the key (and Spark packs landed files into tasks by size, not by key),
    so a 100-row batch read all 2,000,000 rows of a mirror built from a snapshot (docs/spark.md).
    """
    parts = max(1, math.ceil(p.facts.events / ROWS_PER_MIRROR_FILE))
    return rows.repartitionByRange(parts, *[F.col(k) for k in p.key])


def adoptable_mirror(p: Prepared, files: list[LandedFile]) -> bool:
    """Whether the landed files, as they are, hold exactly the rows of a new mirror: one event per key, no
    delete, key change or unavailable column (``Facts.unique``), no truncate (its event is a row of a landed
    file), one schema version, and a mirror created with its column names as physical names (``ddl``)."""
    return (p.facts.unique and p.facts.deletes == 0 and p.facts.truncate_pos is None
            and len(p.facts.file_ranges) == len(files)
            and one_version(files) and plain_names(mirror_schema(p)))


def _appends_new_keys(spark: SparkSession, p: Prepared, plan: Statements, have: StructType | None) -> bool:
    """Whether the batch's rows can be appended to an existing mirror, in key ranges, instead of MERGEd: one
    insert per key, no update or delete (``Facts.unique``; an update names a key the mirror most likely holds,
    and the question would cost every update merge a query), the mirror's schema the batch's, and none of
    the keys in the mirror (asked of it: ``plan.mirror_holds_a_key``, after the truncate if there is one).
    Then the MERGE would insert every row; its inserted rows would be laid out by a hash of the key (its
    join's), so each file of a large catch-up (a snapshot applied in several merges) would span the whole
    range of the batch's keys, which later small batches then read."""
    if not p.facts.unique or p.facts.deletes != 0 or p.facts.updates != 0 or have is None or plan.mirror_ddl:
        return False
    if not same_columns(mirror_schema(p), have):
        return False
    return not spark.sql(plan.mirror_holds_a_key).take(1)


def _new_keys_only(spark: SparkSession, names: Names, schema: str, table: str, p: Prepared, plan: Statements,
                   have: StructType | None) -> bool:
    """Whether landed files can join an existing Delta mirror as they are: its schema is the batch's (no
    change in this merge, every column stored under its own name) and it holds no row in the batch's key
    range, asked of the table itself (its file statistics skip every file outside the range, so a batch of new
    keys beyond the mirror's reads no data file)."""
    r = p.facts.key_range
    if have is None or plan.mirror_ddl or r is None or r.lowest is None or not same_columns(mirror_schema(p), have):
        return False
    jvm = spark._jvm
    assert jvm is not None
    log = jvm.org.apache.spark.sql.delta.DeltaLog.forTable(
        spark._jsparkSession, names.location("tables", schema, table).as_uri())
    stored = json.loads(log.update(False, jvm.scala.Option.empty(), jvm.scala.Option.empty()).metadata().schemaString())
    if not _own_physical_names(stored):
        return False  # a column added under column mapping: its data files name it otherwise
    inside = sql.key_range(r.column, p.types[r.column], r.lowest, r.highest, r.nulls)
    return not spark.sql(f"SELECT 1 FROM {names.mirror(schema, table)} t WHERE {inside} LIMIT 1").take(1)


def _own_physical_names(dt: Any) -> bool:
    """Whether every field of a Delta schema (its JSON form), nested ones too, is stored under its own name."""
    if not isinstance(dt, dict):
        return True  # a primitive type
    if dt.get("type") == "struct":
        return all(f.get("metadata", {}).get("delta.columnMapping.physicalName", f["name"]) == f["name"]
                   and _own_physical_names(f["type"]) for f in dt["fields"])
    return all(_own_physical_names(dt.get(k)) for k in ("elementType", "keyType", "valueType"))


def key_stats(p: Prepared) -> list[dict[str, Any]]:
    """Per landed file, the first key column's bounds as Delta statistics (integer and string keys), so that
    the MERGE of later batches skips the adopted files outside their key range."""
    first = p.key[0]
    if not isinstance(p.types[first], ByteType | ShortType | IntegerType | LongType | StringType):
        return [{} for _ in p.facts.file_ranges]
    # Delta uses a file's min/max only with its NULL count (a column of NULLs only has no min/max)
    return [{"minValues": {first: r[0]}, "maxValues": {first: r[1]}, "nullCount": {first: r[2]}}
            if r is not None and r[0] is not None else {} for r in p.facts.file_ranges]


def _append_changelog(spark: SparkSession, names: Names, schema: str, table: str, events: DataFrame,
                      seq: int) -> None:
    _delta_append(events, names.location("changelog", schema, table), "changelog", seq)


def _delta_append(df: DataFrame, location: Path, step: str, seq: int) -> None:
    """Append ``df`` to a Delta table, the commit recording ``seq`` as ``recorded`` does, but in the write's own
    options (Delta prefers them to the session's): a statement running beside it may set the session's."""
    (df.write.format("delta").mode("append").option("txnAppId", f"cdcd-{step}").option("txnVersion", str(seq))
     .save(location.as_uri()))


def _timed_call(timings: dict[str, float], name: str, fn: Callable[..., None], *args: Any) -> None:
    with _timed(timings, name):
        fn(*args)


def _required(spark: SparkSession, names: Names, schema: str, table: str) -> StructType:
    found = table_schema(spark, names, "changelog", schema, table)
    assert found is not None, f"the change-log of {schema}.{table} was just created"
    return found


def _register(spark: SparkSession, df: DataFrame, view: str) -> None:
    df.createOrReplaceTempView(view)


def _run(spark: SparkSession, statements_: list[str]) -> None:
    for s in statements_:
        spark.sql(s)


class LakehouseStrategy:
    """``--format delta|iceberg``: each table of a segment through ``apply_lakehouse_table`` (MERGE INTO)."""

    def __init__(self, spark: SparkSession, store: TargetStore, fmt: str) -> None:
        self.spark = spark
        self.names = Names(fmt, store.target)
        self.label = f"{fmt}: "
        self.held = Held()
        marker = store.state_dir / FORMAT_MARKER
        if not marker.exists():
            marker.write_text(fmt + "\n")

    def apply(self, segment: Segment, tables: dict[str, TableState]) -> Applied:
        # every statement is idempotent: a crash before the job's commit applies the batches again
        out = Applied()
        try:
            for (schema, table), files in sorted(segment.tables().items()):
                name = f"{schema}.{table}"
                out.timings[name] = {}
                with applying(name):
                    state, n = apply_lakehouse_table(self.spark, self.names, schema, table, files,
                                                     tables.get(name, TableState()), segment.run_id,
                                                     out.timings[name], self.held)
                out.tables[name] = state
                out.events += n
        except BaseException:
            self.held = Held()  # which of the failed merge's commits were made is not known: ask the tables
            raise
        apply_covered(self.spark, self.names, segment)  # completed re-snapshots, after the events
        return out
