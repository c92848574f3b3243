"""The columnar change stream (ChangeBlocks) equals the row path (one ChangeEvent per row), event by event.

A generated workload runs on a real MariaDB: every type rowimage reads (the columns and edge values of
``test_mysql_rowimage``), composite and changed keys, a keyless table, MINIMAL and NOBLOB row images
(unavailable columns), several tables and statements per transaction, a schema change mid-stream, TRUNCATE,
RENAME/DROP/CREATE of a captured table and transactions larger than a block. Its binlog is decoded twice
from the same start, by ``Decoder(columnar=True)`` and ``Decoder(columnar=False)``: the blocks' rows must
be the row path's events (values, positions, ops, before rows, unavailable columns, keys and key changes),
the marks must be the same at the same positions, and what lands from a block (also cut in two, as a
mid-transaction batch cut does) must be what lands from the row path's events.
"""

from __future__ import annotations

import itertools
import random
from typing import Any

import pyarrow as pa
import pymysql
import pytest
from pymysqlreplication import BinLogStreamReader
from source_driver import events_of
from test_mysql_rowimage import COLUMNS, EDGE_ROWS, _connect, _position

from cdcd.events import ChangeBlock, ChangeEvent, Item, Mark, TableId
from cdcd.sinks.arrow import block_to_table, events_to_table
from cdcd.sources.mysql import decode
from cdcd.sources.mysql.binlog import _EVENTS
from cdcd.sources.mysql.columnar import BLOCK_ROWS, BlockBuilder, build_blocks
from cdcd.sources.mysql.schema import SchemaHistory
from devtools.servers import MariaDBServer

_server_ids = itertools.count(7301)
NAMES = [n for n, _ in COLUMNS]
TABLES = ["t", "k", "nk", "big", "done"]
DDL = [
    "CREATE TABLE t (id INT PRIMARY KEY, " + ", ".join(f"`{n}` {t}" for n, t in COLUMNS) + ") CHARACTER SET utf8mb4",
    "CREATE TABLE k (a INT, b VARCHAR(8), v INT, w TEXT, PRIMARY KEY (a, b)) CHARACTER SET utf8mb4",
    "CREATE TABLE nk (x INT, y VARCHAR(10), z BLOB) CHARACTER SET utf8mb4",
    "CREATE TABLE big (id INT PRIMARY KEY, v VARCHAR(20), n DECIMAL(12, 2))",
    "CREATE TABLE done (id INT PRIMARY KEY)",
]


class Workload:
    """Random statements over the tables; keeps the live keys so updates and deletes hit rows."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.t: list[int] = []
        self.k: list[tuple[int, str]] = []
        self.next_id = 1

    def _row(self) -> dict[str, Any]:
        """Each column's value from a random edge row, or NULL."""
        rng = self.rng
        return {n: None if rng.random() < 0.15 else rng.choice(EDGE_ROWS).get(n) for n in NAMES}

    def _t(self) -> tuple[str, list[Any]]:
        rng = self.rng
        if len(self.t) < 3 or rng.random() < 0.4:
            rows = [self._row() for _ in range(rng.choice([1, 1, 2, 5]))]
            ids = []
            for _ in rows:
                ids.append(self.next_id)
                self.next_id += 1
            self.t += ids
            marks = "(" + ", ".join(["%s"] * (len(NAMES) + 1)) + ")"
            cols = ", ".join(f"`{n}`" for n in NAMES)
            params = [v for i, r in zip(ids, rows, strict=True) for v in (i, *r.values())]
            return f"INSERT INTO t (id, {cols}) VALUES " + ", ".join([marks] * len(rows)), params
        rid = rng.choice(self.t)
        if rng.random() < 0.25:
            self.t.remove(rid)
            return "DELETE FROM t WHERE id = %s", [rid]
        picked = rng.sample(NAMES, rng.randint(1, 4))
        row = self._row()
        sets = [f"`{n}` = %s" for n in picked]
        params: list[Any] = [row[n] for n in picked]
        if rng.random() < 0.2:  # a key change
            new = self.next_id
            self.next_id += 1
            self.t.remove(rid)
            self.t.append(new)
            sets.append("id = %s")
            params.append(new)
        return f"UPDATE t SET {', '.join(sets)} WHERE id = %s", [*params, rid]

    def _k(self) -> tuple[str, list[Any]]:
        rng = self.rng
        if len(self.k) < 3 or rng.random() < 0.4:
            key = (self.next_id, rng.choice(["a", "é", "", "😀x"]))
            self.next_id += 1
            self.k.append(key)
            values = [*key, rng.choice([None, 1, -5]), rng.choice([None, "w"])]
            return "INSERT INTO k (a, b, v, w) VALUES (%s, %s, %s, %s)", values
        key = rng.choice(self.k)
        r = rng.random()
        if r < 0.2:
            self.k.remove(key)
            return "DELETE FROM k WHERE a = %s AND b = %s", list(key)
        if r < 0.5:  # a key change of one key column
            new = (key[0], key[1] + "z")
            self.k.remove(key)
            self.k.append(new)
            return "UPDATE k SET b = %s WHERE a = %s AND b = %s", [new[1], *key]
        return "UPDATE k SET v = %s, w = %s WHERE a = %s AND b = %s", [rng.randint(-9, 9), "ww", *key]

    def _nk(self) -> tuple[str, list[Any]]:
        rng = self.rng
        if rng.random() < 0.7:
            values = [rng.randint(0, 5), rng.choice(["p", None]), b"\x00z"]
            return "INSERT INTO nk (x, y, z) VALUES (%s, %s, %s)", values
        return "DELETE FROM nk WHERE x = %s LIMIT 1", [rng.randint(0, 5)]

    def statement(self) -> tuple[str, list[Any]]:
        r = self.rng.random()
        return self._t() if r < 0.6 else self._k() if r < 0.85 else self._nk()

    def transaction(self, cur: Any, size: int) -> None:
        image = self.rng.choice(["FULL", "FULL", "MINIMAL", "NOBLOB"])
        cur.execute(f"SET SESSION binlog_row_image = {image}")
        cur.execute("BEGIN")
        for _ in range(size):
            cur.execute(*self.statement())
        cur.execute("COMMIT")


def _run_workload(conn: pymysql.connections.Connection, seed: int) -> None:
    w = Workload(seed)
    with conn.cursor() as cur:
        for _ in range(40):
            w.transaction(cur, w.rng.randint(1, 10))
        cur.execute("SET SESSION binlog_row_image = FULL")
        cur.execute("ALTER TABLE k ADD COLUMN extra INT")  # a schema change mid-stream ends a block
        for _ in range(20):
            w.transaction(cur, w.rng.randint(1, 10))
        cur.execute("SET SESSION binlog_row_image = FULL")
        # transactions larger than a block: cut at BLOCK_ROWS rows, positions go on across the cut
        cur.execute("SET SESSION max_recursive_iterations = 100000")
        cur.execute("BEGIN")
        cur.execute(f"INSERT INTO big WITH RECURSIVE s(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM s WHERE n < "
                    f"{2 * BLOCK_ROWS + 100}) SELECT n, CONCAT('v', n), n / 7 FROM s")
        cur.execute("INSERT INTO done VALUES (0)")  # another table between two statements of big
        cur.execute("UPDATE big SET v = 'u', id = id + 100000 WHERE id % 3 = 0")
        cur.execute("DELETE FROM big WHERE id % 5 = 0")
        cur.execute("COMMIT")
        cur.execute("TRUNCATE TABLE nk")
        for _ in range(10):
            w.transaction(cur, w.rng.randint(1, 10))
        cur.execute("SET SESSION binlog_row_image = FULL")
        cur.execute("RENAME TABLE nk TO nk_old")
        cur.execute("CREATE TABLE nk (x INT, y VARCHAR(10), z BLOB, q INT)")
        cur.execute("DROP TABLE nk_old")
        for _ in range(10):
            w.transaction(cur, w.rng.randint(1, 10))
        cur.execute("SET SESSION binlog_row_image = FULL")
        cur.execute("INSERT INTO done VALUES (1)")


def _decode_all(server: MariaDBServer, db: str, start: tuple[str, int], columnar: bool,
                defer_builds: bool = False) -> list[Item]:
    reader = BinLogStreamReader(
        connection_settings={"host": "127.0.0.1", "port": server.port, "user": "root", "password": ""},
        server_id=next(_server_ids), log_file=start[0], log_pos=start[1], resume_stream=True, blocking=False,
        only_events=_EVENTS, only_schemas=[db], filter_non_implemented_events=False,
    )
    decoder = decode.Decoder("mariadb", {TableId(db, t) for t in TABLES}, SchemaHistory(), start[0], "",
                             columnar=columnar, defer_builds=defer_builds)
    out: list[Item] = []
    try:
        for ev in reader:
            out.extend(decoder.feed(ev))
    finally:
        reader.close()
    assert not decoder.pending
    return out


def _describe(e: ChangeEvent) -> dict[str, Any]:
    return {"table": str(e.table), "schema": e.schema, "op": e.op, "position": e.position, "before": e.before,
            "after": e.after, "unavailable": e.unavailable, "tx": e.tx_id, "commit_ts": e.commit_ts,
            "snapshot": e.snapshot, "key": e.key, "before_key": e.before_key}


def _touched(e: ChangeEvent) -> list[tuple[Any, ...]]:
    """What the incremental snapshot's window records of one row event (``incremental.Window.record``); only
    tables with a key have incremental snapshots (chunks.py refuses the others)."""
    if not e.schema.key:
        return []
    out = [(e.position, e.tx_id, e.key, bool(e.unavailable))]
    if e.before_key is not None:
        out.append((e.position, e.tx_id, e.before_key, False))
    return out


@pytest.mark.parametrize("seed", [1, 2])
def test_columnar_stream_equals_the_row_path_event_by_event(maria_server: MariaDBServer, maria_db: str,
                                                            seed: int) -> None:
    conn = _connect(maria_server, maria_db)
    try:
        with conn.cursor() as cur:
            for statement in DDL:
                cur.execute(statement)
        start = _position(conn)
        _run_workload(conn, seed)
    finally:
        conn.close()
    col_items = _decode_all(maria_server, maria_db, start, columnar=True)
    row_items = _decode_all(maria_server, maria_db, start, columnar=False)
    # the stream's way: blocks handed on unbuilt, then every transaction's blocks of one table built together
    deferred = _decode_all(maria_server, maria_db, start, columnar=True, defer_builds=True)
    assert any(isinstance(i, BlockBuilder) for i in deferred)
    together = build_blocks(deferred)
    assert not any(isinstance(i, BlockBuilder) for i in together)
    assert len(together) == len(col_items)
    for a, b in zip(together, col_items, strict=True):
        assert type(a) is type(b)
        if isinstance(a, ChangeBlock):
            assert isinstance(b, ChangeBlock)
            assert (a.start, a.tx_id, a.commit_ts, a.rows, a.positions()) == \
                (b.start, b.tx_id, b.commit_ts, b.rows, b.positions())
            assert [_describe(e) for e in a.events()] == [_describe(e) for e in b.events()]
            assert block_to_table(a.schema, 7, 3, a).to_pylist() == block_to_table(b.schema, 7, 3, b).to_pylist()

    blocks = [i for i in col_items if isinstance(i, ChangeBlock)]
    assert blocks and all(b.rows for b in blocks)
    assert any(b.rows > 1 for b in blocks) and any(b.key_changed is not None for b in blocks)
    assert any(b.unavailable is not None for b in blocks)
    assert any(b.seqs is not None for b in blocks)  # rows of several rows events, with position gaps
    # a transaction larger than a block is cut once a block reaches BLOCK_ROWS rows (after a whole rows event)
    big = [b for b in blocks if b.table.name == "big" and b.ops[0].as_py() == "c"]
    assert len(big) >= 2 and big[0].rows >= BLOCK_ROWS and len({b.tx_id for b in big}) == 1
    assert not [i for i in col_items if isinstance(i, ChangeEvent) and i.op.value != "t"]  # rowimage reads all
    assert not [i for i in row_items if isinstance(i, ChangeBlock)]

    col_events = events_of(col_items)
    row_events = [i for i in row_items if isinstance(i, ChangeEvent)]
    assert len(col_events) == len(row_events) > 3 * BLOCK_ROWS
    for a, b in zip(col_events, row_events, strict=True):
        assert _describe(a) == _describe(b), (a, b)
    # the order of everything: marks (commits, schema changes, DDL) at the same places and positions
    def shape(items: list[Item]) -> list[Any]:
        out: list[Any] = []
        for i in items:
            if isinstance(i, ChangeBlock):
                out.extend(("row", p) for p in i.positions())
            elif isinstance(i, ChangeEvent):
                out.append(("row", i.position) if i.op.value != "t" else ("truncate", i.position))
            else:
                assert isinstance(i, Mark)
                out.append((i.kind, i.position, i.detail))
        return out
    assert shape(col_items) == shape(row_items)
    kinds = {k[0] for k in shape(row_items)}
    assert {"schema", "ddl", "commit", "truncate"} <= kinds, kinds

    by_position = {e.position: e for e in row_events}
    for block in blocks:
        events = [by_position[p] for p in block.positions()]
        # the incremental snapshot's window sees the same keys and key changes
        assert block.touched() == [t for e in events for t in _touched(e)]
        # what lands: the block's table is the table of the row path's events at the same positions
        landed = block_to_table(block.schema, 7, 3, block)
        expected = events_to_table(block.schema, 7, events, range(3, 3 + block.rows))
        assert landed.schema == expected.schema
        assert landed.to_pylist() == expected.to_pylist()
        # a batch cut inside the block lands the same rows on either side, and the skip rule keeps the rest
        if block.rows > 2:
            cut = block.rows // 2
            head, tail = block.slice(0, cut), block.slice(cut)
            assert head.position == block.position_at(cut - 1) and tail.start == block.position_at(cut)
            parts = pa.concat_tables([block_to_table(block.schema, 7, 3, head),
                                      block_to_table(block.schema, 7, 3 + cut, tail)])
            assert parts.to_pylist() == expected.to_pylist()
            after = block.after(head.position)
            assert after is not None and after.positions() == tail.positions()
            assert block.after(block.position) is None and block.after(head.start) is not None
