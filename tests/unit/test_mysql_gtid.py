"""GTID sets of both flavors; the MySQL ones from recorded server output."""

from __future__ import annotations

import pytest

from cdcd.errors import SourceFatal
from cdcd.sources.mysql.gtid import MariaGtidSet, MySqlGtidSet, check_not_purged

# SHOW MASTER STATUS\G on MySQL 8.0 with two sources (Executed_Gtid_Set printed over two lines)
RECORDED_EXECUTED = ("3e11fa47-71ca-11e1-9e33-c80aa9429562:1-5:11-18,\n"
                     "2174b383-5441-11e8-b90a-c80aa9429562:1-27")
A = "3e11fa47-71ca-11e1-9e33-c80aa9429562"
B = "2174b383-5441-11e8-b90a-c80aa9429562"


def test_mysql_parse_and_format_recorded_set() -> None:
    s = MySqlGtidSet.parse(RECORDED_EXECUTED)
    assert s.sids == {A: [(1, 5), (11, 18)], B: [(1, 27)]}
    assert str(s) == f"{B}:1-27,{A}:1-5:11-18"
    assert MySqlGtidSet.parse(str(s)) == s


def test_mysql_add_merges_adjacent_intervals() -> None:
    s = MySqlGtidSet.parse(f"{A}:1-5:11-18")
    for gno in range(6, 11):
        s.add(A, gno)
    assert str(s) == f"{A}:1-18"
    s.add_gtid(f"{B.upper()}:3")
    assert s.sids[B] == [(3, 3)]


def test_mysql_union_contains_and_difference() -> None:
    have = MySqlGtidSet.parse(f"{A}:1-10")
    purged = MySqlGtidSet.parse(f"{A}:1-12,{B}:1-2")
    assert not have.contains(purged)
    assert have.union(purged).contains(purged)
    assert str(purged.missing_from(have)) == f"{B}:1-2,{A}:11-12"
    assert have.contains(MySqlGtidSet.parse(f"{A}:3-4:7"))
    assert not MySqlGtidSet.parse(f"{A}:1-3:5-9").contains(MySqlGtidSet.parse(f"{A}:3-5"))


@pytest.mark.parametrize("bad", ["nope:1-2", f"{A}", f"{A}:5-2", f"{A}:0", f"{A}:x"])
def test_mysql_malformed(bad: str) -> None:
    with pytest.raises(ValueError):
        MySqlGtidSet.parse(bad)


def test_mysql_purged_check_names_the_missing_transactions() -> None:
    check_not_purged("mysql", f"{A}:1-20", f"{A}:1-15")  # fine: everything purged was seen
    with pytest.raises(SourceFatal) as err:
        check_not_purged("mysql", f"{A}:1-20", f"{A}:1-25,{B}:1")
    assert f"{A}:21-25" in str(err.value) and "snapshot" in str(err.value)
    check_not_purged("mariadb", "0-1-1", "")  # MariaDB uses the binlog file check


def test_mariadb_positions() -> None:
    s = MariaGtidSet.parse("0-1-42,1-7-3")
    assert str(s) == "0-1-42,1-7-3"
    s.add(0, 2, 43)
    s.add(0, 1, 40)  # never backwards
    assert str(s) == "0-2-43,1-7-3"
    assert s.contains(MariaGtidSet.parse("0-1-43"))
    assert not s.contains(MariaGtidSet.parse("1-7-4"))
    assert not s.contains(MariaGtidSet.parse("2-1-1"))
    assert str(MariaGtidSet.parse("").union(s)) == str(s)
    with pytest.raises(ValueError):
        MariaGtidSet.parse("0-1")
