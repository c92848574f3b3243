"""Unit tests of the relation OIDs the PostgreSQL checkpoint keeps (``state.py``, ``"oids"``): what a restart
compares with the catalog to flag a table replaced while cdcd was stopped."""

from __future__ import annotations

from cdcd.events import Mark, MarkKind
from cdcd.positions import PgPosition, format_lsn
from cdcd.sources.postgres.state import PgState, fold_state

W = PgPosition(1000, 0)


def start(**oids: int) -> Mark:
    return Mark(MarkKind.STREAM_START, W, {"slot": "s", "watermark": format_lsn(1000),
                                           "tables": ["public.a", "public.t"],
                                           "oids": {f"public.{k}": v for k, v in oids.items()}})


def tables(names: list[str], oids: dict[str, int] | None = None) -> Mark:
    detail: dict[str, object] = {"tables": names}
    if oids is not None:
        detail["oids"] = oids
    return Mark(MarkKind.TABLES, W, detail)


def test_the_start_mark_records_every_table_oid_and_parse_reads_them() -> None:
    state = fold_state({}, [start(a=10, t=20)])
    assert state["oids"] == {"public.a": 10, "public.t": 20}
    assert PgState.parse(state).oids == {"public.a": 10, "public.t": 20}


def test_a_tables_mark_sets_the_oids_it_carries_and_keeps_the_others() -> None:
    state = fold_state({}, [start(a=10, t=20), tables(["public.a", "public.t"], {"public.t": 30})])
    assert state["oids"] == {"public.a": 10, "public.t": 30}


def test_a_table_no_longer_captured_loses_its_oid_and_one_added_gets_its_own() -> None:
    state = fold_state({}, [start(a=10, t=20), tables(["public.a", "public.u"], {"public.u": 40})])
    assert state["oids"] == {"public.a": 10, "public.u": 40}


def test_a_tables_mark_without_oids_keeps_them() -> None:
    state = fold_state({}, [start(a=10, t=20), tables(["public.a", "public.t"])])
    assert state["oids"] == {"public.a": 10, "public.t": 20}


def test_a_state_written_before_oids_were_kept_parses_to_none() -> None:
    state = fold_state({}, [Mark(MarkKind.STREAM_START, W, {"slot": "s", "watermark": format_lsn(1000)})])
    assert "oids" not in state and PgState.parse(state).oids == {}
