"""The checkpoint's ``inside_tx`` follows the stream, not the items an incremental snapshot places in it.

An incremental snapshot's chunk (its rows, its Marks) can be placed between two rows events of one streamed
transaction. A batch that ends there still ends inside that transaction: after a failover the new server
re-sends the whole transaction and the delivered part must be skipped (``inside_tx``), else it lands twice.
"""

from __future__ import annotations

import pyarrow as pa

from cdcd.events import ChangeEvent, Column, Item, Mark, MarkKind, Op, RowBlock, TableId, TableSchema
from cdcd.positions import MySqlPosition
from cdcd.sources.mysql.state import fold_state

T = TableSchema(TableId("d", "t"), (Column("id", pa.int64(), "int"),), ("id",))
U = TableSchema(TableId("d", "u"), (Column("id", pa.int64(), "int"),), ("id",))
MID = MySqlPosition.at("b.000001", 100, 2, "0-1-5")
START = {"incremental": {"d.u": {"where": None, "last_key": None, "rows": 0, "chunks": 0, "lw": None,
                                 "status": "running"}}}


def _streamed(seq: int) -> ChangeEvent:
    return ChangeEvent(Op.CREATE, T, MySqlPosition.at("b.000001", 100, seq, "0-1-5"), after={"id": seq})


def _chunk() -> list[Item]:
    rows = RowBlock(U, MID, pa.table({"id": pa.array([1, 2], pa.int64())}), Op.READ, True)
    return [rows, Mark(MarkKind.INCREMENTAL_CHUNK, MID, {"table": "d.u", "last_key": [2], "rows": 2,
                                                        "lw": MID.to_json(), "reread": []})]


def test_a_batch_ending_on_a_chunk_placed_inside_a_transaction_stays_inside_it() -> None:
    state = fold_state(START, [_streamed(1), *_chunk()])
    assert state.get("inside_tx") is True
    assert state["incremental"]["d.u"]["chunks"] == 1


def test_a_batch_ending_on_snapshot_rows_placed_inside_a_transaction_stays_inside_it() -> None:
    assert fold_state(START, [_streamed(1), _chunk()[0]]).get("inside_tx") is True


def test_a_batch_of_only_snapshot_items_keeps_what_the_batch_before_ended_in() -> None:
    inside = fold_state(START, [_streamed(1)])
    assert inside.get("inside_tx") is True
    assert fold_state(inside, _chunk()).get("inside_tx") is True
    assert fold_state(inside, [Mark(MarkKind.WATERMARK, MID, {})]).get("inside_tx") is True
    committed = fold_state(inside, [_streamed(2), Mark(MarkKind.COMMIT, MID, {"events": 2})])
    assert "inside_tx" not in committed
    assert "inside_tx" not in fold_state(committed, _chunk())
