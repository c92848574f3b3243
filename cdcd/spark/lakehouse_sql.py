"""The SQL statements of the Delta Lake / Iceberg target, as plain strings.

Pure functions (no Spark session needed) so that every statement the
consumer can issue is checked by Spark's SQL parser in the tests. Every
name is back-quoted: source columns may hold any character.
"""

from __future__ import annotations

from collections.abc import Sequence
from decimal import Decimal
from typing import Any

from pyspark.sql.types import ArrayType, DataType, MapType, StringType, StructType

from cdcd.landing.columns import CDC_OP, CDC_POS, CDC_UNAVAILABLE

DELETE_FLAG = "_cdc_delete"  # collapsed source row: the key's last action removes it
UNAVAILABLE = CDC_UNAVAILABLE  # collapsed source row: columns whose value is still unknown


def q(name: str) -> str:
    """A back-quoted identifier."""
    return "`" + name.replace("`", "``") + "`"


def path_of(parts: Sequence[str]) -> str:
    """A nested column reference such as `_cdc_before_key`.`id`."""
    return ".".join(q(p) for p in parts)


def literal(text: str) -> str:
    """A Spark SQL string literal (backslash escapes are on by default)."""
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def sql_type(dt: DataType) -> str:
    """DDL text of a Spark type; struct field names are quoted, unlike ``simpleString()``."""
    if isinstance(dt, StructType):
        return "STRUCT<" + ", ".join(f"{q(f.name)}: {sql_type(f.dataType)}" for f in dt.fields) + ">"
    if isinstance(dt, ArrayType):
        return f"ARRAY<{sql_type(dt.elementType)}>"
    if isinstance(dt, MapType):
        return f"MAP<{sql_type(dt.keyType)}, {sql_type(dt.valueType)}>"
    return dt.simpleString()


def delta_table(location: str) -> str:
    """A path-based Delta table, e.g. delta.`file:/t/tables/public.orders`."""
    return f"delta.{q(location)}"


def catalog_table(*parts: str) -> str:
    return ".".join(q(p) for p in parts)


def create_namespace(namespace: str) -> str:
    return f"CREATE NAMESPACE IF NOT EXISTS {namespace}"


def create_table(table: str, schema: StructType, using: str, properties: dict[str, str]) -> str:
    """Every column nullable: the change-log's truncate rows have null keys, and evolution adds nullable columns."""
    cols = ", ".join(f"{q(f.name)} {sql_type(f.dataType)}"
                     + (f" COMMENT {literal(f.metadata['comment'])}" if f.metadata.get("comment") else "")
                     for f in schema.fields)
    props = ", ".join(f"{literal(k)} = {literal(v)}" for k, v in sorted(properties.items()))
    tail = f" TBLPROPERTIES ({props})" if props else ""
    return f"CREATE TABLE IF NOT EXISTS {table} ({cols}) USING {using}{tail}"


def set_properties(table: str, properties: dict[str, str]) -> str:
    props = ", ".join(f"{literal(k)} = {literal(v)}" for k, v in sorted(properties.items()))
    return f"ALTER TABLE {table} SET TBLPROPERTIES ({props})"


def add_columns(table: str, columns: Sequence[tuple[Sequence[str], DataType]]) -> str:
    cols = ", ".join(f"{path_of(p)} {sql_type(t)}" for p, t in columns)
    return f"ALTER TABLE {table} ADD COLUMNS ({cols})"


def drop_columns(table: str, columns: Sequence[Sequence[str]]) -> str:
    return f"ALTER TABLE {table} DROP COLUMNS ({', '.join(path_of(p) for p in columns)})"


def change_type(table: str, column: Sequence[str], dt: DataType) -> str:
    return f"ALTER TABLE {table} ALTER COLUMN {path_of(column)} TYPE {sql_type(dt)}"


def truncate_before(table: str, position: str) -> str:
    """A landed truncate: rows last changed before it go; rows changed after it (a replay) stay."""
    return f"DELETE FROM {table} WHERE {CDC_POS} < {literal(position)}"


def _key_match(key: Sequence[str]) -> str:
    # null-safe: a table without a primary key uses all its columns as the key, and they may be NULL
    return " AND ".join(f"t.{q(k)} <=> s.{q(k)}" for k in key)


def typed_literal(value: Any, dt: DataType) -> str:
    """A literal of type ``dt`` (one of ``collapse.RANGED``): compared with a column of that type, the
    format's file statistics can skip files (a literal of another type would cast the column)."""
    if isinstance(dt, StringType):
        return literal(value)
    text = format(value, "f") if isinstance(value, Decimal) else str(value)
    return f"CAST({literal(text)} AS {sql_type(dt)})"


def key_range(column: str, dt: DataType, lowest: Any, highest: Any, nulls: bool) -> str:
    """A target-only MERGE condition holding every key of the batch: the format skips files outside it."""
    t = f"t.{q(column)}"
    inside = (f"{t} >= {typed_literal(lowest, dt)} AND {t} <= {typed_literal(highest, dt)}"
              if lowest is not None and highest is not None else "")
    if not nulls:
        return inside or "FALSE"
    return f"({inside} OR {t} IS NULL)" if inside else f"{t} IS NULL"


def mirror_merge(table: str, source: str, key: Sequence[str], columns: Sequence[str], keep: Sequence[str],
                 prune: str | None = None) -> str:
    """Upsert/delete the collapsed source (one row per key) into the mirror.

    ``columns`` are the mirror's columns (source columns and ``_cdc_*``);
    ``keep`` the columns some event left unavailable: for those the row's
    ``_cdc_unavailable`` says whether to keep the mirror's value. A source
    row only acts on a mirror row of a lower position, so a replayed batch
    matches rows at its own position and changes nothing. ``prune`` (``key_range``)
    bounds the target side so that only files that may hold the batch's keys are read.
    """
    on = f"{prune} AND {_key_match(key)}" if prune else _key_match(key)
    newer = f"s.{CDC_POS} > t.{CDC_POS}"

    def assign(c: str) -> str:
        if c in keep:
            unknown = f"array_contains(s.{q(UNAVAILABLE)}, {literal(c)})"
            return f"t.{q(c)} = CASE WHEN {unknown} THEN t.{q(c)} ELSE s.{q(c)} END"
        return f"t.{q(c)} = s.{q(c)}"

    sets = ", ".join(assign(c) for c in columns if c not in key)
    names = ", ".join(q(c) for c in columns)
    values = ", ".join(f"s.{q(c)}" for c in columns)
    return (
        f"MERGE INTO {table} t USING {source} s ON {on} "
        f"WHEN MATCHED AND {newer} AND s.{q(DELETE_FLAG)} THEN DELETE "
        f"WHEN MATCHED AND {newer} THEN UPDATE SET {sets} "
        f"WHEN NOT MATCHED AND NOT s.{q(DELETE_FLAG)} THEN INSERT ({names}) VALUES ({values})"
    )


def holds_a_key(table: str, source: str, key: Sequence[str], prune: str | None = None) -> str:
    """A query giving one row when the table holds a key of the source, none otherwise; ``prune``
    (``key_range``) lets the format read only the files that may hold one."""
    on = f"{prune} AND {_key_match(key)}" if prune else _key_match(key)
    return f"SELECT 1 FROM {table} t LEFT SEMI JOIN {source} s ON {on} LIMIT 1"


def changelog_merge(
    table: str, source: str, key: Sequence[str], columns: Sequence[str], lowest: str, highest: str
) -> str:
    """Insert the events the change-log does not hold yet.

    An event is identified by position, op and key: the daemon re-lands
    events after its crash under new batch seqs with the same positions, so
    ``_cdc_batch`` is not part of it; the key tells apart snapshot rows,
    which share one position. The position range only lets the format skip
    files whose statistics are outside it.
    """
    on = " AND ".join(
        [
            f"t.{CDC_POS} >= {literal(lowest)}",
            f"t.{CDC_POS} <= {literal(highest)}",
            f"t.{CDC_POS} = s.{CDC_POS}",
            f"t.{CDC_OP} = s.{CDC_OP}",
            *([_key_match(key)] if key else []),
        ]
    )
    names = ", ".join(q(c) for c in columns)
    values = ", ".join(f"s.{q(c)}" for c in columns)
    return f"MERGE INTO {table} t USING {source} s ON {on} WHEN NOT MATCHED THEN INSERT ({names}) VALUES ({values})"


def mirror_insert(table: str, source: str, columns: Sequence[str]) -> str:
    """The collapsed source into a mirror created by this batch: an empty table needs no MERGE (no join,
    one pass); what ``mirror_merge`` would do to it, as its WHEN NOT MATCHED clause."""
    names = ", ".join(q(c) for c in columns)
    return f"INSERT INTO {table} ({names}) SELECT {names} FROM {source} WHERE NOT {q(DELETE_FLAG)}"


def append(table: str, source: str, columns: Sequence[str]) -> str:
    """Add every source row: the change-log's events when the table holds none of them yet."""
    names = ", ".join(q(c) for c in columns)
    return f"INSERT INTO {table} ({names}) SELECT {names} FROM {source}"
