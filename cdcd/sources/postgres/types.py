"""PostgreSQL types: the Arrow type of each column and text value → Python value.

pgoutput sends values in the type's text output form. The replication and
snapshot sessions both run with ``TimeZone=UTC, DateStyle=ISO,
IntervalStyle=iso_8601, extra_float_digits=3, bytea_output=hex`` so one
converter per type serves both, and a snapshot row equals the streamed row.

Choices for types Parquet/Spark cannot hold natively (documented in
docs/postgres.md): interval, timetz, uuid, unconstrained numeric and
numeric wider than 38 digits are strings in PostgreSQL's canonical text
form; enums are strings; domains are their base type; unknown types are
strings (the caller warns once per column).
"""

from __future__ import annotations

import struct
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, time
from decimal import Decimal, InvalidOperation
from typing import Any

import pyarrow as pa

SESSION_SETTINGS = {
    "TimeZone": "UTC",
    "DateStyle": "ISO, YMD",
    "IntervalStyle": "iso_8601",
    "extra_float_digits": "3",
    "bytea_output": "hex",
    "client_encoding": "UTF8",
}


class Unrepresentable(ValueError):
    """A value the column's Arrow type cannot hold (NaN in numeric(p,s), a BC date)."""


@dataclass(frozen=True, slots=True)
class PgType:
    """What the catalog says about a type (pg_type)."""

    oid: int
    name: str
    kind: str = "b"  # typtype: b(ase), e(num), d(omain), c(omposite), r(ange), m(ultirange), p(seudo)
    elem: int = 0  # element type of an array type
    base: int = 0  # base type of a domain
    base_typmod: int = -1
    ndims: int = 0  # declared array dimensions of a domain over an array


# name, oid, array oid
_BUILTIN = [
    ("bool", 16, 1000), ("bytea", 17, 1001), ("char", 18, 1002), ("name", 19, 1003), ("int8", 20, 1016),
    ("int2", 21, 1005), ("int4", 23, 1007), ("text", 25, 1009), ("oid", 26, 1028), ("json", 114, 199),
    ("xml", 142, 143), ("float4", 700, 1021), ("float8", 701, 1022), ("money", 790, 791),
    ("macaddr", 829, 1040), ("inet", 869, 1041), ("cidr", 650, 651), ("bpchar", 1042, 1014),
    ("varchar", 1043, 1015), ("date", 1082, 1182), ("time", 1083, 1183), ("timestamp", 1114, 1115),
    ("timestamptz", 1184, 1185), ("interval", 1186, 1187), ("timetz", 1266, 1270), ("bit", 1560, 1561),
    ("varbit", 1562, 1563), ("numeric", 1700, 1231), ("uuid", 2950, 2951), ("jsonb", 3802, 3807),
    ("tsvector", 3614, 3643), ("macaddr8", 774, 775), ("pg_lsn", 3220, 3221), ("int2vector", 22, 1006),
    ("oidvector", 30, 1013), ("point", 600, 1017), ("line", 628, 629), ("lseg", 601, 1018), ("box", 603, 1020),
    ("path", 602, 1019), ("polygon", 604, 1027), ("circle", 718, 719), ("tsquery", 3615, 3645),
]

# Types that are text by nature: strings without a warning.
_TEXTUAL = {
    "text", "varchar", "bpchar", "name", "char", "xml", "money", "macaddr", "macaddr8", "inet", "cidr", "bit",
    "varbit", "tsvector", "tsquery", "pg_lsn", "point", "line", "lseg", "box", "path", "polygon", "circle",
    "int2vector", "oidvector", "json", "jsonb", "uuid", "interval", "timetz",
}

#: Types whose asyncpg (binary) decoding already equals our converter's result; the
#: snapshot selects them directly. Every other type is read in its text output form.
DRIVER_NATIVE = {"bool", "int2", "int4", "int8", "oid", "float4", "float8", "text", "varchar", "bpchar", "name",
                 "bytea", "date", "timestamp", "timestamptz", "uuid", "json", "jsonb"}

_F32 = struct.Struct("f")
_PG_SPACE = " \t\n\r\v\f"  # what array_out quotes (array_isspace), nothing more


def _bool(text: str) -> bool:
    return text in ("t", "true")


def _float4(text: str) -> float:
    # Round through float32 so the streamed value equals what a binary read returns.
    return float(_F32.unpack(_F32.pack(float(text)))[0])


def _bytea(text: str) -> bytes:
    if text.startswith("\\x"):
        return bytes.fromhex(text[2:])
    raise Unrepresentable(f"bytea value not in hex form: {text[:20]!r}")


def _date(text: str) -> date:
    if text == "infinity":
        return date.max
    if text == "-infinity":
        return date.min
    try:
        return date.fromisoformat(text)
    except ValueError as exc:
        raise Unrepresentable(f"date {text!r} is outside the range Python/Arrow can hold") from exc


def _time(text: str) -> time:
    if text.startswith("24:00:00"):
        return time.max
    return time.fromisoformat(text)


def _timestamp(text: str) -> datetime:
    if text == "infinity":
        return datetime.max
    if text == "-infinity":
        return datetime.min
    try:
        return datetime.fromisoformat(text)
    except ValueError as exc:
        raise Unrepresentable(f"timestamp {text!r} is outside the range Python/Arrow can hold") from exc


def _timestamptz(text: str) -> datetime:
    if text == "infinity":
        return datetime.max.replace(tzinfo=UTC)
    if text == "-infinity":
        return datetime.min.replace(tzinfo=UTC)
    try:
        return datetime.fromisoformat(text).astimezone(UTC)
    except (ValueError, OverflowError) as exc:
        raise Unrepresentable(f"timestamptz {text!r} is outside the range Python/Arrow can hold") from exc


def _decimal(text: str) -> Decimal:
    try:
        value = Decimal(text)
    except InvalidOperation as exc:
        raise Unrepresentable(f"numeric {text!r}") from exc
    if not value.is_finite():
        raise Unrepresentable(f"numeric {text} cannot be stored in a decimal column")
    return value


def _text(text: str) -> str:
    return text


def _identity(value: Any) -> Any:
    return value


def _tz_from_driver(value: Any) -> Any:
    # asyncpg returns ±infinity of timestamptz as naive datetime.max/min.
    if isinstance(value, datetime) and value.tzinfo is None:
        return value.replace(tzinfo=UTC)
    return value


def _uuid_from_driver(value: Any) -> Any:
    return str(value) if isinstance(value, uuid.UUID) else value


def parse_array(text: str) -> list[Any]:
    """Parse an array literal (``{1,NULL,"a b"}``, nested, optional ``[1:2]=`` bounds) into lists of str/None."""
    pos = 0
    if text.startswith("["):
        pos = text.index("=") + 1
    if text[pos] != "{":
        raise Unrepresentable(f"array literal {text[:40]!r} does not start with '{{'")
    value, _ = _parse_array_at(text, pos)
    return value


def _parse_array_at(text: str, pos: int) -> tuple[list[Any], int]:
    # text[pos] == "{"
    out: list[Any] = []
    pos += 1
    if text[pos] == "}":
        return out, pos + 1
    while True:
        ch = text[pos]
        if ch == "{":
            sub, pos = _parse_array_at(text, pos)
            out.append(sub)
        elif ch == '"':
            buf: list[str] = []
            pos += 1
            while text[pos] != '"':
                if text[pos] == "\\":
                    pos += 1
                buf.append(text[pos])
                pos += 1
            pos += 1
            out.append("".join(buf))
        else:
            start = pos
            while text[pos] not in ",}":
                pos += 1
            word = text[start:pos].strip(_PG_SPACE)  # str.strip() would also eat \x1f, \xa0 and the like
            out.append(None if word.upper() == "NULL" else word)
        if text[pos] == "}":
            return out, pos + 1
        pos += 1  # the comma


@dataclass(frozen=True, slots=True)
class ColumnType:
    """How one column is landed: Arrow type, converter from text, and from the snapshot driver."""

    arrow: pa.DataType
    source_type: str
    from_text: Callable[[str], Any]
    from_driver: Callable[[Any], Any] = _identity
    driver_native: bool = False  # the snapshot may select the column without a text cast
    known: bool = True  # False: an unknown type landed as text (warn once)
    extra: dict[str, Any] = field(default_factory=dict)


def _numeric_type(typmod: int) -> ColumnType:
    if typmod < 4:
        return ColumnType(pa.string(), "numeric", _text)
    precision, scale = ((typmod - 4) >> 16) & 0xFFFF, (typmod - 4) & 0x7FF
    if scale & 0x400:  # PostgreSQL 15 allows negative scales (11-bit two's complement)
        scale -= 0x800
    name = f"numeric({precision},{scale})"
    if precision > 38 or scale < 0 or scale > precision:
        return ColumnType(pa.string(), name, _text)
    return ColumnType(pa.decimal128(precision, scale), name, _decimal)


def _char_name(name: str, typmod: int) -> str:
    return f"{name}({typmod - 4})" if typmod >= 4 else name


_SIMPLE: dict[str, tuple[pa.DataType, Callable[[str], Any]]] = {
    "bool": (pa.bool_(), _bool),
    "int2": (pa.int16(), int),
    "int4": (pa.int32(), int),
    "int8": (pa.int64(), int),
    "oid": (pa.int64(), int),
    "float4": (pa.float32(), _float4),
    "float8": (pa.float64(), float),
    "bytea": (pa.binary(), _bytea),
    "date": (pa.date32(), _date),
    "time": (pa.time64("us"), _time),
    "timestamp": (pa.timestamp("us"), _timestamp),
    "timestamptz": (pa.timestamp("us", tz="UTC"), _timestamptz),
}


class TypeRegistry:
    """Built-in types plus whatever the catalog told us (enums, domains, their arrays)."""

    def __init__(self) -> None:
        self._types: dict[int, PgType] = {}
        for name, oid, array_oid in _BUILTIN:
            self._types[oid] = PgType(oid, name)
            self._types[array_oid] = PgType(array_oid, "_" + name, elem=oid)

    def add(self, t: PgType) -> None:
        self._types[t.oid] = t

    def __contains__(self, oid: int) -> bool:
        return oid in self._types

    def missing(self, oids: set[int]) -> set[int]:
        """OIDs the catalog must be asked about (unknown ones, and the parts of known composites)."""
        out: set[int] = set()
        todo = set(oids)
        while todo:
            oid = todo.pop()
            t = self._types.get(oid)
            if t is None:
                out.add(oid)
            elif t.elem and t.elem not in self._types:
                out.add(t.elem)
            elif t.base and t.base not in self._types:
                out.add(t.base)
        return out

    def column_type(self, oid: int, typmod: int = -1, ndims: int = 1) -> ColumnType:
        t = self._types.get(oid)
        if t is None:
            return ColumnType(pa.string(), f"oid:{oid}", _text, known=False)
        if t.kind == "d" and t.base:
            inner = self.column_type(t.base, t.base_typmod, t.ndims or ndims)
            return ColumnType(inner.arrow, f"{t.name}({inner.source_type})", inner.from_text, inner.from_driver,
                              inner.driver_native, inner.known)
        if t.elem:
            return self._array(t, typmod, max(ndims, 1))
        if t.kind == "e":
            return ColumnType(pa.string(), t.name, _text)
        name = t.name
        if name == "numeric":
            return _numeric_type(typmod)
        if name in _SIMPLE:
            arrow, conv = _SIMPLE[name]
            from_driver = _tz_from_driver if name == "timestamptz" else _identity
            return ColumnType(arrow, name, conv, from_driver, driver_native=name in DRIVER_NATIVE)
        if name == "uuid":
            return ColumnType(pa.string(), name, _text, _uuid_from_driver, driver_native=True)
        if name in _TEXTUAL:
            return ColumnType(pa.string(), _char_name(name, typmod), _text, driver_native=name in DRIVER_NATIVE)
        return ColumnType(pa.string(), name, _text, known=False)

    def _array(self, t: PgType, typmod: int, ndims: int) -> ColumnType:
        elem = self.column_type(t.elem, typmod, 1)
        arrow = elem.arrow
        for _ in range(ndims):
            arrow = pa.list_(arrow)
        conv = elem.from_text

        def convert(value: Any) -> Any:
            if isinstance(value, list):
                return [convert(v) for v in value]
            return None if value is None else conv(value)

        def from_text(text: str) -> list[Any]:
            return convert(parse_array(text))  # type: ignore[no-any-return]

        return ColumnType(arrow, elem.source_type + "[]" * ndims, from_text, known=elem.known)


def key_text(value: Any) -> str:
    """A key value in a form PostgreSQL parses back to the same value (snapshot resume)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, bytes):
        return "\\x" + value.hex()
    if isinstance(value, datetime | date | time):
        return value.isoformat()
    if isinstance(value, float):
        return repr(value)
    return str(value)
