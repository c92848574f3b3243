"""The pure parts of incremental snapshots: the window's superseding rule, the fold, PostgreSQL's visibility."""

from __future__ import annotations

import asyncio

import pyarrow as pa
import pytest
import structlog

from cdcd.capture.incremental import (
    Chunk,
    Incremental,
    SnapshotJob,
    Window,
    check_table,
    fold_incremental,
    jobs_from_state,
    rows_with,
    stale_from_state,
)
from cdcd.config import parse_config
from cdcd.errors import ConfigError
from cdcd.events import ChangeEvent, Column, Item, Mark, MarkKind, Op, RowBlock, TableId, TableSchema
from cdcd.positions import PgPosition
from cdcd.sources.postgres.chunks import invisible_to

T = TableId("public", "t")
SCHEMA = TableSchema(T, (Column("id", pa.int64(), "int8"), Column("v", pa.int64(), "int8")), ("id",))


def ev(op: Op, lsn: int, tx: str, key: int, old: int | None = None, unavailable: tuple[str, ...] = ()) -> ChangeEvent:
    after = None if op is Op.DELETE else {"id": key, "v": 0}
    before = {"id": key if old is None else old} if op is not Op.CREATE else None
    return ChangeEvent(op, SCHEMA, PgPosition(lsn, 1), before, after, tx, unavailable=unavailable)


def chunk(lw: int, hw: int, invisible: set[str] = frozenset()) -> Chunk:  # type: ignore[assignment]
    data = pa.table({"id": pa.array(range(1, 11), pa.int64()), "v": pa.array([0] * 10, pa.int64())})
    return Chunk(SnapshotJob(T), SCHEMA, data, None, ["10"], PgPosition(lw, 0), PgPosition(hw, 0), False,
                 lambda tx: tx in invisible)


def test_changes_after_the_low_watermark_or_unseen_by_the_read_supersede_chunk_rows() -> None:
    w = Window(T)
    w.record(ev(Op.UPDATE, 50, "1", 1))  # before the LW, seen by the read: the chunk row stands
    w.record(ev(Op.DELETE, 60, "2", 2))  # before the LW but the read did not see it: dropped
    w.record(ev(Op.DELETE, 150, "3", 3))  # between the watermarks: dropped
    w.record(ev(Op.UPDATE, 160, "4", 40, old=4))  # a key change: both keys
    w.record(ev(Op.CREATE, 170, "5", 5))
    keys, truncated = w.touched(chunk(100, 200, {"2"}))
    assert keys == {(2,), (3,), (40,), (4,), (5,)} and not truncated


def test_a_truncate_in_the_window_drops_the_whole_chunk_and_prune_keeps_what_later_reads_need() -> None:
    w = Window(T)
    w.record(ChangeEvent(Op.TRUNCATE, SCHEMA, PgPosition(150, 1), tx_id="9"))
    w.record(ev(Op.UPDATE, 60, "2", 2))  # unseen by this read: a later read may not see it either
    w.record(ev(Op.UPDATE, 70, "1", 1))  # seen by this read, before its LW
    c = chunk(100, 200, {"2"})
    assert w.touched(c) == ({(2,)}, True)
    w.prune(c)
    w.record(ev(Op.UPDATE, 250, "3", 3))  # after this HW: the next chunk's business
    assert w.touched(chunk(300, 400)) == (set(), False)  # both seen by the next read, before its LW
    assert w.touched(chunk(240, 400)) == ({(3,)}, False)


def test_postgres_snapshot_visibility_compares_xids_modulo_2_32() -> None:
    inv = invisible_to("100:105:100,103")
    assert [inv(str(x)) for x in (99, 100, 101, 103, 104, 105, 2**32 + 101)] == [False, True, False, True, False,
                                                                                  True, False]
    assert inv(None) is False
    wrapped = invisible_to(f"{2**32 + 5}:{2**32 + 10}:")  # epoch 1: streamed xids are 32-bit
    assert wrapped("4") is False and wrapped("10") is True and wrapped(str(2**32 - 3)) is False


def test_fold_keeps_progress_and_the_captured_list() -> None:
    lw = PgPosition(100, 0)
    state: dict[str, object] = {}
    marks = [Mark(MarkKind.TABLES, lw, {"tables": ["public.t"]}),
             Mark(MarkKind.INCREMENTAL_START, lw, {"table": "public.t", "where": "v > 1"}),
             Mark(MarkKind.INCREMENTAL_CHUNK, PgPosition(200, 0),
                  {"table": "public.t", "last_key": ["10"], "rows": 9, "lw": lw.to_json()}),
             Mark(MarkKind.INCREMENTAL_CHUNK, PgPosition(300, 0),
                  {"table": "public.t", "last_key": ["20"], "rows": 10, "lw": PgPosition(250, 0).to_json()})]
    for m in marks:
        fold_incremental(state, m)
    assert state == {"tables": ["public.t"], "incremental": {"public.t": {
        "where": "v > 1", "last_key": ["20"], "rows": 19, "chunks": 2, "lw": lw.to_json(), "status": "running"}}}
    jobs = jobs_from_state(state, [T])
    assert [(j.table, j.where, j.last_key, j.rows, j.chunks, j.below, j.started) for j in jobs] == [
        (T, "v > 1", ["20"], 19, 2, lw, True)]
    assert jobs_from_state(state, [TableId("public", "other")]) == []  # removed from source.tables
    fold_incremental(state, Mark(MarkKind.INCREMENTAL_DONE, PgPosition(300, 0), {"table": "public.t"}))
    assert jobs_from_state(state, [T]) == []


def test_check_table_names_the_configured_list() -> None:
    assert check_table("public.t", [T]) == T
    with pytest.raises(ConfigError, match=r"'public\.x' is not captured; source\.tables lists: public\.t"):
        check_table("public.x", [T])


def test_chunk_event_is_per_chunk() -> None:
    a, b = chunk(1, 2), chunk(1, 2)
    a.emitted.set()
    assert not b.emitted.is_set() and isinstance(a.emitted, asyncio.Event)


def test_changes_that_lack_a_column_mark_their_new_key_partial_when_they_supersede() -> None:
    w = Window(T)
    w.record(ev(Op.UPDATE, 50, "1", 1, unavailable=("v",)))  # before the LW, seen by the read: the row has it
    w.record(ev(Op.UPDATE, 60, "2", 2, unavailable=("v",)))  # unseen by the read
    w.record(ev(Op.UPDATE, 150, "3", 3, unavailable=("v",)))
    w.record(ev(Op.UPDATE, 160, "4", 40, old=4, unavailable=("v",)))  # a key change: the new key only
    w.record(ev(Op.UPDATE, 170, "5", 5))  # carries every column
    c = chunk(100, 200, {"2"})
    assert w.partial(c) == {(2,), (3,), (40,)}
    assert w.touched(c) == ({(2,), (3,), (40,), (4,), (5,)}, False)
    data = pa.table({"id": pa.array([1, 2, 3, 7], pa.int64()), "v": pa.array([0] * 4, pa.int64())})
    assert rows_with(data, ("id",), w.partial(c)) == {(2,), (3,)}
    assert rows_with(data.slice(0, 0), ("id",), {(2,)}) == set()


def test_fold_keeps_the_keys_to_read_again_until_a_chunk_settles_them() -> None:
    lw = PgPosition(100, 0)
    state: dict[str, object] = {}
    fold_incremental(state, Mark(MarkKind.INCREMENTAL_START, lw, {"table": "public.t", "where": None}))
    fold_incremental(state, Mark(MarkKind.INCREMENTAL_REREAD, lw, {"table": "public.t", "keys": [["-2"]]}))
    fold_incremental(state, Mark(MarkKind.INCREMENTAL_CHUNK, PgPosition(200, 0), {
        "table": "public.t", "last_key": ["10"], "rows": 8, "lw": lw.to_json(), "reread": [["1"], ["-2"]]}))
    fold_incremental(state, Mark(MarkKind.INCREMENTAL_REREAD, lw, {"table": "public.t", "keys": [["-7"], ["1"]]}))
    assert state["incremental"]["public.t"]["reread"] == [["1"], ["-2"], ["-7"]]  # type: ignore[index]
    (job,) = jobs_from_state(state, [T])
    assert job.reread == {("1",): ["1"], ("-2",): ["-2"], ("-7",): ["-7"]} and job.last_key == ["10"]
    assert job.progress()["reread"] == 3
    fold_incremental(state, Mark(MarkKind.INCREMENTAL_CHUNK, PgPosition(300, 0), {
        "table": "public.t", "last_key": ["10"], "rows": 2, "lw": lw.to_json(), "reread": []}))
    assert "reread" not in state["incremental"]["public.t"]  # type: ignore[index]
    assert jobs_from_state(state, [T])[0].reread == {}


def test_fold_keeps_a_replaced_table_until_a_snapshot_begun_after_it_completes() -> None:
    at = PgPosition(100, 0)
    state: dict[str, object] = {}
    t = {"table": "public.t"}
    fold_incremental(state, Mark(MarkKind.INCREMENTAL_START, at, {**t, "where": None}))  # before the flag
    fold_incremental(state, Mark(MarkKind.TABLE_REPLACED, at, {**t, "why": "dropped"}))
    fold_incremental(state, Mark(MarkKind.INCREMENTAL_DONE, at, t))
    assert state["tables_needing_snapshot"] == {"public.t": "dropped"}
    assert stale_from_state(state["tables_needing_snapshot"], [T]) == {T: "dropped"}  # type: ignore[arg-type]
    assert stale_from_state(state["tables_needing_snapshot"], []) == {}  # type: ignore[arg-type]
    fold_incremental(state, Mark(MarkKind.INCREMENTAL_START, at, {**t, "where": None, "repairs": True}))
    assert jobs_from_state(state, [T])[0].repairs
    fold_incremental(state, Mark(MarkKind.INCREMENTAL_DONE, at, {**t, "failed": "gone"}))
    assert state["tables_needing_snapshot"] == {"public.t": "dropped"}
    fold_incremental(state, Mark(MarkKind.INCREMENTAL_START, at, {**t, "where": None, "repairs": True}))
    fold_incremental(state, Mark(MarkKind.INCREMENTAL_DONE, at, t))
    assert "tables_needing_snapshot" not in state
    fold_incremental(state, Mark(MarkKind.TABLE_REPLACED, at, {**t, "why": "again"}))
    fold_incremental(state, Mark(MarkKind.TABLES, at, {"tables": ["public.t", "public.u"]}))
    assert state["tables_needing_snapshot"] == {"public.t": "again"}
    fold_incremental(state, Mark(MarkKind.TABLES, at, {"tables": ["public.u"]}))  # no longer captured
    assert "tables_needing_snapshot" not in state


def incremental() -> Incremental:
    config = parse_config({"source": {"kind": "postgres", "user": "u", "database": "d", "tables": ["public.t"]}},
                          env={})
    inc = Incremental(config, structlog.get_logger("test"), "test")
    inc.key_json = lambda schema, key: [str(v) for v in key]
    inc.last = lambda: PgPosition(1, 0)
    return inc


def kinds(items: list[Item]) -> list[str]:
    return [i.kind.value if isinstance(i, Mark) else "rows" for i in items]


def test_a_key_change_lacking_a_column_is_read_again_before_the_job_begins_and_after_its_range_only_from_the_set(
        ) -> None:
    inc = incremental()
    (job,) = jobs = [SnapshotJob(T, None, ["10"], started=True)]  # resumed from a checkpoint, no LW yet
    inc.resume(jobs)
    out, go = inc.before(ev(Op.UPDATE, 50, "1", 5, old=20, unavailable=("v",)))
    assert go and kinds(out) == ["incremental_reread"] and out[0].detail == {"table": "public.t", "keys": [["5"]]}
    assert out[0].position < PgPosition(50, 1) and job.reread == {("5",): ["5"]}
    assert inc.before(ev(Op.UPDATE, 60, "2", 6, old=21))[0] == []  # it carries every column
    job.range_done = True
    assert inc.before(ev(Op.UPDATE, 70, "3", 7, old=22, unavailable=("v",)))[0] == []  # 22 is whole in the mirror
    out, _ = inc.before(ev(Op.UPDATE, 80, "4", 8, old=5, unavailable=("v",)))  # 5 waits for its re-read
    assert kinds(out) == ["incremental_reread"] and set(job.reread) == {("5",), ("8",)}


def test_rows_and_keys_read_again_settle_unless_a_change_lacking_a_column_took_them_in_the_window() -> None:
    inc = incremental()
    job = SnapshotJob(T, None, started=True, reread={("30",): ["30"], ("31",): ["31"], ("32",): ["32"],
                                                     ("99",): ["99"]})
    inc.resume([job])
    inc._begin(inc.jobs.popleft())
    data = pa.table({"id": pa.array([1, 2, 3, 30, 31, 32], pa.int64()), "v": pa.array([0] * 6, pa.int64())})
    inc.pending = Chunk(job, SCHEMA, data, None, ["3"], PgPosition(100, 0), PgPosition(200, 0), True,
                        lambda tx: False, [["30"], ["31"], ["32"], ["40"]])
    for e in (ev(Op.UPDATE, 150, "1", 1, unavailable=("v",)),  # a chunk row taken without its value
              ev(Op.UPDATE, 151, "2", 2),  # a chunk row taken whole
              ev(Op.UPDATE, 152, "3", 30, unavailable=("v",)),  # a key read again, taken again without it
              ev(Op.UPDATE, 153, "4", 31),  # a key read again, taken whole
              ev(Op.UPDATE, 154, "5", 50, unavailable=("v",))):  # a key of an earlier chunk: whole in the mirror
        inc.before(e)
    out, _ = inc.before(Mark(MarkKind.HEARTBEAT, PgPosition(200, 0)))
    rows = next(i for i in out if isinstance(i, RowBlock))
    assert rows.data.column("id").to_pylist() == [3, 32]  # untouched: whole at the HW
    # 1 and 30 wait; 31 (taken whole), 32 (read untouched) and 40 (not found) settle; 99 was not read this time
    assert set(job.reread) == {("1",), ("30",), ("99",)}
    chunk_mark = next(i for i in out if isinstance(i, Mark) and i.kind is MarkKind.INCREMENTAL_CHUNK)
    assert sorted(chunk_mark.detail["reread"]) == [["1"], ["30"], ["99"]]
    assert not [i for i in out if isinstance(i, Mark) and i.kind is MarkKind.INCREMENTAL_DONE]  # rounds follow
    assert job.range_done and inc.current is job
