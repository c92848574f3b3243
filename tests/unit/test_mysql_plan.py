"""Unit tests of the MySQL/MariaDB planner's pure decisions (cdcd/sources/mysql/plan.py)."""

from __future__ import annotations

import pytest

from cdcd.errors import SourceFatal
from cdcd.positions import MySqlPosition, PgPosition
from cdcd.sources.mysql.identity import BinlogFacts, Verdict
from cdcd.sources.mysql.plan import Step, after_verdict, first_step, resume_position
from cdcd.sources.mysql.state import MySqlState

WM = MySqlPosition.at("b.000003", 400, 0, "0-1-9")
CKPT = MySqlPosition.at("b.000004", 120, 2, "0-1-12")
FACTS = BinlogFacts("mariadb", 1, "", "0-1-20", True, [("b.000005", 4096), ("b.000006", 100)])


def snapshot_state(done: bool) -> MySqlState:
    return MySqlState.parse({"snapshot": {"watermark": WM.to_json(), "done": done,
                                          "tables": {"d.t": {"last_key": [3], "done": False}}}})


def test_what_the_checkpoint_asks_for() -> None:
    assert first_step(MySqlState(), None, "initial") is Step.FRESH_SNAPSHOT
    assert first_step(MySqlState(), None, "initial_only") is Step.FRESH_SNAPSHOT
    assert first_step(MySqlState(), None, "never") is Step.STREAM_FROM_NOW
    assert first_step(snapshot_state(False), None, "initial") is Step.RESUME_SNAPSHOT
    assert first_step(snapshot_state(False), WM, "initial_only") is Step.RESUME_SNAPSHOT
    assert first_step(snapshot_state(True), CKPT, "initial_only") is Step.DONE
    assert first_step(snapshot_state(True), CKPT, "initial") is Step.RESUME_STREAM
    assert first_step(MySqlState(), CKPT, "never") is Step.RESUME_STREAM


def test_where_streaming_resumes() -> None:
    assert resume_position(snapshot_state(True), CKPT) == CKPT
    assert resume_position(snapshot_state(True), None) == WM  # the snapshot committed, no stream item yet
    assert resume_position(MySqlState(stream_start=CKPT), None) == CKPT
    with pytest.raises(SourceFatal, match="neither a snapshot nor a stream start"):
        resume_position(MySqlState(), None)
    with pytest.raises(SourceFatal, match="not a MySQL binlog position"):
        resume_position(MySqlState(), PgPosition(1, 0))


def test_a_lost_or_purged_position_is_fatal_unless_when_needed() -> None:
    ok = Verdict(0, True, False)
    assert after_verdict(ok, "initial", CKPT, FACTS, "the checkpoint") is ok
    for lost in (None, "the server's binlog went back"):
        assert after_verdict(lost, "when_needed", CKPT, FACTS, "the checkpoint") is Step.RESNAPSHOT
    purged = r"b.000004 needed to resume from the checkpoint .* the oldest binlog is b.000005"
    with pytest.raises(SourceFatal, match=purged):
        after_verdict(None, "initial", CKPT, FACTS, "the checkpoint")
    with pytest.raises(SourceFatal, match=r"went back\. The changes since are lost"):
        after_verdict("the server's binlog went back", "never", CKPT, FACTS, "the checkpoint")
