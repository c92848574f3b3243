"""Values the landed type cannot give back still resume exactly; huge values; ±infinity is warned about."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, date, datetime
from typing import Any

import pytest
from pg_helpers import Driver, changes, marks

from cdcd.config import Config
from cdcd.events import ChangeEvent, Item, RowBlock
from cdcd.sources.postgres.shape import INFINITE


def _rows(items: list[Item]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for i in items:
        if isinstance(i, RowBlock):
            out.extend(e.after for e in i.events() if e.after is not None)
        elif isinstance(i, ChangeEvent) and i.after is not None:
            out.append(i.after)
    return out


@pytest.mark.parametrize("key_type, values", [
    ("numeric(10,2)", "('1'), ('2.5'), ('NaN'), ('-7')"),
    ("int[]", "('{1,2}'), ('{1}'), ('{}'), ('{3,NULL}'), ('{0,-1}')"),
    ("date", "('-infinity'), ('0001-01-01'), ('2024-02-29'), ('infinity'), ('9999-12-31')"),
    ("timestamptz", "('-infinity'), ('2024-01-01 00:00:00+00'), ('infinity')"),
])
async def test_snapshot_resumes_after_keys_the_landed_value_cannot_give_back(
        make_config: Callable[..., Config], sql: Callable[[str], str], key_type: str, values: str) -> None:
    # chunk_rows=1: every row is its own chunk, and every committed row is a resume point.
    sql(f"CREATE TABLE k (id {key_type} PRIMARY KEY, n int GENERATED ALWAYS AS IDENTITY); "
        f"INSERT INTO k (id) VALUES {values}")
    total = int(sql("SELECT count(*) FROM k"))
    order = sql("SELECT n FROM k ORDER BY id").split()
    cfg = make_config(["public.k"], snapshot={"chunk_rows": 1, "parallelism": 1})
    seen: list[str] = []
    position, state = None, None
    for _ in range(total + 1):  # one committed row per run, then a restart ("crash") resumes after it
        async with Driver(cfg, position, state, expand_blocks=False) as d:
            items = await d.take(lambda got: bool(got) and (isinstance(got[-1], RowBlock)
                                                          or bool(marks(got, "snapshot_done"))))
            rows = _rows(items)
            if not rows:
                break
            await d.commit()
            position, state = d.position, d.state
            seen.extend(str(r["n"]) for r in rows)
    assert seen == order  # every row exactly once, in key order, across total restarts


async def test_infinite_dates_land_clamped_with_one_warning_per_column(
        make_config: Callable[..., Config], sql: Callable[[str], str]) -> None:
    # t takes the columnar (COPY) path, the keyless k the row path; the stream is the third path
    sql("CREATE TABLE t (id int PRIMARY KEY, d date, ts timestamp, tz timestamptz);"
        "INSERT INTO t VALUES (1, 'infinity', 'infinity', 'infinity'), (2, '-infinity', '-infinity', '-infinity');"
        "CREATE TABLE k (id int, d date, ts timestamp, tz timestamptz); ALTER TABLE k REPLICA IDENTITY FULL;"
        "INSERT INTO k SELECT * FROM t")
    expected = {1: {"d": date.max, "ts": datetime.max, "tz": datetime.max.replace(tzinfo=UTC)},
                2: {"d": date.min, "ts": datetime.min, "tz": datetime.min.replace(tzinfo=UTC)}}
    async with Driver(make_config(["public.t", "public.k"])) as d:
        got = changes(await d.until_mark("snapshot_done"))
        snap = {(str(e.table), e.after["id"]): e.after for e in got}  # type: ignore[index]
        warned = set(d.source._t.warnings._seen)  # type: ignore[attr-defined]
        d.source._t.warnings._seen.clear()  # type: ignore[attr-defined]
        sql("INSERT INTO t SELECT id + 10, d, ts, tz FROM t")
        stream = {e.after["id"] - 10: e.after for e in await d.events(2)}  # type: ignore[index,operator]
        warned_stream = set(d.source._t.warnings._seen)  # type: ignore[attr-defined]
    for rid, want in expected.items():
        for name, value in want.items():
            assert snap[("public.t", rid)][name] == value and stream[rid][name] == value, (rid, name)
            assert snap[("public.k", rid)][name] == value, (rid, name)
    for table in ("public.t", "public.k"):
        assert {c for t, c, r in warned if r == INFINITE and t == table} == {"d", "ts", "tz"}
    assert {c for t, c, r in warned_stream if r == INFINITE} == {"d", "ts", "tz"}


@pytest.mark.slow
async def test_a_51_mb_text_value_through_the_snapshot_and_the_stream(
        make_config: Callable[..., Config], sql: Callable[[str], str]) -> None:
    size = 51 * 1024 * 1024
    sql(f"CREATE TABLE big (id int PRIMARY KEY, v text, b bytea); "
        f"INSERT INTO big VALUES (1, repeat('ab\\cd', {size // 5}), NULL), (2, 'small', '\\x00ff');"
        f"ALTER TABLE big ALTER COLUMN v SET STORAGE EXTERNAL")
    async with Driver(make_config(["public.big"], snapshot={"chunk_rows": 1000})) as d:
        snap = {r["id"]: r for r in changes(await d.until_mark("snapshot_done", timeout=300))
                for r in [r.after] if r is not None}
        sql(f"INSERT INTO big VALUES (3, repeat('x', {size}) || 'é', NULL)")
        stream = await d.events(1, timeout=300)
    assert len(snap) == 2
    assert snap[1]["v"] == "ab\\cd" * (size // 5) and snap[2]["v"] == "small" and snap[2]["b"] == b"\x00\xff"
    assert stream[0].after is not None and stream[0].after["v"] == "x" * size + "é"


async def test_keyless_table_of_large_rows_is_read_in_bounded_batches(
        make_config: Callable[..., Config], sql: Callable[[str], str]) -> None:
    sql("CREATE TABLE nk (v int, pad text); ALTER TABLE nk REPLICA IDENTITY FULL;"
        "INSERT INTO nk SELECT g, repeat('p', 200000) FROM generate_series(1, 30) g")
    cfg = make_config(["public.nk"], snapshot={"chunk_rows": 7, "chunk_bytes": 1 << 16})
    async with Driver(cfg) as d:
        got = [e.after for e in changes(await d.until_mark("snapshot_done"))]
    assert sorted(r["v"] for r in got if r) == list(range(1, 31))
    assert all(r and r["pad"] == "p" * 200000 for r in got)
