"""DDL parsing, schema history, preflight rules, status parsing and fold — all pure."""

from __future__ import annotations

import pyarrow as pa
import pytest

from cdcd.errors import CheckpointFatal
from cdcd.events import ChangeEvent, Column, Mark, Op, TableId, TableSchema
from cdcd.positions import MySqlPosition
from cdcd.sources.mysql.alter import apply_alter
from cdcd.sources.mysql.ddl import parse_ddl
from cdcd.sources.mysql.preflight import ServerFacts, evaluate
from cdcd.sources.mysql.queries import parse_binlog_status, parse_snapshot_status
from cdcd.sources.mysql.schema import SchemaHistory, schema_to_json
from cdcd.sources.mysql.state import MySqlState, TableProgress, fold_state
from cdcd.sources.mysql.types import arrow_type

T = TableId("app", "t")


def _schema(*cols: tuple[str, str], key: tuple[str, ...] = ("id",)) -> TableSchema:
    return TableSchema(T, tuple(Column(n, arrow_type(st), st) for n, st in cols), key)


BASE = _schema(("id", "int"), ("a", "varchar(10)"), ("b", "int"))


def _alter(sql: str) -> TableSchema | None:
    (ddl, *_) = parse_ddl(sql, "app")
    assert ddl.kind == "alter" and ddl.table == T
    altered = apply_alter(BASE, ddl.actions, 4)
    return None if altered is None else altered.schema


def test_alter_add_drop_modify_change_rename() -> None:
    s = _alter("ALTER TABLE t ADD COLUMN c DECIMAL(10, 2) NOT NULL DEFAULT 0 AFTER a")
    assert s is not None and s.column_names == ("id", "a", "c", "b")
    assert s.column("c").type == pa.decimal128(10, 2) and not s.column("c").nullable
    s = _alter("alter table `app`.`t` add first_col bigint unsigned FIRST, drop column b")
    assert s is not None and s.column_names == ("first_col", "id", "a")
    assert s.column("first_col").type == pa.decimal128(20, 0)
    s = _alter("ALTER TABLE t MODIFY a TEXT, CHANGE COLUMN b b2 BIGINT, RENAME COLUMN id TO pk")
    assert s is not None and s.column_names == ("pk", "a", "b2") and s.key == ("pk",)
    assert s.column("b2").type == pa.int64()
    s = _alter("ALTER TABLE t ADD (x INT, y ENUM('p','q')), ADD INDEX ix (a)")
    assert s is not None and s.column_names == ("id", "a", "b", "x", "y")
    assert _alter("ALTER TABLE t DROP COLUMN nope") is None  # the next table map decides


def test_other_ddl() -> None:
    assert parse_ddl("TRUNCATE TABLE t", "app")[0].kind == "truncate"
    assert parse_ddl("truncate `other`.`t`", "app")[0].table == TableId("other", "t")
    r = parse_ddl("RENAME TABLE t TO t_old, t_new TO t", "app")
    assert [(d.table, d.new_table) for d in r] == [(T, TableId("app", "t_old")), (TableId("app", "t_new"), T)]
    assert [d.kind for d in parse_ddl("ALTER TABLE t RENAME TO u", "app")] == ["alter", "rename"]
    assert [d.table for d in parse_ddl("DROP TABLE IF EXISTS t, app.u", "app")] == [T, TableId("app", "u")]
    assert parse_ddl("/* comment */ CREATE TABLE IF NOT EXISTS t (id INT)", "app")[0].kind == "create"
    assert parse_ddl("GRANT SELECT ON *.* TO x", "app") == []


def test_history_versions_and_lookup() -> None:
    h = SchemaHistory()
    p1, p2, p3 = (MySqlPosition.at("b.000001", n, 1) for n in (100, 200, 300))
    v1 = h.record(p1, BASE)
    v2 = h.record(p3, _schema(("id", "int")))
    assert (v1.version, v2.version) == (1, 2)
    assert h.at(T, p2) == v1 and h.at(T, p3) == v2 and h.at(T, MySqlPosition.at("b.000001", 50, 1)) is None
    assert h.record(p1, BASE).version == 1  # a replay finds the recorded entry
    again = SchemaHistory.from_json(h.to_json())
    assert again.at(T, p2) == v1 and again.latest(T) == v2


def test_fold_tracks_snapshot_progress_and_schemas() -> None:
    wm = MySqlPosition.at("b.000003", 400, 0, "0-1-9")
    schema = TableSchema(T, BASE.columns, ("id",), 1)
    items = [
        Mark("snapshot_start", wm, {"tables": ["app.t", "app.u"]}),
        Mark("snapshot_table_start", wm, {"table": "app.t", "schema": schema_to_json(schema)}),
        *(ChangeEvent(Op.READ, schema, wm, None, {"id": i, "a": "x", "b": 1}, snapshot=True) for i in (1, 2, 3)),
    ]
    state = fold_state({}, items)
    assert state["snapshot"] == {"watermark": wm.to_json(), "done": False,
                                 "tables": {"app.t": {"last_key": [3], "done": False},
                                            "app.u": {"last_key": None, "done": False}}}
    assert "app.t" in state["schemas"]
    state2 = fold_state(state, [Mark("snapshot_table_done", wm, {"table": "app.t"}),
                                Mark("snapshot_table_done", wm, {"table": "app.u"}), Mark("snapshot_done", wm)])
    assert state2["snapshot"]["done"] and state2["snapshot"]["tables"]["app.t"] == {"last_key": [3], "done": True}
    assert state["snapshot"]["done"] is False  # pure: the input is untouched
    assert fold_state(state2, [Mark("commit", MySqlPosition.at("b.000003", 500, 2), {"events": 1})]) == state2
    typed = MySqlState.parse(state)  # what the planner reads
    assert typed.snapshot is not None and typed.snapshot.watermark == wm and not typed.snapshot.done
    assert typed.snapshot.tables["app.t"] == TableProgress([3], False) and typed.stream_start is None
    assert MySqlState.parse(state2).snapshot.done  # type: ignore[union-attr]
    with pytest.raises(CheckpointFatal, match="not a MySQL binlog position"):
        MySqlState.parse({"snapshot": {"watermark": {"kind": "postgres", "lsn": "0/1", "seq": 0}}})


def test_binlog_status_recorded_outputs() -> None:
    # MySQL 8.0 SHOW MASTER STATUS (dict cursor), GTIDs on over two lines
    row = {"File": "binlog.000042", "Position": 157, "Binlog_Do_DB": "", "Binlog_Ignore_DB": "",
           "Executed_Gtid_Set": "3e11fa47-71ca-11e1-9e33-c80aa9429562:1-5,\n2174b383-5441-11e8-b90a-c80aa9429562:1-27"}
    wm = parse_binlog_status(row)
    assert (wm.file, wm.pos) == ("binlog.000042", 157)
    assert wm.gtid == "3e11fa47-71ca-11e1-9e33-c80aa9429562:1-5,2174b383-5441-11e8-b90a-c80aa9429562:1-27"
    assert wm.position() == MySqlPosition.at("binlog.000042", 157, 0, wm.gtid)
    assert parse_binlog_status({"File": "binlog.000001", "Position": 4, "Executed_Gtid_Set": ""}).gtid == ""
    from cdcd.errors import SourceFatal
    with pytest.raises(SourceFatal, match="log_bin"):
        parse_binlog_status({})  # binlog off: empty result
    assert parse_snapshot_status([("Binlog_snapshot_file", "mysql-bin.000002"),
                                  ("Binlog_snapshot_position", "1234")]) == ("mysql-bin.000002", 1234)


MYSQL_VARS = {"log_bin": "ON", "binlog_format": "ROW", "binlog_row_image": "FULL", "binlog_row_metadata": "FULL",
              "server_id": "1", "gtid_mode": "ON"}
MYSQL_GRANTS = ["GRANT SELECT, RELOAD, REPLICATION SLAVE, REPLICATION CLIENT ON *.* TO `cdc`@`%`"]


def test_preflight_rules_mysql_recorded() -> None:
    facts = ServerFacts("8.0.36", dict(MYSQL_VARS), list(MYSQL_GRANTS), {"app.t": (True, ("id",))}, 5401)
    assert [r for r in evaluate(facts) if not r.ok] == []
    bad = ServerFacts("8.0.36", {**MYSQL_VARS, "binlog_format": "MIXED", "binlog_row_metadata": "MINIMAL"},
                      ["GRANT SELECT ON `app`.* TO `cdc`@`%`"], {"app.t": (True, ("id",))}, 1)
    failed = {r.name: r for r in evaluate(bad) if not r.ok}
    assert set(failed) == {"binlog_format", "binlog_row_metadata", "server_id", "privilege REPLICATION SLAVE",
                           "privilege REPLICATION CLIENT", "privilege RELOAD"}
    assert "binlog_format = 'ROW'" in failed["binlog_format"].fix
    old = ServerFacts("5.7.44", dict(MYSQL_VARS), list(MYSQL_GRANTS), {}, 5401)
    assert [r.name for r in evaluate(old) if not r.ok] == ["version"]


def test_preflight_refuses_a_compressed_mariadb_binlog() -> None:
    maria = {**MYSQL_VARS, "gtid_binlog_pos": "0-1-5"}
    ok = ServerFacts("10.11.6-MariaDB", {**maria, "log_bin_compress": "OFF"}, list(MYSQL_GRANTS), {}, 5401)
    assert [r.name for r in evaluate(ok) if not r.ok] == []
    bad = ServerFacts("10.11.6-MariaDB", {**maria, "log_bin_compress": "ON"}, list(MYSQL_GRANTS), {}, 5401)
    failed = {r.name: r for r in evaluate(bad) if not r.ok}
    assert set(failed) == {"log_bin_compress"}
    assert "SET GLOBAL log_bin_compress = OFF" in failed["log_bin_compress"].fix
