"""Unit tests of PostgresSource.fold: the durable state derived from committed items."""

from __future__ import annotations

import copy

import pyarrow as pa

from cdcd.events import ChangeEvent, Column, Mark, MarkKind, Op, TableId, TableSchema
from cdcd.positions import PgPosition, format_lsn
from cdcd.sources.postgres.state import PgState, TableProgress, fold_state, fresh_state

T = TableSchema(TableId("public", "t"), (Column("id", pa.int32(), "int4"), Column("v", pa.string(), "text")), ("id",))
U = TableSchema(TableId("public", "u"), (Column("v", pa.string(), "text"),), ())
W = PgPosition(1000, 0)


def snap(table: TableSchema, row: dict[str, object]) -> ChangeEvent:
    return ChangeEvent(Op.READ, table, W, after=row, snapshot=True)


def start() -> Mark:
    return Mark(MarkKind.SNAPSHOT_START, W, {"slot": "s", "watermark": format_lsn(1000)})


def test_snapshot_progress_is_the_last_committed_key_per_table() -> None:
    state = fold_state({}, [start(), snap(T, {"id": 1, "v": "a"}), snap(U, {"v": "x"}), snap(T, {"id": 2, "v": "b"})])
    assert state["slot"] == "s" and state["watermark"] == "0/3E8" and state["flush_lsn"] == "0/3E8"
    assert state["snapshot"]["status"] == "running"
    assert state["snapshot"]["tables"]["public.t"] == {"last_key": ["2"], "rows": 2, "done": False}
    assert state["snapshot"]["tables"]["public.u"] == {"last_key": None, "rows": 1, "done": False}
    before = copy.deepcopy(state)
    state2 = fold_state(state, [snap(T, {"id": 3, "v": "c"}), Mark("snapshot_table_done", W, {"table": "public.t"})])
    assert state == before  # pure: the input is not modified
    assert state2["snapshot"]["tables"]["public.t"] == {"last_key": ["3"], "rows": 3, "done": True}
    state3 = fold_state(state2, [Mark("snapshot_table_done", W, {"table": "public.u"}), Mark("snapshot_done", W)])
    assert state3["snapshot"]["status"] == "done"
    assert state3["snapshot"]["tables"]["public.u"]["done"] is True


def test_flush_follows_commits_and_heartbeats_only() -> None:
    state = fresh_state("s", 1000, snapshot=False)
    ev = ChangeEvent(Op.CREATE, T, PgPosition(2000, 1), after={"id": 1, "v": "a"})
    # A transaction cut by a batch boundary: its events alone do not move the flush position.
    assert fold_state(state, [ev])["flush_lsn"] == "0/3E8"
    state = fold_state(state, [ev, Mark("commit", PgPosition(2000, 2), {"lsn": format_lsn(2000)})])
    assert state["flush_lsn"] == format_lsn(2000)
    state = fold_state(state, [Mark("heartbeat", PgPosition(3000, 0))])
    assert state["flush_lsn"] == format_lsn(3000)
    assert state["snapshot"]["status"] == "none"
    # A transaction resent after a restart never moves the flush position back.
    assert fold_state(state, [Mark("commit", PgPosition(2000, 2), {"lsn": format_lsn(2000)})])["flush_lsn"] == \
        format_lsn(3000)


def test_a_new_start_mark_resets_the_state() -> None:
    old = fold_state({}, [start(), snap(T, {"id": 9, "v": "z"})])
    new = fold_state(old, [Mark(MarkKind.SNAPSHOT_START, PgPosition(5000, 0), {"slot": "s", "watermark": "0/1388"}),
                           snap(T, {"id": 1, "v": "a"})])
    assert new["watermark"] == "0/1388"
    assert new["snapshot"]["tables"]["public.t"] == {"last_key": ["1"], "rows": 1, "done": False}


def test_the_planner_reads_the_folded_state_typed() -> None:
    assert PgState.parse({}).empty
    state = fold_state({}, [start(), snap(T, {"id": 7, "v": "a"}), Mark(MarkKind.COMMIT, PgPosition(2000, 2),
                                                                        {"lsn": format_lsn(2000)})])
    typed = PgState.parse(state)
    assert not typed.empty and typed.slot == "s" and typed.watermark == 1000 and typed.flush_lsn == 2000
    assert typed.snapshot == "running" and typed.tables["public.t"] == TableProgress(["7"], 1, False)
    assert PgState.parse(fresh_state(None, 1000, True)).slot is None  # initial_only: no slot
