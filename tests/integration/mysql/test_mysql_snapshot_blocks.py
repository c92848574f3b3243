"""A MariaDB snapshot arrives as columnar RowBlocks that land exactly what the old per-row path landed."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pyarrow as pa
from source_driver import SourceDriver, opening_truncate
from test_mysql_types_roundtrip import DDL, ROWS

from cdcd.config import Config
from cdcd.events import ChangeEvent, Mark, RowBlock, TableSchema
from cdcd.sources.mysql import MySqlSource
from cdcd.sources.mysql.connection import open_connection
from cdcd.sources.mysql.queries import quote_ident
from cdcd.sources.mysql.types import snapshot_converter


async def _row_path(source: MySqlSource, block_schema: TableSchema) -> pa.Table:
    """The table as the old path built it: per-value converter, one dict per row, pa.array per column."""
    conn = await open_connection(source.conn.settings())
    try:
        names = block_schema.column_names
        async with conn.cursor() as cur:
            await cur.execute(f"SELECT {', '.join(quote_ident(n) for n in names)} FROM "
                              f"{quote_ident(block_schema.table.schema)}.{quote_ident(block_schema.table.name)} "
                              "ORDER BY id")
            raw = await cur.fetchall()
    finally:
        conn.close()
    convs = [snapshot_converter(c.source_type) for c in block_schema.columns]
    rows = [{n: v if v is None or f is None else f(v) for n, v, f in zip(names, r, convs, strict=True)}
            for r in raw]
    return pa.Table.from_arrays([pa.array([r[c.name] for r in rows], type=c.type) for c in block_schema.columns],
                                names=list(names))


async def test_keyed_snapshot_lands_row_blocks_equal_to_the_row_path(make_config: Callable[..., Config],
                                                                    sql: Callable[..., Any]) -> None:
    sql(DDL, f"INSERT INTO t VALUES {ROWS[0]}, {ROWS[1]}, {ROWS[2]}",
        "INSERT INTO t (id) SELECT seq + 10 FROM seq_1_to_5")
    source = MySqlSource(make_config(["t"], snapshot={"chunk_rows": 3}))
    async with SourceDriver(source, expand_blocks=False) as d:
        items = await d.until_mark("snapshot_done")
        blocks = [i for i in items if isinstance(i, RowBlock)]
        assert blocks and not any(isinstance(i, ChangeEvent) and not opening_truncate(i) for i in items)
        assert [b.rows for b in blocks] == [3, 3, 2]  # one block per keyset chunk
        assert all(b.snapshot and b.position == items[-1].position for b in blocks)
        schema = blocks[0].schema
        landed = pa.concat_tables([b.data for b in blocks])
        expected = await _row_path(source, schema)
        assert landed.schema.types == [c.type for c in schema.columns]
        assert landed.to_pylist() == expected.to_pylist()
        assert landed.equals(expected)
    # the fold records the committed slice's own last key, not the whole block's
    start = next(i for i in items if isinstance(i, Mark) and i.kind == "snapshot_start")
    state = source.fold({}, [start, blocks[0], blocks[1].slice(0, 1)])
    assert state["snapshot"]["tables"][str(schema.table)]["last_key"] == [blocks[1].key_at(0)[0]]  # type: ignore[index]
