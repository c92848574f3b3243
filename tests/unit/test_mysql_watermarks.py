"""The low-watermark decisions of MariaDB/MySQL incremental snapshots (cdcd/sources/mysql/watermarks.py)."""

from __future__ import annotations

import pytest

from cdcd.config import parse_config
from cdcd.errors import ConfigError, SourceFatal
from cdcd.sources.mysql.gtid import MariaGtidSet, MySqlGtidSet
from cdcd.sources.mysql.watermarks import (
    binlog_status_statement,
    choose_strategy,
    covers,
    server_version,
)

U1 = "3e11fa47-71ca-11e1-9e33-c80aa9429562"
U2 = "4f22ab58-82db-22f2-af44-d91bb9530673"


@pytest.mark.parametrize(("flavor", "version", "statement"), [
    ("mysql", "5.7.44-log", "SHOW MASTER STATUS"),
    ("mysql", "8.0.36-0ubuntu0.22.04.1", "SHOW MASTER STATUS"),
    ("mysql", "8.1.0", "SHOW MASTER STATUS"),
    ("mysql", "8.2.0", "SHOW BINARY LOG STATUS"),
    ("mysql", "8.4.3", "SHOW BINARY LOG STATUS"),
    ("mysql", "9.1.0-commercial", "SHOW BINARY LOG STATUS"),
    ("mysql", "", "SHOW BINARY LOG STATUS"),  # unknown: the statement that still exists on new servers
    ("mariadb", "10.11.6-MariaDB-0+deb12u1", "SHOW MASTER STATUS"),
    ("mariadb", "11.4.2-MariaDB", "SHOW MASTER STATUS"),
])
def test_the_binlog_status_statement_follows_the_server_version(flavor: str, version: str, statement: str) -> None:
    assert binlog_status_statement(flavor, version) == statement


def test_server_version_reads_the_leading_number() -> None:
    assert server_version("8.0.36-0ubuntu0.22.04.1") == (8, 0, 36)
    assert server_version("10.11.6-MariaDB") == (10, 11, 6)
    assert server_version("8.4") == (8, 4, 0)
    assert server_version("MySQL") is None


def test_the_strategy_is_exact_on_mariadb_and_bracketing_on_mysql_unless_set() -> None:
    assert choose_strategy("mariadb", "auto") == "exact"
    assert choose_strategy("mariadb", "exact") == "exact"
    assert choose_strategy("mariadb", "bracketing") == "bracketing"
    assert choose_strategy("mysql", "auto") == "bracketing"
    assert choose_strategy("mysql", "bracketing") == "bracketing"
    with pytest.raises(SourceFatal, match=r"incremental_watermark = \"exact\" needs MariaDB"):
        choose_strategy("mysql", "exact")


def test_the_setting_is_a_config_key_with_three_values() -> None:
    base = {"kind": "mysql", "user": "u", "database": "d", "tables": ["d.t"]}
    cfg = parse_config({"source": {**base, "mysql": {"server_id": 7}}}, env={})
    assert cfg.source.mysql.incremental_watermark == "auto"
    cfg = parse_config({"source": {**base, "mysql": {"server_id": 7, "incremental_watermark": "bracketing"}}}, env={})
    assert cfg.source.mysql.incremental_watermark == "bracketing"
    with pytest.raises(ConfigError, match="incremental_watermark"):
        parse_config({"source": {**base, "mysql": {"server_id": 7, "incremental_watermark": "late"}}}, env={})


def test_a_committed_set_covers_what_the_binlog_reader_read() -> None:
    assert covers(MariaGtidSet.parse("0-1-42,1-2-7"), MariaGtidSet.parse("0-1-42"))
    assert not covers(MariaGtidSet.parse("0-1-41"), MariaGtidSet.parse("0-1-42"))
    assert not covers(MariaGtidSet.parse("1-1-100"), MariaGtidSet.parse("0-1-1"))  # another domain only
    assert covers(MySqlGtidSet.parse(f"{U1}:1-10,{U2}:1"), MySqlGtidSet.parse(f"{U1}:1-9"))
    assert not covers(MySqlGtidSet.parse(f"{U1}:1-9"), MySqlGtidSet.parse(f"{U1}:1-10"))
    assert not covers(MySqlGtidSet.parse(f"{U1}:1-9:11"), MySqlGtidSet.parse(f"{U1}:1-11"))  # a hole: 10 committing
    with pytest.raises(TypeError, match="two flavors"):
        covers(MariaGtidSet.parse("0-1-1"), MySqlGtidSet.parse(f"{U1}:1"))


async def test_mysql_without_gtids_refuses_incremental_snapshots_with_the_fix() -> None:
    # async: a reload hands its work to the chunk task as a future of the running loop
    from cdcd.sources.mysql import MySqlSource

    cfg = parse_config({"source": {"kind": "mysql", "user": "u", "database": "d", "tables": ["d.t", "d.u"],
                                   "mysql": {"server_id": 7}}}, env={})
    src = MySqlSource(cfg)
    src.server.flavor, src.server.gtid_mode = "mysql", False  # as connect() finds a MySQL server with gtid_mode = OFF
    with pytest.raises(ConfigError, match=r"snapshot request: incremental snapshots on MySQL need GTIDs \(gtid_mode"):
        src.request_snapshot("d.t")
    with pytest.raises(ConfigError, match=r"table reload \(an added table .*\): incremental snapshots on MySQL need"):
        src.reload_tables(["d.t", "d.u", "d.v"])
    src.reload_tables(["d.t"])  # removing a table needs no snapshot
    src.server.gtid_mode = True
    src.request_snapshot("d.t")
    assert [(p["table"], p["state"]) for p in src.snapshot_progress()] == [("d.t", "queued")]
