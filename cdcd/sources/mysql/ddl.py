"""DDL statements from the binlog's Query events, as far as they change captured tables.

``parse_ddl`` reads what a statement does (``ALTER TABLE ... ADD/DROP/MODIFY/CHANGE/RENAME COLUMN``,
``RENAME TABLE``, ``TRUNCATE``, ``DROP``, ``CREATE``) with a small tokenizer; ``apply_alter`` gives the table
schema after an ALTER's column actions. The schema history (``schema.py``) records the result.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from cdcd.events import Column, TableId, TableSchema
from cdcd.sources.mysql.types import arrow_type, normalize_source_type


@dataclass(frozen=True)
class Ddl:
    """What a DDL statement does to captured tables."""

    kind: str  # "alter" | "truncate" | "rename" | "drop" | "create" | "other"
    table: TableId | None = None
    new_table: TableId | None = None
    actions: tuple[tuple[str, ...], ...] = ()  # alter actions, see _alter_actions


_COMMENT = re.compile(r"/\*.*?\*/|--[^\n]*|#[^\n]*", re.S)
_TYPE_STOP = {"not", "null", "default", "auto_increment", "comment", "primary", "unique", "key", "character",
              "charset", "collate", "first", "after", "generated", "as", "check", "references", "on",
              "invisible", "visible", "stored", "virtual", "persistent", "without", "with", "constraint"}


def _tokens(sql: str) -> list[str]:
    """Identifiers, quoted names, strings, numbers and punctuation, in order."""
    sql = _COMMENT.sub(" ", sql)
    out: list[str] = []
    i = 0
    while i < len(sql):
        ch = sql[i]
        if ch.isspace():
            i += 1
        elif ch in "`\"'":
            j = i + 1
            while j < len(sql):
                if sql[j] == ch and j + 1 < len(sql) and sql[j + 1] == ch:
                    j += 2
                    continue
                if sql[j] == "\\" and ch == "'":
                    j += 2
                    continue
                if sql[j] == ch:
                    break
                j += 1
            out.append(sql[i:j + 1])
            i = j + 1
        elif ch.isalnum() or ch in "_$":
            j = i
            while j < len(sql) and (sql[j].isalnum() or sql[j] in "_$"):
                j += 1
            out.append(sql[i:j])
            i = j
        else:
            out.append(ch)
            i += 1
    return out


def _name(tok: str) -> str:
    if tok[:1] == "`":
        return tok[1:-1].replace("``", "`")
    if tok[:1] == '"':
        return tok[1:-1].replace('""', '"')
    return tok


def _is_name(tok: str) -> bool:
    return bool(tok) and (tok[0] in "`\"" or tok[0].isalnum() or tok[0] in "_$")


class _P:
    def __init__(self, toks: list[str]) -> None:
        self.t = toks
        self.i = 0

    def peek(self, k: int = 0) -> str:
        j = self.i + k
        return self.t[j] if j < len(self.t) else ""

    def kw(self, *words: str) -> bool:
        """Consume the keywords if they come next (case-insensitive)."""
        for k, w in enumerate(words):
            if self.peek(k).lower() != w:
                return False
        self.i += len(words)
        return True

    def take(self) -> str:
        tok = self.peek()
        self.i += 1
        return tok

    def table(self, default_db: str) -> TableId:
        first = _name(self.take())
        if self.peek() == ".":
            self.i += 1
            return TableId(first, _name(self.take()))
        return TableId(default_db, first)

    def balanced(self) -> list[str]:
        """Tokens up to the next top-level comma or end, parentheses balanced."""
        depth = 0
        out = []
        while self.i < len(self.t):
            tok = self.peek()
            if tok == "," and depth == 0:
                break
            if tok == "(":
                depth += 1
            elif tok == ")":
                if depth == 0:
                    break
                depth -= 1
            out.append(self.take())
        return out


def _column_def(toks: list[str]) -> tuple[str, str, bool, str]:
    """(name, normalised type, nullable, placement) of ``name type [attributes]``."""
    name = _name(toks[0])
    type_toks: list[str] = []
    i = 1
    depth = 0
    while i < len(toks):
        tok = toks[i]
        if depth == 0 and tok.lower() in _TYPE_STOP:
            break
        depth += tok == "("
        depth -= tok == ")"
        type_toks.append(tok)
        i += 1
    text = ""
    for tok in type_toks:
        if tok in "(),":
            text = text.rstrip() + tok
        else:
            text += tok + " "
    rest = [t.lower() for t in toks[i:]]
    nullable = not any(rest[k] == "not" and k + 1 < len(rest) and rest[k + 1] == "null" for k in range(len(rest)))
    if "primary" in rest:
        nullable = False
    placement = ""
    if "first" in rest:
        placement = "first"
    elif "after" in rest:
        k = rest.index("after")
        placement = "after:" + _name(toks[i + k + 1]) if i + k + 1 < len(toks) else ""
    return name, normalize_source_type(text.strip()), nullable, placement


def _alter_actions(p: _P) -> list[tuple[str, ...]]:
    acts: list[tuple[str, ...]] = []
    while p.i < len(p.t):
        if p.peek() == ",":
            p.i += 1
            continue
        if p.kw("add"):
            if p.kw("column"):
                pass
            elif p.peek().lower() in ("index", "key", "unique", "primary", "constraint", "fulltext", "spatial",
                                      "foreign", "partition", "check", "period", "system"):
                acts.append(("other",))
                p.balanced()
                continue
            p.kw("if", "not", "exists")
            if p.peek() == "(":
                p.i += 1
                while p.peek() not in (")", ""):
                    if p.peek() == ",":
                        p.i += 1
                        continue
                    n, st, nullable, place = _column_def(p.balanced())
                    acts.append(("add", n, st, "1" if nullable else "0", place))
                p.i += 1
                continue
            n, st, nullable, place = _column_def(p.balanced())
            acts.append(("add", n, st, "1" if nullable else "0", place))
        elif p.kw("drop"):
            if p.peek().lower() in ("index", "key", "primary", "foreign", "constraint", "partition", "check"):
                acts.append(("other",))
                p.balanced()
                continue
            p.kw("column")
            p.kw("if", "exists")
            acts.append(("drop", _name(p.take())))
            p.balanced()
        elif p.kw("modify"):
            p.kw("column")
            p.kw("if", "exists")
            n, st, nullable, place = _column_def(p.balanced())
            acts.append(("modify", n, n, st, "1" if nullable else "0", place))
        elif p.kw("change"):
            p.kw("column")
            p.kw("if", "exists")
            old = _name(p.take())
            n, st, nullable, place = _column_def(p.balanced())
            acts.append(("modify", old, n, st, "1" if nullable else "0", place))
        elif p.kw("rename", "column"):
            old = _name(p.take())
            p.kw("to")
            acts.append(("rename_column", old, _name(p.take())))
            p.balanced()
        elif p.kw("rename"):
            if p.peek().lower() in ("index", "key"):
                p.balanced()
                acts.append(("other",))
                continue
            p.kw("to") or p.kw("as")
            acts.append(("rename_table", *_split_qualified(p)))
        else:
            p.balanced()
            acts.append(("other",))
    return acts


def _split_qualified(p: _P) -> tuple[str, ...]:
    first = _name(p.take())
    if p.peek() == ".":
        p.i += 1
        return (first, _name(p.take()))
    return ("", first)


def parse_ddl(sql: str, default_db: str) -> list[Ddl]:
    """What a Query event's statement does to tables; ``[]`` when it touches none we follow."""
    p = _P(_tokens(sql))
    if p.kw("truncate"):
        p.kw("table")
        return [Ddl("truncate", p.table(default_db))]
    if p.kw("alter"):
        p.kw("online")
        p.kw("ignore")
        if not p.kw("table"):
            return []
        p.kw("if", "exists")
        table = p.table(default_db)
        out: list[Ddl] = []
        acts = _alter_actions(p)
        col_acts = tuple(a for a in acts if a[0] not in ("rename_table",))
        out.append(Ddl("alter", table, actions=col_acts))
        for a in acts:
            if a[0] == "rename_table":
                out.append(Ddl("rename", table, TableId(a[1] or table.schema, a[2])))
        return out
    if p.kw("rename", "table") or p.kw("rename", "tables"):
        out = []
        while p.i < len(p.t):
            p.kw("if", "exists")
            old = p.table(default_db)
            p.kw("to")
            new = p.table(default_db)
            out.append(Ddl("rename", old, new))
            if not (p.peek() == "," and p.take()):
                break
        return out
    if p.kw("drop"):
        p.kw("temporary")
        if not p.kw("table"):
            return []
        p.kw("if", "exists")
        out = []
        while p.i < len(p.t) and _is_name(p.peek()):
            out.append(Ddl("drop", p.table(default_db)))
            if not (p.peek() == "," and p.take()):
                break
        return out
    if p.kw("create"):
        p.kw("or", "replace")
        p.kw("temporary")
        if not p.kw("table"):
            return []
        p.kw("if", "not", "exists")
        return [Ddl("create", p.table(default_db))]
    return []


def apply_alter(schema: TableSchema, actions: tuple[tuple[str, ...], ...]) -> TableSchema | None:
    """The schema after ALTER TABLE column actions; None when an action cannot be applied
    (the next table map then defines the new shape)."""
    cols = list(schema.columns)
    key = list(schema.key)

    def index(name: str) -> int:
        for i, c in enumerate(cols):
            if c.name.lower() == name.lower():
                return i
        raise KeyError(name)

    def place(col: Column, where: str, at: int | None = None) -> None:
        if where == "first":
            cols.insert(0, col)
        elif where.startswith("after:"):
            cols.insert(index(where[6:]) + 1, col)
        elif at is not None:
            cols.insert(at, col)
        else:
            cols.append(col)

    try:
        for a in actions:
            if a[0] == "add":
                place(Column(a[1], arrow_type(a[2]), a[2], a[3] == "1"), a[4])
            elif a[0] == "drop":
                dropped = cols.pop(index(a[1]))
                key = [k for k in key if k != dropped.name]
            elif a[0] == "modify":
                i = index(a[1])
                old = cols.pop(i)
                new = Column(a[2], arrow_type(a[3]), a[3], a[4] == "1")
                place(new, a[5], at=i)
                key = [new.name if k == old.name else k for k in key]
            elif a[0] == "rename_column":
                i = index(a[1])
                old = cols[i]
                cols[i] = Column(a[2], old.type, old.source_type, old.nullable)
                key = [a[2] if k == old.name else k for k in key]
    except (KeyError, ValueError):
        return None
    names = [c.name for c in cols]
    key = [k for k in names if k in key]  # key in column order, as the table map gives it
    return TableSchema(schema.table, tuple(cols), tuple(key), schema.version)
