"""Driver rows to Arrow columns: the conversion both snapshot readers share (aiomysql's rows in
``snapshot.py``, mysqlclient's in ``bulkread.py``).

Each column goes into Arrow with one ``pa.array`` call; only a column Arrow refuses is converted value by
value with the column's converter (``types.snapshot_converter``), and a zero date becomes NULL with the
warning, once per column (as the stream lands it).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pyarrow as pa

from cdcd.errors import SourceFatal
from cdcd.events import TableId, TableSchema
from cdcd.sources.mysql.types import ZERO_DATE, Converter, ZeroValue, warn_once


def column_array(values: Any, type_: pa.DataType, conv: Converter | None,
                 on_zero: Callable[[ZeroValue], None] | None = None) -> pa.Array:
    """One column's driver values → its landed Arrow array.

    Most driver values are already what Arrow takes for the landed type (str for
    text, bytes for binary, datetime for timestamps, Decimal for decimals), so the
    whole column goes in one call; only when Arrow refuses a value (zero dates
    as text, unsigned bigint overflow, invalid UTF-8...) does the converter run
    on every value, giving exactly what the per-row path landed.
    """
    if conv is not None:
        try:
            return pa.array(values, type=type_)
        except (pa.ArrowException, TypeError, ValueError, OverflowError):
            values = [None if v is None else _convert(conv, v, on_zero) for v in values]
    return pa.array(values, type=type_)


def _convert(conv: Converter, v: Any, on_zero: Callable[[ZeroValue], None] | None) -> Any:
    try:
        return conv(v)
    except ZeroValue as exc:  # a zero date: NULL (the stream lands it the same way), warned once per column
        if on_zero is not None:
            on_zero(exc)
        return None


def rows_to_table(schema: TableSchema, convs: list[Converter | None], raw: Any) -> pa.Table:
    """A chunk of driver rows (tuples in ``schema`` column order) → the RowBlock's Arrow table."""
    columns = list(zip(*raw, strict=True)) if raw else [() for _ in schema.columns]
    arrays = []
    for col, values, conv in zip(schema.columns, columns, convs, strict=True):
        try:
            arrays.append(column_array(values, col.type, conv, functools.partial(zero_warning, schema.table,
                                                                                  col.name)))
        except (pa.ArrowException, TypeError, ValueError, OverflowError) as exc:
            # the row path failed the same way in the sink; here the column is known
            raise SourceFatal(f"snapshot of {schema.table}: column {col.name!r} ({col.source_type}): values do not "
                              f"fit Arrow type {col.type}: {exc}; the type mapping for this column is wrong") from exc
    return pa.Table.from_arrays(arrays, schema=pa.schema([pa.field(c.name, c.type) for c in schema.columns]))


def zero_warning(table: TableId, column: str, exc: ZeroValue) -> None:
    warn_once(table, column, ZERO_DATE, error=str(exc))
