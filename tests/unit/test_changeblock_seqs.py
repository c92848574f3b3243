"""ChangeBlock.seqs: rows whose sequence numbers have gaps (MySQL/MariaDB rows events) keep them everywhere."""

from __future__ import annotations

import dataclasses

import pyarrow as pa

from cdcd.events import ChangeBlock, Column, TableId, TableSchema
from cdcd.positions import MySqlPosition
from cdcd.runtime.batcher import Batcher
from cdcd.sinks.arrow import block_to_table

SCHEMA = TableSchema(TableId("app", "t"), (Column("id", pa.int32(), "int"),), ("id",))
SEQS = [3, 4, 5, 40, 41, 90]  # three rows events: their rows' seqs start after each event's offset


def _block() -> ChangeBlock:
    start = MySqlPosition.at("bin.000012", 400, SEQS[0], gtid="0-1-7", epoch=1)
    return ChangeBlock(SCHEMA, start, pa.array(["c"] * 6), pa.table({"id": pa.array(range(6), pa.int32())}),
                       tx_id="0-1-8", seqs=pa.array(SEQS, pa.int64()))


def _at(seq: int) -> MySqlPosition:
    return MySqlPosition.at("bin.000012", 400, seq, gtid="0-1-7", epoch=1)


def test_every_row_keeps_its_sequence_number() -> None:
    block = _block()
    expected = [_at(s) for s in SEQS]
    assert block.positions() == expected == [block.position_at(i) for i in range(6)]
    assert [e.position for e in block.events()] == expected and block.position == _at(90)
    assert block.encoded_positions().to_pylist() == [p.encoded for p in expected]
    assert block_to_table(SCHEMA, 1, 0, block).column("_cdc_pos").to_pylist() == [p.encoded for p in expected]
    assert [t[0] for t in block.touched()] == expected


def test_slices_and_the_skip_rule_follow_the_sequence_numbers() -> None:
    block = _block()
    tail = block.slice(2, 3)
    assert tail.start == _at(5) and tail.positions() == [_at(5), _at(40), _at(41)]
    # a checkpoint inside the block, on a row or between two rows (a seq no row has)
    for skip, first in ((_at(5), 40), (_at(20), 40), (_at(40), 41), (_at(89), 90), (_at(2), 3)):
        kept = block.after(skip)
        assert kept is not None and kept.start == _at(first), skip
        assert kept.positions() == [_at(s) for s in SEQS if s > skip.seq]
    assert block.after(_at(90)) is None
    assert block.after(dataclasses.replace(_at(0), pos=399)) is block


def test_a_batch_cut_keeps_the_positions_on_both_sides() -> None:
    batcher = Batcher(max_events=4, max_delay_s=60.0)
    rest = batcher.add(_block())
    assert rest is not None
    head = batcher.items[0]
    assert isinstance(head, ChangeBlock) and isinstance(rest, ChangeBlock)
    assert head.positions() + rest.positions() == [_at(s) for s in SEQS]
