"""ChangeBlock: per-block positions, slices, the skip rule inside a block, batch cuts, landing."""

from __future__ import annotations

from datetime import UTC, datetime

import pyarrow as pa

from cdcd.events import BEFORE_KEY, ChangeBlock, Column, Op, TableId, TableSchema, event_count
from cdcd.positions import MySqlPosition, PgPosition
from cdcd.runtime.batcher import Batcher
from cdcd.sinks.arrow import block_to_table, events_to_table

SCHEMA = TableSchema(TableId("public", "t"), (Column("id", pa.int32(), "int4"), Column("v", pa.string(), "text")),
                     ("id",))


def _block(start: PgPosition | MySqlPosition, n: int = 5) -> ChangeBlock:
    ops = pa.array(["c", "u", "d", "u", "c"][:n])
    # row 2 is a key-only delete (its other values are not known), row 3's v is unavailable: both NULL
    values = [None if i in (2, 3) else f"v{i}" for i in range(n)]
    data = pa.table({"id": pa.array(range(1, n + 1), pa.int32()), "v": pa.array(values, pa.string())})
    # row 1 (an update) changed its key from 11 to 2; row 2 (a delete) has its old key
    before = pa.table({"id": pa.array([None, 11, 3, None, None][:n], pa.int32()),
                       "v": pa.array([None] * n, pa.string())})
    kinds = pa.array([0, BEFORE_KEY, BEFORE_KEY, 0, 0][:n], pa.int8())
    changed = pa.array([False, True, False, False, False][:n])
    gone = tuple((("v",) if i == 3 else ()) for i in range(n))
    return ChangeBlock(SCHEMA, start, ops, data, before, kinds, ("id",), gone, changed, "77",
                       datetime(2026, 1, 2, tzinfo=UTC))


def test_positions_are_the_first_rows_and_consecutive_sequence_numbers() -> None:
    for start in (PgPosition(0x1234, 7), MySqlPosition.at("bin.000012", 400, 3, epoch=2)):
        block = _block(start)
        expected = [block.position_at(i).encoded for i in range(5)]
        assert [e.position.encoded for e in block.events()] == expected
        assert block.encoded_positions().to_pylist() == expected
        assert block.position == block.position_at(4) and event_count(block) == 5


def test_events_carry_ops_before_after_keys_and_unavailable_columns() -> None:
    events = _block(PgPosition(100, 1)).events()
    assert [e.op for e in events] == [Op.CREATE, Op.UPDATE, Op.DELETE, Op.UPDATE, Op.CREATE]
    assert events[1].before == {"id": 11} and events[1].before_key == (11,) and events[1].key == (2,)
    assert events[2].before == {"id": 3} and events[2].after is None and events[2].key == (3,)
    assert events[3].before is None and events[3].unavailable == ("v",)
    assert all(e.tx_id == "77" and not e.snapshot for e in events)


def test_after_keeps_the_rows_above_a_position_inside_the_block() -> None:
    block = _block(PgPosition(100, 1))
    assert block.after(PgPosition(99, 50)) is block
    assert block.after(PgPosition(100, 5)) is None and block.after(PgPosition(101, 0)) is None
    rest = block.after(PgPosition(100, 3))
    assert rest is not None and rest.rows == 2 and rest.start == PgPosition(100, 4)
    assert [e.op for e in rest.events()] == [Op.UPDATE, Op.CREATE] and rest.events()[0].unavailable == ("v",)


def test_the_batcher_cuts_a_block_between_batches_without_losing_a_row() -> None:
    batcher = Batcher(max_events=3, max_delay_s=60)
    rest = batcher.add(_block(PgPosition(100, 1)))
    assert batcher.full and rest is not None and rest.rows == 2
    first = batcher.seal(1)
    assert first.event_count == 3 and first.last_position == PgPosition(100, 3)
    assert batcher.add(rest) is None and batcher.seal(2).first_position == PgPosition(100, 5)


def test_a_block_lands_as_its_events_would() -> None:
    block = _block(PgPosition(100, 1))
    landed = block_to_table(SCHEMA, 9, 4, block)
    expected = events_to_table(SCHEMA, 9, block.events(), range(4, 9))
    assert landed.equals(expected)
    assert landed.column("_cdc_before_key").to_pylist() == [None, {"id": 11}, None, None, None]
    assert landed.column("_cdc_unavailable").to_pylist() == [[], [], [], ["v"], []]
