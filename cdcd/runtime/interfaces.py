"""The contracts the sources and sinks plug into.

A ``Source`` owns everything about one database: connecting, preflight,
snapshot and streaming (including the snapshot-to-stream handoff and resume),
and a pure ``fold`` that says what its durable state is once a run of items is
committed. cdcd's sources plan in ``connect`` and let the capture coordinator
(``cdcd/capture/coordinator.py``) run the snapshot and the stream. The runtime
owns batching, the commit barrier and the checkpoint.

A ``Sink`` lands batches durably and reports acks, possibly out of order.
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from cdcd.errors import ConfigError
from cdcd.events import ChangeEvent, Item, event_count
from cdcd.positions import Position


@dataclass(frozen=True, slots=True)
class CheckResult:
    """One preflight check: what was checked, whether it passed, and the fix."""

    name: str
    ok: bool
    detail: str
    fix: str = ""


@dataclass(slots=True)
class Batch:
    """A contiguous run of items, numbered by the runtime (never reused)."""

    seq: int
    items: list[Item] = field(default_factory=list)

    @property
    def events(self) -> list[ChangeEvent]:
        """The ChangeEvent items (rows of RowBlocks and ChangeBlocks are not expanded)."""
        return [i for i in self.items if isinstance(i, ChangeEvent)]

    @property
    def event_count(self) -> int:
        """Rows to land: one per ChangeEvent, the rows of every RowBlock and ChangeBlock."""
        return sum(event_count(i) for i in self.items)

    @property
    def first_position(self) -> Position | None:
        return self.items[0].position if self.items else None

    @property
    def last_position(self) -> Position | None:
        return self.items[-1].position if self.items else None


@dataclass(slots=True)
class ResumePoint:
    """What the checkpoint says about the source when the runtime starts.

    ``position`` is the position of the last committed item (None before the
    first commit); ``state`` is the source's own durable state as its ``fold``
    last returned it (empty on a first start).
    """

    position: Position | None
    state: dict[str, Any]


class Source(abc.ABC):
    """A database change source."""

    kind: str

    @abc.abstractmethod
    async def connect(self, resume: ResumePoint) -> None:
        """Connect and validate the resume point (slot exists, binlog not purged).

        Raises ``SourceFatal`` when the resume point cannot be honoured.
        """

    @abc.abstractmethod
    def stream(self) -> AsyncIterator[Item]:
        """Items from the resume point on: snapshot rows (if due) then changes.

        Snapshot rows already committed (by the key progress in the resume
        state) are not produced again. Streamed items at or before
        ``resume.position`` may be produced: the runtime drops them.
        Transient failures are retried inside; fatal ones raise.
        """

    @abc.abstractmethod
    def fold(self, state: dict[str, Any], items: Sequence[Item]) -> dict[str, Any]:
        """The durable source state after ``items`` are committed. Pure."""

    @abc.abstractmethod
    async def confirm(self, position: Position, state: dict[str, Any]) -> None:
        """The checkpoint holding ``state`` is durable: tell the server (flush LSN)."""

    @abc.abstractmethod
    async def preflight(self) -> list[CheckResult]:
        """Check the server's settings and privileges for `cdcd check`."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Close connections gracefully (asyncpg ``close()``)."""

    @abc.abstractmethod
    def terminate(self) -> None:
        """Drop connections at once (asyncpg ``terminate()``)."""

    def status(self) -> dict[str, Any]:
        """Source-specific figures for /status and metrics (lag, slot, binlog)."""
        return {}

    # -- operator requests on the running source (docs/runtime.md, "Incremental snapshots") --------------

    def request_snapshot(self, table: str, where: str | None = None) -> None:
        """Queue an incremental snapshot of ``table`` (a captured ``schema.table``), of the rows matching the SQL
        condition ``where`` if given, read while the stream runs. Raises ``ConfigError`` for a table that is not
        captured (naming the configured list)."""
        raise ConfigError(f"the {self.kind} source cannot snapshot a table while it runs")

    async def check_where(self, table: str, where: str) -> None:
        """Refuse (``ConfigError`` with the server's message) a ``where`` condition the source cannot evaluate on
        ``table``, before a snapshot request is accepted: it is planned on a connection of its own, never run."""
        raise ConfigError(f"the {self.kind} source cannot snapshot a table while it runs")

    def reload_tables(self, tables: list[str]) -> asyncio.Future[None]:
        """The captured table list is to be ``tables`` (what SIGHUP calls after re-reading source.tables): added
        tables are snapshotted incrementally while streaming, removed ones stop being captured. Raises
        ``ConfigError`` for a list it refuses at once; the future is done once the reload is applied (a reconnect
        meanwhile does not drop it), or holds why it was not (an added table that does not exist or has no key)."""
        raise ConfigError(f"the {self.kind} source cannot change its tables while it runs")

    def snapshot_progress(self) -> list[dict[str, Any]]:
        """The incremental snapshots of this process, for /status and metrics: one dict per request with
        ``table``, ``where``, ``state`` (queued, running, done, failed), ``chunks``, ``rows``, ``last_key``,
        ``error``."""
        return []

    # -- a lost position (docs/operations.md, "A lost position") -------------------------------------------

    def recover_only(self) -> None:
        """`cdcd recover`: the next ``connect`` recovers a lost position (a new one, the gap recorded, every table
        re-snapshotted) and raises ``NothingToRecover`` when the position is not lost."""
        raise ConfigError(f"the {self.kind} source cannot recover a lost position")

    def recovered(self) -> dict[str, Any] | None:
        """What this process recovered from (the gap's record: ``lost``, ``from``, ``to``, ``tables``), or None."""
        return None


class Sink(abc.ABC):
    """Lands batches durably and acks them."""

    @abc.abstractmethod
    async def open(self) -> int:
        """Prepare (clean temp files from a crash); return the highest landed batch seq, or 0."""

    @abc.abstractmethod
    async def deliver(self, batch: Batch) -> None:
        """Land the batch durably. An ack follows through ``acks()``."""

    @abc.abstractmethod
    def acks(self) -> AsyncIterator[int]:
        """Batch seqs as they are acked, in any order."""

    @abc.abstractmethod
    async def committed(self, batch_seq: int) -> None:
        """The checkpoint now covers every batch up to ``batch_seq`` (retention)."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Stop watching for acks and release resources."""

    def status(self) -> dict[str, Any]:
        """Sink-specific figures for /status, metrics and health (write failures)."""
        return {}
