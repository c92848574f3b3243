"""Schema history: the table schema in force at each binlog position.

Row events are decoded with the column list of their own table-map event
(``binlog_row_metadata=FULL`` puts names, signedness, charsets, enum/set
values and the primary key in the binlog), so old events always decode with
the columns they were written with. The history gives those shapes stable
version numbers across restarts, carries the richer snapshot types, and
follows DDL (``ALTER TABLE ... ADD/DROP/MODIFY/CHANGE/RENAME COLUMN``,
``RENAME TABLE``, ``TRUNCATE``) from Query events. It is persisted in the
source state that ``fold`` returns.
"""

from __future__ import annotations

import bisect
import re
from dataclasses import dataclass
from typing import Any

from cdcd.events import Column, TableId, TableSchema
from cdcd.positions import MySqlPosition, position_from_json
from cdcd.sources.mysql.types import arrow_type, normalize_source_type, quote_values

MAX_VERSIONS_KEPT = 64

# pymysqlreplication FIELD_TYPE codes
_INT_NAMES = {1: "tinyint", 2: "smallint", 9: "mediumint", 3: "int", 8: "bigint"}
_BLOB_TEXT = {1: ("tinyblob", "tinytext"), 2: ("blob", "text"), 3: ("mediumblob", "mediumtext"),
              4: ("longblob", "longtext")}


def binlog_source_type(col: Any) -> str:
    """The COLUMN_TYPE-style name of a table-map column (a pymysqlreplication Column)."""
    t = col.type
    binary = getattr(col, "character_set_name", None) == "binary"
    if t in _INT_NAMES:
        return _INT_NAMES[t] + (" unsigned" if col.unsigned else "")
    if t == 246:
        return f"decimal({col.precision},{col.decimals})"
    if t == 4:
        return "float"
    if t == 5:
        return "double"
    if t in (15, 253):
        return "varbinary" if binary else "varchar"
    if t == 254:
        return f"binary({col.max_length})" if binary else "char"
    if t in (249, 250, 251, 252):
        blob, text = _BLOB_TEXT.get(getattr(col, "length_size", 2), ("blob", "text"))
        return blob if binary else text
    if t in (10, 14):
        return "date"
    if t in (12, 18):
        return f"datetime({getattr(col, 'fsp', 0)})"
    if t in (7, 17):
        return f"timestamp({getattr(col, 'fsp', 0)})"
    if t in (11, 19):
        return f"time({getattr(col, 'fsp', 0)})"
    if t == 13:
        return "year"
    if t == 245:
        return "json"
    if t == 247:
        return f"enum({quote_values(list(col.enum_values or [''])[1:])})"
    if t == 248:
        return f"set({quote_values(list(col.set_values or []))})"
    if t == 16:
        return f"bit({col.bits})"
    if t == 255:
        return "geometry"
    raise ValueError(f"binlog column type code {t} of column {col.name!r} is not supported")


def schema_from_table_map(table: TableId, columns: list[Any]) -> TableSchema:
    """A TableSchema (version 0) from a table map's columns; key in column order."""
    cols = []
    key = []
    for i, c in enumerate(columns):
        if not c.name:
            raise ValueError(
                f"the binlog has no column names for {table} (column {i}): set binlog_row_metadata=FULL"
            )
        st = binlog_source_type(c)
        cols.append(Column(c.name, arrow_type(st), st))
        if getattr(c, "is_primary", False):
            key.append(c.name)
    return TableSchema(table, tuple(cols), tuple(key))


#: MariaDB types the binlog's table map shows as fixed binary strings (their stored bytes).
_STORED_AS_BINARY = {"uuid": "binary(16)", "inet6": "binary(16)", "inet4": "binary(4)"}


def refine_types(derived: TableSchema, known: TableSchema | None) -> TableSchema:
    """The table map's schema with the types the binlog cannot name (UUID, INET6, INET4) taken from ``known``.

    ``known`` is the schema the history holds (from the snapshot's information_schema or from the DDL
    that added the column): where it names one of those types for a column the table map shows as
    the matching BINARY(n), the column keeps the richer type, so the stream lands the same text as the
    snapshot.
    """
    if known is None:
        return derived
    by_name = {c.name: c for c in known.columns}
    cols = []
    changed = False
    for c in derived.columns:
        k = by_name.get(c.name)
        if k is not None and _STORED_AS_BINARY.get(k.source_type.split("(")[0]) == c.source_type:
            cols.append(Column(c.name, k.type, k.source_type, c.nullable))
            changed = True
        else:
            cols.append(c)
    return TableSchema(derived.table, tuple(cols), derived.key, derived.version) if changed else derived


def same_shape(a: TableSchema, b: TableSchema) -> bool:
    """Equal for landing purposes: names, Arrow types and key (not type spelling or nullability)."""
    return (
        a.key == b.key
        and len(a.columns) == len(b.columns)
        and all(x.name == y.name and x.type == y.type for x, y in zip(a.columns, b.columns, strict=True))
    )


def schema_to_json(s: TableSchema) -> dict[str, Any]:
    return {
        "columns": [[c.name, c.source_type, c.nullable] for c in s.columns],
        "key": list(s.key),
        "version": s.version,
    }


def schema_from_json(table: TableId, doc: dict[str, Any]) -> TableSchema:
    cols = tuple(Column(n, arrow_type(st), st, bool(nullable)) for n, st, nullable in doc["columns"])
    return TableSchema(table, cols, tuple(doc["key"]), int(doc["version"]))


@dataclass
class _Entry:
    pos: MySqlPosition
    schema: TableSchema


class SchemaHistory:
    """Per table, the schemas in force from each position on."""

    def __init__(self) -> None:
        self._entries: dict[TableId, list[_Entry]] = {}

    def at(self, table: TableId, pos: MySqlPosition) -> TableSchema | None:
        """The schema in force at ``pos`` (the last one recorded at or before it)."""
        entries = self._entries.get(table)
        if not entries:
            return None
        i = bisect.bisect_right([e.pos for e in entries], pos)
        return entries[i - 1].schema if i else None

    def latest(self, table: TableId) -> TableSchema | None:
        entries = self._entries.get(table)
        return entries[-1].schema if entries else None

    def record(self, pos: MySqlPosition, schema: TableSchema) -> TableSchema:
        """Record ``schema`` as in force from ``pos``; returns it with its version number."""
        entries = self._entries.setdefault(schema.table, [])
        for e in entries:
            if e.pos == pos:
                return e.schema  # already known (a replay)
        version = max((e.schema.version for e in entries), default=0) + 1
        s = TableSchema(schema.table, schema.columns, schema.key, version)
        bisect.insort(entries, _Entry(pos, s), key=lambda e: e.pos)
        del entries[:-MAX_VERSIONS_KEPT]
        return s

    def add_entry(self, pos: MySqlPosition, schema: TableSchema) -> None:
        """Add an entry with its version as is (loading, folding); duplicates are ignored."""
        entries = self._entries.setdefault(schema.table, [])
        if any(e.pos == pos for e in entries):
            return
        bisect.insort(entries, _Entry(pos, schema), key=lambda e: e.pos)
        del entries[:-MAX_VERSIONS_KEPT]

    def to_json(self) -> dict[str, Any]:
        return {
            str(t): [{"pos": e.pos.to_json(), "schema": schema_to_json(e.schema)} for e in entries]
            for t, entries in sorted(self._entries.items())
        }

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> SchemaHistory:
        h = cls()
        for name, entries in doc.items():
            table = TableId.parse(name)
            for e in entries:
                pos = position_from_json(e["pos"])
                assert isinstance(pos, MySqlPosition)
                h.add_entry(pos, schema_from_json(table, e["schema"]))
        return h


# ---------------------------------------------------------------- DDL

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
