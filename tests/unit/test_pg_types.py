"""Unit tests of text value → Python/Arrow conversion by type OID."""

from __future__ import annotations

import math
from datetime import UTC, date, datetime, time, timedelta, timezone
from decimal import Decimal

import pyarrow as pa
import pytest

from cdcd.sources.postgres.types import PgType, TypeRegistry, Unrepresentable, key_text, parse_array

R = TypeRegistry()


def conv(oid: int, text: str, typmod: int = -1) -> object:
    return R.column_type(oid, typmod).from_text(text)


def numeric_typmod(p: int, s: int) -> int:
    return ((p << 16) | (s & 0x7FF)) + 4


def test_integers_bool_floats() -> None:
    assert conv(21, "-32768") == -32768 and R.column_type(21).arrow == pa.int16()
    assert conv(23, "2147483647") == 2**31 - 1 and R.column_type(23).arrow == pa.int32()
    assert conv(20, "-9223372036854775808") == -(2**63) and R.column_type(20).arrow == pa.int64()
    assert conv(16, "t") is True and conv(16, "f") is False
    assert conv(701, "0.1") == 0.1 and conv(701, "-Infinity") == -math.inf
    assert math.isnan(conv(701, "NaN"))  # type: ignore[arg-type]
    assert conv(700, "1.1") == pytest.approx(1.1, rel=1e-7) and conv(700, "1.1") != 1.1  # float32-rounded
    assert conv(700, "Infinity") == math.inf
    assert R.column_type(700).arrow == pa.float32()


def test_numeric() -> None:
    ct = R.column_type(1700, numeric_typmod(38, 10))
    assert ct.arrow == pa.decimal128(38, 10) and ct.source_type == "numeric(38,10)"
    big = "1234567890123456789012345678.0123456789"
    assert ct.from_text(big) == Decimal(big)
    with pytest.raises(Unrepresentable):
        ct.from_text("NaN")
    free = R.column_type(1700)
    assert free.arrow == pa.string() and free.from_text("0.000000000000000000000000000000000000001") == \
        "0.000000000000000000000000000000000000001"
    assert R.column_type(1700, numeric_typmod(50, 2)).arrow == pa.string()
    assert R.column_type(1700, numeric_typmod(5, -2)).arrow == pa.string()


def test_text_bytea_uuid_json() -> None:
    assert conv(25, "") == "" and conv(1043, "ünïcödé ✓") == "ünïcödé ✓"
    assert conv(1042, "ab  ", 7) == "ab  "
    assert R.column_type(1042, 7).source_type == "bpchar(3)"
    assert conv(17, "\\x00ff10") == b"\x00\xff\x10" and conv(17, "\\x") == b""
    assert R.column_type(17).arrow == pa.binary()
    assert conv(2950, "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11") == "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11"
    assert conv(3802, '{"a": [1, 2]}') == '{"a": [1, 2]}' and conv(114, '{"a":1}') == '{"a":1}'


def test_dates_and_times() -> None:
    assert conv(1082, "2024-02-29") == date(2024, 2, 29)
    assert conv(1082, "infinity") == date.max and conv(1082, "-infinity") == date.min
    with pytest.raises(Unrepresentable):
        conv(1082, "0044-03-15 BC")
    assert conv(1083, "13:14:15.5") == time(13, 14, 15, 500000)
    assert conv(1083, "24:00:00") == time.max
    assert conv(1114, "2024-01-02 03:04:05.123456") == datetime(2024, 1, 2, 3, 4, 5, 123456)
    assert conv(1114, "infinity") == datetime.max
    assert conv(1184, "2024-01-02 03:04:05+00") == datetime(2024, 1, 2, 3, 4, 5, tzinfo=UTC)
    ts = conv(1184, "2024-01-02 03:04:05.5+05:30")
    assert ts == datetime(2024, 1, 1, 21, 34, 5, 500000, tzinfo=UTC) and ts.tzinfo is UTC  # type: ignore[union-attr]
    assert R.column_type(1184).arrow == pa.timestamp("us", tz="UTC")
    assert R.column_type(1114).arrow == pa.timestamp("us")
    # interval and timetz land as their canonical text (IntervalStyle=iso_8601)
    assert conv(1186, "P-1Y-2M3DT-4H-5M-6.5S") == "P-1Y-2M3DT-4H-5M-6.5S"
    assert conv(1266, "13:14:15+02") == "13:14:15+02" and R.column_type(1266).arrow == pa.string()
    assert datetime(2024, 1, 2, tzinfo=timezone(timedelta(hours=2))) == conv(1184, "2024-01-01 22:00:00+00")


def test_array_literals() -> None:
    assert parse_array("{}") == []
    assert parse_array('{1,NULL,"NULL","a \\"q\\" \\\\ b","x,y"}') == ["1", None, "NULL", 'a "q" \\ b', "x,y"]
    assert parse_array("{{1,2},{3,NULL}}") == [["1", "2"], ["3", None]]
    assert parse_array("[0:1]={7,8}") == ["7", "8"]
    ints = R.column_type(1007)
    assert ints.arrow == pa.list_(pa.int32()) and ints.from_text("{1,NULL,-3}") == [1, None, -3]
    assert ints.source_type == "int4[]"
    two = R.column_type(1007, -1, 2)
    assert two.arrow == pa.list_(pa.list_(pa.int32())) and two.from_text("{{1,2},{3,4}}") == [[1, 2], [3, 4]]
    nums = R.column_type(1231, numeric_typmod(10, 2))
    assert nums.from_text("{1.50,NULL}") == [Decimal("1.50"), None] and nums.arrow == pa.list_(pa.decimal128(10, 2))
    assert R.column_type(1185).from_text('{"2024-01-01 00:00:00+00"}') == [datetime(2024, 1, 1, tzinfo=UTC)]
    assert R.column_type(1000).from_text("{t,f,NULL}") == [True, False, None]


def test_enums_domains_and_unknown_types() -> None:
    reg = TypeRegistry()
    reg.add(PgType(90001, "mood", "e"))
    reg.add(PgType(90002, "_mood", "b", elem=90001))
    reg.add(PgType(90003, "price", "d", base=1700, base_typmod=numeric_typmod(12, 2)))
    reg.add(PgType(90004, "_price", "b", elem=90003))
    assert reg.column_type(90001).from_text("happy") == "happy"
    assert reg.column_type(90002).from_text("{happy,sad}") == ["happy", "sad"]
    price = reg.column_type(90003)
    assert price.arrow == pa.decimal128(12, 2) and price.from_text("9.99") == Decimal("9.99")
    assert reg.column_type(90004).arrow == pa.list_(pa.decimal128(12, 2))
    unknown = reg.column_type(123456)
    assert unknown.arrow == pa.string() and not unknown.known and unknown.from_text("(1,2)") == "(1,2)"
    assert reg.missing({23, 123456, 90004}) == {123456}
    assert R.column_type(869).known and R.column_type(869).from_text("10.0.0.1") == "10.0.0.1"  # inet


def test_key_text_round_trips_through_postgres_literals() -> None:
    assert key_text(True) == "true" and key_text(42) == "42" and key_text(Decimal("1.50")) == "1.50"
    assert key_text(b"\x00\xff") == "\\x00ff" and key_text(0.1) == "0.1"
    assert key_text(datetime(2024, 1, 2, 3, 4, 5, tzinfo=UTC)) == "2024-01-02T03:04:05+00:00"
    assert key_text(date(2024, 1, 2)) == "2024-01-02" and key_text("it's") == "it's"
