"""The Delta Lake target (``--format delta``): path tables, column mapping, the idempotent-write transaction.

What Delta does otherwise than Iceberg on top of ``cdcd.spark.lakehouse``: tables are addressed by path
(TARGET/tables/<schema>.<table>/); a mirror is created with its column names as physical names, then column
mapping is switched on (``Delta.create``); file statistics on the position and key columns only; each commit
records its batch in Delta's idempotent-write transaction (appId ``cdcd-<step>``, version = batch seq),
which Delta itself uses to skip a statement it holds already; and new events join the change-log, and a new
mirror, without a MERGE: as the landed files themselves (``cdcd.spark.adopt``) or as a DataFrame append
that runs beside the mirror's statements.
"""

from __future__ import annotations

import json
import os
import re
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import (
    ByteType,
    DataType,
    DateType,
    DecimalType,
    DoubleType,
    FloatType,
    IntegerType,
    LongType,
    ShortType,
    StringType,
    StructType,
    TimestampNTZType,
    TimestampType,
)

from cdcd.errors import ConfigError
from cdcd.landing.columns import CDC_POS
from cdcd.landing.objstore import is_object_url
from cdcd.landing.reader import LandedFile
from cdcd.spark import jars
from cdcd.spark import lakehouse_sql as sql
from cdcd.spark.adopt import adopt, on_disk, one_version, same_columns
from cdcd.spark.collapse import Prepared, conformed
from cdcd.spark.commitrecord import CommitRecord
from cdcd.spark.lakehouse import Lakehouse, Statements, in_key_ranges, register, timed_call
from cdcd.spark.lakehouse_ddl import mirror_schema
from cdcd.spark.objtarget import table_uri
from cdcd.spark.schemalog import CDC_SCHEMA_CHANGE
from cdcd.spark.strategy import Applied
from cdcd.spark.widening import lossless

DELTA_TXN = ("spark.databricks.delta.write.txnAppId", "spark.databricks.delta.write.txnVersion")
#: Types Delta keeps statistics for (``delta.dataSkippingStatsColumns`` refuses others).
_DELTA_STATS_TYPES = (ByteType, ShortType, IntegerType, LongType, FloatType, DoubleType, DateType, TimestampType,
                      TimestampNTZType, StringType, DecimalType)
#: Characters Delta refuses in a column name unless column mapping is on.
_MAPPED_ONLY = re.compile(r"[ ,;{}()\n\t=]")
_MAPPING = {"delta.columnMapping.mode": "name"}
#: Type widening (Delta 4.x): ALTER COLUMN TYPE to a wider type keeps the data files (``Delta.widens_in_place``).
_WIDENING = {"delta.enableTypeWidening": "true"}
_INTS = ("tinyint", "smallint", "int", "bigint")
#: ``--delta-readers`` / ``CDCD_DELTA_READERS``: ``spark`` writes mirrors with deletion vectors, column mapping
#: and type widening (Spark and Delta-kernel readers); ``any`` writes mirrors without them until a drop, a rename
#: or a column name needs column mapping, so delta-rs, pandas, DuckDB and Trino open them (docs/spark.md, Readers).
READERS_ENV = "CDCD_DELTA_READERS"
READERS = ("spark", "any")
_PORTABLE = {"delta.enableDeletionVectors": "false"}


def readers_setting() -> str:
    """The ``--delta-readers`` setting of this process (``CDCD_DELTA_READERS``, default ``spark``)."""
    value = os.environ.get(READERS_ENV, "spark")
    if value not in READERS:
        raise ConfigError(f"{READERS_ENV}={value!r} is not a Delta readers setting: give one of {', '.join(READERS)} "
                          "(docs/spark.md, Readers)")
    return value


def plain_names(schema: StructType) -> bool:
    """Whether Delta takes every column name of ``schema`` without column mapping."""
    return not any(_MAPPED_ONLY.search(f.name) for f in schema.fields)


def stats_columns(p: Prepared) -> str:
    """The position and the key columns of a type Delta keeps statistics for, as a Delta property value."""
    stats = [CDC_POS, *[k for k in p.key if isinstance(p.types[k], _DELTA_STATS_TYPES)]]
    return ",".join(sql.q(c) for c in dict.fromkeys(stats))


def adoptable_mirror(p: Prepared, files: list[LandedFile]) -> bool:
    """Whether the landed files, as they are, hold exactly the rows of a new mirror: one event per key, no
    delete, key change or unavailable column (``Facts.unique``), no truncate (its event is a row of a landed
    file), one schema version, and a mirror created with its column names as physical names (``Delta.create``)."""
    return (p.facts.unique and p.facts.deletes == 0 and p.facts.truncate_pos is None
            and len(p.facts.file_ranges) == len(files)
            and one_version(files) and plain_names(mirror_schema(p)))


def appends_new_keys(spark: SparkSession, p: Prepared, plan: Statements, have: StructType | None) -> bool:
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


def _delta_log(spark: SparkSession, location: Path) -> Any:
    """The table's Delta log, brought up to date (a py4j object)."""
    jvm = spark._jvm
    assert jvm is not None
    log = jvm.org.apache.spark.sql.delta.DeltaLog.forTable(spark._jsparkSession, table_uri(location))
    return log.update(False, jvm.scala.Option.empty(), jvm.scala.Option.empty())


class Delta(Lakehouse):
    """``--format delta``."""

    name = "delta"
    marker_class = "io.delta.sql.DeltaSparkSessionExtension"
    packages = jars.packages_line(jars.DELTA_PACKAGES)
    #: Delta can drop a column (the mirror follows the source's DROP COLUMN) only with column mapping. A small
    #: batch must not rewrite the data files of a large mirror: Delta marks changed rows in deletion vectors.
    mirror_props = {"delta.columnMapping.mode": "name", "delta.enableDeletionVectors": "true", **_WIDENING}
    log_props = dict(_WIDENING)
    ddl_side_by_side = True

    def __init__(self, target: Path) -> None:
        super().__init__(target)
        self.versions: dict[Path, int] = {}  # a Delta log's last commit version seen (``files_after``)
        self.plain: dict[tuple[Path, str], bool] = {}  # ``_own_names`` per (table, schema)
        # ``any``: new mirrors without deletion vectors (each merge rewrites the files it changes), without type
        # widening (a wider type rewrites the column) and without column mapping until needed.
        self.portable = readers_setting() == "any"
        self.on_disk = not is_object_url(target)  # landed files join tables on a file system only (adopt)

    def ref(self, kind: str, schema: str, table: str) -> str:
        return sql.delta_table(table_uri(self.location(kind, schema, table)))

    def exists(self, spark: SparkSession, kind: str, schema: str, table: str) -> bool:
        jvm = spark._jvm
        assert jvm is not None
        jsession = spark._jsparkSession
        path = table_uri(self.location(kind, schema, table))
        return bool(jvm.io.delta.tables.DeltaTable.isDeltaTable(jsession, path))

    # -- DDL

    def create(self, table: str, want: StructType, properties: dict[str, str]) -> list[str]:
        """A table with column mapping whose column names Delta takes without it is created without it, then
        column mapping is switched on: its first columns keep their names as physical names (a new table with
        column mapping would get generated ones), so landed Parquet files can become its data files as they are
        (``cdcd.spark.adopt``)."""
        if self._portable(properties) and not plain_names(want):
            properties = {**properties, **_MAPPING}  # names Delta takes only with column mapping
        if self._mapped(properties) and plain_names(want):
            plain = {k: v for k, v in properties.items() if k not in _MAPPING}
            return [sql.create_table(table, want, self.name, plain), sql.set_properties(table, _MAPPING)]
        return super().create(table, want, properties)

    def before_drop(self, table: str, properties: dict[str, str]) -> list[str]:
        """A drop switches column mapping on again first (a no-op when on): a crash between the two statements of
        ``create`` must not leave a mirror that cannot drop a column."""
        needs = self._mapped(properties) or self._portable(properties)
        return [sql.set_properties(table, _MAPPING)] if needs else []

    def widens_in_place(self, old: DataType, new: DataType) -> bool:
        """Delta's type widening: integers to wider integers, to double (up to int) and to decimals with room;
        float to double; a decimal's precision and scale up; a date to timestamp_ntz."""
        if self.portable or not lossless(old, new):
            return False  # ``any``: type widening is a reader feature delta-rs does not open
        o, n = old.simpleString(), new.simpleString()
        if o in _INTS:
            return n in _INTS or n == "double" or isinstance(new, DecimalType)
        return ((o, n) == ("float", "double") or (isinstance(old, DecimalType) and isinstance(new, DecimalType))
                or (o, n) == ("date", "timestamp_ntz"))

    def before_widen(self, table: str) -> list[str]:
        """Type widening switched on (a table created before it was; nothing changes when on)."""
        return [sql.set_properties(table, _WIDENING)]

    def before_rename(self, table: str) -> list[str]:
        """Column mapping, which a rename or a drop needs (the change-log is created without it)."""
        return [sql.set_properties(table, _MAPPING)]

    @staticmethod
    def _portable(properties: dict[str, str]) -> bool:
        """A mirror of ``--delta-readers any``: it gets column mapping only when it needs it."""
        return properties.get("delta.enableDeletionVectors") == "false"

    @staticmethod
    def _mapped(properties: dict[str, str]) -> bool:
        return properties.get("delta.columnMapping.mode") == "name"

    def mirror_properties(self, p: Prepared) -> dict[str, str]:
        """Also file statistics on the key columns and ``_cdc_pos`` only (``stats_columns``): the MERGE prunes by
        the first key column, and statistics of every other column cost a fifth of a merge's CPU in the tasks
        that write the mirror."""
        props = dict(_PORTABLE) if self.portable else super().mirror_properties(p)
        return {**props, "delta.dataSkippingStatsColumns": stats_columns(p)}

    def changelog_properties(self, p: Prepared) -> dict[str, str]:
        """File statistics on the position and the key columns only: the change-log's MERGE prunes on
        ``_cdc_pos``, and statistics of every other column (Delta's default: the first 32) cost time in every
        append and are of little use for a log read by position or key."""
        props = {} if self.portable else super().changelog_properties(p)
        return {**props, "delta.dataSkippingStatsColumns": stats_columns(p)}

    # -- the commit record: the idempotent-write transaction, kept in the table's log

    def commit_settings(self, record: CommitRecord) -> dict[str, str]:
        return {DELTA_TXN[0]: f"cdcd-{record.step}", DELTA_TXN[1]: str(record.seq)}

    def applied_seq(self, spark: SparkSession, kind: str, schema: str, table: str, step: str) -> int:
        version = _delta_log(spark, self.location(kind, schema, table)).transactions().get(f"cdcd-{step}")
        return int(version.get()) if version.isDefined() else 0

    def append(self, df: DataFrame, location: Path, record: CommitRecord) -> None:
        """Append ``df`` to a Delta table, the commit recording ``record`` as a SQL statement's does, but in the
        write's own options (Delta prefers them to the session's): a statement running beside it may set the
        session's."""
        (df.write.format("delta").mode("append").option("txnAppId", f"cdcd-{record.step}")
         .option("txnVersion", str(record.seq)).save(table_uri(location)))

    def _logs(self, tables: list[tuple[str, str]]) -> list[Path]:
        return [self.location(kind, s, t) / "_delta_log" for s, t in tables for kind in ("changelog", "tables")]

    def files_before(self, tables: list[tuple[str, str]]) -> None:
        """The versions of Delta logs not seen yet: a merge reads only its own commits (the first one of a table in
        this process lists its log once; not on object storage)."""
        for log in self._logs(tables) if not is_object_url(self.target) else ():
            if log not in self.versions:
                found = [int(n[:-5]) for n in (os.listdir(log) if log.is_dir() else ())
                         if n.endswith(".json") and n[:-5].isdigit()]
                self.versions[log] = max(found, default=-1)

    def files_after(self, applied: Applied, tables: list[tuple[str, str]],
                    since: float) -> tuple[int | None, int | None]:
        """The add and remove actions of the commits made since ``files_before`` (not known on object storage)."""
        if is_object_url(self.target):
            return None, None
        added = rewritten = 0
        for log in self._logs(tables):
            version = self.versions.get(log, -1) + 1
            while (commit := log / f"{version:020d}.json").is_file():
                for line in commit.read_text().splitlines():
                    action = json.loads(line) if line.strip() else {}
                    added += "add" in action
                    rewritten += "remove" in action
                self.versions[log] = version
                version += 1
        return added, rewritten

    # -- the apply: appends without a MERGE

    def changelog_beside(self, pool: ThreadPoolExecutor, spark: SparkSession, schema: str, table: str,
                         files: list[LandedFile], p: Prepared, log_schema: StructType, seq: int,
                         took: dict[str, float]) -> Future[None] | None:
        location = self.location("changelog", schema, table)
        # the schema-change rows' column (cdcd.spark.schemalog) is NULL in every event row: files without it do
        events_columns = StructType([f for f in log_schema.fields if f.name != CDC_SCHEMA_CHANGE])
        if (on_disk(files) and self.on_disk and one_version(files) and same_columns(p.events.schema, events_columns)
                and self._own_names(spark, location, log_schema)):
            # the landed files are the change-log's rows as they are: no Spark write (cdcd.spark.adopt)
            return pool.submit(timed_call, took, "changelog", adopt, spark, location, files, "cdcd-changelog", seq)
        return pool.submit(timed_call, took, "changelog", self.append, conformed(p.events, log_schema), location,
                           CommitRecord("changelog", seq))

    def apply_mirror(self, spark: SparkSession, schema: str, table: str, p: Prepared, plan: Statements,
                     view: str, seq: int, have: StructType | None, files: list[LandedFile] | None) -> None:
        self.truncate_mirror(spark, plan, seq)
        created = have is None
        location = self.location("tables", schema, table)
        if (files is not None and on_disk(files) and self.on_disk and adoptable_mirror(p, files)
                and (created or self._new_keys_only(spark, schema, table, p, plan, have))):
            # every landed row is a mirror row as it is (one insert or update per key, nothing else)
            adopt(spark, location, files, "cdcd-mirror", seq, key_stats(p))
            return
        if created:  # a mirror this merge created is empty: an append (no join)
            rows = p.mirror.filter(~F.col(sql.DELETE_FLAG)).select(*[F.col(c) for c in p.mirror_columns])
            self.append(in_key_ranges(rows, p), location, CommitRecord("mirror", seq))
            return
        register(p.mirror, view)
        if appends_new_keys(spark, p, plan, have):
            rows = p.mirror.select(*[F.col(c) for c in p.mirror_columns])
            self.append(in_key_ranges(rows, p), location, CommitRecord("mirror", seq))
            return
        self.merge_mirror(spark, plan, seq, created)

    def _own_names(self, spark: SparkSession, location: Path, schema: StructType) -> bool:
        """Whether every column of the table is stored under its own name (none renamed or added under column
        mapping, which a rename or drop switches on), read from its log once per schema."""
        key = (location, schema.simpleString())
        if key not in self.plain:
            stored = json.loads(_delta_log(spark, location).metadata().schemaString())
            self.plain[key] = _own_physical_names(stored)
        return self.plain[key]

    def _new_keys_only(self, spark: SparkSession, schema: str, table: str, p: Prepared, plan: Statements,
                       have: StructType | None) -> bool:
        """Whether landed files can join an existing mirror as they are: its schema is the batch's (no change in
        this merge, every column stored under its own name) and it holds no row in the batch's key range, asked
        of the table itself (its file statistics skip every file outside the range, so a batch of new keys
        beyond the mirror's reads no data file)."""
        r = p.facts.key_range
        if have is None or plan.mirror_ddl or r is None or r.lowest is None or not same_columns(mirror_schema(p), have):
            return False
        stored = json.loads(_delta_log(spark, self.location("tables", schema, table)).metadata().schemaString())
        if not _own_physical_names(stored):
            return False  # a column added under column mapping: its data files name it otherwise
        inside = sql.key_range(r.column, p.types[r.column], r.lowest, r.highest, r.nulls)
        return not spark.sql(f"SELECT 1 FROM {self.mirror(schema, table)} t WHERE {inside} LIMIT 1").take(1)
