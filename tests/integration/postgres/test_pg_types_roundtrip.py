"""Every supported type round-trips exactly, identically through the snapshot and the stream."""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from datetime import UTC, date, datetime, time
from decimal import Decimal
from typing import Any

import asyncpg
import pyarrow as pa
import pytest
from pg_helpers import Driver, changes, marks

from cdcd.config import Config
from cdcd.events import ChangeEvent
from devtools.servers import PostgresServer

pytestmark = pytest.mark.pg18  # also on PostgreSQL 18 (docs/testing.md)

DDL = """
CREATE TYPE mood AS ENUM ('sad', 'happy');
CREATE DOMAIN posint AS int4 CHECK (VALUE > 0);
CREATE DOMAIN money2 AS numeric(12, 2);
CREATE TABLE t (
  id int PRIMARY KEY, i2 int2, i4 int4, i8 int8, n numeric(38,10), nf numeric, f4 float4, f8 float8, f8n float8,
  b bool, tx text, vc varchar(20), ch char(5), by bytea, d date, tm time, ttz timetz, ts timestamp, tstz timestamptz,
  iv interval, u uuid, j json, jb jsonb, ai int4[], at text[], an numeric(10,2)[], ats timestamptz[], m mood,
  dm posint, dn money2, am mood[], rng int4range, ai2 int4[][]
)
"""

VALUES = """(1, -32768, 2147483647, -9223372036854775808, '-1234567890123456789012345678.0123456789',
  '0.000000000000000000000000000000000000001', '-Infinity', '0.1', 'NaN', true, '', 'ünïcödé ✓ 🐘', 'ab', '\\x00ff10',
  '2024-02-29', '24:00:00', '13:14:15.5+02', '2024-01-02 03:04:05.123456', '2024-01-02 03:04:05.5+05:30',
  '-1 year -2 mons +3 days -04:05:06.5', 'A0EEBC99-9C0B-4EF8-BB6D-6BB9BD380A11', '{"b": 1,  "a": [1, 2]}',
  '{"b": 1,  "a": null}', '{1,NULL,3}', '{"a b",NULL,"NULL","","x,\\"y"}', '{1.5,NULL}',
  '{"2024-01-01 00:00:00+02",NULL}', 'happy', 5, '9.99', '{sad,happy}', '[1,5)', '{{1,2},{3,4}}'),
  (2, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
  NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL),
  (3, 0, 0, 0, '0', '-0.5', 'Infinity', '-1.5e300', '1', false, 'x', 'y', '', '\\x', '-infinity', '00:00:00',
  '00:00:00-03:30', 'infinity', '-infinity', '0', '00000000-0000-0000-0000-000000000000', '[]', '{}', '{}', '{}', '{}',
  '{}', 'sad', 1, '-0.01', '{}', 'empty', '{}')"""

ROW1: dict[str, Any] = {
    "id": 1, "i2": -32768, "i4": 2147483647, "i8": -(2**63), "n": Decimal("-1234567890123456789012345678.0123456789"),
    "nf": "0.000000000000000000000000000000000000001", "f4": -math.inf, "f8": 0.1, "b": True, "tx": "",
    "vc": "ünïcödé ✓ 🐘", "ch": "ab   ", "by": b"\x00\xff\x10", "d": date(2024, 2, 29), "tm": time.max,
    "ttz": "13:14:15.5+02", "ts": datetime(2024, 1, 2, 3, 4, 5, 123456),
    "tstz": datetime(2024, 1, 1, 21, 34, 5, 500000, tzinfo=UTC), "iv": "P-1Y-2M3DT-4H-5M-6.5S",
    "u": "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11", "j": '{"b": 1,  "a": [1, 2]}', "jb": '{"a": null, "b": 1}',
    "ai": [1, None, 3], "at": ["a b", None, "NULL", "", 'x,"y'], "an": [Decimal("1.50"), None],
    "ats": [datetime(2023, 12, 31, 22, 0, tzinfo=UTC), None], "m": "happy", "dm": 5, "dn": Decimal("9.99"),
    "am": ["sad", "happy"], "rng": "[1,5)", "ai2": [[1, 2], [3, 4]],
}
ROW3: dict[str, Any] = {
    "id": 3, "i2": 0, "i4": 0, "i8": 0, "n": Decimal("0"), "nf": "-0.5", "f4": math.inf, "f8": -1.5e300, "f8n": 1.0,
    "b": False, "tx": "x", "vc": "y", "ch": "     ", "by": b"", "d": date.min, "tm": time(0, 0),
    "ttz": "00:00:00-03:30",
    "ts": datetime.max, "tstz": datetime.min.replace(tzinfo=UTC), "iv": "PT0S",
    "u": "00000000-0000-0000-0000-000000000000", "j": "[]", "jb": "{}", "ai": [], "at": [], "an": [], "ats": [],
    "m": "sad", "dm": 1, "dn": Decimal("-0.01"), "am": [], "rng": "empty", "ai2": [],
}


def check(rows: dict[int, dict[str, Any]]) -> None:
    one = dict(rows[1])
    assert math.isnan(one.pop("f8n"))
    assert one == ROW1
    assert rows[2] == {k: (2 if k == "id" else None) for k in ROW1 | {"f8n": 0}}
    assert rows[3] == ROW3


async def test_types_round_trip_through_snapshot_and_stream(make_config: Callable[..., Config],
                                                            sql: Callable[[str], str]) -> None:
    sql(DDL)
    sql(f"INSERT INTO t VALUES {VALUES}")
    async with Driver(make_config(["public.t"])) as d:
        items = await d.take(lambda got: bool(marks(got, "snapshot_done")))
        snap = changes(items)
        sql("DELETE FROM t")
        sql(f"INSERT INTO t VALUES {VALUES}")
        streamed = [e for e in await d.events(6) if e.op.value == "c"]
    assert len(snap) == 3 and len(streamed) == 3
    check({e.after["id"]: e.after for e in snap if e.after})
    check({e.after["id"]: e.after for e in streamed if e.after})
    # Same landing schema from the catalog (snapshot) and from the Relation message (stream).
    assert snap[0].schema == streamed[0].schema
    types = {c.name: c.type for c in snap[0].schema.columns}
    assert types["n"] == pa.decimal128(38, 10) and types["nf"] == pa.string() and types["tstz"] == pa.timestamp(
        "us", tz="UTC")
    assert types["ai2"] == pa.list_(pa.list_(pa.int32())) and types["dn"] == pa.decimal128(12, 2)
    assert types["iv"] == types["ttz"] == types["u"] == types["m"] == types["rng"] == pa.string()
    # Every value fits its Arrow type (what the landing sink will do).
    for ev in snap + streamed:
        assert isinstance(ev, ChangeEvent) and ev.after is not None
        for col in ev.schema.columns:
            pa.array([ev.after[col.name]], type=col.type)


def _tricky_strings(seed: int, count: int) -> list[list[str | None]]:
    """Arrays of strings full of what array literals must quote: quotes, backslashes, commas, braces, NULL."""
    rnd = random.Random(seed)
    alphabet = ['"', "\\", ",", "{", "}", " ", "'", "NULL", "null", "a", "é", "✓", "\t", "\n", "x y", "",
                "\x1f", "\xa0", "\u2003"]  # not quoted by array_out, yet Python's str.strip() eats them
    out: list[list[str | None]] = []
    for _ in range(count):
        arr: list[str | None] = []
        for _ in range(rnd.randrange(0, 6)):
            arr.append(None if rnd.random() < 0.1 else "".join(rnd.choice(alphabet) for _ in range(rnd.randrange(6))))
        out.append(arr)
    return out


async def test_text_arrays_and_table_quirks_round_trip(pg_server: PostgresServer, pg_db: str,
                                                       make_config: Callable[..., Config],
                                                       sql: Callable[[str], str]) -> None:
    sql("CREATE TABLE q (id int PRIMARY KEY, gone int, arr text[], total int GENERATED ALWAYS AS (id * 2) STORED);"
        "ALTER TABLE q DROP COLUMN gone")
    values = _tricky_strings(7, 60)
    conn = await asyncpg.connect(pg_server.dsn(pg_db))
    try:
        await conn.executemany("INSERT INTO q (id, arr) VALUES ($1, $2)", list(enumerate(values[:30])))
        async with Driver(make_config(["public.q"])) as d:
            items = await d.take(lambda got: bool(marks(got, "snapshot_done")))
            await conn.executemany("INSERT INTO q (id, arr) VALUES ($1, $2)", [(i + 30, v) for i, v in
                                                                              enumerate(values[30:])])
            streamed = await d.events(30)
    finally:
        await conn.close()
    snap = changes(items)
    assert [e.after for e in snap] == [{"id": i, "arr": v} for i, v in enumerate(values[:30])]
    assert [e.after for e in streamed] == [{"id": i + 30, "arr": v} for i, v in enumerate(values[30:])]
    # Generated columns are not published by pgoutput, so the snapshot leaves them out too: one schema.
    assert snap[0].schema == streamed[0].schema and snap[0].schema.column_names == ("id", "arr")
