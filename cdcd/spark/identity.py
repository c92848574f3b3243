"""Landed columns by identity (docs/landing-format.md, "Column identity and fills") for Delta Lake and Iceberg.

A file entry's column may carry its ``id`` (a rename keeps it; a column dropped and added again gets a new
one) and a ``fill`` (the value rows that existed when it was added hold in it). The events of one merge,
landed under several schema versions, are read here under the latest version's names: a renamed column's
older values under its new name, a dropped column whose name a new column took moved aside
(``_cdc_old_<name>_<id>``), an older type converted to the latest where no value changes (else moved aside
as ``_cdc_old_<name>_<type>``), and, for the mirror, a column added with a fill holding it in rows landed
before it existed. The target tables keep each column's id in the column's comment (``Tag``), which a
rename keeps and which is written in the same commit as the column (``cdcd.spark.evolve``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace

from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import ArrayType, BinaryType, DataType, StructField, StructType

from cdcd.landing.columns import CDC_BEFORE_KEY, CDC_SCHEMA_VERSION
from cdcd.landing.manifest import ColumnEntry
from cdcd.landing.reader import LandedFile
from cdcd.spark.lakehouse_sql import literal, q, sql_type
from cdcd.spark.rule import schema_groups
from cdcd.spark.widening import holds, lossless

COMMENT = "comment"
TAG_PREFIX = "cdcd:"
#: A column being rewritten to a new type (``cdcd.spark.evolve``): ``_cdc_new_<name>``.
NEW_PREFIX = "_cdc_new_"
#: A change-log column moved aside: ``_cdc_old_<name>_<id>`` or ``_cdc_old_<name>_<type>``.
OLD_PREFIX = "_cdc_old_"


@dataclass(frozen=True, slots=True)
class Tag:
    """What a target column's comment says of it: its id at the source, and the position below which its rows
    still wait for the column's fill (set in the commit that adds the column, cleared after the fill)."""

    id: int | None = None
    fill_below: str | None = None

    def text(self) -> str | None:
        doc = {k: v for k, v in (("id", self.id), ("fill_below", self.fill_below)) if v is not None}
        return TAG_PREFIX + json.dumps(doc, sort_keys=True) if doc else None


def tag_of(f: StructField) -> Tag:
    text = str(f.metadata.get(COMMENT) or "")
    if not text.startswith(TAG_PREFIX):
        return Tag()
    try:
        doc = json.loads(text[len(TAG_PREFIX):])
    except ValueError:
        return Tag()  # a comment of someone else's that happens to start so
    return Tag(doc.get("id"), doc.get("fill_below"))


def tagged(f: StructField, tag: Tag) -> StructField:
    text = tag.text()
    meta = {k: v for k, v in f.metadata.items() if k != COMMENT}
    return StructField(f.name, f.dataType, f.nullable, {**meta, COMMENT: text} if text else meta)


def old_name(name: str, what: int | str) -> str:
    """A change-log column moved aside: by the old column's id, or by its old type."""
    return f"{OLD_PREFIX}{name}_{re.sub(r'[^0-9A-Za-z]+', '_', str(what)).strip('_')}"


def same_column(a: ColumnEntry, b: ColumnEntry) -> bool:
    return a.id == b.id if a.id is not None and b.id is not None else a.name == b.name


@dataclass(frozen=True, slots=True)
class Identity:
    """The identity of one table's landed columns in a merge."""

    latest: tuple[ColumnEntry, ...]  # the latest schema version's columns
    first: dict[str, int]  # name -> id in the merge's first file (ids for target columns that have none yet)
    added_at: dict[str, str]  # latest column -> first position of the first file that has it

    def entry(self, name: str) -> ColumnEntry | None:
        return next((c for c in self.latest if c.name == name), None)

    @property
    def names(self) -> dict[int, str]:
        """id -> the latest name."""
        return {c.id: c.name for c in self.latest if c.id is not None}


def identity(files: list[LandedFile]) -> Identity:
    """The latest version's columns, each with the fill of the version that added it (a later version of the
    merge no longer carries it)."""
    first = {c.name: c.id for c in files[0].entry.table.columns if c.id is not None}
    added: dict[str, str] = {}
    latest: list[ColumnEntry] = []
    for c in files[-1].entry.table.columns:
        found = next((f for f in files if any(same_column(c, e) for e in f.entry.table.columns)), files[-1])
        added[c.name] = found.entry.first_position
        adding = next(e for e in found.entry.table.columns if same_column(c, e))
        latest.append(c if c.fill is not None or adding.fill is None else replace(c, fill=adding.fill))
    return Identity(tuple(latest), first, added)


def fill_sql(entry: ColumnEntry, dt: DataType) -> str:
    """The column's fill as a Spark SQL expression of type ``dt``."""
    return _value_sql(None if entry.fill is None else entry.fill.get("value"), dt)


def _value_sql(doc: object, dt: DataType) -> str:
    if doc is None:
        return f"CAST(NULL AS {sql_type(dt)})"
    if isinstance(dt, ArrayType) and isinstance(doc, list):
        return f"CAST(array({', '.join(_value_sql(v, dt.elementType) for v in doc)}) AS {sql_type(dt)})"
    if isinstance(dt, BinaryType):
        return f"unbase64({literal(str(doc))})"
    text = ("true" if doc else "false") if isinstance(doc, bool) else str(doc)
    return f"CAST({literal(text)} AS {sql_type(dt)})"


def read_by_identity(spark: SparkSession, files: list[LandedFile], fill: bool) -> DataFrame:
    """The landed rows of one table under the latest version's names (module docstring); ``fill``: columns
    added with a fill hold it in the rows of older versions (the mirror's events; the change-log's keep what
    was landed). One schema version reads as it is."""
    groups = schema_groups(files)
    frames = [(g[0].entry.table.columns, spark.read.parquet(*[f.path for f in g])) for g in groups]
    if len(frames) == 1:
        return frames[0][1]
    ident = identity(files)
    ids, names = ident.names, {c.name for c in ident.latest}
    types = {f.name: f.dataType for f in frames[-1][1].schema.fields}
    out: DataFrame | None = None
    for cols, df in frames:
        entries = {c.name: c for c in cols}
        picks: list[Column] = []
        present: set[str] = set()
        for f in df.schema.fields:
            if f.name == CDC_BEFORE_KEY and isinstance(f.dataType, StructType):
                picks.append(_before_key(f.dataType, entries, ids, types.get(CDC_BEFORE_KEY)))
            else:
                picks.append(_renamed(f, entries.get(f.name), ids, names, types, present))
        for c in ident.latest if fill else ():
            if c.fill is not None and c.name not in present and c.name in types:
                picks.append(F.expr(fill_sql(c, types[c.name])).alias(c.name))
        shaped = df.select(*picks)
        out = shaped if out is None else out.unionByName(shaped, allowMissingColumns=True)
    assert out is not None
    return out


def _before_key(old: StructType, entries: dict[str, ColumnEntry], ids: dict[int, str], want: DataType | None) -> Column:
    """An older version's old keys (an update that changed the key) under the latest names and types: a key column
    renamed in the merge must still find the mirror row of the old key."""
    types = {f.name: f.dataType for f in want.fields} if isinstance(want, StructType) else {}
    parts = []
    for f in old.fields:
        e = entries.get(f.name)
        new = ids.get(e.id, f.name) if e is not None and e.id is not None else f.name
        value = F.col(CDC_BEFORE_KEY).getField(f.name)
        if (dt := types.get(new)) is not None and dt != f.dataType and lossless(f.dataType, dt):
            value = value.cast(dt)
        parts.append(value.alias(new))
    return F.when(F.col(CDC_BEFORE_KEY).isNotNull(), F.struct(*parts)).alias(CDC_BEFORE_KEY)


def _renamed(f: StructField, e: ColumnEntry | None, ids: dict[int, str], names: set[str], types: dict[str, DataType],
             present: set[str]) -> Column:
    """One landed column of an older version, under the name (and type) the latest version gives it."""
    col = F.col(q(f.name))
    new = f.name
    if e is not None and e.id is not None:
        if e.id in ids:
            new = ids[e.id]
        elif f.name in names:
            new = old_name(f.name, e.id)  # dropped, and its name taken by a new column
    want = types.get(new)
    if e is not None and want is not None and want != f.dataType and not isinstance(want, StructType):
        if lossless(f.dataType, want):
            col = col.cast(want)
        elif not holds(f.dataType, want):  # (a narrowed column keeps its wider type: the union takes it)
            new = old_name(new, f.dataType.simpleString())  # values the new type cannot hold: kept aside
    present.add(new)
    return col.alias(new)


# -- the Parquet target (``cdcd.spark.parquet``): ids kept in the consumer's state, its mirror rewritten whole


def state_columns(cols: list[str], types: dict[str, DataType], ident: Identity) -> list[list[str]]:
    """The mirror's columns for the consumer's state: [name, Spark type] and the id where the landing gives one."""
    ids = {c.name: c.id for c in ident.latest}
    return [[c, types[c].simpleString(), *([str(ids[c])] if ids.get(c) is not None else [])] for c in cols]


def older_rows_filled(events: DataFrame, files: list[LandedFile], ident: Identity,
                      types: dict[str, DataType]) -> DataFrame:
    """Events landed under a schema version older than the one that added a column with a fill hold the fill."""
    for c in ident.latest:
        if c.fill is None or c.name not in types:
            continue
        added = next((f.entry.table.version for f in files
                      if any(same_column(c, e) for e in f.entry.table.columns)), None)
        if added is not None and added > files[0].entry.table.version:
            older = F.col(CDC_SCHEMA_VERSION) < F.lit(added)
            events = events.withColumn(c.name, F.when(older, F.expr(fill_sql(c, types[c.name])))
                                       .otherwise(F.col(q(c.name))))
    return events


def mirror_rows_by_identity(rows: DataFrame, before: list[list[str]], ident: Identity,
                            types: dict[str, DataType]) -> DataFrame:
    """The mirror's rows as written under its previous columns (``before``, the state's), under the latest
    version's: renamed and dropped as ``mirror_renamed`` says, a column new to the mirror with its fill."""
    rows = mirror_renamed(rows, {c[0]: int(c[2]) for c in before if len(c) > 2} or ident.first, ident)
    for c in ident.latest:
        if c.fill is not None and c.name not in rows.columns and c.name in types:
            rows = rows.withColumn(c.name, F.expr(fill_sql(c, types[c.name])))
    return rows


def tagged_ids(schema: StructType) -> dict[str, int]:
    """A Delta Lake / Iceberg table's columns that carry their id (``Tag``): name -> id."""
    return {f.name: i for f in schema.fields if (i := tag_of(f).id) is not None}


def mirror_renamed(rows: DataFrame, old_ids: dict[str, int], ident: Identity) -> DataFrame:
    """Rows of the mirror as it is (``old_ids``: its columns' ids) under the latest version's names: a renamed
    column under its new name (all at once: two columns may swap names), a column whose name a new column (another
    id) took dropped: dropped at the source, the new column of that name starts empty."""
    names, latest = ident.names, {c.name for c in ident.latest}
    renamed: dict[str, str] = {}
    for name, was in old_ids.items():
        if name not in rows.columns:
            continue
        now, taken = names.get(was), ident.entry(name)
        if now is not None and now != name:
            renamed[name] = now
        elif now is None and name in latest and taken is not None and taken.id is not None:
            rows = rows.drop(name)
    if renamed:
        rows = rows.select(*[F.col(q(c)).alias(renamed.get(c, c)) for c in rows.columns
                             if c in renamed or c not in renamed.values()])
    return rows
