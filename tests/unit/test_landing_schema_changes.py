"""The manifest's schema-change records (docs/landing-format.md, ``schema_changes``): built from the sources'
schema-change marks, in batch order, read back; a batch holding only one lands; older versions read without."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pytest

from cdcd.errors import SinkFatal
from cdcd.events import Column, Fill, Mark, MarkKind, TableId, TableSchema, lands
from cdcd.landing.manifest import ColumnEntry, SchemaChangeRecord, load_manifest, seal
from cdcd.landing.reader import read_batches
from cdcd.positions import PgPosition
from cdcd.runtime.interfaces import Batch
from cdcd.sinks.landing import LandingSink

T = TableId("shop", "orders")
V2 = TableSchema(T, (Column("id", pa.int64(), "bigint", nullable=False, id=1),
                     Column("note", pa.string(), "text", id=3, fill=Fill("new"))), ("id",), version=2)
V3 = TableSchema(T, (Column("id", pa.int64(), "bigint", nullable=False, id=1),), ("id",), version=3)


def change(lsn: int, new: TableSchema, ddl: str | None) -> Mark:
    return Mark(MarkKind.SCHEMA, PgPosition(lsn, 0), {"table": str(new.table), "change": new, "ddl": ddl})


async def test_schema_changes_land_in_batch_order_and_read_back(tmp_path: Path) -> None:
    sink = LandingSink(tmp_path, source_kind="mysql")
    await sink.open()
    # marks only: the batch lands (no files) because it holds schema changes; a SCHEMA mark without "change"
    # (a schema the source merely learns, e.g. at a snapshot) records nothing
    batch = Batch(1, [Mark(MarkKind.SCHEMA, PgPosition(5, 0), {"table": str(T)}),
                      change(10, V2, "ALTER TABLE orders ADD note text DEFAULT 'new'"), change(20, V3, None)])
    assert [lands(m) for m in batch.items if isinstance(m, Mark)] == [False, True, True]
    await sink.deliver(batch)
    await sink.close()
    [landed] = read_batches(tmp_path)
    m = landed.manifest
    assert (m.event_count, m.files, m.version) == (0, (), 4)
    assert m.schema_changes == (
        SchemaChangeRecord("shop", "orders", 2, PgPosition(10, 0).encoded,
                           "ALTER TABLE orders ADD note text DEFAULT 'new'",
                           (ColumnEntry("id", "int64", "bigint", False, 1),
                            ColumnEntry("note", "string", "text", True, 3, {"value": "new"}))),
        SchemaChangeRecord("shop", "orders", 3, PgPosition(20, 0).encoded, None,
                           (ColumnEntry("id", "int64", "bigint", False, 1),)),
    )
    doc = load_manifest(tmp_path / "manifests" / "00000000000000000001.json")
    assert doc["schema_changes"][1] == {"table": {"schema": "shop", "name": "orders"}, "version": 3,
                                        "position": PgPosition(20, 0).encoded, "statement": None,
                                        "columns": [{"name": "id", "arrow_type": "int64", "source_type": "bigint",
                                                     "nullable": False, "id": 1}]}
    assert m.to_json() == doc


async def test_a_version_3_manifest_reads_without_schema_changes(tmp_path: Path) -> None:
    sink = LandingSink(tmp_path, source_kind="postgres")
    await sink.open()
    await sink.deliver(Batch(1, [change(10, V3, None)]))
    await sink.close()
    path = tmp_path / "manifests" / "00000000000000000001.json"
    old = {k: v for k, v in load_manifest(path).items() if k not in ("schema_changes", "checksum")}
    path.write_text(json.dumps(seal({**old, "version": 3})))
    [landed] = read_batches(tmp_path)
    assert landed.manifest.version == 3 and landed.manifest.schema_changes == ()
    assert landed.manifest.to_json() == load_manifest(path)  # reads back as it was landed
    # a version 4 manifest written before the field existed reads without records too
    path.write_text(json.dumps(seal({**old, "version": 4})))
    assert read_batches(tmp_path)[0].manifest.schema_changes == ()


async def test_a_schema_change_mark_without_a_schema_is_refused(tmp_path: Path) -> None:
    sink = LandingSink(tmp_path, source_kind="postgres")
    await sink.open()
    with pytest.raises(SinkFatal, match="needs detail 'change'"):
        await sink.deliver(Batch(1, [Mark(MarkKind.SCHEMA, PgPosition(1, 0), {"table": str(T), "change": {}})]))
    await sink.close()
