"""The MySQL/MariaDB snapshot and binlog stream as the capture coordinator runs them.

``MySqlSnapshot`` (``cdcd.capture.contracts.SnapshotReader``) opens the consistent snapshot
(``snapshot.py``, ``Snapshotter``) and reads its chunks; ``MySqlStream`` (``StreamReader``) follows the
binlog from the plan's start point, or from the snapshot's watermark after the handoff. What is the same for
every source (the order, the truncates, reconnects with backoff, the skip rule) is the coordinator's; what is
this source's (the server identity and position epochs, a failover's re-sent transaction, the history watch,
ending our dump thread on the server) is here and in ``source.py``.

The readers are this source's own parts: they use the source's private helpers (control connection, identity).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator
from datetime import UTC
from typing import TYPE_CHECKING, Any

from cdcd.capture.contracts import Restream
from cdcd.capture.coordinator import CaptureCoordinator
from cdcd.errors import SourceError
from cdcd.events import ChangeBlock, ChangeEvent, Item, Mark, MarkKind, TableSchema
from cdcd.positions import MySqlPosition, Position
from cdcd.sources.mysql.binlog import STALL_S, BinlogReader, Channel, StartPoint
from cdcd.sources.mysql.columnar import build_blocks
from cdcd.sources.mysql.decode import Decoder
from cdcd.sources.mysql.snapshot import SnapshotTask, Snapshotter, load_table_schema

if TYPE_CHECKING:
    from cdcd.sources.mysql.source import MySqlSource

QUEUE_ITEMS = 20000  # decoded rows buffered ahead of the runtime; the binlog reader waits beyond


class MySqlSnapshot:
    """A snapshot at one binlog position: a new one (``watermark`` None: read at open) or the rest of one."""

    def __init__(self, src: MySqlSource, tasks: list[SnapshotTask], watermark: MySqlPosition | None,
                 fresh: bool) -> None:
        self._src = src
        self._tasks = tasks
        self._watermark = watermark
        self.fresh = fresh
        self.snapshotter: Snapshotter | None = None
        self.then: list[Mark] = []  # marks after a fresh snapshot's start, moved to its watermark (the table list)

    async def open(self) -> MySqlPosition:
        src, cfg = self._src, self._src.config
        snap = Snapshotter(src.conn.settings(), src.flavor, cfg.snapshot.parallelism, cfg.snapshot.chunk_rows,
                           src.history, tls=src.tls, read_timeout_s=cfg.runtime.source_read_timeout_s,
                           chunk_bytes=cfg.snapshot.chunk_bytes)
        self.snapshotter = snap
        wm = await snap.open()
        if self._watermark is None:
            self._watermark = src._stamp(wm.position())
        return self._watermark

    def opening(self, watermark: Position) -> list[Item]:
        if not self.fresh:
            return []
        assert isinstance(watermark, MySqlPosition)
        start = Mark(MarkKind.SNAPSHOT_START, watermark, {"tables": [str(t.table) for t in self._tasks]})
        then = [Mark(m.kind, watermark, m.detail) for m in self.then]
        return [start, *self._src._server_marks(watermark), *then]

    async def schemas(self) -> list[TableSchema]:
        conn = await self._src._control()
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

    def __init__(self, src: MySqlSource, coord: CaptureCoordinator, start: StartPoint | None) -> None:
        self._src = src
        self._coord = coord
        self.start = start  # None until the snapshot hands off
        self.reader: BinlogReader | None = None
        self.channel: Channel | None = None
        self.lag_ms: float | None = None
        self.resend_skip: tuple[str, int] | None = None  # (GTID set, seq): resent items of a partial transaction
        self._restarted: asyncio.Event | None = None  # set when a run after a ``restream`` has its reader going
        self.columnar = True  # row changes as ChangeBlocks (decode.py); False: the row path, one ChangeEvent per row

    @property
    def where(self) -> str:
        return self._src._where

    @property
    def what(self) -> str:
        return f"the binlog connection to {self.where}"

    @property
    def ended(self) -> str:
        return f"{self.where}: the binlog stream ended"

    def handoff(self, watermark: Position) -> None:
        assert isinstance(watermark, MySqlPosition)
        self.start = self._src._start_at(watermark)
        self._src._resume_pos = watermark

    async def run(self, reconnect: bool) -> AsyncIterator[Item]:
        src = self._src
        assert self.start is not None
        if reconnect:  # the server may be another one now (a failover), or its binlog may have gone back
            self.start, marks = await src._reconnect_point(self.start)
            for mark in marks:
                yield mark
        start = self.start
        loop = asyncio.get_running_loop()
        channel = Channel(loop, QUEUE_ITEMS)
        decoder = Decoder(src.flavor, src.tables, src.history, start.file, start.gtid, src._epoch, self.columnar,
                          defer_builds=True, legacy_tx=src._legacy_tx)
        reader = BinlogReader(src.conn.binlog_settings(STALL_S), src.server_id, src.flavor, start, decoder, channel,
                              tls=src.tls)
        self.reader, self.channel = reader, channel
        reader.start()
        self._coord.connected = True
        if self._restarted is not None:
            self._restarted.set()
        watch = asyncio.create_task(src._watch_history(channel), name="mysql-history-watch")
        try:
            while True:
                chunk = await channel.get_many()
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
        src = self._src
        ids = [int(t) for t in reader.thread_ids]
        reader.thread_ids.clear()
        if not ids or src._ctl is None or src._ctl.closed:
            # no live control connection: never open one for this, it could reach another server (a failover)
            # whose connection ids mean other sessions
            return
        limit = float(src.conn.connect_timeout)  # short: a dead control connection must not hold us
        with contextlib.suppress(Exception):
            for tid in ids:
                if src._ctl is None:  # a failed query dropped it: do not open another (see above)
                    return
                with contextlib.suppress(SourceError):
                    await src._query(f"KILL CONNECTION {tid}", timeout=limit)
            listed = ", ".join(map(str, ids))
            for _ in range(50):  # KILL only flags the thread; wait until it is gone
                if src._ctl is None:
                    return
                rows = await src._query(f"SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE ID IN ({listed})",
                                       timeout=limit)
                if not rows[0][0]:
                    break
                await asyncio.sleep(0.05)

    async def restream(self, why: str) -> None:
        """Read the binlog again from the last delivered position with the source's current table filter; return
        once the new reader runs (the coordinator reconnects on ``Restream``). Nothing to do while no reader runs:
        the next connection takes the new filter anyway."""
        channel = self.channel
        if channel is None:
            return
        restarted = self._restarted = asyncio.Event()
        channel.finish(Restream(f"{self.where}: {why}"))
        cfg = self._src.config.runtime
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
