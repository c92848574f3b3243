"""rowimage on hand-made rows events: the layout, the errors, and when it declines.

The differential test against pymysqlreplication on a real binlog is in
tests/integration/mysql/test_mysql_rowimage.py.
"""

from __future__ import annotations

import struct
from decimal import Decimal
from types import SimpleNamespace
from typing import Any

import pytest
from pymysqlreplication.constants import FIELD_TYPE
from pymysqlreplication.row_event import DeleteRowsEvent, PartialUpdateRowsEvent, UpdateRowsEvent, WriteRowsEvent

from cdcd.errors import SourceFatal
from cdcd.sources.mysql.rowimage import compile_table

_TYPE_CODES = {WriteRowsEvent: 0x17, UpdateRowsEvent: 0x18, DeleteRowsEvent: 0x19, PartialUpdateRowsEvent: 0x27}


def col(type_: int, name: str, **kw: Any) -> SimpleNamespace:
    base = {"unsigned": False, "character_set_name": None, "enum_values": None, "set_values": None}
    return SimpleNamespace(type=type_, name=name, **(base | kw))


COLS = [col(FIELD_TYPE.LONG, "a"), col(FIELD_TYPE.VARCHAR, "b", max_length=40, character_set_name="utf8"),
        col(FIELD_TYPE.NEWDECIMAL, "d", precision=4, decimals=2)]


def event(cls: type, body: bytes, bitmaps: tuple[bytes, ...] = (b"\x07",), prefix: bytes = b"hdr") -> Any:
    """A rows event as pymysqlreplication leaves it after parsing the header: cursor at the first row image."""
    ev = object.__new__(cls)
    data = prefix + body + b"CRC!"
    wrapper = SimpleNamespace(packet=SimpleNamespace(_data=data, _position=len(prefix)), read_bytes=10, log_pos=999)
    ev.__dict__.update(packet=wrapper, event_type=_TYPE_CODES[cls], complete=True, number_of_columns=len(COLS),
                       event_size=10 + len(body), schema="db", table="t", columns_present_bitmap=bitmaps[0],
                       _RowsEvent__rows=None)
    if len(bitmaps) > 1:
        ev.columns_present_bitmap2 = bitmaps[1]
    return ev


def row(a: int | None, b: str | None, d: bytes | None) -> bytes:
    nulls = (a is None) | (b is None) << 1 | (d is None) << 2
    out = bytes([nulls])
    if a is not None:
        out += struct.pack("<i", a)
    if b is not None:
        raw = b.encode()
        out += bytes([len(raw)]) + raw
    if d is not None:
        out += d
    return out


D_12_34 = bytes([0x80 | 12, 34])  # DECIMAL(4,2) 12.34: one byte per side, sign bit set for positive
D_MINUS_1_05 = bytes([(0x80 | 1) ^ 0xFF, 5 ^ 0xFF])  # -1.05: every bit inverted


def test_write_rows_decode_with_nulls_and_signs() -> None:
    decoder = compile_table(COLS)
    assert decoder is not None
    ev = event(WriteRowsEvent, row(-5, "héllo", D_12_34) + row(None, "", D_MINUS_1_05) + row(7, None, None))
    assert decoder.rows(ev) == [
        {"values": {"a": -5, "b": "héllo", "d": Decimal("12.34")}, "none_sources": {}},
        {"values": {"a": None, "b": "", "d": Decimal("-1.05")}, "none_sources": {"a": "null"}},
        {"values": {"a": 7, "b": None, "d": None}, "none_sources": {"b": "null", "d": "null"}},
    ]
    assert ev.packet.packet._position == 3  # the packet cursor is left alone


def test_minimal_update_image_marks_missing_columns() -> None:
    decoder = compile_table(COLS)
    assert decoder is not None
    before = b"\x00" + struct.pack("<i", 1)  # only the key: bitmap 0b001, one present column
    after = b"\x00" + bytes([1]) + b"x"  # only b: bitmap 0b010
    ev = event(UpdateRowsEvent, before + after, bitmaps=(b"\x01", b"\x02"))
    (r,) = decoder.rows(ev) or []
    assert r["before_values"] == {"a": 1, "b": None, "d": None}
    assert r["before_none_sources"] == {"b": "cols bitmap", "d": "cols bitmap"}
    assert r["after_values"] == {"a": None, "b": "x", "d": None}
    assert r["after_none_sources"] == {"a": "cols bitmap", "d": "cols bitmap"}


@pytest.mark.parametrize("body", [
    row(1, "abc", D_12_34)[:-1],  # truncated: the last row runs past the event
    row(1, "abc", bytes([0x80 | 100, 0])),  # 100 in a 2-digit group: no server writes that
    row(1, "abc", D_12_34) + b"\x00",  # a stray byte: a row image that ends past the event
], ids=["truncated", "overfull-decimal", "trailing-byte"])
def test_unreadable_row_images_raise(body: bytes) -> None:
    decoder = compile_table(COLS)
    assert decoder is not None
    with pytest.raises(SourceFatal, match=r"cannot decode a row image of db\.t .* ending at 999"):
        decoder.rows(event(DeleteRowsEvent, body))
    # the columnar readers (the stream's path) refuse the same images
    lists: list[list[Any]] = [[] for _ in COLS]
    with pytest.raises(SourceFatal, match=r"cannot decode a row image of db\.t .* ending at 999"):
        decoder.read_columns(event(DeleteRowsEvent, body), lists, [[] for _ in COLS], set())


def test_columnar_decimal_is_the_int_of_its_digits() -> None:
    """The columnar readers leave a DECIMAL as value * 10**scale, sign included; an overfull group is named."""
    decoder = compile_table(COLS)
    assert decoder is not None
    data: list[list[Any]] = [[] for _ in COLS]
    ev = event(WriteRowsEvent, row(1, "x", D_12_34) + row(2, "y", D_MINUS_1_05) + row(3, "z", None))
    assert decoder.read_columns(ev, data, [[] for _ in COLS], set()) == 3
    assert data[2] == [1234, -105, None]
    with pytest.raises(SourceFatal, match=r"a DECIMAL\(4,2\) group holds 100, more digits than it may"):
        decoder.read_columns(event(WriteRowsEvent, row(1, "x", bytes([0x80 | 100, 0]))), [[] for _ in COLS],
                             [[] for _ in COLS], set())


def test_declines_what_it_does_not_read() -> None:
    decoder = compile_table(COLS)
    assert decoder is not None
    ev = event(PartialUpdateRowsEvent, row(1, "a", D_12_34) * 2, bitmaps=(b"\x07", b"\x07"))
    assert decoder.rows(ev) is None  # partial JSON updates stay with pymysqlreplication
    ev = event(WriteRowsEvent, row(1, "a", D_12_34))
    ev._RowsEvent__rows = []
    assert decoder.rows(ev) is None  # already decoded by the library: its cursor has moved
    ev = event(WriteRowsEvent, row(1, "a", D_12_34))
    ev.number_of_columns = 2
    assert decoder.rows(ev) is None  # the event and its table map disagree: the library's behaviour stands


def test_unsupported_columns_fall_back() -> None:
    assert compile_table([col(FIELD_TYPE.JSON, "j", length_size=4)]) is None  # MySQL binary JSON
    assert compile_table([col(FIELD_TYPE.DATETIME, "old")]) is None  # pre-5.6 DATETIME
    assert compile_table([col(FIELD_TYPE.LONG, None)]) is None  # no column names (binlog_row_metadata != FULL)
    assert compile_table([col(FIELD_TYPE.ENUM, "e", size=1)]) is None  # no ENUM labels
    assert compile_table([col(FIELD_TYPE.BLOB, "b", length_size=2, character_set_name="hex")]) is None
