"""Schema history: the table schema in force at each binlog position.

Row events are decoded with the column list of their own table-map event
(``binlog_row_metadata=FULL`` puts names, signedness, charsets, enum/set
values and the primary key in the binlog), so old events always decode with
the columns they were written with. The history gives those shapes stable
version numbers across restarts, carries the richer snapshot types, and
follows DDL (``ALTER TABLE ... ADD/DROP/MODIFY/CHANGE/RENAME COLUMN``,
``RENAME TABLE``, ``TRUNCATE``) from Query events (parsed by ``ddl.py``). It is
persisted in the source state that ``fold`` returns.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any

from cdcd.events import Column, TableId, TableSchema
from cdcd.positions import MySqlPosition, position_from_json
from cdcd.sources.mysql.types import arrow_type, quote_values

MAX_VERSIONS_KEPT = 64

# pymysqlreplication FIELD_TYPE codes
_INT_NAMES = {1: "tinyint", 2: "smallint", 9: "mediumint", 3: "int", 8: "bigint"}
_BLOB_TEXT = {1: ("tinyblob", "tinytext"), 2: ("blob", "text"), 3: ("mediumblob", "mediumtext"),
              4: ("longblob", "longtext")}


def binlog_source_type(col: Any) -> str:
    """The COLUMN_TYPE-style name of a table-map column (a pymysqlreplication Column)."""
    t = col.type
    binary = getattr(col, "character_set_name", None) == "binary"
    if t in _INT_NAMES:
        return _INT_NAMES[t] + (" unsigned" if col.unsigned else "")
    if t == 246:
        return f"decimal({col.precision},{col.decimals})"
    if t == 4:
        return "float"
    if t == 5:
        return "double"
    if t in (15, 253):
        return "varbinary" if binary else "varchar"
    if t == 254:
        return f"binary({col.max_length})" if binary else "char"
    if t in (249, 250, 251, 252):
        blob, text = _BLOB_TEXT.get(getattr(col, "length_size", 2), ("blob", "text"))
        return blob if binary else text
    if t in (10, 14):
        return "date"
    if t in (12, 18):
        return f"datetime({getattr(col, 'fsp', 0)})"
    if t in (7, 17):
        return f"timestamp({getattr(col, 'fsp', 0)})"
    if t in (11, 19):
        return f"time({getattr(col, 'fsp', 0)})"
    if t == 13:
        return "year"
    if t == 245:
        return "json"
    if t == 247:
        return f"enum({quote_values(list(col.enum_values or [''])[1:])})"
    if t == 248:
        return f"set({quote_values(list(col.set_values or []))})"
    if t == 16:
        return f"bit({col.bits})"
    if t == 255:
        return "geometry"
    raise ValueError(f"binlog column type code {t} of column {col.name!r} is not supported")


def schema_from_table_map(table: TableId, columns: list[Any]) -> TableSchema:
    """A TableSchema (version 0) from a table map's columns; key in column order."""
    cols = []
    key = []
    for i, c in enumerate(columns):
        if not c.name:
            raise ValueError(
                f"the binlog has no column names for {table} (column {i}): set binlog_row_metadata=FULL"
            )
        st = binlog_source_type(c)
        cols.append(Column(c.name, arrow_type(st), st))
        if getattr(c, "is_primary", False):
            key.append(c.name)
    return TableSchema(table, tuple(cols), tuple(key))


#: MariaDB types the binlog's table map shows as fixed binary strings (their stored bytes).
_STORED_AS_BINARY = {"uuid": "binary(16)", "inet6": "binary(16)", "inet4": "binary(4)"}


def refine_types(derived: TableSchema, known: TableSchema | None) -> TableSchema:
    """The table map's schema with the types the binlog cannot name (UUID, INET6, INET4) taken from ``known``.

    ``known`` is the schema the history holds (from the snapshot's information_schema or from the DDL
    that added the column): where it names one of those types for a column the table map shows as
    the matching BINARY(n), the column keeps the richer type, so the stream lands the same text as the
    snapshot.
    """
    if known is None:
        return derived
    by_name = {c.name: c for c in known.columns}
    cols = []
    changed = False
    for c in derived.columns:
        k = by_name.get(c.name)
        if k is not None and _STORED_AS_BINARY.get(k.source_type.split("(")[0]) == c.source_type:
            cols.append(Column(c.name, k.type, k.source_type, c.nullable))
            changed = True
        else:
            cols.append(c)
    return TableSchema(derived.table, tuple(cols), derived.key, derived.version) if changed else derived


def same_shape(a: TableSchema, b: TableSchema) -> bool:
    """Equal for landing purposes: names, Arrow types and key (not type spelling or nullability)."""
    return (
        a.key == b.key
        and len(a.columns) == len(b.columns)
        and all(x.name == y.name and x.type == y.type for x, y in zip(a.columns, b.columns, strict=True))
    )


def schema_to_json(s: TableSchema) -> dict[str, Any]:
    return {
        "columns": [[c.name, c.source_type, c.nullable] for c in s.columns],
        "key": list(s.key),
        "version": s.version,
    }


def schema_from_json(table: TableId, doc: dict[str, Any]) -> TableSchema:
    cols = tuple(Column(n, arrow_type(st), st, bool(nullable)) for n, st, nullable in doc["columns"])
    return TableSchema(table, cols, tuple(doc["key"]), int(doc["version"]))


@dataclass
class _Entry:
    pos: MySqlPosition
    schema: TableSchema


class SchemaHistory:
    """Per table, the schemas in force from each position on."""

    def __init__(self) -> None:
        self._entries: dict[TableId, list[_Entry]] = {}

    def at(self, table: TableId, pos: MySqlPosition) -> TableSchema | None:
        """The schema in force at ``pos`` (the last one recorded at or before it)."""
        entries = self._entries.get(table)
        if not entries:
            return None
        i = bisect.bisect_right([e.pos for e in entries], pos)
        return entries[i - 1].schema if i else None

    def latest(self, table: TableId) -> TableSchema | None:
        entries = self._entries.get(table)
        return entries[-1].schema if entries else None

    def record(self, pos: MySqlPosition, schema: TableSchema) -> TableSchema:
        """Record ``schema`` as in force from ``pos``; returns it with its version number."""
        entries = self._entries.setdefault(schema.table, [])
        for e in entries:
            if e.pos == pos:
                return e.schema  # already known (a replay)
        version = max((e.schema.version for e in entries), default=0) + 1
        s = TableSchema(schema.table, schema.columns, schema.key, version)
        bisect.insort(entries, _Entry(pos, s), key=lambda e: e.pos)
        del entries[:-MAX_VERSIONS_KEPT]
        return s

    def add_entry(self, pos: MySqlPosition, schema: TableSchema) -> None:
        """Add an entry with its version as is (loading, folding); duplicates are ignored."""
        entries = self._entries.setdefault(schema.table, [])
        if any(e.pos == pos for e in entries):
            return
        bisect.insort(entries, _Entry(pos, schema), key=lambda e: e.pos)
        del entries[:-MAX_VERSIONS_KEPT]

    def to_json(self) -> dict[str, Any]:
        return {
            str(t): [{"pos": e.pos.to_json(), "schema": schema_to_json(e.schema)} for e in entries]
            for t, entries in sorted(self._entries.items())
        }

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> SchemaHistory:
        h = cls()
        for name, entries in doc.items():
            table = TableId.parse(name)
            for e in entries:
                pos = position_from_json(e["pos"])
                assert isinstance(pos, MySqlPosition)
                h.add_entry(pos, schema_from_json(table, e["schema"]))
        return h
