"""What the Delta Lake and Iceberg targets share (``--format delta|iceberg``): MERGE INTO with the position rule.

Per micro-batch and table: the events are collapsed to one action per key
(``cdcd.spark.collapse``), a truncate becomes ``DELETE ... WHERE _cdc_pos <
<truncate>``, then one ``MERGE INTO`` applies the actions to the mirror and
an insert-only ``MERGE INTO`` adds the new events to the change-log. Every
statement is idempotent, so the job's journal (``cdcd.spark.state``)
records the applied batch after all of them and a crash in between is
repaired by applying the batch again. ``Lakehouse`` is the job's
``TableFormat`` for both; what differs between them (table references, DDL,
the commit record, Delta's appends without a MERGE) is a method of its
subclass, ``cdcd.spark.delta.Delta`` or ``cdcd.spark.iceberg.Iceberg``. Only
usable when the format's jars are on Spark's classpath.
"""

from __future__ import annotations

import math
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import ArrayType, DataType, MapType, StructType

from cdcd.landing.columns import CDC_POS
from cdcd.landing.objstore import is_object_url
from cdcd.landing.reader import LandedFile
from cdcd.spark import evolve, schemalog
from cdcd.spark import lakehouse_sql as sql
from cdcd.spark.collapse import Prepared, conformed, new_events, prepare, release
from cdcd.spark.commitrecord import CommitRecord, recorded
from cdcd.spark.evolve import CHANGELOG, MIRROR, Target
from cdcd.spark.held import Held
from cdcd.spark.identity import Identity, Tag, identity, mirror_renamed, tagged, tagged_ids
from cdcd.spark.lakehouse_ddl import changelog_schema, mirror_schema
from cdcd.spark.objtarget import read_state, write_state
from cdcd.spark.session import FORMAT_SETTINGS, object_store_conf, session, use_object_store
from cdcd.spark.state import TableState
from cdcd.spark.strategy import Applied, Segment, applying
from cdcd.spark.widening import lossless

_FETCH = "run scripts/bootstrap.sh (it fetches the jars into .jars/) or set CDCD_SPARK_JARS to a directory holding them"
FORMAT_MARKER = "format"  # TARGET/state/format: the target's table format
#: The step name of the covered delete in the tables' own commit records (Delta appId ``cdcd-covered``).
COVERED_STEP = "covered"


def table_schema(spark: SparkSession, fmt: Lakehouse, kind: str, schema: str, table: str) -> StructType | None:
    """The table's schema, None when it does not exist yet."""
    if not fmt.exists(spark, kind, schema, table):
        return None
    return spark.table(fmt.ref(kind, schema, table)).schema


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
    mirror_holds_a_key: str  # a row when the mirror holds a key of the batch (``delta.appends_new_keys``)


def statements(p: Prepared, fmt: Lakehouse, schema: str, table: str, log_have: StructType | None,
               mirror_have: StructType | None, sources: tuple[str, str], positions: tuple[str, str],
               approve: Callable[[str, DataType], bool] | None = None) -> Statements:
    """The SQL of one table's micro-batch given the tables' current schemas (None: not created yet); ``approve``:
    whether the operator approved a rewrite of a mirror column to a type (``evolve.approved``)."""
    log, mirror = fmt.changelog(schema, table), fmt.mirror(schema, table)
    name = f"{schema}.{table}"
    log_pre, log_now = (evolve.reconcile(fmt, Target(log, name, CHANGELOG), log_have, p.ident) if log_have is not None
                        else ([], None))
    log_want = changelog_schema(log_now, p.events.schema)
    decide = approve or (lambda column, dt: False)
    r = p.facts.key_range
    prune = sql.key_range(r.column, p.types[r.column], r.lowest, r.highest, r.nulls) if r is not None else None
    return Statements(
        [sql.create_namespace(ns) for ns in fmt.namespaces(schema)],
        log_pre + fmt.ddl(Target(log, name, CHANGELOG), log_now, log_want, fmt.changelog_properties(p), p.ident,
                          decide),
        sql.changelog_merge(log, sources[0], p.key, log_want.fieldNames(), *positions),
        sql.append(log, sources[0], log_want.fieldNames()),
        fmt.ddl(Target(mirror, name, MIRROR), mirror_have, mirror_schema(p), fmt.mirror_properties(p), p.ident,
                decide),
        sql.truncate_before(mirror, p.facts.truncate_pos) if p.facts.truncate_pos is not None else None,
        sql.mirror_merge(mirror, sources[1], p.key, p.mirror_columns, p.keep, prune),
        sql.mirror_insert(mirror, sources[1], p.mirror_columns),
        sql.holds_a_key(mirror, sources[1], p.key, prune),
    )


@contextmanager
def timed(timings: dict[str, float], name: str) -> Iterator[None]:
    began = time.monotonic()
    try:
        yield
    finally:
        timings[name] = timings.get(name, 0.0) + time.monotonic() - began


def timed_call(timings: dict[str, float], name: str, fn: Callable[..., None], *args: Any) -> None:
    with timed(timings, name):
        fn(*args)


def apply_lakehouse_table(spark: SparkSession, fmt: Lakehouse, schema: str, table: str, files: list[LandedFile],
                          prev: TableState, run_id: str, timings: dict[str, float] | None = None,
                          held: Held | None = None) -> tuple[TableState, int]:
    """Apply one table's landed files to its change-log and mirror; the new table state and the event count.

    Each statement's commit records the last batch seq it applied (``CommitRecord``), and a
    statement the table already holds is skipped: a batch applied twice, or again after
    a crash between two statements, leaves the tables as they are. The change-log takes
    a plain append when it holds none of the events yet, else an insert-only MERGE. On
    Delta Lake the append records its batch in its own write options (or its own commit,
    when the landed files join the table as they are: ``cdcd.spark.adopt``, also for a new
    mirror of one insert or update per key), not in the session, so it runs in a second
    thread while the mirror's statements run (``Lakehouse.changelog_beside``): the two writes
    share the cores, and one's driver-side work (planning, the Delta commit) overlaps the other's tasks.
    """
    seq = files[-1].seq
    took = timings if timings is not None else {}
    record = held if held is not None else Held()
    with timed(took, "prepare"):
        mirror_have = table_schema(spark, fmt, "tables", schema, table)
        target = None
        if mirror_have is not None:  # its rows of moved keys take part in the rule: under the latest names
            ident = identity(files)
            target = mirror_renamed(spark.table(fmt.mirror(schema, table)),
                                    {**ident.first, **tagged_ids(mirror_have)}, ident)
        p = prepare(spark, files, prev.watermark, target)
    try:
        last_pos = max(f.entry.last_position for f in files)
        state = TableState(max(prev.watermark, last_pos), run_id,
                           [[c, p.types[c].simpleString()] for c in p.cols], 0)
        if p.facts.events == 0:  # everything re-delivered below the watermark
            return state, 0
        lowest = max(prev.watermark, min(f.entry.first_position for f in files))
        tag = uuid.uuid4().hex[:12]
        views = (f"cdcd_log_{tag}", f"cdcd_src_{tag}")
        with timed(took, "ddl"):
            log_have = table_schema(spark, fmt, "changelog", schema, table)
            plan = statements(p, fmt, schema, table, log_have, mirror_have, views, (lowest, last_pos),
                              lambda c, dt: evolve.approved(spark, fmt.mirror(schema, table), c, dt))
            run_sql(spark, plan.namespaces)

            def changelog_side() -> tuple[int, StructType]:
                evolve.run_ddl(spark, plan.changelog_ddl, f"{schema}.{table}")
                # a table created by this merge holds no batch yet: no need to read its log for one
                found = record.seq(spark, fmt, "changelog", schema, table, "changelog") if log_have is not None else 0
                return found, (log_have if log_have is not None and not plan.changelog_ddl
                              else _required(spark, fmt, schema, table))

            # on Delta the two tables' DDL and log reads run side by side (driver work of separate tables, each
            # its own commits); Iceberg's catalog (SQLite by default) takes one statement at a time
            with ThreadPoolExecutor(max_workers=1, thread_name_prefix="cdcd-changelog-ddl") as pool:
                log_side = pool.submit(changelog_side) if fmt.ddl_side_by_side else None
                evolve.run_ddl(spark, plan.mirror_ddl, f"{schema}.{table}")
                mirror_held = (record.seq(spark, fmt, "tables", schema, table, "mirror")
                               if mirror_have is not None else 0)
                log_held, log_schema = log_side.result() if log_side is not None else changelog_side()
        # an append unless the table may hold some of these events already: a batch of this
        # merge (an earlier attempt), or events the daemon landed again after its crash
        fresh = log_held < files[0].seq and min(f.entry.first_position for f in files) > prev.watermark
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="cdcd-changelog") as pool:
            side = (fmt.changelog_beside(pool, spark, schema, table, files, p, log_schema, seq, took)
                    if fresh and log_held < seq else None)
            if side is None and log_held < seq:
                with timed(took, "changelog"):
                    register(conformed(p.events, log_schema), views[0])
                    with recorded(spark, fmt.commit_settings(CommitRecord("changelog", seq))):
                        run_sql(spark, [plan.changelog_append if fresh else plan.changelog_merge])
            with timed(took, "mirror"):
                # the truncate comes first: a mirror that records the merge holds it. It is idempotent (rows
                # below its position) and Delta records it too; Iceberg may drop whole files without a snapshot
                # summary of ours (a metadata-only delete)
                if mirror_held < seq:
                    new_only = min(f.entry.first_position for f in files) > prev.watermark
                    fmt.apply_mirror(spark, schema, table, p, plan, views[1], seq, mirror_have,
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


def _required(spark: SparkSession, fmt: Lakehouse, schema: str, table: str) -> StructType:
    found = table_schema(spark, fmt, "changelog", schema, table)
    assert found is not None, f"the change-log of {schema}.{table} was just created"
    return found


def register(df: DataFrame, view: str) -> None:
    df.createOrReplaceTempView(view)


def run_sql(spark: SparkSession, statements_: list[str]) -> None:
    for s in statements_:
        spark.sql(s)


class Lakehouse(ABC):
    """A Delta Lake or Iceberg target (``TableFormat``): where its tables are, their DDL, the commit record, the apply.

    Each table of a segment goes through ``apply_lakehouse_table`` (MERGE INTO); every statement is idempotent,
    so a crash before the job's commit applies the batches again. Then the segment's completed re-snapshots.
    """

    name: str  # the --format value
    #: A class only the format's jars hold, and the packages that bring them (``check_format``).
    marker_class: ClassVar[str]
    packages: ClassVar[str]
    #: A new table's properties (``mirror_properties``, ``changelog_properties``).
    mirror_props: ClassVar[dict[str, str]]
    log_props: ClassVar[dict[str, str]]
    #: Whether the change-log's DDL and log read run beside the mirror's (``apply_lakehouse_table``).
    ddl_side_by_side: ClassVar[bool] = False

    def __init__(self, target: Path) -> None:
        self.target = target
        self.held = Held()

    # -- the session and the target

    def check_format(self, spark: SparkSession) -> str | None:
        """None when the format can be used in this session, else what to do about it."""
        jvm = spark._jvm
        try:
            assert jvm is not None
            jvm.java.lang.Class.forName(self.marker_class, True, jvm.Thread.currentThread().getContextClassLoader())
        except Exception:
            return (f"--format {self.name}: {self.marker_class} is not on Spark's classpath; {_FETCH}, or start the "
                    f"job with spark-submit {self.packages} (docs/spark.md)")
        for k, v in FORMAT_SETTINGS[self.name].items():
            have = spark.conf.get(k, "") or ""
            if v not in have.split(","):
                return f"--format {self.name}: the session was started without --conf {k}={v} (docs/spark.md)"
        return None

    def check_target(self, spark: SparkSession) -> str | None:
        """None when TARGET can take this format's tables (registers a catalog where the format needs one), else
        why not."""
        fmt, target = self.name, self.target
        marker = read_state(target, FORMAT_MARKER)
        if marker is not None and marker.strip() != fmt:
            return f"--format {fmt}: {target} holds {marker.strip()} tables; use a new --target"
        if marker is None and not is_object_url(target) and (target / "state" / "consumer.json").exists():
            return f"--format {fmt}: {target} holds a Parquet mirror (--format parquet); use a new --target"
        self.register(spark)
        return None

    def register(self, spark: SparkSession) -> None:  # noqa: B027 (most formats need nothing)
        """Make the target's tables reachable in the session (Iceberg: its catalog)."""

    def prepare_run(self, only: bool = False) -> str | None:
        """Start the session for the format (``only``: for it alone, ``session``); None when the run can go on, else
        the problem (exit 2)."""
        if is_object_url(self.target):  # S3A's jars in a local session, the store's settings in any
            use_object_store()
        spark = session(self.name, only)
        if is_object_url(self.target):
            object_store_conf(spark)
        return self.check_format(spark) or self.check_target(spark)

    def claim(self, state_dir: Path) -> None:
        """Mark the target as this format's (``check_target`` refuses another format on it)."""
        if read_state(self.target, FORMAT_MARKER) is None:
            write_state(self.target, FORMAT_MARKER, self.name + "\n")

    # -- where the tables are

    def mirror(self, schema: str, table: str) -> str:
        return self.ref("tables", schema, table)

    def changelog(self, schema: str, table: str) -> str:
        return self.ref("changelog", schema, table)

    def namespaces(self, schema: str) -> list[str]:
        """Namespaces to create first (Delta's path tables need none)."""
        return []

    def location(self, kind: str, schema: str, table: str) -> Path:
        """A table's directory: TARGET/tables/<schema>.<table>/, as in Parquet mode (a URL's ``Path`` on object
        storage: ``objtarget.table_uri`` gives Spark its URL)."""
        root = self.target if is_object_url(self.target) else self.target.resolve()
        return root / kind / f"{schema}.{table}"

    @abstractmethod
    def ref(self, kind: str, schema: str, table: str) -> str:
        """The table as a SQL table reference."""

    @abstractmethod
    def exists(self, spark: SparkSession, kind: str, schema: str, table: str) -> bool:
        """Whether the table was created, asked of the format (works on object storage too)."""

    # -- DDL

    def stored_type(self, dt: DataType) -> str:
        """How the format stores ``dt``, nullability aside."""
        if isinstance(dt, StructType):
            return "struct<" + ",".join(f"{f.name}:{self.stored_type(f.dataType)}" for f in dt.fields) + ">"
        if isinstance(dt, ArrayType):
            return f"array<{self.stored_type(dt.elementType)}>"
        if isinstance(dt, MapType):
            return f"map<{self.stored_type(dt.keyType)},{self.stored_type(dt.valueType)}>"
        return self.stored_leaf(dt)

    def stored_leaf(self, dt: DataType) -> str:
        return dt.simpleString()

    def ddl(self, t: Target, have: StructType | None, want: StructType, properties: dict[str, str],
            ident: Identity | None, approve: Callable[[str, DataType], bool]) -> list[str]:
        """CREATE TABLE for a new table (each column's id in its comment), else the statements of the schema
        change (``cdcd.spark.evolve``; none: same schema). Raises ``evolve.SchemaChangeRefused`` for a mirror
        column the change would lose values of."""
        if have is None:
            ids = {c.name: c.id for c in ident.latest} if ident is not None else {}
            return self.create(t.table, StructType([tagged(f, Tag(ids.get(f.name))) for f in want.fields]),
                               properties)
        pre, now = evolve.reconcile(self, t, have, ident) if t.kind == MIRROR else ([], have)
        return pre + evolve.changes(self, t, now, want, ident, approve, self.before_drop(t.table, properties))

    def widens_in_place(self, old: DataType, new: DataType) -> bool:
        """Whether ALTER COLUMN TYPE takes ``old`` to ``new`` (both a widening, ``lossless``)."""
        return lossless(old, new) and (old.simpleString(), new.simpleString()) in {
            ("int", "bigint"), ("float", "double")}

    def before_widen(self, table: str) -> list[str]:
        """The statements an ALTER COLUMN TYPE needs first."""
        return []

    def before_rename(self, table: str) -> list[str]:
        """The statements a column rename or drop needs first (on either table)."""
        return []

    def create(self, table: str, want: StructType, properties: dict[str, str]) -> list[str]:
        """The statements that create a new table."""
        return [sql.create_table(table, want, self.name, properties)]

    def before_drop(self, table: str, properties: dict[str, str]) -> list[str]:
        """The statements a column drop needs first."""
        return []

    def mirror_properties(self, p: Prepared) -> dict[str, str]:
        """A new mirror's properties (``mirror_props``)."""
        return dict(self.mirror_props)

    def changelog_properties(self, p: Prepared) -> dict[str, str]:
        """A new change-log's properties (``log_props``)."""
        return dict(self.log_props)

    # -- the commit record

    @abstractmethod
    def commit_settings(self, record: CommitRecord) -> dict[str, str]:
        """The session settings that make a SQL statement's commit record ``record`` (``recorded``)."""

    @abstractmethod
    def applied_seq(self, spark: SparkSession, kind: str, schema: str, table: str, step: str) -> int:
        """The highest batch seq the table's own commits record for ``step`` (0: none)."""

    def files_before(self, tables: list[tuple[str, str]]) -> None:  # noqa: B027 (Delta alone reads ahead)
        """Called before a merge (``files_after``)."""

    @abstractmethod
    def files_after(self, applied: Applied, tables: list[tuple[str, str]],
                    since: float) -> tuple[int | None, int | None]:
        """Data files the merge added, and files it rewrote or removed, read from the tables' own commit records
        (None: not known)."""

    # -- the apply

    def apply(self, spark: SparkSession, segment: Segment, tables: dict[str, TableState]) -> Applied:
        # every statement is idempotent: a crash before the job's commit applies the batches again
        out = Applied()
        landed = sorted(segment.tables().items())
        if len(landed) > 1:  # a type change a mirror refuses stops the merge before any table's statement
            for (schema, table), files in landed:
                if evolve.changed(files, tables.get(f"{schema}.{table}", TableState())):
                    self.check_mirror(spark, schema, table, files)
        try:
            for (schema, table), files in landed:
                name = f"{schema}.{table}"
                out.timings[name] = {}
                with applying(name):
                    state, n = apply_lakehouse_table(spark, self, schema, table, files, tables.get(name, TableState()),
                                                     segment.run_id, out.timings[name], self.held)
                out.tables[name] = state
                out.events += n
        except BaseException:
            self.held = Held()  # which of the failed merge's commits were made is not known: ask the tables
            raise
        self.apply_covered(spark, segment)  # completed re-snapshots, after the events
        schemalog.apply_segment(spark, self, segment.batches, tables)  # the schema changes' change-log rows
        return out

    def check_mirror(self, spark: SparkSession, schema: str, table: str, files: list[LandedFile]) -> None:
        """Raise ``evolve.SchemaChangeRefused`` when the files change a type the mirror cannot take."""
        have = table_schema(spark, self, "tables", schema, table)
        if have is not None:
            events = new_events(spark, files, "")
            want = StructType([events.schema[c] for c in files[-1].entry.table.column_names])
            ref = self.mirror(schema, table)
            self.ddl(Target(ref, f"{schema}.{table}", MIRROR), have, want, {}, identity(files),
                     lambda c, dt: evolve.approved(spark, ref, c, dt))

    def apply_covered(self, spark: SparkSession, segment: Segment) -> None:
        """``DELETE FROM mirror WHERE _cdc_pos < below`` per covered table (``Segment.covered``; a ranged record
        adds its key condition: ``... OR (_cdc_pos < below AND <range>)``).

        Runs after the tables' MERGEs. Idempotent by construction (a second run finds no row below);
        on Delta the commit also records the batch seq (appId ``cdcd-covered``), so a repeat after a
        crash before the job's journal is skipped by Delta itself. A table that has no mirror yet
        has nothing to remove.
        """
        for (schema, table), c in sorted(segment.covered().items()):
            if not self.exists(spark, "tables", schema, table):
                continue
            with recorded(spark, self.commit_settings(CommitRecord(COVERED_STEP, c.seq))):
                spark.sql(f"DELETE FROM {self.mirror(schema, table)} WHERE {c.gone(CDC_POS, sql.literal)}")

    def changelog_beside(self, pool: ThreadPoolExecutor, spark: SparkSession, schema: str, table: str,
                         files: list[LandedFile], p: Prepared, log_schema: StructType, seq: int,
                         took: dict[str, float]) -> Future[None] | None:
        """The change-log's append of new events, started in ``pool`` beside the mirror's statements, or None:
        the change-log's SQL statement runs before them (``apply_lakehouse_table``)."""
        return None

    def apply_mirror(self, spark: SparkSession, schema: str, table: str, p: Prepared, plan: Statements,
                     view: str, seq: int, have: StructType | None, files: list[LandedFile] | None) -> None:
        """``have``: the mirror's schema before this merge (None: created by it); ``files``: the landed files when
        every event in them is new to the table (none below its watermark)."""
        self.truncate_mirror(spark, plan, seq)
        created = have is None
        register(in_key_ranges(p.mirror, p) if created else p.mirror, view)
        self.merge_mirror(spark, plan, seq, created)

    def truncate_mirror(self, spark: SparkSession, plan: Statements, seq: int) -> None:
        if plan.truncate is not None:
            with recorded(spark, self.commit_settings(CommitRecord("truncate", seq))):
                run_sql(spark, [plan.truncate])

    def merge_mirror(self, spark: SparkSession, plan: Statements, seq: int, created: bool) -> None:
        with recorded(spark, self.commit_settings(CommitRecord("mirror", seq))):
            # a retry after a crash finds the mirror created (not empty, perhaps): MERGE
            run_sql(spark, [plan.mirror_insert if created else plan.mirror_merge])
