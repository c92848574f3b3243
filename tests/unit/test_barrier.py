"""The commit barrier: the committed point is the end of the longest acked prefix."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cdcd.errors import StateError
from cdcd.events import Mark
from cdcd.positions import PgPosition
from cdcd.runtime.barrier import CommitBarrier
from cdcd.runtime.interfaces import Batch


def _batch(seq: int) -> Batch:
    return Batch(seq, [Mark("heartbeat", PgPosition(seq, 0))])


async def _commit_prefix(barrier: CommitBarrier) -> None:
    prefix = barrier.committable()
    if prefix:
        await barrier.mark_durable(prefix)


@given(st.integers(min_value=1, max_value=30).flatmap(
    lambda n: st.tuples(st.just(n), st.permutations(range(1, n + 1)), st.integers(min_value=0, max_value=n))
))
def test_committed_is_end_of_longest_acked_prefix(case: tuple[int, list[int], int]) -> None:
    n, order, how_many = case

    async def scenario() -> None:
        barrier = CommitBarrier(base_seq=0, committed_events=0, max_inflight=n)
        for seq in range(1, n + 1):
            barrier.add(_batch(seq))
        acked: set[int] = set()
        for seq in order[:how_many]:
            barrier.ack(seq)
            acked.add(seq)
            await _commit_prefix(barrier)
            prefix = 0
            while prefix + 1 in acked:
                prefix += 1
            assert barrier.committed_seq == prefix
            assert barrier.inflight == n - prefix

    asyncio.run(scenario())


async def test_failed_save_then_good_save_commits() -> None:
    barrier = CommitBarrier(base_seq=10, committed_events=100, max_inflight=4)
    for seq in (11, 12, 13):
        barrier.add(Batch(seq, []))
    barrier.ack(11)
    barrier.ack(12)
    first = barrier.committable()
    assert [b.seq for b in first] == [11, 12]
    # The save failed: nothing is marked durable. The next ack offers the prefix again, extended.
    barrier.ack(13)
    second = barrier.committable()
    assert [b.seq for b in second] == [11, 12, 13]
    await barrier.mark_durable(second)
    assert barrier.committed_seq == 13
    assert barrier.inflight == 0


async def test_reserve_blocks_until_a_slot_frees() -> None:
    barrier = CommitBarrier(base_seq=0, committed_events=0, max_inflight=2)
    await barrier.reserve()
    barrier.add(_batch(1))
    await barrier.reserve()
    barrier.add(_batch(2))
    waiter = asyncio.ensure_future(barrier.reserve())
    await asyncio.sleep(0.05)
    assert not waiter.done()
    barrier.ack(1)
    await _commit_prefix(barrier)
    await asyncio.wait_for(waiter, 1)


def test_stale_acks_are_ignored_and_unknown_acks_refused() -> None:
    barrier = CommitBarrier(base_seq=5, committed_events=0, max_inflight=2)
    barrier.add(_batch(6))
    assert barrier.ack(3) is False  # landed before a restart, already covered
    with pytest.raises(StateError, match="never delivered"):
        barrier.ack(9)
    with pytest.raises(StateError, match="strictly increase"):
        barrier.add(_batch(6))


async def test_committed_event_count_is_hydrated_and_advances() -> None:
    import pyarrow as pa

    from cdcd.events import ChangeEvent, Column, Op, TableId, TableSchema

    schema = TableSchema(TableId("public", "t"), (Column("id", pa.int64(), "int8"),), ("id",))
    event = ChangeEvent(Op.CREATE, schema, PgPosition(1, 1), after={"id": 1})
    barrier = CommitBarrier(base_seq=7, committed_events=1000, max_inflight=2)
    barrier.add(Batch(8, [event, event]))
    barrier.ack(8)
    await _commit_prefix(barrier)
    assert barrier.committed_events == 1002
