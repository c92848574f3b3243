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


@dataclass
class _Slot:
    """A column while the clauses apply: the name it had before the statement (None: added by it) and whether it
    is a key column."""

    before: str | None
    column: Column
    key: bool = False


def apply_alter(schema: TableSchema, actions: tuple[Action, ...], next_id: int,
                flavor: str = "mariadb") -> Altered | None:
    """The schema after the column clauses; None when a clause cannot be applied to it. ``flavor``: the server's
    (``mariadb`` or ``mysql``), which decides how some defaults read (``defaults.column_fill``).

    DROP, MODIFY, CHANGE and RENAME COLUMN name the table's columns as they were before the statement (``RENAME
    COLUMN a TO b, RENAME COLUMN b TO a`` swaps two columns); AFTER names them as they are after the clauses
    before it."""
    keyed = {k.lower() for k in schema.key}
    cols = [_Slot(c.name, replace(c, fill=None), c.name.lower() in keyed) for c in schema.columns]
    unknown: list[tuple[str, str]] = []

    def find(name: str, current: bool = False) -> int | None:
        for i, s in enumerate(cols):
            have = s.column.name if current else s.before
            if have is not None and have.lower() == name.lower():
                return i
        return None

    def index(name: str, current: bool = False) -> int:
        i = find(name, current)
        if i is None:
            raise _Cannot(name)
        return i

    def place(slot: _Slot, where: str, at: int | None = None) -> None:
        if where == "first":
            cols.insert(0, slot)
        elif where.startswith("after:"):
            cols.insert(index(where[6:], current=True) + 1, slot)
        elif at is not None:
            cols.insert(at, slot)
        else:
            cols.append(slot)

    def column(d: ColumnDef, cid: int | None) -> Column:
        return Column(d.name, arrow_type(d.source_type), d.source_type, d.nullable, cid)

    try:
        for a in actions:
            if a.kind == "add" and a.column is not None:
                if a.if_exists and find(a.column.name, current=True) is not None:
                    continue  # ADD COLUMN IF NOT EXISTS of a column the table has: nothing happens
                fill, why = column_fill(a.column, flavor)
                place(_Slot(None, replace(column(a.column, next_id), fill=fill)), a.column.placement)
                next_id += 1
                if why:
                    unknown.append((a.column.name, why))
            elif a.if_exists and find(a.name) is None:
                continue  # DROP / MODIFY / CHANGE / RENAME COLUMN IF EXISTS of a column the table does not have
            elif a.kind == "drop":
                cols.pop(index(a.name))
            elif a.kind == "modify" and a.column is not None:
                i = index(a.name)
                old = cols.pop(i)
                place(_Slot(old.before, column(a.column, old.column.id), old.key), a.column.placement, at=i)
            elif a.kind == "rename_column":
                slot = cols[index(a.name)]
                slot.column = replace(slot.column, name=a.new_name)
    except (_Cannot, ValueError):
        return None
    key = tuple(s.column.name for s in cols if s.key)  # key in column order, as the table map gives it
    return Altered(TableSchema(schema.table, tuple(s.column for s in cols), key, schema.version), tuple(unknown))
