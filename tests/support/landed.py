"""What the landing zone holds, as the tests ask it: the keys that landed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from cdcd.landing.reader import read_batches


def landed_ids(landing: Path, table: str | None = None, column: str = "id") -> set[Any]:
    """Every non-null value of ``column`` in the rows landed so far (of ``table``, ``schema.name``, when given)."""
    if not landing.exists():
        return set()
    return {r[column] for b in read_batches(landing) for name, t in b.tables.items()
            if (table is None or str(name) == table) and column in t.column_names
            for r in t.select([column]).to_pylist() if r[column] is not None}
