"""ALTER TABLE under a running stream on the real MariaDB: each column-changing statement lands a schema version whose
columns carry their ids (kept through renames and type changes, new for a column dropped and added again) and, on
the version that added a column with a constant DEFAULT, its fill; rows land under the right columns; a restart
keeps the ids (docs/mysql.md, "Schema changes")."""

from __future__ import annotations

from collections.abc import Callable
from datetime import date, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

import pyarrow as pa
from my_helpers import Driver

from cdcd.config import Config
from cdcd.events import ChangeBlock, ChangeEvent, Item, Mark, MarkKind, RowBlock, TableId
from cdcd.landing.manifest import TableEntry
from cdcd.landing.reader import read_batches
from cdcd.runtime.interfaces import Batch
from cdcd.sinks.landing import LandingSink
from cdcd.sources.mysql.schema import schema_from_json


def _has_row(key: int) -> Callable[[list[Item]], bool]:
    def seen(items: list[Item]) -> bool:
        last = items[-1] if items else None
        if isinstance(last, ChangeBlock | RowBlock):
            return key in last.data.column("id").to_pylist()
        return isinstance(last, ChangeEvent) and last.after is not None and last.after.get("id") == key
    return seen


async def _land(path: Path, seq: int, items: list[Item]) -> None:
    sink = LandingSink(path)
    await sink.open()
    await sink.deliver(Batch(seq, list(items)))
    await sink.close()


def _landed(path: Path) -> tuple[dict[int, tuple[TableEntry, pa.Schema]], dict[int, dict[str, Any]]]:
    """Each landed schema version of the table (with its data file's Arrow schema), and each key's last landed row
    (with its schema version)."""
    versions: dict[int, tuple[TableEntry, pa.Schema]] = {}
    rows: dict[int, dict[str, Any]] = {}
    for batch in read_batches(path):
        for f in batch.files:
            versions[f.schema.version] = (f.schema, f.data.schema)
            for r in f.data.to_pylist():
                if r["_cdc_op"] in ("c", "u", "r"):
                    rows[r["id"]] = {k: v for k, v in r.items() if not k.startswith("_cdc_")} | \
                        {"_v": r["_cdc_schema_version"]}
    return versions, rows


def _columns(version: tuple[TableEntry, pa.Schema]) -> list[tuple[str, int | None, str]]:
    return [(c.name, c.id, c.source_type) for c in version[0].columns]


def _fills(version: tuple[TableEntry, pa.Schema]) -> dict[str, Any]:
    entry, schema = version
    return {c.name: c.fill_value(schema.field(c.name).type) for c in entry.columns if c.fill is not None}


async def test_alters_under_a_running_stream_land_ids_fills_and_versions(
        make_config: Callable[..., Config], sql: Callable[..., Any], tmp_path: Path) -> None:
    sql("CREATE TABLE sc (id INT PRIMARY KEY, label VARCHAR(20), qty INT, extra VARCHAR(10), note TEXT)",
        "INSERT INTO sc VALUES (1, 'one', 1, 'e1', 'n1'), (2, 'two', 2, 'e2', 'n2')")
    landing = tmp_path / "landing"
    cfg = make_config(["sc"])
    async with Driver(cfg) as d:
        d.expand_blocks = False
        items = await d.until_mark(MarkKind.SNAPSHOT_DONE)
        sql("ALTER TABLE sc ADD COLUMN d1 VARCHAR(10) NOT NULL DEFAULT 'it''s', ADD COLUMN d2 DECIMAL(10,2) "
            "DEFAULT 1.5, ADD COLUMN (d3 DATE DEFAULT '2024-02-29', d4 INT DEFAULT NULL), "
            "ADD COLUMN d5 VARBINARY(4) DEFAULT 0x4142, ALGORITHM=INSTANT",
            "INSERT INTO sc (id, label, qty, extra, note) VALUES (3, 'three', 3, 'e3', 'n3')",
            "ALTER TABLE sc RENAME COLUMN label TO title",
            "INSERT INTO sc (id, title, qty) VALUES (4, 'four', 4)",
            "ALTER TABLE sc CHANGE COLUMN extra remark VARCHAR(10)",
            "INSERT INTO sc (id, title, remark) VALUES (5, 'five', 'r5')",
            "ALTER TABLE sc MODIFY title VARCHAR(200)",
            f"INSERT INTO sc (id, title) VALUES (6, '{'t' * 150}')",
            "ALTER TABLE sc MODIFY qty BIGINT",
            "INSERT INTO sc (id, qty) VALUES (7, 5000000000)")
        items += await d.take(_has_row(7))
        await _land(landing, 1, items)
        await d.commit()
        state, position = d.state, d.position
    versions, rows = _landed(landing)
    snap = versions[1]
    assert _columns(snap) == [("id", 1, "int"), ("label", 2, "varchar(20)"), ("qty", 3, "int"),
                              ("extra", 4, "varchar(10)"), ("note", 5, "text")]
    assert not _fills(snap)
    added = versions[rows[3]["_v"]]
    assert [(n, i) for n, i, _ in _columns(added)][5:] == [("d1", 6), ("d2", 7), ("d3", 8), ("d4", 9), ("d5", 10)]
    # constant defaults fill, NULL does not
    assert _fills(added) == {"d1": "it's", "d2": Decimal("1.50"), "d3": date(2024, 2, 29), "d5": b"AB"}
    renamed = versions[rows[4]["_v"]]
    assert _columns(renamed)[1] == ("title", 2, "varchar(20)") and not _fills(renamed)
    changed = versions[rows[5]["_v"]]
    assert _columns(changed)[3] == ("remark", 4, "varchar(10)")
    widened = versions[rows[6]["_v"]]
    assert _columns(widened)[1] == ("title", 2, "varchar(200)") and rows[6]["title"] == "t" * 150
    bigger = versions[rows[7]["_v"]]
    assert _columns(bigger)[2] == ("qty", 3, "bigint") and rows[7]["qty"] == 5_000_000_000
    assert len({rows[k]["_v"] for k in (3, 4, 5, 6, 7)}) == 5  # each ALTER its own version
    assert rows[3]["d1"] == "it's" and rows[5]["remark"] == "r5" and rows[4]["title"] == "four"

    # a restart from the checkpoint's state: the same ids, and new ones above every id the table ever had
    async with Driver(make_config(["sc"]), position, state) as d:
        d.expand_blocks = False
        sql("ALTER TABLE sc DROP COLUMN note",
            "INSERT INTO sc (id) VALUES (8)",
            "ALTER TABLE sc ADD COLUMN note INT DEFAULT 42",
            "INSERT INTO sc (id) VALUES (9)",
            "ALTER TABLE sc ADD COLUMN after_id SMALLINT NOT NULL DEFAULT 7 AFTER id",
            "INSERT INTO sc (id, qty) VALUES (10, 10)",
            "ALTER TABLE sc MODIFY remark VARCHAR(10) FIRST",
            "INSERT INTO sc (id, remark, after_id) VALUES (11, 'r11', 3)")
        later = await d.take(_has_row(11))
        await _land(landing, 2, later)
        marks = [i for i in later if isinstance(i, Mark) and i.kind is MarkKind.SCHEMA]
        assert [m.detail["reason"] for m in marks] == ["ddl"] * 4
    versions, rows = _landed(landing)
    dropped = versions[rows[8]["_v"]]
    assert "note" not in [n for n, _, _ in _columns(dropped)]
    again = versions[rows[9]["_v"]]
    assert _columns(again)[-1] == ("note", 11, "int") and _fills(again) == {"note": 42}
    after = versions[rows[10]["_v"]]
    assert _columns(after)[:2] == [("id", 1, "int"), ("after_id", 12, "smallint")]
    assert _fills(after) == {"after_id": 7}  # only the version that added the column fills it
    first = versions[rows[11]["_v"]]
    assert _columns(first)[:3] == [("remark", 4, "varchar(10)"), ("id", 1, "int"), ("after_id", 12, "smallint")]
    assert (rows[11]["remark"], rows[11]["after_id"], rows[10]["qty"]) == ("r11", 3, 10)
    assert rows[9]["note"] == 42 and rows[11]["title"] is None
    # each ALTER is recorded in its batch's manifest: its statement, the new version and columns (issue 28)
    first_batch, second_batch = (b.manifest.schema_changes for b in read_batches(landing))
    assert [c.version for c in first_batch] == [rows[k]["_v"] for k in (3, 4, 5, 6, 7)]
    assert [(c.name, c.version, c.statement) for c in second_batch] == [
        ("sc", rows[8]["_v"], "ALTER TABLE sc DROP COLUMN note"),
        ("sc", rows[9]["_v"], "ALTER TABLE sc ADD COLUMN note INT DEFAULT 42"),
        ("sc", rows[10]["_v"], "ALTER TABLE sc ADD COLUMN after_id SMALLINT NOT NULL DEFAULT 7 AFTER id"),
        ("sc", rows[11]["_v"], "ALTER TABLE sc MODIFY remark VARCHAR(10) FIRST")]
    assert [(c.name, c.id, c.fill) for c in second_batch[1].columns][-1] == ("note", 11, {"value": 42})
    positions = [c.position for c in (*first_batch, *second_batch)]
    assert positions == sorted(set(positions))


async def test_the_binlog_text_of_each_lexical_form_is_read(make_config: Callable[..., Config],
                                                            sql: Callable[..., Any], tmp_path: Path) -> None:
    """Comments, versioned comments, quoted names, IF [NOT] EXISTS, WAIT, escapes, NO_BACKSLASH_ESCAPES and
    ANSI_QUOTES, as the server logs them."""
    sql("CREATE TABLE lx (id INT PRIMARY KEY, a INT)", "INSERT INTO lx VALUES (1, 1)")
    async with Driver(make_config(["lx"], snapshot={"mode": "initial"})) as d:
        d.expand_blocks = False
        items = await d.until_mark(MarkKind.SNAPSHOT_DONE)
        sql("ALTER TABLE lx /* a, comment */ ADD COLUMN `a b` INT DEFAULT 3 -- no, ADD nope INT\n"
            ", ADD COLUMN `q``t` VARCHAR(8) DEFAULT 'x\\'y#' # hash\n, ALGORITHM=INSTANT, LOCK=NONE",
            "/*!50100 ALTER TABLE lx ADD COLUMN v1 INT DEFAULT 1 */",
            "ALTER TABLE lx WAIT 2 ADD COLUMN IF NOT EXISTS `a b` INT, DROP COLUMN IF EXISTS nope, "
            "MODIFY COLUMN IF EXISTS `a b` BIGINT DEFAULT 3, CHANGE COLUMN IF EXISTS a `renamed a` INT")
        sql("SET SESSION sql_mode = 'NO_BACKSLASH_ESCAPES'",
            "ALTER TABLE lx ADD COLUMN nb VARCHAR(5) DEFAULT 'a\\'")
        sql("SET SESSION sql_mode = 'ANSI_QUOTES'",
            'ALTER TABLE "lx" ADD COLUMN "dq col" VARCHAR(5) DEFAULT \'dq\'')
        sql("ALTER TABLE lx RENAME COLUMN v1 TO nb, RENAME COLUMN nb TO v1",  # a swap: names before the statement
            "INSERT INTO lx (id, `renamed a`) VALUES (2, 2)")
        items += await d.take(_has_row(2))
        await _land(tmp_path, 1, items)
    versions, rows = _landed(tmp_path)
    last = versions[rows[2]["_v"]]
    assert _columns(last) == [("id", 1, "int"), ("renamed a", 2, "int"), ("a b", 3, "bigint"),
                              ("q`t", 4, "varchar(8)"), ("nb", 5, "int"), ("v1", 6, "varchar(5)"),
                              ("dq col", 7, "varchar(5)")]
    # versions without rows land no file: their fills are in the schema marks
    fills = {c.name: c.fill.value for m in items if isinstance(m, Mark) and m.kind is MarkKind.SCHEMA
             for c in schema_from_json(TableId("x", "lx"), m.detail["schema"]).columns if c.fill is not None}
    assert fills == {"a b": 3, "q`t": "x'y#", "v1": 1, "nb": "a\\", "dq col": "dq"}
    assert {k: v for k, v in rows[2].items() if k != "_v"} == {
        "id": 2, "renamed a": 2, "a b": 3, "q`t": "x'y#", "nb": 1, "v1": "a\\", "dq col": "dq"}


async def test_a_non_constant_default_has_the_table_read_again(make_config: Callable[..., Config],
                                                               sql: Callable[..., Any], maria_db: str) -> None:
    """``DEFAULT CURRENT_TIMESTAMP`` gives the existing rows a value no event carries and no fill can: the source
    reads the table again (a whole-table incremental snapshot), whose rows carry it."""
    sql("CREATE TABLE rr (id INT PRIMARY KEY, a INT)", "INSERT INTO rr VALUES (1, 1), (2, 2)")
    async with Driver(make_config(["rr"])) as d:
        d.expand_blocks = False
        await d.until_mark(MarkKind.SNAPSHOT_DONE)
        sql("ALTER TABLE rr ADD COLUMN created DATETIME DEFAULT CURRENT_TIMESTAMP, ADD COLUMN k INT DEFAULT 5")
        items = await d.until_mark(MarkKind.INCREMENTAL_DONE)
        (mark,) = [i for i in items if isinstance(i, Mark) and i.kind is MarkKind.SCHEMA]
        await d.commit(d.pending.index(mark) + 1)  # the checkpoint at the ALTER: its re-read queued, not begun
        state, position = d.state, d.position
    # a restart re-sends the ALTER's mark: the checkpoint's queued re-read runs, no second one is asked for
    async with Driver(make_config(["rr"]), position, state) as d:
        d.expand_blocks = False
        again = await d.until_mark(MarkKind.INCREMENTAL_DONE)
    assert [m.detail.get("queued") for m in again if isinstance(m, Mark) and m.kind is MarkKind.INCREMENTAL_START] \
        == [None]
    assert sorted(r["id"] for b in again if isinstance(b, RowBlock) for r in b.data.to_pylist()) == [1, 2]
    assert [name for name, _ in mark.detail["unknown"]] == ["created"]
    added = schema_from_json(TableId("x", "rr"), mark.detail["schema"])
    assert added.column("created").fill is None and added.column("k").fill is not None
    starts = [i for i in items if isinstance(i, Mark) and i.kind is MarkKind.INCREMENTAL_START]
    assert {m.detail["table"] for m in starts} == {f"{maria_db}.rr"}
    assert [m.detail.get("queued") for m in starts] == [True, None]  # queued by the source, then begun
    reread = [r for b in items if isinstance(b, RowBlock) for r in b.data.to_pylist()]
    assert sorted(r["id"] for r in reread) == [1, 2]
    assert all(isinstance(r["created"], datetime) and r["k"] == 5 for r in reread)
