"""MySQL/MariaDB column types → Arrow types, and exact Python values.

Source types are written the way ``information_schema.COLUMNS.COLUMN_TYPE``
writes them, normalised (lower case, integer display widths and ``zerofill``
dropped): ``bigint unsigned``, ``decimal(30,10)``, ``datetime(6)``,
``enum('a','b')``, ``binary(4)``. The stream derives the same strings from
the binlog's table-map metadata, so one mapping serves snapshot and stream.

The Arrow types are chosen so that Parquet and Spark hold every value exactly
(docs/mysql.md lists them): unsigned 64-bit → decimal(20,0), decimal wider
than 38 digits → string, TIME (may be negative, up to ±838 h) → duration[us],
SET → string as MySQL prints it, BIT → binary (big-endian bytes), YEAR → int16.
"""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Callable
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from typing import Any

import pyarrow as pa

Converter = Callable[[Any], Any]

_WIDTH = re.compile(r"^(tinyint|smallint|mediumint|int|integer|bigint)\(\d+\)")
_ARGS = re.compile(r"^([a-z ]+?)\s*(?:\((.*)\))?\s*(unsigned)?\s*$", re.S)

_INTS: dict[str, tuple[pa.DataType, pa.DataType]] = {
    # name: (signed, unsigned)
    "tinyint": (pa.int8(), pa.int16()),
    "bool": (pa.int8(), pa.int16()),
    "boolean": (pa.int8(), pa.int16()),
    "smallint": (pa.int16(), pa.int32()),
    "mediumint": (pa.int32(), pa.int32()),
    "int": (pa.int32(), pa.int64()),
    "integer": (pa.int32(), pa.int64()),
    "bigint": (pa.int64(), pa.decimal128(20, 0)),
}
_STRINGS = {"char", "varchar", "tinytext", "text", "mediumtext", "longtext", "json", "enum", "set",
            "long varchar", "nchar", "nvarchar", "inet4", "inet6", "uuid"}
_BINARIES = {"binary", "varbinary", "tinyblob", "blob", "mediumblob", "longblob", "bit", "geometry", "point",
             "linestring", "polygon", "multipoint", "multilinestring", "multipolygon", "geometrycollection",
             "geomcollection"}
MAX_DECIMAL_PRECISION = 38  # Spark's DecimalType limit; wider decimals land as exact strings


def normalize_source_type(column_type: str) -> str:
    """``int(11) unsigned zerofill`` → ``int unsigned``; other types keep their arguments."""
    t = column_type.strip().lower().replace(" zerofill", "")
    t = _WIDTH.sub(r"\1", t)
    return re.sub(r"\s+", " ", t)


def split_type(source_type: str) -> tuple[str, str, bool]:
    """(base name, argument text, unsigned) of a normalised source type."""
    m = _ARGS.match(source_type)
    if m is None:
        raise ValueError(f"cannot parse the column type {source_type!r}")
    return m.group(1).strip(), m.group(2) or "", m.group(3) is not None


def type_values(args: str) -> list[str]:
    """The quoted values of ``enum('a','b')`` / ``set(...)`` arguments."""
    out: list[str] = []
    i = 0
    while i < len(args):
        if args[i] != "'":
            i += 1
            continue
        j = i + 1
        buf = []
        while j < len(args):
            if args[j] == "'" and j + 1 < len(args) and args[j + 1] == "'":
                buf.append("'")
                j += 2
                continue
            if args[j] == "'":
                break
            if args[j] == "\\" and j + 1 < len(args):
                buf.append(args[j + 1])
                j += 2
                continue
            buf.append(args[j])
            j += 1
        out.append("".join(buf))
        i = j + 1
    return out


def quote_values(values: list[str]) -> str:
    return ",".join("'" + v.replace("'", "''") + "'" for v in values)


def _int_args(args: str) -> list[int]:
    return [int(a) for a in args.split(",") if a.strip().isdigit()]


def arrow_type(source_type: str) -> pa.DataType:
    """The Arrow type a column of this source type lands as."""
    base, args, unsigned = split_type(normalize_source_type(source_type))
    if base in _INTS:
        return _INTS[base][1 if unsigned else 0]
    if base in ("decimal", "numeric", "dec", "fixed"):
        nums = _int_args(args) or [10]
        precision, scale = nums[0], (nums[1] if len(nums) > 1 else 0)
        if precision > MAX_DECIMAL_PRECISION:
            return pa.string()
        return pa.decimal128(precision, scale)
    if base == "float":
        return pa.float32()  # FLOAT(M,D) is still the 4-byte float; FLOAT(p>24) is spelled "double"
    if base in ("double", "double precision", "real"):
        return pa.float64()
    if base in _STRINGS:
        return pa.string()
    if base in _BINARIES:
        return pa.binary()
    if base == "date":
        return pa.date32()
    if base == "datetime":
        return pa.timestamp("us")
    if base == "timestamp":
        return pa.timestamp("us", tz="UTC")
    if base == "time":
        return pa.duration("us")
    if base == "year":
        return pa.int16()
    raise ValueError(f"column type {source_type!r} is not supported by cdcd's MySQL source")


def _fixed_binary_len(source_type: str) -> int | None:
    base, args, _ = split_type(source_type)
    if base == "binary":
        nums = _int_args(args)
        return nums[0] if nums else 1
    return None


def _bit_bytes(source_type: str) -> int:
    nums = _int_args(split_type(source_type)[1])
    return ((nums[0] if nums else 1) + 7) // 8


def _to_decimal_text(v: Any) -> str:
    return format(Decimal(v), "f")


def _utc(v: datetime) -> datetime:
    return v.replace(tzinfo=UTC)


def _to_bytes(v: Any) -> bytes:
    if isinstance(v, str):
        return v.encode("utf-8", "surrogateescape")
    return bytes(v)


def _to_str(v: Any) -> str:
    if type(v) is str:  # checked first: this runs for every text value streamed
        return v
    if isinstance(v, bytes | bytearray):
        return bytes(v).decode("utf-8", "replace")
    return str(v)


def stream_converter(source_type: str) -> Converter | None:
    """How a pymysqlreplication value becomes the exact landed value (None: as is)."""
    st = normalize_source_type(source_type)
    base, args, unsigned = split_type(st)
    at = arrow_type(st)
    if base == "bigint" and unsigned:
        return Decimal
    if base == "year":
        # pymysqlreplication adds 1900 to the stored byte; YEAR 0000 is stored as 0.
        return lambda v: 0 if v == 1900 else v
    if pa.types.is_string(at) and base in ("decimal", "numeric", "dec", "fixed"):
        return _to_decimal_text
    if base == "set":
        order = type_values(args)
        return lambda v: ",".join(x for x in order if x in v)
    if base == "bit":
        n = _bit_bytes(st)
        return lambda v: int(v, 2).to_bytes(n, "big") if isinstance(v, str) else _to_bytes(v)
    if base == "json":
        return lambda v: v if isinstance(v, str) else json.dumps(_jsonify(v), ensure_ascii=False)
    if base == "timestamp":
        return _utc
    if pa.types.is_binary(at):
        width = _fixed_binary_len(st)
        if width is not None:
            # the binlog drops BINARY(n)'s trailing zero padding that SELECT returns
            return lambda v: _to_bytes(v).ljust(width, b"\x00")
        return _to_bytes
    if pa.types.is_string(at):
        return _to_str
    return None


def _jsonify(v: Any) -> Any:
    """MySQL binary JSON as parsed by pymysqlreplication: bytes keys/strings → str."""
    if isinstance(v, bytes):
        return v.decode("utf-8", "replace")
    if isinstance(v, dict):
        return {_jsonify(k): _jsonify(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_jsonify(x) for x in v]
    return v


def snapshot_converter(source_type: str) -> Converter | None:
    """How an aiomysql/PyMySQL value (session time zone UTC) becomes the landed value."""
    st = normalize_source_type(source_type)
    base, _, unsigned = split_type(st)
    at = arrow_type(st)
    if base == "bigint" and unsigned:
        return Decimal
    if pa.types.is_string(at) and base in ("decimal", "numeric", "dec", "fixed"):
        return _to_decimal_text
    if base == "timestamp":
        return lambda v: _utc(v) if isinstance(v, datetime) else None  # zero dates arrive as text
    if base in ("datetime", "date"):
        return lambda v: v if isinstance(v, date) else None
    if pa.types.is_binary(at):
        return _to_bytes
    if pa.types.is_string(at):
        return _to_str
    return None


# --- JSON-safe encoding of key values for the checkpoint (snapshot progress) ---

def key_to_json(values: tuple[Any, ...]) -> list[Any]:
    out: list[Any] = []
    for v in values:
        if v is None or isinstance(v, bool | int | float | str):
            out.append(v)
        elif isinstance(v, Decimal):
            out.append({"d": str(v)})
        elif isinstance(v, bytes | bytearray):
            out.append({"b": base64.b64encode(bytes(v)).decode()})
        elif isinstance(v, datetime):
            out.append({"ts": v.isoformat()})
        elif isinstance(v, date):
            out.append({"date": v.isoformat()})
        elif isinstance(v, timedelta):
            out.append({"us": v // timedelta(microseconds=1)})
        else:
            raise TypeError(f"cannot store a key value of type {type(v).__name__} in the checkpoint")
    return out


def key_from_json(values: list[Any]) -> tuple[Any, ...]:
    out: list[Any] = []
    for v in values:
        if not isinstance(v, dict):
            out.append(v)
        elif "d" in v:
            out.append(Decimal(v["d"]))
        elif "b" in v:
            out.append(base64.b64decode(v["b"]))
        elif "ts" in v:
            out.append(datetime.fromisoformat(v["ts"]))
        elif "date" in v:
            out.append(date.fromisoformat(v["date"]))
        elif "us" in v:
            out.append(timedelta(microseconds=v["us"]))
        else:
            raise ValueError(f"unknown key encoding {v!r}")
    return tuple(out)


def to_query_param(v: Any) -> Any:
    """A key value as a query parameter for ``WHERE key > %s`` (timestamps back to naive UTC)."""
    if isinstance(v, datetime) and v.tzinfo is not None:
        return v.astimezone(UTC).replace(tzinfo=None)
    return v
