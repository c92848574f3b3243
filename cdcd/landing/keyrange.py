"""A re-sync condition on a table's key that the source and the mirror evaluate the same way.

``cdcd snapshot TABLE --where`` re-reads the rows matching a condition; for its covered record (the merge deletes
the mirror rows in the condition that the re-read did not see) the condition must select in the mirror no row
the source's condition did not select: else the merge would delete a row the source still has. So only forms
whose meaning does not depend on the database are accepted, on a one-column key:

- a range on an integer key: ``id BETWEEN 1 AND 500``, ``id >= 1 AND id < 500``, ``id > 7``, ``id = 7``;
- a key list on an integer or text key: ``id IN (1, 5, 9)``, ``code IN ('a', 'b')``, ``code = 'a'``.

Text ranges are refused: a database collation orders text otherwise than Spark does (MariaDB's default is
case-insensitive), so a range would not select the same rows on both sides. Equality is safe: a collation can
only make the source match more rows than Spark's exact comparison, never fewer.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cdcd.errors import ConfigError

KeyValue = int | str

FORMS = ("KEY BETWEEN a AND b, KEY >= a AND KEY < b (any of >, >=, <, <=), KEY = a, KEY IN (a, b, ...), "
         "with integer literals, or quoted text literals for = and IN; KEY the table's one key column")

_TOKEN = re.compile(r"\s*(?:(?P<num>-?\d+)(?![\w.])|(?P<str>'(?:[^']|'')*')|(?P<op>>=|<=|<>|!=|=|<|>|\(|\)|,)"
                    r"|(?P<word>[A-Za-z_][A-Za-z0-9_$]*|`[^`]+`|\"[^\"]+\"))")


def _tokens(text: str) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    pos = 0
    text = text.strip()
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None or m.end() == pos:
            raise ValueError(f"cannot read {text[pos:pos + 20]!r}")
        pos = m.end()
        kind = m.lastgroup
        assert kind is not None
        value = m.group(kind)
        if kind == "num":
            out.append(("val", int(value)))
        elif kind == "str":
            out.append(("val", value[1:-1].replace("''", "'")))
        elif kind == "word" and value[0] in "`\"":
            out.append(("name", value[1:-1]))
        elif kind == "word":
            out.append(("kw", value.upper()) if value.upper() in ("BETWEEN", "AND", "IN") else ("name", value))
        else:
            out.append(("op", value))
    return out


@dataclass(frozen=True, slots=True)
class KeyRange:
    """Rows whose key ``column`` lies in [lo, hi] (bounds None: open; inclusive flags), or is one of ``values``."""

    column: str
    lo: int | None = None
    lo_inclusive: bool = True
    hi: int | None = None
    hi_inclusive: bool = True
    values: tuple[KeyValue, ...] | None = None

    def to_spark_sql(self) -> str:
        """The condition over the mirror (Spark SQL)."""
        col = "`" + self.column.replace("`", "``") + "`"
        if self.values is not None:
            return f"{col} IN ({', '.join(_spark_literal(v) for v in self.values)})"
        parts = []
        if self.lo is not None:
            parts.append(f"{col} {'>=' if self.lo_inclusive else '>'} {self.lo}")
        if self.hi is not None:
            parts.append(f"{col} {'<=' if self.hi_inclusive else '<'} {self.hi}")
        return " AND ".join(parts)

    def to_json(self) -> dict[str, Any]:
        if self.values is not None:
            return {"column": self.column, "values": list(self.values)}
        return {"column": self.column, "lo": self.lo, "lo_inclusive": self.lo_inclusive, "hi": self.hi,
                "hi_inclusive": self.hi_inclusive}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> KeyRange:
        if doc.get("values") is not None:
            return cls(str(doc["column"]), values=tuple(doc["values"]))
        return cls(str(doc["column"]), doc.get("lo"), bool(doc.get("lo_inclusive", True)), doc.get("hi"),
                   bool(doc.get("hi_inclusive", True)))


def _spark_literal(v: KeyValue) -> str:
    if isinstance(v, int):
        return str(v)
    return "'" + v.replace("\\", "\\\\").replace("'", "\\'") + "'"  # Spark SQL escapes with backslashes


_FLIP = {">": "<", ">=": "<=", "<": ">", "<=": ">="}


def _bound(r: KeyRange, op: str, v: int) -> KeyRange:
    if op in (">", ">="):
        if r.lo is not None:
            raise ValueError("two lower bounds")
        return KeyRange(r.column, v, op == ">=", r.hi, r.hi_inclusive)
    if r.hi is not None:
        raise ValueError("two upper bounds")
    return KeyRange(r.column, r.lo, r.lo_inclusive, v, op == "<=")


def _parse(toks: list[tuple[str, Any]], column: str) -> KeyRange:
    def name_at(i: int) -> bool:
        if toks[i][0] != "name":
            return False
        if toks[i][1].lower() != column.lower():
            raise ValueError(f"{toks[i][1]!r} is not the key column {column!r}")
        return True

    n = len(toks)
    if n == 5 and name_at(0) and toks[1] == ("kw", "BETWEEN") and toks[3] == ("kw", "AND"):
        lo, hi = toks[2], toks[4]
        if lo[0] != "val" or hi[0] != "val" or not isinstance(lo[1], int) or not isinstance(hi[1], int):
            raise ValueError("BETWEEN takes integer bounds")
        return KeyRange(column, lo[1], True, hi[1], True)
    if n >= 4 and name_at(0) and toks[1] == ("kw", "IN") and toks[2] == ("op", "(") and toks[-1] == ("op", ")"):
        inner = toks[3:-1]
        values = [t[1] for t in inner[0::2]]
        if (not inner or any(t[0] != "val" for t in inner[0::2]) or any(t != ("op", ",") for t in inner[1::2])
                or len(inner) % 2 == 0):
            raise ValueError("IN takes a list of literals")
        if len({type(v) for v in values}) > 1:
            raise ValueError("IN mixes integers and text")
        return KeyRange(column, values=tuple(dict.fromkeys(values)))
    if n == 3 and name_at(0) and toks[1] == ("op", "=") and toks[2][0] == "val":
        return KeyRange(column, values=(toks[2][1],))
    if n in (3, 7):
        if n == 7 and toks[3] != ("kw", "AND"):
            raise ValueError("two comparisons are joined by AND")
        out = KeyRange(column)
        for left, op, right in ([toks] if n == 3 else [toks[:3], toks[4:]]):
            if left[0] == "name":
                name_at(toks.index(left))
                sign, val = op[1], right
            elif right[0] == "name":
                name_at(toks.index(right))
                sign, val = _FLIP.get(op[1], ""), left
            else:
                raise ValueError("a comparison names the key column")
            if op[0] != "op" or sign not in _FLIP or val[0] != "val" or not isinstance(val[1], int):
                raise ValueError("a range compares the key with an integer using >, >=, < or <=")
            out = _bound(out, sign, val[1])
        return out
    raise ValueError("not one of the accepted forms")


_INTEGER = ("smallint", "integer", "bigint", "int", "tinyint", "mediumint", "int2", "int4", "int8")
_TEXT = ("text", "character varying", "character", "varchar", "char", "tinytext", "mediumtext", "longtext")


def key_kind(type_name: str) -> str:
    """``integer``, ``text`` or ``other`` for a key column's type as the source names it (PostgreSQL's
    ``format_type``, MySQL's ``DATA_TYPE`` or ``COLUMN_TYPE``)."""
    base = re.sub(r"\(.*", "", type_name.lower()).replace(" unsigned", "").strip()
    return "integer" if base in _INTEGER else "text" if base in _TEXT else "other"


def parse_where(text: str, key: Sequence[str], table: str, kind: str) -> KeyRange:
    """The KeyRange of a ``--where`` condition on ``table`` (key columns ``key``; ``kind``: the key's
    ``key_kind``); ConfigError naming the accepted forms for any other condition."""
    def refuse(why: str) -> ConfigError:
        return ConfigError(f"snapshot request: the condition {text!r} on {table} cannot be recorded as a key range "
                           f"({why}), so the merge could not remove the rows the source no longer has in it. Use "
                           f"one of: {FORMS}; or re-sync the whole table (`cdcd snapshot {table}` without --where)")

    if len(key) != 1:
        raise refuse(f"the table's key has {len(key)} columns ({', '.join(key)}); only a one-column key is accepted")
    if kind not in ("integer", "text"):
        raise refuse(f"the key {key[0]} is neither an integer nor text")
    text_key = kind == "text"
    try:
        r = _parse(_tokens(text), key[0])
    except (ValueError, IndexError) as exc:
        raise refuse(str(exc)) from None
    if r.values is not None:
        if any(isinstance(v, int) for v in r.values) == text_key:
            raise refuse(f"the key {key[0]} is {'text' if text_key else 'an integer'}: compare it with "
                         f"{'quoted text' if text_key else 'integers'}")
    elif text_key:
        raise refuse(f"the key {key[0]} is text, whose order depends on the database's collation: list the keys "
                     "with IN (...) or = instead")
    return r
