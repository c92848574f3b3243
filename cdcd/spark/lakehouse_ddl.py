"""The schemas of the Delta Lake / Iceberg tables: what a change-log and a mirror hold, and the ALTERs that
make a table hold a new schema. Pure functions of Spark types (``cdcd.spark.lakehouse`` turns them into DDL)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from pyspark.sql.types import DataType, StructField, StructType

from cdcd.spark.collapse import Prepared
from cdcd.spark.widening import holds, lossless

__all__ = ["Changes", "changelog_schema", "holds", "lossless", "mirror_schema", "schema_changes"]


@dataclass(slots=True)
class Changes:
    adds: list[tuple[list[str], DataType]] = field(default_factory=list)
    drops: list[list[str]] = field(default_factory=list)
    retypes: list[tuple[list[str], DataType]] = field(default_factory=list)


def schema_changes(have: StructType, want: StructType, stored_type: Callable[[DataType], str], drop: bool,
                   prefix: list[str] | None = None) -> Changes:
    """The ALTERs that make table schema ``have`` hold ``want`` (struct fields compared by name; ``stored_type``:
    how the format stores a type, ``Lakehouse.stored_type``)."""
    path = prefix or []
    out = Changes()
    current = {f.name: f.dataType for f in have.fields}
    wanted = {f.name for f in want.fields}
    for f in want.fields:
        old = current.get(f.name)
        if old is None:
            out.adds.append(([*path, f.name], f.dataType))
        elif isinstance(old, StructType) and isinstance(f.dataType, StructType):
            inner = schema_changes(old, f.dataType, stored_type, drop, [*path, f.name])
            out.adds += inner.adds
            out.drops += inner.drops
            out.retypes += inner.retypes
        elif stored_type(old) != stored_type(f.dataType) and not holds(old, f.dataType):
            # a narrowed column keeps its wider type (the MERGE casts up); anything else is altered
            out.retypes.append(([*path, f.name], f.dataType))
    if drop:
        out.drops += [[*path, f.name] for f in have.fields if f.name not in wanted]
    return out


def mirror_schema(p: Prepared) -> StructType:
    return StructType([StructField(c, p.types[c]) for c in p.mirror_columns])


def changelog_schema(have: StructType | None, landed: StructType) -> StructType:
    """The change-log keeps every column it ever had (old events keep their values); new ones are added."""
    if have is None:
        return StructType([StructField(f.name, f.dataType) for f in landed.fields])
    names = set(have.fieldNames())
    fields = [StructField(f.name, _merged(f.dataType, landed[f.name].dataType) if f.name in landed.fieldNames()
                          else f.dataType) for f in have.fields]
    return StructType(fields + [StructField(f.name, f.dataType) for f in landed.fields if f.name not in names])


def _merged(have: DataType, landed: DataType) -> DataType:
    if isinstance(have, StructType) and isinstance(landed, StructType):
        return changelog_schema(have, landed)
    return landed
