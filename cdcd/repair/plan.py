"""Which keys to re-sync: the differing keys verify found, as one key list per table.

verify buckets rows by a hash of their key and reads only the rows of the buckets whose checksums differ, so it
ends with the exact keys that differ (missing, extra, changed): the smallest ranges there are. A table's keys go
to the daemon as one ``KEY IN (...)`` re-sync (``cdcd.landing.keyrange``): one request per table, because a newer
request for a table replaces a queued one. Its covered record makes the merge remove the listed keys the source
no longer has. Up to MAX_KEYS keys per table; beyond that a whole-table re-sync is the cheaper repair.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cdcd.verify.compare import TableDiff

MAX_KEYS = 10_000


@dataclass(frozen=True, slots=True)
class Resync:
    """The re-sync of one table's differing keys (their verify texts, in order)."""

    table: str
    column: str
    keys: tuple[str, ...]

    def where(self, quoted: bool) -> str:
        """The ``--where`` condition: integers as they are, else quoted text (SQL quotes doubled)."""
        col = self.column
        items = ", ".join(("'" + k.replace("'", "''") + "'") if quoted else k for k in self.keys)
        return f"{col} IN ({items})"

    @property
    def numeric(self) -> bool:
        return all(_is_int(k) for k in self.keys)


def _is_int(text: str) -> bool:
    return text.lstrip("-").isdigit()


def differing_keys(diff: TableDiff) -> list[str]:
    """The one-column keys verify found differing, as texts (a note, not a key, is left out)."""
    out: list[str] = []
    for k in (*diff.missing, *diff.extra, *diff.changed):
        if isinstance(k, tuple) and len(k) == 1 and str(k[0]) not in out:
            out.append(str(k[0]))
    return out


def plan(diff: TableDiff, key: list[str]) -> Resync | str:
    """The table's re-sync, or why it cannot be one by key list (the operator's way instead)."""
    keys = differing_keys(diff)
    composite: Any = [k for k in (*diff.missing, *diff.extra, *diff.changed) if not isinstance(k, tuple) or len(k) != 1]
    if len(key) != 1 or composite:
        return (f"{diff.table}: the key has {len(key)} columns; a key-list re-sync takes a one-column key: run "
                f"`cdcd snapshot {diff.table}` (the whole table)")
    if not key[0].isidentifier():  # quoted names differ by source (` or "): the request takes a plain name
        return (f"{diff.table}: the key column {key[0]!r} needs quoting; run `cdcd snapshot {diff.table}` "
                "(the whole table)")
    if len(keys) > MAX_KEYS:
        return (f"{diff.table}: {len(keys)} keys differ (more than {MAX_KEYS:,}): run `cdcd snapshot {diff.table}` "
                "(the whole table), cheaper than a key list that long")
    return Resync(diff.table, key[0], tuple(keys))
