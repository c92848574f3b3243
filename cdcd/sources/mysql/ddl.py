"""DDL statements from the binlog's Query events, as far as they change captured tables.

``parse_ddl`` reads what a statement does (``ALTER TABLE ... ADD/DROP/MODIFY/CHANGE/RENAME COLUMN``,
``RENAME TABLE``, ``TRUNCATE``, ``DROP``, ``CREATE``) from the tokens of ``ddllex.py`` (the server's lexical
rules: quoted names, strings, comments, versioned comments) and DEFAULT literals. ``alter.py`` gives the table
schema after an ALTER's column actions; the schema history (``schema.py``) records the result.
"""

from __future__ import annotations

from dataclasses import dataclass

from cdcd.events import TableId
from cdcd.sources.mysql.ddllex import Default, is_name, literal, tokens, unquote
from cdcd.sources.mysql.types import normalize_source_type

#: sql_mode bits of a Query event's status variables that change how the statement is read
MODE_ANSI_QUOTES = 1 << 2
MODE_NO_BACKSLASH_ESCAPES = 1 << 20


@dataclass(frozen=True)
class ColumnDef:
    """``name type [attributes]`` of ADD / MODIFY / CHANGE."""

    name: str
    source_type: str  # normalised (types.normalize_source_type)
    nullable: bool = True
    placement: str = ""  # "" (in place or last), "first", "after:<column>"
    default: Default | None = None
    generated: bool = False  # AS (expr) / GENERATED ALWAYS AS: every row holds its own value
    auto_increment: bool = False
    type_text: str = ""  # as written (normalising lower-cases ENUM and SET labels)


@dataclass(frozen=True)
class Action:
    """One clause of an ALTER TABLE: ``add``, ``drop``, ``modify`` (MODIFY and CHANGE: ``name`` the old name,
    ``column`` the new definition), ``rename_column`` (``name`` to ``new_name``), ``rename_table`` or ``other``
    (indexes, options, ``ALGORITHM=INSTANT``: no change to the columns)."""

    kind: str
    name: str = ""
    column: ColumnDef | None = None
    new_name: str = ""
    if_exists: bool = False  # IF EXISTS / IF NOT EXISTS: a missing (or present) column skips the clause
    table: TableId | None = None  # rename_table: the new name (schema "" = the statement's own database)


@dataclass(frozen=True)
class Ddl:
    """What a DDL statement does to captured tables."""

    kind: str  # "alter" | "truncate" | "rename" | "drop" | "create" | "other"
    table: TableId | None = None
    new_table: TableId | None = None
    actions: tuple[Action, ...] = ()  # alter: the column clauses, in statement order


_TYPE_STOP = {"not", "null", "default", "auto_increment", "comment", "primary", "unique", "key", "character",
              "charset", "collate", "first", "after", "generated", "as", "check", "references", "on",
              "invisible", "visible", "stored", "virtual", "persistent", "without", "with", "constraint",
              "serial", "column_format", "storage", "compressed", "engine_attribute", "secondary_engine_attribute",
              "srid", "ref_system_id", "encrypted", "encryption_key_id"}

class _P:
    def __init__(self, toks: list[str], ansi_quotes: bool = False, backslash: bool = True) -> None:
        self.t = toks
        self.i = 0
        self.ansi_quotes = ansi_quotes
        self.backslash = backslash

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
        first = unquote(self.take())
        if self.peek() == ".":
            self.i += 1
            return TableId(first, unquote(self.take()))
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


def _column_def(toks: list[str], ansi_quotes: bool = False, backslash: bool = True) -> ColumnDef:
    """``name type [attributes]``."""
    name = unquote(toks[0])
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
    nullable, placement, default = True, "", None
    generated = auto_increment = False
    k = i
    while k < len(toks):
        low = toks[k].lower()
        if low == "not" and k + 1 < len(toks) and toks[k + 1].lower() == "null":
            nullable = False
            k += 2
        elif low == "primary" or low == "serial":
            nullable = False
            k += 1
        elif low == "default":
            default, used = literal(toks[k + 1:], ansi_quotes, backslash)
            k += 1 + used
        elif low == "first":
            placement = "first"
            k += 1
        elif low == "after" and k + 1 < len(toks):
            placement = "after:" + unquote(toks[k + 1])
            k += 2
        elif low in ("generated", "as"):
            generated = True
            k += 1
        elif low == "auto_increment":
            auto_increment = True
            k += 1
        elif toks[k] == "(":  # an expression (CHECK, AS): skip it whole
            d = 0
            while k < len(toks):
                d += (toks[k] == "(") - (toks[k] == ")")
                k += 1
                if d == 0:
                    break
        else:
            k += 1
    return ColumnDef(name, normalize_source_type(text.strip()), nullable, placement, default, generated,
                     auto_increment, text.strip())


_ADD_OTHER = ("index", "key", "unique", "primary", "constraint", "fulltext", "spatial", "foreign", "partition",
              "check", "period", "system", "vector")
_DROP_OTHER = ("index", "key", "primary", "foreign", "constraint", "partition", "check", "period", "system",
               "default")


def _alter_actions(p: _P) -> list[Action]:
    acts: list[Action] = []

    def coldef() -> ColumnDef:
        return _column_def(p.balanced(), p.ansi_quotes, p.backslash)

    while p.i < len(p.t):
        if p.peek() in (",", ";"):
            p.i += 1
            continue
        if p.kw("add"):
            if not p.kw("column") and p.peek().lower() in _ADD_OTHER:
                acts.append(Action("other"))
                p.balanced()
                continue
            guarded = p.kw("if", "not", "exists")
            if p.peek() == "(":  # ADD [COLUMN] (a int, b int)
                p.i += 1
                while p.peek() not in (")", ""):
                    if p.peek() == ",":
                        p.i += 1
                        continue
                    acts.append(Action("add", column=coldef(), if_exists=guarded))
                p.i += 1
                continue
            acts.append(Action("add", column=coldef(), if_exists=guarded))
        elif p.kw("drop"):
            if p.peek().lower() in _DROP_OTHER and p.peek(1) not in (",", ""):
                acts.append(Action("other"))
                p.balanced()
                continue
            p.kw("column")
            guarded = p.kw("if", "exists")
            acts.append(Action("drop", unquote(p.take()), if_exists=guarded))
            p.balanced()  # RESTRICT / CASCADE
        elif p.kw("modify"):
            p.kw("column")
            guarded = p.kw("if", "exists")
            col = coldef()
            acts.append(Action("modify", col.name, col, if_exists=guarded))
        elif p.kw("change"):
            p.kw("column")
            guarded = p.kw("if", "exists")
            old = unquote(p.take())
            acts.append(Action("modify", old, coldef(), if_exists=guarded))
        elif p.kw("rename", "column"):
            guarded = p.kw("if", "exists")
            old = unquote(p.take())
            p.kw("to")
            acts.append(Action("rename_column", old, new_name=unquote(p.take()), if_exists=guarded))
            p.balanced()
        elif p.kw("rename"):
            if p.peek().lower() in ("index", "key"):
                p.balanced()
                acts.append(Action("other"))
                continue
            p.kw("to") or p.kw("as")
            acts.append(Action("rename_table", table=_qualified(p)))
        else:
            p.balanced()
            acts.append(Action("other"))
    return acts


def _qualified(p: _P) -> TableId:
    first = unquote(p.take())
    if p.peek() == ".":
        p.i += 1
        return TableId(first, unquote(p.take()))
    return TableId("", first)


def parse_ddl(sql: str, default_db: str, sql_mode: int = 0) -> list[Ddl]:
    """What a Query event's statement does to tables; ``[]`` when it touches none we follow. ``sql_mode`` (the
    event's) says whether ``"`` quotes names (ANSI_QUOTES) and whether backslashes escape (NO_BACKSLASH_ESCAPES)."""
    ansi = bool(sql_mode & MODE_ANSI_QUOTES)
    backslash = not sql_mode & MODE_NO_BACKSLASH_ESCAPES
    p = _P(tokens(sql, ansi, backslash), ansi, backslash)
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
        if p.kw("wait"):  # MariaDB: WAIT n | NOWAIT
            p.take()
        p.kw("nowait")
        out: list[Ddl] = []
        acts = _alter_actions(p)
        col_acts = tuple(a for a in acts if a.kind != "rename_table")
        out.append(Ddl("alter", table, actions=col_acts))
        for a in acts:
            if a.kind == "rename_table" and a.table is not None:
                out.append(Ddl("rename", table, TableId(a.table.schema or table.schema, a.table.name)))
        return out
    if p.kw("rename", "table") or p.kw("rename", "tables"):
        out = []
        while p.i < len(p.t):
            p.kw("if", "exists")
            old = p.table(default_db)
            if p.kw("wait"):
                p.take()
            p.kw("nowait")
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
        while p.i < len(p.t) and is_name(p.peek()):
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
