"""The server's lexical rules for DDL text, and DEFAULT literals (what ``ddl.py`` parses with).

Tokens: names, quoted names and strings (with their quotes), numbers, punctuation. Comments are skipped
(``/* */``, ``-- `` followed by a space, ``#``); a versioned comment (``/*!50100 ... */``, MariaDB's
``/*M!100301 ... */``) is read as its content, which the server runs. Strings resolve doubled quotes and, unless
the statement's ``sql_mode`` has NO_BACKSLASH_ESCAPES, backslash escapes; with ANSI_QUOTES ``"`` quotes names.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Default:
    """A column definition's DEFAULT: ``kind`` is ``string`` (``text``: the value, escapes resolved), ``number``
    (its literal text), ``bits`` (``b'0101'``: the value in ``data``), ``hex`` (``0x..``/``x'..'``: ``data``),
    ``bool``, ``null``, or ``expression`` (not a constant: ``CURRENT_TIMESTAMP``, ``(a + 1)``; ``text`` is its
    source text)."""

    kind: str
    text: str = ""
    data: bytes = b""


_VERSIONED = re.compile(r"/\*M?!\d*")
_NUMBER = re.compile(r"\d+(\.\d*)?([eE][+-]?\d+)?|\.\d+([eE][+-]?\d+)?")
_WORD = re.compile(r"[0-9A-Za-z_$\u0080-\uffff]+")
_ESCAPES = {"0": "\0", "b": "\b", "n": "\n", "r": "\r", "t": "\t", "Z": "\x1a"}
class _Lexer:
    """Tokens of a statement: names, quoted names and strings (with their quotes), numbers, punctuation."""

    def __init__(self, sql: str, ansi_quotes: bool, backslash: bool) -> None:
        self.s = sql
        self.ansi_quotes = ansi_quotes
        self.backslash = backslash

    def tokens(self) -> list[str]:
        s = self.s
        out: list[str] = []
        i = 0
        n = len(s)
        while i < n:
            ch = s[i]
            if ch.isspace():
                i += 1
            elif s.startswith("/*", i):
                versioned = _VERSIONED.match(s, i)
                if versioned is not None:  # executed by the server: its body is part of the statement
                    i = versioned.end()
                    continue
                end = s.find("*/", i + 2)
                i = n if end < 0 else end + 2
            elif s.startswith("*/", i):  # the end of a versioned comment
                i += 2
            elif ch == "#" or (s.startswith("--", i) and (i + 2 == n or s[i + 2].isspace())):
                end = s.find("\n", i)
                i = n if end < 0 else end + 1
            elif ch in "`\"'":
                j = self._quoted_end(i)
                out.append(s[i:j])
                i = j
            elif ch.isdigit() or (ch == "." and i + 1 < n and s[i + 1].isdigit()
                                  and (i == 0 or s[i - 1].isspace() or s[i - 1] in "(,=+-")):  # not db.5t
                m = _NUMBER.match(s, i)
                w = _WORD.match(s, i)
                # 1abc is a name; 1e5, 1.5 and 12 are numbers
                if m is not None and (w is None or w.end() <= m.end()):
                    out.append(m.group())
                    i = m.end()
                else:
                    assert w is not None
                    out.append(w.group())
                    i = w.end()
            elif _WORD.match(s, i):
                w = _WORD.match(s, i)
                assert w is not None
                out.append(w.group())
                i = w.end()
            else:
                out.append(ch)
                i += 1
        return out

    def _quoted_end(self, i: int) -> int:
        s = self.s
        q = s[i]
        escapes = self.backslash and (q == "'" or (q == '"' and not self.ansi_quotes))
        j = i + 1
        while j < len(s):
            if escapes and s[j] == "\\":
                j += 2
                continue
            if s[j] == q:
                if j + 1 < len(s) and s[j + 1] == q:
                    j += 2
                    continue
                return j + 1
            j += 1
        return len(s)


def tokens(sql: str, ansi_quotes: bool = False, backslash: bool = True) -> list[str]:
    return _Lexer(sql, ansi_quotes, backslash).tokens()


def unquote(tok: str) -> str:
    if tok[:1] == "`":
        return tok[1:-1].replace("``", "`")
    if tok[:1] == '"':
        return tok[1:-1].replace('""', '"')
    return tok


def is_name(tok: str) -> bool:
    return bool(tok) and (tok[0] in "`\"" or bool(_WORD.match(tok)))


def string_value(tok: str, backslash: bool = True) -> str:
    """The value of a quoted string token: doubled quotes and (unless NO_BACKSLASH_ESCAPES) escapes resolved."""
    q = tok[0]
    body = tok[1:-1]
    out: list[str] = []
    i = 0
    while i < len(body):
        ch = body[i]
        if ch == "\\" and backslash and i + 1 < len(body):
            nxt = body[i + 1]
            out.append(_ESCAPES.get(nxt, nxt))  # \% and \_ keep their backslash only in LIKE patterns
            i += 2
        elif ch == q and i + 1 < len(body) and body[i + 1] == q:
            out.append(q)
            i += 2
        else:
            out.append(ch)
            i += 1
    return "".join(out)


def is_string(tok: str, ansi_quotes: bool) -> bool:
    return tok[:1] == "'" or (tok[:1] == '"' and not ansi_quotes)


def literal(toks: list[str], ansi_quotes: bool, backslash: bool) -> tuple[Default, int]:
    """The DEFAULT value starting at ``toks[0]`` and how many tokens it takes."""
    first = toks[0] if toks else ""
    low = first.lower()
    nxt = toks[1] if len(toks) > 1 else ""
    if first == "(":  # an expression default (MySQL 8.0.13+, MariaDB 10.2+): a constant when it is one literal
        depth, end = 0, len(toks)
        for j, tok in enumerate(toks):
            depth += (tok == "(") - (tok == ")")
            if depth == 0:
                end = j
                break
        inner = toks[1:end]
        if inner:
            d, used = literal(inner, ansi_quotes, backslash)
            if d.kind != "expression" and used == len(inner):
                return d, end + 1
        return Default("expression", " ".join(inner)), end + 1
    if low == "null":
        return Default("null"), 1
    if low in ("true", "false"):
        return Default("bool", "1" if low == "true" else "0"), 1
    if low in ("b", "x") and nxt[:1] == "'":  # b'0101', X'0A'
        return _binary_literal(low, nxt[1:-1]), 2
    if low.startswith("0x") and len(low) > 2:
        return _binary_literal("x", first[2:]), 1
    if low.startswith("0b") and len(low) > 2 and set(low[2:]) <= {"0", "1"}:
        return _binary_literal("b", first[2:]), 1
    if (low == "n" or low.startswith("_")) and is_string(nxt, ansi_quotes):  # N'..', _utf8mb4'..'
        d, used = literal(toks[1:], ansi_quotes, backslash)
        return d, used + 1
    if is_string(first, ansi_quotes):
        parts, used = [], 0
        while used < len(toks) and is_string(toks[used], ansi_quotes):  # 'a' 'b' is 'ab'
            parts.append(string_value(toks[used], backslash))
            used += 1
        return Default("string", "".join(parts)), used
    if first in ("-", "+") and _NUMBER.fullmatch(nxt):
        return Default("number", (first if first == "-" else "") + nxt), 2
    if _NUMBER.fullmatch(first):
        return Default("number", first), 1
    # a function or a name (CURRENT_TIMESTAMP, NOW(), UUID(), NEXTVAL(s)...): up to the next attribute
    j = 1
    depth = 0
    while j < len(toks) and (depth or toks[j] == "(" or toks[j] == ")"):
        depth += (toks[j] == "(") - (toks[j] == ")")
        j += 1
    return Default("expression", " ".join(toks[:j])), j


def _binary_literal(kind: str, digits: str) -> Default:
    if kind == "x":
        text = digits if len(digits) % 2 == 0 else "0" + digits
        return Default("hex", data=bytes.fromhex(text))
    value = int(digits, 2) if digits else 0
    return Default("bits", data=value.to_bytes(max(1, (len(digits) + 7) // 8), "big"))
