"""Which column is which: a Relation message's columns matched with the catalog's ``pg_attribute`` rows (read by the
relation's OID), so that every landed column carries its ``attnum`` as its id (a rename keeps it, a column dropped
and added again gets a new one), and a column added with a constant default carries the value the rows existing
then hold (``attmissingval``: PostgreSQL 11+ stores it once instead of rewriting them).

The catalog is read after the DDL the Relation reflects, maybe after more DDL on the table: ``resolve`` matches by
name, checks the match against what attnums allow (they only grow and are never reused; a Relation lists the live
columns in attnum order) and says why when the catalog cannot tell. docs/postgres.md, "Schema changes", says what
the source then does.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cdcd.sources.postgres.types import parse_array

#: A column as the source knew it before a Relation message: (name, id or None, source type).
Known = tuple[str, int | None, str]


@dataclass(frozen=True, slots=True)
class Attribute:
    """One ``pg_attribute`` row of a table (``attnum > 0``, dropped ones included)."""

    attnum: int
    name: str
    type_oid: int
    typmod: int
    dropped: bool = False
    generated: bool = False  # pgoutput does not send generated columns
    missing: str | None = None  # the value rows written before the column existed hold (server's text), if any
    has_default: bool = False  # a default or identity: without ``missing``, an ADD COLUMN rewrote the table

    @property
    def live(self) -> bool:
        return not self.dropped and not self.generated


_ATTRIBUTES = (
    "SELECT attnum, attname, atttypid, atttypmod, attisdropped, attgenerated <> '' AS generated, "
    "CASE WHEN atthasmissing THEN attmissingval::text END AS missing, atthasdef OR attidentity <> '' AS has_default "
    "FROM pg_attribute WHERE attrelid = $1 AND attnum > 0 ORDER BY attnum")


async def read_attributes(conn: Any, oid: int) -> tuple[Attribute, ...]:
    """The table's attributes now (empty: the relation is gone)."""
    rows = await conn.fetch(_ATTRIBUTES, oid)
    out = []
    for r in rows:
        missing = r["missing"]
        if missing is not None:  # an array of one element, of the column's type
            missing = parse_array(missing)[0]
        out.append(Attribute(r["attnum"], r["attname"], r["atttypid"], r["atttypmod"], r["attisdropped"],
                             r["generated"], missing, r["has_default"]))
    return tuple(out)


@dataclass(frozen=True, slots=True)
class Resolution:
    """The Relation's columns' ids (None: unknown), the columns new to the source and why the catalog cannot tell
    (empty: it can)."""

    ids: tuple[int | None, ...]
    new: tuple[bool, ...]
    doubts: tuple[str, ...]


def resolve(rel: Sequence[tuple[str, str]], attrs: Sequence[Attribute], old: Sequence[Known],
            top: int = 0) -> Resolution:
    """Match the Relation's columns (name, source type) with the catalog's ``attrs`` (read later than the Relation
    was written) given the columns the source knew before (``old``) and the largest attnum it ever saw (``top``:
    a dropped column at or below it that ``old`` does not have was dropped while the source knew it, or before)."""
    live = {a.name: a for a in attrs if a.live}
    by_num = {a.attnum: a for a in attrs}
    old_ids = {num: kind for _, num, kind in old if num is not None}
    old_by_name = {name: num for name, num, _ in old if num is not None}
    doubts: list[str] = []
    ids: list[int | None] = [live[name].attnum if name in live else None for name, _ in rel]
    for i, (name, _) in enumerate(rel):
        if ids[i] is not None:
            continue
        # The column the source knew under this name, renamed since this Relation (still live under another name)
        # or dropped since (a DROP within the stream's lag): its attnum is the name's.
        o = old_by_name.get(name)
        if o is not None and o in by_num and not by_num[o].generated and o not in ids:
            ids[i] = o
        else:
            doubts.append(f"column {name!r} is not in the catalog any more (renamed or dropped since)")
    known = [n for n in ids if n is not None]
    if any(a >= b for a, b in itertools.pairwise(known)):
        doubts.append("the catalog orders the columns otherwise (renamed again since)")
    elif known:
        # A live column older than one of the Relation's existed when it was written: the Relation must have it.
        skipped = [a.name for a in attrs if a.live and a.attnum < known[-1] and a.attnum not in known]
        if skipped:
            doubts.append(f"the catalog's column(s) {', '.join(map(repr, skipped))} are missing from it (renamed "
                          "since)")
    top = max(top, max(old_ids, default=0))
    new = tuple(n is None or n not in old_ids for n in ids)
    for i, ((name, kind), num) in enumerate(zip(rel, ids, strict=True)):
        if not new[i] or num is None:
            continue
        # A column new to the source may instead be one dropped since: the name added again after this Relation.
        low = max((n for n in ids[:i] if n is not None), default=0)
        for d in range(low + 1, num):
            a = by_num.get(d)
            if a is None or not a.dropped or d in ids or (d <= top and d not in old_ids):
                continue  # not a column, or dropped before the source knew the table
            if d > top or old_ids[d] == kind:
                doubts.append(f"column {name!r} (attnum {num}) may be attnum {d}, dropped since: the same "
                              "name added again after it")
                break
    return Resolution(tuple(ids), new, tuple(doubts))
