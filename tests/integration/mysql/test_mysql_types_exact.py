"""MariaDB types beyond the round-trip table: snapshot and stream land the same, documented values.

UUID / INET6 / INET4 as the server's text, zero dates as NULL with a warning, FLOAT exactly, ENUM and
FLOAT keys paginated in ORDER BY order, keyless tables and huge values read in bounded blocks.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import date, timedelta
from decimal import Decimal
from typing import Any

import pytest
import structlog
from my_helpers import Driver, events_of
from source_driver import SourceDriver

from cdcd.config import Config
from cdcd.events import Op, RowBlock
from cdcd.sources.mysql import MySqlSource
from cdcd.sources.mysql.types import ZERO_DATE

DDL = """CREATE TABLE u (
  id INT PRIMARY KEY, j JSON, b1 BIT(1), b8 BIT(8), b64 BIT(64), dw DECIMAL(65,30), du DECIMAL(10,2) UNSIGNED,
  st SET('x','y','z'), e ENUM('z','a','m'), y YEAR, zd DATE, zdt DATETIME(6), zts TIMESTAMP NULL DEFAULT NULL,
  i4 INET4, i6 INET6, uu UUID, p POINT, tm TIME(6), bu BIGINT UNSIGNED, lat VARCHAR(20) CHARACTER SET latin1,
  f FLOAT
) CHARACTER SET utf8mb4"""

ROWS = [
    "(1, '{\"k\": [1, \"é\"]}', b'1', b'10000001', "
    "b'1000000000000000000000000000000000000000000000000000000000000001', "
    "'-12345678901234567890123456789012345.123456789012345678901234567891', 99999999.99, 'x,z', 'm', 2155, "
    "'0000-00-00', '0000-00-00 00:00:00', '0000-00-00 00:00:00', '192.0.2.1', '::1', "
    "'123e4567-e89b-12d3-a456-426655440000', POINT(1.5, -2), '838:59:59.000000', 18446744073709551615, "
    "'caf\u00e9 \u00e0 la cr\u00e8me', 1.2345678)",
    "(2, 'null', b'0', b'0', b'0', 0, 0, '', 'z', 0, '2024-00-15', '2024-01-00 10:00:00', NULL, '0.0.0.0', "
    "'::ffff:192.0.2.1', '00000000-0000-0000-0000-000000000000', NULL, '-838:59:59.000000', 0, '', 16777216)",
    "(3, '[]', NULL, b'11111111', NULL, NULL, NULL, NULL, 'a', 1901, '1000-01-01', NULL, NULL, '255.255.255.255', "
    "'2001:db8::ff00:42:8329', 'ffffffff-ffff-ffff-ffff-ffffffffffff', NULL, '-00:00:00.000001', NULL, NULL, "
    "-3.4028235e38)",
    "(4, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, '10.0.0.0', '::', "
    "'00000000-0000-0000-0000-000000000001', NULL, NULL, NULL, NULL, 1e-38)",
    "(5, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, '::1.2.3.4', NULL, "
    "NULL, NULL, NULL, NULL, 0.1)",
]

EXPECTED: dict[int, dict[str, Any]] = {
    1: {"j": '{"k": [1, "é"]}', "b1": b"\x01", "b8": b"\x81", "b64": b"\x80" + bytes(6) + b"\x01",
        "dw": "-12345678901234567890123456789012345.123456789012345678901234567891", "du": Decimal("99999999.99"),
        "st": "x,z", "e": "m", "y": 2155, "zd": None, "zdt": None, "zts": None, "i4": "192.0.2.1", "i6": "::1",
        "uu": "123e4567-e89b-12d3-a456-426655440000", "tm": timedelta(hours=838, minutes=59, seconds=59),
        "bu": Decimal("18446744073709551615"), "lat": "café à la crème", "f": 1.2345677614212036},
    2: {"j": "null", "b1": b"\x00", "st": "", "e": "z", "y": 0, "zd": None, "zdt": None, "i4": "0.0.0.0",
        "i6": "::ffff:192.0.2.1", "uu": "00000000-0000-0000-0000-000000000000", "bu": Decimal(0),
        "tm": -timedelta(hours=838, minutes=59, seconds=59), "f": 16777216.0},
    3: {"e": "a", "zd": date(1000, 1, 1), "i6": "2001:db8::ff00:42:8329", "i4": "255.255.255.255",
        "uu": "ffffffff-ffff-ffff-ffff-ffffffffffff", "tm": -timedelta(microseconds=1), "f": -3.4028234663852886e38},
    4: {"i4": "10.0.0.0", "i6": "::", "uu": "00000000-0000-0000-0000-000000000001"},
    5: {"i6": "::1.2.3.4", "f": 0.10000000149011612},
}


async def test_unusual_types_land_the_same_from_snapshot_and_stream(make_config: Callable[..., Config],
                                                                   sql: Callable[..., Any]) -> None:
    sql("SET SESSION sql_mode = ''", DDL, "INSERT INTO u VALUES " + ", ".join(ROWS))
    with structlog.testing.capture_logs() as logs:
        async with Driver(make_config(["u"])) as d:
            snap = {e.after["id"]: e.after  # type: ignore[index]
                    for e in events_of(await d.until_mark("snapshot_done"))}
            sql("SET SESSION sql_mode = ''", "DELETE FROM u", "INSERT INTO u VALUES " + ", ".join(ROWS),
                "ALTER TABLE u ADD COLUMN i6b INET6, ADD COLUMN ub UUID",
                "UPDATE u SET i6b = i6, ub = uu WHERE id = 1")
            evs = await d.events(11)
    stream = {e.after["id"]: e.after for e in evs if e.op is Op.CREATE}  # type: ignore[index]
    # the server's own text, read back over SQL, is what both paths land
    server = {r[0]: r[1:] for r in sql("SELECT id, CAST(i4 AS CHAR), CAST(i6 AS CHAR), CAST(uu AS CHAR) FROM u")}
    for rid in range(1, 6):
        assert snap[rid] == stream[rid], rid
        assert (snap[rid]["i4"], snap[rid]["i6"], snap[rid]["uu"]) == server[rid], rid
        for name, want in EXPECTED[rid].items():
            assert snap[rid][name] == want, (rid, name, snap[rid][name])
    # columns added while streaming: text, not the 16 stored bytes
    upd = next(e for e in evs if e.op is Op.UPDATE).after
    assert upd is not None and upd["i6b"] == "::1" and upd["ub"] == "123e4567-e89b-12d3-a456-426655440000"
    # a zero date is NULL with one warning per column
    zero = [entry["column"] for entry in logs if entry["event"] == ZERO_DATE]
    assert sorted(zero) == ["zd", "zdt", "zts"]


async def test_zero_timestamp_is_null_from_snapshot_and_stream(make_config: Callable[..., Config],
                                                               sql: Callable[..., Any]) -> None:
    sql("SET SESSION sql_mode = ''", "CREATE TABLE z (id INT PRIMARY KEY, ts TIMESTAMP NULL DEFAULT NULL)",
        "INSERT INTO z VALUES (1, '0000-00-00 00:00:00'), (2, '1970-01-01 00:00:01')")
    async with Driver(make_config(["z"])) as d:
        snap = {e.after["id"]: e.after["ts"] for e in events_of(await d.until_mark("snapshot_done"))}  # type: ignore[index]
        sql("SET SESSION sql_mode = ''", "INSERT INTO z VALUES (3, '0000-00-00 00:00:00'), (4, '1970-01-01 00:00:01')")
        stream = {e.after["id"]: e.after["ts"] for e in await d.events(2)}  # type: ignore[index]
    assert snap[1] is None and stream[3] is None
    assert snap[2] == stream[4] and snap[2] is not None and snap[2].timestamp() == 1


async def _snapshot_in_restarts(config: Config) -> list[tuple[Any, ...]]:
    """Snapshot ``config``'s table one committed block per run, restarting after each: the keys in order."""
    keys: list[tuple[Any, ...]] = []
    position, state = None, None
    for _ in range(100):
        source = MySqlSource(config)
        async with SourceDriver(source, position, state, expand_blocks=False) as d:
            got = await d.take(lambda items: bool(items) and (isinstance(items[-1], RowBlock) or (
                getattr(items[-1], "kind", "") == "snapshot_done")))
            blocks = [i for i in got if isinstance(i, RowBlock)]
            if not blocks:
                return keys
            await d.commit()
            position, state = d.position, d.state
            for b in blocks:
                keys.extend(b.key_at(i) for i in range(b.rows))  # type: ignore[misc]
    raise AssertionError("the snapshot did not end")


async def test_enum_and_float_keys_paginate_in_order_by_order(make_config: Callable[..., Config],
                                                              sql: Callable[..., Any]) -> None:
    sql("CREATE TABLE ek (id INT, e ENUM('zeta','alpha','mid'), v INT, PRIMARY KEY (id, e))",
        "INSERT INTO ek VALUES (1, 'zeta', 1), (1, 'alpha', 2), (1, 'mid', 3), (2, 'alpha', 4), (2, 'zeta', 5)",
        "CREATE TABLE fk (f FLOAT PRIMARY KEY, v INT)",
        "INSERT INTO fk VALUES (1.2345678, 1), (1.2345679, 2), (16777216, 3), (16777218, 4), (0.1, 5), "
        "(-3.4e38, 6), (1e-38, 7)")
    ek = await _snapshot_in_restarts(make_config(["ek"], snapshot={"chunk_rows": 1, "parallelism": 1}))
    assert [k[1] for k in ek] == ["zeta", "alpha", "mid", "zeta", "alpha"]  # every row, definition order
    # within one run too (no restarts)
    async with Driver(make_config(["ek", "fk"], snapshot={"chunk_rows": 1, "parallelism": 1})) as d:
        snap = events_of(await d.until_mark("snapshot_done"))
        sql("DELETE FROM fk", "INSERT INTO fk VALUES (1.2345678, 1), (1.2345679, 2), (16777216, 3), "
            "(16777218, 4), (0.1, 5), (-3.4e38, 6), (1e-38, 7)")
        stream = [e for e in await d.events(14) if e.op is Op.CREATE]
    assert len([e for e in snap if str(e.table).endswith(".ek")]) == 5
    snap_f = {e.after["v"]: e.after["f"] for e in snap if str(e.table).endswith(".fk")}  # type: ignore[index]
    stream_f = {e.after["v"]: e.after["f"] for e in stream}  # type: ignore[index]
    assert snap_f == stream_f and len(snap_f) == 7 and snap_f[4] == 16777218.0
    fk = await _snapshot_in_restarts(make_config(["fk"], snapshot={"chunk_rows": 1, "parallelism": 1}))
    assert [k[0] for k in fk] == sorted(stream_f.values())


async def test_keyless_table_and_huge_rows_are_read_in_bounded_blocks(make_config: Callable[..., Config],
                                                                      sql: Callable[..., Any]) -> None:
    sql("CREATE TABLE nk (v INT, pad LONGTEXT)", "INSERT INTO nk SELECT seq, REPEAT('p', 100000) FROM seq_1_to_40",
        "CREATE TABLE kk (id INT PRIMARY KEY, pad LONGTEXT)",
        "INSERT INTO kk SELECT seq, REPEAT('k', 100000) FROM seq_1_to_40")
    config = make_config(["nk", "kk"], snapshot={"chunk_rows": 50000, "chunk_bytes": 1 << 18, "parallelism": 1})
    async with SourceDriver(MySqlSource(config), expand_blocks=False) as d:
        got = await d.until_mark("snapshot_done")
    for name in ("nk", "kk"):
        blocks = [b for b in got if isinstance(b, RowBlock) and str(b.table).endswith("." + name)]
        assert sum(b.rows for b in blocks) == 40
        assert len(blocks) >= 10 and max(b.data.nbytes for b in blocks) <= 4 * (1 << 18), name
        values = sorted(v for b in blocks for v in b.data.column(0).to_pylist())
        assert values == list(range(1, 41))


@pytest.mark.slow
async def test_a_51_mb_longtext_through_the_snapshot_and_the_stream(make_config: Callable[..., Config],
                                                                   sql: Callable[..., Any]) -> None:
    size = 51 * 1024 * 1024
    sql("CREATE TABLE big (id INT PRIMARY KEY, v LONGTEXT, b LONGBLOB)",
        f"INSERT INTO big VALUES (1, REPEAT('ab', {size // 2}), NULL), (2, 'small', X'00FF'), "
        f"(3, REPEAT('c', {size}), REPEAT(X'01', 1000))")
    async with Driver(make_config(["big"])) as d:
        snap = {e.after["id"]: e.after for e in events_of(await d.until_mark("snapshot_done", timeout=300))}  # type: ignore[index]
        sql(f"INSERT INTO big VALUES (4, CONCAT(REPEAT('x', {size}), 'é'), NULL)")
        stream = await d.events(1, timeout=300)
    assert snap[1]["v"] == "ab" * (size // 2) and snap[2]["v"] == "small" and snap[2]["b"] == b"\x00\xff"
    assert snap[3]["v"] == "c" * size and snap[3]["b"] == b"\x01" * 1000
    assert stream[0].after is not None and stream[0].after["v"] == "x" * size + "é"


INET6 = ["::", "::1", "::2", "::ffff", "::1:0", "::1.2.3.4", "::ffff:1.2.3.4", "::ffff:0.0.0.1", "1::", "ffff::",
         "1:0:2:3:4:5:6:7", "1:0:0:2:0:0:3:4", "1:2:3:4:5:6:7:8", "0:0:0:0:0:1:0:0", "2001:db8::ff00:42:8329",
         "fe80::1:0:0:0", "0:1::", "::0.1.0.0", "::ffff:0:0", "64:ff9b::192.0.2.33"]


async def test_inet6_and_uuid_stream_text_equals_the_servers(make_config: Callable[..., Config],
                                                             sql: Callable[..., Any]) -> None:
    sql("CREATE TABLE n (id INT PRIMARY KEY, a INET6, u UUID)",
        "INSERT INTO n VALUES " + ", ".join(f"({i}, '{a}', UUID())" for i, a in enumerate(INET6)))
    async with Driver(make_config(["n"])) as d:
        snap = {e.after["id"]: e.after for e in events_of(await d.until_mark("snapshot_done"))}  # type: ignore[index]
        sql("UPDATE n SET id = id + 100")
        stream = {e.after["id"] - 100: e.after for e in await d.events(len(INET6))}  # type: ignore[index,operator]
    for i in range(len(INET6)):
        assert stream[i]["a"] == snap[i]["a"] and stream[i]["u"] == snap[i]["u"], (INET6[i], snap[i], stream[i])


async def test_zero_date_key_resumes_after_a_restart(make_config: Callable[..., Config],
                                                     sql: Callable[..., Any]) -> None:
    sql("SET SESSION sql_mode = ''", "CREATE TABLE zk (d DATE, id INT, PRIMARY KEY (d, id))",
        "INSERT INTO zk VALUES ('0000-00-00', 1), ('0000-00-00', 2), ('2024-01-01', 1), ('2024-00-00', 3)")
    keys = await _snapshot_in_restarts(make_config(["zk"], snapshot={"chunk_rows": 1, "parallelism": 1}))
    assert len(keys) == 4 and [k[1] for k in keys] == [1, 2, 3, 1]  # zero dates (NULL) first, none skipped
