"""RowBlocks: landing (same Parquet as events), batch cutting, the PostgreSQL fold."""

from __future__ import annotations

import hashlib
from datetime import UTC, date, datetime
from decimal import Decimal
from pathlib import Path

import pyarrow as pa

from cdcd.events import ChangeEvent, Column, Mark, MarkKind, Op, RowBlock, TableId, TableSchema
from cdcd.landing.manifest import Manifest
from cdcd.landing.reader import read_batch
from cdcd.positions import PgPosition, format_lsn
from cdcd.runtime.batcher import Batcher
from cdcd.runtime.interfaces import Batch
from cdcd.sinks.landing import LandingWriter
from cdcd.sources.postgres.state import fold_state

T = TableSchema(
    TableId("public", "t"),
    (
        Column("id", pa.int64(), "int8", nullable=False),
        Column("n", pa.decimal128(12, 2), "numeric(12,2)"),
        Column("at", pa.timestamp("us", tz="UTC"), "timestamptz"),
        Column("d", pa.date32(), "date"),
        Column("blob", pa.binary(), "bytea"),
        Column("f", pa.float32(), "float4"),
        Column("ok", pa.bool_(), "bool"),
        Column("doc", pa.string(), "jsonb"),
        Column("tags", pa.list_(pa.int32()), "int4[]"),
    ),
    ("id",),
    version=3,
)
U = TableSchema(TableId("public", "u"), (Column("s", pa.string(), "text"),), ())
W = PgPosition(0x16B3A40, 0)


def rows(first: int, count: int) -> list[dict[str, object]]:
    return [
        {"id": i, "n": None if i % 5 == 0 else Decimal(f"{i}.25"), "at": datetime(2024, 1, 1, 0, 0, i % 60, tzinfo=UTC),
         "d": date(2024, 2, 1 + i % 28), "blob": bytes([i % 256]) * (i % 3), "f": 0.5 * i, "ok": i % 2 == 0,
         "doc": '{"a": "x,\\"y\\"\\n"}' if i % 7 else "", "tags": [i, None] if i % 4 else []}
        for i in range(first, first + count)
    ]


def block(schema: TableSchema, data: list[dict[str, object]]) -> RowBlock:
    table = pa.Table.from_pylist(data, schema=pa.schema([pa.field(c.name, c.type) for c in schema.columns]))
    return RowBlock(schema, W, table)


def snap_events(schema: TableSchema, data: list[dict[str, object]]) -> list[ChangeEvent]:
    return [ChangeEvent(Op.READ, schema, W, after=r, snapshot=True) for r in data]


def land(tmp_path: Path, name: str, batch: Batch) -> tuple[Manifest, list[bytes]]:
    writer = LandingWriter(tmp_path / name, "run")
    writer.prepare()
    manifest = writer.land(batch)
    files = [(tmp_path / name / f.path).read_bytes() for f in manifest.files]
    return manifest, files


def test_a_block_lands_the_same_parquet_as_the_events_of_its_rows(tmp_path: Path) -> None:
    data = rows(1, 50)
    m_events, f_events = land(tmp_path, "events", Batch(7, [*snap_events(T, data)]))
    m_block, f_block = land(tmp_path, "block", Batch(7, [block(T, data)]))
    assert f_block == f_events  # byte for byte: same schema, same values, same metadata columns
    for key in ("event_count", "first_position", "last_position"):
        assert getattr(m_block, key) == getattr(m_events, key)
    assert m_block.files == m_events.files
    assert hashlib.sha256(f_block[0]).hexdigest() == m_block.files[0].sha256


def test_blocks_and_events_of_a_batch_share_one_file_per_table_in_batch_order(tmp_path: Path) -> None:
    data = rows(1, 30)
    evs = snap_events(T, data)
    items = [evs[0], block(T, data[1:11]), Mark("heartbeat", W), *snap_events(U, [{"s": "a"}]), block(T, data[11:12]),
             *evs[12:20], block(T, data[20:])]
    mixed, _ = land(tmp_path, "mixed", Batch(4, items))
    land(tmp_path, "plain", Batch(4, [evs[0], *evs[1:11], *snap_events(U, [{"s": "a"}]), *evs[11:]]))
    got, want = read_batch(tmp_path / "mixed", 4), read_batch(tmp_path / "plain", 4)
    assert mixed.event_count == 31 and [f.rows for f in mixed.files] == [30, 1]
    assert got.tables[T.table].equals(want.tables[T.table]) and got.tables[U.table].equals(want.tables[U.table])
    t = got.tables[T.table].to_pydict()
    assert t["_cdc_index"] == [*range(0, 11), *range(12, 31)]  # the row of U took index 11
    assert t["id"] == list(range(1, 31)) and set(t["_cdc_op"]) == {"r"} and set(t["_cdc_snapshot"]) == {True}
    assert set(t["_cdc_pos"]) == {W.encoded} and t["_cdc_batch"] == [4] * 30 and t["_cdc_schema_version"] == [3] * 30
    assert t["_cdc_unavailable"] == [[]] * 30 and t["_cdc_before_key"] == [None] * 30 and t["_cdc_tx"] == [None] * 30


def test_the_batcher_splits_blocks_so_a_batch_never_exceeds_max_events() -> None:
    b = Batcher(max_events=10, max_delay_s=60)
    ev = snap_events(T, rows(1, 1))[0]
    assert b.add(ev) is None and b.events == 1
    rest = b.add(block(T, rows(2, 25)))
    assert b.full and b.events == 10 and rest is not None and rest.rows == 16
    first = b.seal(1)
    assert first.event_count == 10 and [type(i).__name__ for i in first.items] == ["ChangeEvent", "RowBlock"]
    rest = b.add(rest)
    assert rest is not None and rest.rows == 6 and b.full
    second = b.seal(2)
    assert b.add(rest) is None and b.events == 6 and not b.full
    b.add(Mark("heartbeat", W))
    third = b.seal(3)
    assert second.event_count == 10 and third.event_count == 6
    ids = [r["id"] for batch in (first, second, third) for i in batch.items if isinstance(i, RowBlock)
           for r in i.data.select(["id"]).to_pylist()]
    assert ids == list(range(2, 27))  # every row once, in order
    assert b.add(block(T, [])) is None and b.events == 0  # an empty block counts nothing


def test_fold_records_the_last_key_of_committed_blocks_and_slices() -> None:
    start = Mark(MarkKind.SNAPSHOT_START, W, {"slot": "s", "watermark": format_lsn(W.lsn)})
    blk = block(T, rows(1, 100))
    state = fold_state({}, [start, blk.slice(0, 40)])
    assert state["snapshot"]["tables"]["public.t"] == {"last_key": ["40"], "rows": 40, "done": False}
    state = fold_state(state, [blk.slice(40, 60), *snap_events(T, rows(101, 2)), block(U, [{"s": "k"}])])
    assert state["snapshot"]["tables"]["public.t"] == {"last_key": ["102"], "rows": 102, "done": False}
    assert state["snapshot"]["tables"]["public.u"] == {"last_key": None, "rows": 1, "done": False}
    state = fold_state(state, [block(T, rows(103, 3)), Mark("snapshot_table_done", W, {"table": "public.t"})])
    assert state["snapshot"]["tables"]["public.t"] == {"last_key": ["105"], "rows": 105, "done": True}


def test_block_events_are_its_rows() -> None:
    data = rows(1, 5)
    evs = block(T, data).events()
    assert [e.after for e in evs] == data and all(e.op is Op.READ and e.snapshot and e.position == W for e in evs)
    assert block(T, data).slice(3).last_key == (5,) and block(U, [{"s": "x"}]).last_key is None


def test_key_text_follows_slices_and_gives_the_fold_the_servers_text() -> None:
    schema = TableSchema(TableId("public", "k"), (Column("id", pa.decimal128(6, 2), "numeric(6,2)", False),), ("id",))
    data = pa.table({"id": pa.array([Decimal("1.00"), None, None], pa.decimal128(6, 2))})  # NaN lands as NULL
    block = RowBlock(schema, PgPosition(1, 0), data, key_text=(pa.array(["1.00", "NaN", "NaN"]),))
    part = block.slice(0, 2)
    assert part.last_key_text() == ("NaN",) and block.slice(0, 1).last_key_text() == ("1.00",)
    state = fold_state({"snapshot": {"status": "running", "tables": {}}}, [part])
    assert state["snapshot"]["tables"]["public.k"]["last_key"] == ["NaN"]
    assert RowBlock(schema, PgPosition(1, 0), data).last_key_text() is None
