"""A column's fill value in a manifest: every Arrow type the sources land goes to JSON and back unchanged."""

from __future__ import annotations

import json
import math
from datetime import UTC, date, datetime, time, timedelta
from decimal import Decimal
from typing import Any

import pyarrow as pa
import pytest

from cdcd.events import Column, Fill
from cdcd.landing.manifest import ColumnEntry
from cdcd.landing.values import ValueEncodingError, value_from_json, value_to_json

CASES: list[tuple[pa.DataType, Any]] = [
    (pa.bool_(), True),
    (pa.int8(), -7),
    (pa.int64(), 2**62),
    (pa.float32(), 1.5),
    (pa.float64(), -0.1),
    (pa.decimal128(14, 2), Decimal("123456789012.34")),
    (pa.string(), "new ünïcode"),
    (pa.binary(), b"\x00\xffbytes"),
    (pa.date32(), date(2026, 11, 28)),
    (pa.time64("us"), time(23, 59, 59, 999999)),
    (pa.timestamp("us"), datetime(2026, 11, 28, 10, 0, 0, 1)),
    (pa.timestamp("us", tz="UTC"), datetime(2026, 11, 28, 10, 0, 0, 1, tzinfo=UTC)),
    (pa.duration("us"), timedelta(days=2, microseconds=3)),
    (pa.list_(pa.int32()), [1, None, 3]),
    (pa.list_(pa.decimal128(5, 1)), [Decimal("1.5")]),
]


@pytest.mark.parametrize(("kind", "value"), CASES, ids=[str(k) for k, _ in CASES])
def test_a_value_goes_through_the_manifests_json_unchanged(kind: pa.DataType, value: Any) -> None:
    doc = json.loads(json.dumps(value_to_json(value, kind)))  # what a manifest on disk holds
    back = value_from_json(doc, kind)
    assert back == value and type(back) is type(value)
    assert pa.array([back], kind).to_pylist() == [value]  # the consumer builds the column from it


def test_non_finite_floats_and_null() -> None:
    for f, text in ((math.inf, "Infinity"), (-math.inf, "-Infinity")):
        assert value_to_json(f, pa.float64()) == text and value_from_json(text, pa.float64()) == f
    assert value_to_json(math.nan, pa.float64()) == "NaN" and math.isnan(value_from_json("NaN", pa.float64()))
    assert value_to_json(None, pa.decimal128(5, 2)) is None and value_from_json(None, pa.date32()) is None


def test_a_type_without_a_json_form_is_refused_with_what_to_report() -> None:
    with pytest.raises(ValueEncodingError, match="Arrow type month_day_nano_interval cannot be written"):
        value_to_json(object(), pa.month_day_nano_interval())


def test_a_column_entry_carries_id_and_fill_only_when_known() -> None:
    plain = ColumnEntry.of(Column("qty", pa.int32(), "integer"))
    assert plain.to_json() == {"name": "qty", "arrow_type": "int32", "source_type": "integer", "nullable": True}
    added = ColumnEntry.of(Column("price", pa.decimal128(10, 2), "numeric(10,2)", True, 4, Fill(Decimal("9.90"))))
    doc = added.to_json()
    assert doc["id"] == 4 and doc["fill"] == {"value": "9.90"}
    again = ColumnEntry.from_json(json.loads(json.dumps(doc)))
    assert again == added and again.fill_value(pa.decimal128(10, 2)) == Decimal("9.90")
    assert ColumnEntry.from_json(plain.to_json()).fill_value(pa.int32()) is None
