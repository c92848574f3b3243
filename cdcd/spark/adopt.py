"""Delta appends without rewriting the events: landed Parquet files join a table as they are.

A change-log row is a landed row, column for column. When a segment's landed files of
a table all have the change-log's columns and types (one schema version) and every
event in them is new to the table (the job's ``fresh`` append), Spark's append would
read them, rebuild the same rows and write them again. The same holds for a mirror
the merge has just created when the events are one insert or update per key (no
delete, truncate, key change or unavailable column): the landed rows are the mirror's
rows, and the landed columns the mirror does not have are not read (a Delta reader
reads the table's columns by name; the mirror is created with its column names as
physical names, ``Delta.create``). Then each file is linked (hard link; a copy
across file systems) into the table's directory, and one Delta commit adds them,
recording the segment's last batch in the same idempotent-write transaction (appId
``cdcd-changelog`` or ``cdcd-mirror``, version = batch seq) as Spark's append would.
A crash before that commit leaves only unreferenced files in the directory (Delta's
VACUUM removes them); the rerun links the files again under new names.

The statistics of each added file: its row count, the ``_cdc_pos`` bounds that the
manifest records and, for a mirror, the first key column's bounds and NULL count
(exact values, so data skipping stays correct; Delta uses min/max only next to a
NULL count).
"""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import quote

from pyspark.sql import SparkSession
from pyspark.sql.types import StructType

from cdcd.landing.columns import CDC_POS
from cdcd.landing.objstore import is_object_url
from cdcd.landing.reader import LandedFile


def same_columns(landed: StructType, table: StructType) -> bool:
    """Whether Spark reads the landed files with exactly the table's columns and types (nullability aside)."""
    return {f.name: f.dataType.simpleString() for f in landed.fields} == {
        f.name: f.dataType.simpleString() for f in table.fields}


def on_disk(files: list[LandedFile]) -> bool:
    """Whether the files are on a file system: landed files on object storage are not adopted (no hard links
    there, and a copy reads and writes every byte as Spark's append does)."""
    return not any(is_object_url(f.path) for f in files)


def one_version(files: list[LandedFile]) -> bool:
    """Whether the files were landed under one schema version (the same columns)."""
    return all(f.entry.table.columns == files[0].entry.table.columns for f in files)


def _stats(f: LandedFile, extra: dict[str, Any]) -> str:
    """Delta's statistics of an added file: its rows, the manifest's ``_cdc_pos`` bounds and ``extra``'s
    (``minValues``, ``maxValues``, ``nullCount`` by column)."""
    lows: dict[str, Any] = {CDC_POS: f.entry.first_position, **extra.get("minValues", {})}
    highs: dict[str, Any] = {CDC_POS: f.entry.last_position, **extra.get("maxValues", {})}
    nulls: dict[str, Any] = {CDC_POS: 0, **extra.get("nullCount", {})}  # every landed event has a position
    return json.dumps({"numRecords": f.entry.rows, "minValues": lows, "maxValues": highs,
                       "nullCount": nulls})


def _link(source: str, dest: Path) -> None:
    try:
        os.link(source, dest)
    except OSError:  # another file system, or links not supported: a copy
        shutil.copyfile(source, dest)


def adopt(spark: SparkSession, table: Path, files: list[LandedFile], app_id: str, seq: int,
          stats: list[dict[str, Any]] | None = None) -> None:
    """Add ``files`` to the Delta table at ``table`` (a local directory) in one commit recording (app_id, seq);
    only for a table that does not hold (app_id, seq) yet.

    ``stats``: per file, more statistics (``minValues``/``maxValues`` by column) than the position bounds.
    """
    tag = uuid.uuid4().hex[:12]
    actions = []
    for f, extra in zip(files, stats or [{} for _ in files], strict=True):
        name = f"{Path(f.path).stem}-{tag}.parquet"
        dest = table / name
        _link(f.path, dest)
        st = dest.stat()
        actions.append(json.dumps({"add": {
            "path": quote(name), "partitionValues": {}, "size": st.st_size,
            "modificationTime": int(st.st_mtime * 1000), "dataChange": True, "stats": _stats(f, extra)}}))
    now = int(time.time() * 1000)
    actions.append(json.dumps({"txn": {"appId": app_id, "version": seq, "lastUpdated": now}}))
    jvm = spark._jvm
    assert jvm is not None
    delta = jvm.org.apache.spark.sql.delta
    action = getattr(getattr(delta.actions, "Action$"), "MODULE$")  # Scala's companion object
    parsed = jvm.java.util.ArrayList()
    for a in actions:
        parsed.add(action.fromJson(a))
    seq_actions = jvm.scala.jdk.javaapi.CollectionConverters.asScala(parsed).toList()
    none = jvm.scala.Option.empty()
    append = jvm.org.apache.spark.sql.SaveMode.Append
    write = getattr(delta, "DeltaOperations$Write")
    # the mode, then only Options: 3 of them in Delta 4.0.x, 8 in 4.4 (the widest public constructor)
    arity = max(c.getParameterCount() for c in write._java_lang_class.getConstructors())
    operation = write(append, *([none] * (arity - 1)))
    log = delta.DeltaLog.forTable(spark._jsparkSession, table.as_uri())
    # no txnVersion(app_id) check in the transaction: it reconstructs the table's state with a Spark job (1 s
    # and more); the caller has checked the table's record (``Delta.applied_seq``) and is its only writer
    log.startTransaction().commit(seq_actions, operation)
