"""The value the rows a table already has take in a column ``ALTER TABLE ... ADD`` adds: its ``Fill``.

The servers do not rewrite those rows (MariaDB and MySQL 8 add a column instantly, and even a table copy
logs no row events), so no change event carries the value: the DDL does. A constant DEFAULT (or, for a NOT
NULL column without one, the type's implicit default: 0, '', the first ENUM label) is converted here to
the landed value, the Python value of the column's Arrow type that the stream would give the same value
(``types.py``'s converters). A default that is not a constant (``CURRENT_TIMESTAMP``, an expression,
AUTO_INCREMENT, a generated column) gives each row its own value: no fill, and ``column_fill`` says why
(the source then reads the table again: ``source.py``, docs/mysql.md, "Schema changes").
"""

from __future__ import annotations

import ipaddress
import json
import re
import struct
import uuid
from datetime import date, datetime, timedelta
from decimal import ROUND_HALF_UP, Decimal, InvalidOperation
from typing import Any

import pyarrow as pa

from cdcd.events import Fill
from cdcd.sources.mysql.ddl import ColumnDef
from cdcd.sources.mysql.ddllex import Default
from cdcd.sources.mysql.types import (
    MAX_DECIMAL_PRECISION,
    arrow_type,
    inet6_text,
    split_type,
    type_values,
)

_TIME = re.compile(r"^(-)?(?:(\d+) )?(\d+)(?::(\d+))?(?::(\d+))?(?:\.(\d{1,6})\d*)?$")


def column_fill(col: ColumnDef, flavor: str = "mariadb") -> tuple[Fill | None, str]:
    """(the fill, "") or (None, why the existing rows' value is unknown; "" when they hold NULL). ``flavor``:
    MySQL keeps JSON in its binary form (the stream lands it re-printed), MariaDB as the text given."""
    if col.generated:
        return None, "a generated column: each row holds its own value"
    if col.auto_increment:
        return None, "an AUTO_INCREMENT column: the server numbered the existing rows"
    default = col.default
    if default is None:
        if col.nullable:
            return None, ""
        default = Default("implicit")
    if default.kind == "null":
        return None, ""
    if default.kind == "expression":
        return None, f"DEFAULT {default.text} is not a constant"
    if split_type(col.source_type)[0] == "timestamp":
        return None, ("a TIMESTAMP default is read in the session time zone of the ALTER (or is CURRENT_TIMESTAMP "
                      "under explicit_defaults_for_timestamp = OFF), which the binlog does not say")
    try:
        value = default_value(default, col.source_type, col.type_text, flavor)
    except (ValueError, InvalidOperation, OverflowError) as exc:
        return None, f"DEFAULT cannot be read as {col.source_type}: {exc}"
    return (None, "") if value is None else (Fill(value), "")


def _number(default: Default) -> Decimal:
    """A literal in a numeric context, as the server reads it."""
    if default.kind in ("hex", "bits"):
        return Decimal(int.from_bytes(default.data, "big"))
    if default.kind == "implicit":
        return Decimal(0)
    text = default.text.strip()
    m = re.match(r"^[+-]?(\d+\.?\d*(e[+-]?\d+)?|\.\d+(e[+-]?\d+)?)", text, re.I)
    return Decimal(m.group()) if m else Decimal(0)  # '12abc' is 12, 'abc' is 0 (non-strict conversion)


def _text(default: Default) -> str:
    if default.kind in ("hex", "bits"):
        return default.data.decode("utf-8", "replace")
    return "" if default.kind == "implicit" else default.text


def default_value(default: Default, source_type: str, type_text: str = "", flavor: str = "mariadb") -> Any:
    """The landed value (of the column's Arrow type) of a constant default; None where the value lands NULL.
    ``type_text``: the type as written, whose ENUM and SET labels keep their case."""
    base, args, unsigned = split_type(source_type)
    at = arrow_type(source_type)
    if base in ("decimal", "numeric", "dec", "fixed"):
        nums = [int(a) for a in args.split(",") if a.strip().isdigit()] or [10]
        scale = nums[1] if len(nums) > 1 else 0
        d = _number(default).quantize(Decimal(1).scaleb(-scale), ROUND_HALF_UP)
        return format(d, "f") if nums[0] > MAX_DECIMAL_PRECISION else d
    if pa.types.is_integer(at) or (base == "bigint" and unsigned):
        n = int(_number(default).to_integral_value(ROUND_HALF_UP))
        if base == "year":
            return _year(n, default.kind == "string")
        return Decimal(n) if pa.types.is_decimal(at) else n
    if pa.types.is_floating(at):
        f = float(_number(default))
        return struct.unpack("<f", struct.pack("<f", f))[0] if pa.types.is_float32(at) else f
    if base == "bit":
        n = int(_number(default))
        width = ((int(args) if args.strip().isdigit() else 1) + 7) // 8
        return n.to_bytes(width, "big")
    if pa.types.is_binary(at):
        data = default.data if default.kind in ("hex", "bits") else _text(default).encode("utf-8")
        if base == "binary":
            return data.ljust(int(args) if args.strip().isdigit() else 1, b"\x00")
        return data
    if base in ("date", "datetime"):
        return _temporal(_text(default), base, args)
    if base == "time":
        return _time(_text(default), args)
    if base in ("enum", "set") and "(" in type_text:
        args = type_text[type_text.index("(") + 1:type_text.rindex(")")]
    return _string(default, base, args, flavor)


def _string(default: Default, base: str, args: str, flavor: str) -> Any:
    text = _text(default)
    if base == "enum":
        labels = type_values(args)
        if default.kind == "implicit":
            return labels[0] if labels else None
        for label in labels:
            if label.lower() == text.lower():
                return label
        raise ValueError(f"{text!r} is not one of the ENUM's labels")
    if base == "set":
        labels = type_values(args)
        wanted = {v.lower() for v in text.split(",") if v}
        return ",".join(x for x in labels if x.lower() in wanted)
    if base in ("char", "nchar"):
        return text.rstrip(" ")  # CHAR values are read without their trailing spaces
    if base == "uuid":
        return str(uuid.UUID(text))
    if base == "inet6":
        return inet6_text(ipaddress.IPv6Address(text).packed)
    if base == "inet4":
        return str(ipaddress.IPv4Address(text))
    if base == "json" and flavor == "mysql":
        return json.dumps(_json_order(json.loads(text)), ensure_ascii=False)
    return text


def _json_order(v: Any) -> Any:
    """Object keys in the order MySQL's binary JSON keeps them (by length, then bytes), as the stream lands them."""
    if isinstance(v, dict):
        return {k: _json_order(v[k]) for k in sorted(v, key=lambda k: (len(k.encode()), k.encode()))}
    if isinstance(v, list):
        return [_json_order(x) for x in v]
    return v


def _year(n: int, from_string: bool) -> int | None:
    if n == 0 and not from_string:
        return 0
    if 0 <= n < 70:
        return 2000 + n
    if 70 <= n < 100:
        return 1900 + n
    return n


def _fsp(args: str) -> int:
    return int(args) if args.strip().isdigit() else 0


def _round_us(us: int, fsp: int) -> int:
    step = int(10 ** (6 - min(fsp, 6)))
    return (us + step // 2) // step * step


def _temporal(text: str, base: str, args: str) -> date | datetime | None:
    text = text.strip()
    if not text:
        return None  # the implicit default of a NOT NULL DATE/DATETIME is the zero date: it lands NULL
    if base == "date":
        if text.startswith("0000") or "-00" in text[:10]:
            return None  # a zero date lands NULL (types.ZeroValue)
        return date.fromisoformat(text[:10])
    if text.startswith("0000") or "-00" in text[:10]:
        return None
    value = datetime.fromisoformat(text.replace(" ", "T", 1)) if len(text) > 10 else datetime.fromisoformat(text)
    us = _round_us(value.microsecond, _fsp(args))
    return value.replace(microsecond=0) + timedelta(microseconds=us)


def _time(text: str, args: str) -> timedelta:
    m = _TIME.match(text.strip())
    if m is None:
        raise ValueError(f"{text!r} is not a TIME value")
    sign, days, h, mi, s, frac = m.groups()
    if mi is None and days is None:  # a bare number: [H]HMMSS
        n = int(h)
        h, mi, s = str(n // 10000), str(n // 100 % 100), str(n % 100)
    us = _round_us(int((frac or "0").ljust(6, "0")), _fsp(args))
    value = timedelta(days=int(days or 0), hours=int(h), minutes=int(mi or 0), seconds=int(s or 0),
                      microseconds=us)
    return -value if sign else value
