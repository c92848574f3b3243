"""What a source hands the capture coordinator: a plan, a snapshot reader and a stream reader.

A source's ``connect`` is its planner: it reads what it must from the server
and the checkpoint's state and decides, as a ``CapturePlan``, what this run
does (marks to emit first, a snapshot to read or finish, a stream to follow).
The coordinator (``coordinator.py``) then tells the one story of every source.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

from cdcd.errors import SourceError
from cdcd.events import Item, TableSchema
from cdcd.positions import Position


class Replan(SourceError):
    """The stream's position is lost and ``snapshot.mode = "when_needed"``: give up this plan at once.

    Not fatal: the runtime reconnects the source, whose planner then takes a new snapshot. The coordinator
    never retries it with backoff (retrying a lost position cannot find it again)."""


class Restream(SourceError):
    """The source asks for its stream to be read again from the last delivered position (a reloaded table filter).

    Not a failure: the coordinator reconnects at once, without backoff, and does not count it as a reconnect;
    the skip rule drops what the new connection re-sends."""


class SnapshotReader(Protocol):
    """Reads the tables at one watermark: a new snapshot, or the rest of an interrupted one."""

    #: a new snapshot (not a resumed one): it lands one truncate per table first (snapshot generations)
    fresh: bool

    async def open(self) -> Position:
        """Open the snapshot's transactions; the watermark, the position every snapshot row carries."""
        ...

    def opening(self, watermark: Position) -> list[Item]:
        """Marks that go right after ``open`` (before the truncates and rows): the snapshot's start."""
        ...

    async def schemas(self) -> list[TableSchema]:
        """The snapshotted tables' schemas (for a fresh snapshot's truncates)."""
        ...

    def rows(self, watermark: Position) -> AsyncIterator[Item]:
        """RowBlocks and the tables' start/done marks, key-ordered chunk after chunk."""
        ...

    async def close(self) -> None:
        ...


class StreamReader(Protocol):
    """Follows the server's change stream from where the plan (or the snapshot) left it."""

    @property
    def where(self) -> str:
        """The server, for messages ("postgres://cdc@db:5432/app")."""
        ...

    @property
    def what(self) -> str:
        """What is reconnected, for logs and the backoff's give-up message ("the replication connection to ...")."""
        ...

    @property
    def ended(self) -> str:
        """The error when the server ends the stream (it never does by itself: a shutdown, a reset)."""
        ...

    @property
    def lost_event(self) -> str:
        """The log event of a lost connection ("replication connection lost; reconnecting")."""
        ...

    @property
    def transient(self) -> tuple[type[BaseException], ...]:
        """Exceptions besides ``SourceError`` that mean "the connection broke" (retried with backoff)."""
        ...

    def handoff(self, watermark: Position) -> None:
        """The snapshot is delivered: stream from its watermark (the watermark handoff)."""
        ...

    def run(self, reconnect: bool) -> AsyncIterator[Item]:
        """Connect and yield the stream's items until the connection breaks (raise) or the source is closed.

        ``reconnect`` is True after a failure: the reader checks that the server still holds what was
        delivered (``CaptureCoordinator.last``) and may emit identity marks first. Items at or before the
        last delivered position may be yielded: the coordinator drops them.
        """
        ...


@dataclass
class CapturePlan:
    """What one run of a source does, in order: ``announce``, the snapshot (if any), the stream (if any)."""

    announce: list[Item] = field(default_factory=list)
    snapshot: SnapshotReader | None = None
    stream: StreamReader | None = None
