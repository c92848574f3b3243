"""Drive a Source the way the runtime does, without the runtime (shared by the source tests)."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any, Self

from cdcd.events import ChangeBlock, ChangeEvent, Item, Mark, Op, RowBlock
from cdcd.positions import Position
from cdcd.runtime.interfaces import ResumePoint, Source


def events_of(items: list[Item]) -> list[ChangeEvent]:
    """The change events among ``items`` in order, each ChangeBlock's rows as events (marks left out)."""
    events: list[ChangeEvent] = []
    for item in items:
        if isinstance(item, ChangeBlock):
            events.extend(item.events())
        elif isinstance(item, ChangeEvent):
            events.append(item)
    return events


def opening_truncate(item: Item) -> bool:
    """A new snapshot's truncate of its table (events.snapshot_truncates), not a row."""
    return isinstance(item, ChangeEvent) and item.snapshot and item.op is Op.TRUNCATE


class SourceDriver:
    """Pulls items from a source; ``commit()`` folds and confirms like the runtime's commit barrier.

    With ``expand_blocks`` (the default) every RowBlock and ChangeBlock is handed out as the ChangeEvents
    of its rows (converted from its Arrow columns, i.e. the values that land), so tests can look at and
    commit single rows; ``expand_blocks=False`` hands out the blocks as the source made them.
    """

    def __init__(self, source: Source, position: Position | None = None, state: dict[str, Any] | None = None,
                 expand_blocks: bool = True) -> None:
        self.source = source
        self.position = position
        self.state: dict[str, Any] = state or {}
        self.pending: list[Item] = []
        self._iter: AsyncIterator[Item] | None = None
        self._expanded: deque[Item] = deque()
        self.expand_blocks = expand_blocks
        self.ended = False

    async def __aenter__(self) -> Self:
        await self.source.connect(ResumePoint(self.position, self.state))
        self._iter = self.source.stream().__aiter__()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._iter is not None:
            await self._iter.aclose()  # type: ignore[attr-defined]
            self._iter = None
        await self.source.close()

    async def next(self, timeout: float = 30) -> Item | None:
        assert self._iter is not None
        while True:
            if self._expanded:
                item = self._expanded.popleft()
                self.pending.append(item)
                return item
            try:
                item = await asyncio.wait_for(self._iter.__anext__(), timeout)
            except StopAsyncIteration:
                self.ended = True
                return None
            if self.expand_blocks and isinstance(item, RowBlock):
                self._expanded.extend(item.events())
                continue
            if self.expand_blocks and isinstance(item, ChangeBlock):
                # the runtime's skip rule, row by row
                self._expanded.extend(e for e in item.events() if self.position is None or e.position > self.position)
                continue
            # The runtime drops already-committed stream events on resume.
            if isinstance(item, ChangeEvent | ChangeBlock) and not item.snapshot and self.position is not None \
                    and item.position <= self.position:
                continue
            self.pending.append(item)
            return item

    async def take(self, pred: Callable[[list[Item]], bool], timeout: float = 60) -> list[Item]:
        """Pull until ``pred(items pulled so far)`` holds (or the stream ends)."""
        got: list[Item] = []
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not pred(got):
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise TimeoutError(f"condition not met; got {len(got)} items: {got[-5:]}")
            item = await self.next(remaining)
            if item is None:
                break
            got.append(item)
        return got

    async def events(self, n: int, timeout: float = 60) -> list[ChangeEvent]:
        """Pull until ``n`` change events came, a snapshot's opening truncates not counted (linear in ``n``)."""
        out: list[ChangeEvent] = []

        def enough(got: list[Item]) -> bool:
            if got and isinstance(got[-1], ChangeEvent) and not opening_truncate(got[-1]):
                out.append(got[-1])
            return len(out) >= n

        await self.take(enough, timeout)
        return out

    async def until_mark(self, kind: str, timeout: float = 60) -> list[Item]:
        """Pull until a Mark of ``kind`` came."""
        return await self.take(lambda items: bool(items) and isinstance(items[-1], Mark) and items[-1].kind == kind,
                               timeout)

    async def commit(self, count: int | None = None) -> None:
        """Commit the first ``count`` pending items (all by default): fold, 'save', confirm."""
        count = len(self.pending) if count is None else count
        done, self.pending = self.pending[:count], self.pending[count:]
        if not done:
            return
        self.state = self.source.fold(self.state, done)
        self.position = done[-1].position
        await self.source.confirm(self.position, self.state)


def replay_covered(items: list[Item], table: str) -> dict[tuple[Any, ...], dict[str, Any]]:
    """``table``'s rows as the Spark merge leaves them: events in position order, then each SNAPSHOT_COVERED
    record drops the rows whose last change lies below its ``below`` (rows the re-snapshot did not see)."""
    rows: dict[tuple[Any, ...], tuple[Position, dict[str, Any]]] = {}
    events = sorted((i for i in items if isinstance(i, ChangeEvent) and str(i.table) == table),
                    key=lambda e: e.position)
    for e in events:
        if e.op is Op.DELETE:
            rows.pop(e.key, None)  # type: ignore[arg-type]
        elif e.op is Op.TRUNCATE:
            rows.clear()
        else:
            if e.before_key is not None:
                rows.pop(e.before_key, None)
            rows[e.key] = (e.position, dict(e.after or {}))  # type: ignore[index]
    for m in items:
        if isinstance(m, Mark) and m.kind.value == "snapshot_covered" and m.detail["table"] == table:
            below = m.detail["below"]
            rows = {k: v for k, v in rows.items() if not v[0] < below}
    return {k: v[1] for k, v in rows.items()}
