"""Every supported column type round-trips exactly, through the snapshot and through the binlog."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from typing import Any

import pyarrow as pa
from my_helpers import Driver, events_of

from cdcd.config import Config
from cdcd.events import Op

DDL = """CREATE TABLE t (
  id INT PRIMARY KEY,
  ti TINYINT, tu TINYINT UNSIGNED, si SMALLINT, su SMALLINT UNSIGNED, mi MEDIUMINT, mu MEDIUMINT UNSIGNED,
  i INT, iu INT UNSIGNED, bi BIGINT, bu BIGINT UNSIGNED,
  d DECIMAL(30,10), dw DECIMAL(65,30), f FLOAT, db DOUBLE,
  c CHAR(5), vc VARCHAR(300), tx TEXT, lt LONGTEXT,
  bn BINARY(4), vb VARBINARY(10), bl BLOB,
  dt DATE, dtm DATETIME(6), dt0 DATETIME, ts TIMESTAMP(3) NULL DEFAULT NULL, tm TIME(6), tm0 TIME, tm2 TIME(2), y YEAR,
  j JSON, e ENUM('a','b','it''s'), st SET('x','y','z'), b1 BIT(1), b10 BIT(10), b64 BIT(64)
) CHARACTER SET utf8mb4"""

ROWS = [
    # all extremes
    "(1, -128, 255, -32768, 65535, -8388608, 16777215, -2147483648, 4294967295, -9223372036854775808, "
    "18446744073709551615, -12345678901234567890.0123456789, "
    "12345678901234567890123456789012345.123456789012345678901234567890, 1.5, -2.25e300, "
    "'ab', 'héllo 😀 ünï', 'some text', REPEAT('x', 70000), X'00010203', X'', X'FF00', '2024-02-29', "
    "'2024-01-02 03:04:05.123456', '9999-12-31 23:59:59', '2038-01-19 03:14:07.999', '-838:59:58.999999', "
    "'-00:00:01', '-00:00:00.50', 2155, '{\"a\": [1, 2.5, \"x\"], \"b\": null}', 'it''s', 'x,z', b'1', "
    "b'1000000001', b'1111111111111111111111111111111111111111111111111111111111111111')",
    # other edges: zero/empty values that are not NULL
    "(2, 0, 0, 0, 0, 0, 0, 0, 0, 9223372036854775807, 9223372036854775808, 0, 0, 0, 0, '', '', '', '', X'01', "
    "X'00', X'', '1000-01-01', '1000-01-01 00:00:00', '1000-01-01 00:00:00', '1970-01-01 00:00:01', "
    "'838:59:59', '00:00:00', '12:34:56.78', 1901, '[]', 'a', '', b'0', b'0', b'0')",
    # NULL everywhere (distinct from the empty values above)
    "(3" + ", NULL" * 35 + ")",
]

EXPECTED: dict[int, dict[str, Any]] = {
    1: {"id": 1, "ti": -128, "tu": 255, "si": -32768, "su": 65535, "mi": -8388608, "mu": 16777215,
        "i": -2147483648, "iu": 4294967295, "bi": -9223372036854775808, "bu": Decimal("18446744073709551615"),
        "d": Decimal("-12345678901234567890.0123456789"),
        "dw": "12345678901234567890123456789012345.123456789012345678901234567890",
        "f": 1.5, "db": -2.25e300, "c": "ab", "vc": "héllo 😀 ünï", "tx": "some text", "lt": "x" * 70000,
        "bn": b"\x00\x01\x02\x03", "vb": b"", "bl": b"\xff\x00", "dt": date(2024, 2, 29),
        "dtm": datetime(2024, 1, 2, 3, 4, 5, 123456), "dt0": datetime(9999, 12, 31, 23, 59, 59),
        "ts": datetime(2038, 1, 19, 3, 14, 7, 999000, tzinfo=UTC),
        "tm": -timedelta(hours=838, minutes=59, seconds=58, microseconds=999999),
        "tm0": -timedelta(seconds=1), "tm2": -timedelta(microseconds=500000), "y": 2155,
        "j": '{"a": [1, 2.5, "x"], "b": null}', "e": "it's", "st": "x,z", "b1": b"\x01", "b10": b"\x02\x01",
        "b64": b"\xff" * 8},
    2: {"id": 2, "ti": 0, "tu": 0, "si": 0, "su": 0, "mi": 0, "mu": 0, "i": 0, "iu": 0,
        "bi": 9223372036854775807, "bu": Decimal("9223372036854775808"), "d": Decimal("0E-10"),
        "dw": "0.000000000000000000000000000000", "f": 0.0, "db": 0.0, "c": "", "vc": "", "tx": "", "lt": "",
        "bn": b"\x01\x00\x00\x00", "vb": b"\x00", "bl": b"", "dt": date(1000, 1, 1),
        "dtm": datetime(1000, 1, 1), "dt0": datetime(1000, 1, 1), "ts": datetime(1970, 1, 1, 0, 0, 1, tzinfo=UTC),
        "tm": timedelta(hours=838, minutes=59, seconds=59), "tm0": timedelta(0),
        "tm2": timedelta(hours=12, minutes=34, seconds=56, microseconds=780000), "y": 1901, "j": "[]", "e": "a",
        "st": "", "b1": b"\x00", "b10": b"\x00\x00", "b64": b"\x00" * 8},
}

ARROW = {"tu": pa.int16(), "su": pa.int32(), "mu": pa.int32(), "iu": pa.int64(), "bu": pa.decimal128(20, 0),
         "d": pa.decimal128(30, 10), "dw": pa.string(), "f": pa.float32(), "db": pa.float64(),
         "bn": pa.binary(), "dtm": pa.timestamp("us"), "ts": pa.timestamp("us", tz="UTC"), "tm": pa.duration("us"),
         "y": pa.int16(), "j": pa.string(), "st": pa.string(), "b10": pa.binary(), "dt": pa.date32()}


def _check(row: dict[str, Any], expected: dict[str, Any]) -> None:
    for k, v in expected.items():
        got = row[k]
        assert got == v and type(got) is type(v), f"{k}: {got!r} != {v!r}"


async def test_every_type_round_trips_through_snapshot_and_stream(make_config: Callable[..., Config],
                                                                    sql: Callable[..., Any]) -> None:
    sql(DDL, f"INSERT INTO t VALUES {ROWS[0]}, {ROWS[1]}, {ROWS[2]}")
    async with Driver(make_config(["t"])) as d:
        got = await d.until_mark("snapshot_done")
        snap = {e.key[0]: e for e in events_of(got)}  # type: ignore[index]
        sql("DELETE FROM t", f"INSERT INTO t VALUES {ROWS[0]}", f"INSERT INTO t VALUES {ROWS[1]}",
            f"INSERT INTO t VALUES {ROWS[2]}", "UPDATE t SET e = 'b', st = 'y' WHERE id = 1")
        evs = await d.events(7)
    stream = {e.key[0]: e for e in evs if e.op is Op.CREATE}  # type: ignore[index]
    for rid, expected in EXPECTED.items():
        _check(snap[rid].after, expected)  # type: ignore[arg-type]
        _check(stream[rid].after, expected)  # type: ignore[arg-type]
    for source in (snap, stream):
        nulls = source[3].after
        assert nulls is not None and all(v is None for k, v in nulls.items() if k != "id")
    # the delete carries the full before image; the update both images
    deleted = {e.key[0]: e.before for e in evs if e.op is Op.DELETE}  # type: ignore[index]
    _check(deleted[1], EXPECTED[1])  # type: ignore[arg-type]
    upd = next(e for e in evs if e.op is Op.UPDATE)
    assert upd.before["e"] == "it's" and upd.after["e"] == "b" and upd.after["st"] == "y"  # type: ignore[index]
    # the snapshot's and the stream's Arrow types agree, and are the documented ones
    for name, want in ARROW.items():
        assert snap[1].schema.column(name).type == want, name
        assert stream[1].schema.column(name).type == want, name
    assert [c.type for c in snap[1].schema.columns] == [c.type for c in stream[1].schema.columns]
    # values fit their Arrow types exactly
    for e in (snap[1], snap[2], stream[1], stream[2]):
        for c in e.schema.columns:
            arr = pa.array([e.after[c.name]], type=c.type)  # type: ignore[index]
            assert arr.to_pylist()[0] == e.after[c.name] or c.type == pa.duration("us"), c.name  # type: ignore[index]
