"""The MySQL/MariaDB snapshot and binlog stream as the capture coordinator runs them.

``MySqlSnapshot`` (``cdcd.capture.contracts.SnapshotReader``) opens the consistent snapshot
(``snapshot.py``, ``Snapshotter``) and reads its chunks; ``MySqlStream`` (``StreamReader``) follows the
binlog from the plan's start point, or from the snapshot's watermark after the handoff. What is the same for
every source (the order, the truncates, reconnects with backoff, the skip rule) is the coordinator's; what is
this source's (the server identity and position epochs, a failover's re-sent transaction, the history watch,
ending our dump thread on the server) is here, on the ``MySqlServer`` (``server.py``) both readers are handed.

The stream keeps where it (re)started from (``resume_pos``) and whether the last delivered item ended a
transaction: the planner (``source.py``) sets them when it plans a resume, the stream when the snapshot hands off.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator
from datetime import UTC
from typing import Any

import structlog

from cdcd.capture.contracts import Restream
from cdcd.capture.coordinator import CaptureCoordinator
from cdcd.errors import PositionLost, SourceError
from cdcd.events import ChangeBlock, ChangeEvent, Item, Mark, MarkKind, TableId, TableSchema
from cdcd.positions import MySqlPosition, Position
from cdcd.sources.mysql.binlog import STALL_S, BinlogReader, Channel, StartPoint
from cdcd.sources.mysql.columnar import build_blocks
from cdcd.sources.mysql.decode import Decoder
from cdcd.sources.mysql.identity import PurgedFile, judge, same_server
from cdcd.sources.mysql.queries import load_table_schema
from cdcd.sources.mysql.server import MySqlServer
from cdcd.sources.mysql.snapshot import SnapshotTask, Snapshotter

log = structlog.get_logger("cdcd.source.mysql")

QUEUE_ITEMS = 20000  # decoded rows buffered ahead of the runtime; the binlog reader waits beyond
HISTORY_CHECK_S = 5.0  # while streaming, how often the server's binlog is checked against the last position


class MySqlSnapshot:
    """A snapshot at one binlog position: a new one (``watermark`` None: read at open) or the rest of one."""

    def __init__(self, server: MySqlServer, tasks: list[SnapshotTask], watermark: MySqlPosition | None,
                 fresh: bool) -> None:
        self._server = server
        self._tasks = tasks
        self._watermark = watermark
        self.fresh = fresh
        self.snapshotter: Snapshotter | None = None
        self.then: list[Mark] = []  # marks after a fresh snapshot's start, moved to its watermark (the table list)

    async def open(self) -> MySqlPosition:
        server, cfg = self._server, self._server.config
        snap = Snapshotter(server.conn.settings(), server.flavor, cfg.snapshot.parallelism, cfg.snapshot.chunk_rows,
                           server.history, tls=server.tls, read_timeout_s=cfg.runtime.source_read_timeout_s,
                           chunk_bytes=cfg.snapshot.chunk_bytes)
        self.snapshotter = snap
        wm = await snap.open()
        if self._watermark is None:
            self._watermark = server.stamp(wm.position())
        return self._watermark

    def opening(self, watermark: Position) -> list[Item]:
        if not self.fresh:
            return []
        assert isinstance(watermark, MySqlPosition)
        start = Mark(MarkKind.SNAPSHOT_START, watermark, {"tables": [str(t.table) for t in self._tasks]})
        then = [Mark(m.kind, watermark, m.detail) for m in self.then]
        return [start, *self._server.marks(watermark), *then]

    async def schemas(self) -> list[TableSchema]:
        async with self._server.controlled(what="reading the tables' schemas") as conn:
            return [(await load_table_schema(conn, t.table))[0] for t in self._tasks]

    async def rows(self, watermark: Position) -> AsyncIterator[Item]:
        assert self.snapshotter is not None and isinstance(watermark, MySqlPosition)
        async for chunk in self.snapshotter.run(self._tasks, watermark):
            for item in chunk:
                yield item

    async def close(self) -> None:
        if self.snapshotter is not None:
            await self.snapshotter.close()

    def terminate(self) -> None:
        if self.snapshotter is not None:
            self.snapshotter.terminate()


class MySqlStream:
    """The binlog from ``start`` on, decoded in a thread (``binlog.py``) and handed over in chunks."""

    lost_event = "binlog connection lost; reconnecting"
    transient: tuple[type[BaseException], ...] = ()  # the reader thread classifies its errors (binlog.classify)

    def __init__(self, server: MySqlServer, coord: CaptureCoordinator, tables: set[TableId],
                 start: StartPoint | None) -> None:
        self._server = server
        self._coord = coord
        self.tables = tables  # the next binlog connection's filter (``capture``)
        self.start = start  # None until the snapshot hands off
        self.resume_pos: MySqlPosition | None = None  # where the binlog stream (re)started from
        self.last_was_commit = True  # the last emitted item was a commit Mark (not inside a transaction)
        #: (epoch, file index, transaction start) of the transaction a checkpoint of an earlier version is inside:
        #: its seqs are byte offsets (decode.py, state.py "seqs")
        self.legacy_tx: tuple[int, int, int] | None = None
        self.reader: BinlogReader | None = None
        self.channel: Channel | None = None
        self.lag_ms: float | None = None
        self.newest_event: dict[str, float] = {}  # binlog file -> commit time of the newest change read in it
        self.resend_skip: tuple[str, int] | None = None  # (GTID set, seq): resent items of a partial transaction
        self._restarted: asyncio.Event | None = None  # set when a run after a ``restream`` has its reader going
        self.columnar = True  # row changes as ChangeBlocks (decode.py); False: the row path, one ChangeEvent per row

    @property
    def where(self) -> str:
        return self._server.where

    @property
    def what(self) -> str:
        return f"the binlog connection to {self.where}"

    @property
    def ended(self) -> str:
        return f"{self.where}: the binlog stream ended"

    def capture(self, tables: set[TableId]) -> None:
        """The captured tables changed (a reload): the next binlog connection filters on ``tables`` (the running
        one keeps its own set)."""
        self.tables = tables

    def handoff(self, watermark: Position) -> None:
        assert isinstance(watermark, MySqlPosition)
        self.start = self._server.start_at(watermark)
        self.resume_pos = watermark

    def resume_from(self, pos: MySqlPosition) -> None:
        """The plan resumes streaming at ``pos`` (the checkpoint's, or the last delivered one)."""
        self.arm_resend_skip(pos)
        self.resume_pos = pos

    async def run(self, reconnect: bool) -> AsyncIterator[Item]:
        server = self._server
        assert self.start is not None
        if reconnect:  # the server may be another one now (a failover), or its binlog may have gone back
            self.start, marks = await self._reconnect_point(self.start)
            for mark in marks:
                yield mark
        start = self.start
        loop = asyncio.get_running_loop()
        channel = Channel(loop, QUEUE_ITEMS)
        decoder = Decoder(server.flavor, self.tables, server.history, start.file, start.gtid, server.epoch,
                          self.columnar, defer_builds=True, legacy_tx=self.legacy_tx)
        reader = BinlogReader(server.conn.binlog_settings(STALL_S), server.server_id, server.flavor, start, decoder,
                              channel, tls=server.tls)
        self.reader, self.channel = reader, channel
        reader.start()
        self._coord.connected = True
        if self._restarted is not None:
            self._restarted.set()
        watch = asyncio.create_task(self._watch_history(channel), name="mysql-history-watch")
        try:
            while True:
                try:
                    chunk = await channel.get_many()
                except PositionLost as exc:  # the dump refused the position (1236): a replan when that is allowed
                    raise server.lost_error(str(exc).split(": those changes are lost", 1)[0]) from exc
                if not chunk:
                    return  # stopped
                chunk = build_blocks(chunk)
                for item in chunk:
                    skip = self.resend_skip
                    if skip is not None:
                        pos = item.position
                        assert isinstance(pos, MySqlPosition)
                        if pos.gtid == skip[0] and pos.seq <= skip[1]:
                            continue  # resent by the new server: delivered before the failover
                        if type(item) is ChangeBlock and pos.gtid == skip[0] and item.start.seq <= skip[1]:
                            kept = item.after(dataclasses.replace(item.start, seq=skip[1]))
                            assert kept is not None  # its last row is above the skip
                            item = kept
                        self.resend_skip = None
                    if (type(item) is ChangeEvent or type(item) is ChangeBlock) and item.commit_ts is not None:
                        self.lag_ms = max(0.0, (time.time() - item.commit_ts.timestamp()) * 1000)
                        if isinstance(item.position, MySqlPosition):  # the file was closed after it (expiry.py)
                            self.newest_event[item.position.file] = item.commit_ts.timestamp()
                    yield item
        finally:
            watch.cancel()
            await asyncio.gather(watch, return_exceptions=True)  # it shares the control connection
            reader.stop()
            await loop.run_in_executor(None, reader.join, 5.0)
            await self.kill_dump(reader)

    async def kill_dump(self, reader: BinlogReader) -> None:
        """End our dump thread on the server now: it would linger until its next write and pin the binlog
        file it reads (PURGE BINARY LOGS skips files in use)."""
        ids = [int(t) for t in reader.thread_ids]
        reader.thread_ids.clear()
        await self._server.kill_threads(ids)

    async def restream(self, why: str) -> None:
        """Read the binlog again from the last delivered position with the source's current table filter; return
        once the new reader runs (the coordinator reconnects on ``Restream``). Nothing to do while no reader runs:
        the next connection takes the new filter anyway."""
        channel = self.channel
        if channel is None:
            return
        restarted = self._restarted = asyncio.Event()
        channel.finish(Restream(f"{self.where}: {why}"))
        cfg = self._server.config.runtime
        limit = cfg.source_retry_timeout_s + 2 * cfg.source_read_timeout_s  # past it the coordinator gave up
        try:
            async with asyncio.timeout(limit):
                await restarted.wait()
        except TimeoutError:
            raise SourceError(f"{self.where}: the binlog stream did not restart within {limit:.0f} s after {why}; "
                              "check the source's connectivity and reload again") from None
        finally:
            self._restarted = None

    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        reader = self.reader
        if reader is not None:
            d = reader.decoder
            out["binlog_file"] = d.file
            out["binlog_pos"] = d.tx_start
            out["gtid"] = str(d.gtid)
            idle = self.channel is not None and len(self.channel) == 0
            out["lag_ms"] = 0.0 if idle and d.tx_start is None else self.lag_ms
            if d.last_ts is not None:
                out["last_event_ts"] = d.last_ts.astimezone(UTC).isoformat()
        return out

    def stop(self) -> BinlogReader | None:
        reader = self.reader
        if reader is not None:
            reader.stop()
        return reader

    # ------------------------------------------------------------ the server's history, checked on every reconnect
    def last_position(self) -> MySqlPosition | None:
        """The last delivered position, else where the binlog stream started."""
        last = self._coord.last
        return last if isinstance(last, MySqlPosition) else self.resume_pos

    def last_is_commit(self) -> bool:
        """Whether the last item delivered in this process was a commit Mark (outside a transaction)."""
        item = self._coord.last_item
        return type(item) is Mark and item.kind == MarkKind.COMMIT

    def arm_resend_skip(self, pos: MySqlPosition) -> None:
        """Resuming by GTID on another server re-sends the transaction ``pos`` is inside of: skip its items up to
        ``pos`` (they carry the GTID set before it and the same seq numbers, which the binlog alone defines)."""
        partial = pos.epoch < self._server.epoch and pos.file and not self.last_was_commit and pos.seq > 0
        if partial and self.legacy_tx == (pos.epoch, pos.file_index, pos.pos):
            # a checkpoint of an earlier version numbered the transaction by byte offsets on the old server, which
            # the new server's copy does not share: skipping by them could lose rows. The whole transaction comes
            # again (the mirror converges; the change-log holds its delivered part twice).
            log.warning("following a failover from inside a transaction that a checkpoint of an earlier cdcd "
                        "numbered by byte offsets: its delivered part is delivered again", position=str(pos))
            partial = False
        self.resend_skip = (pos.gtid, pos.seq) if partial else None

    async def _reconnect_point(self, fallback: StartPoint) -> tuple[StartPoint, list[Item]]:
        """Before a reconnect of the binlog stream: check that the server (maybe another one after a failover)
        still has the last delivered position; where to start and the Marks to emit first."""
        server = self._server
        pos = self.last_position()
        if pos is None:
            return fallback, []
        if self._coord.last_item is not None:
            self.last_was_commit = self.last_is_commit()
        facts = await server.facts_at(await server.facts(), pos)
        verdict = server.judge(facts, server.identity, pos, "the last delivered transaction")
        if verdict is None or isinstance(verdict, str):
            raise server.lost_error(verdict or (f"binlog file {pos.file} of the last delivered transaction ({pos}) "
                                                f"is no longer on the server ({facts.describe()}): it was purged"))
        server.adopt(facts, verdict)
        self.arm_resend_skip(pos)
        return server.start_at(pos), server.marks(server.mark_at(pos))

    async def _watch_history(self, channel: Channel) -> None:
        """While streaming, check every HISTORY_CHECK_S that the server's binlog still holds the last delivered
        position. A dump does not notice RESET MASTER (it waits at its old offset, and new transactions go to a
        new file 1 it never reads): without this, nothing would land and nothing would be logged."""
        server = self._server
        while True:
            await asyncio.sleep(HISTORY_CHECK_S)
            pos = self.last_position()
            if pos is None:
                continue
            try:
                facts = await server.facts()
                if same_server(server.identity, facts):
                    facts = await server.facts_at(facts, pos)
            except SourceError as exc:
                if exc.fatal:
                    channel.finish(exc)
                    return
                continue  # the control connection is down: the stream notices the outage itself
            if not same_server(server.identity, facts):
                channel.finish(SourceError(f"the server behind {server.conn.where} is now "
                                           f"{facts.describe()}; reconnecting to follow it"))
                return
            try:
                judge(facts, server.identity, server.epoch, pos, "the last delivered transaction")
            except PurgedFile:
                continue  # a file behind the one being read was purged: only a reconnect needs it
            except PositionLost as exc:
                channel.finish(server.lost_error(str(exc)))
                return
