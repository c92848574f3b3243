"""Schema changes under a running stream, landed: every column carries its attnum as its id (a rename keeps it, a
column dropped and added again gets a new one), a column added with a constant default carries its fill on the
version that added it, and what the stream alone cannot land right (a rewrite, a catalog that cannot tell which
column is which) is re-snapshotted."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

from pg_helpers import Driver, marks

from cdcd.config import Config
from cdcd.events import ChangeEvent, Fill, Item, MarkKind
from cdcd.landing.reader import read_batches
from cdcd.runtime.interfaces import Batch
from cdcd.sinks.landing import LandingSink


async def land(path: Path, items: list[Item]) -> None:
    sink = LandingSink(path)
    await sink.open()
    await sink.deliver(Batch(1, items))
    await sink.close()


def landed(path: Path) -> tuple[dict[int, list[tuple[str, int | None, Any]]], list[dict[str, Any]]]:
    """Each landed schema version's columns as (name, id, fill value), and the rows in landing order."""
    versions: dict[int, list[tuple[str, int | None, Any]]] = {}
    rows: list[dict[str, Any]] = []
    for batch in read_batches(path):
        for f in batch.files:
            kinds = {field.name: field.type for field in f.data.schema}
            versions[f.schema.version] = [(c.name, c.id, c.fill_value(kinds[c.name]) if c.fill else None)
                                          for c in f.schema.columns]
            rows += f.data.to_pylist()
    return versions, rows


def streamed_row(got: list[Item]) -> bool:
    return bool(got) and isinstance(got[-1], ChangeEvent) and not got[-1].snapshot


async def test_alters_under_a_running_stream_land_column_ids_and_fills(
        make_config: Callable[..., Config], sql: Callable[[str], str], tmp_path: Path) -> None:
    sql("CREATE TABLE t (id int PRIMARY KEY, label text, qty int, extra text); "
        "INSERT INTO t VALUES (1, 'one', 1, 'x'), (2, 'two', 2, 'y')")
    items: list[Item] = []
    async with Driver(make_config(["public.t"])) as d:
        items += await d.until_mark(MarkKind.SNAPSHOT_DONE)
        # One step at a time: each Relation is decoded before the next DDL (the race has its own test).
        sql("ALTER TABLE t ADD COLUMN s text DEFAULT 'new, \"quoted\"', ADD COLUMN n int DEFAULT 7, "
            "ADD COLUMN d numeric(10,2) DEFAULT 1.5, ADD COLUMN ts timestamptz DEFAULT '2024-01-02 03:04:05+02', "
            "ADD COLUMN b boolean DEFAULT true, ADD COLUMN plain text; INSERT INTO t (id, label) VALUES (3, 'three')")
        items += await d.take(streamed_row)  # with the marks before it
        sql("ALTER TABLE t RENAME COLUMN label TO title; UPDATE t SET qty = 10 WHERE id = 1")
        items += await d.take(streamed_row)  # with the marks before it
        sql("ALTER TABLE t DROP COLUMN extra; ALTER TABLE t ADD COLUMN extra int; INSERT INTO t (id, extra) "
            "VALUES (4, 40)")
        items += await d.take(streamed_row)  # with the marks before it
        sql("ALTER TABLE t ALTER COLUMN qty TYPE bigint; INSERT INTO t (id, qty) VALUES (5, 5000000000)")
        items += await d.take(streamed_row)  # with the marks before it
        # The last column dropped, then (in a later Relation) one of the same type added: the source saw the drop.
        sql("ALTER TABLE t DROP COLUMN extra; UPDATE t SET qty = 2 WHERE id = 2")
        items += await d.take(streamed_row)  # with the marks before it
        sql("ALTER TABLE t ADD COLUMN more int; INSERT INTO t (id, more) VALUES (6, 60)")
        items += await d.take(streamed_row)  # with the marks before it
    assert not marks(items, MarkKind.INCREMENTAL_START)  # the catalog could tell every time: no re-snapshot
    await land(tmp_path, items)
    versions, rows = landed(tmp_path)
    base = [("id", 1, None), ("label", 2, None), ("qty", 3, None), ("extra", 4, None)]
    added = [("s", 5, 'new, "quoted"'), ("n", 6, 7), ("d", 7, Decimal("1.50")),
             ("ts", 8, datetime(2024, 1, 2, 1, 4, 5, tzinfo=UTC)), ("b", 9, True), ("plain", 10, None)]
    unfilled = [(name, num, None) for name, num, _ in added]
    renamed = [("id", 1, None), ("title", 2, None), ("qty", 3, None), ("extra", 4, None)]
    assert versions == {
        0: base,  # the snapshot's, from the catalog
        1: base + added,  # fills on the version that added the columns only
        2: renamed + unfilled,  # a rename keeps the id
        3: [("id", 1, None), ("title", 2, None), ("qty", 3, None), *unfilled, ("extra", 11, None)],
        4: [("id", 1, None), ("title", 2, None), ("qty", 3, None), *unfilled, ("extra", 11, None)],
        5: [("id", 1, None), ("title", 2, None), ("qty", 3, None), *unfilled],
        6: [("id", 1, None), ("title", 2, None), ("qty", 3, None), *unfilled, ("more", 12, None)],
    }
    kinds = {f.schema.version: {c.name: c.arrow_type for c in f.schema.columns}
             for b in read_batches(tmp_path) for f in b.files}
    assert kinds[3]["qty"] == "int32" and kinds[4]["qty"] == "int64" and kinds[3]["extra"] == "int32"
    streamed = [{k: v for k, v in r.items() if not k.startswith("_cdc_")} for r in rows if r["_cdc_op"] in ("c", "u")]
    quoted = 'new, "quoted"'
    assert [(r["id"], r.get("title", r.get("label")), r["qty"], r["s"], r.get("extra")) for r in streamed] == [
        (3, "three", None, quoted, None), (1, "one", 10, quoted, "x"), (4, None, None, quoted, 40),
        (5, None, 5000000000, quoted, None), (2, "two", 2, quoted, None), (6, None, None, quoted, None)]
    # each change is recorded in the manifest (no statement from pgoutput), below the first row of its version
    changes = read_batches(tmp_path)[0].manifest.schema_changes
    assert [(c.name, c.version, c.statement) for c in changes] == [("t", v, None) for v in range(1, 7)]
    assert [(c.name, c.id) for c in changes[1].columns][:3] == [("id", 1), ("title", 2), ("qty", 3)]
    for c in changes:
        assert c.position < min(r["_cdc_pos"] for r in rows if r["_cdc_schema_version"] == c.version)


async def test_what_the_stream_cannot_land_right_is_re_snapshotted(
        make_config: Callable[..., Config], sql: Callable[[str], str], tmp_path: Path) -> None:
    sql("CREATE TABLE t (id int PRIMARY KEY, label text); INSERT INTO t VALUES (1, 'one'), (2, 'two')")
    items: list[Item] = []
    async with Driver(make_config(["public.t"], snapshot={"mode": "never"})) as d:
        # The catalog is read later than the DDL: here after a rename that followed the ADD. It can tell (the
        # column the source knew as 'label' is still live under its new name): no re-snapshot.
        sql("ALTER TABLE t ADD COLUMN c int DEFAULT 5; INSERT INTO t (id, label) VALUES (3, 'three')")
        sql("ALTER TABLE t RENAME COLUMN label TO title; INSERT INTO t (id, title) VALUES (4, 'four')")
        items += await d.events(2)
        assert not marks(items, MarkKind.INCREMENTAL_START)
        # A volatile default rewrites the table: logical decoding sends none of the rewritten rows.
        sql("ALTER TABLE t ADD COLUMN r float8 DEFAULT random(); INSERT INTO t (id) VALUES (5)")
        items += await d.until_mark(MarkKind.INCREMENTAL_DONE)
        rewrite = len(items)
        # The same name dropped and added again with the same type after the Relation was written: the catalog
        # cannot tell which 'z' the Relation's is.
        sql("ALTER TABLE t ADD COLUMN z text; INSERT INTO t (id, z) VALUES (6, 'old')")
        sql("ALTER TABLE t DROP COLUMN z; ALTER TABLE t ADD COLUMN z text; INSERT INTO t (id) VALUES (7)")
        items += await d.until_mark(MarkKind.INCREMENTAL_DONE)
    source = {int(i): float(r) for i, r in (line.split("|") for line in sql("SELECT id, r FROM t").splitlines())}
    first = [e for e in items[:rewrite] if isinstance(e, ChangeEvent) and not e.snapshot]
    assert [e.after["id"] for e in first if e.after] == [3, 4, 5]  # no change event for rows 1 to 4's rewrite
    snap = [e for e in items[:rewrite] if isinstance(e, ChangeEvent) and e.snapshot]
    assert {e.after["id"]: e.after["r"] for e in snap if e.after} == {i: source[i] for i in range(1, 6)}  # the values
    resnap = [e.after for e in items[rewrite:] if isinstance(e, ChangeEvent) and e.snapshot and e.after]
    assert {r["id"]: r["z"] for r in resnap} == {i: None for i in range(1, 8)}  # 'old' was the dropped column's
    await land(tmp_path, items)
    versions, _ = landed(tmp_path)
    assert versions[1] == [("id", 1, None), ("label", 2, None), ("c", 3, 5)]
    assert versions[2] == [("id", 1, None), ("title", 2, None), ("c", 3, None)]
    assert [c[:2] for c in versions[max(versions)]] == [("id", 1), ("title", 2), ("c", 3), ("r", 4), ("z", 6)]


async def test_changes_made_while_cdcd_was_stopped_are_told_by_what_the_checkpoint_landed(
        make_config: Callable[..., Config], sql: Callable[[str], str]) -> None:
    sql("CREATE TABLE t (id int PRIMARY KEY, v text); INSERT INTO t VALUES (1, 'a'), (2, 'b'); "
        "CREATE TABLE u (id int PRIMARY KEY)")
    cfg = make_config(["public.t", "public.u"])
    async with Driver(cfg) as d:
        await d.until_mark(MarkKind.SNAPSHOT_DONE)
        # The last transaction is another table's: the slot sends it again at the start, not one of t's (whose
        # Relation message would show t's columns before the ALTER).
        sql("INSERT INTO t VALUES (3, 'c')")
        sql("INSERT INTO u VALUES (1)")
        await d.events(2)
        await d.until_mark(MarkKind.COMMIT)  # u's: the checkpoint's flush position is its commit
        await d.commit()
        position, state = d.position, d.state
    assert state["columns"]["public.t"] == [["id", 1, "int4"], ["v", 2, "text"]]
    assert state["column_tops"] == {"public.t": 2, "public.u": 1}
    # Stopped: a column with a constant default, then a change. The catalog read at the next start already
    # has the column; the checkpoint says the mirror does not.
    sql("ALTER TABLE t ADD COLUMN c text DEFAULT 'k'; INSERT INTO t (id) VALUES (4)")
    async with Driver(cfg, position, state) as d:
        [ev] = await d.events(1)
        sql("INSERT INTO u VALUES (2)")
        await d.events(1)
        await d.until_mark(MarkKind.COMMIT)
        await d.commit()
        position, state = d.position, d.state
    assert [(c.name, c.id, c.fill) for c in ev.schema.columns] == [("id", 1, None), ("v", 2, None),
                                                                   ("c", 3, Fill("k"))]
    # Stopped again: a volatile default. The start re-snapshots the table.
    sql("ALTER TABLE t ADD COLUMN r float8 DEFAULT random(); INSERT INTO t (id) VALUES (5)")
    async with Driver(cfg, position, state) as d:
        items = await d.until_mark(MarkKind.INCREMENTAL_DONE)
    snap = {e.after["id"]: e.after["r"] for e in items if isinstance(e, ChangeEvent) and e.snapshot and e.after}
    assert snap == {int(i): float(r) for i, r in (x.split("|") for x in sql("SELECT id, r FROM t").splitlines())}
