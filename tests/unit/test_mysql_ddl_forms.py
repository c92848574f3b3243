"""The DDL parser against the column-changing forms of the MariaDB 10.11 and MySQL 8.0 manuals (ALTER TABLE), the
schema each ALTER gives (column ids, fills of constant defaults) and the schema history's ids across saves: pure.
"""

from __future__ import annotations

import json
from datetime import date, datetime, timedelta
from decimal import Decimal
from typing import Any

import pyarrow as pa
import pytest

from cdcd.events import Column, Fill, Mark, MarkKind, TableId, TableSchema
from cdcd.positions import MySqlPosition
from cdcd.sources.mysql.alter import apply_alter
from cdcd.sources.mysql.ddl import MODE_ANSI_QUOTES, MODE_NO_BACKSLASH_ESCAPES, Action, parse_ddl
from cdcd.sources.mysql.ddllex import Default
from cdcd.sources.mysql.defaults import column_fill
from cdcd.sources.mysql.schema import MAX_VERSIONS_KEPT, SchemaHistory, schema_from_json, schema_to_json
from cdcd.sources.mysql.state import fold_state
from cdcd.sources.mysql.types import arrow_type

T = TableId("app", "t")


def _schema(*cols: tuple[str, str], key: tuple[str, ...] = ("id",)) -> TableSchema:
    return TableSchema(T, tuple(Column(n, arrow_type(st), st, True, i + 1) for i, (n, st) in enumerate(cols)), key)


BASE = _schema(("id", "int"), ("a", "varchar(20)"), ("b", "int"))


def _actions(sql: str, sql_mode: int = 0) -> tuple[Action, ...]:
    (ddl, *_) = parse_ddl(sql, "app", sql_mode)
    assert ddl.kind == "alter"
    return ddl.actions


def _columns(sql: str) -> list[tuple[str, str, int | None]]:
    altered = apply_alter(BASE, _actions(sql), 4)
    assert altered is not None, sql
    return [(c.name, c.source_type, c.id) for c in altered.schema.columns]


def _default(sql_default: str, sql_mode: int = 0) -> Default | None:
    (add,) = [a for a in _actions(f"ALTER TABLE t ADD COLUMN c varchar(10) DEFAULT {sql_default}", sql_mode)
              if a.kind == "add"]
    assert add.column is not None
    return add.column.default


def test_several_clauses_options_and_guards() -> None:
    assert _columns("ALTER TABLE t ADD COLUMN c INT, ALGORITHM=INSTANT, LOCK=NONE") == [
        ("id", "int", 1), ("a", "varchar(20)", 2), ("b", "int", 3), ("c", "int", 4)]
    assert _columns("ALTER TABLE t ALGORITHM = INSTANT, DROP COLUMN b, MODIFY a varchar(200), ADD d BIGINT") == [
        ("id", "int", 1), ("a", "varchar(200)", 2), ("d", "bigint", 4)]
    (ddl,) = parse_ddl("ALTER ONLINE IGNORE TABLE IF EXISTS app.t WAIT 5 ADD COLUMN IF NOT EXISTS a INT, "
                       "ADD IF NOT EXISTS c INT", "other")
    assert ddl.table == T
    altered = apply_alter(BASE, ddl.actions, 4)
    assert altered is not None  # a is there already: only c is added
    assert [(c.name, c.source_type) for c in altered.schema.columns][-2:] == [("b", "int"), ("c", "int")]
    assert _columns("ALTER TABLE t NOWAIT DROP COLUMN IF EXISTS nope, DROP IF EXISTS b, "
                    "MODIFY COLUMN IF EXISTS gone TEXT, CHANGE COLUMN IF EXISTS gone2 g TEXT") == [
        ("id", "int", 1), ("a", "varchar(20)", 2)]
    # indexes, keys, constraints, defaults set and table options change no column
    assert _columns("ALTER TABLE t ADD INDEX ix (a), ADD UNIQUE KEY (b), DROP INDEX ix, ALTER COLUMN a SET DEFAULT "
                    "'x', ALTER COLUMN b DROP DEFAULT, ADD CONSTRAINT ck CHECK (b > 0), ENGINE = InnoDB, "
                    "COMMENT 'tbl', RENAME INDEX ix TO iy, FORCE") == [
        ("id", "int", 1), ("a", "varchar(20)", 2), ("b", "int", 3)]
    assert apply_alter(BASE, _actions("ALTER TABLE t DROP COLUMN nope"), 4) is None  # the next table map decides
    assert apply_alter(BASE, _actions("ALTER TABLE t MODIFY a CHAR(10) BINARY"), 4) is None


def test_quoted_identifiers_and_comments() -> None:
    (ddl,) = parse_ddl("ALTER TABLE `my db`.`my table` ADD COLUMN `a b` INT, ADD `we``ird` TEXT, "
                       "CHANGE `a b` `c d` BIGINT", "app")
    assert ddl.table == TableId("my db", "my table")
    assert [(a.kind, a.name, a.column.name if a.column else "") for a in ddl.actions] == [
        ("add", "", "a b"), ("add", "", "we`ird"), ("modify", "a b", "c d")]
    sql = ("/* leading */ ALTER TABLE t /* inside, with a comma */ ADD COLUMN c INT -- a comment, ADD nope INT\n"
           ", ADD d INT # another, DROP a\n, ADD e varchar(40) DEFAULT '-- not /* a */ # comment'")
    assert _columns(sql)[3:] == [("c", "int", 4), ("d", "int", 5), ("e", "varchar(40)", 6)]
    assert _default("'-- not /* a */ # comment'") == Default("string", "-- not /* a */ # comment")
    # versioned comments are executed by the server: their content counts
    assert _columns("ALTER TABLE t /*!50100 ADD COLUMN c INT */ , /*M!100301 ADD COLUMN d INT */ "
                    "/*!99999 , ADD COLUMN e INT */")[3:] == [("c", "int", 4), ("d", "int", 5), ("e", "int", 6)]
    assert _columns("ALTER TABLE t ADD COLUMN c INT --\n, ADD d INT")[3:] == [("c", "int", 4), ("d", "int", 5)]
    ansi = parse_ddl('ALTER TABLE "t" ADD COLUMN "x y" INT DEFAULT 3', "app", MODE_ANSI_QUOTES)[0]
    assert ansi.table == T and ansi.actions[0].column is not None and ansi.actions[0].column.name == "x y"


def test_rename_change_modify_and_placement_keep_ids() -> None:
    assert _columns("ALTER TABLE t RENAME COLUMN a TO title") == [
        ("id", "int", 1), ("title", "varchar(20)", 2), ("b", "int", 3)]
    assert _columns("ALTER TABLE t CHANGE a remark TEXT, CHANGE COLUMN b b BIGINT") == [
        ("id", "int", 1), ("remark", "text", 2), ("b", "bigint", 3)]
    assert _columns("ALTER TABLE t MODIFY b INT FIRST") == [("b", "int", 3), ("id", "int", 1), ("a", "varchar(20)", 2)]
    assert _columns("ALTER TABLE t MODIFY COLUMN id INT AFTER b, ADD c INT AFTER a, ADD z INT FIRST") == [
        ("z", "int", 5), ("a", "varchar(20)", 2), ("c", "int", 4), ("b", "int", 3), ("id", "int", 1)]
    assert _columns("ALTER TABLE t ADD (x INT, y ENUM('p','q')), ADD COLUMN (z TEXT)")[3:] == [
        ("x", "int", 4), ("y", "enum('p','q')", 5), ("z", "text", 6)]
    # dropped and added again under its name in one statement: another column
    assert _columns("ALTER TABLE t DROP COLUMN b, ADD COLUMN b varchar(5)") == [
        ("id", "int", 1), ("a", "varchar(20)", 2), ("b", "varchar(5)", 4)]
    # a rename, then a new column under the old name
    assert _columns("ALTER TABLE t RENAME COLUMN a TO a2, ADD a TEXT") == [
        ("id", "int", 1), ("a2", "varchar(20)", 2), ("b", "int", 3), ("a", "text", 4)]
    altered = apply_alter(BASE, _actions("ALTER TABLE t RENAME COLUMN id TO pk"), 4)
    assert altered is not None and altered.schema.key == ("pk",)
    # the clauses name the columns as they were before the statement: two renames swap, two CHANGEs too
    assert _columns("ALTER TABLE t RENAME COLUMN a TO b, RENAME COLUMN b TO a") == [
        ("id", "int", 1), ("b", "varchar(20)", 2), ("a", "int", 3)]
    assert _columns("ALTER TABLE t CHANGE a b varchar(20), CHANGE b a int, ADD c INT AFTER b") == [
        ("id", "int", 1), ("b", "varchar(20)", 2), ("c", "int", 4), ("a", "int", 3)]
    altered = apply_alter(BASE, _actions("ALTER TABLE t RENAME COLUMN id TO b, RENAME COLUMN b TO id"), 4)
    assert altered is not None and altered.schema.key == ("b",)


@pytest.mark.parametrize(("literal", "expected"), [
    ("'it''s'", Default("string", "it's")),
    (r"'back\'slash\n'", Default("string", "back'slash\n")),
    ('"double"', Default("string", "double")),
    ("_utf8mb4'intro' COLLATE utf8mb4_bin", Default("string", "intro")),
    ("N'national'", Default("string", "national")),
    ("'con' 'cat'", Default("string", "concat")),
    ("-1.5", Default("number", "-1.5")),
    ("+7", Default("number", "7")),
    ("1e3", Default("number", "1e3")),
    (".5", Default("number", ".5")),
    ("0x41", Default("hex", data=b"A")),
    ("X'4142'", Default("hex", data=b"AB")),
    ("b'101'", Default("bits", data=b"\x05")),
    ("TRUE", Default("bool", "1")),
    ("NULL", Default("null")),
    ("(42)", Default("number", "42")),
    ("('in parens')", Default("string", "in parens")),
    ("CURRENT_TIMESTAMP ON UPDATE CURRENT_TIMESTAMP", Default("expression", "CURRENT_TIMESTAMP")),
    ("current_timestamp(6)", Default("expression", "current_timestamp ( 6 )")),
    ("(a + 1)", Default("expression", "a + 1")),
    ("(uuid())", Default("expression", "uuid ( )")),
])
def test_default_literals(literal: str, expected: Default) -> None:
    assert _default(literal) == expected


def test_sql_mode_no_backslash_escapes() -> None:
    assert _default(r"'a\'", MODE_NO_BACKSLASH_ESCAPES) == Default("string", "a\\")
    assert _default(r"'a\\b'") == Default("string", "a\\b")


def _fill(coldef: str) -> tuple[Fill | None, tuple[tuple[str, str], ...]]:
    altered = apply_alter(BASE, _actions(f"ALTER TABLE t ADD COLUMN c {coldef}"), 4)
    assert altered is not None
    return altered.schema.column("c").fill, altered.unknown


@pytest.mark.parametrize(("coldef", "value"), [
    ("int NOT NULL DEFAULT 5", 5),
    ("int DEFAULT '7'", 7),
    ("tinyint DEFAULT -3", -3),
    ("int DEFAULT 2.5", 3),
    ("bigint unsigned DEFAULT 18446744073709551615", Decimal("18446744073709551615")),
    ("decimal(10,2) DEFAULT '1.5'", Decimal("1.50")),
    ("decimal(50,3) DEFAULT 2", "2.000"),
    ("double DEFAULT 1.25", 1.25),
    ("float DEFAULT 0.1", 0.10000000149011612),
    ("varchar(20) CHARACTER SET utf8mb4 DEFAULT 'new' COMMENT 'c'", "new"),
    ("char(5) DEFAULT 'ab  '", "ab"),
    ("text DEFAULT 'it''s'", "it's"),
    ("enum('a','B') DEFAULT 'b'", "B"),
    ("set('x','y','z') DEFAULT 'z,x'", "x,z"),
    ("date DEFAULT '2024-02-29'", date(2024, 2, 29)),
    ("datetime(3) DEFAULT '2024-01-02 03:04:05.12345'", datetime(2024, 1, 2, 3, 4, 5, 123000)),
    ("time DEFAULT '-12:30:00'", -timedelta(hours=12, minutes=30)),
    ("year DEFAULT 2024", 2024),
    ("bit(10) DEFAULT b'101'", b"\x00\x05"),
    ("binary(4) DEFAULT 0x41", b"A\x00\x00\x00"),
    ("varbinary(8) DEFAULT 'ab'", b"ab"),
    ("int NOT NULL", 0),
    ("varchar(3) NOT NULL", ""),
    ("enum('p','q') NOT NULL", "p"),
    ("int NOT NULL DEFAULT (42)", 42),
])
def test_constant_defaults_fill_with_the_landed_value(coldef: str, value: Any) -> None:
    fill, unknown = _fill(coldef)
    assert fill == Fill(value) and unknown == ()
    assert type(fill.value) is type(value)


def test_json_defaults_read_as_each_server_keeps_them() -> None:
    (add,) = _actions("""ALTER TABLE t ADD COLUMN j JSON DEFAULT ('{"bb": 1, "a": [1, 2]}')""")
    assert add.column is not None
    assert column_fill(add.column, "mysql")[0] == Fill('{"a": [1, 2], "bb": 1}')  # binary JSON: keys by length
    assert column_fill(add.column, "mariadb")[0] == Fill('{"bb": 1, "a": [1, 2]}')  # MariaDB: the text as given


@pytest.mark.parametrize(("coldef", "why"), [
    ("datetime DEFAULT CURRENT_TIMESTAMP", "not a constant"),
    ("int DEFAULT (b + 1)", "not a constant"),
    ("timestamp NOT NULL DEFAULT '2024-01-01 00:00:00'", "time zone"),
    ("int NOT NULL AUTO_INCREMENT UNIQUE", "AUTO_INCREMENT"),
    ("int AS (b * 2) STORED", "generated"),
])
def test_non_constant_defaults_fill_nothing_and_say_why(coldef: str, why: str) -> None:
    fill, unknown = _fill(coldef)
    assert fill is None and len(unknown) == 1 and unknown[0][0] == "c" and why in unknown[0][1]


@pytest.mark.parametrize("coldef", ["int", "int DEFAULT NULL", "varchar(5) NULL DEFAULT NULL", "date NOT NULL"])
def test_null_defaults_fill_nothing(coldef: str) -> None:
    assert _fill(coldef) == (None, ())


def test_history_ids_versions_and_fills_through_ddl_table_maps_and_saves() -> None:
    h = SchemaHistory()
    p = [MySqlPosition.at("b.000001", n, 1) for n in range(100, 1000, 100)]
    snap = TableSchema(T, tuple(Column(c.name, c.type, c.source_type) for c in BASE.columns), ("id",))
    v1 = h.record(p[0], snap)  # a snapshot: ids 1..n
    assert [c.id for c in v1.columns] == [1, 2, 3] and h.next_id(T) == 4

    def alter(pos: MySqlPosition, sql: str) -> TableSchema:
        current = h.latest(T)
        assert current is not None
        altered = apply_alter(current, _actions(sql), h.next_id(T))
        assert altered is not None
        return h.record(pos, altered.schema)

    v2 = alter(p[1], "ALTER TABLE t ADD COLUMN extra varchar(5) NOT NULL DEFAULT 'x'")
    assert v2.version == 2 and v2.column("extra").id == 4 and v2.column("extra").fill == Fill("x")
    v3 = alter(p[2], "ALTER TABLE t DROP COLUMN extra")
    v4 = alter(p[3], "ALTER TABLE t ADD COLUMN extra int, RENAME COLUMN a TO title")
    assert v4.column("extra").id == 5 and v4.column("title").id == 2 and v4.column("extra").fill is None
    assert all(c.fill is None for c in v3.columns)
    # a table map (no ids, coarser types) takes the ids by name
    derived = TableSchema(T, tuple(Column(c.name, c.type, "varchar" if c.name == "title" else c.source_type)
                                   for c in v4.columns), ("id",))
    v5 = h.record(p[4], derived)
    assert [c.id for c in v5.columns] == [1, 2, 3, 5]
    # saved and loaded, and folded from the marks the stream emits: the same ids, fills and next id
    again = SchemaHistory.from_json(json.loads(json.dumps(h.to_json())))
    assert again.at(T, p[1]) == v2 and again.latest(T) == v5 and again.next_id(T) == 6
    marks = [Mark(MarkKind.SCHEMA, pos, {"table": str(T), "schema": schema_to_json(s)})
             for pos, s in zip(p[:5], (v1, v2, v3, v4, v5), strict=True)]
    folded = SchemaHistory.from_json(fold_state({}, marks)["schemas"])
    assert folded.at(T, p[1]) == v2 and folded.next_id(T) == 6
    # the next id outlives the versions that held it
    for i in range(MAX_VERSIONS_KEPT + 2):
        h.record(MySqlPosition.at("b.000002", 100 + i, 1), _schema(("id", "int")))
    kept = SchemaHistory.from_json(json.loads(json.dumps(h.to_json())))
    assert kept.next_id(T) == 6 and h.successor().next_id(T) == 6
    fresh = h.successor()
    assert fresh.latest(T) == h.latest(T)


def test_a_history_saved_without_ids_loads_with_ids_by_position() -> None:
    pos = MySqlPosition.at("b.000001", 100, 1)
    old = {"app.t": [{"pos": pos.to_json(),
                      "schema": {"columns": [["id", "int", False], ["a", "varchar(20)", True]],
                                 "key": ["id"], "version": 3}}]}
    h = SchemaHistory.from_json(old)
    s = h.latest(T)
    assert s is not None and [(c.name, c.id, c.fill) for c in s.columns] == [("id", 1, None), ("a", 2, None)]
    assert s.version == 3 and h.next_id(T) == 3
    altered = apply_alter(s, _actions("ALTER TABLE t ADD c date DEFAULT '2024-01-02'"), h.next_id(T))
    assert altered is not None
    doc = schema_to_json(altered.schema)
    assert doc["columns"][-1] == ["c", "date", True, 3, {"date": "2024-01-02"}]
    assert schema_from_json(T, doc) == altered.schema
    assert altered.schema.column("c").type == pa.date32()
