"""How each column of a row image is read: the per-column plans that ``rowimage.py`` compiles into readers.

``column_plan`` gives, for one column of a table map, the source lines that read its non-NULL value from the
packet (``b`` at offset ``p``) into ``v{i}`` and the values those lines use, exactly as pymysqlreplication
decodes it (``rowimage.py``'s module doc); ``columnar_plan`` the faster raw forms the columnar readers take
for TIMESTAMP, DECIMAL and UTF-8 text (``columnar.py`` converts them). A column type not decoded here raises
``Unsupported``: the table falls back to pymysqlreplication.
"""

from __future__ import annotations

import codecs
import struct
from collections.abc import Callable
from dataclasses import dataclass
from datetime import date, datetime, timedelta
from decimal import Decimal
from typing import Any

from pymysqlreplication import row_event as rows
from pymysqlreplication.constants import FIELD_TYPE, NONE_SOURCE

from cdcd.sources.mysql.compat import decode_time2

_FRAC_BYTES = (0, 1, 1, 2, 2, 3, 3)  # fractional-second bytes per fsp 0..6
_DIG2BYTES = (0, 1, 1, 2, 2, 3, 3, 4, 4, 4)  # bytes of a packed decimal group of n < 9 digits
_EPOCH = datetime(1970, 1, 1)


# ------------------------------------------------------------------ value helpers (called from generated code)

def _date(t: int) -> date | None:
    """DATE: 3 bytes little-endian, day | month << 5 | year << 9; zero parts are the zero date (None), and so is
    a day the month does not have (``ALLOW_INVALID_DATES`` stores ``2024-02-31``): NULL with the warning."""
    year, month, day = (t >> 9) & 0x7FFF, (t >> 5) & 0xF, t & 0x1F
    if not (year and month and day):
        return None
    try:
        return date(year, month, day)
    except ValueError:
        return None


def _time2_reader(fsp: int) -> Callable[[bytes, int], timedelta]:
    n = _FRAC_BYTES[fsp]

    def read(b: bytes, p: int) -> timedelta:
        return decode_time2(b[p:p + 3], b[p + 3:p + 3 + n], fsp)

    return read


def _decimal_groups(digits: int, full_first: bool) -> list[tuple[int, int]]:
    """(bytes, 10**digits) of the packed groups of one side of the point, in order: 9 digits per 4 bytes,
    the leftover digits in fewer bytes before the integer part's groups and after the fraction's."""
    full, rem = divmod(digits, 9)
    groups = [(4, 10 ** 9)] * full
    if rem:
        groups.insert(len(groups) if full_first else 0, (_DIG2BYTES[rem], 10 ** rem))
    return groups


def _decimal_reader(precision: int, scale: int) -> tuple[Callable[[bytes, int], Decimal], int]:
    """Packed DECIMAL (MySQL ``decimal2bin``): big-endian groups, the first bit is the sign (1 = positive),
    negative values have every bit inverted. The Decimal keeps ``scale`` digits after the point, as
    pymysqlreplication's does; a group holding more digits than it may is an error, never a value."""
    int_groups, frac_groups = _decimal_groups(precision - scale, False), _decimal_groups(scale, True)
    size = sum(n for n, _ in int_groups + frac_groups)
    sign_bit = 1 << (8 * size - 1)
    flip_neg = ((1 << (8 * size)) - 1) ^ sign_bit

    def split(groups: list[tuple[int, int]], shift: int) -> list[tuple[int, int, int]]:
        out = []
        for n, limit in groups:
            shift -= 8 * n
            out.append((shift, (1 << (8 * n)) - 1, limit))
        return out

    ints = split(int_groups, 8 * size)
    fracs = split(frac_groups, ints[-1][0] if ints else 8 * size)

    def digits(x: int, groups: list[tuple[int, int, int]]) -> int:
        v = 0
        for shift, mask, limit in groups:
            g = x >> shift & mask
            if g >= limit:
                raise ValueError(f"a DECIMAL({precision},{scale}) group holds {g}, more digits than it may")
            v = v * limit + g
        return v

    def read(b: bytes, p: int) -> Decimal:
        x = int.from_bytes(b[p:p + size], "big")
        neg = not x & sign_bit
        x ^= flip_neg if neg else sign_bit
        text = f"{'-' if neg else ''}{digits(x, ints)}"
        if scale:
            text += f".{digits(x, fracs):0{scale}d}"
        return Decimal(text)

    return read, size


def _set_reader(labels: tuple[str, ...]) -> Callable[[int], set[str] | None]:
    def read(bits: int) -> set[str] | None:
        members = {v for i, v in enumerate(labels) if bits >> i & 1}
        return members or None  # pymysqlreplication: an empty set is None ("empty set")

    return read


def _bit_reader(bits: int) -> Callable[[int], str]:
    """BIT(n) as pymysqlreplication gives it: n characters '0'/'1', most significant first."""
    mask = (1 << bits) - 1
    spec = f"0{bits}b"
    return lambda x: format(x & mask, spec)


# ------------------------------------------------------------------ per-column code generation

@dataclass(frozen=True)
class Col:
    """How to read one column: source lines for the non-NULL case and the names they use."""

    name: str
    lines: tuple[str, ...]  # read from b at p into v{i}, advance p; may set s[K{i}] when the value is None
    consts: tuple[tuple[str, Any], ...]  # the globals the lines use; {i} becomes the column's index


_STRUCTS = {fmt: struct.Struct(fmt).unpack_from for fmt in ("<b", "<B", "<h", "<H", "<i", "<I", "<q", "<Q", "<f", "<d")}
_INTS = {  # field type -> (size, signed format, unsigned format)
    FIELD_TYPE.TINY: (1, "<b", "<B"), FIELD_TYPE.SHORT: (2, "<h", "<H"), FIELD_TYPE.LONG: (4, "<i", "<I"),
    FIELD_TYPE.LONGLONG: (8, "<q", "<Q"),
}


def _int_col(c: Any) -> Col:
    size, signed, unsigned = _INTS[c.type]
    if c.type == FIELD_TYPE.TINY and c.unsigned:
        return Col(c.name, ("v{i} = b[p]", "p += 1"), ())
    fmt = unsigned if c.unsigned else signed
    return Col(c.name, ("v{i} = U{i}(b, p)[0]", f"p += {size}"), (("U{i}", _STRUCTS[fmt]),))


def _int24_col(c: Any) -> Col:
    line = f"v{{i}} = FB{{i}}(b[p:p + 3], 'little', signed={not c.unsigned})"
    return Col(c.name, (line, "p += 3"), (("FB{i}", int.from_bytes),))


def _float_col(c: Any) -> Col:
    fmt, size = ("<f", 4) if c.type == FIELD_TYPE.FLOAT else ("<d", 8)
    return Col(c.name, ("v{i} = U{i}(b, p)[0]", f"p += {size}"), (("U{i}", _STRUCTS[fmt]),))


def _length_lines(size: int) -> tuple[tuple[str, ...], tuple[tuple[str, Any], ...]]:
    """Lines reading a little-endian length prefix of 1..4 bytes into ``m``."""
    if size == 1:
        return ("m = b[p]", "p += 1"), ()
    if size == 2:
        return ("m = U{i}(b, p)[0]", "p += 2"), (("U{i}", _STRUCTS["<H"]),)
    if size == 4:
        return ("m = U{i}(b, p)[0]", "p += 4"), (("U{i}", _STRUCTS["<I"]),)
    return (f"m = FB{{i}}(b[p:p + {size}], 'little')", f"p += {size}"), (("FB{i}", int.from_bytes),)


def _text_col(c: Any, size: int, errors: str) -> Col:
    """Length-prefixed bytes decoded with the column's charset exactly as pymysqlreplication does:
    its Python codec when there is one, the raw bytes when Python has no such codec (binary, ucs2...)."""
    head, consts = _length_lines(size)
    enc = rows.RowsEvent.charset_to_encoding(c.character_set_name) if c.character_set_name is not None else "utf-8"
    try:
        if not getattr(codecs.lookup(enc), "_is_text_encoding", True):
            raise Unsupported(f"charset {c.character_set_name!r} maps to a non-text codec")
    except LookupError:
        # bytes.decode of b"" skips the codec lookup, so pymysqlreplication returns "" (str) for empty values
        return Col(c.name, (*head, "v{i} = b[p:p + m] if m else ''", "p += m"), consts)
    return Col(c.name, (*head, "v{i} = b[p:p + m].decode(ENC{i}, ERR{i})", "p += m"),
                (*consts, ("ENC{i}", enc), ("ERR{i}", errors)))


def _bytes_col(c: Any, size: int) -> Col:
    head, consts = _length_lines(size)
    return Col(c.name, (*head, "v{i} = b[p:p + m]", "p += m"), consts)


def _decimal_col(c: Any) -> Col:
    read, size = _decimal_reader(int(c.precision), int(c.decimals))
    return Col(c.name, ("v{i} = R{i}(b, p)", f"p += {size}"), (("R{i}", read),))


def _temporal_col(c: Any) -> Col:
    fsp = int(getattr(c, "fsp", 0) or 0)
    if not 0 <= fsp <= 6:
        raise Unsupported(f"fractional seconds precision {fsp}")
    n = _FRAC_BYTES[fsp]
    if c.type == FIELD_TYPE.DATETIME2:
        return _datetime2_col(c, fsp)
    if c.type == FIELD_TYPE.TIMESTAMP2:
        return _timestamp2_col(c, fsp)
    return Col(c.name, ("v{i} = R{i}(b, p)", f"p += {3 + n}"), (("R{i}", _time2_reader(fsp)),))


def _frac_expr(fsp: int, at: int) -> str:
    """Generated-code expression of the microseconds in the fraction bytes at p + at, read as
    pymysqlreplication reads them (signed big-endian; odd fsp stores one digit more than it keeps)."""
    n = _FRAC_BYTES[fsp]
    frac = f"FB{{i}}(b[p + {at}:p + {at + n}], 'big', signed=True)"
    if fsp % 2:
        frac = f"int({frac} / 10)"
    return f"{frac} * {10 ** (6 - fsp)}"


def _datetime2_col(c: Any, fsp: int) -> Col:
    """DATETIME2 inline: 5 bytes big-endian (sign, year*13+month, day, hour, minute, second) + fraction.
    Dates the datetime type cannot hold (zero dates, zero months or days) are None, as pymysqlreplication
    gives them; a fraction above 999999 cannot be written by a server and is an error, not a None."""
    n = _FRAC_BYTES[fsp]
    head = ["x = FB{i}(b[p:p + 5], 'big')", "ym = x >> 22 & 131071"]
    micro = "0"
    if n:
        head += [f"m = {_frac_expr(fsp, 5)}", "if m > 999999:",
                 "    raise ValueError('a DATETIME fraction above 999999')"]
        micro = "m if m > 0 else 0"
    return Col(c.name, (
        *head, "try:",
        f"    v{{i}} = DT{{i}}(ym // 13, ym % 13, x >> 17 & 31, x >> 12 & 31, x >> 6 & 63, x & 63, {micro})",
        "except ValueError:", "    v{i} = None", f"    s[K{{i}}] = {NONE_SOURCE.OUT_OF_DATETIME2_RANGE!r}",
        f"p += {5 + n}"), (("FB{i}", int.from_bytes), ("DT{i}", datetime)))


def _timestamp2_col(c: Any, fsp: int) -> Col:
    """TIMESTAMP2 inline (the most common temporal type): signed big-endian seconds since the epoch (UTC)
    and the fraction as ``_frac_expr`` reads it; a naive datetime, as pymysqlreplication gives."""
    n = _FRAC_BYTES[fsp]
    consts: tuple[tuple[str, Any], ...] = (("U{i}", struct.Struct(">i").unpack_from), ("E{i}", _EPOCH),
                                           ("TD{i}", timedelta))
    if n == 0:
        return Col(c.name, ("v{i} = E{i} + TD{i}(0, U{i}(b, p)[0])", "p += 4"), consts)
    return Col(c.name, (f"m = {_frac_expr(fsp, 4)}", "v{i} = E{i} + TD{i}(0, U{i}(b, p)[0], m if m > 0 else 0)",
                         f"p += {4 + n}"), (*consts, ("FB{i}", int.from_bytes)))


def _date_col(c: Any) -> Col:
    return Col(c.name, ("v{i} = R{i}(b[p] | b[p + 1] << 8 | b[p + 2] << 16)", "p += 3", "if v{i} is None:",
                         f"    s[K{{i}}] = {NONE_SOURCE.OUT_OF_DATE_RANGE!r}"), (("R{i}", _date),))


def _enum_col(c: Any) -> Col:
    labels = list(c.enum_values or [])
    if not labels:
        raise Unsupported("ENUM without labels (binlog_row_metadata is not FULL)")
    head, consts = _length_lines(int(c.size))
    return Col(c.name, (*head, "v{i} = E{i}[m]"), (*consts, ("E{i}", tuple(labels))))


def _set_col(c: Any) -> Col:
    if not c.set_values:
        raise Unsupported("SET without labels (binlog_row_metadata is not FULL)")
    size = int(c.size)
    return Col(c.name, (f"v{{i}} = R{{i}}(FB{{i}}(b[p:p + {size}], 'little'))", f"p += {size}", "if v{i} is None:",
                         f"    s[K{{i}}] = {NONE_SOURCE.EMPTY_SET!r}"),
                (("R{i}", _set_reader(tuple(c.set_values))), ("FB{i}", int.from_bytes)))


def _bit_col(c: Any) -> Col:
    n = int(c.bytes)
    return Col(c.name, (f"v{{i}} = R{{i}}(FB{{i}}(b[p:p + {n}], 'big'))", f"p += {n}"),
                (("R{i}", _bit_reader(int(c.bits))), ("FB{i}", int.from_bytes)))


class Unsupported(Exception):
    """A column this module does not decode; the table falls back to pymysqlreplication."""


#: How a columnar reader leaves a column's values when not as the row reader's (``columnar.py`` converts):
#: ``micros``: TIMESTAMP as int microseconds since the epoch; ``unscaled``: DECIMAL (precision <= 38) as the
#: int of its digits (value * 10**scale); ``utf8``: UTF-8 text as the raw bytes (Arrow validates them).
FORM_MICROS, FORM_UNSCALED, FORM_UTF8 = "micros", "unscaled", "utf8"
Form = tuple[str, int] | None  # (FORM_*, its argument: a DECIMAL's scale, else 0); None: the row reader's value


def _unscaled_lines(precision: int, scale: int) -> tuple[tuple[str, ...], tuple[tuple[str, Any], ...]]:
    """Lines reading a packed DECIMAL into v{i} as the int of its digits (``_decimal_reader``'s value times
    10**scale), inline: one ``int.from_bytes``, then each group cut out with a shift and a mask, checked and
    combined without a call or a loop per value (the wide benchmark table's two DECIMALs cost a fifth of the
    generated reader's time through a function per value)."""
    int_groups, frac_groups = _decimal_groups(precision - scale, False), _decimal_groups(scale, True)
    size = sum(n for n, _ in int_groups + frac_groups)
    sign_bit = 1 << (8 * size - 1)
    flip_neg = ((1 << (8 * size)) - 1) ^ sign_bit
    groups = []
    shift = 8 * size
    for n, limit in int_groups + frac_groups:
        shift -= 8 * n
        groups.append((shift, (1 << (8 * n)) - 1, limit))
    lines = [f"x = FB{{i}}(b[p:p + {size}], 'big')", f"if x & {sign_bit}:", f"    x ^= {sign_bit}", "    ng = False",
             "else:", f"    x ^= {flip_neg}", "    ng = True"]
    names = [f"g{k}" for k in range(len(groups))]
    lines += [f"{g} = x >> {sh} & {mask}" for g, (sh, mask, _) in zip(names, groups, strict=True)]
    lines += ["if " + " or ".join(f"{g} >= {limit}" for g, (_, _, limit) in zip(names, groups, strict=True)) + ":",
              f"    raise ValueError(OV{{i}}(({', '.join(names)},)))"]
    value = names[0]
    for g, (_, _, limit) in zip(names[1:], groups[1:], strict=True):
        value = f"({value}) * {limit} + {g}"
    lines += [f"v{{i}} = -({value}) if ng else {value}", f"p += {size}"]
    limits = tuple(limit for _, _, limit in groups)

    def overfull(got: tuple[int, ...]) -> str:
        g = next(v for v, limit in zip(got, limits, strict=True) if v >= limit)
        return f"a DECIMAL({precision},{scale}) group holds {g}, more digits than it may"

    return tuple(lines), (("FB{i}", int.from_bytes), ("OV{i}", overfull))


def columnar_plan(c: Any, col: Col, errors: str) -> tuple[Col, Form]:
    """The columnar readers' form of a column: faster raw forms for TIMESTAMP, DECIMAL and UTF-8 text."""
    t = c.type
    if t == FIELD_TYPE.TIMESTAMP2:
        fsp = int(getattr(c, "fsp", 0) or 0)
        n = _FRAC_BYTES[fsp]
        consts: tuple[tuple[str, Any], ...] = (("U{i}", struct.Struct(">i").unpack_from),)
        if n == 0:
            return Col(c.name, ("v{i} = U{i}(b, p)[0] * 1000000", "p += 4"), consts), (FORM_MICROS, 0)
        return Col(c.name, (f"m = {_frac_expr(fsp, 4)}", "v{i} = U{i}(b, p)[0] * 1000000 + (m if m > 0 else 0)",
                             f"p += {4 + n}"), (*consts, ("FB{i}", int.from_bytes))), (FORM_MICROS, 0)
    if t == FIELD_TYPE.NEWDECIMAL and int(c.precision) <= 38:
        lines, consts = _unscaled_lines(int(c.precision), int(c.decimals))
        return Col(c.name, lines, consts), (FORM_UNSCALED, int(c.decimals))
    text = t in (FIELD_TYPE.VARCHAR, FIELD_TYPE.STRING) or (t == FIELD_TYPE.BLOB and c.length_size in (1, 2, 3, 4))
    if text and errors == "strict" and c.character_set_name is not None:
        enc = rows.RowsEvent.charset_to_encoding(c.character_set_name)
        try:
            utf8 = codecs.lookup(enc).name == "utf-8"
        except LookupError:
            utf8 = False
        if utf8 and any(line.endswith(".decode(ENC{i}, ERR{i})") for line in col.lines):
            lines = tuple("v{i} = b[p:p + m]" if line.endswith(".decode(ENC{i}, ERR{i})") else line
                          for line in col.lines)
            return Col(c.name, lines, col.consts), (FORM_UTF8, 0)
    return col, None


def column_plan(c: Any, errors: str) -> Col:
    t = c.type
    if not c.name:
        raise Unsupported("a column without a name")
    if t in _INTS:
        return _int_col(c)
    if t == FIELD_TYPE.INT24:
        return _int24_col(c)
    if t in (FIELD_TYPE.FLOAT, FIELD_TYPE.DOUBLE):
        return _float_col(c)
    if t == FIELD_TYPE.NEWDECIMAL:
        return _decimal_col(c)
    if t in (FIELD_TYPE.VARCHAR, FIELD_TYPE.STRING):
        return _text_col(c, 2 if c.max_length > 255 else 1, errors)
    if t == FIELD_TYPE.BLOB and c.length_size in (1, 2, 3, 4):
        return _text_col(c, int(c.length_size), errors)
    if t == FIELD_TYPE.GEOMETRY and c.length_size in (1, 2, 3, 4):
        return _bytes_col(c, int(c.length_size))
    if t in (FIELD_TYPE.DATETIME2, FIELD_TYPE.TIMESTAMP2, FIELD_TYPE.TIME2):
        return _temporal_col(c)
    if t == FIELD_TYPE.DATE:
        return _date_col(c)
    if t == FIELD_TYPE.YEAR:
        return Col(c.name, ("v{i} = b[p] + 1900", "p += 1"), ())
    if t == FIELD_TYPE.ENUM:
        return _enum_col(c)
    if t == FIELD_TYPE.SET:
        return _set_col(c)
    if t == FIELD_TYPE.BIT:
        return _bit_col(c)
    raise Unsupported(f"column type code {t}")
