"""Is the binlog at a position's file and offset still the transaction the position names? (issue 27, item 4)

After RESET MASTER the server's binlog starts again at file 1 and GTID sequence 1; once the new history has
grown past the checkpoint's file offset and GTID sequence number, file sizes and GTID sets look like the old
history's. ``identity.judge`` then compares what the binlog holds at the checkpoint's offset (``BinlogAt``: the
real server's answers are checked in tests/e2e/test_mysql_identity.py) with the position.
"""

from __future__ import annotations

import pytest

from cdcd.errors import PositionLost
from cdcd.positions import MySqlPosition
from cdcd.sources.mysql.identity import BinlogAt, BinlogFacts, judge, parse_event_gtid

UUID = "3e11fa47-71ca-11e1-9e33-c80aa9429562"
RECORDED = {"server_id": 1, "uuid": "", "epoch": 0}


def maria(at: BinlogAt | None, gtid: str = "0-1-1157") -> BinlogFacts:
    return BinlogFacts("mariadb", 1, "", gtid, True, [("mysql-bin.000001", 400_000)], at)


def mysql(at: BinlogAt | None) -> BinlogFacts:
    return BinlogFacts("mysql", 1, UUID, f"{UUID}:1-1157", True, [("binlog.000001", 400_000)], at)


INSIDE = MySqlPosition.at("mysql-bin.000001", 50_000, 120, "0-1-321")  # an item: the GTID set before its tx
COMMIT = MySqlPosition.at("mysql-bin.000001", 50_000, 900, "0-1-322")  # its commit: the set including it


@pytest.mark.parametrize("pos", [INSIDE, COMMIT], ids=["inside", "commit"])
def test_mariadb_the_same_history_passes(pos: MySqlPosition) -> None:
    at = BinlogAt(pos.file, pos.pos, True, "0-1-321", "0-1-322")
    assert judge(maria(at), RECORDED, 0, pos, "the checkpoint").by_gtid
    watermark = MySqlPosition.at("mysql-bin.000001", 60_000, 0, "0-1-400")  # the binlog's end then: no event yet
    judge(maria(BinlogAt(watermark.file, watermark.pos, True, "0-1-400", None)), RECORDED, 0, watermark, "wm")


@pytest.mark.parametrize("pos", [INSIDE, COMMIT], ids=["inside", "commit"])
def test_mariadb_a_new_history_grown_past_the_position_is_lost(pos: MySqlPosition) -> None:
    # the new history has more GTIDs than the checkpoint and a longer file: only the offset's contents differ
    at = BinlogAt(pos.file, pos.pos, True, "0-1-150", "0-1-151")
    with pytest.raises(PositionLost, match=r"binlog at mysql-bin.000001:50000 is not the checkpoint .* GTID state "
                                           r"there is 0-1-150 .* 0-1-151, where cdcd read 0-1-32[12]: its binlog was "
                                           r"reset"):
        judge(maria(at), RECORDED, 0, pos, "the checkpoint")
    with pytest.raises(PositionLost, match=r"no binlog event starts at mysql-bin.000001:50000"):
        judge(maria(BinlogAt(pos.file, pos.pos, False)), RECORDED, 0, pos, "the checkpoint")


def test_mysql_the_transaction_at_the_offset_must_follow_or_end_the_set() -> None:
    inside = MySqlPosition.at("binlog.000001", 50_000, 120, f"{UUID}:1-321")
    commit = MySqlPosition.at("binlog.000001", 50_000, 900, f"{UUID}:1-322")
    for pos in (inside, commit):
        judge(mysql(BinlogAt(pos.file, pos.pos, True, None, f"{UUID}:322")), RECORDED, 0, pos, "the checkpoint")
        with pytest.raises(PositionLost, match=rf"the transaction starting there is {UUID}:150"):
            judge(mysql(BinlogAt(pos.file, pos.pos, True, None, f"{UUID}:150")), RECORDED, 0, pos, "the checkpoint")
        with pytest.raises(PositionLost, match=rf"the transaction starting there is {UUID}:400"):
            judge(mysql(BinlogAt(pos.file, pos.pos, True, None, f"{UUID}:400")), RECORDED, 0, pos, "the checkpoint")
    # nothing starts there yet (the end of the binlog): the file and GTID checks stand alone
    judge(mysql(BinlogAt(inside.file, inside.pos, True, None, None)), RECORDED, 0, inside, "the checkpoint")


def test_event_gtids_of_both_flavors() -> None:
    assert parse_event_gtid("Gtid", "BEGIN GTID 0-1-322") == "0-1-322"
    assert parse_event_gtid("Gtid", "GTID 0-1-6") == "0-1-6"
    assert parse_event_gtid("Gtid", "BEGIN GTID 0-1-7 cid=123") == "0-1-7"
    assert parse_event_gtid("Gtid", f"SET @@SESSION.GTID_NEXT= '{UUID}:7'") == f"{UUID}:7"
    assert parse_event_gtid("Table_map", "table_id: 18 (app.t)") is None
