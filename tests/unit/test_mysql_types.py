"""MySQL column types → Arrow types and values; negative TIME decoding; checkpoint key encoding."""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta
from decimal import Decimal

import pyarrow as pa
import pytest

from cdcd.sources.mysql.compat import decode_time2
from cdcd.sources.mysql.types import (
    ZeroValue,
    arrow_type,
    is_known_type,
    key_from_json,
    key_to_json,
    normalize_source_type,
    snapshot_converter,
    stream_converter,
    type_values,
)


@pytest.mark.parametrize(("column_type", "want"), [
    ("tinyint(4)", pa.int8()), ("tinyint(3) unsigned", pa.int16()), ("smallint(5) unsigned zerofill", pa.int32()),
    ("mediumint(8) unsigned", pa.int32()), ("int(11)", pa.int32()), ("int(10) unsigned", pa.int64()),
    ("bigint(20)", pa.int64()), ("bigint(20) unsigned", pa.decimal128(20, 0)),
    ("decimal(10,2)", pa.decimal128(10, 2)), ("decimal(38,0)", pa.decimal128(38, 0)), ("decimal(65,30)", pa.string()),
    ("float", pa.float32()), ("float(7,4)", pa.float32()), ("double", pa.float64()),
    ("varchar(20)", pa.string()), ("longtext", pa.string()), ("json", pa.string()), ("enum('a','b')", pa.string()),
    ("set('x')", pa.string()), ("binary(4)", pa.binary()), ("blob", pa.binary()), ("bit(10)", pa.binary()),
    ("date", pa.date32()), ("datetime(6)", pa.timestamp("us")), ("timestamp(3)", pa.timestamp("us", tz="UTC")),
    ("time(6)", pa.duration("us")), ("year(4)", pa.int16()), ("geometry", pa.binary()),
])
def test_arrow_types(column_type: str, want: pa.DataType) -> None:
    assert arrow_type(column_type) == want


def test_unknown_type_lands_as_text() -> None:
    assert arrow_type("frobnicate") == pa.string() and not is_known_type("frobnicate")
    assert all(is_known_type(t) for t in ("inet6", "inet4", "uuid", "point", "bit(64)", "year", "float"))


def test_normalize_and_enum_values() -> None:
    assert normalize_source_type("INT(11) UNSIGNED ZEROFILL") == "int unsigned"
    assert type_values("'a','it''s','c,d'") == ["a", "it's", "c,d"]


def test_stream_converters() -> None:
    assert stream_converter("bigint unsigned")(18446744073709551615) == Decimal(18446744073709551615)  # type: ignore[misc]
    assert stream_converter("year")(1900) == 0  # type: ignore[misc]
    assert stream_converter("set('x','y','z')")({"z", "x"}) == "x,z"  # type: ignore[misc]
    assert stream_converter("bit(10)")("1000000001") == b"\x02\x01"  # type: ignore[misc]
    assert stream_converter("binary(4)")(b"\x01") == b"\x01\x00\x00\x00"  # type: ignore[misc]
    assert stream_converter("varbinary")("") == b""  # type: ignore[misc]
    assert stream_converter("json")({"a": [1, b"x"]}) == '{"a": [1, "x"]}'  # type: ignore[misc]
    ts = stream_converter("timestamp(3)")(datetime(2024, 1, 1, 12))  # type: ignore[misc]
    assert ts == datetime(2024, 1, 1, 12, tzinfo=UTC)
    assert stream_converter("decimal(65,2)")(Decimal("1.50")) == "1.50"  # type: ignore[misc]
    assert stream_converter("int") is None


def test_snapshot_converters() -> None:
    with pytest.raises(ZeroValue):  # zero dates: NULL plus a warning, decided by the caller
        snapshot_converter("datetime")("0000-00-00 00:00:00")  # type: ignore[misc]
    assert snapshot_converter("date")(date(2024, 1, 1)) == date(2024, 1, 1)  # type: ignore[misc]
    assert snapshot_converter("timestamp")(datetime(2024, 1, 1)).tzinfo is UTC  # type: ignore[misc]
    assert snapshot_converter("bigint unsigned")(5) == Decimal(5)  # type: ignore[misc]


@pytest.mark.parametrize(("raw", "fsp", "want"), [
    # TIME2 bytes as the server's format defines them (3 integer bytes, offset 0x800000, then the fraction)
    (bytes.fromhex("80100c"), 0, timedelta(hours=1, seconds=12)),
    (bytes.fromhex("7fffff"), 0, -timedelta(seconds=1)),
    (bytes.fromhex("7fffff") + bytes.fromhex("ce"), 2, -timedelta(microseconds=500000)),
    (bytes.fromhex("4b9105f0bdc1"), 6, -timedelta(hours=838, minutes=59, seconds=58,
                                                                        microseconds=999999)),
])
def test_negative_time_decoding(raw: bytes, fsp: int, want: timedelta) -> None:
    frac_len = {0: 0, 2: 1, 6: 3}[fsp]
    assert decode_time2(raw[:3], raw[3:3 + frac_len], fsp) == want


def test_checkpoint_keys_round_trip() -> None:
    key = (1, "a", Decimal("18446744073709551615"), b"\x00\xff", datetime(2024, 1, 1, tzinfo=UTC),
           date(2024, 2, 29), timedelta(hours=-3), None)
    assert key_from_json(key_to_json(key)) == key


def test_key_order_values_follow_order_by() -> None:
    from cdcd.sources.mysql.types import key_order_expr, key_order_value
    assert key_order_expr("`e`", "enum('z','a')") == "(`e` + 0)" and key_order_expr("`i`", "int") == "`i`"
    assert key_order_value("a", "enum('z','a')") == 2 and key_order_value("z", "enum('z','a')") == 1
    assert key_order_value("", "enum('z','a')") == 0  # the error value sorts first
    assert key_order_value("x,z", "set('x','y','z')") == 5 and key_order_value("", "set('x')") == 0
    assert key_order_value(None, "date") == "0000-00-00"  # a zero date landed as NULL
    assert key_order_value(None, "datetime(6)") == "0000-00-00 00:00:00"
    assert key_order_value(7, "int") == 7
