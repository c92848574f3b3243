"""A single value of a landed column in a manifest's JSON (a column's ``fill``), by the column's Arrow type.

JSON's own kinds where they are exact (booleans, integers, strings, finite floats), strings where JSON has no
kind or would round (decimals, non-finite floats ``"NaN"``/``"Infinity"``/``"-Infinity"``, ISO 8601 dates,
times and date-times, binary as base64), integer microseconds for durations, JSON arrays for lists.
docs/landing-format.md, "Column identity and fills", is the reader's contract.
"""

from __future__ import annotations

import base64
import math
from datetime import date, datetime, time, timedelta
from decimal import Decimal
from typing import Any

import pyarrow as pa
import pyarrow.types as pat

from cdcd.errors import CdcdError


class ValueEncodingError(CdcdError):
    """A value that the manifest's JSON cannot carry for its column type."""


_NON_FINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def value_to_json(value: Any, kind: pa.DataType) -> Any:
    """``value`` (a Python value of Arrow type ``kind``) as JSON."""
    if value is None:
        return None
    if pat.is_list(kind) or pat.is_large_list(kind):
        return [value_to_json(v, kind.value_type) for v in value]
    if pat.is_boolean(kind) or pat.is_integer(kind) or pat.is_string(kind) or pat.is_large_string(kind):
        return value
    if pat.is_floating(kind):
        f = float(value)
        if math.isfinite(f):
            return f
        return "NaN" if math.isnan(f) else ("Infinity" if f > 0 else "-Infinity")
    if pat.is_decimal(kind):
        return str(Decimal(value))
    if pat.is_binary(kind) or pat.is_large_binary(kind) or pat.is_fixed_size_binary(kind):
        return base64.b64encode(bytes(value)).decode("ascii")
    if pat.is_date(kind) or pat.is_time(kind) or pat.is_timestamp(kind):
        return value.isoformat()
    if pat.is_duration(kind):
        return (value // timedelta(microseconds=1)) if isinstance(value, timedelta) else int(value)
    raise ValueEncodingError(f"a value of Arrow type {kind} cannot be written in a landing manifest; "
                             "report this with the column's source type")


def value_from_json(doc: Any, kind: pa.DataType) -> Any:
    """The Python value of Arrow type ``kind`` that ``value_to_json`` wrote as ``doc``."""
    if doc is None:
        return None
    if pat.is_list(kind) or pat.is_large_list(kind):
        return [value_from_json(v, kind.value_type) for v in doc]
    if pat.is_floating(kind):
        return _NON_FINITE[doc] if isinstance(doc, str) else float(doc)
    if pat.is_decimal(kind):
        return Decimal(doc)
    if pat.is_binary(kind) or pat.is_large_binary(kind) or pat.is_fixed_size_binary(kind):
        return base64.b64decode(doc)
    if pat.is_date(kind):
        return date.fromisoformat(doc)
    if pat.is_time(kind):
        return time.fromisoformat(doc)
    if pat.is_timestamp(kind):
        return datetime.fromisoformat(doc)
    if pat.is_duration(kind):
        return timedelta(microseconds=int(doc))
    return doc
