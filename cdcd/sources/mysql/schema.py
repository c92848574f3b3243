"""Schema history: the table schema in force at each binlog position.

Row events are decoded with the column list of their own table-map event
(``binlog_row_metadata=FULL`` puts names, signedness, charsets, enum/set
values and the primary key in the binlog), so old events always decode with
the columns they were written with. The history gives those shapes stable
version numbers across restarts, carries the richer snapshot types, and
follows DDL (``ALTER TABLE ... ADD/DROP/MODIFY/CHANGE/RENAME COLUMN``,
``RENAME TABLE``, ``TRUNCATE``) from Query events (parsed by ``ddl.py``, applied by
``alter.py``). Each column has an id, the table's next free number when the
column first appears (a snapshot, a table map, an ADD COLUMN), kept through
renames and type changes; a table map's columns take the ids of the columns of
their names. It is persisted in the source state that ``fold`` returns.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, replace
from typing import Any

from cdcd.events import Column, Fill, TableId, TableSchema
from cdcd.positions import MySqlPosition, position_from_json
from cdcd.sources.mysql.types import arrow_type, key_from_json, key_to_json, quote_values

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


def same_columns(a: TableSchema, b: TableSchema) -> bool:
    """Equal as a DDL sees it: names, ids, source types (``varchar(20)`` is not ``varchar(200)``), nullability,
    order and key; fills aside (a fill belongs to the version that added its column)."""
    def cols(s: TableSchema) -> list[tuple[object, ...]]:
        return [(c.name, c.id, c.source_type, c.nullable) for c in s.columns]
    return a.key == b.key and cols(a) == cols(b)


def schema_to_json(s: TableSchema) -> dict[str, Any]:
    """``columns``: ``[name, source_type, nullable, id]``, with the fill's value (``key_to_json``) fifth."""
    columns: list[list[Any]] = []
    for c in s.columns:
        entry: list[Any] = [c.name, c.source_type, c.nullable, c.id]
        if c.fill is not None:
            entry.append(key_to_json((c.fill.value,))[0])
        columns.append(entry)
    return {"columns": columns, "key": list(s.key), "version": s.version}


def schema_from_json(table: TableId, doc: dict[str, Any]) -> TableSchema:
    """The schema; a history an earlier version saved has no ids: the columns take 1..n by position."""
    cols = []
    for i, entry in enumerate(doc["columns"]):
        name, st, nullable = entry[:3]
        cid = entry[3] if len(entry) > 3 and entry[3] is not None else i + 1
        fill = Fill(key_from_json([entry[4]])[0]) if len(entry) > 4 else None
        cols.append(Column(name, arrow_type(st), st, bool(nullable), int(cid), fill))
    return TableSchema(table, tuple(cols), tuple(doc["key"]), int(doc["version"]))


def with_ids(schema: TableSchema, before: TableSchema | None, next_id: int) -> TableSchema:
    """``schema`` (from a table map or the catalog: no ids) with each column's id: the one of the column of its
    name in ``before``, else the next free one. A column that has an id keeps it."""
    if all(c.id is not None for c in schema.columns):
        return schema
    known = {c.name.lower(): c.id for c in (before.columns if before is not None else ())}
    taken = {c.id for c in schema.columns if c.id is not None}
    cols = []
    for c in schema.columns:
        cid = c.id
        if cid is None:
            cid = known.get(c.name.lower())
            if cid is None or cid in taken:
                cid = next_id
                next_id += 1
            taken.add(cid)
        cols.append(replace(c, id=cid))
    return TableSchema(schema.table, tuple(cols), schema.key, schema.version)


@dataclass
class _Entry:
    pos: MySqlPosition
    schema: TableSchema


class SchemaHistory:
    """Per table, the schemas in force from each position on, and the next column id to give (never reused)."""

    def __init__(self) -> None:
        self._entries: dict[TableId, list[_Entry]] = {}
        self._next_id: dict[TableId, int] = {}

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

    def next_id(self, table: TableId) -> int:
        """The id the table's next new column takes: above every id it ever had, dropped columns' too."""
        return self._next_id.get(table, 1)

    def _saw(self, schema: TableSchema) -> None:
        top = max((c.id for c in schema.columns if c.id is not None), default=0)
        self._next_id[schema.table] = max(self.next_id(schema.table), top + 1)

    def record(self, pos: MySqlPosition, schema: TableSchema) -> TableSchema:
        """Record ``schema`` as in force from ``pos``; returns it with its version number and column ids (columns
        without one take the id of the column of their name before ``pos``, or a new one)."""
        entries = self._entries.setdefault(schema.table, [])
        for e in entries:
            if e.pos == pos:
                return e.schema  # already known (a replay)
        version = max((e.schema.version for e in entries), default=0) + 1
        before = self.at(schema.table, pos) or self.latest(schema.table)
        s = with_ids(TableSchema(schema.table, schema.columns, schema.key, version), before,
                     self.next_id(schema.table))
        bisect.insort(entries, _Entry(pos, s), key=lambda e: e.pos)
        del entries[:-MAX_VERSIONS_KEPT]
        self._saw(s)
        return s

    def add_entry(self, pos: MySqlPosition, schema: TableSchema) -> None:
        """Add an entry with its version as is (loading, folding); duplicates are ignored."""
        entries = self._entries.setdefault(schema.table, [])
        self._saw(schema)
        if any(e.pos == pos for e in entries):
            return
        bisect.insort(entries, _Entry(pos, schema), key=lambda e: e.pos)
        del entries[:-MAX_VERSIONS_KEPT]

    def successor(self) -> SchemaHistory:
        """A history for a new snapshot of the same tables: the latest schema of each table (its columns keep their
        ids by name) and the next ids, nothing older."""
        h = SchemaHistory()
        h._next_id = dict(self._next_id)
        h._entries = {t: entries[-1:] for t, entries in self._entries.items() if entries}
        return h

    def to_json(self) -> dict[str, Any]:
        return {
            str(t): [{"pos": e.pos.to_json(), "schema": schema_to_json(e.schema), "next_id": self.next_id(t)}
                     for e in entries]
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
                h._next_id[table] = max(h.next_id(table), int(e.get("next_id") or 1))
        return h
