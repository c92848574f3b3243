"""COPY text format → Arrow columns in the landed types, in bulk (the snapshot's fast path).

The snapshot reads key-ordered chunks with ``COPY (SELECT ...) TO STDOUT``
in text format: one line per row, fields separated by tabs, ``\\N`` for NULL,
backslash escapes for backslash and control characters. The session settings
are the stream's (types.SESSION_SETTINGS), so every field is the type's text
output, exactly what pgoutput sends. pyarrow's CSV reader splits and parses a
whole chunk at once (off the event loop); integers, floats and booleans are
converted by it; strings are unescaped, and decimals, dates, times and
timestamps are cast with pyarrow.compute. Whatever Arrow cannot convert
exactly — a type without a vectorized conversion (bytea, arrays, ...), or a
chunk of a column holding a value the cast refuses (a BC date, year 10000) —
goes through the stream's per-value converter from types.py, so snapshot and
stream land the same values and warnings.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv

from cdcd.errors import SourceError, SourceFatal
from cdcd.sources.postgres.shape import INFINITE, TableShape, Warnings
from cdcd.sources.postgres.types import Unrepresentable

UNREPRESENTABLE = "value cannot be represented: landed as NULL"  # the stream's warning, so it is shown once
#: pyarrow's default CSV block; a larger one is used when a row is larger (a row must fit one block).
_BLOCK = 1 << 20

_ESCAPES = {"b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t", "v": "\v"}
_ESCAPE_RE = re.compile(r"\\(.)", re.DOTALL)

_TS_MAX, _TS_MIN = "9999-12-31 23:59:59.999999", "0001-01-01 00:00:00"


class _Kind(enum.Enum):
    PARSED = "parsed"  # the CSV reader converts it (ints, float8, bool)
    FLOAT4 = "float4"  # parsed as float8, then rounded to float32 like the stream's converter
    STRING = "string"
    DECIMAL = "decimal"
    DATE = "date"
    TIMESTAMP = "timestamp"
    TIMESTAMPTZ = "timestamptz"
    TIME = "time"
    PYTHON = "python"  # per value, with the stream's converter


def _kind(arrow: pa.DataType) -> _Kind:
    # types.py pairs every Arrow type with one text converter (e.g. every string column is the
    # text output as is), so the Arrow type says which vectorized conversion equals it.
    if pa.types.is_integer(arrow) or pa.types.is_float64(arrow) or pa.types.is_boolean(arrow):
        return _Kind.PARSED
    if pa.types.is_float32(arrow):
        return _Kind.FLOAT4
    if arrow == pa.string():
        return _Kind.STRING
    if pa.types.is_decimal128(arrow):
        return _Kind.DECIMAL
    if arrow == pa.date32():
        return _Kind.DATE
    if arrow == pa.timestamp("us"):
        return _Kind.TIMESTAMP
    if arrow == pa.timestamp("us", tz="UTC"):
        return _Kind.TIMESTAMPTZ
    if arrow == pa.time64("us"):
        return _Kind.TIME
    return _Kind.PYTHON


def needs_key_text(arrow: pa.DataType) -> bool:
    """A key column of this landed type keeps the server's text for the resume key (RowBlock.key_text):
    its landed value does not always give the source's value back (NaN, ±infinity, arrays, rounding)."""
    return _kind(arrow) is not _Kind.PARSED


def unescape_field(raw: bytes) -> str:
    """One field of a text-format row as the value's text (``\\N`` is the caller's business)."""
    text = raw.decode()
    if "\\" not in text:
        return text
    return _ESCAPE_RE.sub(lambda m: _ESCAPES.get(m.group(1), m.group(1)), text)


def last_row_fields(chunks: Sequence[bytes], indexes: Sequence[int]) -> list[str]:
    """The text of fields ``indexes`` of the last row (keyset pagination: where the next chunk starts).

    ``chunks`` are the pieces of whole rows as received; the last row may span pieces.
    """
    tail = b""
    for piece in reversed(chunks):
        tail = piece + tail
        start = tail.rfind(b"\n", 0, len(tail) - 1)
        if start >= 0:
            break
    fields = tail[start + 1:-1].split(b"\t")
    return [unescape_field(fields[i]) for i in indexes]


class RowRuns:
    """Cuts COPY output, arriving in pieces, into runs of whole rows of at least ``target`` bytes."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.rows = 0  # rows handed out so far
        self._pieces: list[bytes] = []
        self._size = 0

    def feed(self, data: bytes) -> list[bytes] | None:
        """Add a piece; a run of whole rows once ``target`` bytes are there."""
        self._pieces.append(data)
        self._size += len(data)
        return self._take() if self._size >= self.target else None

    def rest(self) -> list[bytes] | None:
        """What is left once the COPY ended: whole rows only."""
        run = self._take() if self._pieces else None
        if self._pieces:
            raise SourceError("COPY output ended inside a row")
        return run

    def _take(self) -> list[bytes] | None:
        pieces, self._pieces, self._size = self._pieces, [], 0
        if not pieces[-1].endswith(b"\n"):  # the driver hands out whole messages (rows), but do not rely on it
            blob = b"".join(pieces)
            cut = blob.rfind(b"\n") + 1
            pieces, tail = [blob[:cut]], blob[cut:]
            self._pieces, self._size = [tail], len(tail)
            if not cut:
                return None
        self.rows += sum(p.count(b"\n") for p in pieces)
        return pieces


def _has_backslash(col: pa.Array) -> bool:
    # A scan of the column's character buffer (memchr speed); a hit in an unused byte only costs a no-op unescape.
    data = col.buffers()[2]
    return data is not None and np.frombuffer(data, np.uint8).__contains__(92)


def _unescape(col: pa.Array) -> pa.Array:
    """Undo COPY's backslash escapes in a whole string column (only when it holds a backslash)."""
    if not _has_backslash(col):
        return col
    # PostgreSQL text never holds NUL: it stands in for an escaped backslash while the others are undone.
    col = pc.replace_substring(col, "\\\\", "\x00")
    for letter, char in _ESCAPES.items():
        col = pc.replace_substring(col, "\\" + letter, char)
    return pc.replace_substring(col, "\x00", "\\")


def _replace(col: pa.Array, mapping: dict[str, str]) -> pa.Array:
    for old, new in mapping.items():
        col = pc.if_else(pc.equal(col, old), new, col)
    return col


class CopyDecoder:
    """Text-format COPY chunks of one table → ``pa.Table`` of its columns in their landed types."""

    def __init__(self, shape: TableShape, warnings: Warnings, key_fields: Sequence[int] = ()) -> None:
        self.shape = shape
        # Key columns whose landed value does not give the source's value back (NaN, ±infinity, arrays):
        # their text is kept for the snapshot's resume key.
        self._key_texts = [i for i in key_fields if needs_key_text(shape.schema.columns[i].type)]
        self._key_fields = list(key_fields)
        self._warnings = warnings
        cols = shape.schema.columns
        self._kinds = [_kind(c.type) for c in cols]
        self._names = [f"c{i}" for i in range(len(cols))]
        # A header line of our own: the CSV reader would eat a byte-order mark opening the first row.
        self._header = ("\t".join(self._names) + "\n").encode()
        # float4 is read as text and cast here: a float4 key keeps the server's text for its resume key
        types = {name: (c.type if kind is _Kind.PARSED else pa.string())
                 for name, c, kind in zip(self._names, cols, self._kinds, strict=True)}
        self._parse = pacsv.ParseOptions(delimiter="\t", quote_char=False, double_quote=False, escape_char=False,
                                         newlines_in_values=False, ignore_empty_lines=False)
        self._convert = pacsv.ConvertOptions(
            column_types=types, null_values=["\\N"], strings_can_be_null=True, true_values=["t"],
            false_values=["f"], check_utf8=True)
        self._converters: list[Callable[[str], Any]] = [t.from_text for t in shape.types]

    def decode(self, chunks: Sequence[bytes], rows: int) -> pa.Table:
        """``chunks`` concatenated are ``rows`` whole text-format rows (each ending with a newline)."""
        return self.decode_keyed(chunks, rows)[0]

    def decode_keyed(self, chunks: Sequence[bytes], rows: int) -> tuple[pa.Table, tuple[pa.Array | None, ...]]:
        """``decode`` plus the text of each key column (None where the landed value is exact)."""
        data = b"".join([self._header, *chunks])
        escaped = any(b"\\" in c for c in chunks)  # the common case, no backslash at all, skips every scan
        # A row must fit in one CSV block: pieces are whole COPY messages (rows) or runs of them, so the
        # largest piece bounds the largest row.
        block = max(_BLOCK, max((len(c) for c in chunks), default=0) + len(self._header) + 1)
        try:
            try:
                parsed = self._read(data, block)
            except pa.ArrowInvalid as exc:
                if "straddl" not in str(exc) or block > len(data):
                    raise
                parsed = self._read(data, len(data) + 1)  # a row split over pieces: the whole run as one block
        except pa.ArrowInvalid as exc:
            # Not a transient fault: the same rows would fail again after a reconnect (no retry loop).
            raise SourceFatal(f"snapshot of {self.shape.table}: COPY output could not be parsed: {exc}; "
                              "please report this with the table's definition") from exc
        if parsed.num_rows != rows:
            raise SourceFatal(f"snapshot of {self.shape.table}: COPY sent {rows} rows but {parsed.num_rows} "
                              "were parsed; please report this with the table's definition")
        texts: list[pa.Array | None] = []
        columns = [parsed.column(i).combine_chunks() for i in range(len(self._names))]
        for i in self._key_fields:
            texts.append(_unescape(columns[i]) if escaped and i in self._key_texts
                         else columns[i] if i in self._key_texts else None)
        arrays = [self._column(i, columns[i], escaped) for i in range(len(self._names))]
        return pa.Table.from_arrays(arrays, schema=self._schema()), tuple(texts)

    def text_column(self, i: int, col: pa.Array) -> pa.Array:
        """Column ``i`` from its values' text output (no COPY escapes: e.g. ``format('%s', col)``)."""
        if self._kinds[i] in (_Kind.PARSED, _Kind.FLOAT4):
            return self._per_value(i, col)  # the CSV reader's parsing is not there: the stream's converter
        return self._column(i, col, escaped=False)

    def wire_column(self, i: int, col: pa.Array) -> pa.Array:
        """Column ``i`` from pgoutput's text values (the type's text output as sent, no COPY escapes), as a
        binary array (NULL is NULL), converted as a whole: what the stream's per-value converter gives, value
        for value."""
        try:
            col = col.view(pa.string())
            col.validate(full=True)
        except pa.ArrowInvalid:
            return self._per_value_raw(i, col.view(pa.binary()).to_pylist())  # not UTF-8: NULL plus a warning
        kind = self._kinds[i]
        if kind is _Kind.PARSED or kind is _Kind.FLOAT4:
            arrow = self.shape.schema.columns[i].type
            try:
                if pa.types.is_boolean(arrow):
                    return pc.or_(pc.equal(col, "t"), pc.equal(col, "true"))
                if kind is _Kind.FLOAT4:  # through float8, as the stream's converter rounds
                    return pc.cast(pc.cast(col, pa.float64()), pa.float32())
                return pc.cast(col, arrow)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
                return self._per_value(i, col)
        return self._column(i, col, escaped=False)

    def _per_value_raw(self, i: int, values: Sequence[bytes | None]) -> pa.Array:
        conv = self._converters[i]
        column = self.shape.schema.columns[i]
        out: list[Any] = []
        for raw in values:
            try:
                out.append(None if raw is None else conv(raw.decode()))
            except (Unrepresentable, ValueError) as exc:
                self._warnings.once(self.shape.table, column.name, UNREPRESENTABLE, error=str(exc))
                out.append(None)
        return pa.array(out, type=column.type)

    def _read(self, data: bytes, block: int) -> pa.Table:
        return pacsv.read_csv(pa.py_buffer(data), read_options=pacsv.ReadOptions(use_threads=True, block_size=block),
                              parse_options=self._parse, convert_options=self._convert)

    def _schema(self) -> pa.Schema:
        return pa.schema([pa.field(c.name, c.type) for c in self.shape.schema.columns])

    def _column(self, i: int, col: pa.Array, escaped: bool) -> pa.Array:
        kind = self._kinds[i]
        arrow = self.shape.schema.columns[i].type
        if kind is _Kind.PARSED:
            return col
        if kind is _Kind.FLOAT4:  # through float8, as the stream's converter rounds
            return pc.cast(pc.cast(col, pa.float64()), pa.float32())
        if escaped:
            col = _unescape(col)
        if kind is _Kind.STRING:
            return col
        if kind is _Kind.PYTHON:
            return self._per_value(i, col)
        try:
            if kind is _Kind.DECIMAL:
                return pc.cast(self._no_special_numerics(i, col), arrow)
            if kind is _Kind.DATE:
                return pc.cast(self._infinite(i, col, "9999-12-31", "0001-01-01"), arrow)
            if kind is _Kind.TIMESTAMP:
                return pc.cast(self._infinite(i, col, _TS_MAX, _TS_MIN), arrow)
            if kind is _Kind.TIMESTAMPTZ:
                return pc.cast(self._infinite(i, col, _TS_MAX + "+00", _TS_MIN + "+00"), arrow)
            if kind is _Kind.TIME:
                return self._time(col)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            pass  # a value the cast refuses (BC date, year 10000): the converter decides, value by value
        return self._per_value(i, col)

    def _infinite(self, i: int, col: pa.Array, largest: str, smallest: str) -> pa.Array:
        """±infinity → the type's largest/smallest value (as the stream's converter), warned once per column."""
        special = pc.is_in(col, pa.array(["infinity", "-infinity"]))
        if not pc.any(special).as_py():
            return col
        column = self.shape.schema.columns[i]
        self._warnings.once(self.shape.table, column.name, INFINITE, source_type=column.source_type)
        return _replace(col, {"infinity": largest, "-infinity": smallest})

    def _no_special_numerics(self, i: int, col: pa.Array) -> pa.Array:
        """NaN and ±Infinity do not fit a decimal column: NULL plus a warning, as the stream does."""
        special = pc.is_in(col, pa.array(["NaN", "Infinity", "-Infinity"]))
        if not pc.any(special).as_py():
            return col
        column = self.shape.schema.columns[i]
        self._warnings.once(self.shape.table, column.name, UNREPRESENTABLE,
                            error=f"numeric NaN or Infinity cannot be stored in {column.source_type}")
        return pc.if_else(special, pa.scalar(None, pa.string()), col)

    @staticmethod
    def _time(col: pa.Array) -> pa.Array:
        # No string → time cast in Arrow: parse as a timestamp on 1970-01-01, keep the microseconds of the day.
        col = pc.if_else(pc.starts_with(col, "24:"), "23:59:59.999999", col)  # 24:00:00 → time.max
        stamps = pc.cast(pc.binary_join_element_wise("1970-01-01 ", col, ""), pa.timestamp("us"))
        return pc.cast(pc.cast(stamps, pa.int64()), pa.time64("us"))

    def _per_value(self, i: int, col: pa.Array) -> pa.Array:
        conv = self._converters[i]
        column = self.shape.schema.columns[i]
        out: list[Any] = []
        for text in col.to_pylist():
            if text is None:
                out.append(None)
                continue
            try:
                out.append(conv(text))
            except (Unrepresentable, ValueError) as exc:
                self._warnings.once(self.shape.table, column.name, UNREPRESENTABLE, error=str(exc))
                out.append(None)
        return pa.array(out, type=column.type)
