"""The binlog stream: pymysqlreplication in a worker thread, feeding the event loop.

The thread reads events, decodes them (``decode.Decoder``) and appends the
items to a bounded channel. When the channel is full the thread waits, so it
stops reading the socket and the server's dump thread blocks: backpressure
reaches the binlog. ``stop()`` shuts the socket down so a blocked read returns
at once, and the connection factory refuses the library's silent reconnects
(they would restart from the wrong place); reconnecting is the source's job.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pymysql
from pymysqlreplication import BinLogStreamReader
from pymysqlreplication import event as bl
from pymysqlreplication import row_event as rows

from cdcd.errors import PositionLost, SourceError, SourceFatal
from cdcd.events import Item, Mark, MarkKind, event_count
from cdcd.sockets import keepalive
from cdcd.sources.mysql.columnar import BlockBuilder
from cdcd.sources.mysql.decode import Decoder
from cdcd.sources.mysql.failures import TRANSIENT_CODES
from cdcd.sources.mysql.plan import RESNAPSHOT_FIX
from cdcd.sources.mysql.tls import Tls

IDLE_MARK_INTERVAL_S = 1.0  # how often progress over uncaptured transactions reaches the checkpoint
HEARTBEAT_S = 1.0  # MASTER_HEARTBEAT_PERIOD asked of the server: an idle dump still sends something this often
#: The stall detector: no event and no heartbeat for this long (several heartbeat periods) means a dead path.
STALL_S = 10.0

_EVENTS = [
    bl.QueryEvent, bl.RotateEvent, bl.FormatDescriptionEvent, bl.XidEvent, bl.GtidEvent, bl.MariadbGtidEvent,
    bl.MariadbGtidListEvent, bl.HeartbeatLogEvent, rows.WriteRowsEvent, rows.UpdateRowsEvent, rows.DeleteRowsEvent,
    bl.NotImplementedEvent,  # so the decoder sees event types the library cannot decode (compressed ones)
    # the library drops events whose class is not listed: these must reach the decoder, which refuses or uses them
    bl.XAPrepareEvent, rows.PartialUpdateRowsEvent,
]


@dataclass(frozen=True)
class StartPoint:
    """Where the dump starts: a GTID set (when ``gtid`` is set and used) or file and offset."""

    file: str
    pos: int
    gtid: str = ""
    use_gtid: bool = False


class Stopped(Exception):
    """The reader was stopped on purpose."""


def _weight(item: Item | BlockBuilder) -> int:
    """What an item counts for in the channel's bound: its rows (a ChangeBlock or a BlockBuilder still to be
    built holds thousands), at least 1."""
    if type(item) is BlockBuilder:
        return max(1, item.rows)
    return max(1, event_count(item))  # type: ignore[arg-type]


class Channel:
    """A bounded hand-over from one producer thread to one asyncio consumer; the bound counts rows, so a
    channel of ChangeBlocks holds no more than one of ChangeEvents."""

    def __init__(self, loop: asyncio.AbstractEventLoop, max_items: int) -> None:
        self._loop = loop
        self._max = max_items
        self._cond = threading.Condition()
        self._buf: deque[Item] = deque()
        self._held = 0  # the weight of what ``_buf`` holds
        self._event = asyncio.Event()
        self._waiting = False
        self._done = False
        self._error: BaseException | None = None
        self.stopping = False

    def put_many(self, items: list[Item]) -> None:
        """Thread side: blocks while full; raises Stopped once stopping."""
        with self._cond:
            while self._held >= self._max and not self.stopping:
                self._cond.wait(0.5)
            if self.stopping:
                raise Stopped
            self._buf.extend(items)
            self._held += sum(map(_weight, items))
            self._wake()

    def finish(self, error: BaseException | None) -> None:
        """The end of the hand-over; the first error stays (the thread's own end after a stop must not hide why
        the consumer was stopped: a lost history, a restream)."""
        with self._cond:
            self._done = True
            if self._error is None:
                self._error = error
            self._wake()

    def _wake(self) -> None:
        if self._waiting:
            self._waiting = False
            with contextlib.suppress(RuntimeError):  # loop already closed
                self._loop.call_soon_threadsafe(self._event.set)

    def stop(self) -> None:
        with self._cond:
            self.stopping = True
            self._cond.notify_all()

    def __len__(self) -> int:
        return len(self._buf)

    async def get_many(self) -> list[Item]:
        """Loop side: every item available, waiting for at least one; [] at the end; raises the thread's error."""
        while True:
            with self._cond:
                if self._buf:
                    out = list(self._buf)
                    self._buf.clear()
                    self._held = 0
                    self._cond.notify_all()
                    return out
                if self._done:
                    if self._error is not None:
                        raise self._error
                    return []
                self._event.clear()
                self._waiting = True
            await self._event.wait()


def refused(where: str, msg: str) -> str:
    """What the server's error 1236 (the dump cannot start at the position) means."""
    return f"the server cannot send the binlog from {where}: {msg}; the binlog or GTIDs needed to resume were purged"


def classify(exc: BaseException, where: str) -> BaseException:
    """Map a reader failure to the error hierarchy: purged binlogs and auth are fatal."""
    if isinstance(exc, SourceError):
        return exc
    if isinstance(exc, pymysql.err.OperationalError | pymysql.err.InternalError) and exc.args:
        code = exc.args[0]
        msg = exc.args[1] if len(exc.args) > 1 else ""
        if code == 1236:
            return PositionLost(f"{refused(where, msg)}: those changes are lost to cdcd. {RESNAPSHOT_FIX}")
        if code in (1045, 1044, 1227, 1142):
            return SourceFatal(f"binlog connection refused ({code}: {msg}); grant the cdc user REPLICATION SLAVE, "
                               "REPLICATION CLIENT and SELECT, and check the password")
        what = "server unavailable" if code in TRANSIENT_CODES else "binlog connection lost"
        return SourceError(f"{what} at {where} ({code}: {msg}); reconnecting")
    if isinstance(exc, OSError | pymysql.err.Error | EOFError):
        return SourceError(f"binlog connection lost at {where}: {exc!r}; reconnecting")
    return SourceFatal(f"cannot decode the binlog at {where}: {exc!r}")


class BinlogReader:
    """One dump connection in a thread; items come out of ``channel``."""

    def __init__(self, settings: dict[str, Any], server_id: int, flavor: str, start: StartPoint, decoder: Decoder,
                 channel: Channel, on_event: Callable[[], None] | None = None, tls: Tls | None = None) -> None:
        self.settings = settings
        self.tls = tls  # None: PyMySQL's own default
        self.server_id = server_id
        self.flavor = flavor
        self.start_point = start
        self.decoder = decoder
        self.channel = channel
        self.on_event = on_event
        self._conns: list[pymysql.connections.Connection] = []
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.events_read = 0
        # (binlog file, position) the reader has read and handed on up to (heartbeats included): where an
        # incremental snapshot's HW on an idle binlog is known to be reached (cdcd/sources/mysql/chunks.py)
        self.read_upto: tuple[str, int] | None = None
        self.last_read = time.monotonic()  # when the last event or heartbeat arrived: names a stall
        self.thread_ids: list[int] = []  # server connection ids, to end the dump thread on close

    def _connect(self, **kwargs: Any) -> pymysql.connections.Connection:
        with self._lock:
            if self.channel.stopping:
                raise Stopped
            if len(self._conns) >= 2:
                # the library reconnects silently from its own idea of the position; we restart instead
                idle = time.monotonic() - self.last_read
                if idle >= STALL_S * 0.9:
                    raise SourceError(
                        f"no binlog event and no heartbeat for {idle:.0f}s (heartbeats asked every {HEARTBEAT_S:g}s, "
                        f"read timeout {STALL_S:g}s): the connection is taken for dead; reconnecting from the last "
                        "delivered transaction")
                raise SourceError("binlog connection lost; reconnecting from the last delivered transaction")
            conn = self.tls.connect_blocking(**kwargs) if self.tls is not None else pymysql.connect(**kwargs)
            keepalive(getattr(conn, "_sock", None))
            self._conns.append(conn)
            self.thread_ids.append(int(conn.thread_id()))
            return conn

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="cdcd-binlog", daemon=True)
        self._thread.start()

    def _reader(self) -> BinLogStreamReader:
        sp = self.start_point
        kw: dict[str, Any] = {}
        if sp.use_gtid:
            kw["auto_position"] = sp.gtid
            kw["is_mariadb"] = self.flavor == "mariadb"
        else:
            kw.update(log_file=sp.file, log_pos=sp.pos, resume_stream=True)
        return BinLogStreamReader(
            connection_settings=dict(self.settings), server_id=self.server_id, blocking=True,
            # no only_schemas / only_tables: the decoder numbers a transaction's rows events of every table
            # (decode.py, seqs) and passes over those of tables it does not capture without decoding their rows
            only_events=_EVENTS,
            slave_heartbeat=HEARTBEAT_S, pymysql_wrapper=self._connect, enable_logging=False,
            filter_non_implemented_events=False, **kw,
        )

    def _run(self) -> None:
        error: BaseException | None = None
        reader = None
        held: Mark | None = None  # the newest commit mark of uncaptured transactions not yet passed on
        last_sent = time.monotonic()
        try:
            reader = self._reader()
            decoder = self.decoder
            for ev in reader:
                if self.channel.stopping:
                    break
                self.events_read += 1
                self.last_read = time.monotonic()
                if type(ev) is bl.HeartbeatLogEvent:
                    self.read_upto = (decoder.file, int(ev.packet.log_pos))
                    if held is not None and time.monotonic() - last_sent >= IDLE_MARK_INTERVAL_S:
                        self.channel.put_many([held])
                        held, last_sent = None, time.monotonic()
                    continue
                items = decoder.feed(ev)
                if not items:
                    if not decoder.pending:  # rows gathered for a block are not handed on yet
                        self.read_upto = (decoder.file, int(ev.packet.log_pos))
                    continue
                if len(items) == 1 and type(items[0]) is Mark and items[0].kind == MarkKind.COMMIT \
                        and not items[0].detail["events"]:
                    held = items[0]
                    if time.monotonic() - last_sent < IDLE_MARK_INTERVAL_S:
                        self.read_upto = (decoder.file, int(ev.packet.log_pos))  # held: only progress
                        continue
                    held = None
                self.channel.put_many(items)
                last_sent = time.monotonic()
                if not decoder.pending:
                    self.read_upto = (decoder.file, int(ev.packet.log_pos))  # after its items are handed on
            if not self.channel.stopping:
                # A blocking dump never ends by itself: the server sent EOF (it is shutting down, or RESET MASTER
                # removed the binlog being read). Never a clean end: reconnect, which checks the server's binlog.
                raise SourceError(f"the server ended the binlog dump at {self.decoder.file}:"
                                  f"{self.decoder.tx_start or ''} (a shutdown, or its binlog was reset); reconnecting")
        except Stopped:
            pass
        except BaseException as exc:
            if not self.channel.stopping:
                where = f"{self.decoder.file}:{self.decoder.tx_start or ''}"
                error = classify(exc, where)
        finally:
            if reader is not None:
                with contextlib.suppress(Exception):
                    reader.close()
            self.channel.finish(error)

    def stop(self) -> None:
        """Ask the thread to end and unblock its socket read."""
        self.channel.stop()
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            sock = getattr(c, "_sock", None)
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def join(self, timeout: float) -> bool:
        if self._thread is None:
            return True
        self._thread.join(timeout)
        return not self._thread.is_alive()
