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

from datetime import datetime, timedelta
from decimal import Context, Decimal
from typing import Any

import numpy as np
import pyarrow as pa

from cdcd.errors import SourceFatal
from cdcd.events import BEFORE_FULL, BEFORE_NONE, ChangeBlock, TableSchema
from cdcd.positions import MySqlPosition
from cdcd.sources.mysql.rowcolumns import FORM_MICROS, FORM_UNSCALED, FORM_UTF8
from cdcd.sources.mysql.rowimage import TableDecoder
from cdcd.sources.mysql.types import ZERO_DATE, Converter, ZeroValue, _stream_timestamp, _to_str, warn_once

#: A block is cut at this many rows or row-image bytes: bounds what a block holds while it is gathered and
#: converted, and is enough rows for the per-column work to pay.
BLOCK_ROWS = 8192
#: Blocks of fewer rows and row-image bytes are handed on unbuilt and built together in the event loop
#: (``build_blocks``): their build costs more than their rows. Larger ones are built in the binlog thread,
#: beside the loop's work, and wait as Arrow arrays rather than Python lists (the wide stream of 1,000-row
#: transactions: peak RSS 134 MB built in the thread, 231 MB when every block waited unbuilt).
DEFER_ROWS = 1024
DEFER_BYTES = 64 << 10
BLOCK_BYTES = 1 << 20
_CODES = {"write": "c", "update": "u", "delete": "d"}
_TS_UTC = pa.timestamp("us", tz="UTC")
_EPOCH = datetime(1970, 1, 1)
_EXACT = Context(prec=100)  # more digits than any DECIMAL (65)


class BlockBuilder:
    """The rows events of one table, schema version, transaction and event timestamp, gathered until ``build``."""

    def __init__(self, schema: TableSchema, convert: list[tuple[str, Converter]], fast: TableDecoder,
                 start: MySqlPosition, tx_id: str, commit_ts: datetime) -> None:
        self.schema = schema
        self.convert = convert
        self.fast = fast
        self.start = start
        self.tx_id = tx_id
        self.commit_ts = commit_ts
        # the lists are the table map's columns; the row path picks the schema's columns from them by name
        mapped = {c.name: k for k, c in enumerate(fast.cols)}
        self._source = [mapped.get(c.name) for c in schema.columns]
        converters = dict(convert)
        self._conv = [converters.get(c.name) for c in schema.columns]
        width = len(fast.cols)
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
                gone = tuple(c.name for c, here in zip(self.fast.cols, present, strict=True) if not here)
        self.events.append((_CODES[kind], n, first_seq, gone))
        self.rows += n
        self.size += int(ev.event_size)
        return n

    def _prepare(self, lists: list[list[Any]]) -> None:
        """Applies the stream converters, in place, to the columns the readers left as the row reader's values
        (the raw forms are converted in ``_array``); the key comparison then sees values equal exactly when the
        row path's are."""
        forms = self.fast.forms
        for j, k in enumerate(self._source):
            f = self._conv[j]
            if k is not None and f is not None and forms[k] is None:
                lists[k] = _converted(self.schema, self.schema.columns[j].name, lists[k], f)

    def _array(self, j: int, lists: list[list[Any]], n: int) -> pa.Array:
        col = self.schema.columns[j]
        k = self._source[j]
        if k is None:
            return pa.nulls(n, col.type)
        values = lists[k]
        form = self.fast.forms[k]
        f = self._conv[j]
        try:
            if form is None:
                return pa.array(values, type=col.type)
            kind, arg = form
            if kind == FORM_MICROS:
                if col.type == _TS_UTC and f is _stream_timestamp:
                    return self._timestamps(col.name, values)
                values = [None if v is None else _EPOCH + timedelta(microseconds=v) for v in values]
            elif kind == FORM_UNSCALED:
                if pa.types.is_decimal128(col.type) and col.type.scale == arg:
                    return _decimals(values, col.type)
                values = [None if v is None else decimal_of(v, arg) for v in values]
            elif kind == FORM_UTF8:
                if col.type == pa.string() and f is _to_str:
                    return pa.array(values, pa.binary()).cast(pa.string())
                values = [None if v is None else v.decode("utf-8") for v in values]
            if f is not None:
                values = _converted(self.schema, col.name, values, f)
            return pa.array(values, type=col.type)
        except (pa.ArrowException, TypeError, ValueError, OverflowError) as exc:
            raise SourceFatal(
                f"table {self.schema.table} column {col.name!r} ({col.source_type}): binlog values do not fit "
                f"Arrow type {col.type}: {exc}; the source's type mapping for this column is wrong, or the "
                "binlog holds text that is not valid in the column's character set") from exc

    def _timestamps(self, name: str, values: list[Any]) -> pa.Array:
        """TIMESTAMP microseconds as landed; 0 is the zero TIMESTAMP: NULL, with the row path's warning."""
        mask = np.fromiter((v is None for v in values), bool, len(values))
        micros = np.fromiter((0 if v is None else v for v in values), np.int64, len(values))
        zero = (micros == 0) & ~mask
        if zero.any():
            warn_once(self.schema.table, name, ZERO_DATE, error="zero TIMESTAMP")
            mask |= zero
        return pa.array(micros, type=_TS_UTC, mask=mask if mask.any() else None)

    def build(self) -> ChangeBlock:
        """The gathered rows as one block."""
        schema = self.schema
        table = schema.table
        for name in sorted(self.zero):
            warn_once(table, name, ZERO_DATE)
        data_lists, before_lists = self.data, self.before
        self._prepare(data_lists)
        n = self.rows
        arrow_schema = pa.schema([pa.field(c.name, c.type) for c in schema.columns])
        data = pa.Table.from_arrays([self._array(j, data_lists, n) for j in range(len(schema.columns))],
                                    schema=arrow_schema)
        codes = [e[0] for e in self.events]
        counts = [e[1] for e in self.events]
        ops = pa.array(np.repeat(np.array(codes, dtype=object), counts), pa.string()) if len(codes) > 1 else \
            pa.array([codes[0]] * n, pa.string())
        seqs = _seqs(self.events)
        unavailable = None
        if any(e[3] for e in self.events):
            per_row: list[tuple[str, ...]] = []
            for e in self.events:
                per_row.extend([e[3]] * e[1])
            unavailable = tuple(per_row)
        before = kinds = changed = None
        olds = len(before_lists[0]) if before_lists else 0
        if olds:
            self._prepare(before_lists)
            has_before = np.repeat(np.array([c != "c" for c in codes], dtype=bool), counts)
            index = np.full(n, -1, dtype=np.int64)
            index[has_before] = np.arange(olds, dtype=np.int64)
            table_olds = pa.Table.from_arrays([self._array(j, before_lists, olds) for j in range(len(schema.columns))],
                                              schema=arrow_schema)
            before = table_olds if has_before.all() else table_olds.take(pa.array(index, mask=~has_before))
            kinds = pa.array(np.where(has_before, BEFORE_FULL, BEFORE_NONE).astype(np.int8))
            changed = self._key_changed(codes, counts, data_lists, before_lists)
        self.data = self.before = []  # the builder is spent
        return ChangeBlock(schema, self.start, ops, data, before, kinds, (), unavailable, changed, self.tx_id,
                           self.commit_ts, False, seqs)

    def _key_changed(self, codes: list[str], counts: list[int], data: list[list[Any]],
                     before: list[list[Any]]) -> pa.Array | None:
        """Updates whose key differs between the before and the after image (the row path's ``before_key``:
        ``!=`` on the converted key tuples; a raw form is equal exactly when its converted value is); None
        when none does."""
        names = self.schema.column_names
        key = [self._source[names.index(k)] for k in self.schema.key]
        if not key or "u" not in codes:
            return None
        out = np.zeros(self.rows, dtype=bool)
        row = old = 0  # the event's first row in the data lists and in the before lists
        for code, count in zip(codes, counts, strict=True):
            if code == "u":
                for r in range(count):
                    out[row + r] = tuple(None if k is None else data[k][row + r] for k in key) != \
                        tuple(None if k is None else before[k][old + r] for k in key)
            if code != "c":
                old += count
            row += count
        return pa.array(out) if out.any() else None


def _seqs(events: list[tuple[str, int, int, tuple[str, ...]]]) -> pa.Array | None:
    """Each row's seq when the rows events' seqs are not consecutive from the first event's (None: they are)."""
    if len(events) < 2:
        return None
    firsts = np.fromiter((e[2] for e in events), np.int64, len(events))
    counts = np.fromiter((e[1] for e in events), np.int64, len(events))
    if (firsts[1:] == firsts[:-1] + counts[:-1]).all():
        return None
    return pa.array(np.concatenate([np.arange(f, f + c, dtype=np.int64) for f, c in
                                    zip(firsts.tolist(), counts.tolist(), strict=True)]))


def build_blocks(items: list[Any]) -> list[Any]:
    """``items`` with each ``BlockBuilder`` (the rows of one table in one transaction, handed on unbuilt by a
    ``Decoder(defer_builds=True)``) replaced by its ``ChangeBlock``.

    The builders of one table shape are converted together and each gets a zero-copy slice with its own start,
    transaction and commit time: with small transactions a build per transaction was most of the cost (one
    per transaction's commit), and the binlog thread cannot wait for the next transaction without blocking,
    so the stream builds in the event loop what piled up since it last looked.
    """
    groups: dict[tuple[int, int, int], list[BlockBuilder]] = {}
    for item in items:
        if type(item) is BlockBuilder:
            groups.setdefault((id(item.schema), id(item.fast), id(item.convert)), []).append(item)
    if not groups:
        return items
    built: dict[int, ChangeBlock] = {}
    for group in groups.values():
        if len(group) == 1:
            built[id(group[0])] = group[0].build()
            continue
        whole = _merged(group).build()
        at = 0
        for b in group:
            part = whole.slice(at, b.rows)
            part.start, part.tx_id, part.commit_ts, part.seqs = b.start, b.tx_id, b.commit_ts, _seqs(b.events)
            built[id(b)] = part
            at += b.rows
    return [built[id(item)] if type(item) is BlockBuilder else item for item in items]


def _merged(group: list[BlockBuilder]) -> BlockBuilder:
    """One builder holding the rows of ``group`` (builders of one table shape), in order."""
    first = group[0]
    out = BlockBuilder(first.schema, first.convert, first.fast, first.start, first.tx_id, first.commit_ts)
    for b in group:
        for mine, theirs in zip(out.data, b.data, strict=True):
            mine.extend(theirs)
        for mine, theirs in zip(out.before, b.before, strict=True):
            mine.extend(theirs)
        out.zero |= b.zero
        out.events.extend(b.events)
        out.rows += b.rows
        out.size += b.size
    return out


def decimal_of(digits: int, scale: int) -> Decimal:
    """The Decimal of an unscaled DECIMAL (exact: no context rounding), with ``scale`` digits after the point."""
    return Decimal(digits).scaleb(-scale, _EXACT)


def _decimals(values: list[Any], kind: pa.Decimal128Type) -> pa.Array:
    """DECIMAL digits as ints (value * 10**scale) -> decimal128 from its 16-byte little-endian words."""
    n = len(values)
    mask = np.fromiter((v is None for v in values), bool, n)
    ints = [0 if v is None else v for v in values]
    try:
        low = np.array(ints, dtype=np.int64)
        words = np.empty((n, 2), np.int64)
        words[:, 0] = low
        words[:, 1] = low >> 63  # the sign extended into the high word
        data = words.tobytes()
    except OverflowError:  # beyond 18 digits: each value's two's complement bytes
        data = b"".join(v.to_bytes(16, "little", signed=True) for v in ints)
    bitmap = pa.py_buffer(np.packbits(~mask, bitorder="little")) if mask.any() else None
    return pa.Array.from_buffers(kind, n, [bitmap, pa.py_buffer(data)], null_count=int(mask.sum()))


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
