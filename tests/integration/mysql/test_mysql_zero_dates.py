"""Zero, partially-zero, year-0 and invalid dates land the same through every path, and `cdcd verify` reads them so.

The rule (docs/mysql.md): a DATE / DATETIME / TIMESTAMP value that is not a real date of years 1-9999
(``0000-00-00``, a zero month or day, year 0, an invalid day allowed by ``ALLOW_INVALID_DATES``, the zero
TIMESTAMP) lands as NULL with the zero-date warning. One real MariaDB table holding each such value in every
fractional precision is read by the bulk snapshot reader (mysqlclient), the aiomysql snapshot reader, the
incremental snapshot (chunks.py), the binlog stream (columnar blocks and the row path) and verify's source
reader; the landed Arrow values (days / microseconds, never through Python's ``date``, which has no year 0) must
be the same on every path, NULL exactly where verify reads NULL, and each path warns for the same columns.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, date, datetime, timedelta
from typing import Any

import pyarrow as pa
import pytest
import structlog
from my_helpers import Driver
from source_driver import SourceDriver

from cdcd.config import Config
from cdcd.events import ChangeBlock, ChangeEvent, Item, Mark, MarkKind, RowBlock
from cdcd.sinks.arrow import block_to_table, events_to_table
from cdcd.sources.mysql import MySqlSource, bulkread
from cdcd.sources.mysql import types as mysql_types
from cdcd.verify.source import read_mysql

FSPS = range(7)
COLUMNS = ["d"] + [f"dt{p}" for p in FSPS] + [f"ts{p}" for p in FSPS]
DDL = ("CREATE TABLE zd (id INT PRIMARY KEY, d DATE, "
       + ", ".join(f"dt{p} DATETIME({p})" for p in FSPS) + ", "
       + ", ".join(f"ts{p} TIMESTAMP({p}) NULL DEFAULT NULL" for p in FSPS) + ")")
#: The binlog formats before MySQL 5.6 (DATETIME as a packed decimal, TIMESTAMP as 4 bytes, no fractions), which
#: tables created with ``mysql56_temporal_format = OFF`` keep: pymysqlreplication decodes them, not rowimage.
OLD_COLUMNS = ["d", "dt0", "ts0"]
OLD_DDL = "CREATE TABLE zd (id INT PRIMARY KEY, d DATE, dt0 DATETIME, ts0 TIMESTAMP NULL DEFAULT NULL)"


def _row(rid: int, d: str | None, dt: str | None, ts: str | None, fsps: range = FSPS) -> str:
    def q(v: str | None) -> str:
        return "NULL" if v is None else f"'{v}'"
    return f"({rid}, {q(d)}, " + ", ".join([q(dt)] * len(fsps)) + ", " + ", ".join([q(ts)] * len(fsps)) + ")"


#: (id, DATE, DATETIME(0..6), TIMESTAMP(0..6)); fractions the column cannot keep are rounded by the server.
VALUES = [
    (1, "0000-00-00", "0000-00-00 00:00:00", "0000-00-00 00:00:00"),
    (2, "0000-00-00", "0000-00-00 00:00:00.000000", "0000-00-00 00:00:00.000000"),
    (3, "0000-01-01", "0000-01-01 00:00:00", "1970-01-01 00:00:01"),  # year 0, not all zero
    (4, "0000-12-31", "0000-12-31 23:59:59.499999", "2038-01-19 03:14:07.499999"),
    (5, "0000-01-00", "0000-00-01 10:00:00.5", None),
    (6, "2024-00-15", "2024-00-15 10:00:00", "2024-00-15 10:00:00"),  # the TIMESTAMP becomes the zero one
    (7, "2024-03-00", "2024-03-00 00:00:00.123456", "1999-12-31 23:59:59.123456"),
    (8, "2024-02-31", "2024-02-31 10:00:00.25", "2024-02-31 10:00:00"),  # ALLOW_INVALID_DATES
    (9, "2023-02-29", "2023-04-31 00:00:00", None),
    (10, "0001-01-01", "0001-01-01 00:00:00", "2000-02-29 12:00:00.000001"),
    (11, "1000-01-01", "1000-01-01 00:00:00", "1970-01-01 00:00:01.000001"),
    (12, "9999-12-31", "9999-12-31 23:59:59.499999", "2038-01-19 03:14:07.499999"),
    (13, None, None, None),
]
SQL_MODE = "SET SESSION sql_mode = 'ALLOW_INVALID_DATES'"
_EPOCH = datetime(1970, 1, 1)


def _plain(values: pa.Array | pa.ChunkedArray) -> list[int | None]:
    """A landed temporal column as ints (days, microseconds), never through Python's date (no year 0)."""
    as_int = pa.int32() if pa.types.is_date32(values.type) else pa.int64()
    return values.cast(as_int).to_pylist()  # type: ignore[no-any-return]


def _source_plain(v: Any) -> int | None:
    if v is None:
        return None
    if isinstance(v, datetime):
        v = v.astimezone(UTC).replace(tzinfo=None) if v.tzinfo is not None else v
        return (v - _EPOCH) // timedelta(microseconds=1)
    assert isinstance(v, date)
    return (v - date(1970, 1, 1)).days


def _landed(items: list[Item], columns: list[str]) -> dict[int, dict[str, int | None]]:
    """id -> the landed value of each temporal column, of the rows ``items`` insert or snapshot."""
    tables: list[pa.Table] = []
    for item in items:
        if isinstance(item, RowBlock | ChangeBlock) and item.table.name == "zd":
            tables.append(block_to_table(item.schema, 0, 0, item))
        elif isinstance(item, ChangeEvent) and item.table.name == "zd" and item.after is not None:
            tables.append(events_to_table(item.schema, 0, [item], [0]))
    out: dict[int, dict[str, int | None]] = {}
    for t in tables:
        cols = {c: _plain(t.column(c)) for c in columns}
        for i, rid in enumerate(t.column("id").to_pylist()):
            out[rid] = {c: cols[c][i] for c in columns}
    return out


def _warned() -> set[str]:
    return {column for table, column, reason in mysql_types._warned  # type: ignore[attr-defined]
            if reason == mysql_types.ZERO_DATE and table.endswith(".zd")}


def _done(kind: MarkKind) -> Callable[[list[Item]], bool]:
    return lambda got: bool(got) and isinstance(got[-1], Mark) and got[-1].kind is kind


@pytest.mark.parametrize("old_format", [False, True], ids=["mysql56-formats", "old-formats"])
async def test_zero_and_invalid_dates_land_alike_on_every_path_and_verify_reads_them_so(
        make_config: Callable[..., Config], sql: Callable[..., Any], monkeypatch: pytest.MonkeyPatch,
        old_format: bool) -> None:
    columns = OLD_COLUMNS if old_format else COLUMNS
    rows = ", ".join(_row(*v, fsps=range(1) if old_format else FSPS) for v in VALUES)
    if old_format:
        try:
            sql("SET GLOBAL mysql56_temporal_format = OFF", OLD_DDL)
        finally:
            sql("SET GLOBAL mysql56_temporal_format = ON")
    else:
        sql(DDL)
    sql(SQL_MODE, f"INSERT INTO zd VALUES {rows}")
    assert sql("SELECT COUNT(*) FROM zd")[0][0] == len(VALUES)
    paths: dict[str, tuple[dict[int, Any], set[str]]] = {}
    # one row per chunk: the bulk reader's Arrow casts see each value alone (a group with a zero date in a
    # column goes value by value); and all rows in one chunk
    for chunk_rows in (1, 100):
        cfg = make_config(["zd"], snapshot={"chunk_rows": chunk_rows, "parallelism": 1})
        for bulk in (True, False):
            with monkeypatch.context() as m:
                m.setattr(bulkread, "available", lambda: bulk)  # noqa: B023
                mysql_types._warned.clear()  # type: ignore[attr-defined]
                with structlog.testing.capture_logs() as logs:
                    async with SourceDriver(MySqlSource(cfg), None, None, False) as d:
                        got = await d.until_mark(MarkKind.SNAPSHOT_DONE)
            assert [e["reader"] for e in logs if e["event"] == "mysql.snapshot.reader"] == \
                ["bulk" if bulk else "aiomysql"]
            paths[f"{'bulk' if bulk else 'aiomysql'} snapshot, chunks of {chunk_rows}"] = \
                _landed(got, columns), _warned()

    # the incremental snapshot, then the same rows written again, streamed as columnar blocks and on the row path
    for columnar in (True, False):
        mysql_types._warned.clear()  # type: ignore[attr-defined]
        async with Driver(make_config(["zd"], snapshot={"mode": "never", "chunk_rows": 5})) as d:
            src = d.source
            assert isinstance(src, MySqlSource)
            src._stream.columnar = columnar
            d.expand_blocks = False
            if columnar:
                src.request_snapshot(f"{src.config.source.database}.zd")
                got = await d.take(_done(MarkKind.INCREMENTAL_DONE))
                paths["incremental snapshot"] = _landed(got, columns), _warned()
                mysql_types._warned.clear()  # type: ignore[attr-defined]
            sql(SQL_MODE, "DELETE FROM zd", f"INSERT INTO zd VALUES {rows}")
            got = await d.take(lambda items: len(_landed(items, columns)) >= len(VALUES))
            paths["stream" if columnar else "stream (row path)"] = _landed(got, columns), _warned()

    source = {r[0]: r[1:] for r in (await read_mysql(make_config(["zd"])))[0].rows}
    verify = {rid: {c: _source_plain(v) for c, v in zip(columns, values, strict=True)}
              for rid, values in source.items()}
    warn = {c for c in columns if any(verify[rid][c] is None for rid, *_ in VALUES[:-1])}
    for name, (landed, warned) in paths.items():
        assert set(landed) == set(verify), name
        for rid, *_ in VALUES:
            bad = {c: (landed[rid][c], verify[rid][c]) for c in columns if landed[rid][c] != verify[rid][c]}
            assert not bad, f"{name}: row {rid} landed (landed, verify reads): {bad}"
        assert warned == warn, name
    # the rule itself: no year 0, no zero or invalid part lands as a value
    for rid in (1, 2, 3, 4, 5, 6, 8, 9):
        assert verify[rid]["d"] is None and verify[rid]["dt0"] is None, rid
    assert verify[10]["d"] == (date(1, 1, 1) - date(1970, 1, 1)).days
    assert verify[11]["dt0"] == (datetime(1000, 1, 1) - _EPOCH) // timedelta(microseconds=1)

