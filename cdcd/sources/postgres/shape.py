"""A captured table's shape: landing schema plus one converter per column.

Built from the catalog (snapshot) or from a pgoutput Relation message
(streaming); both give equal ``TableSchema`` values for an unchanged table,
so snapshot rows and streamed rows land with the same schema.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import structlog

from cdcd.events import Column, Fill, TableId, TableSchema
from cdcd.sources.postgres.catalog import TableInfo
from cdcd.sources.postgres.types import ColumnType, TypeRegistry, Unrepresentable
from cdcd.sources.postgres.wire.pgoutput import UNCHANGED_TOAST, Relation, TupleValue

log = structlog.get_logger("cdcd.source.postgres")


@dataclass(frozen=True, slots=True)
class TableShape:
    schema: TableSchema
    types: tuple[ColumnType, ...]
    identity: tuple[bool, ...]  # column is part of the replica identity (pgoutput 'K' tuples)

    @property
    def table(self) -> TableId:
        return self.schema.table


class Warnings:
    """One warning per (table, column, reason): a bad value must not flood the log."""

    def __init__(self) -> None:
        self._seen: set[tuple[str, str, str]] = set()

    def once(self, table: TableId, column: str, reason: str, **kw: Any) -> None:
        key = (str(table), column, reason)
        if key not in self._seen:
            self._seen.add(key)
            log.warning(reason, table=str(table), column=column, **kw)


def _schema(table: TableId, names: Sequence[str], types: Sequence[ColumnType], key: tuple[str, ...],
            not_null: Sequence[bool], version: int, ids: Sequence[int | None],
            fills: Sequence[Fill | None]) -> TableSchema:
    cols = tuple(Column(n, t.arrow, t.source_type, not nn, i, f)
                 for n, t, nn, i, f in zip(names, types, not_null, ids, fills, strict=True))
    return TableSchema(table, cols, key, version)


def warn_unknown(shape: TableShape, warnings: Warnings) -> None:
    for col, t in zip(shape.schema.columns, shape.types, strict=True):
        if not t.known:
            warnings.once(shape.table, col.name, "unknown PostgreSQL type: landed as its text form",
                          source_type=t.source_type)


def shape_from_info(info: TableInfo, registry: TypeRegistry, version: int = 0) -> TableShape:
    types = tuple(registry.column_type(c.type_oid, c.typmod, c.ndims) for c in info.columns)
    names = [c.name for c in info.columns]
    schema = _schema(info.table, names, types, info.key, [c.not_null for c in info.columns], version,
                     [c.attnum for c in info.columns], [None] * len(names))
    identity = tuple(c.name in info.identity_key or info.replica_identity == "f" for c in info.columns)
    return TableShape(schema, types, identity)


def shape_from_relation(rel: Relation, info: TableInfo | None, registry: TypeRegistry, version: int,
                        ids: Sequence[int | None] | None = None,
                        fills: Sequence[Fill | None] | None = None) -> TableShape:
    """The shape a Relation message describes; key, dimensions and NOT NULL come from the catalog when it agrees;
    the columns' ids and fills are the caller's (``columns.py``; None: unknown)."""
    table = TableId(rel.namespace, rel.name)
    by_name = {c.name: c for c in info.columns} if info else {}
    types = tuple(
        registry.column_type(c.type_oid, c.typmod, by_name[c.name].ndims if c.name in by_name else 1)
        for c in rel.columns
    )
    names = [c.name for c in rel.columns]
    key = info.key if info and all(k in names for k in info.key) else ()
    flagged = tuple(c.name for c in rel.columns if c.key)  # the replica identity, as the server sends it
    if rel.replica_identity in ("d", "i") and flagged and set(flagged) != set(key):
        key = flagged  # the catalog is older than this Relation (the identity changed): the server's word wins
    if not key and rel.replica_identity != "f":
        key = flagged
    not_null = [by_name[c.name].not_null if c.name in by_name else False for c in rel.columns]
    none = [None] * len(names)
    schema = _schema(table, names, types, key, not_null, version, none if ids is None else ids,
                     none if fills is None else fills)
    return TableShape(schema, types, tuple(c.key for c in rel.columns))


def same_columns(a: TableSchema, b: TableSchema) -> bool:
    return a.columns == b.columns and a.key == b.key


def known_columns(schema: TableSchema) -> tuple[tuple[str, int | None, str], ...]:
    """What the column matching (``columns.py``) and the checkpoint (``state.py``, ``"columns"``) keep of a schema."""
    return tuple((c.name, c.id, c.source_type) for c in schema.columns)


#: pgoutput's text of infinite dates and timestamps; landed as the type's largest/smallest value.
_INFINITE = (b"infinity", b"-infinity")
INFINITE = "infinite date/timestamp landed as the type's largest/smallest value"
_CLAMPED = {"date", "timestamp", "timestamptz"}


class RowDecoder:
    """pgoutput tuples → row dicts of Python values, for one table shape."""

    def __init__(self, shape: TableShape, warnings: Warnings) -> None:
        self.shape = shape
        self._cols = [(c.name, t.from_text) for c, t in zip(shape.schema.columns, shape.types, strict=True)]
        self._clamped = {c.name for c, t in zip(shape.schema.columns, shape.types, strict=True)
                         if t.source_type.split("(")[-1].rstrip(")") in _CLAMPED}
        self._warnings = warnings

    def row(self, values: Sequence[TupleValue]) -> tuple[dict[str, Any], list[str]]:
        """The row and the names of its unavailable (unchanged TOAST) columns."""
        out: dict[str, Any] = {}
        missing: list[str] = []
        for (name, conv), raw in zip(self._cols, values, strict=True):
            if raw is None:
                out[name] = None
            elif raw is UNCHANGED_TOAST:
                out[name] = None
                missing.append(name)
            else:
                if name in self._clamped and raw in _INFINITE:
                    self._warnings.once(self.shape.table, name, INFINITE)
                try:
                    out[name] = conv(raw.decode())  # type: ignore[union-attr]
                except (Unrepresentable, ValueError) as exc:
                    self._warnings.once(self.shape.table, name, "value cannot be represented: landed as NULL",
                                        error=str(exc))
                    out[name] = None
        return out, missing

    def key_row(self, values: Sequence[TupleValue]) -> dict[str, Any]:
        """A 'K' tuple: only the replica identity columns carry values."""
        row, _ = self.row(values)
        return {name: row[name] for (name, _), ident in zip(self._cols, self.shape.identity, strict=True) if ident}
