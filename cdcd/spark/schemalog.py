"""Schema changes as change-log rows (Delta Lake, Iceberg): the manifests' ``schema_changes`` records
(docs/landing-format.md) become one row each in their table's change-log, so its readers see when the schema
changed.

The row: ``_cdc_op = 's'``, ``_cdc_pos`` the change's position, ``_cdc_schema_version`` the new version, the
table's columns NULL and ``_cdc_schema_change`` (a column of the change-log only, added by the first such row)
the change as JSON: ``{"version", "position", "statement", "columns", "old_columns"}`` (columns as the
manifest's entries; ``old_columns`` from the version before as the segment shows it, else the mirror's names
and Spark types). The insert is a MERGE on position and op, so a segment applied again (a crash before the
job's journal) adds no second row. The consumer logs ``table schema changed`` per record.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from pyspark.sql import SparkSession
from pyspark.sql.types import StructField, StructType

from cdcd.landing.columns import (
    CDC_BATCH,
    CDC_INDEX,
    CDC_OP,
    CDC_POS,
    CDC_SCHEMA_VERSION,
    CDC_SNAPSHOT,
    CDC_UNAVAILABLE,
)
from cdcd.landing.manifest import ColumnEntry, Manifest, SchemaChangeRecord
from cdcd.logging import get_logger
from cdcd.spark import lakehouse_sql as sql
from cdcd.spark.state import TableState

_log = get_logger("cdcd.spark")

CDC_SCHEMA_CHANGE = "_cdc_schema_change"  # a change-log's schema-change row: the change as JSON
SCHEMA_OP = "s"
TableVersion = tuple[int, tuple[ColumnEntry, ...]]


def changes_by_table(batches: Sequence[tuple[int, Manifest]],
                     mirrored: Mapping[str, TableState] | None = None) -> dict[tuple[str, str], list[tuple[int, str]]]:
    """Per (schema, table), the segment's schema changes in order: (batch seq, the change's JSON). The old columns
    are those of the highest version below the change's that the segment shows (a record or a file entry of an
    earlier batch, or of the same batch), else the mirror's before the segment (``mirrored``: the consumer's
    table states; ``{"name", "type"}`` with the Spark type), else null."""
    mirrored = mirrored or {}
    known: dict[tuple[str, str], list[TableVersion]] = {}
    out: dict[tuple[str, str], list[tuple[int, str]]] = {}
    for seq, manifest in batches:
        seen = [(f.table.schema, f.table.name, f.table.version, f.table.columns) for f in manifest.files]
        seen += [(r.schema, r.name, r.version, r.columns) for r in manifest.schema_changes]
        for schema, table, version, columns in seen:
            known.setdefault((schema, table), []).append((version, columns))
        for r in manifest.schema_changes:
            older = [v for v in known.get((r.schema, r.name), []) if v[0] < r.version]
            state = mirrored.get(f"{r.schema}.{r.name}")
            old: list[dict[str, Any]] | None = (
                [c.to_json() for c in max(older, key=lambda v: v[0])[1]] if older
                else [{"name": c[0], "type": c[1]} for c in state.columns] if state is not None and state.columns
                else None)
            out.setdefault((r.schema, r.name), []).append((seq, describe(r, old)))
    return out


def describe(r: SchemaChangeRecord, old: list[dict[str, Any]] | None) -> str:
    return json.dumps({"version": r.version, "position": r.position, "statement": r.statement,
                       "columns": [c.to_json() for c in r.columns], "old_columns": old},
                      sort_keys=True, ensure_ascii=False)


def apply_schema_changes(spark: SparkSession, changelog: str, name: str,
                         changes: list[tuple[int, str]]) -> None:
    """Add one ``'s'`` row per change to ``changelog`` (which exists) unless it holds it."""
    have = spark.table(changelog).schema
    if CDC_SCHEMA_CHANGE not in have.fieldNames():
        spark.sql(f"ALTER TABLE {changelog} ADD COLUMNS ({sql.q(CDC_SCHEMA_CHANGE)} STRING)")
        have = spark.table(changelog).schema
    schema = StructType([StructField(f.name, f.dataType, True) for f in have.fields])
    rows = [tuple(values.get(f.name) for f in schema.fields) for values in change_rows(name, changes)]
    view = f"cdcd_schema_{uuid.uuid4().hex[:12]}"
    spark.createDataFrame(rows, schema).createOrReplaceTempView(view)
    try:
        positions = [json.loads(c)["position"] for _, c in changes]
        spark.sql(sql.changelog_merge(changelog, view, (), schema.fieldNames(), min(positions), max(positions)))
    finally:
        spark.catalog.dropTempView(view)


def change_rows(name: str, changes: list[tuple[int, str]]) -> list[dict[str, Any]]:
    """The ``'s'`` rows of a table's changes (their ``_cdc_*`` columns; the table's are NULL), each logged."""
    rows = []
    for index, (seq, change) in enumerate(changes):
        doc = json.loads(change)
        _log.info("table schema changed", table=name, version=doc["version"], position=doc["position"],
                  statement=doc["statement"], columns=[c["name"] for c in doc["columns"]])
        rows.append({CDC_OP: SCHEMA_OP, CDC_POS: doc["position"], CDC_SCHEMA_VERSION: doc["version"],
                     CDC_SNAPSHOT: False, CDC_UNAVAILABLE: [], CDC_BATCH: seq, CDC_INDEX: -1 - index,
                     CDC_SCHEMA_CHANGE: change})
    return rows


class _Tables(Protocol):
    def exists(self, spark: SparkSession, kind: str, schema: str, table: str) -> bool: ...

    def changelog(self, schema: str, table: str) -> str: ...


def apply_segment(spark: SparkSession, fmt: _Tables, batches: Sequence[tuple[int, Manifest]],
                  mirrored: Mapping[str, TableState]) -> None:
    """The schema-change rows of a segment's records, after its events (``Lakehouse.apply``). A table without a
    change-log yet (no row of it landed so far) gets none: its first rows carry the schema as it is."""
    for (schema, table), changes in sorted(changes_by_table(batches, mirrored).items()):
        name = f"{schema}.{table}"
        if not fmt.exists(spark, "changelog", schema, table):
            _log.info("table schema changed before any of its rows was applied: no change-log row records it",
                      table=name, versions=[json.loads(c)["version"] for _, c in changes])
            continue
        apply_schema_changes(spark, fmt.changelog(schema, table), name, changes)
