"""MySQL 8 events cdcd cannot decode are refused, by `cdcd check` and in the stream, never passed over.

No MySQL server installs here: the events are hand-made as pymysqlreplication leaves them after
parsing their header (the same way as tests/unit/test_mysql_rowimage_layout.py).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from pymysqlreplication import event as bl
from pymysqlreplication.row_event import PartialUpdateRowsEvent

from cdcd.errors import SourceFatal
from cdcd.events import TableId
from cdcd.sources.mysql import binlog
from cdcd.sources.mysql.decode import Decoder
from cdcd.sources.mysql.preflight import ServerFacts, evaluate
from cdcd.sources.mysql.schema import SchemaHistory

MYSQL_VARS = {"log_bin": "ON", "binlog_format": "ROW", "binlog_row_image": "FULL", "binlog_row_metadata": "FULL",
              "server_id": "1", "gtid_mode": "ON"}
GRANTS = ["GRANT SELECT, RELOAD, REPLICATION SLAVE, REPLICATION CLIENT ON *.* TO `cdc`@`%`"]


def _facts(**variables: str) -> ServerFacts:
    return ServerFacts("8.0.36", {**MYSQL_VARS, **variables}, list(GRANTS), {"app.t": (True, ("id",))}, 5401)


def test_check_refuses_transaction_compression_and_partial_json() -> None:
    ok = _facts(binlog_transaction_compression="OFF", binlog_row_value_options="")
    assert [r.name for r in evaluate(ok) if not r.ok] == []
    bad = _facts(binlog_transaction_compression="ON", binlog_row_value_options="PARTIAL_JSON")
    failed = {r.name: r for r in evaluate(bad) if not r.ok}
    assert set(failed) == {"binlog_transaction_compression", "binlog_row_value_options"}
    assert "SET GLOBAL binlog_transaction_compression = OFF" in failed["binlog_transaction_compression"].fix
    assert "SET GLOBAL binlog_row_value_options = ''" in failed["binlog_row_value_options"].fix


def _decoder() -> Decoder:
    return Decoder("mysql", {TableId("app", "t")}, SchemaHistory(), "binlog.000007", "")


def _header(event_type: int, log_pos: int, size: int, flags: int = 0) -> SimpleNamespace:
    # read_bytes: the body pymysqlreplication parsed before the row images (decode.row_image_bytes)
    return SimpleNamespace(event_type=event_type, log_pos=log_pos, event_size=size, flags=flags, read_bytes=20)


def _not_implemented(event_type: int, log_pos: int = 5000, size: int = 300, flags: int = 0) -> Any:
    ev = object.__new__(bl.NotImplementedEvent)
    ev.__dict__.update(packet=_header(event_type, log_pos, size, flags), event_type=event_type, timestamp=0)
    return ev


def test_transaction_payload_event_is_fatal_with_its_position() -> None:
    with pytest.raises(SourceFatal, match=r"TRANSACTION_PAYLOAD_EVENT at binlog\.000007:4700") as err:
        _decoder().feed(_not_implemented(40))
    assert "binlog_transaction_compression = OFF" in str(err.value)


@pytest.mark.parametrize("event_type", [26, 20, 172, 200])  # incident, pre-GA rows, unknown MariaDB, unknown
def test_unknown_events_are_fatal_never_skipped(event_type: int) -> None:
    with pytest.raises(SourceFatal, match=r"binlog\.000007:4700"):
        _decoder().feed(_not_implemented(event_type))


@pytest.mark.parametrize("event_type", [29, 34, 35, 160, 161])  # rows query, anonymous/previous GTIDs, annotations
def test_known_events_without_rows_pass(event_type: int) -> None:
    assert _decoder().feed(_not_implemented(event_type)) == []
    assert _decoder().feed(_not_implemented(250, flags=0x80)) == []  # LOG_EVENT_IGNORABLE_F: skippable


def _partial_update(schema: str, table: str) -> Any:
    ev = object.__new__(PartialUpdateRowsEvent)
    ev.__dict__.update(packet=_header(0x27, 6000, 200), event_type=0x27, schema=schema, table=table, timestamp=0,
                       event_size=181)
    return ev


def test_partial_json_update_reaches_the_decoder_and_is_fatal() -> None:
    # the library drops events whose class is not requested: it must be, or the update vanishes silently
    assert PartialUpdateRowsEvent in binlog._EVENTS and bl.XAPrepareEvent in binlog._EVENTS
    with pytest.raises(SourceFatal, match=r"PARTIAL_UPDATE_ROWS_EVENT for app\.t at binlog\.000007:5800") as err:
        _decoder().feed(_partial_update("app", "t"))
    assert "binlog_row_value_options" in str(err.value)
    assert _decoder().feed(_partial_update("app", "other")) == []  # not captured
