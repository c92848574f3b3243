"""MySqlSource: the Source for ``source.kind`` "mariadb" and "mysql".

connect() validates the resume point (the binlog it needs is still on the
server) and plans the run: a fresh snapshot, the rest of an interrupted one,
or streaming from the checkpoint. stream() yields the snapshot (if due) and
then the binlog from the watermark or the checkpoint's transaction.

Durable state (what ``fold`` returns):
``{"snapshot": {"watermark": pos, "tables": {"db.t": {"last_key": [...],
"done": bool}}, "done": bool}, "schemas": SchemaHistory JSON}``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC
from typing import Any

import aiomysql

from cdcd.config import Config
from cdcd.errors import SourceError, SourceFatal
from cdcd.events import ChangeEvent, Item, Mark, Op, RowBlock, TableId, snapshot_truncates
from cdcd.positions import MySqlPosition, Position, position_from_json
from cdcd.runtime.interfaces import CheckResult, ResumePoint, Source
from cdcd.sources.mysql.binlog import BinlogReader, Channel, StartPoint
from cdcd.sources.mysql.decode import Decoder
from cdcd.sources.mysql.gtid import check_not_purged
from cdcd.sources.mysql.preflight import ServerFacts, evaluate, tls_check, undecodable_settings
from cdcd.sources.mysql.schema import SchemaHistory, schema_from_json
from cdcd.sources.mysql.snapshot import (
    SnapshotTask,
    Snapshotter,
    Watermark,
    load_table_schema,
    open_connection,
    parse_binlog_status,
)
from cdcd.sources.mysql.tls import Tls, TlsError
from cdcd.sources.mysql.types import key_from_json, key_to_json

QUEUE_ITEMS = 20000  # decoded items buffered ahead of the runtime; the binlog reader waits beyond

RESNAPSHOT_FIX = (
    "Re-snapshot: stop cdcd, remove the state directory (state.path) and the landing zone and start again with "
    "snapshot.mode = \"initial\", or set snapshot.mode = \"when_needed\" to re-snapshot automatically; keep "
    "binlogs longer (expire_logs_days / binlog_expire_logs_seconds) so this does not recur."
)


# ------------------------------------------------------------------ pure state

def fold_state(state: dict[str, Any], items: Sequence[Item]) -> dict[str, Any]:
    """The source state once ``items`` are committed. Pure; ``state`` is not modified."""
    new = dict(state)
    snap: dict[str, Any] | None = new.get("snapshot")
    tables: dict[str, dict[str, Any]] = {k: dict(v) for k, v in ((snap or {}).get("tables") or {}).items()}
    if snap is not None:
        snap = dict(snap)
    last: dict[str, ChangeEvent | RowBlock] = {}
    history: SchemaHistory | None = None
    for item in items:
        if type(item) is ChangeEvent:
            if item.snapshot and item.op is not Op.TRUNCATE:  # a snapshot's opening truncate is no progress
                last[str(item.table)] = item
            continue
        if type(item) is RowBlock:
            # the batcher may have sliced the block: this slice's own last row is what is committed
            if item.snapshot and item.rows:
                last[str(item.table)] = item
            continue
        assert isinstance(item, Mark)
        kind = item.kind
        if kind == "snapshot_start":
            snap = {"watermark": item.position.to_json(), "done": False}
            tables = {t: {"last_key": None, "done": False} for t in item.detail["tables"]}
            last = {}
        elif kind == "snapshot_table_done":
            _flush_keys(tables, last)
            tables.setdefault(item.detail["table"], {"last_key": None})["done"] = True
        elif kind == "snapshot_done" and snap is not None:
            snap["done"] = True
        elif kind in ("schema", "snapshot_table_start"):
            if history is None:
                history = SchemaHistory.from_json(new.get("schemas") or {})
            table = TableId.parse(item.detail["table"])
            assert isinstance(item.position, MySqlPosition)
            history.add_entry(item.position, schema_from_json(table, item.detail["schema"]))
        elif kind == "stream_start":
            new["stream_start"] = item.position.to_json()
    _flush_keys(tables, last)
    if snap is not None:
        snap["tables"] = tables
        new["snapshot"] = snap
    if history is not None:
        new["schemas"] = history.to_json()
    return new


def _flush_keys(tables: dict[str, dict[str, Any]], last: dict[str, ChangeEvent | RowBlock]) -> None:
    for name, ev in last.items():
        entry = tables.setdefault(name, {"last_key": None, "done": False})
        key = ev.key if isinstance(ev, ChangeEvent) else ev.last_key
        entry["last_key"] = key_to_json(key) if ev.schema.key and key is not None else None
    last.clear()


# ------------------------------------------------------------------ the source

@dataclass
class _Plan:
    snapshot_tasks: list[SnapshotTask] | None = None  # None: no snapshot to run
    fresh_snapshot: bool = False
    watermark: MySqlPosition | None = None  # the snapshot's (known when resuming one)
    start: StartPoint | None = None  # where streaming starts (None: after the snapshot, at its watermark)
    stream: bool = True  # False for initial_only
    announce: list[Item] = field(default_factory=list)


class MySqlSource(Source):
    """Binlog streaming and snapshots for MariaDB and MySQL."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.kind = config.source.kind
        src = config.source
        assert src.mysql.server_id is not None
        self.server_id: int = src.mysql.server_id
        self.tables = set(src.table_ids)
        self.settings: dict[str, Any] = {
            "host": src.host, "port": src.effective_port, "user": src.user, "password": src.secret() or "",
            "charset": "utf8mb4", "connect_timeout": int(src.connect_timeout_s),
        }
        self._tls: Tls | None = None  # built on first use: a bad sslrootcert is a connect error
        self.flavor = "mariadb" if src.kind == "mariadb" else "mysql"
        self.version = ""
        self.gtid_mode = False
        self.history = SchemaHistory()
        self._plan = _Plan()
        self._ctl: aiomysql.Connection | None = None
        self._snapshotter: Snapshotter | None = None
        self._reader: BinlogReader | None = None
        self._channel: Channel | None = None
        self._phase = "idle"
        self._connected = False
        self._last_emitted: MySqlPosition | None = None
        self._lag_ms: float | None = None
        self._closing = False

    # ------------------------------------------------------------ connect
    @property
    def tls(self) -> Tls:
        """The TLS policy of every connection (source.sslmode, source.sslrootcert)."""
        if self._tls is None:
            src = self.config.source
            self._tls = Tls.build(src.sslmode, src.sslrootcert, self.settings["host"], self.settings["port"])
        return self._tls

    def _binlog_settings(self) -> dict[str, Any]:
        s = self.settings
        return {"host": s["host"], "port": s["port"], "user": s["user"], "password": s["password"],
                "charset": "utf8mb4", "connect_timeout": s["connect_timeout"]}

    async def _control(self) -> aiomysql.Connection:
        if self._ctl is None or self._ctl.closed:
            try:
                self._ctl = await open_connection(self.settings, self.tls)
            except TlsError:
                raise
            except SourceError as exc:
                cause = exc.__cause__
                if cause is not None and getattr(cause, "args", (None,))[0] in (1045, 1044):
                    raise SourceFatal(f"{exc}: check source.user and the password") from cause
                raise
        return self._ctl

    async def _query(self, sql: str, args: Any = None) -> list[tuple[Any, ...]]:
        conn = await self._control()
        async with conn.cursor() as cur:
            await cur.execute(sql, args)
            return list(await cur.fetchall())

    async def _variables(self) -> dict[str, str]:
        rows = await self._query(
            "SHOW GLOBAL VARIABLES WHERE Variable_name IN ('log_bin', 'binlog_format', 'binlog_row_image', "
            "'binlog_row_metadata', 'server_id', 'gtid_mode', 'gtid_binlog_pos', 'gtid_purged', 'version', "
            "'log_bin_compress', 'binlog_transaction_compression', 'binlog_row_value_options')")
        return {str(k).lower(): str(v) for k, v in rows}

    async def _binlog_files(self) -> list[str]:
        return [str(r[0]) for r in await self._query("SHOW BINARY LOGS")]

    async def connect(self, resume: ResumePoint) -> None:
        self._closing = False
        v = await self._variables()
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
        self.history = SchemaHistory.from_json(resume.state.get("schemas") or {})
        self._plan = await self._make_plan(resume, v)
        self._connected = True

    def _gtid_usable(self, gtid: str) -> bool:
        return bool(gtid) and (self.flavor == "mariadb" or self.gtid_mode)

    def _start_at(self, pos: MySqlPosition) -> StartPoint:
        return StartPoint(pos.file, pos.pos, pos.gtid, self._gtid_usable(pos.gtid))

    async def _make_plan(self, resume: ResumePoint, v: dict[str, str]) -> _Plan:
        mode = self.config.snapshot.mode
        state = resume.state
        snap = state.get("snapshot")
        if resume.position is None and not snap:
            if mode == "never":
                wm = await self._current_position()
                start = self._start_at(wm.position())
                return _Plan(start=start, announce=[Mark("stream_start", wm.position(), {})])
            return self._fresh_snapshot_plan(mode)
        files = await self._binlog_files()
        if snap and not snap.get("done"):
            wm_pos = position_from_json(snap["watermark"])
            assert isinstance(wm_pos, MySqlPosition)
            if wm_pos.file not in files:
                return self._purged(wm_pos, files, mode, "the interrupted snapshot's watermark")
            tasks = [SnapshotTask(TableId.parse(t), key_from_json(e["last_key"]) if e.get("last_key") else None)
                     for t, e in sorted((snap.get("tables") or {}).items()) if not e.get("done")]
            return _Plan(snapshot_tasks=tasks, watermark=wm_pos, stream=mode != "initial_only")
        if mode == "initial_only" and snap and snap.get("done"):
            return _Plan(stream=False)
        pos = resume.position
        if pos is None:
            pos = position_from_json(snap["watermark"] if snap else state["stream_start"])
        if not isinstance(pos, MySqlPosition):
            raise SourceFatal(f"the checkpoint position {pos} is not a MySQL binlog position: this state directory "
                              "belongs to another kind of source; point state.path at a fresh directory")
        if pos.file not in files:
            return self._purged(pos, files, mode, "the checkpoint")
        if self.flavor == "mysql" and self.gtid_mode and pos.gtid:
            check_not_purged("mysql", pos.gtid, v.get("gtid_purged", ""))
        return _Plan(start=self._start_at(pos))

    def _fresh_snapshot_plan(self, mode: str) -> _Plan:
        tasks = [SnapshotTask(t) for t in sorted(self.tables)]
        return _Plan(snapshot_tasks=tasks, fresh_snapshot=True, stream=mode != "initial_only")

    def _purged(self, pos: MySqlPosition, files: list[str], mode: str, what: str) -> _Plan:
        if mode == "when_needed":
            self.history = SchemaHistory()
            return self._fresh_snapshot_plan(mode)
        oldest = files[0] if files else "(none)"
        raise SourceFatal(
            f"binlog file {pos.file} needed to resume from {what} ({pos}, GTID {pos.gtid or 'n/a'}) is no longer on "
            f"the server (purged; the oldest binlog is {oldest}): the changes since then are lost to cdcd. "
            + RESNAPSHOT_FIX
        )

    async def _current_position(self) -> Watermark:
        conn = await self._control()
        async with conn.cursor(aiomysql.DictCursor) as cur:
            try:
                await cur.execute("SHOW BINARY LOG STATUS")
            except (aiomysql.ProgrammingError, aiomysql.OperationalError):
                await cur.execute("SHOW MASTER STATUS")
            wm = parse_binlog_status(await cur.fetchone())
        if self.flavor == "mariadb":
            rows = await self._query("SELECT BINLOG_GTID_POS(%s, %s)", (wm.file, wm.pos))
            wm.gtid = str(rows[0][0] or "")
        return wm

    # ------------------------------------------------------------ stream
    async def stream(self) -> AsyncIterator[Item]:
        plan = self._plan
        for item in plan.announce:
            yield item
        start = plan.start
        if plan.snapshot_tasks is not None:
            wm_pos: MySqlPosition | None = None
            async for item in self._snapshot(plan):
                wm_pos = item.position  # type: ignore[assignment]
                yield item
            assert wm_pos is not None
            start = self._start_at(wm_pos)
        if not plan.stream or start is None:
            return
        async for item in self._stream_binlog(start):
            yield item

    async def _snapshot(self, plan: _Plan) -> AsyncIterator[Item]:
        self._phase = "snapshot"
        snap = Snapshotter(self.settings, self.flavor, self.config.snapshot.parallelism,
                           self.config.snapshot.chunk_rows, self.history, tls=self.tls)
        self._snapshotter = snap
        try:
            wm = await snap.open()
            at = plan.watermark if plan.watermark is not None else wm.position()
            assert plan.snapshot_tasks is not None
            if plan.fresh_snapshot:
                yield Mark("snapshot_start", at, {"tables": [str(t.table) for t in plan.snapshot_tasks]})
                # a new snapshot supersedes whatever an abandoned earlier one landed (docs/landing-format.md)
                conn = await self._control()
                schemas = [(await load_table_schema(conn, t.table))[0] for t in plan.snapshot_tasks]
                for truncate in snapshot_truncates(schemas, at):
                    yield truncate
            async for chunk in snap.run(plan.snapshot_tasks, at):
                for item in chunk:
                    yield item
        finally:
            await snap.close()
        yield Mark("snapshot_done", at, {})

    async def _stream_binlog(self, start: StartPoint) -> AsyncIterator[Item]:
        self._phase = "streaming"
        backoff = 1.0
        loop = asyncio.get_running_loop()
        dbs = sorted({t.schema for t in self.tables})
        names = sorted({t.name for t in self.tables})
        while not self._closing:
            channel = Channel(loop, QUEUE_ITEMS)
            decoder = Decoder(self.flavor, self.tables, self.history, start.file, start.gtid)
            reader = BinlogReader(self._binlog_settings(), self.server_id, self.flavor, start, decoder, dbs, names,
                                  channel, tls=self.tls)
            self._reader, self._channel = reader, channel
            reader.start()
            try:
                while True:
                    chunk = await channel.get_many()
                    if not chunk:
                        return  # stopped
                    last = self._last_emitted
                    for item in chunk:
                        pos = item.position
                        assert isinstance(pos, MySqlPosition)
                        if last is not None and pos <= last:
                            continue  # already delivered before a reconnect
                        last = pos
                        self._last_emitted = pos
                        if type(item) is ChangeEvent and item.commit_ts is not None:
                            self._lag_ms = max(0.0, (time.time() - item.commit_ts.timestamp()) * 1000)
                        yield item
                    backoff = 1.0
            except SourceError as exc:
                if exc.fatal or self._closing:
                    raise
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self.config.runtime.reconnect_max_s)
                if self._last_emitted is not None:
                    start = self._start_at(self._last_emitted)
            finally:
                reader.stop()
                await loop.run_in_executor(None, reader.join, 5.0)
                await self._kill_dump(reader)

    async def _kill_dump(self, reader: BinlogReader) -> None:
        """End our dump thread on the server now: it would linger until its next write and pin the binlog
        file it reads (PURGE BINARY LOGS skips files in use)."""
        ids = [int(t) for t in reader.thread_ids]
        reader.thread_ids.clear()
        if not ids:
            return
        with contextlib.suppress(Exception):
            for tid in ids:
                with contextlib.suppress(aiomysql.Error):
                    await self._query(f"KILL CONNECTION {tid}")
            listed = ", ".join(map(str, ids))
            for _ in range(50):  # KILL only flags the thread; wait until it is gone
                rows = await self._query(f"SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE ID IN ({listed})")
                if not rows[0][0]:
                    break
                await asyncio.sleep(0.05)

    # ------------------------------------------------------------ commit
    def fold(self, state: dict[str, Any], items: Sequence[Item]) -> dict[str, Any]:
        return fold_state(state, items)

    async def confirm(self, position: Position, state: dict[str, Any]) -> None:
        """Nothing to tell the server: a binlog dump has no acknowledgements."""
        return None

    # ------------------------------------------------------------ checks, status, shutdown
    async def preflight(self) -> list[CheckResult]:
        try:
            v = await self._variables()
            grants = [str(r[0]) for r in await self._query("SHOW GRANTS FOR CURRENT_USER()")]
            tls_status = {str(k).lower(): str(v or "") for k, v in
                          await self._query("SHOW SESSION STATUS WHERE Variable_name IN ('Ssl_cipher', 'Ssl_version')")}
        except TlsError as exc:
            return [CheckResult("connect", False, exc.problem, exc.fix)]
        except SourceError as exc:
            return [CheckResult("connect", False, str(exc), "check source.host, source.port, user and password")]
        tables: dict[str, tuple[bool, tuple[str, ...]]] = {}
        for t in sorted(self.tables):
            exists = await self._query("SELECT 1 FROM information_schema.TABLES WHERE TABLE_SCHEMA = %s AND "
                                       "TABLE_NAME = %s", (t.schema, t.name))
            key = await self._query(
                "SELECT COLUMN_NAME FROM information_schema.KEY_COLUMN_USAGE WHERE TABLE_SCHEMA = %s AND "
                "TABLE_NAME = %s AND CONSTRAINT_NAME = 'PRIMARY' ORDER BY ORDINAL_POSITION", (t.schema, t.name))
            tables[str(t)] = (bool(exists), tuple(str(r[0]) for r in key))
        facts = ServerFacts(v.get("version", ""), v, grants, tables, self.server_id)
        return [CheckResult("connect", True, f"{self.settings['user']}@{self.settings['host']}:"
                                             f"{self.settings['port']}"),
                tls_check(self.tls, tls_status.get("ssl_version", ""), tls_status.get("ssl_cipher", "")),
                *evaluate(facts)]

    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = {"connected": self._connected, "phase": self._phase, "flavor": self.flavor}
        snap = self._snapshotter
        if snap is not None and snap.progress:
            out["snapshot"] = {t: {"rows": p.rows, "total_estimate": p.total_estimate, "done": p.done}
                               for t, p in snap.progress.items()}
        reader = self._reader
        if reader is not None:
            d = reader.decoder
            out["binlog_file"] = d.file
            out["binlog_pos"] = d.tx_start
            out["gtid"] = str(d.gtid)
            idle = self._channel is not None and len(self._channel) == 0
            out["lag_ms"] = 0.0 if idle and d.tx_start is None else self._lag_ms
            if d.last_ts is not None:
                out["last_event_ts"] = d.last_ts.astimezone(UTC).isoformat()
        return out

    def _stop_reader(self) -> BinlogReader | None:
        self._closing = True
        reader = self._reader
        if reader is not None:
            reader.stop()
        return reader

    async def close(self) -> None:
        reader = self._stop_reader()
        if reader is not None:
            await asyncio.get_running_loop().run_in_executor(None, reader.join, 5.0)
            await self._kill_dump(reader)
        if self._snapshotter is not None:
            await self._snapshotter.close()
        if self._ctl is not None:
            with contextlib.suppress(Exception):
                await self._ctl.ensure_closed()
            self._ctl = None
        self._connected = False

    def terminate(self) -> None:
        self._stop_reader()
        if self._snapshotter is not None:
            self._snapshotter.terminate()
        if self._ctl is not None:
            with contextlib.suppress(Exception):
                self._ctl.close()
            self._ctl = None
        self._connected = False
