"""The capture coordinator: the one story every source tells.

plan -> snapshot -> hand off -> stream -> reconnect with backoff, skipping what was already delivered. A source
plans (``connect``) and supplies a ``SnapshotReader`` and a ``StreamReader`` (``contracts.py``); the coordinator
runs them in that order and owns what is the same for every source:

* the snapshot sequence: open at the watermark, the opening marks, a fresh snapshot's truncates (one per table,
  docs/landing-format.md "Snapshot generations"), the chunks, then the ``SNAPSHOT_DONE`` mark at the watermark;
* the watermark handoff: the stream starts where the snapshot's watermark says;
* reconnecting the stream with the one backoff (``cdcd.retry.source_backoff``: capped, jittered, a budget after
  which the failure is a ``SourceFatal``);
* a ``Restream`` (the source changed what its stream reads, e.g. MariaDB's table filter on a reload): read the
  stream again from the last delivered position at once, no backoff;
* the skip rule after a reconnect: a stream re-read from an earlier point re-sends items; every item at or before
  the last delivered position is dropped (identity marks excepted: they describe the new connection); a
  ``ChangeBlock`` that reaches past that position keeps its rows above it;
* incremental snapshots (``incremental/``): while the stream runs, a task reads chunks between watermarks and
  the stream loop delivers each chunk's unsuperseded rows when the stream reaches the chunk's high watermark.

The runtime's own rule (streamed rows at or before the checkpoint are dropped and counted as ``events_skipped``)
stays in the runtime: it is the commit barrier's, and holds for any ``Source``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from cdcd.capture.contracts import CapturePlan, Replan, Restream, StreamReader
from cdcd.capture.incremental import Incremental
from cdcd.capture.retention import RetentionWatch
from cdcd.config import Config
from cdcd.errors import SourceError
from cdcd.events import ChangeBlock, Item, Mark, MarkKind, snapshot_truncates
from cdcd.positions import Position
from cdcd.retry import source_backoff

_UNORDERED = (MarkKind.IDENTITY, MarkKind.WATERMARK)


class CaptureCoordinator:
    """Runs a source's plan; one per source object, kept across the runtime's reconnects."""

    def __init__(self, config: Config, log: Any, phase: str = "idle", where: str = "") -> None:
        self._config = config
        self.incremental = Incremental(config, log, where)  # the source sets its ChunkReader (``reader``)
        self._log = log
        self._plan = CapturePlan()
        self._closing = False
        self.phase = phase  # "snapshot" or "streaming" once under way, for /status
        self.connected = False  # the stream is connected (the source sets it while planning too)
        self.reconnects = 0  # stream reconnects inside this process, for /status
        self.last_error: str | None = None
        self.last: Position | None = None  # the last streamed position delivered: the skip rule's bound
        self.last_item: Item | None = None  # the item at ``last``
        self.retention: RetentionWatch | None = None  # the source's budget watch, run while the stream runs

    @property
    def closing(self) -> bool:
        return self._closing

    def start(self, plan: CapturePlan) -> None:
        """The source has planned (``connect``): ``items`` runs this plan next."""
        self._plan = plan
        self._closing = False

    def close(self) -> None:
        """The source is closing: a connection that breaks now is not retried, a stream that ends just ends."""
        self._closing = True
        self.connected = False
        if self.retention is not None:
            self.retention.stop()

    async def items(self) -> AsyncIterator[Item]:
        """Everything the source delivers in this run, in position order."""
        plan = self._plan
        if self.retention is not None:  # from the start: a long initial snapshot holds the slot too
            self.retention.start()
        for item in plan.announce:
            yield item
        stream = plan.stream
        if plan.snapshot is not None:
            snap = plan.snapshot
            self.phase = "snapshot"
            try:
                watermark = await snap.open()
                for item in snap.opening(watermark):
                    yield item
                if snap.fresh:
                    # a new snapshot supersedes whatever an abandoned earlier one landed
                    for truncate in snapshot_truncates(await snap.schemas(), watermark):
                        yield truncate
                async for item in snap.rows(watermark):
                    yield item
            finally:
                await snap.close()
            yield Mark(MarkKind.SNAPSHOT_DONE, watermark, {})
            if stream is not None:
                stream.handoff(watermark)
        self.phase = "streaming"
        if stream is None:
            if self.retention is not None:
                self.retention.stop()
            return
        incr = self.incremental
        if incr.reader is not None:
            incr.start()
        try:
            async for item in self._stream(stream, incr if incr.reader is not None else None):
                yield item
        finally:
            incr.stop()
            if self.retention is not None:
                self.retention.stop()

    async def _stream(self, stream: StreamReader, incr: Incremental | None) -> AsyncIterator[Item]:
        retry = source_backoff(self._config, stream.what)
        transient: tuple[type[BaseException], ...] = (SourceError, *stream.transient)
        reconnect = False
        while True:
            try:
                last = self.last
                async for item in stream.run(reconnect):
                    pos = item.position
                    # identity marks describe the connection, watermark marks an idle binlog's position (several
                    # chunks may share it): neither is a streamed item the skip rule or ``last`` is about
                    passes = type(item) is Mark and item.kind in _UNORDERED
                    if last is not None and pos <= last:  # type: ignore[operator]
                        if not passes:
                            continue  # delivered before the reconnect
                    elif not passes:
                        if last is not None and type(item) is ChangeBlock:
                            item = item.after(last) or item  # rows up to ``last`` were delivered (never None here)
                        self.last = last = pos
                        self.last_item = item
                    if retry.attempts:  # the first item after an outage: say it is over (the losses were warned)
                        self._log.info("source stream restored", failed_attempts=retry.attempts,
                                       outage_s=round(retry.failed_for_s(), 1))
                        retry.success()
                    if incr is not None:
                        before, keep = incr.before(item)
                        for extra in before:
                            yield extra
                        if not keep or (type(item) is Mark and item.kind is MarkKind.WATERMARK):
                            continue  # a removed table's change; a watermark only wakes a pending chunk
                    yield item
                if self._closing:
                    return
                raise SourceError(stream.ended)
            except Restream as exc:
                if self._closing:
                    return
                self._log.info("re-reading the stream from the last delivered position", reason=str(exc))
                reconnect = True
            except transient as exc:
                if isinstance(exc, SourceError) and (exc.fatal or isinstance(exc, Replan)):
                    raise
                if self._closing:
                    if isinstance(exc, SourceError):
                        raise
                    raise SourceError(f"{stream.where}: connection closed while stopping") from exc
                self.connected = False
                delay = retry.failure(exc)  # SourceFatal once runtime.source_retry_timeout_s is spent
                self.reconnects += 1
                self.last_error = str(exc) or repr(exc)
                self._log.warning(stream.lost_event, error=self.last_error, retry_in_s=round(delay, 2),
                                  attempt=retry.attempts, failing_for_s=round(retry.failed_for_s(), 1))
                await asyncio.sleep(delay)
                reconnect = True
