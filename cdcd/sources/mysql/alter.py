"""The table schema after an ALTER TABLE's column clauses (parsed by ``ddl.py``), applied in statement order.

Columns keep their ``id`` through RENAME COLUMN, CHANGE and MODIFY (wherever FIRST/AFTER moves them); an added
column takes the table's next free id (``SchemaHistory.next_id``), so a column dropped and added again under its
name is another column. The added column carries its ``fill`` (``defaults.py``) on this version only: the
columns taken over from the schema before lose theirs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from cdcd.events import Column, TableSchema
from cdcd.sources.mysql.ddl import Action, ColumnDef
from cdcd.sources.mysql.defaults import column_fill
from cdcd.sources.mysql.types import arrow_type


@dataclass(frozen=True)
class Altered:
    """An ALTER's result: the new schema (version as before: the history numbers it) and the added columns whose
    existing rows hold values no event carries and no fill gives (column name, why)."""

    schema: TableSchema
    unknown: tuple[tuple[str, str], ...] = ()


class _Cannot(Exception):
    """A clause names a column the schema does not have: the next table map defines the new shape."""


def apply_alter(schema: TableSchema, actions: tuple[Action, ...], next_id: int,
                flavor: str = "mariadb") -> Altered | None:
    """The schema after the column clauses; None when a clause cannot be applied to it. ``flavor``: the server's
    (``mariadb`` or ``mysql``), which decides how some defaults read (``defaults.column_fill``)."""
    cols = [replace(c, fill=None) for c in schema.columns]
    key = list(schema.key)
    unknown: list[tuple[str, str]] = []

    def find(name: str) -> int | None:
        for i, c in enumerate(cols):
            if c.name.lower() == name.lower():
                return i
        return None

    def index(name: str) -> int:
        i = find(name)
        if i is None:
            raise _Cannot(name)
        return i

    def place(col: Column, where: str, at: int | None = None) -> None:
        if where == "first":
            cols.insert(0, col)
        elif where.startswith("after:"):
            cols.insert(index(where[6:]) + 1, col)
        elif at is not None:
            cols.insert(at, col)
        else:
            cols.append(col)

    def column(d: ColumnDef, cid: int | None) -> Column:
        return Column(d.name, arrow_type(d.source_type), d.source_type, d.nullable, cid)

    try:
        for a in actions:
            if a.kind == "add" and a.column is not None:
                if a.if_exists and find(a.column.name) is not None:
                    continue  # ADD COLUMN IF NOT EXISTS of a column the table has: nothing happens
                fill, why = column_fill(a.column, flavor)
                place(replace(column(a.column, next_id), fill=fill), a.column.placement)
                next_id += 1
                if why:
                    unknown.append((a.column.name, why))
            elif a.kind == "drop":
                if a.if_exists and find(a.name) is None:
                    continue
                dropped = cols.pop(index(a.name))
                key = [k for k in key if k != dropped.name]
            elif a.kind == "modify" and a.column is not None:
                if a.if_exists and find(a.name) is None:
                    continue
                i = index(a.name)
                old = cols.pop(i)
                new = column(a.column, old.id)
                place(new, a.column.placement, at=i)
                key = [new.name if k == old.name else k for k in key]
            elif a.kind == "rename_column":
                if a.if_exists and find(a.name) is None:
                    continue
                i = index(a.name)
                old = cols[i]
                cols[i] = replace(old, name=a.new_name)
                key = [a.new_name if k == old.name else k for k in key]
    except (_Cannot, ValueError):
        return None
    names = [c.name for c in cols]
    key = [k for k in names if k in key]  # key in column order, as the table map gives it
    return Altered(TableSchema(schema.table, tuple(cols), tuple(key), schema.version), tuple(unknown))
