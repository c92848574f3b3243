"""Schema changes of a Delta Lake / Iceberg change-log or mirror: the statements that make it hold a new schema.

Columns are matched by identity where the landing gives one (``cdcd.spark.identity``: the id in each target
column's comment), else by name. In order (docs/spark.md, "Schema changes"):

1. an interrupted rewrite is finished or started again; a pending fill is applied (crash safety);
2. target columns without an id take the one the merge's first landed file gives their name;
3. a column whose name a new column (another id) took: dropped from the mirror, moved aside in the change-log
   (``_cdc_old_<name>_<id>``); a column whose id comes under another name: renamed;
4. new columns added with their id (and, in the mirror, with a fill: the rows below the position where the
   column appeared take the fill value, the column's comment saying so until it is done);
5. type changes: widened in place where the format can (``widens_in_place``), rewritten (a new column filled
   with the cast values, the old dropped, the new renamed; timed and logged) where only the format cannot; a
   change that would lose values moves the change-log's column aside and stops the consumer before the batch
   for the mirror (``SchemaChangeRefused``) unless the operator approved a rewrite of that column
   (``cdcd.rewrite.<column>`` on the mirror);
6. columns gone from the source dropped from the mirror (the change-log keeps them).
Every step is one commit of the format and can be run again: a consumer killed between two of them finds its
way from the table's schema on the next run.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from pyspark.sql import SparkSession
from pyspark.sql.types import DataType, StructField, StructType

from cdcd.errors import CdcdError
from cdcd.landing.columns import CDC_POS
from cdcd.landing.reader import LandedFile
from cdcd.logging import get_logger
from cdcd.spark.identity import NEW_PREFIX, Identity, Tag, fill_sql, old_name, tag_of, tagged
from cdcd.spark.lakehouse_ddl import schema_changes
from cdcd.spark.lakehouse_sql import literal, path_of, q, sql_type
from cdcd.spark.state import TableState
from cdcd.spark.widening import lossless

_log = get_logger("cdcd.spark")
#: The mirror's table property by which the operator approves a rewrite that may lose values: its value is the
#: column's new type, e.g. ``'cdcd.rewrite.qty' = 'int'`` (docs/spark.md, "Schema changes").
REWRITE_PROPERTY = "cdcd.rewrite."
MIRROR, CHANGELOG = "tables", "changelog"
#: A column renamed in a circle of renames (two columns swap names) stands aside under ``_cdc_renaming_<name>``.
RENAMING_PREFIX = "_cdc_renaming_"


class SchemaChangeRefused(CdcdError):
    """A type change the mirror cannot take without losing values; nothing of the batch was applied."""


class Dialect(Protocol):
    """What a format says about its DDL (``cdcd.spark.lakehouse.Lakehouse``)."""

    name: str

    def stored_type(self, dt: DataType) -> str: ...

    def widens_in_place(self, old: DataType, new: DataType) -> bool: ...

    def before_widen(self, table: str) -> list[str]: ...

    def before_rename(self, table: str) -> list[str]: ...


class Rewrite(str):
    """A statement that rewrites every stored value of a column (``run_ddl`` times and logs it)."""

    __slots__ = ()


@dataclass(frozen=True, slots=True)
class Target:
    table: str  # the SQL reference
    name: str  # "schema.table", for messages
    kind: str  # MIRROR or CHANGELOG


def _data(f: StructField) -> bool:
    return not f.name.startswith("_cdc_") or f.name.startswith(NEW_PREFIX)


def reconcile(fmt: Dialect, t: Target, have: StructType, ident: Identity | None) -> tuple[list[str], StructType]:
    """Steps 1 to 3 of the module docstring: the statements, and the table's schema after them."""
    out: list[str] = []
    fields = list(have.fields)

    def index(name: str) -> int | None:
        return next((i for i, f in enumerate(fields) if f.name == name), None)

    mapped = False

    def renaming() -> list[str]:
        nonlocal mapped
        first, mapped = not mapped, True
        return fmt.before_rename(t.table) if first else []

    for f in [f for f in fields if f.name.startswith(NEW_PREFIX)]:  # step 1: an interrupted rewrite
        name = f.name[len(NEW_PREFIX):]
        at = index(f.name)
        assert at is not None
        if index(name) is not None:
            out += [*renaming(), f"ALTER TABLE {t.table} DROP COLUMN {q(f.name)}"]
            fields.pop(at)
        else:
            out += [*renaming(), _rename(t.table, f.name, name)]
            fields[at] = StructField(name, f.dataType, f.nullable, f.metadata)
    if t.kind == MIRROR:
        for f in fields:
            if tag_of(f).fill_below is not None:
                out += _fill(t.table, f, tag_of(f), ident)
    if ident is None:
        return out, StructType(fields)
    for i, f in enumerate(fields):  # step 2
        if _data(f) and tag_of(f).id is None and f.name in ident.first:
            fields[i] = tagged(f, Tag(ident.first[f.name]))
            out.append(_comment(t.table, fields[i]))
    names = ident.names
    for f in list(fields):  # step 3: a name taken by a new column
        was = tag_of(f).id
        now = ident.entry(f.name)
        if was is None or now is None or now.id is None or now.id == was or was in names:
            continue
        at = index(f.name)
        assert at is not None
        if t.kind == MIRROR:
            out += [*renaming(), f"ALTER TABLE {t.table} DROP COLUMN {q(f.name)}"]
            fields.pop(at)
        else:
            aside = old_name(f.name, was)
            out += [*renaming(), _rename(t.table, f.name, aside)]
            fields[at] = StructField(aside, f.dataType, f.nullable, f.metadata)
    # step 3: renames, each once its new name is free; a circle of names (a swap) through a name of its own
    wanted = {f.name: new for f in fields
              if (was := tag_of(f).id) is not None and (new := names.get(was)) is not None and new != f.name}
    while wanted:
        ready = next(((name, new) for name, new in wanted.items() if index(new) is None), None)
        if ready is None:
            stuck = [name for name, new in wanted.items() if new not in wanted]  # held by a column that stays
            for name in stuck:
                del wanted[name]
            if stuck:
                continue
            name = next(iter(wanted))
            ready = name, RENAMING_PREFIX + name  # steps aside; its rename to the name it wants follows
            wanted[ready[1]] = wanted[name]
        name, new = ready
        del wanted[name]
        at = index(name)
        assert at is not None
        out += [*renaming(), _rename(t.table, name, new)]
        fields[at] = StructField(new, fields[at].dataType, fields[at].nullable, fields[at].metadata)
    return out, StructType(fields)


def changes(fmt: Dialect, t: Target, have: StructType, want: StructType, ident: Identity | None,
            approve: Callable[[str, DataType], bool], before_drop: list[str]) -> list[str]:
    """Steps 4 to 6 of the module docstring (``have``: the schema after ``reconcile``)."""
    found = schema_changes(have, want, fmt.stored_type, t.kind == MIRROR)
    current = {f.name: f for f in have.fields}
    retypes: list[str] = []
    asides: set[str] = set()
    widened = False
    for p, dt in found.retypes:
        old = current[p[0]]
        old_type = _at(old.dataType, p[1:])
        if fmt.widens_in_place(old_type, dt):
            retypes += [] if widened else fmt.before_widen(t.table)
            widened = True
            retypes.append(f"ALTER TABLE {t.table} ALTER COLUMN {path_of(p)} TYPE {sql_type(dt)}")
        elif len(p) == 1 and lossless(old_type, dt):
            retypes += _rewrite(fmt, t.table, old, dt, "CAST")
        elif len(p) == 1 and t.kind == CHANGELOG:  # the change-log keeps the old values aside
            aside = old_name(old.name, old_type.simpleString())
            asides.add(aside)
            retypes += [*fmt.before_rename(t.table), _rename(t.table, old.name, aside),
                        f"ALTER TABLE {t.table} ADD COLUMNS ({q(old.name)} {sql_type(dt)}"
                        f"{_comment_clause(tag_of(old))})"]
        elif len(p) == 1 and approve(old.name, dt):
            retypes += _rewrite(fmt, t.table, old, dt, "TRY_CAST")
        else:
            raise refused(t, ".".join(p), old_type, dt)
    out: list[str] = []
    adds = [(p, dt, _new_tag(t, p, ident)) for p, dt in found.adds if p[0] not in asides]
    if adds:
        out.append(f"ALTER TABLE {t.table} ADD COLUMNS ("
                   + ", ".join(f"{path_of(p)} {sql_type(dt)}{_comment_clause(tag)}" for p, dt, tag in adds) + ")")
        for p, dt, tag in adds:
            if tag.fill_below is not None:
                out += _fill(t.table, StructField(p[0], dt, True, {}), tag, ident)
    out += retypes
    if found.drops:
        out += before_drop
        out.append(f"ALTER TABLE {t.table} DROP COLUMNS ({', '.join(path_of(p) for p in found.drops)})")
    return out


#: Spark's name of a landed Arrow type (``changed``); another type counts as changed.
_SPARK_NAMES = {"int8": "tinyint", "int16": "smallint", "int32": "int", "int64": "bigint", "float": "float",
                "double": "double", "string": "string", "large_string": "string", "bool": "boolean",
                "date32[day]": "date", "binary": "binary", "large_binary": "binary",
                "timestamp[us, tz=UTC]": "timestamp", "timestamp[us]": "timestamp_ntz"}


def changed(files: list[LandedFile], state: TableState) -> bool:
    """Whether the files may change the table's schema: several versions, or another than the last merge's."""
    latest = files[-1].entry.table.columns
    if any(f.entry.table.columns != latest for f in files):
        return True
    seen = {c[0]: c[1] for c in state.columns}
    for c in latest:
        decimal = re.fullmatch(r"decimal128\((\d+), (\d+)\)", c.arrow_type)
        spark = f"decimal({decimal[1]},{decimal[2]})" if decimal else _SPARK_NAMES.get(c.arrow_type)
        if spark is None or seen.get(c.name) != spark:
            return True
    return False


def refused(t: Target, column: str, old: DataType, new: DataType) -> SchemaChangeRefused:
    prop = f"{REWRITE_PROPERTY}{column}"
    return SchemaChangeRefused(
        f"table {t.name}, column {column}: the source changed its type from {old.simpleString()} to "
        f"{new.simpleString()}, which the mirror ({t.table}) cannot take without losing values; nothing of the "
        f"batch was applied and the consumer stops here (every rerun stops the same way). Two ways out: "
        f"(1) a new mirror version: move the table's mirror and change-log aside (docs/spark.md, \"Schema "
        f"changes\"), run the consumer again (it creates them with the new type), then `cdcd snapshot {t.name}` "
        f"so that the new mirror gets every row; or (2) approve a rewrite that casts the stored values (those the "
        f"new type cannot hold become NULL): ALTER TABLE {t.table} SET TBLPROPERTIES ({literal(prop)} = "
        f"{literal(new.simpleString())}), then run the consumer again")


def approved(spark: SparkSession, table: str, column: str, dt: DataType) -> bool:
    """Whether the operator approved a rewrite of ``column`` to ``dt`` (``REWRITE_PROPERTY``)."""
    rows = spark.sql(f"SHOW TBLPROPERTIES {table}").collect()
    return any(r[0] == REWRITE_PROPERTY + column and r[1].strip().lower() == dt.simpleString() for r in rows)


def run_ddl(spark: SparkSession, statements: list[str], table: str) -> None:
    """Run a table's DDL in order; a rewrite is timed and logged (what a type change the format cannot make in
    place costs)."""
    for s in statements:
        began = time.monotonic()
        spark.sql(s)
        if isinstance(s, Rewrite):
            _log.info("column rewritten for a type change", table=table, statement=str(s),
                      seconds=round(time.monotonic() - began, 3))


def _at(dt: DataType, path: list[str]) -> DataType:
    for name in path:
        assert isinstance(dt, StructType)
        dt = dt[name].dataType
    return dt


def _new_tag(t: Target, path: list[str], ident: Identity | None) -> Tag:
    entry = ident.entry(path[0]) if ident is not None and len(path) == 1 else None
    if entry is None:
        return Tag()
    fill = entry.fill is not None and entry.fill.get("value") is not None and t.kind == MIRROR
    assert ident is not None
    return Tag(entry.id, ident.added_at.get(entry.name) if fill else None)


def _fill(table: str, f: StructField, tag: Tag, ident: Identity | None) -> list[str]:
    """The rows of the mirror below the position where the column appeared take its fill; then the mark goes."""
    entry = ident.entry(f.name) if ident is not None else None
    out: list[str] = []
    if entry is not None and entry.fill is not None and tag.fill_below is not None:
        out.append(Rewrite(f"UPDATE {table} SET {q(f.name)} = {fill_sql(entry, f.dataType)} "
                           f"WHERE {CDC_POS} < {literal(tag.fill_below)}"))
    out.append(_comment(table, tagged(f, Tag(tag.id))))
    return out


def _rewrite(fmt: Dialect, table: str, old: StructField, dt: DataType, cast: str) -> list[str]:
    """A column to a type the format cannot change it to in place: a new column of the cast values."""
    new = NEW_PREFIX + old.name
    return [*fmt.before_rename(table),
            f"ALTER TABLE {table} ADD COLUMNS ({q(new)} {sql_type(dt)}{_comment_clause(tag_of(old))})",
            Rewrite(f"UPDATE {table} SET {q(new)} = {cast}({q(old.name)} AS {sql_type(dt)})"),
            f"ALTER TABLE {table} DROP COLUMN {q(old.name)}", _rename(table, new, old.name)]


def _rename(table: str, old: str, new: str) -> str:
    return f"ALTER TABLE {table} RENAME COLUMN {q(old)} TO {q(new)}"


def _comment(table: str, f: StructField) -> str:
    return f"ALTER TABLE {table} ALTER COLUMN {q(f.name)} COMMENT {literal(tag_of(f).text() or '')}"


def _comment_clause(tag: Tag) -> str:
    text = tag.text()
    return f" COMMENT {literal(text)}" if text else ""

