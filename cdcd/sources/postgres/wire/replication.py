"""The streaming-replication connection: a thin asyncio adapter over ``protocol.py``.

asyncpg cannot speak the replication sub-protocol, so this is a minimal client:
startup with ``replication=database``, trust/cleartext/md5/SCRAM-SHA-256
authentication, TLS per ``sslmode``, simple queries (IDENTIFY_SYSTEM,
CREATE_REPLICATION_SLOT), and START_REPLICATION in CopyBoth mode with
standby status updates.

Status updates are sent on a timer of their own, independent of whether
anyone reads the stream: when the runtime applies backpressure the socket is
not read, but the server still hears from us, so ``wal_sender_timeout``
never fires.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import ssl
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from cdcd.errors import SourceError, SourceFatal, SourceUnavailable, reason
from cdcd.positions import format_lsn, parse_lsn
from cdcd.sockets import PG_SERVER_KEEPALIVES, keepalive_transport
from cdcd.sources.postgres.connection import ConnectParams as ConnectParams
from cdcd.sources.postgres.connection import ssl_context
from cdcd.sources.postgres.types import SESSION_SETTINGS
from cdcd.sources.postgres.wire import protocol as p

# Authentication request codes.
_AUTH_OK, _AUTH_CLEARTEXT, _AUTH_MD5, _AUTH_SASL, _AUTH_SASL_CONTINUE, _AUTH_SASL_FINAL = 0, 3, 5, 10, 11, 12
_READ_SIZE = 1 << 18

# SQLSTATE classes no retry can cure.
_FATAL_SQLSTATES = ("28", "3D", "42501", "42704", "55000")

#: The stall bound when the server's wal_sender_timeout is 0 (disabled).
DEFAULT_STALL_S = 60.0


class PgServerError(SourceError):
    """An ErrorResponse from the server."""

    def __init__(self, fields: dict[str, str], context: str) -> None:
        self.sqlstate = fields.get("sqlstate", "")
        self.server_message = fields.get("message", "")
        hint = f" (hint: {fields['hint']})" if "hint" in fields else ""
        detail = f" ({fields['detail']})" if "detail" in fields else ""
        super().__init__(f"{context}: server error {self.sqlstate}: {self.server_message}{detail}{hint}")
        self.fatal = self.sqlstate.startswith(_FATAL_SQLSTATES)


class PgServerFatal(PgServerError, SourceFatal):
    """An ErrorResponse that no retry can cure (auth, missing slot, privileges)."""


def server_error(fields: dict[str, str], context: str) -> PgServerError:
    err = PgServerError(fields, context)
    return PgServerFatal(fields, context) if err.fatal else err


_UNITS_S = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "min": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration_s(text: str) -> float:
    """A PostgreSQL duration setting as SHOW prints it (``60s``, ``500ms``, ``1min``, ``0``) in seconds."""
    text = text.strip()
    number = text.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = text[len(number):] or "ms"  # wal_sender_timeout's base unit
    return float(number) * _UNITS_S.get(unit, 1e-3)


def server_major(version: str) -> int:
    """``15.4 (Debian 15.4-1)`` -> 15, ``17beta1`` -> 17, ``9.6.24`` -> 9; 0 when it does not start with a number."""
    match = re.match(r"\s*(\d+)", version)
    return int(match.group(1)) if match else 0


@dataclass(frozen=True, slots=True)
class SlotCreated:
    name: str
    consistent_point: int
    snapshot_name: str | None


async def negotiate_tls(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, params: ConnectParams) -> bool:
    """TLS per ``sslmode``, asked for before the startup message; True when the connection is TLS."""
    ctx = ssl_context(params.sslmode, params.sslrootcert)
    if ctx is None:
        return False
    writer.write(p.ssl_request())
    await writer.drain()
    answer = await reader.readexactly(1)
    if answer == b"S":
        hostname = params.host if ctx.check_hostname else None
        try:
            await writer.start_tls(ctx, server_hostname=hostname)
        except ssl.SSLError as exc:
            raise SourceFatal(
                f"{params.where}: TLS handshake failed ({exc.reason}) with sslmode={params.sslmode}; "
                "check source.sslrootcert and the server certificate"
            ) from exc
        return True
    elif params.sslmode != "prefer":
        raise SourceFatal(
            f"{params.where}: the server does not accept TLS but sslmode={params.sslmode}; "
            "enable ssl on the server or set source.sslmode = \"prefer\""
        )
    return False


def need_password(params: ConnectParams) -> str:
    if params.password is None:
        raise SourceFatal(f"{params.where}: the server asks for a password and none is configured; "
                          "set source.password or source.password_file")
    return params.password


class ReplicationConnection:
    """One replication connection (``replication=database``)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, params: ConnectParams) -> None:
        self._reader = reader
        self._writer = writer
        self._params = params
        self._buf = p.MessageBuffer()
        self.server_params: dict[str, str] = {}
        self.tls = False
        # Standby status: what we received, and what the source says is durably flushed.
        self.received_lsn = 0
        self.flush_lsn = 0
        self._status_task: asyncio.Task[None] | None = None
        self._copy_both = False
        self.closed = False
        #: No message at all for this long while streaming means a dead path (set from wal_sender_timeout).
        self.stall_timeout_s = DEFAULT_STALL_S
        #: When set, ``xlog`` yields an empty list if no data came by this ``time.monotonic()`` (once).
        self.wake_at: float | None = None
        #: The WAL end of the last primary keepalive after which no XLogData came (0: none since ``take_keepalive``)
        #: and whether one asked for a reply: the server had sent everything it decoded before that position.
        self._keepalive_lsn = 0
        self._keepalive_reply = False

    # ------------------------------------------------------------ connecting

    @classmethod
    async def connect(cls, params: ConnectParams) -> ReplicationConnection:
        try:
            return await asyncio.wait_for(cls._connect(params), params.connect_timeout_s)
        except TimeoutError:
            raise SourceUnavailable(
                f"{params.where}: no answer within {params.connect_timeout_s}s; check host, port and firewall"
            ) from None
        except OSError as exc:
            raise SourceUnavailable(f"{params.where}: cannot connect: {reason(exc)}; check that the server runs and "
                              "listens") from exc

    @classmethod
    async def _connect(cls, params: ConnectParams) -> ReplicationConnection:
        reader, writer = await asyncio.open_connection(params.host, params.port)
        keepalive_transport(writer.transport)
        conn = cls(reader, writer, params)
        try:
            conn.tls = await negotiate_tls(reader, writer, params)
            await conn._startup()
        except BaseException:
            conn.terminate()
            raise
        return conn

    async def _startup(self) -> None:
        params = {
            "user": self._params.user,
            "database": self._params.database,
            "replication": "database",
            "application_name": self._params.application_name,
            **SESSION_SETTINGS,
            **PG_SERVER_KEEPALIVES,
        }
        self._writer.write(p.startup_message(params))
        scram: p.ScramClient | None = None
        while True:
            msg = await self._next()
            if msg.kind == b"R":
                code, data = p.parse_auth(msg.payload)
                if code == _AUTH_OK:
                    continue
                password = need_password(self._params)
                if code == _AUTH_CLEARTEXT:
                    self._writer.write(p.password_message(password))
                elif code == _AUTH_MD5:
                    self._writer.write(p.password_message(p.md5_password(self._params.user, password, data[:4])))
                elif code == _AUTH_SASL:
                    mechanisms = [m.decode() for m in data.split(b"\x00") if m]
                    if p.ScramClient.mechanism not in mechanisms:
                        raise SourceFatal(f"{self._params.where}: server offers only SASL {mechanisms}; "
                                          "cdcd supports SCRAM-SHA-256")
                    scram = p.ScramClient(password)
                    self._writer.write(p.sasl_initial_response(scram.mechanism, scram.client_first()))
                elif code == _AUTH_SASL_CONTINUE and scram is not None:
                    self._writer.write(p.sasl_response(scram.client_final(data)))
                elif code == _AUTH_SASL_FINAL and scram is not None:
                    try:
                        scram.verify_server_final(data)
                    except p.ProtocolError as exc:
                        raise SourceFatal(f"{self._params.where}: {exc}") from exc
                else:
                    raise SourceFatal(f"{self._params.where}: unsupported authentication request {code}; "
                                      "use trust, md5 or scram-sha-256 in pg_hba.conf")
                await self._writer.drain()
            elif msg.kind == b"S":
                name, value = p.parse_parameter_status(msg.payload)
                self.server_params[name] = value
            elif msg.kind == b"K" or msg.kind == b"N":
                continue
            elif msg.kind == b"Z":
                return
            elif msg.kind == b"E":
                raise server_error(p.parse_error_fields(msg.payload), f"{self._params.where}: connecting")
            else:
                raise SourceError(f"{self._params.where}: unexpected message {msg.kind!r} during startup")

    async def _next(self, timeout: float | None = -1.0) -> p.BackendMessage:
        """The next message; waits at most ``timeout`` (default: ``read_timeout_s``; None: no bound but
        keepalives) for the server to say anything."""
        limit = self._params.read_timeout_s if timeout is not None and timeout < 0 else timeout
        while True:
            for msg in self._buf:
                return msg
            try:
                async with asyncio.timeout(limit):
                    data = await self._reader.read(_READ_SIZE)
            except TimeoutError:
                raise SourceError(f"{self._params.where}: no answer from the server within {limit:g}s "
                                  "(runtime.source_read_timeout_s); the connection is taken for dead") from None
            if not data:
                raise SourceError(f"{self._params.where}: the server closed the replication connection")
            self._buf.feed(data)

    # ------------------------------------------------------------ commands

    async def query(self, sql: str, timeout: float | None = -1.0) -> list[dict[str, str | None]]:
        """A simple-protocol command; its rows as dicts of text. ``timeout`` as for ``_next``."""
        self._writer.write(p.query_message(sql))
        await self._writer.drain()
        names: list[str] = []
        rows: list[dict[str, str | None]] = []
        error: PgServerError | None = None
        while True:
            msg = await self._next(timeout)
            if msg.kind == b"T":
                names = p.parse_row_description(msg.payload)
            elif msg.kind == b"D":
                rows.append(dict(zip(names, p.parse_data_row(msg.payload), strict=True)))
            elif msg.kind == b"E":
                error = server_error(p.parse_error_fields(msg.payload), f"{self._params.where}: {sql.split(' (')[0]}")
            elif msg.kind == b"Z":
                if error is not None:
                    raise error
                return rows

    async def identify_system(self) -> dict[str, str | None]:
        return (await self.query("IDENTIFY_SYSTEM"))[0]

    async def create_slot(self, name: str, export_snapshot: bool, failover: bool = False) -> SlotCreated:
        # The pre-15 spelling is understood by 14 and every later version; a failover slot (17+) only by the
        # option list.
        how = "EXPORT_SNAPSHOT" if export_snapshot else "NOEXPORT_SNAPSHOT"
        if failover:
            how = f"(SNAPSHOT '{'export' if export_snapshot else 'nothing'}', FAILOVER true)"
        # Creating a slot waits for every running transaction to end, however long the application keeps one
        # open: bounded by TCP keepalives only, never by a read timeout that would retry it for ever.
        row = (await self.query(f'CREATE_REPLICATION_SLOT "{name}" LOGICAL pgoutput {how}', timeout=None))[0]
        return SlotCreated(str(row["slot_name"]), parse_lsn(str(row["consistent_point"])), row.get("snapshot_name"))

    async def status_interval(self, most: float) -> float:
        """How often to send status updates: well inside the server's ``wal_sender_timeout``.

        Also sets the stall bound: every status update asks for a reply, so a live server says something
        at least every interval; silence for a whole ``wal_sender_timeout`` (after which the server gives
        up on us too, freeing the slot) means the path is dead.
        """
        rows = await self.query("SHOW wal_sender_timeout")
        timeout = parse_duration_s(str(rows[0].get("wal_sender_timeout") or "0")) if rows else 0.0
        if timeout <= 0:
            self.stall_timeout_s = DEFAULT_STALL_S
            return min(most, DEFAULT_STALL_S / 4)
        interval = max(0.1, min(most, timeout / 4))
        self.stall_timeout_s = max(timeout, 3 * interval)
        return interval

    def server_major(self) -> int:
        """The server's major version from its ``server_version`` parameter; 0 when it has none."""
        return server_major(self.server_params.get("server_version", ""))

    async def start_replication(self, slot: str, start_lsn: int, publication: str, status_interval_s: float,
                                stream_in_progress: bool = False) -> None:
        """START_REPLICATION with pgoutput protocol 1, or 2 with ``streaming 'on'`` (in-progress transactions
        streamed, PostgreSQL 14+) when ``stream_in_progress``."""
        proto = "proto_version '2', streaming 'on'" if stream_in_progress else "proto_version '1'"
        sql = (f'START_REPLICATION SLOT "{slot}" LOGICAL {format_lsn(start_lsn)} '
               f"({proto}, publication_names '\"{publication}\"', messages 'true')")
        self._writer.write(p.query_message(sql))
        await self._writer.drain()
        while True:
            msg = await self._next()
            if msg.kind == b"W":
                break
            if msg.kind == b"E":
                raise server_error(p.parse_error_fields(msg.payload), f"{self._params.where}: START_REPLICATION")
            if msg.kind == b"N":
                continue
            raise SourceError(f"{self._params.where}: unexpected message {msg.kind!r} after START_REPLICATION")
        self._copy_both = True
        self.received_lsn = max(self.received_lsn, start_lsn)
        self._status_task = asyncio.create_task(self._status_loop(status_interval_s), name="pg-standby-status")

    # ------------------------------------------------------------ streaming

    async def xlog(self) -> AsyncIterator[list[bytes]]:
        """The WAL data (pgoutput messages) of the XLogData messages, as many as one socket read brought, until
        the server ends the stream.

        Lists rather than single messages: crossing async generators per message costs more than decoding it;
        and the buffer cuts them out in bulk (``MessageBuffer.take_xlog``), with no object per message but the
        data itself. Keepalives are answered here. An empty list: nothing came by ``wake_at``, or a keepalive
        came with no data (``take_keepalive``).
        """
        buf = self._buf
        while True:
            out: list[bytes] = []
            keepalive = False  # a keepalive came in this read with no XLogData after it
            while True:
                taken = len(out)
                wal_end, msg = buf.take_xlog(out)
                if wal_end > self.received_lsn:
                    self.received_lsn = wal_end
                if len(out) > taken:  # XLogData after a keepalive: that keepalive's position is behind the stream
                    keepalive = False
                    self._keepalive_lsn, self._keepalive_reply = 0, False
                if msg is None:
                    break
                if msg.kind == b"d":
                    item = p.parse_copy_data(msg.payload)
                    if item.wal_end > self.received_lsn:
                        self.received_lsn = item.wal_end
                    if isinstance(item, p.XLogData):  # never: take_xlog takes every well-formed one
                        out.append(item.data)
                        keepalive = False
                        self._keepalive_lsn, self._keepalive_reply = 0, False
                        continue
                    keepalive = True
                    self._keepalive_lsn = item.wal_end
                    self._keepalive_reply = self._keepalive_reply or item.reply_requested
                    if item.reply_requested:
                        self.send_status()
                elif msg.kind == b"E":
                    raise server_error(p.parse_error_fields(msg.payload), f"{self._params.where}: replication stream")
                elif msg.kind == b"c":
                    if out:
                        yield out
                    return
                elif msg.kind not in (b"N", b"S"):
                    raise SourceError(f"{self._params.where}: unexpected message {msg.kind!r} in the stream")
            if out:
                self.wake_at = None  # the reader gets messages: it sets a new wake time if it wants one
                yield out
            elif keepalive:
                self.wake_at = None
                yield []  # the reader may take the keepalive's position (``take_keepalive``)
            # The reader may hold decoded items until ``wake_at``: it is told (an empty list) when no message
            # came by then, also when only a keepalive or part of a message did.
            wake = self.wake_at
            try:
                async with asyncio.timeout(self.stall_timeout_s if wake is None else max(0.0, wake - time.monotonic())):
                    data = await self._reader.read(_READ_SIZE)  # cancelled before data: none is lost
            except TimeoutError:
                if wake is not None:
                    self.wake_at = None
                    yield []
                    continue
                raise SourceError(
                    f"{self._params.where}: no message from the server for {self.stall_timeout_s:g}s, not even a "
                    "keepalive (the bound is the server's wal_sender_timeout): the connection is taken for dead; "
                    "reconnecting from the checkpoint") from None
            if not data:
                raise SourceError(f"{self._params.where}: the server closed the replication connection")
            buf.feed(data)

    @property
    def keepalive_pending(self) -> bool:
        """A keepalive that no XLogData followed waits for ``take_keepalive``."""
        return self._keepalive_lsn != 0

    def take_keepalive(self) -> tuple[int, bool] | None:
        """The WAL end of the last primary keepalive that no XLogData followed, and whether a keepalive since the
        last take asked for a reply; None when there is none. Taken once.

        The walsender sends a keepalive with its ``sentPtr``, the end of the last WAL record it decoded, and
        decodes in WAL order: every transaction whose commit record lies before that position was sent before
        the keepalive. One sent while the walsender outputs a transaction carries a position at or before that
        transaction's commit record: the reader takes a position only between transactions. At a fast shutdown
        the walsender waits, asking for replies, until the client confirms exactly that position
        (``WalSndDone``)."""
        lsn, reply = self._keepalive_lsn, self._keepalive_reply
        self._keepalive_lsn, self._keepalive_reply = 0, False
        return (lsn, reply) if lsn else None

    def send_status(self, reply: bool = False) -> None:
        """Standby status update. ``flush`` is what the source set: never more than the durable checkpoint."""
        if self.closed or not self._copy_both or self._writer.is_closing():
            return
        flush = self.flush_lsn
        self._writer.write(p.standby_status_update(max(self.received_lsn, flush), flush, flush,
                                                   time.time_ns() // 1000, reply))

    async def _status_loop(self, interval: float) -> None:
        while not self.closed:
            await asyncio.sleep(interval)
            try:
                self.send_status(reply=True)  # the server answers at once: the stall detector hears it live
                await self._writer.drain()
            except (OSError, RuntimeError):
                return

    # ------------------------------------------------------------ closing

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self._status_task is not None:
            self._status_task.cancel()
        with contextlib.suppress(Exception):
            if self._copy_both:
                # Final word: the flush position, then leave CopyBoth and say goodbye.
                self._copy_both_final()
            self._writer.write(p.terminate_message())
            await asyncio.wait_for(self._writer.drain(), 2)
        self._writer.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._writer.wait_closed(), 2)

    def _copy_both_final(self) -> None:
        flush = self.flush_lsn
        self._writer.write(p.standby_status_update(max(self.received_lsn, flush), flush, flush,
                                                   time.time_ns() // 1000))
        self._writer.write(p.copy_done())

    def terminate(self) -> None:
        self.closed = True
        if self._status_task is not None:
            self._status_task.cancel()
        with contextlib.suppress(Exception):
            self._writer.transport.abort()
