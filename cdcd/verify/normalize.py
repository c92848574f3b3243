"""One normal form for a value read from a source database or from the mirror.

Both sides of `cdcd verify` pass their values through ``normal`` so that
equal data hashes equal whatever the driver or Parquet made of it: decimals
without trailing zeros, instants in UTC, floats of 4-byte columns rounded to
float32, bytes as hex, JSON re-serialised with sorted keys, times of day and
durations as microseconds.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
import uuid
from datetime import UTC, date, datetime, time, timedelta
from decimal import Decimal
from typing import Any

_F32 = struct.Struct("f")


def _decimal(d: Decimal) -> str:
    if not d.is_finite():
        return str(d)
    text = format(d.normalize(), "f")
    return "0" if text in ("-0", "0") else text


def _float(x: float, float32: bool) -> str:
    if math.isnan(x):
        return "nan"
    if float32 and not math.isinf(x):
        x = _F32.unpack(_F32.pack(x))[0]
    return repr(x)


def normal(value: Any, float32: bool = False, is_json: bool = False) -> Any:
    """A JSON-serialisable normal form of ``value``."""
    if value is None:
        return None
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        return str(value)
    if isinstance(value, Decimal):
        return _decimal(value) if value != value.to_integral_value() or not value.is_finite() else str(int(value))
    if isinstance(value, float):
        return _float(value, float32)
    if isinstance(value, datetime):
        if value.tzinfo is not None:
            value = value.astimezone(UTC).replace(tzinfo=None)
        return value.isoformat(timespec="microseconds")
    if isinstance(value, date):
        return value.isoformat()
    if isinstance(value, time):
        return str(((value.hour * 60 + value.minute) * 60 + value.second) * 1_000_000 + value.microsecond)
    if isinstance(value, timedelta):
        return str(value // timedelta(microseconds=1))
    if isinstance(value, bytes | bytearray | memoryview):
        return "0x" + bytes(value).hex()
    if isinstance(value, uuid.UUID):
        return str(value)
    if isinstance(value, str):
        if is_json:
            try:
                return json.dumps(json.loads(value), sort_keys=True, separators=(",", ":"))
            except ValueError:
                return value
        return value
    if isinstance(value, list | tuple):
        return [normal(v, float32, is_json) for v in value]
    if isinstance(value, dict):
        return {str(k): normal(v, float32, is_json) for k, v in value.items()}
    return str(value)


def row_hash(values: list[Any]) -> str:
    return hashlib.sha256(json.dumps(values, separators=(",", ":")).encode()).hexdigest()
