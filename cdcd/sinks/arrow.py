"""Turn the change events and row blocks of one table into an Arrow table of the landing format.

The table's columns come first, in the source's order and Arrow types, then
the ``_cdc_`` metadata columns (``cdcd.landing.columns``, docs/landing-format.md). Events are
converted in bulk, one Arrow call per column; a RowBlock or a ChangeBlock already holds the table's columns,
so only the metadata columns are made (constant arrays for a RowBlock, from the block's per-row arrays for a
ChangeBlock): no Python row is built.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from cdcd.errors import SinkFatal
from cdcd.events import ChangeBlock, ChangeEvent, Op, RowBlock, TableSchema
from cdcd.landing.columns import arrow_schema, before_key_type


def _row_of(event: ChangeEvent) -> dict[str, Any]:
    if event.op is Op.TRUNCATE:
        return {}
    if event.op is Op.DELETE:
        return event.before or {}
    return event.after or {}


def _value_columns(schema: TableSchema, events: Sequence[ChangeEvent]) -> list[pa.Array]:
    """The table's columns of ``events``, converted by Arrow in one pass over the row dicts.

    The rows go in as one struct array (Arrow's converter reads each dict in C++; a key a row lacks is
    NULL, a key the schema lacks is ignored) and come out as its child arrays. Unavailable values are
    NULL: the few rows that have any are copied without them.
    """
    rows = [_row_of(e) for e in events]
    for i, e in enumerate(events):
        if e.unavailable:
            gone = e.unavailable
            rows[i] = {k: v for k, v in rows[i].items() if k not in gone}
    struct = pa.struct([pa.field(c.name, c.type) for c in schema.columns])
    try:
        return list(pa.array(rows, type=struct).flatten())
    except (pa.ArrowException, TypeError, ValueError, OverflowError) as exc:
        _convert_by_column(schema, rows)  # raises, naming the column that failed
        raise SinkFatal(  # Arrow refused the rows as a whole but took every column alone
            f"landing: table {schema.table}: Arrow could not convert the rows as one struct array although "
            f"every column converts alone: {exc}; report this with the table's schema"
        ) from exc


def _convert_by_column(schema: TableSchema, rows: list[dict[str, Any]]) -> None:
    for col in schema.columns:
        name = col.name
        try:
            pa.array([row.get(name) for row in rows], type=col.type)
        except (pa.ArrowException, TypeError, ValueError, OverflowError) as exc:
            raise SinkFatal(
                f"landing: table {schema.table} column {col.name!r} ({col.source_type}): values do not fit "
                f"Arrow type {col.type}: {exc}; the source's type mapping for this column is wrong"
            ) from exc


def _commit_ts_utc(events: Sequence[ChangeEvent]) -> list[datetime | None]:
    """Each event's commit time in UTC; a transaction's events share one, converted once."""
    out: list[datetime | None] = []
    last: datetime | None = None
    last_utc: datetime | None = None
    for e in events:
        ts = e.commit_ts
        if ts is not last:
            last, last_utc = ts, (ts.astimezone(UTC) if ts else None)
        out.append(last_utc)
    return out


def _empty_lists(n: int) -> pa.Array:
    """``n`` empty string lists (built from offsets alone)."""
    return pa.ListArray.from_arrays(pa.array(np.zeros(n + 1, np.int32)), pa.array([], pa.string()))


def events_to_table(schema: TableSchema, batch_seq: int, events: Sequence[ChangeEvent],
                    indexes: Sequence[int]) -> pa.Table:
    """``events`` (all of ``schema``) with ``indexes``, each event's index in the batch.

    Column by column in bulk: Python builds one list per metadata column, Arrow converts each
    with one call; constant columns are repeated scalars.
    """
    n = len(events)
    columns = _value_columns(schema, events)
    columns.append(pa.array([e.op for e in events], pa.string()))  # a StrEnum member is its code as str
    columns.append(pa.array([e.position.encoded for e in events], pa.string()))
    columns.append(pa.array([e.tx_id for e in events], pa.string()))
    columns.append(pa.array(_commit_ts_utc(events), pa.timestamp("us", tz="UTC")))
    columns.append(pa.array([e.snapshot for e in events], pa.bool_()))
    if any(e.unavailable for e in events):
        columns.append(pa.array([sorted(e.unavailable) for e in events], pa.list_(pa.string())))
    else:
        columns.append(_empty_lists(n))
    columns.append(pa.repeat(pa.scalar(batch_seq, pa.int64()), n))
    columns.append(pa.array(indexes, pa.int64()))
    columns.append(pa.repeat(pa.scalar(schema.version, pa.int64()), n))
    columns.append(_before_keys(schema, events))
    return pa.Table.from_arrays(columns, schema=arrow_schema(schema))


def _before_keys(schema: TableSchema, events: Sequence[ChangeEvent]) -> pa.Array:
    """The old key of each update that changed its key, else NULL; only updates are looked at."""
    kind = before_key_type(schema)
    if not schema.key:
        return pa.nulls(len(events), kind)
    update = Op.UPDATE
    keys = schema.key
    values: list[dict[str, Any] | None] = [None] * len(events)
    changed = False
    for i, e in enumerate(events):
        if e.op is update:
            old = e.before_key
            if old is not None:
                values[i] = dict(zip(keys, old, strict=True))
                changed = True
    return pa.array(values, kind) if changed else pa.nulls(len(events), kind)


def _check_columns(schema: TableSchema, data: pa.Table, what: str) -> None:
    if data.column_names != list(schema.column_names) or data.schema.types != [c.type for c in schema.columns]:
        raise SinkFatal(
            f"landing: table {schema.table}: a {what} has columns {data.schema} but the table schema is "
            f"{[(c.name, str(c.type)) for c in schema.columns]}; the source's columnar decoder is wrong"
        )


def block_to_table(schema: TableSchema, batch_seq: int, first_index: int, block: RowBlock | ChangeBlock) -> pa.Table:
    """A RowBlock or ChangeBlock of ``schema`` whose first row has index ``first_index`` in the batch."""
    if type(block) is ChangeBlock:
        return change_block_to_table(schema, batch_seq, first_index, block)
    assert type(block) is RowBlock
    data = block.data
    n = data.num_rows
    _check_columns(schema, data, "row block")
    ts = block.commit_ts.astimezone(UTC) if block.commit_ts else None
    columns: list[pa.Array | pa.ChunkedArray] = list(data.columns)
    columns.append(pa.repeat(pa.scalar(block.op.value, pa.string()), n))
    columns.append(pa.repeat(pa.scalar(block.position.encoded, pa.string()), n))
    columns.append(pa.repeat(pa.scalar(block.tx_id, pa.string()), n))
    columns.append(pa.repeat(pa.scalar(ts, pa.timestamp("us", tz="UTC")), n))
    columns.append(pa.repeat(pa.scalar(block.snapshot, pa.bool_()), n))
    # Every row: an empty list (a block never has unavailable values).
    columns.append(_empty_lists(n))
    columns.append(pa.repeat(pa.scalar(batch_seq, pa.int64()), n))
    columns.append(pa.array(np.arange(first_index, first_index + n, dtype=np.int64)))
    columns.append(pa.repeat(pa.scalar(schema.version, pa.int64()), n))
    columns.append(pa.nulls(n, before_key_type(schema)))  # snapshot-like rows never change a key
    return pa.Table.from_arrays(columns, schema=arrow_schema(schema))


def change_block_to_table(schema: TableSchema, batch_seq: int, first_index: int, block: ChangeBlock) -> pa.Table:
    """A ChangeBlock's rows with the metadata columns a ChangeEvent per row would get (``events_to_table``)."""
    return change_blocks_to_table(schema, batch_seq, [(first_index, block)])


def change_blocks_to_table(schema: TableSchema, batch_seq: int, parts: Sequence[tuple[int, ChangeBlock]]) -> pa.Table:
    """ChangeBlocks of ``schema``, each with its first row's index in the batch, as one table in their order.

    The Arrow calls are per table, not per block: a stream of small transactions lands a block each, and the
    landing thread waited for the GIL at every call while the event loop decoded.
    """
    blocks = [b for _, b in parts]
    for b in blocks:
        _check_columns(schema, b.data, "change block")
    counts = np.fromiter((b.rows for b in blocks), np.int64, len(blocks))
    n = int(counts.sum())
    one = len(blocks) == 1
    columns: list[pa.Array | pa.ChunkedArray] = list(
        (blocks[0].data if one else pa.concat_tables([b.data for b in blocks])).columns)
    columns.append(blocks[0].ops if one else pa.concat_arrays([b.ops for b in blocks]))
    heads, numbers = zip(*(b.position_parts() for b in blocks), strict=True)
    padded = pc.utf8_lpad(pa.array(np.concatenate(numbers)).cast(pa.string()), 10, "0")
    columns.append(pc.binary_join_element_wise(_per_row(list(heads), counts, pa.string()), padded, ""))
    columns.append(_per_row([b.tx_id for b in blocks], counts, pa.string()))
    columns.append(_per_row([b.commit_ts.astimezone(UTC) if b.commit_ts else None for b in blocks], counts,
                            pa.timestamp("us", tz="UTC")))
    columns.append(_per_row([b.snapshot for b in blocks], counts, pa.bool_()))
    if any(b.unavailable is not None for b in blocks):
        names: list[list[str]] = []
        for b in blocks:
            names.extend([[]] * b.rows if b.unavailable is None else (sorted(u) for u in b.unavailable))
        columns.append(pa.array(names, pa.list_(pa.string())))
    else:
        columns.append(_empty_lists(n))
    columns.append(pa.repeat(pa.scalar(batch_seq, pa.int64()), n))
    columns.append(pa.array(np.concatenate([np.arange(first, first + b.rows, dtype=np.int64) for first, b in parts])))
    columns.append(pa.repeat(pa.scalar(schema.version, pa.int64()), n))
    if any(_changes_keys(schema, b) for b in blocks):
        columns.append(pa.concat_arrays([_block_before_keys(schema, b) for b in blocks]))
    else:
        columns.append(pa.nulls(n, before_key_type(schema)))
    return pa.Table.from_arrays(columns, schema=arrow_schema(schema))


def _per_row(values: list[Any], counts: np.ndarray, kind: pa.DataType) -> pa.Array:
    """``values[i]`` repeated ``counts[i]`` times, in one Arrow call (plus the values' own)."""
    if len(values) == 1:
        return pa.repeat(pa.scalar(values[0], kind), int(counts[0]))
    return pa.array(values, kind).take(pa.array(np.repeat(np.arange(len(values), dtype=np.int32), counts)))


def _changes_keys(schema: TableSchema, block: ChangeBlock) -> bool:
    return bool(schema.key) and block.key_changed is not None and block.before is not None


def _block_before_keys(schema: TableSchema, block: ChangeBlock) -> pa.Array:
    """The old key of each update that changed its key (``block.key_changed``), else NULL."""
    kind = before_key_type(schema)
    if not _changes_keys(schema, block):
        return pa.nulls(block.rows, kind)
    assert block.key_changed is not None and block.before is not None
    keys = [block.before.column(k).combine_chunks() for k in schema.key]
    return pa.StructArray.from_arrays(keys, fields=list(kind), mask=pc.invert(block.key_changed))
