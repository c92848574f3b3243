"""Unit tests of the PostgreSQL planner's pure decision (cdcd/sources/postgres/plan.py)."""

from __future__ import annotations

import pytest

from cdcd.errors import SourceFatal
from cdcd.sources.postgres.catalog import SlotInfo
from cdcd.sources.postgres.plan import Step, check_slot, decide
from cdcd.sources.postgres.state import PgState, fresh_state

SLOT = SlotInfo("cdcd", "pgoutput", "app", 5000, None, "reserved")
RESUMED = PgState.parse(fresh_state("cdcd", 1000, True))
WHERE = "postgres://cdc@db:5432/app"


def test_first_starts() -> None:
    first = PgState()
    assert decide(first, None, "cdcd", "initial", WHERE) is Step.NEW_SLOT_SNAPSHOT
    assert decide(first, None, "cdcd", "never", WHERE) is Step.NEW_SLOT_STREAM
    assert decide(first, SLOT, "cdcd", "initial", WHERE) is Step.SLOT_SNAPSHOT  # a crash before the first commit
    assert decide(first, SLOT, "cdcd", "never", WHERE) is Step.SLOT_STREAM


def test_resume_and_a_lost_slot() -> None:
    assert decide(RESUMED, SLOT, "cdcd", "initial", WHERE) is Step.RESUME
    with pytest.raises(SourceFatal, match=r"'cdcd' named by the checkpoint does not exist on postgres://"):
        decide(RESUMED, None, "cdcd", "initial", WHERE)
    assert decide(RESUMED, None, "cdcd", "when_needed", WHERE) is Step.NEW_SLOT_AFTER_LOSS
    with pytest.raises(SourceFatal, match=r"written for replication slot 'cdcd' but source.postgres.slot is 'other'"):
        decide(RESUMED, SLOT, "other", "initial", WHERE)


def test_initial_only_needs_no_slot() -> None:
    state = PgState.parse(fresh_state(None, 1000, True))
    assert decide(PgState(), None, "cdcd", "initial_only", WHERE) is Step.SNAPSHOT_ONLY
    assert decide(state, None, "cdcd", "initial_only", WHERE) is Step.SNAPSHOT_ONLY
    done = PgState.parse({**fresh_state(None, 1000, True), "snapshot": {"status": "done", "tables": {}}})
    assert decide(done, None, "cdcd", "initial_only", WHERE) is Step.SNAPSHOT_DONE


def test_an_unusable_slot_is_refused() -> None:
    check_slot(SLOT, "app")
    with pytest.raises(SourceFatal, match="uses plugin 'wal2json'"):
        check_slot(SlotInfo("cdcd", "wal2json", "app", 0, None, "reserved"), "app")
    with pytest.raises(SourceFatal, match="needs a pgoutput slot on 'other'"):
        check_slot(SLOT, "other")
    with pytest.raises(SourceFatal, match="wal_status=lost"):
        check_slot(SlotInfo("cdcd", "pgoutput", "app", 0, None, "lost"), "app")
