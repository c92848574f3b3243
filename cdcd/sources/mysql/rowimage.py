"""Fast row-image decoding for WRITE/UPDATE/DELETE rows events, straight from the packet bytes.

pymysqlreplication parses a rows event's header and bitmaps eagerly but decodes
the row images lazily (``ev.rows``), through several method calls, slices and
struct calls per value: that was most of the binlog thread's time. Here a
table map's columns are compiled once into a plan per column (``rowcolumns.py``), and each
columns-present bitmap into one generated Python function that reads a whole
row image with inline struct calls. The output is exactly what ``ev.rows``
returns (after ``compat``'s fix): the same dicts, the same values (types,
Decimal exponents, microseconds) and the same ``none_sources``, so the
converters of ``types.py`` apply unchanged.

Column types this module does not decode (MySQL's binary JSON, the pre-5.6
DATETIME/TIME/TIMESTAMP formats, VAR_STRING, columns without names or without
ENUM/SET labels) make ``compile_table`` return None: the caller then falls
back to pymysqlreplication's own decoding for that table.

Binary formats (MySQL ``sql/log_event.cc``, ``rpl_record.cc``,
``decimal.c``, ``my_time.cc``; MariaDB writes the same): after the
columns-present bitmap(s), each row image is a NULL bitmap with one bit per
*present* column (LSB first), then the values of the present, non-NULL columns
in column order; an UPDATE row is a before image followed by an after image.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from decimal import InvalidOperation
from typing import Any

from pymysqlreplication import row_event as rows
from pymysqlreplication.constants import NONE_SOURCE

from cdcd.errors import SourceFatal
from cdcd.sources.mysql.rowcolumns import Col, Form, Unsupported, column_plan, columnar_plan

Row = dict[str, Any]
Image = Callable[[bytes, int], tuple[Row, dict[str, str], int]]

_ROWS_EVENT_TYPES = frozenset((0x17, 0x18, 0x19, 0x1E, 0x1F, 0x20))  # v1 and v2 write/update/delete
_MAX_IMAGES = 64  # compiled columns-present bitmaps kept per table (MINIMAL images vary per statement)
_MAX_TABLES = 256  # compiled table shapes kept


# ------------------------------------------------------------------ row-image readers (code generation)

def _image_source(cols: tuple[Col, ...], present: tuple[bool, ...]) -> tuple[str, dict[str, Any]]:
    """Python source of one row-image reader for this columns-present bitmap, and its globals."""
    nb = (sum(present) + 7) // 8
    consts: dict[str, Any] = {"FB": int.from_bytes}
    out = ["def image(b, p):", "    s = {}"]
    out += ["    n = b[p]", "    p += 1"] if nb == 1 else [f"    n = FB(b[p:p + {nb}], 'little')", f"    p += {nb}"]
    bit = 0
    for i, (col, here) in enumerate(zip(cols, present, strict=True)):
        consts[f"K{i}"] = col.name
        if not here:
            out += [f"    v{i} = None", f"    s[K{i}] = {NONE_SOURCE.COLS_BITMAP!r}"]
            continue
        out += [f"    if n >> {bit} & 1:", f"        v{i} = None", f"        s[K{i}] = {NONE_SOURCE.NULL!r}",
                "    else:"]
        consts.update((name.format(i=i), value) for name, value in col.consts)
        out += ["        " + line.format(i=i) for line in col.lines]
        bit += 1
    out.append("    return {" + ", ".join(f"K{i}: v{i}" for i in range(len(cols))) + "}, s, p")
    return "\n".join(out), consts


#: A columnar reader: (packet, start, end, data lists, before lists, zero-value column names) -> end offset
ColumnReader = Callable[[bytes, int, int, list[list[Any]], list[list[Any]], set[str]], int]
_EMPTY_SET_LINE = f"s[K{{i}}] = {NONE_SOURCE.EMPTY_SET!r}"


def _column_lines(col: Col) -> list[str]:
    """A column's lines for the columnar readers: no per-row none-source dict. An empty SET is the empty
    string at once (the row path's ``_fix_empty_sets``); a zero or out-of-range date is None, its column
    named in ``z`` for the zero-date warning."""
    out = []
    for line in col.lines:
        body = line.lstrip()
        indent = line[: len(line) - len(body)]
        if body == _EMPTY_SET_LINE:
            out.append(indent + "v{i} = ''")
        elif body.startswith("s[K{i}] = "):
            out.append(indent + "z.add(K{i})")
        else:
            out.append(line)
    return out


def _columns_source(cols: tuple[Col, ...], images: list[tuple[tuple[bool, ...], tuple[str, ...]]]
                    ) -> tuple[str, dict[str, Any]]:
    """Python source of a reader that decodes every row of a rows event and appends each value to its
    column's list: ``images`` are the row's images in order (one, or an update's before and after), each
    with its columns-present bitmap and the list prefixes its values go to (``a``: data, ``b``: before)."""
    consts: dict[str, Any] = {"FB": int.from_bytes}
    out = ["def read(b, p, end, A, B, z):"]
    for prefix, lists in (("a", "A"), ("b", "B")):
        if any(prefix in targets for _, targets in images):
            out += [f"    {prefix}{i} = {lists}[{i}].append" for i in range(len(cols))]
    out.append("    while p < end:")
    for present, targets in images:
        nb = (sum(present) + 7) // 8
        out += ["        n = b[p]", "        p += 1"] if nb == 1 else \
            [f"        n = FB(b[p:p + {nb}], 'little')", f"        p += {nb}"]
        bit = 0
        for i, (col, here) in enumerate(zip(cols, present, strict=True)):
            consts[f"K{i}"] = col.name
            appends = [f"{t}{i}(v{i})" for t in targets]
            if not here:
                out += [f"        {t}{i}(None)" for t in targets]
                continue
            out += [f"        if n >> {bit} & 1:"] + [f"            {t}{i}(None)" for t in targets] + ["        else:"]
            consts.update((name.format(i=i), value) for name, value in col.consts)
            out += ["            " + line.format(i=i) for line in _column_lines(col)]
            out += [f"            {a}" for a in appends]
            bit += 1
    out.append("    return p")
    return "\n".join(out), consts


def _compile_image(cols: tuple[Col, ...], present: tuple[bool, ...]) -> Image:
    source, consts = _image_source(cols, present)
    namespace: dict[str, Any] = dict(consts)
    exec(compile(source, "<cdcd row image>", "exec"), namespace)  # the source is built from fixed templates
    image: Image = namespace["image"]
    return image


# ------------------------------------------------------------------ tables and events

class TableDecoder:
    """Row-image readers for one table-map shape, one per columns-present bitmap seen."""

    def __init__(self, cols: tuple[Col, ...], columnar: tuple[tuple[Col, Form], ...] | None = None) -> None:
        self.cols = cols
        # the columnar readers' columns and each one's form (None: the row reader's value)
        self.columnar_cols = cols if columnar is None else tuple(c for c, _ in columnar)
        self.forms: tuple[Form, ...] = (None,) * len(cols) if columnar is None else \
            tuple(f for _, f in columnar)
        self._present: dict[bytes, tuple[bool, ...]] = {}
        self._images: dict[bytes, Image] = {}
        self._readers: dict[tuple[str, bytes, bytes], ColumnReader] = {}

    def image(self, bitmap: bytes) -> Image:
        img = self._images.get(bitmap)
        if img is None:
            present = tuple(bool(bitmap[i >> 3] >> (i & 7) & 1) for i in range(len(self.cols)))
            img = _compile_image(self.cols, present)
            if len(self._images) >= _MAX_IMAGES:
                self._images.clear()
            self._images[bitmap] = img
        return img

    def present(self, bitmap: bytes) -> tuple[bool, ...]:
        """Which columns a columns-present bitmap holds."""
        got = self._present.get(bitmap)
        if got is None:
            got = tuple(bool(bitmap[i >> 3] >> (i & 7) & 1) for i in range(len(self.cols)))
            if len(self._present) >= _MAX_IMAGES:
                self._present.clear()
            self._present[bitmap] = got
        return got

    def column_reader(self, kind: str, bitmap: bytes, bitmap2: bytes = b"") -> ColumnReader:
        """The columnar reader of rows events of ``kind`` (``write``, ``update``, ``delete``) with these
        columns-present bitmaps: a write's values go to the data lists, a delete's to the data and the before
        lists, an update's before image to the before lists and its after image to the data lists."""
        key = (kind, bitmap, bitmap2)
        reader = self._readers.get(key)
        if reader is None:
            first = self.present(bitmap)
            images: list[tuple[tuple[bool, ...], tuple[str, ...]]] = \
                [(first, ("b",)), (self.present(bitmap2), ("a",))] if kind == "update" else \
                [(first, ("a", "b") if kind == "delete" else ("a",))]
            source, consts = _columns_source(self.columnar_cols, images)
            namespace: dict[str, Any] = dict(consts)
            exec(compile(source, "<cdcd columnar row image>", "exec"), namespace)  # built from fixed templates
            reader = namespace["read"]
            if len(self._readers) >= _MAX_IMAGES:
                self._readers.clear()
            self._readers[key] = reader
        return reader

    def read_columns(self, ev: Any, data: list[list[Any]], before: list[list[Any]], zero: set[str]) -> int | None:
        """Appends the rows of this rows event to the column lists (``column_reader``); the number of rows
        read, None when the event is not one this module reads (as ``rows``)."""
        body = _body(ev, len(self.cols))
        if body is None:
            return None
        buf, start, end = body
        t = type(ev)
        if t is rows.UpdateRowsEvent:
            reader = self.column_reader("update", ev.columns_present_bitmap, ev.columns_present_bitmap2)
        else:
            reader = self.column_reader("write" if t is rows.WriteRowsEvent else "delete", ev.columns_present_bitmap)
        first = len(data[0])
        try:
            pos = reader(buf, start, end, data, before, zero)
            if pos != end:
                raise _Overrun(f"the row images run {pos - end} bytes past the end of the event")
        except (struct.error, ValueError, IndexError, InvalidOperation, OverflowError, _Overrun) as exc:
            raise _undecodable(ev, exc) from exc
        return len(data[0]) - first

    def rows(self, ev: Any) -> list[Row] | None:
        """``ev.rows`` of this rows event, decoded here; None when the event is not one this module reads
        (partial JSON updates, an event already decoded, a column count that differs from the table map)."""
        body = _body(ev, len(self.cols))
        if body is None:
            return None
        buf, start, end = body
        try:
            if type(ev) is rows.UpdateRowsEvent:
                return _update_rows(self.image(ev.columns_present_bitmap), self.image(ev.columns_present_bitmap2),
                                    buf, start, end)
            return _single_rows(self.image(ev.columns_present_bitmap), buf, start, end)
        except (struct.error, ValueError, IndexError, InvalidOperation, OverflowError, _Overrun) as exc:
            # never skip a row we cannot read: that would be a silent gap in the change stream
            raise _undecodable(ev, exc) from exc


class _Overrun(Exception):
    pass


def _undecodable(ev: Any, exc: Exception) -> SourceFatal:
    return SourceFatal(
        f"cannot decode a row image of {ev.schema}.{ev.table} in the binlog event ending at "
        f"{ev.packet.log_pos} ({type(exc).__name__}: {exc}). The event does not match its table map; "
        "report it with the output of mysqlbinlog/mariadb-binlog --verbose for that position."
    )


def _body(ev: Any, ncols: int) -> tuple[bytes, int, int] | None:
    """The packet bytes and the [start, end) range of the row images, if this event can be read here."""
    if type(ev) not in (rows.WriteRowsEvent, rows.UpdateRowsEvent, rows.DeleteRowsEvent):
        return None
    if ev.event_type not in _ROWS_EVENT_TYPES or not ev.complete or ev.number_of_columns != ncols:
        return None
    if getattr(ev, "_RowsEvent__rows", None) is not None:
        return None  # already decoded: the packet cursor has moved on
    wrapper = ev.packet
    if getattr(wrapper, "_BinLogPacketWrapper__data_buffer", b""):
        return None  # pushed-back bytes: the raw cursor is not where the images start
    raw = wrapper.packet
    buf, start = raw._data, raw._position
    end = start + ev.event_size - wrapper.read_bytes
    if not isinstance(buf, bytes | bytearray) or end > len(buf) or end < start:
        return None
    return bytes(buf) if isinstance(buf, bytearray) else buf, start, end


def _single_rows(image: Image, buf: bytes, pos: int, end: int) -> list[Row]:
    out: list[Row] = []
    append = out.append
    while pos < end:
        values, none_sources, pos = image(buf, pos)
        append({"values": values, "none_sources": none_sources})
    if pos != end:
        raise _Overrun(f"the row images run {pos - end} bytes past the end of the event")
    return out


def _update_rows(before: Image, after: Image, buf: bytes, pos: int, end: int) -> list[Row]:
    out: list[Row] = []
    append = out.append
    while pos < end:
        bv, bs, pos = before(buf, pos)
        av, as_, pos = after(buf, pos)
        append({"before_values": bv, "before_none_sources": bs, "after_values": av, "after_none_sources": as_})
    if pos != end:
        raise _Overrun(f"the row images run {pos - end} bytes past the end of the event")
    return out


def table_map_signature(columns: list[Any]) -> tuple[Any, ...]:
    """Everything about a table map's columns that decoding depends on."""
    return tuple(
        (c.type, c.name, bool(c.unsigned), getattr(c, "max_length", None), getattr(c, "length_size", None),
         getattr(c, "precision", None), getattr(c, "decimals", None), getattr(c, "fsp", None),
         getattr(c, "bits", None), getattr(c, "bytes", None), getattr(c, "size", None), c.character_set_name,
         tuple(c.enum_values) if c.enum_values else None, tuple(c.set_values) if c.set_values else None)
        for c in columns
    )


_tables: dict[tuple[Any, ...], TableDecoder | None] = {}


def compile_table(columns: list[Any], ignore_decode_errors: bool = False) -> TableDecoder | None:
    """The decoder for a table map's columns (pymysqlreplication Column objects), or None when a column type
    is not decoded here. Cached by shape: every transaction brings a new table-map event."""
    key = (table_map_signature(columns), ignore_decode_errors)
    if key in _tables:
        return _tables[key]
    errors = "ignore" if ignore_decode_errors else "strict"
    try:
        cols = tuple(column_plan(c, errors) for c in columns)
        decoder: TableDecoder | None = TableDecoder(
            cols, tuple(columnar_plan(c, col, errors) for c, col in zip(columns, cols, strict=True)))
    except Unsupported:
        decoder = None
    if len(_tables) >= _MAX_TABLES:
        _tables.clear()
    _tables[key] = decoder
    return decoder


def unsupported_reason(columns: list[Any]) -> str | None:
    """Why ``compile_table`` falls back for these columns (None: it does not)."""
    for c in columns:
        try:
            column_plan(c, "strict")
        except Unsupported as exc:
            return f"column {c.name!r}: {exc}"
    return None
