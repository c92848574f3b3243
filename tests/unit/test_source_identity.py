"""Position epochs and the resume-point judgements of both sources (pure code, no server)."""

from __future__ import annotations

import pytest

from cdcd.positions import MySqlPosition, parse_lsn, position_from_json
from cdcd.sources.mysql.identity import BinlogFacts, PositionLost, PurgedFile, judge, missing_gtids
from cdcd.sources.postgres.identity import HistoryDiverged, SystemFacts, judge_system, timeline_switch


def test_epoch_zero_encodes_as_before_and_a_later_epoch_sorts_above_every_old_position() -> None:
    old = MySqlPosition.at("mysql-bin.000042", 987654, 3, "0-1-100")
    assert old.encoded == "my:0000000042:00000000000000987654:0000000003"
    new = MySqlPosition.at("mysql-bin.000001", 4, 1, "0-2-101", epoch=1)
    assert new > old and old < new and new >= old and not new <= old
    assert new.encoded > old.encoded
    assert MySqlPosition.epoch_start(1, "0-1-100") < new
    assert MySqlPosition.epoch_start(1, "0-1-100").encoded > old.encoded
    assert MySqlPosition.at("mysql-bin.000001", 4, 1, epoch=2).encoded > new.encoded
    ordered = sorted([new, old, MySqlPosition.epoch_start(1, "")])
    assert [p.encoded for p in ordered] == sorted(p.encoded for p in ordered)


def test_position_json_round_trips_with_and_without_epoch() -> None:
    for pos in (MySqlPosition.at("b.000003", 120, 2, "0-1-5"), MySqlPosition.at("b.000003", 120, 2, "0-1-5", 4),
                MySqlPosition.epoch_start(2, "0-1-5")):
        back = position_from_json(pos.to_json())
        assert back == pos and back.encoded == pos.encoded and back.gtid == pos.gtid  # type: ignore[union-attr]
    assert "epoch" not in MySqlPosition.at("b.000003", 1).to_json()  # old checkpoints read the same


def facts(server_id: int = 1, gtid: str = "0-1-100", logs: list[tuple[str, int]] | None = None,
          flavor: str = "mariadb", uuid: str = "", gtid_mode: bool = False) -> BinlogFacts:
    return BinlogFacts(flavor, server_id, uuid, gtid, gtid_mode, logs or [("mysql-bin.000002", 5000)])


CKPT = MySqlPosition.at("mysql-bin.000002", 4000, 3, "0-1-100")
RECORD = {"server_id": 1, "uuid": "", "epoch": 0}


def test_same_server_with_the_checkpoint_resumes_in_the_same_epoch() -> None:
    v = judge(facts(gtid="0-1-150"), RECORD, 0, CKPT, "the checkpoint")
    assert (v.epoch, v.by_gtid, v.switched) == (0, True, False)
    assert not judge(facts(), None, 0, CKPT, "the checkpoint").switched  # no record yet: this server is assumed


def test_reset_master_is_named_with_the_missing_gtids() -> None:
    with pytest.raises(PositionLost, match=r"no longer has GTIDs.*domain 0: 0-1-1 to 0-1-100.*RESET MASTER"):
        judge(facts(gtid="", logs=[("mysql-bin.000001", 400)]), RECORD, 0, CKPT, "the checkpoint")
    with pytest.raises(PositionLost, match=r"seq 8 to 100"):
        judge(facts(gtid="0-1-7", logs=[("mysql-bin.000001", 400)]), RECORD, 0, CKPT, "the checkpoint")


def test_file_sequence_reset_and_short_file_without_gtids() -> None:
    plain = MySqlPosition.at("mysql-bin.000002", 4000, 3)
    with pytest.raises(PositionLost, match=r"restarted below .*mysql-bin.000002.*newest is mysql-bin.000001"):
        judge(facts(gtid="", logs=[("mysql-bin.000001", 9000)]), RECORD, 0, plain, "the checkpoint")
    with pytest.raises(PositionLost, match=r"shorter than the offset 4000"):
        judge(facts(gtid="", logs=[("mysql-bin.000002", 300)]), RECORD, 0, plain, "the checkpoint")
    with pytest.raises(PurgedFile):
        judge(facts(gtid="", logs=[("mysql-bin.000003", 300)]), RECORD, 0, plain, "the checkpoint")


def test_failover_to_a_server_with_the_gtids_opens_a_new_epoch() -> None:
    v = judge(facts(server_id=2, gtid="0-2-130", logs=[("mysql-bin.000001", 100)]), RECORD, 0, CKPT, "it")
    assert (v.epoch, v.by_gtid, v.switched) == (1, True, True)


def test_failover_to_a_server_lacking_gtids_names_them() -> None:
    with pytest.raises(PositionLost, match=r"server_id 1 to server_id 2.*lacks GTIDs.*seq 91 to 100"):
        judge(facts(server_id=2, gtid="0-1-90"), RECORD, 0, CKPT, "the checkpoint")


def test_failover_without_gtids_is_refused() -> None:
    a, b = "3e11fa47-71ca-11e1-9e33-c80aa9429562", "2174b383-5441-11e8-b90a-c80aa9429562"
    plain = MySqlPosition.at("mysql-bin.000002", 4000, 3, f"{a}:1-10")
    rec = {"server_id": 1, "uuid": a, "epoch": 3}
    with pytest.raises(PositionLost, match=r"only\s+with GTIDs"):
        judge(facts(1, f"{a}:1-10", flavor="mysql", uuid=b, gtid_mode=False), rec, 3, plain, "the checkpoint")
    v = judge(facts(1, f"{a}:1-12", flavor="mysql", uuid=b, gtid_mode=True), rec, 3, plain, "the checkpoint")
    assert (v.epoch, v.switched) == (4, True)
    assert missing_gtids("mysql", f"{a}:1-5", f"{a}:1-10") == f"{a}:6-10"


SYS = {"systemid": "7301", "timeline": 1}


def test_pg_same_system_ahead_is_fine_and_a_first_record_is_taken() -> None:
    assert not judge_system(SYS, SystemFacts("7301", 1, 5000), 4000, None, "pg")
    assert judge_system(None, SystemFacts("7301", 1, 5000), 4000, None, "pg")


def test_pg_refuses_another_cluster_and_a_server_behind_the_checkpoint() -> None:
    with pytest.raises(HistoryDiverged, match=r"system identifier is 9999, the checkpoint's 7301"):
        judge_system(SYS, SystemFacts("9999", 1, 5000), 4000, None, "pg")
    with pytest.raises(HistoryDiverged, match=r"went back in time: its WAL ends at 0/F9F, behind 0/FA0"):
        judge_system(SYS, SystemFacts("7301", 1, 3999), 4000, None, "pg")


def test_pg_timeline_change_is_accepted_only_when_it_forked_after_what_was_captured() -> None:
    history = "1\t0/FA0\tno recovery target specified\n"
    assert timeline_switch(history, 1) == parse_lsn("0/FA0")
    assert judge_system(SYS, SystemFacts("7301", 2, 5000), 4000, history, "pg")
    with pytest.raises(HistoryDiverged, match=r"forked at 0/F00, before 0/FA0"):
        judge_system(SYS, SystemFacts("7301", 2, 5000), 4000, "1\t0/F00\tx\n", "pg")
    with pytest.raises(HistoryDiverged, match=r"timeline 1, older than the checkpoint's timeline 2"):
        judge_system({"systemid": "7301", "timeline": 2}, SystemFacts("7301", 1, 5000), 4000, None, "pg")


def test_fold_records_whether_the_checkpoint_sits_on_a_commit() -> None:
    from cdcd.events import Mark, MarkKind
    from cdcd.sources.mysql.state import fold_state

    mid = MySqlPosition.at("b.000001", 100, 2, "0-1-5")
    inside = fold_state({}, [Mark("ddl", mid, {"table": "d.t", "ddl": "x"})])
    assert inside["inside_tx"] is True
    assert "inside_tx" not in fold_state(inside, [Mark("commit", mid, {"events": 1})])
    identity = Mark(MarkKind.IDENTITY, mid, {"server_id": 2, "uuid": "", "epoch": 1})
    assert fold_state({}, [identity])["server"]["epoch"] == 1


def test_resuming_on_another_server_inside_a_transaction_skips_only_its_delivered_items() -> None:
    from cdcd.config import parse_config
    from cdcd.sources.mysql.source import MySqlSource

    config = parse_config({"source": {"kind": "mariadb", "port": 3306, "user": "u", "password": "p",
                                      "database": "d", "tables": ["d.t"], "mysql": {"server_id": 9}}}, env={})
    src = MySqlSource(config)
    src.server.epoch = 1
    inside = MySqlPosition.at("b.000004", 100, 3, "0-1-5")  # epoch 0: the old server
    src._stream.last_was_commit = False
    src._stream.arm_resend_skip(inside)
    assert src._stream.resend_skip == ("0-1-5", 3)
    assert src.server.start_at(inside).use_gtid and src.server.start_at(inside).gtid == "0-1-5"
    src._stream.last_was_commit = True  # a commit: the new server starts after it, nothing to skip
    src._stream.arm_resend_skip(inside)
    assert src._stream.resend_skip is None
    src._stream.last_was_commit = False
    src._stream.arm_resend_skip(MySqlPosition.at("b.000004", 100, 3, "0-1-5", epoch=1))  # same server: offsets dedupe
    assert src._stream.resend_skip is None
