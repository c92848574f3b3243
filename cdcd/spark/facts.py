"""What the statements of one table's merge depend on, read from the landed files on the driver.

The facts (event count, truncate, unavailable columns, key changes, the first key
column's range, one row event per key) decide which statements a merge runs. They
come from a few columns of the landed Parquet files, read with pyarrow in the
driver: a Spark job for them costs a second or more of fixed cost per merge (the
job's planning, code generation and task launch, far more in a fresh JVM), while
pyarrow reads and counts the key columns of a million events in a fraction of
that. ``cdcd.spark.collapse.facts`` falls back to a Spark aggregate when the
files' types differ between schema versions (``landed_facts`` returns None).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from pyspark.sql.types import (
    ByteType,
    DataType,
    DateType,
    DecimalType,
    IntegerType,
    LongType,
    ShortType,
    StringType,
)

from cdcd.landing.columns import CDC_BEFORE_KEY, CDC_OP, CDC_POS, CDC_UNAVAILABLE
from cdcd.landing.reader import LandedFile

#: Key types whose range the MERGE states as literals (others: no pruning predicate, same result).
RANGED = (ByteType, ShortType, IntegerType, LongType, StringType, DateType, DecimalType)
BEFORE_KEY = CDC_BEFORE_KEY


@dataclass(slots=True)
class Facts:
    """What the statements of a micro-batch depend on."""

    events: int = 0
    truncate_pos: str | None = None
    unavailable: set[str] = field(default_factory=set)
    key_changes: int = 0
    #: Every key has one row event (truncates not counted), none of them below a truncate of the same merge:
    #: no per-key ordering needed (the truncate is its own statement, before the mirror's).
    unique: bool = False
    key_range: KeyRange | None = None  # of the first key column over every key the events name
    #: Delete events (None: not counted, as by the Spark aggregate: only the pyarrow facts count them).
    deletes: int | None = field(default=None, compare=False)
    #: Update events, counted the same way (None from the Spark aggregate).
    updates: int | None = field(default=None, compare=False)
    #: Per landed file, the lowest and highest value and the NULL count of the first key column of its row
    #: events (None: not a ranged type), for the statistics of a landed file that becomes a mirror file as it
    #: is (``cdcd.spark.adopt``); empty from the Spark aggregate.
    file_ranges: list[tuple[Any, Any, int] | None] = field(default_factory=list, compare=False)


@dataclass(frozen=True, slots=True)
class KeyRange:
    """Lowest and highest value of the first key column (new and old keys), for the MERGE to prune files."""

    column: str
    lowest: Any  # None when every value is NULL
    highest: Any
    nulls: bool  # some event names a NULL value (a table without a primary key)


def _comparable(tables: list[pa.Table], key: list[str]) -> bool:
    """Whether every file holds the key columns with one Arrow type each (and ``_cdc_before_key`` too), of
    types whose equality pyarrow and Spark agree on (not floating point, not nested)."""
    for name in key:
        if any(name not in t.column_names for t in tables):
            return False
        kind = tables[0].schema.field(name).type
        if pa.types.is_floating(kind) or pa.types.is_nested(kind):
            return False
    for name in [*key, BEFORE_KEY]:
        found = {str(t.schema.field(name).type) for t in tables if name in t.column_names}
        if len(found) > 1:
            return False
    return True


def _read(f: LandedFile, key: list[str], watermark: str) -> pa.Table:
    """The columns the facts need of one landed file, rows at or above the watermark."""
    have = set(pq.read_schema(f.path).names)
    wanted = [CDC_OP, CDC_POS, CDC_UNAVAILABLE, BEFORE_KEY, *key]
    table = pq.read_table(f.path, columns=[c for c in dict.fromkeys(wanted) if c in have])
    if watermark and f.entry.first_position < watermark:  # re-delivered after a crash: partly applied
        table = table.filter(pc.greater_equal(table[CDC_POS], pa.scalar(watermark)))
    return table


def _extreme(values: list[Any], pick: Any) -> Any:
    present = [v for v in values if v is not None]
    return pick(present) if present else None


def arrow_ranged(kind: pa.DataType) -> bool:
    """Whether Spark reads a landed column of Arrow type ``kind`` as one of the ``RANGED`` types (integers,
    unsigned ones too, strings, dates, decimals)."""
    return bool(pa.types.is_integer(kind) or pa.types.is_string(kind) or pa.types.is_large_string(kind)
                or pa.types.is_date32(kind) or pa.types.is_decimal(kind))


def landed_facts(files: list[LandedFile], key: list[str], watermark: str,
                 types: dict[str, DataType] | None = None) -> Facts | None:
    """The facts of one table's landed files (rows at or above ``watermark``), the same as the Spark aggregate
    ``collapse.spark_facts`` gives; None when the files store a key column with different types (or one
    pyarrow and Spark compare differently): then the caller asks Spark.

    ``types``: Spark's types of the columns; without them (the facts are read while Spark reads the files)
    whether the first key column is ranged is told by its Arrow type (``arrow_ranged``)."""
    tables = [_read(f, key, watermark) for f in files]
    if not tables or not _comparable(tables, key):
        return None
    first = key[0]
    ranged = isinstance(types[first], RANGED) if types is not None else arrow_ranged(tables[0].schema.field(first).type)
    found = Facts()
    deletes = updates = 0
    lows: list[Any] = []
    highs: list[Any] = []
    rows = nulls = 0
    truncates: list[str] = []
    first_rows: list[str] = []  # per file, the lowest position of its row events
    for t in tables:
        found.events += t.num_rows
        is_row = pc.not_equal(t[CDC_OP], "t")
        cut = t.filter(pc.invert(is_row))
        if cut.num_rows:
            truncates.append(str(pc.max(cut[CDC_POS]).as_py()))
        body = t.filter(is_row)
        rows += body.num_rows
        if body.num_rows:
            first_rows.append(str(pc.min(body[CDC_POS]).as_py()))
        deletes += int(pc.sum(pc.equal(t[CDC_OP], "d")).as_py() or 0)
        updates += int(pc.sum(pc.equal(t[CDC_OP], "u")).as_py() or 0)
        if CDC_UNAVAILABLE in t.column_names:
            found.unavailable |= {str(v) for v in pc.unique(pc.list_flatten(t[CDC_UNAVAILABLE])).to_pylist()
                                  if v is not None}
        # key changes and their old keys: a truncate row has no before key
        moved = t.filter(pc.is_valid(t[BEFORE_KEY])) if BEFORE_KEY in t.column_names else None
        if moved is not None:
            found.key_changes += moved.num_rows
        values = [body[first]]
        if moved is not None and moved.num_rows:
            before = moved[BEFORE_KEY].combine_chunks()
            if first in [f.name for f in before.type]:
                old = pc.struct_field(before, first)
                values.append(old)
                nulls += old.null_count
            else:
                nulls += moved.num_rows  # the old key does not name the column: a NULL, as in Spark's aggregate
        nulls += body[first].null_count
        own = pc.min_max(body[first]) if ranged else None
        found.file_ranges.append((own["min"].as_py(), own["max"].as_py(), body[first].null_count)
                                 if own is not None else None)
        if ranged:
            for v in values:
                extremes = pc.min_max(v)
                lows.append(extremes["min"].as_py())
                highs.append(extremes["max"].as_py())
    found.truncate_pos = max(truncates) if truncates else None
    found.deletes, found.updates = deletes, updates
    if ranged:
        found.key_range = KeyRange(first, _extreme(lows, min), _extreme(highs, max), nulls > 0)
    if (not found.key_changes and not found.unavailable
            and truncates_no_row(found.truncate_pos, min(first_rows) if first_rows else None)):
        found.unique = _distinct_keys(tables, key) == rows
    return found


def truncates_no_row(truncate_pos: str | None, first_row_pos: str | None) -> bool:
    """Whether the merge's truncate (if any) removes none of its row events: they all come at or after it
    (``_cdc_pos >= truncate_pos`` stays), as in a snapshot, which lands its truncate first."""
    return truncate_pos is None or first_row_pos is None or first_row_pos >= truncate_pos


def _distinct_keys(tables: list[pa.Table], key: list[str]) -> int:
    """Distinct keys of the row events, rows with a NULL in a key column left out (Spark's ``dropna``)."""
    parts = [t.filter(pc.not_equal(t[CDC_OP], "t")).select(key).drop_null() for t in tables]
    keys = pa.concat_tables(parts) if parts else pa.table({k: [] for k in key})
    if len(key) == 1:
        return int(pc.count_distinct(keys[key[0]]).as_py())
    return int(keys.group_by(key).aggregate([]).num_rows)
