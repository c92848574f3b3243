"""Unit tests of the recovery from a lost position (cdcd/capture/recovery.py): the planners' decisions, the gap's
record in the landing zone, and the folds that move the checkpoint to the new position with every table
re-snapshotted."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import structlog
from test_mysql_plan import CKPT, FACTS

from cdcd.capture.recovery import Recoveries
from cdcd.config import Config
from cdcd.events import Mark, MarkKind, TableId
from cdcd.landing.manifest import Manifest, load_manifest, seal
from cdcd.landing.reader import read_batches
from cdcd.positions import MySqlPosition, PgPosition, format_lsn
from cdcd.runtime.interfaces import Batch
from cdcd.sinks.landing import LandingSink
from cdcd.sources.mysql.plan import Step as MyStep
from cdcd.sources.mysql.plan import after_verdict
from cdcd.sources.mysql.state import fold_state as my_fold
from cdcd.sources.postgres.plan import Step, decide
from cdcd.sources.postgres.state import PgState, fresh_state
from cdcd.sources.postgres.state import fold_state as pg_fold

WHERE = "postgres://cdc@db:5432/app"
TABLES = [TableId("public", "a"), TableId("public", "b")]


def config(on_lost: str = "fail") -> Config:
    return Config.model_validate({
        "source": {"kind": "postgres", "host": "db", "user": "cdc", "database": "app", "tables": ["public.a"],
                   "on_position_lost": on_lost},
        "landing": {"path": "/tmp/l"}, "state": {"path": "/tmp/s"}})


def plan(before: Any, at: Any, **detail: Any) -> tuple[Recoveries, list[Mark]]:
    rec = Recoveries(config("resnapshot"))
    return rec, rec.plan(TABLES, at, "replication slot 'cdcd' does not exist", before, structlog.get_logger(),
                         **detail)


def test_a_lost_slot_is_recovered_only_when_allowed_and_then_before_when_needed() -> None:
    resumed = PgState.parse(fresh_state("cdcd", 1000, False))
    assert decide(resumed, None, "cdcd", "initial", WHERE, recover=True) is Step.RECOVER
    assert decide(resumed, None, "cdcd", "when_needed", WHERE, recover=True) is Step.RECOVER
    assert decide(resumed, None, "cdcd", "when_needed", WHERE) is Step.NEW_SLOT_AFTER_LOSS
    assert not Recoveries(config()).allowed and Recoveries(config("resnapshot")).allowed
    only = Recoveries(config())
    only.only = True  # `cdcd recover`
    assert only.allowed


def test_a_purged_or_reset_binlog_is_recovered_when_allowed() -> None:
    for lost in (None, "the server's binlog went back"):
        assert after_verdict(lost, "initial", CKPT, FACTS, "the checkpoint", recover=True) is MyStep.RECOVER
        assert after_verdict(lost, "when_needed", CKPT, FACTS, "the checkpoint", recover=True) is MyStep.RECOVER


def test_the_plan_records_the_gap_then_re_snapshots_every_table() -> None:
    rec, marks = plan(PgPosition(900, 3), PgPosition(5000, 0), slot="cdcd", lsn=format_lsn(5000))
    gap, *starts = marks
    assert gap.kind is MarkKind.POSITION_LOST and gap.position == PgPosition(5000, 0)
    assert (gap.detail["from"], gap.detail["to"]) == (PgPosition(900, 3).encoded, PgPosition(5000, 0).encoded)
    assert [(m.kind, m.detail) for m in starts] == [
        (MarkKind.INCREMENTAL_START, {"table": str(t), "where": None}) for t in TABLES]
    assert [(j.table, j.where, j.started) for j in rec.jobs] == [(t, None, True) for t in TABLES]
    assert rec.status()["recoveries"] == 1 and rec.status()["last"] is gap.detail


def test_the_postgres_fold_moves_to_the_new_slot_and_replaces_the_old_snapshots() -> None:
    old = pg_fold(fresh_state("cdcd", 1000, True), [
        Mark(MarkKind.INCREMENTAL_START, PgPosition(1100, 0), {"table": "public.a", "where": "id < 5"}),
        Mark(MarkKind.TABLE_REPLACED, PgPosition(1100, 0), {"table": "public.b", "why": "re-created"})])
    _, marks = plan(PgPosition(1100, 0), PgPosition(5000, 0), slot="cdcd", lsn=format_lsn(5000))
    new = pg_fold(old, marks)
    assert (new["slot"], new["watermark"], new["flush_lsn"]) == ("cdcd", format_lsn(5000), format_lsn(5000))
    assert new["snapshot"]["status"] == "done"  # the initial snapshot's rest is in the re-snapshots
    assert {t: (e["where"], e["status"]) for t, e in new["incremental"].items()} == {
        "public.a": (None, "running"), "public.b": (None, "running")}
    assert "tables_needing_snapshot" not in new
    assert new["position_lost"]["count"] == 1 and new["position_lost"]["last"]["to"] == PgPosition(5000, 0).encoded
    assert pg_fold(new, marks)["position_lost"]["count"] == 2


def test_the_mysql_fold_ends_the_transaction_and_the_snapshot_at_the_new_position() -> None:
    at = MySqlPosition.at("b.000001", 4, 0, "0-1-3", epoch=2)
    old = {"snapshot": {"watermark": CKPT.to_json(), "done": False, "tables": {}}, "inside_tx": True}
    _, marks = plan(CKPT, at)
    new = my_fold(old, marks)
    assert new["snapshot"]["done"] and "inside_tx" not in new
    assert set(new["incremental"]) == {"public.a", "public.b"} and new["position_lost"]["count"] == 1


async def test_the_gap_lands_in_a_manifest_that_older_readers_still_read(tmp_path: Path) -> None:
    _, marks = plan(PgPosition(900, 3), PgPosition(5000, 0), slot="cdcd", lsn=format_lsn(5000))
    sink = LandingSink(tmp_path, source_kind="postgres")
    await sink.open()
    await sink.deliver(Batch(1, marks))  # marks only: the gap's record makes the batch land
    await sink.close()
    [landed] = read_batches(tmp_path)
    doc = load_manifest(tmp_path / "manifests" / "00000000000000000001.json")
    assert doc["version"] == 4 and doc["files"] == []
    assert doc["position_lost"] == [{"lost": "replication slot 'cdcd' does not exist",
                                     "from": PgPosition(900, 3).encoded, "to": PgPosition(5000, 0).encoded}]
    assert [r.to_json() for r in landed.manifest.position_lost] == doc["position_lost"]
    # a reader that knows only the fields before it (what from_json reads of them) sees an ordinary batch
    known = {k: v for k, v in doc.items() if k != "position_lost"}
    assert Manifest.from_json(json.loads(json.dumps(seal(known)))).position_lost == ()
