"""The columnar snapshot path: RowBlocks for keyed tables, the row path for keyless ones, chunk ends, resume."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import asyncpg
from pg_helpers import Driver, marks
from source_driver import opening_truncate
from test_pg_types_roundtrip import DDL, VALUES, check

from cdcd.config import Config
from cdcd.events import ChangeEvent, Item, RowBlock
from devtools.servers import PostgresServer


def blocks(items: list[Item], table: str) -> list[RowBlock]:
    return [i for i in items if isinstance(i, RowBlock) and str(i.table) == table]


async def test_keyed_tables_come_as_blocks_keyless_ones_as_rows_with_equal_values(
        make_config: Callable[..., Config], sql: Callable[[str], str]) -> None:
    sql(DDL)
    sql(f"INSERT INTO t VALUES {VALUES}")
    sql("CREATE TABLE k AS SELECT * FROM t; ALTER TABLE k REPLICA IDENTITY FULL")  # no key: the row path
    async with Driver(make_config(["public.t", "public.k"]), expand_blocks=False) as d:
        items = await d.take(lambda got: bool(marks(got, "snapshot_done")))
    fast = blocks(items, "public.t")
    rows = [i for i in items if isinstance(i, ChangeEvent) and not opening_truncate(i)]
    assert fast and all(str(e.table) == "public.k" for e in rows) and len(rows) == 3
    check({r["id"]: r for b in fast for r in b.data.to_pylist()})
    check({e.after["id"]: e.after for e in rows if e.after})
    # CREATE TABLE AS drops declared array dimensions (ai2) and NOT NULL; the Arrow types are the same.
    assert [(c.name, c.type) for c in fast[0].schema.columns if c.name != "ai2"] == \
        [(c.name, c.type) for c in rows[0].schema.columns if c.name != "ai2"]


async def test_chunk_ends_and_resume_inside_a_block_with_awkward_text_keys(
        pg_server: PostgresServer, pg_db: str, make_config: Callable[..., Config],
        sql: Callable[[str], str]) -> None:
    sql("CREATE TABLE w (k text, n int, v text, PRIMARY KEY (k, n))")
    keys = ["a\tb", "a\nb", "a\\b", "a'b", 'a"b', "\ufeffbom", "", "\\N", "NULL", "x,y", "é", "\\.", " lead", "tail "]
    conn = await asyncpg.connect(pg_server.dsn(pg_db))
    try:
        await conn.executemany("INSERT INTO w VALUES ($1, $2, $3)",
                               [(k, n, f"{k}|{n}") for k in keys for n in range(3)])
        want = [(r["k"], r["n"]) for r in await conn.fetch("SELECT k, n FROM w ORDER BY k, n")]
    finally:
        await conn.close()
    cfg = make_config(["public.w"], snapshot={"chunk_rows": 5, "parallelism": 1})
    async with Driver(cfg, expand_blocks=False) as d:
        items = await d.take(lambda got: bool(marks(got, "snapshot_done")))
    got = [(r["k"], r["n"]) for b in blocks(items, "public.w") for r in b.data.to_pylist()]
    assert got == want  # every row once, in key order, across chunk ends
    assert all(b.rows <= 5 for b in blocks(items, "public.w"))
    assert all(r["v"] == f"{r['k']}|{r['n']}" for b in blocks(items, "public.w") for r in b.data.to_pylist())
    # Commit the start mark, two blocks and 3 rows of the third (the runtime splits blocks between batches).
    first = blocks(items, "public.w")
    committed: list[Item] = [items[0], first[0], first[1], first[2].slice(0, 3)]
    async with Driver(cfg, expand_blocks=False) as probe:
        state = probe.source.fold({}, committed)
    assert state["snapshot"]["tables"]["public.w"]["rows"] == 13
    async with Driver(cfg, committed[-1].position, state, expand_blocks=False) as d2:
        again = await d2.take(lambda got: bool(marks(got, "snapshot_done")))
    rest: list[Any] = [(r["k"], r["n"]) for b in blocks(again, "public.w") for r in b.data.to_pylist()]
    assert rest == want[13:]
