"""Cutting the item stream into batches by size and age."""

from __future__ import annotations

import time

from cdcd.events import ChangeBlock, ChangeEvent, Item, RowBlock
from cdcd.runtime.interfaces import Batch


class Batcher:
    """Accumulates items; a batch is due when it holds ``max_events`` events or is ``max_delay_s`` old.

    Every row of a RowBlock or ChangeBlock counts as an event. A block that does not fit the
    open batch is split: ``add`` keeps what fits and returns the rest, which
    goes into the next batch, so a batch never holds more than
    ``max_events`` rows. Marks do not count towards ``max_events`` but make a
    batch due by age, so progress such as heartbeats reaches the checkpoint on
    an idle source.
    """

    def __init__(self, max_events: int, max_delay_s: float) -> None:
        self.max_events = max_events
        self.max_delay_s = max_delay_s
        self.items: list[Item] = []
        self.events = 0
        self._opened_at = 0.0

    def add(self, item: Item) -> RowBlock | ChangeBlock | None:
        """Add ``item``; for a block larger than the room left, return the part that did not fit.

        A ChangeBlock cut here is a mid-transaction batch cut: its rows keep their positions, so the batch
        ends at the last row it holds, exactly as it would with one ChangeEvent per row.
        """
        rest: RowBlock | ChangeBlock | None = None
        if type(item) is RowBlock or type(item) is ChangeBlock:
            room = max(self.max_events - self.events, 1)  # a full batch is sealed before the next add
            if item.rows > room:
                item, rest = item.slice(0, room), item.slice(room)
            self._append(item)
            self.events += item.rows
        else:
            self._append(item)
            if type(item) is ChangeEvent:
                self.events += 1
        return rest

    def _append(self, item: Item) -> None:
        if not self.items:
            self._opened_at = time.monotonic()
        self.items.append(item)

    @property
    def full(self) -> bool:
        return self.events >= self.max_events

    def time_left(self) -> float | None:
        """Seconds until the open batch is due by age; None when nothing is open."""
        if not self.items:
            return None
        return self._opened_at + self.max_delay_s - time.monotonic()

    def seal(self, seq: int) -> Batch:
        batch = Batch(seq, self.items)
        self.items = []
        self.events = 0
        return batch
