"""Fast row-image decoding for WRITE/UPDATE/DELETE rows events, straight from the packet bytes.

pymysqlreplication parses a rows event's header and bitmaps eagerly but decodes
the row images lazily (``ev.rows``), through several method calls, slices and
struct calls per value: that was most of the binlog thread's time. Here a
table map's columns are compiled once into a plan per column, and each
columns-present bitmap into one generated Python function that reads a whole
row image with inline struct calls. The output is exactly what ``ev.rows``
returns (after ``compat``'s fix): the same dicts, the same values (types,
Decimal exponents, microseconds) and the same ``none_sources``, so the
converters of ``types.py`` apply unchanged.

Column types this module does not decode (MySQL's binary JSON, the pre-5.6
DATETIME/TIME/TIMESTAMP formats, VAR_STRING, columns without names or without
ENUM/SET labels) make ``compile_table`` return None: the caller then falls
back to pymysqlreplication's own decoding for that table.

Binary formats (MySQL ``sql/log_event.cc``, ``rpl_record.cc``,
``decimal.c``, ``my_time.cc``; MariaDB writes the same): after the
columns-present bitmap(s), each row image is a NULL bitmap with one bit per
*present* column (LSB first), then the values of the present, non-NULL columns
in column order; an UPDATE row is a before image followed by an after image.
"""

from __future__ import annotations

import codecs
import struct
from collections.abc import Callable
from dataclasses import dataclass
from datetime import date, datetime, timedelta
from decimal import Decimal, InvalidOperation
from typing import Any

from pymysqlreplication import row_event as rows
from pymysqlreplication.constants import FIELD_TYPE, NONE_SOURCE

from cdcd.errors import SourceFatal
from cdcd.sources.mysql.compat import decode_time2

Row = dict[str, Any]
Image = Callable[[bytes, int], tuple[Row, dict[str, str], int]]

_FRAC_BYTES = (0, 1, 1, 2, 2, 3, 3)  # fractional-second bytes per fsp 0..6
_DIG2BYTES = (0, 1, 1, 2, 2, 3, 3, 4, 4, 4)  # bytes of a packed decimal group of n < 9 digits
_ROWS_EVENT_TYPES = frozenset((0x17, 0x18, 0x19, 0x1E, 0x1F, 0x20))  # v1 and v2 write/update/delete
_EPOCH = datetime(1970, 1, 1)
_MAX_IMAGES = 64  # compiled columns-present bitmaps kept per table (MINIMAL images vary per statement)
_MAX_TABLES = 256  # compiled table shapes kept


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
class _Col:
    """How to read one column: source lines for the non-NULL case and the names they use."""

    name: str
    lines: tuple[str, ...]  # read from b at p into v{i}, advance p; may set s[K{i}] when the value is None
    consts: tuple[tuple[str, Any], ...]  # the globals the lines use; {i} becomes the column's index


_STRUCTS = {fmt: struct.Struct(fmt).unpack_from for fmt in ("<b", "<B", "<h", "<H", "<i", "<I", "<q", "<Q", "<f", "<d")}
_INTS = {  # field type -> (size, signed format, unsigned format)
    FIELD_TYPE.TINY: (1, "<b", "<B"), FIELD_TYPE.SHORT: (2, "<h", "<H"), FIELD_TYPE.LONG: (4, "<i", "<I"),
    FIELD_TYPE.LONGLONG: (8, "<q", "<Q"),
}


def _int_col(c: Any) -> _Col:
    size, signed, unsigned = _INTS[c.type]
    if c.type == FIELD_TYPE.TINY and c.unsigned:
        return _Col(c.name, ("v{i} = b[p]", "p += 1"), ())
    fmt = unsigned if c.unsigned else signed
    return _Col(c.name, ("v{i} = U{i}(b, p)[0]", f"p += {size}"), (("U{i}", _STRUCTS[fmt]),))


def _int24_col(c: Any) -> _Col:
    line = f"v{{i}} = FB{{i}}(b[p:p + 3], 'little', signed={not c.unsigned})"
    return _Col(c.name, (line, "p += 3"), (("FB{i}", int.from_bytes),))


def _float_col(c: Any) -> _Col:
    fmt, size = ("<f", 4) if c.type == FIELD_TYPE.FLOAT else ("<d", 8)
    return _Col(c.name, ("v{i} = U{i}(b, p)[0]", f"p += {size}"), (("U{i}", _STRUCTS[fmt]),))


def _length_lines(size: int) -> tuple[tuple[str, ...], tuple[tuple[str, Any], ...]]:
    """Lines reading a little-endian length prefix of 1..4 bytes into ``m``."""
    if size == 1:
        return ("m = b[p]", "p += 1"), ()
    if size == 2:
        return ("m = U{i}(b, p)[0]", "p += 2"), (("U{i}", _STRUCTS["<H"]),)
    if size == 4:
        return ("m = U{i}(b, p)[0]", "p += 4"), (("U{i}", _STRUCTS["<I"]),)
    return (f"m = FB{{i}}(b[p:p + {size}], 'little')", f"p += {size}"), (("FB{i}", int.from_bytes),)


def _text_col(c: Any, size: int, errors: str) -> _Col:
    """Length-prefixed bytes decoded with the column's charset exactly as pymysqlreplication does:
    its Python codec when there is one, the raw bytes when Python has no such codec (binary, ucs2...)."""
    head, consts = _length_lines(size)
    enc = rows.RowsEvent.charset_to_encoding(c.character_set_name) if c.character_set_name is not None else "utf-8"
    try:
        if not getattr(codecs.lookup(enc), "_is_text_encoding", True):
            raise _Unsupported(f"charset {c.character_set_name!r} maps to a non-text codec")
    except LookupError:
        # bytes.decode of b"" skips the codec lookup, so pymysqlreplication returns "" (str) for empty values
        return _Col(c.name, (*head, "v{i} = b[p:p + m] if m else ''", "p += m"), consts)
    return _Col(c.name, (*head, "v{i} = b[p:p + m].decode(ENC{i}, ERR{i})", "p += m"),
                (*consts, ("ENC{i}", enc), ("ERR{i}", errors)))


def _bytes_col(c: Any, size: int) -> _Col:
    head, consts = _length_lines(size)
    return _Col(c.name, (*head, "v{i} = b[p:p + m]", "p += m"), consts)


def _decimal_col(c: Any) -> _Col:
    read, size = _decimal_reader(int(c.precision), int(c.decimals))
    return _Col(c.name, ("v{i} = R{i}(b, p)", f"p += {size}"), (("R{i}", read),))


def _temporal_col(c: Any) -> _Col:
    fsp = int(getattr(c, "fsp", 0) or 0)
    if not 0 <= fsp <= 6:
        raise _Unsupported(f"fractional seconds precision {fsp}")
    n = _FRAC_BYTES[fsp]
    if c.type == FIELD_TYPE.DATETIME2:
        return _datetime2_col(c, fsp)
    if c.type == FIELD_TYPE.TIMESTAMP2:
        return _timestamp2_col(c, fsp)
    return _Col(c.name, ("v{i} = R{i}(b, p)", f"p += {3 + n}"), (("R{i}", _time2_reader(fsp)),))


def _frac_expr(fsp: int, at: int) -> str:
    """Generated-code expression of the microseconds in the fraction bytes at p + at, read as
    pymysqlreplication reads them (signed big-endian; odd fsp stores one digit more than it keeps)."""
    n = _FRAC_BYTES[fsp]
    frac = f"FB{{i}}(b[p + {at}:p + {at + n}], 'big', signed=True)"
    if fsp % 2:
        frac = f"int({frac} / 10)"
    return f"{frac} * {10 ** (6 - fsp)}"


def _datetime2_col(c: Any, fsp: int) -> _Col:
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
    return _Col(c.name, (
        *head, "try:",
        f"    v{{i}} = DT{{i}}(ym // 13, ym % 13, x >> 17 & 31, x >> 12 & 31, x >> 6 & 63, x & 63, {micro})",
        "except ValueError:", "    v{i} = None", f"    s[K{{i}}] = {NONE_SOURCE.OUT_OF_DATETIME2_RANGE!r}",
        f"p += {5 + n}"), (("FB{i}", int.from_bytes), ("DT{i}", datetime)))


def _timestamp2_col(c: Any, fsp: int) -> _Col:
    """TIMESTAMP2 inline (the most common temporal type): signed big-endian seconds since the epoch (UTC)
    and the fraction as ``_frac_expr`` reads it; a naive datetime, as pymysqlreplication gives."""
    n = _FRAC_BYTES[fsp]
    consts: tuple[tuple[str, Any], ...] = (("U{i}", struct.Struct(">i").unpack_from), ("E{i}", _EPOCH),
                                           ("TD{i}", timedelta))
    if n == 0:
        return _Col(c.name, ("v{i} = E{i} + TD{i}(0, U{i}(b, p)[0])", "p += 4"), consts)
    return _Col(c.name, (f"m = {_frac_expr(fsp, 4)}", "v{i} = E{i} + TD{i}(0, U{i}(b, p)[0], m if m > 0 else 0)",
                         f"p += {4 + n}"), (*consts, ("FB{i}", int.from_bytes)))


def _date_col(c: Any) -> _Col:
    return _Col(c.name, ("v{i} = R{i}(b[p] | b[p + 1] << 8 | b[p + 2] << 16)", "p += 3", "if v{i} is None:",
                         f"    s[K{{i}}] = {NONE_SOURCE.OUT_OF_DATE_RANGE!r}"), (("R{i}", _date),))


def _enum_col(c: Any) -> _Col:
    labels = list(c.enum_values or [])
    if not labels:
        raise _Unsupported("ENUM without labels (binlog_row_metadata is not FULL)")
    head, consts = _length_lines(int(c.size))
    return _Col(c.name, (*head, "v{i} = E{i}[m]"), (*consts, ("E{i}", tuple(labels))))


def _set_col(c: Any) -> _Col:
    if not c.set_values:
        raise _Unsupported("SET without labels (binlog_row_metadata is not FULL)")
    size = int(c.size)
    return _Col(c.name, (f"v{{i}} = R{{i}}(FB{{i}}(b[p:p + {size}], 'little'))", f"p += {size}", "if v{i} is None:",
                         f"    s[K{{i}}] = {NONE_SOURCE.EMPTY_SET!r}"),
                (("R{i}", _set_reader(tuple(c.set_values))), ("FB{i}", int.from_bytes)))


def _bit_col(c: Any) -> _Col:
    n = int(c.bytes)
    return _Col(c.name, (f"v{{i}} = R{{i}}(FB{{i}}(b[p:p + {n}], 'big'))", f"p += {n}"),
                (("R{i}", _bit_reader(int(c.bits))), ("FB{i}", int.from_bytes)))


class _Unsupported(Exception):
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


def _columnar_column(c: Any, col: _Col, errors: str) -> tuple[_Col, Form]:
    """The columnar readers' form of a column: faster raw forms for TIMESTAMP, DECIMAL and UTF-8 text."""
    t = c.type
    if t == FIELD_TYPE.TIMESTAMP2:
        fsp = int(getattr(c, "fsp", 0) or 0)
        n = _FRAC_BYTES[fsp]
        consts: tuple[tuple[str, Any], ...] = (("U{i}", struct.Struct(">i").unpack_from),)
        if n == 0:
            return _Col(c.name, ("v{i} = U{i}(b, p)[0] * 1000000", "p += 4"), consts), (FORM_MICROS, 0)
        return _Col(c.name, (f"m = {_frac_expr(fsp, 4)}", "v{i} = U{i}(b, p)[0] * 1000000 + (m if m > 0 else 0)",
                             f"p += {4 + n}"), (*consts, ("FB{i}", int.from_bytes))), (FORM_MICROS, 0)
    if t == FIELD_TYPE.NEWDECIMAL and int(c.precision) <= 38:
        lines, consts = _unscaled_lines(int(c.precision), int(c.decimals))
        return _Col(c.name, lines, consts), (FORM_UNSCALED, int(c.decimals))
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
            return _Col(c.name, lines, col.consts), (FORM_UTF8, 0)
    return col, None


def _column(c: Any, errors: str) -> _Col:
    t = c.type
    if not c.name:
        raise _Unsupported("a column without a name")
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
        return _Col(c.name, ("v{i} = b[p] + 1900", "p += 1"), ())
    if t == FIELD_TYPE.ENUM:
        return _enum_col(c)
    if t == FIELD_TYPE.SET:
        return _set_col(c)
    if t == FIELD_TYPE.BIT:
        return _bit_col(c)
    raise _Unsupported(f"column type code {t}")


def _image_source(cols: tuple[_Col, ...], present: tuple[bool, ...]) -> tuple[str, dict[str, Any]]:
    """Python source of one row-image reader for this columns-present bitmap, and its globals."""
    nb = (sum(present) + 7) // 8
    consts: dict[str, Any] = {"FB": int.from_bytes}
    out = ["def image(b, p):", "    s = {}"]
    out += ["    n = b[p]", "    p += 1"] if nb == 1 else [f"    n = FB(b[p:p + {nb}], 'little')", f"    p += {nb}"]
    bit = 0
    for i, (col, here) in enumerate(zip(cols, present, strict=True)):
        consts[f"K{i}"] = col.name
        if not here:
            out += [f"    v{i} = None", f"    s[K{i}] = {NONE_SOURCE.COLS_BITMAP!r}"]
            continue
        out += [f"    if n >> {bit} & 1:", f"        v{i} = None", f"        s[K{i}] = {NONE_SOURCE.NULL!r}",
                "    else:"]
        consts.update((name.format(i=i), value) for name, value in col.consts)
        out += ["        " + line.format(i=i) for line in col.lines]
        bit += 1
    out.append("    return {" + ", ".join(f"K{i}: v{i}" for i in range(len(cols))) + "}, s, p")
    return "\n".join(out), consts


#: A columnar reader: (packet, start, end, data lists, before lists, zero-value column names) -> end offset
ColumnReader = Callable[[bytes, int, int, list[list[Any]], list[list[Any]], set[str]], int]
_EMPTY_SET_LINE = f"s[K{{i}}] = {NONE_SOURCE.EMPTY_SET!r}"


def _column_lines(col: _Col) -> list[str]:
    """A column's lines for the columnar readers: no per-row none-source dict. An empty SET is the empty
    string at once (the row path's ``_fix_empty_sets``); a zero or out-of-range date is None, its column
    named in ``z`` for the zero-date warning."""
    out = []
    for line in col.lines:
        body = line.lstrip()
        indent = line[: len(line) - len(body)]
        if body == _EMPTY_SET_LINE:
            out.append(indent + "v{i} = ''")
        elif body.startswith("s[K{i}] = "):
            out.append(indent + "z.add(K{i})")
        else:
            out.append(line)
    return out


def _columns_source(cols: tuple[_Col, ...], images: list[tuple[tuple[bool, ...], tuple[str, ...]]]
                    ) -> tuple[str, dict[str, Any]]:
    """Python source of a reader that decodes every row of a rows event and appends each value to its
    column's list: ``images`` are the row's images in order (one, or an update's before and after), each
    with its columns-present bitmap and the list prefixes its values go to (``a``: data, ``b``: before)."""
    consts: dict[str, Any] = {"FB": int.from_bytes}
    out = ["def read(b, p, end, A, B, z):"]
    for prefix, lists in (("a", "A"), ("b", "B")):
        if any(prefix in targets for _, targets in images):
            out += [f"    {prefix}{i} = {lists}[{i}].append" for i in range(len(cols))]
    out.append("    while p < end:")
    for present, targets in images:
        nb = (sum(present) + 7) // 8
        out += ["        n = b[p]", "        p += 1"] if nb == 1 else \
            [f"        n = FB(b[p:p + {nb}], 'little')", f"        p += {nb}"]
        bit = 0
        for i, (col, here) in enumerate(zip(cols, present, strict=True)):
            consts[f"K{i}"] = col.name
            appends = [f"{t}{i}(v{i})" for t in targets]
            if not here:
                out += [f"        {t}{i}(None)" for t in targets]
                continue
            out += [f"        if n >> {bit} & 1:"] + [f"            {t}{i}(None)" for t in targets] + ["        else:"]
            consts.update((name.format(i=i), value) for name, value in col.consts)
            out += ["            " + line.format(i=i) for line in _column_lines(col)]
            out += [f"            {a}" for a in appends]
            bit += 1
    out.append("    return p")
    return "\n".join(out), consts


def _compile_image(cols: tuple[_Col, ...], present: tuple[bool, ...]) -> Image:
    source, consts = _image_source(cols, present)
    namespace: dict[str, Any] = dict(consts)
    exec(compile(source, "<cdcd row image>", "exec"), namespace)  # the source is built from fixed templates
    image: Image = namespace["image"]
    return image


# ------------------------------------------------------------------ tables and events

class TableDecoder:
    """Row-image readers for one table-map shape, one per columns-present bitmap seen."""

    def __init__(self, cols: tuple[_Col, ...], columnar: tuple[tuple[_Col, Form], ...] | None = None) -> None:
        self.cols = cols
        # the columnar readers' columns and each one's form (None: the row reader's value)
        self.columnar_cols = cols if columnar is None else tuple(c for c, _ in columnar)
        self.forms: tuple[Form, ...] = (None,) * len(cols) if columnar is None else \
            tuple(f for _, f in columnar)
        self._present: dict[bytes, tuple[bool, ...]] = {}
        self._images: dict[bytes, Image] = {}
        self._readers: dict[tuple[str, bytes, bytes], ColumnReader] = {}

    def image(self, bitmap: bytes) -> Image:
        img = self._images.get(bitmap)
        if img is None:
            present = tuple(bool(bitmap[i >> 3] >> (i & 7) & 1) for i in range(len(self.cols)))
            img = _compile_image(self.cols, present)
            if len(self._images) >= _MAX_IMAGES:
                self._images.clear()
            self._images[bitmap] = img
        return img

    def present(self, bitmap: bytes) -> tuple[bool, ...]:
        """Which columns a columns-present bitmap holds."""
        got = self._present.get(bitmap)
        if got is None:
            got = tuple(bool(bitmap[i >> 3] >> (i & 7) & 1) for i in range(len(self.cols)))
            if len(self._present) >= _MAX_IMAGES:
                self._present.clear()
            self._present[bitmap] = got
        return got

    def column_reader(self, kind: str, bitmap: bytes, bitmap2: bytes = b"") -> ColumnReader:
        """The columnar reader of rows events of ``kind`` (``write``, ``update``, ``delete``) with these
        columns-present bitmaps: a write's values go to the data lists, a delete's to the data and the before
        lists, an update's before image to the before lists and its after image to the data lists."""
        key = (kind, bitmap, bitmap2)
        reader = self._readers.get(key)
        if reader is None:
            first = self.present(bitmap)
            images: list[tuple[tuple[bool, ...], tuple[str, ...]]] = \
                [(first, ("b",)), (self.present(bitmap2), ("a",))] if kind == "update" else \
                [(first, ("a", "b") if kind == "delete" else ("a",))]
            source, consts = _columns_source(self.columnar_cols, images)
            namespace: dict[str, Any] = dict(consts)
            exec(compile(source, "<cdcd columnar row image>", "exec"), namespace)  # built from fixed templates
            reader = namespace["read"]
            if len(self._readers) >= _MAX_IMAGES:
                self._readers.clear()
            self._readers[key] = reader
        return reader

    def read_columns(self, ev: Any, data: list[list[Any]], before: list[list[Any]], zero: set[str]) -> int | None:
        """Appends the rows of this rows event to the column lists (``column_reader``); the number of rows
        read, None when the event is not one this module reads (as ``rows``)."""
        body = _body(ev, len(self.cols))
        if body is None:
            return None
        buf, start, end = body
        t = type(ev)
        if t is rows.UpdateRowsEvent:
            reader = self.column_reader("update", ev.columns_present_bitmap, ev.columns_present_bitmap2)
        else:
            reader = self.column_reader("write" if t is rows.WriteRowsEvent else "delete", ev.columns_present_bitmap)
        first = len(data[0])
        try:
            pos = reader(buf, start, end, data, before, zero)
            if pos != end:
                raise _Overrun(f"the row images run {pos - end} bytes past the end of the event")
        except (struct.error, ValueError, IndexError, InvalidOperation, OverflowError, _Overrun) as exc:
            raise _undecodable(ev, exc) from exc
        return len(data[0]) - first

    def rows(self, ev: Any) -> list[Row] | None:
        """``ev.rows`` of this rows event, decoded here; None when the event is not one this module reads
        (partial JSON updates, an event already decoded, a column count that differs from the table map)."""
        body = _body(ev, len(self.cols))
        if body is None:
            return None
        buf, start, end = body
        try:
            if type(ev) is rows.UpdateRowsEvent:
                return _update_rows(self.image(ev.columns_present_bitmap), self.image(ev.columns_present_bitmap2),
                                    buf, start, end)
            return _single_rows(self.image(ev.columns_present_bitmap), buf, start, end)
        except (struct.error, ValueError, IndexError, InvalidOperation, OverflowError, _Overrun) as exc:
            # never skip a row we cannot read: that would be a silent gap in the change stream
            raise _undecodable(ev, exc) from exc


class _Overrun(Exception):
    pass


def _undecodable(ev: Any, exc: Exception) -> SourceFatal:
    return SourceFatal(
        f"cannot decode a row image of {ev.schema}.{ev.table} in the binlog event ending at "
        f"{ev.packet.log_pos} ({type(exc).__name__}: {exc}). The event does not match its table map; "
        "report it with the output of mysqlbinlog/mariadb-binlog --verbose for that position."
    )


def _body(ev: Any, ncols: int) -> tuple[bytes, int, int] | None:
    """The packet bytes and the [start, end) range of the row images, if this event can be read here."""
    if type(ev) not in (rows.WriteRowsEvent, rows.UpdateRowsEvent, rows.DeleteRowsEvent):
        return None
    if ev.event_type not in _ROWS_EVENT_TYPES or not ev.complete or ev.number_of_columns != ncols:
        return None
    if getattr(ev, "_RowsEvent__rows", None) is not None:
        return None  # already decoded: the packet cursor has moved on
    wrapper = ev.packet
    if getattr(wrapper, "_BinLogPacketWrapper__data_buffer", b""):
        return None  # pushed-back bytes: the raw cursor is not where the images start
    raw = wrapper.packet
    buf, start = raw._data, raw._position
    end = start + ev.event_size - wrapper.read_bytes
    if not isinstance(buf, bytes | bytearray) or end > len(buf) or end < start:
        return None
    return bytes(buf) if isinstance(buf, bytearray) else buf, start, end


def _single_rows(image: Image, buf: bytes, pos: int, end: int) -> list[Row]:
    out: list[Row] = []
    append = out.append
    while pos < end:
        values, none_sources, pos = image(buf, pos)
        append({"values": values, "none_sources": none_sources})
    if pos != end:
        raise _Overrun(f"the row images run {pos - end} bytes past the end of the event")
    return out


def _update_rows(before: Image, after: Image, buf: bytes, pos: int, end: int) -> list[Row]:
    out: list[Row] = []
    append = out.append
    while pos < end:
        bv, bs, pos = before(buf, pos)
        av, as_, pos = after(buf, pos)
        append({"before_values": bv, "before_none_sources": bs, "after_values": av, "after_none_sources": as_})
    if pos != end:
        raise _Overrun(f"the row images run {pos - end} bytes past the end of the event")
    return out


def table_map_signature(columns: list[Any]) -> tuple[Any, ...]:
    """Everything about a table map's columns that decoding depends on."""
    return tuple(
        (c.type, c.name, bool(c.unsigned), getattr(c, "max_length", None), getattr(c, "length_size", None),
         getattr(c, "precision", None), getattr(c, "decimals", None), getattr(c, "fsp", None),
         getattr(c, "bits", None), getattr(c, "bytes", None), getattr(c, "size", None), c.character_set_name,
         tuple(c.enum_values) if c.enum_values else None, tuple(c.set_values) if c.set_values else None)
        for c in columns
    )


_tables: dict[tuple[Any, ...], TableDecoder | None] = {}


def compile_table(columns: list[Any], ignore_decode_errors: bool = False) -> TableDecoder | None:
    """The decoder for a table map's columns (pymysqlreplication Column objects), or None when a column type
    is not decoded here. Cached by shape: every transaction brings a new table-map event."""
    key = (table_map_signature(columns), ignore_decode_errors)
    if key in _tables:
        return _tables[key]
    errors = "ignore" if ignore_decode_errors else "strict"
    try:
        cols = tuple(_column(c, errors) for c in columns)
        decoder: TableDecoder | None = TableDecoder(
            cols, tuple(_columnar_column(c, col, errors) for c, col in zip(columns, cols, strict=True)))
    except _Unsupported:
        decoder = None
    if len(_tables) >= _MAX_TABLES:
        _tables.clear()
    _tables[key] = decoder
    return decoder


def unsupported_reason(columns: list[Any]) -> str | None:
    """Why ``compile_table`` falls back for these columns (None: it does not)."""
    for c in columns:
        try:
            _column(c, "strict")
        except _Unsupported as exc:
            return f"column {c.name!r}: {exc}"
    return None
