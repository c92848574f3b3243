"""``SourceSide.holds_snapshot``: verify's re-check counts the mirror as having reached a MariaDB/MySQL snapshot
when the daemon's checkpoint holds every transaction the server had binlogged by GTID (its position cannot say:
it stands at the start of the last transaction it delivered). The MariaDB case runs against a real server in
tests/e2e/test_repair.py; here the rule, for both flavors."""

from __future__ import annotations

from cdcd.positions import MySqlPosition, PgPosition
from cdcd.sources.mysql.gtid import MariaGtidSet, MySqlGtidSet
from cdcd.verify.sides import MySide, PgSide

UUID = "3e11fa47-71ca-11e1-9e33-c80aa9429562"


def at(gtid: str) -> MySqlPosition:
    return MySqlPosition.at("mysql-bin.000001", 45740, seq=32, gtid=gtid)


def test_mariadb_checkpoint_holding_every_binlogged_domain_holds_the_snapshot() -> None:
    side = MySide(None, gtids=MariaGtidSet.parse("0-1-8,1-2-3"))
    assert side.holds_snapshot(at("0-1-8,1-2-3"))
    assert side.holds_snapshot(at("0-1-9,1-2-3"))  # past it
    assert not side.holds_snapshot(at("0-1-7,1-2-3"))  # the last transaction not delivered yet
    assert not side.holds_snapshot(at("0-1-8"))  # a domain it has not seen


def test_mysql_checkpoint_must_hold_every_interval() -> None:
    side = MySide(None, gtids=MySqlGtidSet.parse(f"{UUID}:1-5"))
    assert side.holds_snapshot(at(f"{UUID}:1-5"))
    assert not side.holds_snapshot(at(f"{UUID}:1-4"))


def test_without_gtids_only_the_position_order_decides() -> None:
    assert not MySide(None, gtids=None).holds_snapshot(at("0-1-8"))  # GTIDs off, unreadable, none binlogged
    assert not MySide(None, gtids=MariaGtidSet.parse("0-1-8")).holds_snapshot(at(""))  # a checkpoint without
    assert not PgSide(None).holds_snapshot(PgPosition(100))
