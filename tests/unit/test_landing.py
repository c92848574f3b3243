"""The landing zone sink: format, atomicity, acks and retention, on a real directory."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
from datetime import UTC, datetime, timedelta, timezone
from decimal import Decimal
from pathlib import Path

import pyarrow as pa
import pytest

from cdcd.errors import SinkFatal
from cdcd.events import ChangeEvent, Column, Mark, MarkKind, Op, TableId, TableSchema
from cdcd.landing.manifest import load_manifest
from cdcd.landing.reader import consumed_seqs, landed_seqs, mark_consumed, read_batches
from cdcd.positions import PgPosition
from cdcd.runtime.interfaces import Batch
from cdcd.sinks.landing import LandingSink

ORDERS = TableSchema(
    TableId("public", "orders"),
    (
        Column("id", pa.int64(), "bigint", nullable=False),
        Column("amount", pa.decimal128(12, 2), "numeric(12,2)"),
        Column("at", pa.timestamp("us", tz="UTC"), "timestamptz"),
        Column("blob", pa.binary(), "bytea"),
        Column("doc", pa.string(), "jsonb"),
        Column("tags", pa.list_(pa.string()), "text[]"),
    ),
    ("id",),
    version=1,
)
ORDERS_V2 = TableSchema(ORDERS.table, (*ORDERS.columns, Column("note", pa.string(), "text")), ("id",), version=2)
ITEMS = TableSchema(TableId("public", "items"), (Column("k", pa.string(), "text"),), ("k",))
TS = datetime(2024, 5, 1, 12, 0, tzinfo=timezone(timedelta(hours=2)))


def ev(op: Op, lsn: int, seq: int, schema: TableSchema = ORDERS, **kw: object) -> ChangeEvent:
    return ChangeEvent(op, schema, PgPosition(lsn, seq), tx_id=str(lsn), commit_ts=TS, **kw)  # type: ignore[arg-type]


def row(i: int, **over: object) -> dict[str, object]:
    base = {"id": i, "amount": Decimal("12.30"), "at": TS, "blob": b"\x00\xff", "doc": '{"a": 1}', "tags": ["x"]}
    return {**base, **over}


def mixed_batch(seq: int) -> Batch:
    return Batch(
        seq,
        [
            ev(Op.READ, 100, 0, after=row(1), snapshot=True),
            ev(Op.CREATE, 200, 1, after=row(2)),
            Mark("heartbeat", PgPosition(200, 2)),
            ev(Op.UPDATE, 300, 1, before=row(2), after=row(3, blob=None), unavailable=("blob",)),
            ev(Op.CREATE, 300, 2, schema=ITEMS, after={"k": "a"}),
            ev(Op.DELETE, 400, 1, before={"id": 1}),
            ev(Op.TRUNCATE, 500, 1),
        ],
    )


async def test_batch_lands_with_typed_columns_and_metadata(tmp_path: Path) -> None:
    sink = LandingSink(tmp_path, source_kind="postgres")
    assert await sink.open() == 0
    await sink.deliver(mixed_batch(7))
    [landed] = read_batches(tmp_path)
    assert landed.seq == 7 and not landed.consumed
    m = landed.manifest.to_json()
    assert m == load_manifest(tmp_path / "manifests" / "00000000000000000007.json")  # the document as landed
    assert (m["format"], m["version"], m["batch_seq"], m["event_count"]) == ("cdcd-landing", 4, 7, 6)
    assert m["first_position"] == PgPosition(100, 0).encoded and m["last_position"] == PgPosition(500, 1).encoded
    assert [f["rows"] for f in m["files"]] == [5, 1]
    orders = landed.tables[ORDERS.table]
    assert orders.schema.field("amount").type == pa.decimal128(12, 2)
    assert orders.schema.field("at").type == pa.timestamp("us", tz="UTC")
    assert orders.schema.field("_cdc_commit_ts").type == pa.timestamp("us", tz="UTC")
    rows = orders.to_pylist()
    assert [r["_cdc_op"] for r in rows] == ["r", "c", "u", "d", "t"]
    assert [r["_cdc_index"] for r in rows] == [0, 1, 2, 4, 5]
    assert rows[0]["_cdc_snapshot"] and not rows[1]["_cdc_snapshot"]
    assert rows[1]["amount"] == Decimal("12.30") and rows[1]["blob"] == b"\x00\xff" and rows[1]["tags"] == ["x"]
    assert rows[1]["at"] == TS and rows[1]["_cdc_commit_ts"] == TS.astimezone(UTC)
    assert rows[2]["_cdc_before_key"] == {"id": 2} and rows[2]["id"] == 3
    assert rows[2]["_cdc_unavailable"] == ["blob"] and rows[2]["blob"] is None
    assert rows[1]["_cdc_before_key"] is None
    assert rows[3]["id"] == 1 and rows[3]["amount"] is None
    assert rows[4]["id"] is None and rows[4]["_cdc_pos"] == PgPosition(500, 1).encoded
    assert [r["_cdc_pos"] for r in rows] == sorted(r["_cdc_pos"] for r in rows)
    assert landed.tables[ITEMS.table].column("k").to_pylist() == ["a"]
    await sink.close()


async def test_schema_change_inside_a_batch_lands_one_file_per_schema(tmp_path: Path) -> None:
    sink = LandingSink(tmp_path)
    await sink.open()
    await sink.deliver(
        Batch(1, [ev(Op.CREATE, 10, 1, after=row(1)), ev(Op.CREATE, 20, 1, schema=ORDERS_V2, after=row(2, note="n"))])
    )
    [landed] = read_batches(tmp_path)
    assert [f.table.version for f in landed.manifest.files] == [1, 2]
    assert landed.manifest.files[1].table.column_names[-1] == "note"
    assert "note" not in landed.files[0].data.column_names
    assert landed.tables[ORDERS.table].column("note").to_pylist() == [None, "n"]


async def test_open_returns_highest_seq_and_seqs_may_have_gaps(tmp_path: Path) -> None:
    sink = LandingSink(tmp_path)
    await sink.open()
    for seq in (1, 2, 5):
        await sink.deliver(Batch(seq, [ev(Op.CREATE, seq * 10, 1, after=row(seq))]))
    await sink.close()
    again = LandingSink(tmp_path)
    assert await again.open() == 5
    assert landed_seqs(tmp_path) == [1, 2, 5]
    with pytest.raises(SinkFatal, match="never be reused"):
        await again.deliver(Batch(5, [ev(Op.CREATE, 60, 1, after=row(6))]))


CRASH = textwrap.dedent(
    """
    import os, sys
    sys.path.insert(0, {tests!r})
    from test_landing import mixed_batch
    from cdcd.sinks.landing import LandingWriter
    w = LandingWriter(__import__("pathlib").Path({path!r}), "run")
    w.prepare()
    manifest = w.stage(mixed_batch(3))  # data files renamed into place and fsynced
    open(os.path.join({path!r}, "manifests", ".00000000000000000003.json.1.tmp"), "w").write("{{")
    os._exit(9)  # the process dies before the manifest is renamed into place
    """
)


async def test_crash_between_data_files_and_manifest_leaves_nothing(tmp_path: Path) -> None:
    sink = LandingSink(tmp_path)
    await sink.open()
    await sink.deliver(mixed_batch(2))
    await sink.close()
    code = CRASH.format(tests=str(Path(__file__).parent), path=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 9, proc.stderr
    assert len(os.listdir(tmp_path / "data")) == 4  # the crashed batch's two files are there, unpublished
    assert landed_seqs(tmp_path) == [2]  # a reader sees only the complete batch
    again = LandingSink(tmp_path)
    assert await again.open() == 2
    assert sorted(os.listdir(tmp_path / "data")) == [f"{2:020d}-{n:04d}.parquet" for n in (0, 1)]
    assert os.listdir(tmp_path / "manifests") == ["00000000000000000002.json"]
    await again.deliver(mixed_batch(3))
    assert [b.seq for b in read_batches(tmp_path)] == [2, 3]


async def _next_ack(sink: LandingSink) -> int:
    async for seq in sink.acks():
        return seq
    raise AssertionError("ack stream ended")


async def test_landed_mode_acks_once_durable(tmp_path: Path) -> None:
    sink = LandingSink(tmp_path, ack="landed")
    await sink.open()
    await sink.deliver(mixed_batch(4))
    assert await asyncio.wait_for(_next_ack(sink), 5) == 4
    await sink.close()


async def test_consumed_mode_acks_only_after_the_marker(tmp_path: Path) -> None:
    sink = LandingSink(tmp_path, ack="consumed")
    await sink.open()
    await sink.deliver(mixed_batch(1))
    await sink.deliver(mixed_batch(2))
    waiting = asyncio.create_task(_next_ack(sink))
    await asyncio.sleep(0.5)
    assert not waiting.done()  # nothing consumed, nothing acked
    mark_consumed(tmp_path, 2)
    assert await asyncio.wait_for(waiting, 5) == 2
    mark_consumed(tmp_path, 1)
    assert await asyncio.wait_for(_next_ack(sink), 5) == 1
    await sink.close()


async def test_retention_removes_only_consumed_and_old_batches(tmp_path: Path) -> None:
    sink = LandingSink(tmp_path, retention_s=0)
    await sink.open()
    for seq in (1, 2, 3):
        await sink.deliver(mixed_batch(seq))
    mark_consumed(tmp_path, 1)
    mark_consumed(tmp_path, 3)
    await sink.committed(2)  # 3 is consumed but not yet checkpointed; 2 is not consumed
    assert landed_seqs(tmp_path) == [2, 3]
    assert consumed_seqs(tmp_path) == [3]
    assert not any(n.startswith("00000000000000000001") for n in os.listdir(tmp_path / "data"))
    keep = LandingSink(tmp_path, retention_s=3600)
    await keep.open()
    await keep.committed(3)
    assert landed_seqs(tmp_path) == [2, 3]  # consumed, but younger than the retention
    await sink.committed(3)
    assert landed_seqs(tmp_path) == [2]


async def test_tampered_manifest_is_refused(tmp_path: Path) -> None:
    sink = LandingSink(tmp_path)
    await sink.open()
    await sink.deliver(mixed_batch(1))
    path = tmp_path / "manifests" / "00000000000000000001.json"
    doc = json.loads(path.read_text())
    doc["event_count"] = 99
    path.write_text(json.dumps(doc))
    with pytest.raises(SinkFatal, match="checksum"):
        read_batches(tmp_path)


async def test_zone_identity_is_created_once_and_stamped_on_every_manifest(tmp_path: Path) -> None:
    from cdcd.landing.manifest import load_manifest, seal
    from cdcd.landing.zone import read_zone_id

    sink = LandingSink(tmp_path, source_kind="postgres")
    await sink.open()
    zone = read_zone_id(tmp_path)
    assert zone is not None and len(zone) == 32
    await sink.deliver(mixed_batch(1))
    await sink.close()
    again = LandingSink(tmp_path, source_kind="postgres")
    await again.open()  # a restart keeps the identity
    await again.deliver(mixed_batch(2))
    await again.close()
    assert read_zone_id(tmp_path) == zone
    assert [b.manifest.zone_id for b in read_batches(tmp_path)] == [zone, zone]
    # a version 1 manifest (no zone_id) stays readable
    path = tmp_path / "manifests" / "00000000000000000001.json"
    old = {k: v for k, v in load_manifest(path).items() if k not in ("zone_id", "checksum")}
    path.write_text(json.dumps(seal({**old, "version": 1})))
    assert "zone_id" not in load_manifest(path)


def covered_mark(lsn: int, below: PgPosition, table: object = ORDERS.table) -> Mark:
    return Mark(MarkKind.SNAPSHOT_COVERED, PgPosition(lsn, 0), {"table": table, "below": below})


async def test_a_completed_resnapshot_is_recorded_in_the_manifest(tmp_path: Path) -> None:
    from cdcd.landing.manifest import covered_records
    from cdcd.landing.reader import Covered, covered_tables

    sink = LandingSink(tmp_path, source_kind="postgres")
    await sink.open()
    # with rows: the record rides along; the table may be a TableId or its text
    await sink.deliver(Batch(3, [*mixed_batch(3).items, covered_mark(600, PgPosition(150, 0)),
                                 covered_mark(600, PgPosition(90, 0), "public.items")]))
    # a batch of marks only lands when it holds such a record; rows: none, files: none
    await sink.deliver(Batch(4, [Mark(MarkKind.HEARTBEAT, PgPosition(700, 0)),
                                 covered_mark(800, PgPosition(650, 0))]))
    await sink.close()
    first, second = read_batches(tmp_path)
    assert covered_records(first.manifest) == [("public", "orders", PgPosition(150, 0).encoded),
                                               ("public", "items", PgPosition(90, 0).encoded)]
    assert first.manifest.event_count == 6
    m = second.manifest.to_json()
    assert (m["event_count"], m["files"], m["first_position"], m["last_position"]) == (0, [], None, None)
    assert m["covered"] == [{"table": {"schema": "public", "name": "orders"}, "below": PgPosition(650, 0).encoded}]
    # per table over a run of batches: the highest threshold and the last batch holding a record
    assert covered_tables([(b.seq, b.manifest) for b in (first, second)]) == {
        ("public", "orders"): Covered(PgPosition(650, 0).encoded, 4),
        ("public", "items"): Covered(PgPosition(90, 0).encoded, 3),
    }


async def test_a_version_2_manifest_reads_without_covered_records(tmp_path: Path) -> None:
    from cdcd.landing.manifest import covered_records, load_manifest, seal

    sink = LandingSink(tmp_path, source_kind="postgres")
    await sink.open()
    await sink.deliver(mixed_batch(1))
    await sink.close()
    path = tmp_path / "manifests" / "00000000000000000001.json"
    old = {k: v for k, v in load_manifest(path).items() if k not in ("covered", "schema_changes", "checksum")}
    path.write_text(json.dumps(seal({**old, "version": 2})))
    [landed] = read_batches(tmp_path)
    assert landed.manifest.version == 2 and covered_records(landed.manifest) == []
    assert landed.manifest.to_json() == load_manifest(path)  # an older version reads back as it was landed
    path.write_text(json.dumps(seal({**old, "version": 6})))  # a newer format is refused, naming the fix
    with pytest.raises(SinkFatal, match="format version 6; this cdcd reads versions 1, 2, 3, 4, 5"):
        read_batches(tmp_path)


async def test_a_covered_mark_without_its_detail_is_refused(tmp_path: Path) -> None:
    sink = LandingSink(tmp_path, source_kind="postgres")
    await sink.open()
    with pytest.raises(SinkFatal, match=r"needs detail 'table' \(schema.table\) and 'below'"):
        await sink.deliver(Batch(1, [Mark(MarkKind.SNAPSHOT_COVERED, PgPosition(1, 0), {"table": "orders"})]))
    await sink.close()
    assert landed_seqs(tmp_path) == []
