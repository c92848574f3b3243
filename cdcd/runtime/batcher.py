"""Cutting the item stream into batches by size and age."""

from __future__ import annotations

import time

from cdcd.events import ChangeEvent, Item
from cdcd.runtime.interfaces import Batch


class Batcher:
    """Accumulates items; a batch is due when it holds ``max_events`` events or is ``max_delay_s`` old.

    Marks do not count towards ``max_events`` but make a batch due by age, so
    progress such as heartbeats reaches the checkpoint on an idle source.
    """

    def __init__(self, max_events: int, max_delay_s: float) -> None:
        self.max_events = max_events
        self.max_delay_s = max_delay_s
        self.items: list[Item] = []
        self.events = 0
        self._opened_at = 0.0

    def add(self, item: Item) -> None:
        if not self.items:
            self._opened_at = time.monotonic()
        self.items.append(item)
        if type(item) is ChangeEvent:
            self.events += 1

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
