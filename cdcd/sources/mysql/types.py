"""MySQL/MariaDB column types → Arrow types, and exact Python values.

Source types are written the way ``information_schema.COLUMNS.COLUMN_TYPE``
writes them, normalised (lower case, integer display widths and ``zerofill``
dropped): ``bigint unsigned``, ``decimal(30,10)``, ``datetime(6)``,
``enum('a','b')``, ``binary(4)``. The stream derives the same strings from
the binlog's table-map metadata, so one mapping serves snapshot and stream.

The Arrow types are chosen so that Parquet and Spark hold every value exactly
(docs/mysql.md lists them): unsigned 64-bit → decimal(20,0), decimal wider
than 38 digits → string, TIME (may be negative, up to ±838 h) → duration[us],
SET → string as MySQL prints it, BIT → binary (big-endian bytes), YEAR → int16,
MariaDB's UUID / INET6 / INET4 → string in the server's own text form (the binlog
carries their 16/4 stored bytes; the stream formats them as the server prints
them). Zero dates (``0000-00-00``, zero month or day, the zero TIMESTAMP), year 0 and days the
month does not have (``ALLOW_INVALID_DATES``) land NULL on every path, with one warning per column
(``ZeroValue``).
A type this module does not know lands as text with a warning.
"""

from __future__ import annotations

import base64
import ipaddress
import json
import re
from collections.abc import Callable
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from typing import Any

import pyarrow as pa
import structlog

log = structlog.get_logger("cdcd.source.mysql")

Converter = Callable[[Any], Any]

_WIDTH = re.compile(r"^(tinyint|smallint|mediumint|int|integer|bigint)\(\d+\)")
_ARGS = re.compile(r"^([a-z][a-z0-9 ]*?)\s*(?:\((.*)\))?\s*(unsigned)?\s*$", re.S)

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
_TEMPORAL = {"date", "datetime", "timestamp", "time", "year"}
_FLOATS = {"float", "double", "double precision", "real"}
MAX_DECIMAL_PRECISION = 38  # Spark's DecimalType limit; wider decimals land as exact strings
_EPOCH = datetime(1970, 1, 1)

ZERO_DATE = "zero date has no value in Arrow: landed as NULL"
UNKNOWN_TYPE = "unknown MySQL/MariaDB type: landed as text"


class ZeroValue(ValueError):
    """A zero date / datetime / TIMESTAMP (or one with a zero month or day): landed as NULL with a warning."""


_warned: set[tuple[str, str, str]] = set()


def warn_once(table: Any, column: str, reason: str, **kw: Any) -> None:
    """One warning per (table, column, reason) for the process: a bad value must not flood the log."""
    key = (str(table), column, reason)
    if key not in _warned:
        _warned.add(key)
        log.warning(reason, table=str(table), column=column, **kw)


_COMMENT = re.compile(r"/\*[^*]*\*/\s*$")  # trailing only: an ENUM label may hold "/*"


def normalize_source_type(column_type: str) -> str:
    """``int(11) unsigned zerofill`` → ``int unsigned``; other types keep their arguments. MariaDB's comments
    are dropped (``datetime /* mariadb-5.3 */``: a column in the storage format before MySQL 5.6's)."""
    t = _COMMENT.sub(" ", column_type).strip().lower().replace(" zerofill", "")
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
    return pa.string()  # an unknown type: its text (is_known_type tells the caller to warn)


def is_known_type(source_type: str) -> bool:
    """False for a type ``arrow_type`` only lands as text because it does not know it."""
    base = split_type(normalize_source_type(source_type))[0]
    return (base in _INTS or base in _STRINGS or base in _BINARIES or base in _TEMPORAL or base in _FLOATS
            or base in ("decimal", "numeric", "dec", "fixed"))


def is_float4(source_type: str) -> bool:
    """FLOAT (4 bytes): the snapshot reads it as DOUBLE, the text protocol would round it to 6 digits."""
    return split_type(normalize_source_type(source_type))[0] == "float"


def is_temporal_key(source_type: str) -> bool:
    """DATE / DATETIME / TIMESTAMP: a zero date in such a key lands as NULL, the resume key keeps its text."""
    return split_type(normalize_source_type(source_type))[0] in ("date", "datetime", "timestamp")


def key_order_expr(quoted: str, source_type: str) -> str:
    """The expression keyset conditions compare for a key column: what ``ORDER BY`` sorts by.

    ENUM and SET sort by their number (definition order, bit mask), but compare as strings
    with a string constant; comparing ``col + 0`` with the number keeps both in one order.
    """
    base = split_type(normalize_source_type(source_type))[0]
    return f"({quoted} + 0)" if base in ("enum", "set") else quoted


def key_order_value(value: Any, source_type: str) -> Any:
    """A key value as ``key_order_expr`` compares it (ENUM/SET text → its number)."""
    base, args, _ = split_type(normalize_source_type(source_type))
    if value is None and base in ("date", "datetime", "timestamp"):
        # a key column is never NULL: a landed NULL in a checkpointed key is a zero date
        return "0000-00-00" if base == "date" else "0000-00-00 00:00:00"
    if base == "enum" and isinstance(value, str):
        labels = [v.lower() for v in type_values(args)]
        return labels.index(value.lower()) + 1 if value else 0  # '' is the error value, number 0
    if base == "set" and isinstance(value, str):
        labels = [v.lower() for v in type_values(args)]
        return sum(1 << labels.index(v.lower()) for v in value.split(",") if v)
    return value


def _stored(v: Any, width: int) -> bytes:
    # the binlog drops a fixed-width binary value's trailing zero bytes
    return _to_bytes(v).ljust(width, b"\x00")


def uuid_text(v: Any) -> str:
    """MariaDB UUID: the binlog's 16 bytes → the server's text form (lower-case 8-4-4-4-12)."""
    if isinstance(v, str) and v:  # the snapshot's text ('' from the stream is all zero bytes)
        return v
    h = _stored(v, 16).hex()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def inet4_text(v: Any) -> str:
    if isinstance(v, str) and v:
        return v
    return str(ipaddress.IPv4Address(_stored(v, 4)))


def inet6_text(v: Any) -> str:
    """MariaDB INET6: 16 bytes → the server's text form.

    The server's algorithm (MySQL's INET6_NTOA): the longest run of zero words (the first of equal
    ones, even a single word) becomes ``::``; an address whose first six words are the run (and the
    seventh is not zero) prints its last 32 bits dotted (``::1.2.3.4``), as does ``::ffff:`` + IPv4.
    """
    if isinstance(v, str) and v:
        return v
    b = _stored(v, 16)
    words = [int.from_bytes(b[i:i + 2], "big") for i in range(0, 16, 2)]
    gap_pos, gap_len, run_pos, run_len = -1, 0, -1, 0
    for i, w in enumerate([*words, 1]):  # a sentinel closes a run at the end
        if w == 0:
            run_pos, run_len = (run_pos, run_len + 1) if run_pos >= 0 else (i, 1)
        elif run_pos >= 0:
            if run_len > gap_len:
                gap_pos, gap_len = run_pos, run_len
            run_pos, run_len = -1, 0
    out = ""
    i = 0
    while i < 8:
        if i == gap_pos:
            out += "::" if i == 0 else ":"
            i += gap_len
            continue
        if i == 6 and gap_pos == 0 and (gap_len == 6 or (gap_len == 5 and words[5] == 0xFFFF)):
            return out + str(ipaddress.IPv4Address(b[12:]))
        out += f"{words[i]:x}" + (":" if i < 7 else "")
        i += 1
    return out


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
    if base == "uuid":
        return uuid_text
    if base == "inet6":
        return inet6_text
    if base == "inet4":
        return inet4_text
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
        return _stream_timestamp
    if pa.types.is_binary(at):
        width = _fixed_binary_len(st)
        if width is not None:
            # the binlog drops BINARY(n)'s trailing zero padding that SELECT returns
            return lambda v: _to_bytes(v).ljust(width, b"\x00")
        return _to_bytes
    if pa.types.is_string(at):
        return _to_str
    return None


def _stream_timestamp(v: datetime) -> datetime:
    # The binlog stores the zero TIMESTAMP as 0 seconds; 1970-01-01 00:00:00 UTC itself is outside
    # TIMESTAMP's range (it starts one second later), so 0 is always the zero value.
    if v == _EPOCH:
        raise ZeroValue("zero TIMESTAMP")
    return _utc(v)


def _zero_date(v: Any) -> Any:
    # The text protocol hands zero dates (and zero months/days) over as strings.
    raise ZeroValue(f"zero date {v!r}")


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
        return lambda v: _utc(v) if isinstance(v, datetime) else _zero_date(v)  # zero dates arrive as text
    if base in ("datetime", "date"):
        return lambda v: v if isinstance(v, date) else _zero_date(v)
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
