"""The commit barrier: which delivered batches may be checkpointed.

Batches are registered in seq order as they are delivered and acked in any
order. Only the contiguous acked prefix is committable; it becomes committed
once the caller has saved a checkpoint for it (``mark_durable``). A failed
save leaves the prefix committable, so the runtime's retry timer saves it
later (it cannot wait for the next ack: none may come once every slot is
taken). At most
``max_inflight`` batches are registered and not yet durable: ``reserve`` waits
for a free slot, which is how backpressure reaches the source.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict

from cdcd.errors import StateError
from cdcd.runtime.interfaces import Batch


class CommitBarrier:
    def __init__(self, base_seq: int, committed_events: int, max_inflight: int) -> None:
        if max_inflight < 1:
            raise ValueError("max_inflight must be at least 1")
        self.committed_seq = base_seq
        self.committed_events = committed_events
        self.max_inflight = max_inflight
        self._inflight: OrderedDict[int, Batch] = OrderedDict()
        self._acked: set[int] = set()
        self._changed = asyncio.Condition()

    @property
    def inflight(self) -> int:
        return len(self._inflight)

    @property
    def pending_events(self) -> int:
        return sum(b.event_count for b in self._inflight.values())

    def pending_batches(self) -> list[Batch]:
        return list(self._inflight.values())

    async def reserve(self) -> None:
        """Wait until another batch may be delivered."""
        async with self._changed:
            await self._changed.wait_for(lambda: len(self._inflight) < self.max_inflight)

    def add(self, batch: Batch) -> None:
        last = next(reversed(self._inflight)) if self._inflight else self.committed_seq
        if batch.seq <= last:
            raise StateError(f"batch {batch.seq} is not after batch {last}: batch seqs must strictly increase")
        self._inflight[batch.seq] = batch

    def ack(self, seq: int) -> bool:
        """Record an ack. Acks for batches committed already (or from before a restart) are ignored."""
        if seq not in self._inflight:
            if seq <= self.committed_seq:
                return False
            raise StateError(f"ack for batch {seq}, which was never delivered")
        self._acked.add(seq)
        return True

    def committable(self) -> list[Batch]:
        """The contiguous acked prefix of the in-flight batches."""
        out = []
        for seq, batch in self._inflight.items():
            if seq not in self._acked:
                break
            out.append(batch)
        return out

    async def mark_durable(self, batches: list[Batch]) -> None:
        """The checkpoint now covers ``batches`` (a prefix returned by ``committable``)."""
        for batch in batches:
            first = next(iter(self._inflight))
            if batch.seq != first:
                raise StateError(f"batch {batch.seq} committed out of order (expected {first})")
            del self._inflight[first]
            self._acked.discard(first)
            self.committed_seq = batch.seq
            self.committed_events += batch.event_count
        async with self._changed:
            self._changed.notify_all()

    async def wait_drained(self) -> None:
        """Wait until nothing is in flight."""
        async with self._changed:
            await self._changed.wait_for(lambda: not self._inflight)

    def drop_all(self) -> list[Batch]:
        """Forget every in-flight batch (force stop) and return them."""
        dropped = list(self._inflight.values())
        self._inflight.clear()
        self._acked.clear()
        return dropped
