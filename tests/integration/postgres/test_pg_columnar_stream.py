"""The columnar change stream (ChangeBlocks) equals the row path (one ChangeEvent per row), event by event.

Two sources read the same generated workload from two slots created at the same point: one with the
columnar decoder (the default), one with the row path (``PgStream.columnar = False``). Every type of the
type tests, REPLICA IDENTITY DEFAULT / FULL / USING INDEX, keyless tables, key changes, unchanged TOAST
values, schema changes mid-stream, truncates, rolled-back subtransactions and (protocol 2) transactions
streamed while in progress. The landed tables are compared too: a block's against the row path's events'.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from typing import Any

import pyarrow as pa
import pytest
from pg_helpers import Driver
from source_driver import events_of

from cdcd.config import Config
from cdcd.events import ChangeBlock, ChangeEvent, Item
from cdcd.runtime.interfaces import Batch
from cdcd.sinks.arrow import block_to_table, events_to_table
from cdcd.sinks.landing import _group
from devtools.servers import PostgresServer

TYPES = """
CREATE TYPE mood AS ENUM ('sad', 'happy');
CREATE DOMAIN posint AS int4 CHECK (VALUE > 0);
CREATE DOMAIN money2 AS numeric(12, 2);
"""
COLUMNS = """i2 int2, i4 int4, i8 int8, n numeric(38,10), nf numeric, f4 float4, f8 float8, b bool, tx text,
  vc varchar(20), ch char(5), by bytea, d date, tm time, ttz timetz, ts timestamp, tstz timestamptz, iv interval,
  u uuid, j json, jb jsonb, ai int4[], at text[], an numeric(10,2)[], ats timestamptz[], m mood, dm posint,
  dn money2, am mood[], rng int4range, ai2 int4[][], big text"""

# SQL literals per column (NULL is always a choice too): the values of the type tests and their edge cases
POOLS: dict[str, list[str]] = {
    "i2": ["-32768", "0", "32767"], "i4": ["2147483647", "-1", "0"], "i8": ["-9223372036854775808", "42"],
    "n": ["'-1234567890123456789012345678.0123456789'", "'0'", "'NaN'", "'1.5'"],
    "nf": ["'0.000000000000000000000000000000000000001'", "'NaN'", "'-0.5'", "'Infinity'"],
    "f4": ["'-Infinity'", "'0.1'", "'NaN'", "'3.4e38'", "'-0'"], "f8": ["'0.1'", "'NaN'", "'-1.5e300'", "'Infinity'"],
    "b": ["true", "false"], "tx": ["''", "'ünïcödé ✓ 🐘'", "E'tab\\there\\nnew\\\\line'", "'NULL'"],
    "vc": ["'y'", "'ünïcödé ✓ 🐘'"], "ch": ["'ab'", "''"], "by": ["'\\x00ff10'", "'\\x'"],
    "d": ["'2024-02-29'", "'infinity'", "'-infinity'", "'0001-01-01'", "'0044-03-15 BC'"],
    "tm": ["'24:00:00'", "'00:00:00'", "'13:14:15.123456'"], "ttz": ["'13:14:15.5+02'", "'00:00:00-03:30'"],
    "ts": ["'2024-01-02 03:04:05.123456'", "'infinity'", "'-infinity'", "'10000-01-01 00:00:00'"],
    "tstz": ["'2024-01-02 03:04:05.5+05:30'", "'-infinity'", "'infinity'"],
    "iv": ["'-1 year -2 mons +3 days -04:05:06.5'", "'0'"],
    "u": ["'A0EEBC99-9C0B-4EF8-BB6D-6BB9BD380A11'", "'00000000-0000-0000-0000-000000000000'"],
    "j": ["'{\"b\": 1,  \"a\": [1, 2]}'", "'[]'"], "jb": ["'{\"b\": 1,  \"a\": null}'", "'{}'"],
    "ai": ["'{1,NULL,3}'", "'{}'"], "at": ["'{\"a b\",NULL,\"NULL\",\"\",\"x,\\\"y\"}'", "'{}'"],
    "an": ["'{1.5,NULL}'", "'{}'"], "ats": ["'{\"2024-01-01 00:00:00+02\",NULL}'", "'{}'"],
    "m": ["'happy'", "'sad'"], "dm": ["5", "1"], "dn": ["'9.99'", "'-0.01'"], "am": ["'{sad,happy}'", "'{}'"],
    "rng": ["'[1,5)'", "'empty'"], "ai2": ["'{{1,2},{3,4}}'", "'{}'"],
    # out-of-line TOAST (STORAGE EXTERNAL): an update that leaves it alone sends it as unchanged
    "big": ["repeat('x', 5000)", "repeat('ab', 4000) || 'é'", "'small'"],
}
NAMES = list(POOLS)

DDL = TYPES + f"""
CREATE TABLE t (id int PRIMARY KEY, {COLUMNS});
CREATE TABLE f (id int PRIMARY KEY, {COLUMNS}); ALTER TABLE f REPLICA IDENTITY FULL;
CREATE TABLE x (id int PRIMARY KEY, u2 int NOT NULL, {COLUMNS}); CREATE UNIQUE INDEX x_u2 ON x (u2);
ALTER TABLE x REPLICA IDENTITY USING INDEX x_u2;
CREATE TABLE nk ({COLUMNS}); ALTER TABLE nk REPLICA IDENTITY FULL;
CREATE TABLE ak (id int4[] PRIMARY KEY, v float8, big text);
CREATE TABLE nn (id numeric(10,2) PRIMARY KEY, v float4, big text);
CREATE TABLE done (id int PRIMARY KEY);
""" + "".join(f"ALTER TABLE {t} ALTER COLUMN big SET STORAGE EXTERNAL;" for t in ("t", "f", "x", "nk", "ak", "nn"))
TABLES = ["public.t", "public.f", "public.x", "public.nk", "public.ak", "public.nn", "public.done"]


def _value(rng: random.Random, name: str) -> str:
    return "NULL" if rng.random() < 0.15 else rng.choice(POOLS[name])


class Workload:
    """Random transactions over the tables; keeps the live keys so updates and deletes hit rows."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.live: dict[str, list[int]] = {"t": [], "f": [], "x": [], "nk": [], "ak": [], "nn": []}
        self.next_id = 1
        self.extra = False  # t has the column added mid-stream

    def _insert(self, table: str) -> str:
        rng, i = self.rng, self.next_id
        self.next_id += 1
        self.live[table].append(i)
        if table == "ak":
            return f"INSERT INTO ak VALUES ('{{{i},{i % 3}}}', {rng.choice(['0.5', 'NULL', quote('NaN')])}, " \
                   f"{_value(rng, 'big')});"
        if table == "nn":
            return f"INSERT INTO nn VALUES ({i}.25, {rng.choice(['0.5', 'NULL', quote('NaN')])}, {_value(rng, 'big')});"
        names = list(NAMES)
        values = [_value(rng, n) for n in names]
        if table != "nk":
            names.insert(0, "id")
            values.insert(0, str(i))
        if table == "x":
            names.insert(1, "u2")
            values.insert(1, str(i))
        if table == "t" and self.extra:
            names.append("extra")
            values.append(str(i))
        return f"INSERT INTO {table} ({', '.join(names)}) VALUES ({', '.join(values)});"

    def _update(self, table: str) -> str:
        rng = self.rng
        i = rng.choice(self.live[table])
        where = {"ak": f"id = '{{{i},{i % 3}}}'", "nn": f"id = {i}.25",
                 "nk": f"ctid = (SELECT ctid FROM nk OFFSET {rng.randrange(len(self.live['nk']))} LIMIT 1)"}.get(
            table, f"id = {i}")
        if table in ("ak", "nn"):
            if rng.random() < 0.3:  # a key change
                j = self.next_id
                self.next_id += 1
                self.live[table].remove(i)
                self.live[table].append(j)
                new = f"'{{{j},{j % 3}}}'" if table == "ak" else f"{j}.25"
                return f"UPDATE {table} SET id = {new} WHERE {where};"
            return f"UPDATE {table} SET v = {rng.choice(['1.5', 'NULL', quote('NaN')])} WHERE {where};"
        sets = [f"{n} = {_value(rng, n)}" for n in rng.sample([n for n in NAMES if n != "big"], rng.randint(1, 4))]
        if rng.random() < 0.2:
            sets.append(f"big = {_value(rng, 'big')}")
        if table in ("t", "f", "x") and rng.random() < 0.25:  # a key change (x: its identity index too)
            j = self.next_id
            self.next_id += 1
            self.live[table].remove(i)
            self.live[table].append(j)
            sets.append(f"id = {j}")
            if table == "x":
                sets.append(f"u2 = {j}")
        return f"UPDATE {table} SET {', '.join(sets)} WHERE {where};"

    def _delete(self, table: str) -> str:
        i = self.rng.choice(self.live[table])
        self.live[table].remove(i)
        if table == "nk":
            return "DELETE FROM nk WHERE ctid = (SELECT ctid FROM nk LIMIT 1);"
        where = {"ak": f"id = '{{{i},{i % 3}}}'", "nn": f"id = {i}.25"}.get(table, f"id = {i}")
        return f"DELETE FROM {table} WHERE {where};"

    def statement(self) -> str:
        rng = self.rng
        table = rng.choice(list(self.live))
        if len(self.live[table]) < 3 or rng.random() < 0.45:
            return self._insert(table)
        return self._update(table) if rng.random() < 0.7 else self._delete(table)

    def transaction(self, size: int, rollback_at: int = -1) -> str:
        body = []
        for n in range(size):
            if n == rollback_at:  # a rolled-back subtransaction of many changes (spooled while in progress)
                live = {k: list(v) for k, v in self.live.items()}
                body.append("SAVEPOINT big; " + " ".join(self.statement() for _ in range(100))
                            + " ROLLBACK TO SAVEPOINT big;")
                self.live = live
            body.append(self.statement())
            if self.rng.random() < 0.03:  # a rolled-back subtransaction: its changes never arrive
                live = {k: list(v) for k, v in self.live.items()}
                body.append("SAVEPOINT s; " + self.statement() + " ROLLBACK TO SAVEPOINT s;")
                self.live = live
        return "BEGIN; " + " ".join(body) + " COMMIT;\n"


def quote(text: str) -> str:
    return f"'{text}'"


def _same(a: Any, b: Any) -> bool:
    """Equality with NaN equal to NaN (the values are compared, not the float objects)."""
    if isinstance(a, float) and isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _describe(e: ChangeEvent) -> dict[str, Any]:
    return {"table": str(e.table), "schema": e.schema, "op": e.op, "position": e.position, "before": e.before,
            "after": e.after, "unavailable": e.unavailable, "tx": e.tx_id, "commit_ts": e.commit_ts,
            "snapshot": e.snapshot, "key": e.key, "before_key": e.before_key}


def _config(make_config: Callable[..., Config], db: str, slot: str, stream: bool) -> Config:
    return make_config(TABLES, snapshot={"mode": "never"},
                       source={"postgres": {"slot": slot, "publication": f"p_{db}", "stream_in_progress": stream}})


async def _read(d: Driver) -> list[Item]:
    """Everything up to the row of table ``done``."""
    return await d.take(lambda got: bool(got) and any(
        (isinstance(i, ChangeEvent | ChangeBlock)) and str(i.table) == "public.done" for i in got[-1:]), timeout=240)


def _workload(seed: int, streamed: bool) -> list[str]:
    w = Workload(seed)
    out = [w.transaction(w.rng.randint(1, 12)) for _ in range(40)]
    out.append("ALTER TABLE t ADD COLUMN extra int;")  # a Relation message mid-stream ends a block
    w.extra = True
    out += [w.transaction(w.rng.randint(1, 12)) for _ in range(30)]
    out.append("BEGIN; " + w._insert("t") + " TRUNCATE nn; " + w._insert("t") + " COMMIT;\n")
    w.live["nn"] = []
    out.append("ALTER TABLE x REPLICA IDENTITY FULL; ALTER TABLE f REPLICA IDENTITY DEFAULT;")
    out += [w.transaction(w.rng.randint(1, 12)) for _ in range(30)]
    if streamed:  # larger than logical_decoding_work_mem (64 kB here): the server streams them in progress
        out += [w.transaction(400, rollback_at=200) for _ in range(2)]
    out.append("INSERT INTO done VALUES (1);")
    return out


@pytest.mark.parametrize("seed, stream", [(1, False), (2, False), (3, True)])
async def test_columnar_stream_equals_the_row_path_event_by_event(
        pg_server: PostgresServer, pg_db: str, make_config: Callable[..., Config], sql: Callable[[str], str],
        seed: int, stream: bool) -> None:
    sql(DDL)
    if stream:
        pg_server.psql(f"ALTER DATABASE \"{pg_db}\" SET logical_decoding_work_mem = '64kB'")
    col_cfg, row_cfg = (_config(make_config, pg_db, f"s_{name}_{pg_db}", stream) for name in ("col", "row"))
    async with Driver(col_cfg, expand_blocks=False) as col, Driver(row_cfg) as row:
        row.source._stream.columnar = False  # type: ignore[attr-defined]
        for text in _workload(seed, stream):
            sql(text)
        col_items, row_items = await _read(col), await _read(row)
        streams = [d.source._stream for d in (col, row)]  # type: ignore[attr-defined]
        in_progress = [s._inprogress.status() for s in streams]
    if stream:  # both read protocol 2, and the large transactions came streamed in progress
        assert [s.proto_version for s in streams] == [2, 2]
        assert all(p["committed"] >= 2 and p["aborted_subtransactions"] >= 1 for p in in_progress), in_progress
    blocks = [i for i in col_items if isinstance(i, ChangeBlock)]
    assert blocks and all(b.rows for b in blocks)
    assert any(b.rows > 1 for b in blocks) and any(b.key_changed is not None for b in blocks)
    assert any(b.unavailable is not None for b in blocks)
    assert not [i for i in row_items if isinstance(i, ChangeBlock)]
    col_events = events_of(col_items)
    row_events = [i for i in row_items if isinstance(i, ChangeEvent)]
    assert len(col_events) == len(row_events) > 500
    for a, b in zip(col_events, row_events, strict=True):
        assert _same(_describe(a), _describe(b)), (a, b)
    # Marks (commits, heartbeats aside) come at the same positions
    def commits(items: list[Item]) -> list[Any]:
        return [(i.kind, i.position) for i in items if not isinstance(i, ChangeEvent | ChangeBlock)
                and i.kind == "commit"]
    assert commits(col_items) == commits(row_items)
    # What lands: each block's table equals the table of the row path's events at the same positions
    by_position = {e.position: e for e in row_events}
    for block in blocks:
        events = [by_position[block.position_at(k)] for k in range(block.rows)]
        landed = block_to_table(block.schema, 7, 3, block)
        expected = events_to_table(block.schema, 7, events, range(3, 3 + block.rows))
        assert landed.schema == expected.schema
        assert _same(landed.to_pylist(), expected.to_pylist())
        # and a batch cut inside the block lands the same rows on either side
        if block.rows > 2:
            cut = block.rows // 2
            head, tail = block.slice(0, cut), block.slice(cut)
            assert head.position == block.position_at(cut - 1) and tail.start == block.position_at(cut)
            parts = pa.concat_tables([block_to_table(block.schema, 7, 3, head),
                                      block_to_table(block.schema, 7, 3 + cut, tail)])
            assert _same(parts.to_pylist(), expected.to_pylist())
    # Every block in one batch (the landing converts a table's consecutive blocks together) lands what the
    # row path's events land, table by table
    col_groups, row_groups = _group(Batch(7, col_items)), _group(Batch(7, row_items))
    assert [(g.schema.table, g.schema.version) for g in col_groups] == \
        [(g.schema.table, g.schema.version) for g in row_groups]
    assert any(sum(type(p) is tuple for p in g.parts) > 1 for g in col_groups)
    for c, r in zip(col_groups, row_groups, strict=True):
        landed, expected = c.to_table(7), r.to_table(7)
        assert landed.schema == expected.schema
        assert _same(landed.to_pylist(), expected.to_pylist())
