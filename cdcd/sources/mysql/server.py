"""The server a MySqlSource captures from, as the source and its readers share it.

``MySqlServer`` holds the control connection and the queries on it (variables, binlog files, the binlog's
current position, ending our dump threads), what ``connect()`` learned of the server (flavor, version, GTID
mode, the schema history of its tables), the position epoch and the server identity recorded in the checkpoint
(``identity.py`` judges a position against it). The planner (``source.py``), the snapshot and binlog readers
(``stream.py``) and the chunk reader (``chunks.py``) are each handed this object, not the source.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

import aiomysql
import structlog

from cdcd.capture.contracts import Replan
from cdcd.config import Config
from cdcd.errors import PositionLost, SourceError, SourceFatal
from cdcd.events import Item, Mark, MarkKind, TableId
from cdcd.positions import MySqlPosition
from cdcd.sources.mysql.binlog import StartPoint
from cdcd.sources.mysql.connection import ConnectParams
from cdcd.sources.mysql.failures import raise_query_error
from cdcd.sources.mysql.identity import (
    BinlogAt,
    BinlogFacts,
    PurgedFile,
    Verdict,
    judge,
    parse_event_gtid,
)
from cdcd.sources.mysql.plan import LOST_FIX
from cdcd.sources.mysql.preflight import undecodable_settings
from cdcd.sources.mysql.queries import PRIMARY_KEY_SQL, TABLE_EXISTS_SQL, Watermark, parse_binlog_status
from cdcd.sources.mysql.schema import SchemaHistory
from cdcd.sources.mysql.tls import Tls, TlsError
from cdcd.sources.mysql.watermarks import binlog_status_statement

log = structlog.get_logger("cdcd.source.mysql")


class MySqlServer:
    """The control connection, the server's facts, the position epoch and the recorded server identity."""

    def __init__(self, config: Config, conn: ConnectParams) -> None:
        self.config = config
        self.conn = conn  # address, credentials, TLS: shared with `cdcd check` and verify
        assert config.source.mysql.server_id is not None
        self.server_id: int = config.source.mysql.server_id  # ours, as a replica of the server
        self.flavor = "mariadb" if config.source.kind == "mariadb" else "mysql"
        self.version = ""
        self.gtid_mode = False
        self.history = SchemaHistory()
        self.epoch = 0  # the position epoch of the server streamed from (cdcd.positions.MySqlPosition)
        self.identity: dict[str, Any] | None = None  # its identity, as recorded in the checkpoint
        self._identity_due: dict[str, Any] | None = None  # an identity the checkpoint does not have yet
        self._ctl: aiomysql.Connection | None = None
        # one caller at a time on the control connection: the stream's reconnect, a table reload and the snapshot
        # share it, and two readers of one aiomysql connection fail ("readexactly() called while another
        # coroutine is already waiting for incoming data"); the wait and each holder are bounded (``controlled``)
        self._ctl_lock = asyncio.Lock()

    # ------------------------------------------------------------ the control connection
    @property
    def tls(self) -> Tls:
        """The TLS policy of every connection (source.sslmode, source.sslrootcert)."""
        return self.conn.tls

    @property
    def where(self) -> str:
        return f"{self.flavor} {self.conn.user}@{self.conn.where}"

    async def control(self) -> aiomysql.Connection:
        if self._ctl is None or self._ctl.closed:
            try:
                self._ctl = await self.conn.open()
            except TlsError:
                raise
            except SourceError as exc:
                cause = exc.__cause__
                if cause is not None and getattr(cause, "args", (None,))[0] in (1045, 1044):
                    raise SourceFatal(f"{exc}: check source.user and the password") from cause
                raise
        return self._ctl

    @contextlib.asynccontextmanager
    async def controlled(self, timeout: float | None = None, what: str = "query") -> AsyncIterator[aiomysql.Connection]:
        """The control connection, for this caller alone until the block ends (``_ctl_lock``).

        The wait for it and the block together are bounded by ``timeout`` (default runtime.source_read_timeout_s).
        A block that fails or is cut short drops the connection (what it was reading is unknown; the next caller
        opens a new one); database, network and timeout errors are raised as classified SourceErrors naming
        ``what``."""
        try:
            async with asyncio.timeout(timeout or self.config.runtime.source_read_timeout_s), self._ctl_lock:
                conn = await self.control()
                try:
                    yield conn
                except BaseException:
                    conn.close()
                    self._ctl = None
                    raise
        except Exception as exc:  # cdcd's own errors as they are (``raise_query_error``)
            raise_query_error(exc, f"{what} on {self.where}")

    async def query(self, sql: str, args: Any = None, timeout: float | None = None) -> list[tuple[Any, ...]]:
        """One query on the control connection, bounded by ``timeout`` (``controlled``)."""
        async with self.controlled(timeout) as conn, conn.cursor() as cur:
            await cur.execute(sql, args)
            return list(await cur.fetchall())

    async def drop_control(self) -> None:
        if self._ctl is not None:
            with contextlib.suppress(Exception):
                self._ctl.close()
            self._ctl = None

    async def close(self) -> None:
        if self._ctl is not None:
            ctl, self._ctl = self._ctl, None
            with contextlib.suppress(Exception):  # the polite goodbye; a silent server must not hold a stop
                async with asyncio.timeout(float(self.conn.connect_timeout)):
                    await ctl.ensure_closed()
            ctl.close()

    def terminate(self) -> None:
        if self._ctl is not None:
            with contextlib.suppress(Exception):
                self._ctl.close()
            self._ctl = None

    async def kill_threads(self, ids: list[int]) -> None:
        """End these connections (our dump threads) on the server, on the control connection, and wait until
        they are gone."""
        if not ids or self._ctl is None or self._ctl.closed:
            # no live control connection: never open one for this, it could reach another server (a failover)
            # whose connection ids mean other sessions
            return
        limit = float(self.conn.connect_timeout)  # short: a dead control connection must not hold us
        with contextlib.suppress(Exception):
            for tid in ids:
                if self._ctl is None:  # a failed query dropped it: do not open another (see above)
                    return
                with contextlib.suppress(SourceError):
                    await self.query(f"KILL CONNECTION {tid}", timeout=limit)
            listed = ", ".join(map(str, ids))
            for _ in range(50):  # KILL only flags the thread; wait until it is gone
                if self._ctl is None:
                    return
                rows = await self.query(f"SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE ID IN ({listed})",
                                        timeout=limit)
                if not rows[0][0]:
                    break
                await asyncio.sleep(0.05)

    # ------------------------------------------------------------ the server's facts
    async def variables(self) -> dict[str, str]:
        rows = await self.query(
            "SHOW GLOBAL VARIABLES WHERE Variable_name IN ('log_bin', 'binlog_format', 'binlog_row_image', "
            "'binlog_row_metadata', 'server_id', 'gtid_mode', 'gtid_binlog_pos', 'gtid_purged', 'version', "
            "'log_bin_compress', 'server_uuid', 'gtid_executed', 'binlog_transaction_compression', "
            "'binlog_row_value_options')")
        return {str(k).lower(): str(v) for k, v in rows}

    def learn(self, v: dict[str, str]) -> None:
        """Take the server's version, flavor and GTID mode from its ``variables()``; a setting cdcd cannot stream
        from is fatal (no binlog, a compressed one, an undecodable row format, our server_id taken)."""
        self.version = v.get("version", "")
        self.flavor = "mariadb" if "mariadb" in self.version.lower() else "mysql"
        self.gtid_mode = v.get("gtid_mode", "OFF").upper() == "ON"
        if v.get("log_bin", "OFF").upper() not in ("ON", "1"):
            raise SourceFatal("the server's binlog is off (log_bin): set log_bin, binlog_format=ROW, "
                              "binlog_row_image=FULL, binlog_row_metadata=FULL and restart it (see docs/mysql.md)")
        if v.get("log_bin_compress", "OFF").upper() in ("ON", "1"):
            raise SourceFatal("the server compresses its binlog (log_bin_compress = ON), which cdcd cannot decode: "
                              "SET GLOBAL log_bin_compress = OFF and set it OFF in my.cnf (see docs/mysql.md)")
        for problem in undecodable_settings(v):
            raise SourceFatal(problem)
        if v.get("server_id") == str(self.server_id):
            raise SourceFatal(f"source.mysql.server_id {self.server_id} is the server's own server_id: choose a "
                              "number unique among its replicas")

    async def exists(self, t: TableId) -> bool:
        return bool(await self.query(TABLE_EXISTS_SQL, (t.schema, t.name)))

    async def primary_key(self, t: TableId) -> list[tuple[str, str]]:
        """The table's primary key columns in key order, with their types (empty: no primary key)."""
        return [(str(r[0]), str(r[1])) for r in await self.query(PRIMARY_KEY_SQL, (t.schema, t.name))]

    async def facts(self, v: dict[str, str] | None = None) -> BinlogFacts:
        """The server's identity, GTID set and binlog files; a dead control connection is a transient error."""
        try:
            if v is None:
                v = await self.variables()
            logs = await self.query("SHOW BINARY LOGS")
        except (aiomysql.Error, OSError) as exc:
            await self.drop_control()
            raise SourceError(f"{self.conn.where}: reading the server's identity "
                              f"failed: {exc!r}; reconnecting") from exc
        flavor = "mariadb" if "mariadb" in v.get("version", "").lower() else "mysql"
        return BinlogFacts(
            flavor=flavor, server_id=int(v.get("server_id") or 0), uuid=v.get("server_uuid", ""),
            gtid=v.get("gtid_binlog_pos" if flavor == "mariadb" else "gtid_executed", ""),
            gtid_mode=v.get("gtid_mode", "OFF").upper() == "ON",
            binlogs=[(str(r[0]), int(r[1])) for r in logs])

    async def facts_at(self, facts: BinlogFacts, pos: MySqlPosition) -> BinlogFacts:
        """``facts`` with what the server's binlog holds at ``pos``'s file and offset (``identity.BinlogAt``), when
        ``pos`` is a place in this server's binlog that is still on it: the check that the binlog is still the
        history ``pos`` was read from (``identity.check_transaction``)."""
        if not pos.file or pos.epoch < self.epoch or pos.file not in dict(facts.binlogs) or \
                not self.gtid_usable(pos.gtid):
            return facts  # judged by file and GTID set alone (identity.judge)
        boundary, event_gtid = True, None
        try:
            events = await self.query("SHOW BINLOG EVENTS IN %s FROM %s LIMIT 1", (pos.file, pos.pos))
        except SourceError as exc:
            cause = exc.__cause__
            if getattr(cause, "args", (None,))[0] != 1220:  # "Wrong offset or I/O error": no event starts there
                raise
            boundary = False
        else:
            if events:
                event_gtid = parse_event_gtid(str(events[0][2]), str(events[0][5] or ""))
        before = None
        if facts.flavor == "mariadb" and boundary:
            rows = await self.query("SELECT BINLOG_GTID_POS(%s, %s)", (pos.file, pos.pos))
            if rows[0][0] is None:
                boundary = False  # MariaDB: NULL where no event starts
            else:
                before = str(rows[0][0])
        return dataclasses.replace(facts, at=BinlogAt(pos.file, pos.pos, boundary, before, event_gtid))

    async def current_position(self) -> Watermark:
        async with self.controlled(what="the binlog position query") as conn, conn.cursor(aiomysql.DictCursor) as cur:
            await cur.execute(binlog_status_statement(self.flavor, self.version))
            wm = parse_binlog_status(await cur.fetchone())
        if self.flavor == "mariadb":
            rows = await self.query("SELECT BINLOG_GTID_POS(%s, %s)", (wm.file, wm.pos))
            wm.gtid = str(rows[0][0] or "")
        return wm

    # ------------------------------------------------------------ positions of this server, its identity
    def gtid_usable(self, gtid: str) -> bool:
        return bool(gtid) and (self.flavor == "mariadb" or self.gtid_mode)

    def start_at(self, pos: MySqlPosition) -> StartPoint:
        if not pos.file or pos.epoch < self.epoch:
            # a position of an earlier server (before a failover), or an epoch's start: its GTID set locates it
            return StartPoint("", 0, pos.gtid, True)
        return StartPoint(pos.file, pos.pos, pos.gtid, self.gtid_usable(pos.gtid))

    def stamp(self, pos: MySqlPosition) -> MySqlPosition:
        """A position read from the server now (a watermark) in the current epoch."""
        return dataclasses.replace(pos, epoch=self.epoch)

    def judge(self, facts: BinlogFacts, recorded: dict[str, Any] | None, pos: MySqlPosition,
              what: str) -> Verdict | str | None:
        """judge(), with its refusals as values: None = the binlog file was purged, str = the position is lost."""
        try:
            return judge(facts, recorded, self.epoch, pos, what)
        except PurgedFile:
            return None
        except PositionLost as exc:
            return str(exc)

    def lost_error(self, problem: str) -> SourceError:
        if self.config.source.on_position_lost == "resnapshot":
            return Replan(f"{problem}; source.on_position_lost = resnapshot re-plans (a recovery)")
        if self.config.snapshot.mode == "when_needed":
            return Replan(f"{problem}; snapshot.mode = when_needed re-plans (a new snapshot)")
        return PositionLost(f"{problem}. {LOST_FIX}")

    def adopt(self, facts: BinlogFacts, verdict: Verdict | None) -> None:
        """From now on positions belong to this server, in the verdict's epoch; record that in the checkpoint."""
        if verdict is not None and verdict.switched:
            log.warning("the source server changed; following it by GTID in a new position epoch",
                        server=facts.describe(), epoch=verdict.epoch)
            self.epoch = verdict.epoch
        identity = facts.identity(self.epoch)
        if identity != self.identity:
            self._identity_due = identity
        self.identity = identity

    def marks(self, at: MySqlPosition) -> list[Item]:
        """The Mark that records the server identity in the checkpoint, when it changed."""
        if self._identity_due is None:
            return []
        identity, self._identity_due = self._identity_due, None
        return [Mark(MarkKind.IDENTITY, at, identity)]

    def forget_due(self) -> None:
        """A new plan: an identity not yet recorded is decided again."""
        self._identity_due = None

    def mark_at(self, pos: MySqlPosition) -> MySqlPosition:
        """Where the server Mark sits: ``pos`` itself, or the start of the new epoch after a switch."""
        if pos.epoch < self.epoch:
            return MySqlPosition.epoch_start(self.epoch, pos.gtid)
        return pos
