"""The snapshot's bulk decoder: COPY text rows → Arrow columns equal to the stream's per-value converters."""

from __future__ import annotations

import math
from datetime import date, time
from typing import Any

import pyarrow as pa
import pytest
import structlog

from cdcd.errors import SourceError
from cdcd.events import Column, TableId, TableSchema
from cdcd.sources.postgres.copytext import CopyDecoder, RowRuns, last_row_fields, unescape_field
from cdcd.sources.postgres.shape import TableShape, Warnings
from cdcd.sources.postgres.types import PgType, TypeRegistry

REG = TypeRegistry()
REG.add(PgType(90001, "mood", kind="e"))

# (name, oid, typmod, text outputs, as PostgreSQL prints them with the session settings)
COLUMNS: list[tuple[str, int, int, list[str | None]]] = [
    ("i2", 21, -1, ["-32768", "0", None]),
    ("i8", 20, -1, ["-9223372036854775808", "9223372036854775807", None]),
    ("f4", 700, -1, ["0.1", "-Infinity", "NaN"]),
    ("f8", 701, -1, ["-1.5e+300", "Infinity", "5e-324"]),
    ("b", 16, -1, ["t", "f", None]),
    ("tx", 25, -1, ["", "a\tb\nc\\d\re\x0bf\x08g\x0ch", "\\N"]),
    ("n", 1700, 4 + (38 << 16) + 10, ["-1234567890123456789012345678.0123456789", "NaN", "0.0000000000"]),
    ("nf", 1700, -1, ["NaN", "-Infinity", "0.000000000000000000001"]),
    ("d", 1082, -1, ["2024-02-29", "infinity", "-infinity"]),
    ("tm", 1083, -1, ["24:00:00", "13:14:15.5", "00:00:00"]),
    ("ts", 1114, -1, ["2024-01-02 03:04:05.123456", "infinity", "-infinity"]),
    ("tz", 1184, -1, ["2024-01-02 03:04:05.5+00", "infinity", "-infinity"]),
    ("by", 17, -1, ["\\x00ff10", "\\x", None]),
    ("ai", 1007, -1, ["{1,NULL,3}", "{}", None]),
    ("at", 1009, -1, ['{"a b",NULL,"NULL","","x,\\"y"}', "{}", '{"\\\\"}']),
    ("u", 2950, -1, ["a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11", None, "00000000-0000-0000-0000-000000000000"]),
    ("j", 3802, -1, ['{"a": "x,\\"y\\"\\n"}', "{}", "[]"]),
    ("m", 90001, -1, ["happy", "sad", None]),
    ("iv", 1186, -1, ["P-1Y-2M3DT-4H-5M-6.5S", "PT0S", None]),
]


def shape(columns: list[tuple[str, int, int, list[str | None]]]) -> TableShape:
    types = tuple(REG.column_type(oid, typmod) for _, oid, typmod, _ in columns)
    cols = tuple(Column(name, t.arrow, t.source_type) for (name, _, _, _), t in zip(columns, types, strict=True))
    return TableShape(TableSchema(TableId("public", "t"), cols, ()), types, (False,) * len(cols))


def escape(text: str | None) -> str:
    """What COPY TO (text format) sends for a value."""
    if text is None:
        return "\\N"
    out = text.replace("\\", "\\\\")
    for char, letter in (("\b", "b"), ("\f", "f"), ("\n", "n"), ("\r", "r"), ("\t", "t"), ("\v", "v")):
        out = out.replace(char, "\\" + letter)
    return out


def copy_text(columns: list[tuple[str, int, int, list[str | None]]]) -> bytes:
    n = len(columns[0][3])
    return "".join("\t".join(escape(c[3][i]) for c in columns) + "\n" for i in range(n)).encode()


def expected(sh: TableShape, columns: list[tuple[str, int, int, list[str | None]]]) -> dict[str, list[Any]]:
    """What the stream's converters make of the same text (unrepresentable: None)."""
    out: dict[str, list[Any]] = {}
    for (name, _, _, values), t in zip(columns, sh.types, strict=True):
        conv = []
        for v in values:
            try:
                conv.append(None if v is None else t.from_text(v))
            except ValueError:
                conv.append(None)
        out[name] = pa.array(conv, t.arrow).to_pylist()
    return out


def same(a: list[Any], b: list[Any]) -> bool:
    return all((isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y)) or x == y
               for x, y in zip(a, b, strict=True))


def test_every_type_decodes_as_the_stream_converts_it() -> None:
    sh = shape(COLUMNS)
    warnings = Warnings()
    with structlog.testing.capture_logs() as logs:
        table = CopyDecoder(sh, warnings).decode([copy_text(COLUMNS)], 3)
    assert table.schema == pa.schema([pa.field(c.name, c.type) for c in sh.schema.columns])
    got, want = table.to_pydict(), expected(sh, COLUMNS)
    for name in want:
        assert same(got[name], want[name]), name
    assert got["tx"] == ["", "a\tb\nc\\d\re\x0bf\x08g\x0ch", "\\N"]  # the string \N is not NULL
    assert got["n"][1] is None and got["d"][1:] == [date.max, date.min] and got["tm"][0] == time.max
    # NaN: once, named; ±infinity: clamped, once per column
    assert [entry["column"] for entry in logs if entry["log_level"] == "warning"] == ["n", "d", "ts", "tz"]


def test_values_the_casts_refuse_go_through_the_converter() -> None:
    cols: list[tuple[str, int, int, list[str | None]]] = [
        ("d", 1082, -1, ["2024-01-01", "0044-03-15 BC", None]),
        ("ts", 1114, -1, ["10000-01-01 00:00:00", "2024-01-01 00:00:00", "infinity"]),
    ]
    sh = shape(cols)
    with structlog.testing.capture_logs() as logs:
        got = CopyDecoder(sh, Warnings()).decode([copy_text(cols)], 3).to_pydict()
    assert got == expected(sh, cols)
    assert got["d"][1] is None and got["ts"][0] is None
    assert sorted((entry["column"], entry["event"][:8]) for entry in logs if entry["log_level"] == "warning") == \
        [("d", "value ca"), ("ts", "infinite"), ("ts", "value ca")]


def test_a_leading_byte_order_mark_and_empty_single_column_rows_are_kept() -> None:
    cols: list[tuple[str, int, int, list[str | None]]] = [("s", 25, -1, ["\ufeffx", "", None, "\\."])]
    got = CopyDecoder(shape(cols), Warnings()).decode([copy_text(cols)], 4).to_pydict()
    assert got["s"] == ["\ufeffx", "", None, "\\."]


def test_a_row_count_mismatch_is_an_error() -> None:
    cols: list[tuple[str, int, int, list[str | None]]] = [("i", 23, -1, ["1", "2"])]
    with pytest.raises(SourceError, match="rows"):
        CopyDecoder(shape(cols), Warnings()).decode([copy_text(cols)], 3)


def test_row_runs_hand_out_whole_rows_whatever_the_pieces() -> None:
    data = b"".join(f"{i}\tv{i}\n".encode() for i in range(100))
    for size in (1, 7, 64, len(data)):
        runs = RowRuns(50)
        pieces = [data[i:i + size] for i in range(0, len(data), size)]
        out = [r for r in (runs.feed(p) for p in pieces) if r]
        rest = runs.rest()
        if rest:
            out.append(rest)
        assert b"".join(b"".join(r) for r in out) == data and runs.rows == 100
        assert all(b"".join(r).endswith(b"\n") for r in out)
        assert last_row_fields(out[-1], [1, 0]) == ["v99", "99"]
    runs = RowRuns(10)
    runs.feed(b"1\tx")
    with pytest.raises(SourceError):
        runs.rest()


def test_key_fields_are_unescaped() -> None:
    assert unescape_field(b"a\\tb\\\\n\\n") == "a\tb\\n\n"
    assert last_row_fields([b"1\tx\n", b"2\t\\\\\\t'\n"], [1]) == ["\\\t'"]


def test_a_row_larger_than_the_csv_block_parses_even_split_over_pieces() -> None:
    cols: list[tuple[str, int, int, list[str | None]]] = [("id", 23, -1, ["1", "2"]),
                                                         ("v", 25, -1, ["x" * (3 << 20), "y"])]
    sh = shape(cols)
    text = copy_text(cols)
    pieces = [text[i:i + 65536] for i in range(0, len(text), 65536)]  # no piece holds the large row whole
    got = CopyDecoder(sh, Warnings()).decode(pieces, 2).to_pydict()
    assert got == {"id": [1, 2], "v": ["x" * (3 << 20), "y"]}
    assert CopyDecoder(sh, Warnings()).decode([text], 2).to_pydict() == got
