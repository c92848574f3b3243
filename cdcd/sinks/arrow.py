"""Turn the change events and row blocks of one table into an Arrow table of the landing format.

The table's columns come first, in the source's order and Arrow types, then
the ``_cdc_`` metadata columns (see docs/landing-format.md). Events are
converted value by value; a RowBlock already holds the table's columns, so
only the metadata columns are made, as constant arrays.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC
from typing import Any

import numpy as np
import pyarrow as pa

from cdcd.errors import SinkFatal
from cdcd.events import ChangeEvent, Op, RowBlock, TableSchema

META_FIELDS: tuple[pa.Field, ...] = (
    pa.field("_cdc_op", pa.string(), nullable=False),
    pa.field("_cdc_pos", pa.string(), nullable=False),
    pa.field("_cdc_tx", pa.string()),
    pa.field("_cdc_commit_ts", pa.timestamp("us", tz="UTC")),
    pa.field("_cdc_snapshot", pa.bool_(), nullable=False),
    pa.field("_cdc_unavailable", pa.list_(pa.string()), nullable=False),
    pa.field("_cdc_batch", pa.int64(), nullable=False),
    pa.field("_cdc_index", pa.int64(), nullable=False),
    pa.field("_cdc_schema_version", pa.int64(), nullable=False),
)


def key_columns(schema: TableSchema) -> tuple[str, ...]:
    """The merge key: the primary key, or every column for a table without one."""
    return schema.key or schema.column_names


def before_key_type(schema: TableSchema) -> pa.StructType:
    return pa.struct([pa.field(k, schema.column(k).type) for k in key_columns(schema)])


def arrow_schema(schema: TableSchema) -> pa.Schema:
    fields = [pa.field(c.name, c.type) for c in schema.columns]
    fields.extend(META_FIELDS)
    fields.append(pa.field("_cdc_before_key", before_key_type(schema)))
    return pa.schema(fields)


def _row_of(event: ChangeEvent) -> dict[str, Any]:
    if event.op is Op.TRUNCATE:
        return {}
    if event.op is Op.DELETE:
        return event.before or {}
    return event.after or {}


def events_to_table(schema: TableSchema, batch_seq: int, indexed: Sequence[tuple[int, ChangeEvent]]) -> pa.Table:
    """``indexed`` holds (index of the event in the batch, event), all of ``schema``."""
    columns: list[pa.Array] = []
    rows = [_row_of(e) for _, e in indexed]
    for col in schema.columns:
        values = [
            None if col.name in e.unavailable else row.get(col.name)
            for (_, e), row in zip(indexed, rows, strict=True)
        ]
        try:
            columns.append(pa.array(values, type=col.type))
        except (pa.ArrowException, TypeError, ValueError, OverflowError) as exc:
            raise SinkFatal(
                f"landing: table {schema.table} column {col.name!r} ({col.source_type}): values do not fit "
                f"Arrow type {col.type}: {exc}; the source's type mapping for this column is wrong"
            ) from exc
    events = [e for _, e in indexed]
    columns.append(pa.array([e.op.value for e in events], pa.string()))
    columns.append(pa.array([e.position.encoded for e in events], pa.string()))
    columns.append(pa.array([e.tx_id for e in events], pa.string()))
    columns.append(
        pa.array([e.commit_ts.astimezone(UTC) if e.commit_ts else None for e in events], pa.timestamp("us", tz="UTC"))
    )
    columns.append(pa.array([e.snapshot for e in events], pa.bool_()))
    columns.append(pa.array([sorted(e.unavailable) for e in events], pa.list_(pa.string())))
    columns.append(pa.array([batch_seq] * len(events), pa.int64()))
    columns.append(pa.array([i for i, _ in indexed], pa.int64()))
    columns.append(pa.array([schema.version] * len(events), pa.int64()))
    keys = key_columns(schema)
    before_keys = []
    for e in events:
        old = e.before_key
        before_keys.append(None if old is None else dict(zip(keys, old, strict=True)) if schema.key else None)
    columns.append(pa.array(before_keys, before_key_type(schema)))
    return pa.Table.from_arrays(columns, schema=arrow_schema(schema))


def block_to_table(schema: TableSchema, batch_seq: int, first_index: int, block: RowBlock) -> pa.Table:
    """A RowBlock of ``schema`` whose first row has index ``first_index`` in the batch."""
    data = block.data
    n = data.num_rows
    if data.column_names != list(schema.column_names) or data.schema.types != [c.type for c in schema.columns]:
        raise SinkFatal(
            f"landing: table {schema.table}: a row block has columns {data.schema} but the table schema is "
            f"{[(c.name, str(c.type)) for c in schema.columns]}; the source's bulk reader is wrong"
        )
    ts = block.commit_ts.astimezone(UTC) if block.commit_ts else None
    columns: list[pa.Array | pa.ChunkedArray] = list(data.columns)
    columns.append(pa.repeat(pa.scalar(block.op.value, pa.string()), n))
    columns.append(pa.repeat(pa.scalar(block.position.encoded, pa.string()), n))
    columns.append(pa.repeat(pa.scalar(block.tx_id, pa.string()), n))
    columns.append(pa.repeat(pa.scalar(ts, pa.timestamp("us", tz="UTC")), n))
    columns.append(pa.repeat(pa.scalar(block.snapshot, pa.bool_()), n))
    # Every row: an empty list (a block never has unavailable values).
    columns.append(pa.ListArray.from_arrays(pa.array(np.zeros(n + 1, np.int32)), pa.array([], pa.string())))
    columns.append(pa.repeat(pa.scalar(batch_seq, pa.int64()), n))
    columns.append(pa.array(np.arange(first_index, first_index + n, dtype=np.int64)))
    columns.append(pa.repeat(pa.scalar(schema.version, pa.int64()), n))
    columns.append(pa.nulls(n, before_key_type(schema)))  # snapshot-like rows never change a key
    return pa.Table.from_arrays(columns, schema=arrow_schema(schema))


def describe_schema(schema: TableSchema) -> dict[str, Any]:
    """The manifest's description of a table schema."""
    return {
        "schema": schema.table.schema,
        "name": schema.table.name,
        "version": schema.version,
        "key": list(schema.key),
        "columns": [
            {"name": c.name, "arrow_type": str(c.type), "source_type": c.source_type, "nullable": c.nullable}
            for c in schema.columns
        ],
    }
