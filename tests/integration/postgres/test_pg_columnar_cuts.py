"""Blocks cut inside runs of row messages: the columnar stream still equals the row path, event by event.

The stream takes a run of one table's row messages whole when no block cut (``BLOCK_ROWS``, ``BLOCK_BYTES``)
falls inside it, and message by message otherwise. Here the transactions change one table for many
statements in a row (the tables and values of ``test_pg_columnar_stream.py``), and the limits are tiny, so
runs are taken both ways and cut inside.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from pg_helpers import Driver
from source_driver import events_of
from test_pg_columnar_stream import DDL, Workload, _config, _describe, _read, _same

from cdcd.config import Config
from cdcd.events import ChangeBlock, ChangeEvent, Item
from cdcd.sources.postgres import blocks as pg_blocks
from devtools.servers import PostgresServer


class Runs(Workload):
    """``Workload`` whose statements stay on one table for up to 40 statements."""

    def __init__(self, seed: int) -> None:
        super().__init__(seed)
        self.left = 0
        self.table = "t"

    def statement(self) -> str:
        rng = self.rng
        if not self.left:
            self.table, self.left = rng.choice(list(self.live)), rng.randint(1, 40)
        self.left -= 1
        table = self.table
        if len(self.live[table]) < 3 or rng.random() < 0.45:
            return self._insert(table)
        return self._update(table) if rng.random() < 0.7 else self._delete(table)


@pytest.mark.parametrize("rows, size", [(3, 1 << 20), (8192, 3000), (8192, 1 << 20)])
async def test_blocks_cut_inside_runs_equal_the_row_path(
        pg_server: PostgresServer, pg_db: str, make_config: Callable[..., Config], sql: Callable[[str], str],
        monkeypatch: pytest.MonkeyPatch, rows: int, size: int) -> None:
    monkeypatch.setattr(pg_blocks, "BLOCK_ROWS", rows)
    monkeypatch.setattr(pg_blocks, "BLOCK_BYTES", size)
    sql(DDL)
    w = Runs(7)
    col_cfg, row_cfg = (_config(make_config, pg_db, f"s_{name}_{pg_db}", False) for name in ("col", "row"))
    async with Driver(col_cfg, expand_blocks=False) as col, Driver(row_cfg) as row:
        row.source._stream.columnar = False  # type: ignore[attr-defined]
        # every table has rows first: an update's statement needs some in nk (and deletes keep two)
        sql("BEGIN; " + " ".join(w._insert(t) for t in list(w.live) * 3) + " COMMIT;")
        for _ in range(12):
            sql(w.transaction(w.rng.randint(20, 120)))
        sql("INSERT INTO done VALUES (1);")
        col_items, row_items = await _read(col), await _read(row)
    blocks = [i for i in col_items if isinstance(i, ChangeBlock)]
    assert max(b.rows for b in blocks) <= rows
    if rows == 3:
        assert sum(b.rows == 3 for b in blocks) > 50  # cut by rows, inside runs
    elif size == 3000:  # cut by bytes: at most one message (under 60 kB here) past the limit
        assert all(b.data.nbytes < 3000 + 60_000 for b in blocks) and any(b.rows > 1 for b in blocks)
    else:
        assert max(b.rows for b in blocks) > 20  # whole runs
    col_events = events_of(col_items)
    row_events = [i for i in row_items if isinstance(i, ChangeEvent)]
    assert len(col_events) == len(row_events) > 500
    for a, b in zip(col_events, row_events, strict=True):
        assert _same(_describe(a), _describe(b)), (a, b)

    def commits(items: list[Item]) -> list[Any]:
        return [(i.kind, i.position) for i in items if not isinstance(i, ChangeEvent | ChangeBlock)
                and i.kind == "commit"]
    assert commits(col_items) == commits(row_items)
