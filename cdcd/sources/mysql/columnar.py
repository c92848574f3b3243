"""Binlog rows events -> ``ChangeBlock``s: row images decoded straight into column lists, converted a column at once.

``BlockBuilder`` gathers the rows events of one table and schema version inside one transaction (the
decoder cuts a block at anything else: a schema mark, a DDL, the commit, another event timestamp, a rows
event rowimage cannot read, and at ``BLOCK_ROWS`` rows or ``BLOCK_BYTES`` bytes). Each event's row images
are read by a generated reader (``rowimage.TableDecoder.read_columns``) that appends every value to its
column's list: no row dict, no ChangeEvent per row. ``build`` applies the stream converters of ``types.py``
to each column list and makes one Arrow array per column.

The semantics are the row path's (``decode.Decoder._on_rows``), value for value:

* an insert lands its after image; an update its after image with its before image as ``before``
  (``BEFORE_FULL``: the row path's ``before`` holds every column, NULL where the image left it out); a
  delete lands its before image, which is its ``before`` too;
* columns left out of an after image (binlog_row_image = MINIMAL/NOBLOB) are unavailable (the row path's
  ``COLS_BITMAP`` none-sources); a delete has none;
* ``key_changed``: an update whose key (``schema.key``) differs, as Python's ``==`` on the converted
  key tuples, between its before and after images;
* positions: each rows event's rows take the seqs the row path gives them (``seqs``: the next event's rows
  start after its offset's seq), so checkpoints, the skip rule and resumes see the same positions.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

import numpy as np
import pyarrow as pa

from cdcd.errors import SourceFatal
from cdcd.events import BEFORE_FULL, BEFORE_NONE, ChangeBlock, TableSchema
from cdcd.positions import MySqlPosition
from cdcd.sources.mysql.rowimage import TableDecoder
from cdcd.sources.mysql.types import ZERO_DATE, Converter, ZeroValue, warn_once

#: A block is cut at this many rows or row-image bytes: bounds what a block holds while it is gathered and
#: converted, and is enough rows for the per-column work to pay.
BLOCK_ROWS = 8192
BLOCK_BYTES = 1 << 20
_CODES = {"write": "c", "update": "u", "delete": "d"}


class BlockBuilder:
    """The rows events of one table, schema version, transaction and event timestamp, gathered until ``build``."""

    def __init__(self, schema: TableSchema, convert: list[tuple[str, Converter]], fast: TableDecoder,
                 start: MySqlPosition, tx_id: str, commit_ts: datetime) -> None:
        self.schema = schema
        self.fast = fast
        self.start = start
        self.tx_id = tx_id
        self.commit_ts = commit_ts
        names = schema.column_names
        self._convert = [(names.index(name), f) for name, f in convert]
        width = len(names)
        self.data: list[list[Any]] = [[] for _ in range(width)]
        self.before: list[list[Any]] = [[] for _ in range(width)]
        self.zero: set[str] = set()
        # per rows event: (op code, rows, first seq, unavailable columns)
        self.events: list[tuple[str, int, int, tuple[str, ...]]] = []
        self.rows = 0
        self.size = 0

    def full(self) -> bool:
        return self.rows >= BLOCK_ROWS or self.size >= BLOCK_BYTES

    def add(self, kind: str, ev: Any, first_seq: int) -> int | None:
        """Reads a rows event of ``kind`` whose first row takes seq ``first_seq``; its row count, or None when
        rowimage cannot read the event (the caller takes the row path for it)."""
        n = self.fast.read_columns(ev, self.data, self.before, self.zero)
        if n is None:
            return None
        gone: tuple[str, ...] = ()
        if kind != "delete":
            bitmap = ev.columns_present_bitmap2 if kind == "update" else ev.columns_present_bitmap
            present = self.fast.present(bitmap)
            if not all(present):
                gone = tuple(c.name for c, here in zip(self.schema.columns, present, strict=True) if not here)
        self.events.append((_CODES[kind], n, first_seq, gone))
        self.rows += n
        self.size += int(ev.event_size)
        return n

    def _column(self, j: int, values: list[Any]) -> pa.Array:
        col = self.schema.columns[j]
        try:
            return pa.array(values, type=col.type)
        except (pa.ArrowException, TypeError, ValueError, OverflowError) as exc:
            raise SourceFatal(
                f"table {self.schema.table} column {col.name!r} ({col.source_type}): binlog values do not fit "
                f"Arrow type {col.type}: {exc}; the source's type mapping for this column is wrong") from exc

    def build(self) -> ChangeBlock:
        """The gathered rows as one block."""
        schema = self.schema
        table = schema.table
        for name in sorted(self.zero):
            warn_once(table, name, ZERO_DATE)
        data_lists = self.data
        before_lists = self.before
        for j, f in self._convert:  # converted once: the key comparison below sees the landed Python values
            data_lists[j] = _converted(schema, schema.columns[j].name, data_lists[j], f)
            before_lists[j] = _converted(schema, schema.columns[j].name, before_lists[j], f)
        n = self.rows
        fields = [pa.field(c.name, c.type) for c in schema.columns]
        data = pa.Table.from_arrays([self._column(j, v) for j, v in enumerate(data_lists)],
                                    schema=pa.schema(fields))
        codes = [e[0] for e in self.events]
        counts = [e[1] for e in self.events]
        ops = pa.array(np.repeat(np.array(codes, dtype=object), counts), pa.string()) if len(codes) > 1 else \
            pa.array([codes[0]] * n, pa.string())
        seqs = None
        if len(self.events) > 1 and any(e[2] != self.events[0][2] + sum(counts[:k]) for k, e in
                                        enumerate(self.events)):
            seqs = pa.array(np.concatenate([np.arange(e[2], e[2] + e[1], dtype=np.int64) for e in self.events]))
        unavailable = None
        if any(e[3] for e in self.events):
            per_row: list[tuple[str, ...]] = []
            for e in self.events:
                per_row.extend([e[3]] * e[1])
            unavailable = tuple(per_row)
        before = kinds = changed = None
        if before_lists and before_lists[0]:
            has_before = np.repeat(np.array([c != "c" for c in codes], dtype=bool), counts)
            index = np.full(n, -1, dtype=np.int64)
            index[has_before] = np.arange(int(has_before.sum()), dtype=np.int64)
            picks = pa.array(index, mask=~has_before)
            olds = pa.Table.from_arrays([self._column(j, v) for j, v in enumerate(before_lists)],
                                        schema=pa.schema(fields))
            before = olds if has_before.all() else olds.take(picks)
            kinds = pa.array(np.where(has_before, BEFORE_FULL, BEFORE_NONE).astype(np.int8))
            changed = self._key_changed(codes, counts, data_lists, before_lists)
        self.data = self.before = []  # the builder is spent
        return ChangeBlock(schema, self.start, ops, data, before, kinds, (), unavailable, changed, self.tx_id,
                           self.commit_ts, False, seqs)

    def _key_changed(self, codes: list[str], counts: list[int], data: list[list[Any]],
                     before: list[list[Any]]) -> pa.Array | None:
        """Updates whose converted key differs between the before and the after image; None when none does."""
        key = [self.schema.column_names.index(k) for k in self.schema.key]
        if not key or "u" not in codes:
            return None
        out = np.zeros(self.rows, dtype=bool)
        row = old = 0  # the event's first row in the data lists and in the before lists
        for code, count in zip(codes, counts, strict=True):
            if code == "u":
                for r in range(count):
                    out[row + r] = tuple(data[j][row + r] for j in key) != tuple(before[j][old + r] for j in key)
            if code != "c":
                old += count
            row += count
        return pa.array(out) if out.any() else None


def _converted(schema: TableSchema, name: str, values: list[Any], f: Converter) -> list[Any]:
    """The stream converter applied to every non-NULL value; the zero TIMESTAMP becomes NULL with the
    snapshot's warning (as ``decode.Decoder._convert``)."""
    try:
        return [None if v is None else f(v) for v in values]
    except ZeroValue:
        pass
    out: list[Any] = []
    for v in values:
        if v is None:
            out.append(None)
            continue
        try:
            out.append(f(v))
        except ZeroValue as exc:
            warn_once(schema.table, name, ZERO_DATE, error=str(exc))
            out.append(None)
    return out
