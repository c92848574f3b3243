"""The bulk snapshot reader (mysqlclient, columns cast in Arrow) against the aiomysql reader, value by value.

Both readers snapshot the same tables on the same server: every landed value and Arrow type, every key
text (zero dates in keys), every warning and the resume state after each block must be the same. The
aiomysql reader is the reference (its own tests pin its values against the binlog stream).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
from source_driver import SourceDriver
from test_mysql_types_exact import DDL as EXACT_DDL
from test_mysql_types_exact import ROWS as EXACT_ROWS
from test_mysql_types_roundtrip import DDL as ROUNDTRIP_DDL
from test_mysql_types_roundtrip import ROWS as ROUNDTRIP_ROWS

from cdcd.config import Config
from cdcd.events import Item, Mark, MarkKind, RowBlock
from cdcd.sources.mysql import MySqlSource, bulkread
from cdcd.sources.mysql import types as mysql_types

pytestmark = pytest.mark.skipif(not bulkread.available(), reason="mysqlclient is not installed")

EXTRA = [
    "SET SESSION sql_mode = ''",
    "CREATE TABLE zk (d DATE, dt DATETIME(3), id INT, v INT, PRIMARY KEY (d, dt, id))",
    "INSERT INTO zk VALUES ('0000-00-00', '0000-00-00 00:00:00', 1, 1), ('0000-00-00', '2024-01-01 00:00:00.5', 2, 2),"
    " ('2024-01-01', '2024-00-00 00:00:00', 1, 3), ('2024-00-00', '1000-01-01 00:00:00', 3, 4),"
    " ('9999-12-31', '9999-12-31 23:59:59.999', 4, 5)",
    "CREATE TABLE fk (f FLOAT PRIMARY KEY, d DOUBLE, v INT)",
    "INSERT INTO fk VALUES (1.2345678, 1e300, 1), (1.2345679, -0.0, 2), (16777216, 5e-300, 3), "
    "(16777218, 0.1, 4), (0.1, NULL, 5), (-3.4e38, 2.5e-308, 6), (1e-38, 1.7976931348623157e308, 7)",
    "CREATE TABLE ek (id INT, e ENUM('zeta','alpha','mid'), v INT, PRIMARY KEY (id, e))",
    "INSERT INTO ek VALUES (1, 'zeta', 1), (1, 'alpha', 2), (1, 'mid', 3), (2, 'alpha', 4), (2, 'zeta', 5)",
    "CREATE TABLE bk (b VARBINARY(16), dc DECIMAL(20,5), u BIGINT UNSIGNED, ts TIMESTAMP(6) NULL, v INT PRIMARY KEY)",
    "INSERT INTO bk SELECT UNHEX(MD5(seq)), seq / 7, 18446744073709551615 - seq, FROM_UNIXTIME(seq * 1000.5), seq "
    "FROM seq_1_to_3000",
    "CREATE TABLE n (id BIGINT PRIMARY KEY, a INT, b VARCHAR(64), c DATETIME(6), d DATE, t TINYINT(1))",
    "INSERT INTO n SELECT seq, seq % 1000, CONCAT('row ', seq, REPEAT('é', seq % 5)), "
    "'2024-01-01' + INTERVAL seq SECOND, '1970-01-01' + INTERVAL seq DAY, seq % 2 FROM seq_1_to_5000",
    "INSERT INTO n VALUES (0, NULL, NULL, '0000-00-00 00:00:00', '0000-00-00', NULL)",
]

TABLES = ["t", "u", "zk", "fk", "ek", "bk", "n"]


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return type(a) is type(b) and a == b


async def _read(cfg: Config, bulk: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[list[Item], set[Any], list[Any]]:
    with monkeypatch.context() as m:
        m.setattr(bulkread, "available", lambda: bulk)
        mysql_types._warned.clear()  # type: ignore[attr-defined]
        async with SourceDriver(MySqlSource(cfg), None, None, False) as d:
            items = await d.take(lambda got: any(isinstance(i, Mark) and i.kind is MarkKind.SNAPSHOT_DONE
                                                 for i in got))
            warned = set(mysql_types._warned)  # type: ignore[attr-defined]
            states: list[Any] = []
            state: dict[str, Any] = {}
            for item in items:  # the resume key after every block
                state = d.source.fold(state, [item])
                if isinstance(item, RowBlock):
                    states.append((str(item.table), state["snapshot"]["tables"][str(item.table)]))
    return items, warned, states


def _rows(items: list[Item]) -> dict[str, list[tuple[dict[str, Any], dict[str, Any]]]]:
    out: dict[str, list[tuple[dict[str, Any], dict[str, Any]]]] = {}
    for b in items:
        if isinstance(b, RowBlock):
            texts = b.key_text or ()
            for r, row in enumerate(b.data.to_pylist()):
                keys = {str(i): (t[r].as_py() if t is not None else None) for i, t in enumerate(texts)}
                out.setdefault(b.table.name, []).append((row, keys))
    return out


@pytest.mark.parametrize(("chunk_rows", "transpose"), [(2, True), (50000, True), (50000, False)])
async def test_bulk_reader_lands_exactly_what_the_aiomysql_reader_lands(
        make_config: Callable[..., Config], sql: Callable[..., Any], monkeypatch: pytest.MonkeyPatch,
        chunk_rows: int, transpose: bool) -> None:
    """``transpose`` False: every group takes the path Arrow's refusal of a value sends it on (column by
    column) instead of the rows' struct transposition."""
    if not transpose:
        monkeypatch.setattr(bulkread, "_columns", lambda raw, kinds: [None] * len(kinds))
    sql(ROUNDTRIP_DDL, f"INSERT INTO t VALUES {', '.join(ROUNDTRIP_ROWS)}")
    sql("SET SESSION sql_mode = ''", EXACT_DDL, f"INSERT INTO u VALUES {', '.join(EXACT_ROWS)}")
    sql(*EXTRA)
    cfg = make_config(TABLES, snapshot={"chunk_rows": chunk_rows, "parallelism": 2, "chunk_bytes": 1 << 16})
    ref_items, ref_warned, ref_states = await _read(cfg, False, monkeypatch)
    bulk_items, bulk_warned, bulk_states = await _read(cfg, True, monkeypatch)
    ref, bulk = _rows(ref_items), _rows(bulk_items)
    assert set(ref) == set(bulk) == set(TABLES)
    for table in TABLES:
        assert len(ref[table]) == len(bulk[table]) == sql(f"SELECT COUNT(*) FROM {table}")[0][0], table
        for (want, want_keys), (got, got_keys) in zip(ref[table], bulk[table], strict=True):
            assert want.keys() == got.keys()
            for name in want:
                assert _same(want[name], got[name]), (table, name, want[name], got[name])
            assert want_keys == got_keys, table
    schemas = {b.table.name: b.data.schema for b in ref_items if isinstance(b, RowBlock)}
    assert schemas == {b.table.name: b.data.schema for b in bulk_items if isinstance(b, RowBlock)}
    assert ref_warned == bulk_warned and ref_warned  # the zero dates are warned about by both
    last = {t: s for t, s in ref_states}
    assert last == {t: s for t, s in bulk_states}  # the resume state each table ends with


async def test_bulk_reader_resumes_after_committed_keys(
        make_config: Callable[..., Config], sql: Callable[..., Any], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bulkread, "available", lambda: True)
    sql(*EXTRA[:7])
    order = {t: [r[0] for r in sql(f"SELECT v FROM {t} ORDER BY {k}")]
             for t, k in (("zk", "d, dt, id"), ("fk", "f"), ("ek", "id, e"))}
    cfg = make_config(["zk", "fk", "ek"], snapshot={"chunk_rows": 2, "parallelism": 1})
    seen: dict[str, list[int]] = {t: [] for t in order}
    position, state = None, None
    for _ in range(50):  # one committed block per run, then a restart resumes after it
        async with SourceDriver(MySqlSource(cfg), position, state, False) as d:
            items = await d.take(lambda got: bool(got) and (isinstance(got[-1], RowBlock) or any(
                isinstance(i, Mark) and i.kind is MarkKind.SNAPSHOT_DONE for i in got)))
            blocks = [i for i in items if isinstance(i, RowBlock)]
            if not blocks:
                break
            await d.commit()
            position, state = d.position, d.state
            for b in blocks:
                seen[b.table.name].extend(b.data.column("v").to_pylist())
    assert seen == order  # every row exactly once, in key order, across the restarts
