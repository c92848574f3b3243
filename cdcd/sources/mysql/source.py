"""MySqlSource: the Source for ``source.kind`` "mariadb" and "mysql".

connect() validates the resume point (the binlog it needs is still on the
server, the server's identity and position epoch) and plans the run: a fresh
snapshot, the rest of an interrupted one, or streaming from the checkpoint.
The capture coordinator (``cdcd/capture/coordinator.py``) runs the plan with
this source's snapshot and binlog readers (``stream.py``). The durable source
state and ``fold`` live in ``state.py``; connection parameters and TLS in
``connection.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiomysql
import structlog

from cdcd.capture.contracts import CapturePlan, Replan
from cdcd.capture.coordinator import CaptureCoordinator
from cdcd.capture.incremental import SnapshotJob, check_table, parse_tables, plan_tables, stale_from_state
from cdcd.config import Config
from cdcd.errors import ConfigError, PositionLost, SourceError, SourceFatal
from cdcd.events import Item, Mark, MarkKind, TableId
from cdcd.positions import MySqlPosition, Position
from cdcd.runtime.interfaces import CheckResult, ResumePoint, Source
from cdcd.sources.mysql.binlog import Channel, StartPoint
from cdcd.sources.mysql.chunks import MyChunkReader
from cdcd.sources.mysql.connection import connect_params
from cdcd.sources.mysql.failures import TRANSIENT_CODES, code_of, query_error
from cdcd.sources.mysql.gtid import check_not_purged
from cdcd.sources.mysql.identity import (
    BinlogAt,
    BinlogFacts,
    PurgedFile,
    Verdict,
    judge,
    parse_event_gtid,
    same_server,
)
from cdcd.sources.mysql.plan import LOST_FIX, Step, after_verdict, first_step, resume_position
from cdcd.sources.mysql.preflight import ServerFacts, evaluate, tls_check, undecodable_settings
from cdcd.sources.mysql.schema import SchemaHistory, parse_ddl
from cdcd.sources.mysql.snapshot import SnapshotTask, Watermark, parse_binlog_status, quote_ident
from cdcd.sources.mysql.state import MySqlState, fold_state
from cdcd.sources.mysql.stream import MySqlSnapshot, MySqlStream
from cdcd.sources.mysql.tls import Tls, TlsError
from cdcd.sources.mysql.types import key_from_json
from cdcd.sources.mysql.watermarks import binlog_status_statement

log = structlog.get_logger("cdcd.source.mysql")

HISTORY_CHECK_S = 5.0  # while streaming, how often the server's binlog is checked against the last position

# ------------------------------------------------------------------ the source

def replaced_by(mark: Mark) -> tuple[TableId, str] | None:
    """A binlog DDL mark that drops a captured table or moves it away (``DROP TABLE``, ``CREATE OR REPLACE
    TABLE``, ``RENAME TABLE``): the table, and what happened. A table of that name created later streams from
    the binlog by name, but the mirror still holds the old table's rows: a re-snapshot repairs it."""
    if mark.kind is not MarkKind.DDL:
        return None
    table = TableId.parse(str(mark.detail["table"]))
    text = str(mark.detail.get("ddl") or "")
    head = " ".join(text.lower().split()[:4])
    if head.startswith(("drop temporary", "create temporary", "create or replace temporary")):
        return None
    for ddl in parse_ddl(text, table.schema):
        gone = ddl.kind == "drop" or ddl.kind == "rename" or \
            (ddl.kind == "create" and head.startswith("create or replace"))
        if gone and ddl.table == table:
            return table, f"the binlog has `{text[:200]}` at {mark.position}"
    return None


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
        self.conn = connect_params(config)  # address, credentials, TLS: shared with `cdcd check` and verify
        self.flavor = "mariadb" if src.kind == "mariadb" else "mysql"
        self.version = ""
        self.gtid_mode = False
        self.history = SchemaHistory()
        self._ctl: aiomysql.Connection | None = None
        self._coord = CaptureCoordinator(config, log, where=f"{config.source.kind} {self.conn.where}")
        # Incremental snapshots while streaming (cdcd/capture/incremental.py): the chunk reads.
        self._chunks = MyChunkReader(self)
        self._incr = self._coord.incremental
        self._incr.last = self._last_position
        self._incr.replaced = replaced_by
        self._stream = MySqlStream(self, self._coord, None)
        self._snapshot: MySqlSnapshot | None = None  # the last snapshot run, for /status
        self._epoch = 0  # the position epoch of the server streamed from (cdcd.positions.MySqlPosition)
        self._server: dict[str, Any] | None = None  # its identity, as recorded in the checkpoint
        self._server_due: dict[str, Any] | None = None  # an identity the checkpoint does not have yet
        self._last_was_commit = True  # the last emitted item was a commit Mark (not inside a transaction)
        self._resume_pos: MySqlPosition | None = None  # where the binlog stream (re)started from
        #: (epoch, file index, transaction start) of the transaction a checkpoint of an earlier version is inside:
        #: its seqs are byte offsets (decode.py, state.py "seqs")
        self._legacy_tx: tuple[int, int, int] | None = None

    # ------------------------------------------------------------ connect
    @property
    def tls(self) -> Tls:
        """The TLS policy of every connection (source.sslmode, source.sslrootcert)."""
        return self.conn.tls

    async def _control(self) -> aiomysql.Connection:
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

    async def _query(self, sql: str, args: Any = None, timeout: float | None = None) -> list[tuple[Any, ...]]:
        """One query on the control connection, bounded by ``timeout`` (default runtime.source_read_timeout_s).
        A failure drops the connection (the next query opens a new one) and raises a classified SourceError."""
        conn = await self._control()
        try:
            async with asyncio.timeout(timeout or self.config.runtime.source_read_timeout_s):
                async with conn.cursor() as cur:
                    await cur.execute(sql, args)
                    return list(await cur.fetchall())
        except Exception as exc:
            conn.close()
            self._ctl = None
            raise query_error(exc, f"query on {self._where}") from exc

    @property
    def _where(self) -> str:
        return f"{self.flavor} {self.conn.user}@{self.conn.where}"

    async def _variables(self) -> dict[str, str]:
        rows = await self._query(
            "SHOW GLOBAL VARIABLES WHERE Variable_name IN ('log_bin', 'binlog_format', 'binlog_row_image', "
            "'binlog_row_metadata', 'server_id', 'gtid_mode', 'gtid_binlog_pos', 'gtid_purged', 'version', "
            "'log_bin_compress', 'server_uuid', 'gtid_executed', 'binlog_transaction_compression', "
            "'binlog_row_value_options')")
        return {str(k).lower(): str(v) for k, v in rows}

    async def _server_facts(self, v: dict[str, str] | None = None) -> BinlogFacts:
        """The server's identity, GTID set and binlog files; a dead control connection is a transient error."""
        try:
            if v is None:
                v = await self._variables()
            logs = await self._query("SHOW BINARY LOGS")
        except (aiomysql.Error, OSError) as exc:
            await self._drop_control()
            raise SourceError(f"{self.conn.where}: reading the server's identity "
                              f"failed: {exc!r}; reconnecting") from exc
        flavor = "mariadb" if "mariadb" in v.get("version", "").lower() else "mysql"
        return BinlogFacts(
            flavor=flavor, server_id=int(v.get("server_id") or 0), uuid=v.get("server_uuid", ""),
            gtid=v.get("gtid_binlog_pos" if flavor == "mariadb" else "gtid_executed", ""),
            gtid_mode=v.get("gtid_mode", "OFF").upper() == "ON",
            binlogs=[(str(r[0]), int(r[1])) for r in logs])

    async def _facts_at(self, facts: BinlogFacts, pos: MySqlPosition) -> BinlogFacts:
        """``facts`` with what the server's binlog holds at ``pos``'s file and offset (``identity.BinlogAt``), when
        ``pos`` is a place in this server's binlog that is still on it: the check that the binlog is still the
        history ``pos`` was read from (``identity.check_transaction``)."""
        if not pos.file or pos.epoch < self._epoch or pos.file not in dict(facts.binlogs) or \
                not self._gtid_usable(pos.gtid):
            return facts  # judged by file and GTID set alone (identity.judge)
        boundary, event_gtid = True, None
        try:
            events = await self._query("SHOW BINLOG EVENTS IN %s FROM %s LIMIT 1", (pos.file, pos.pos))
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
            rows = await self._query("SELECT BINLOG_GTID_POS(%s, %s)", (pos.file, pos.pos))
            if rows[0][0] is None:
                boundary = False  # MariaDB: NULL where no event starts
            else:
                before = str(rows[0][0])
        return dataclasses.replace(facts, at=BinlogAt(pos.file, pos.pos, boundary, before, event_gtid))

    async def _drop_control(self) -> None:
        if self._ctl is not None:
            with contextlib.suppress(Exception):
                self._ctl.close()
            self._ctl = None

    async def connect(self, resume: ResumePoint) -> None:
        try:
            plan = await self._connect(resume)
        except Exception as exc:
            raise query_error(exc, f"connecting to {self._where}") from exc
        snapshot = None
        if plan.snapshot_tasks is not None:
            snapshot = MySqlSnapshot(self, plan.snapshot_tasks, plan.watermark, plan.fresh_snapshot)
            self._snapshot = snapshot
        self._stream.start = plan.start
        if plan.stream:
            self._incr.reader = self._chunks
            fresh = plan.fresh_snapshot or not resume.state or \
                any(isinstance(m, Mark) and m.kind is MarkKind.STREAM_START for m in plan.announce)
            at = self._resume_pos or (resume.position if isinstance(resume.position, MySqlPosition) else None) \
                or MySqlPosition.epoch_start(self._epoch, "")
            marks, jobs = plan_tables(resume.state or {}, sorted(self.tables), fresh, at, log)
            # the checkpoint's replaced tables stay listed (a fresh snapshot reads every table: none stands)
            stale = MySqlState.parse(resume.state or {}).stale
            self._incr.resume(jobs, None if fresh else stale_from_state(stale, sorted(self.tables)))
            if snapshot is not None and snapshot.fresh:
                snapshot.then = marks  # after the snapshot's start, at its watermark
            else:
                plan.announce.extend(marks)
        self._coord.start(CapturePlan(announce=plan.announce, snapshot=snapshot,
                                      stream=self._stream if plan.stream else None))
        self._coord.connected = True

    async def _connect(self, resume: ResumePoint) -> _Plan:
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
        return await self._make_plan(resume, v)

    def _gtid_usable(self, gtid: str) -> bool:
        return bool(gtid) and (self.flavor == "mariadb" or self.gtid_mode)

    def _start_at(self, pos: MySqlPosition) -> StartPoint:
        if not pos.file or pos.epoch < self._epoch:
            # a position of an earlier server (before a failover), or an epoch's start: its GTID set locates it
            return StartPoint("", 0, pos.gtid, True)
        return StartPoint(pos.file, pos.pos, pos.gtid, self._gtid_usable(pos.gtid))

    def _stamp(self, pos: MySqlPosition) -> MySqlPosition:
        """A position read from the server now (a watermark) in the current epoch."""
        return dataclasses.replace(pos, epoch=self._epoch)

    async def _make_plan(self, resume: ResumePoint, v: dict[str, str]) -> _Plan:
        """Gather the facts, let ``plan.py`` decide (pure), carry the decision out."""
        mode = self.config.snapshot.mode
        state = MySqlState.parse(resume.state)
        facts = await self._server_facts(v)
        recorded: dict[str, Any] | None = self._server or state.server
        ckpt_epoch = resume.position.epoch if isinstance(resume.position, MySqlPosition) else 0
        self._epoch = max(self._epoch, int((recorded or {}).get("epoch", 0)), ckpt_epoch)
        self._server_due = None
        step = first_step(state, resume.position, mode)
        if step is Step.STREAM_FROM_NOW:
            self._adopt(facts, None)
            wm = self._stamp((await self._current_position()).position())
            return _Plan(start=self._start_at(wm), announce=[Mark(MarkKind.STREAM_START, wm, {}),
                                                             *self._server_marks(wm)])
        if step is Step.FRESH_SNAPSHOT:
            self._adopt(facts, None)
            return self._fresh_snapshot_plan(mode)
        if step is Step.RESUME_SNAPSHOT:
            assert state.snapshot is not None
            wm_pos = state.snapshot.watermark
            what = "the interrupted snapshot's watermark"
            verdict = self._judged(await self._facts_at(facts, wm_pos), recorded, wm_pos, what, mode)
            if verdict is Step.RESNAPSHOT:
                return self._resnapshot_plan(mode, facts)
            assert isinstance(verdict, Verdict)
            self._adopt(facts, verdict)
            tasks = [SnapshotTask(TableId.parse(t), key_from_json(e.last_key) if e.last_key else None)
                     for t, e in sorted(state.snapshot.tables.items()) if not e.done]
            return _Plan(snapshot_tasks=tasks, watermark=wm_pos, stream=mode != "initial_only",
                         announce=self._server_marks(self._mark_at(wm_pos)))
        if step is Step.DONE:
            return _Plan(stream=False)
        pos = resume_position(state, resume.position)
        last = self._coord.last
        if isinstance(last, MySqlPosition) and last > pos:
            # a reconnect of this process: the runtime holds everything emitted so far, resume after it
            pos = last
            self._last_was_commit = self._last_is_commit()
        else:
            self._last_was_commit = not state.inside_tx
            if state.inside_tx and not state.content_seqs:
                self._legacy_tx = (pos.epoch, pos.file_index, pos.pos)
        verdict = self._judged(await self._facts_at(facts, pos), recorded, pos, "the checkpoint", mode)
        if verdict is Step.RESNAPSHOT:
            return self._resnapshot_plan(mode, facts)
        assert isinstance(verdict, Verdict)
        if self.flavor == "mysql" and self.gtid_mode and pos.gtid:
            check_not_purged("mysql", pos.gtid, v.get("gtid_purged", ""))
        self._adopt(facts, verdict)
        self._arm_resend_skip(pos)
        self._resume_pos = pos
        return _Plan(start=self._start_at(pos), announce=self._server_marks(self._mark_at(pos)))

    def _judged(self, facts: BinlogFacts, recorded: dict[str, Any] | None, pos: MySqlPosition, what: str,
                mode: str) -> Verdict | Step:
        """``judge`` and ``after_verdict``: a verdict to go on with, or ``Step.RESNAPSHOT`` (fatal otherwise)."""
        verdict = self._judge(facts, recorded, pos, what)
        decided = after_verdict(verdict, mode, pos, facts, what)
        if decided is Step.RESNAPSHOT and isinstance(verdict, str):
            log.warning("the checkpoint's binlog position is lost; snapshot.mode = when_needed takes a new snapshot",
                        problem=verdict)
        return decided

    def _judge(self, facts: BinlogFacts, recorded: dict[str, Any] | None, pos: MySqlPosition,
               what: str) -> Verdict | str | None:
        """judge(), with its refusals as values: None = the binlog file was purged, str = the position is lost."""
        try:
            return judge(facts, recorded, self._epoch, pos, what)
        except PurgedFile:
            return None
        except PositionLost as exc:
            return str(exc)

    def _adopt(self, facts: BinlogFacts, verdict: Verdict | None) -> None:
        """From now on positions belong to this server, in the verdict's epoch; record that in the checkpoint."""
        if verdict is not None and verdict.switched:
            log.warning("the source server changed; following it by GTID in a new position epoch",
                        server=facts.describe(), epoch=verdict.epoch)
            self._epoch = verdict.epoch
        identity = facts.identity(self._epoch)
        if identity != self._server:
            self._server_due = identity
        self._server = identity

    def _server_marks(self, at: MySqlPosition) -> list[Item]:
        """The Mark that records the server identity in the checkpoint, when it changed."""
        if self._server_due is None:
            return []
        identity, self._server_due = self._server_due, None
        return [Mark(MarkKind.IDENTITY, at, identity)]

    def _mark_at(self, pos: MySqlPosition) -> MySqlPosition:
        """Where the server Mark sits: ``pos`` itself, or the start of the new epoch after a switch."""
        if pos.epoch < self._epoch:
            return MySqlPosition.epoch_start(self._epoch, pos.gtid)
        return pos

    def _arm_resend_skip(self, pos: MySqlPosition) -> None:
        """Resuming by GTID on another server re-sends the transaction ``pos`` is inside of: skip its items up to
        ``pos`` (they carry the GTID set before it and the same seq numbers, which the binlog alone defines)."""
        partial = pos.epoch < self._epoch and pos.file and not self._last_was_commit and pos.seq > 0
        if partial and self._legacy_tx == (pos.epoch, pos.file_index, pos.pos):
            # a checkpoint of an earlier version numbered the transaction by byte offsets on the old server, which
            # the new server's copy does not share: skipping by them could lose rows. The whole transaction comes
            # again (the mirror converges; the change-log holds its delivered part twice).
            log.warning("following a failover from inside a transaction that a checkpoint of an earlier cdcd "
                        "numbered by byte offsets: its delivered part is delivered again", position=str(pos))
            partial = False
        self._stream.resend_skip = (pos.gtid, pos.seq) if partial else None

    def _last_is_commit(self) -> bool:
        """Whether the last item delivered in this process was a commit Mark (outside a transaction)."""
        item = self._coord.last_item
        return type(item) is Mark and item.kind == MarkKind.COMMIT

    def _resnapshot_plan(self, mode: str, facts: BinlogFacts) -> _Plan:
        """A new snapshot replacing a lost position: a new epoch on this server, so its rows and the changes after
        it sort above everything landed before."""
        self.history = SchemaHistory()
        self._epoch += 1
        self._adopt(facts, None)
        return self._fresh_snapshot_plan(mode)

    def _fresh_snapshot_plan(self, mode: str) -> _Plan:
        tasks = [SnapshotTask(t) for t in sorted(self.tables)]
        return _Plan(snapshot_tasks=tasks, fresh_snapshot=True, stream=mode != "initial_only")

    async def _reconnect_point(self, fallback: StartPoint) -> tuple[StartPoint, list[Item]]:
        """Before a reconnect of the binlog stream: check that the server (maybe another one after a failover)
        still has the last delivered position; where to start and the Marks to emit first."""
        pos = self._last_position()
        if pos is None:
            return fallback, []
        if self._coord.last_item is not None:
            self._last_was_commit = self._last_is_commit()
        facts = await self._facts_at(await self._server_facts(), pos)
        verdict = self._judge(facts, self._server, pos, "the last delivered transaction")
        if verdict is None or isinstance(verdict, str):
            raise self._lost_error(verdict or (f"binlog file {pos.file} of the last delivered transaction ({pos}) is "
                                               f"no longer on the server ({facts.describe()}): it was purged"))
        self._adopt(facts, verdict)
        self._arm_resend_skip(pos)
        return self._start_at(pos), self._server_marks(self._mark_at(pos))

    def _last_position(self) -> MySqlPosition | None:
        """The last delivered position, else where the binlog stream started."""
        last = self._coord.last
        return last if isinstance(last, MySqlPosition) else self._resume_pos

    def _lost_error(self, problem: str) -> SourceError:
        if self.config.snapshot.mode == "when_needed":
            return Replan(f"{problem}; snapshot.mode = when_needed re-plans (a new snapshot)")
        return PositionLost(f"{problem}. {LOST_FIX}")

    async def _watch_history(self, channel: Channel) -> None:
        """While streaming, check every HISTORY_CHECK_S that the server's binlog still holds the last delivered
        position. A dump does not notice RESET MASTER (it waits at its old offset, and new transactions go to a
        new file 1 it never reads): without this, nothing would land and nothing would be logged."""
        while True:
            await asyncio.sleep(HISTORY_CHECK_S)
            pos = self._last_position()
            if pos is None:
                continue
            try:
                facts = await self._server_facts()
                if same_server(self._server, facts):
                    facts = await self._facts_at(facts, pos)
            except SourceError as exc:
                if exc.fatal:
                    channel.finish(exc)
                    return
                continue  # the control connection is down: the stream notices the outage itself
            if not same_server(self._server, facts):
                channel.finish(SourceError(f"the server behind {self.conn.where} is now "
                                           f"{facts.describe()}; reconnecting to follow it"))
                return
            try:
                judge(facts, self._server, self._epoch, pos, "the last delivered transaction")
            except PurgedFile:
                continue  # a file behind the one being read was purged: only a reconnect needs it
            except PositionLost as exc:
                channel.finish(self._lost_error(str(exc)))
                return

    async def _current_position(self) -> Watermark:
        conn = await self._control()
        async with conn.cursor(aiomysql.DictCursor) as cur:
            await cur.execute(binlog_status_statement(self.flavor, self.version))
            wm = parse_binlog_status(await cur.fetchone())
        if self.flavor == "mariadb":
            rows = await self._query("SELECT BINLOG_GTID_POS(%s, %s)", (wm.file, wm.pos))
            wm.gtid = str(rows[0][0] or "")
        return wm

    # ------------------------------------------------------------ stream: the coordinator runs the plan
    def stream(self) -> AsyncIterator[Item]:
        return self._coord.items()

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
        return [CheckResult("connect", True, f"{self.conn.user}@{self.conn.where}"),
                tls_check(self.tls, tls_status.get("ssl_version", ""), tls_status.get("ssl_cipher", "")),
                *evaluate(facts)]

    # ------------------------------------------------------------ operator requests (issue 13)

    def request_snapshot(self, table: str, where: str | None = None) -> None:
        if self.config.snapshot.mode == "initial_only":
            raise ConfigError("snapshot request: snapshot.mode = \"initial_only\" has no stream to snapshot into")
        self._check_incremental("snapshot request")
        self._incr.request(check_table(table, sorted(self.tables)), where)

    async def check_where(self, table: str, where: str) -> None:
        t = check_table(table, sorted(self.tables))
        conn = await self.conn.open()  # not the control connection: another task may be using it
        try:
            async with asyncio.timeout(self.config.runtime.source_read_timeout_s), conn.cursor() as cur:
                await cur.execute(f"EXPLAIN SELECT 1 FROM {quote_ident(t.schema)}.{quote_ident(t.name)} "
                                  f"WHERE ({where})")
        except Exception as exc:
            code = code_of(exc)
            if code is not None and code not in TRANSIENT_CODES and not 2000 <= code < 3000:  # the server's answer
                raise ConfigError(f"snapshot request: the condition {where!r} does not work on {t}: {exc.args[1]} "
                                  f"(the server's words on {self._where}, error {code}); correct --where") from None
            raise query_error(exc, f"checking a snapshot condition on {self._where}") from exc
        finally:
            conn.close()

    def reload_tables(self, tables: list[str]) -> asyncio.Future[None]:
        new = parse_tables(tables)
        if self.config.snapshot.mode == "initial_only":
            raise ConfigError("table reload: snapshot.mode = \"initial_only\" captures no stream")
        if any(t not in self.tables for t in new):
            self._check_incremental("table reload (an added table is snapshotted incrementally)")
        return self._incr.submit(lambda: self._apply_tables(new))

    def _check_incremental(self, what: str) -> None:
        """Incremental snapshots on MySQL fence their low watermark with GTIDs (cdcd/sources/mysql/chunks.py)."""
        if self.flavor == "mysql" and not self.gtid_mode:
            raise ConfigError(f"{what}: incremental snapshots on MySQL need GTIDs (gtid_mode = ON and "
                              "enforce_gtid_consistency = ON, see docs/mysql.md); without them take a new snapshot: "
                              "stop cdcd, move state.path aside and start again (docs/mysql.md, \"Limits\")")

    async def _apply_tables(self, new: list[TableId]) -> None:
        """A reload (in the chunk task, between chunks): the binlog reader's table filter is fixed when it
        connects, so the stream is read again from the last delivered position with the new filter (the skip rule
        drops what it re-sends); only then are the added tables snapshotted incrementally, so every change after a
        chunk's low watermark is streamed. Removed tables stop being captured; their snapshots are cancelled."""
        added = [t for t in new if t not in self.tables]
        removed = [t for t in sorted(self.tables) if t not in new]
        if not added and not removed:
            return
        for t in added:
            found = await self._query("SELECT 1 FROM information_schema.TABLES WHERE TABLE_SCHEMA = %s AND "
                                      "TABLE_NAME = %s", (t.schema, t.name))
            if not found:
                raise SourceError(f"table reload: table {t} does not exist on {self._where}; create it, or correct "
                                  "source.tables and reload again")
        keyless = [str(t) for t in added if not await self._query(
            # KEY_COLUMN_USAGE as the snapshot and `cdcd check` read it: TABLE_CONSTRAINTS shows MariaDB's
            # least-privileged cdc user (SELECT, no table-level grants) nothing
            "SELECT 1 FROM information_schema.KEY_COLUMN_USAGE WHERE TABLE_SCHEMA = %s AND TABLE_NAME = %s "
            "AND CONSTRAINT_NAME = 'PRIMARY'", (t.schema, t.name))]
        if keyless:  # its incremental snapshot reads in primary-key order: refused before anything changes
            raise SourceError(f"table reload: {', '.join(keyless)} on {self._where} has no primary key, so it cannot "
                              "be snapshotted while streaming; not added. Fix: ALTER TABLE ... ADD PRIMARY KEY (...) "
                              "and reload again, or leave it out of source.tables")
        before = self.tables
        self.tables = set(new)  # the next binlog connection's filter (the running one keeps its own set)
        try:
            await self._stream.restream("source.tables reloaded")
        except BaseException:
            self.tables = before
            raise
        self._incr.dropped = (self._incr.dropped | set(removed)) - set(added)
        self._incr.cancel(set(removed), "the table was removed from source.tables")
        at = self._last_position()
        if at is None:
            at = MySqlPosition.epoch_start(self._epoch, "")
        for t in added:
            self._incr.emit(Mark(MarkKind.INCREMENTAL_START, at, {"table": str(t), "where": None}))
            self._incr.jobs.append(SnapshotJob(t, None, started=True))
        self._incr.emit(Mark(MarkKind.TABLES, at, {"tables": [str(t) for t in sorted(self.tables)]}))
        log.info("captured tables reloaded", added=[str(t) for t in added], removed=[str(t) for t in removed])

    def snapshot_progress(self) -> list[dict[str, Any]]:
        return self._incr.progress()

    def status(self) -> dict[str, Any]:
        coord = self._coord
        out: dict[str, Any] = {"connected": coord.connected, "phase": coord.phase, "flavor": self.flavor,
                               "reconnects": coord.reconnects, "last_error": coord.last_error,
                               "position_epoch": self._epoch, "tables": [str(t) for t in sorted(self.tables)]}
        if self._server is not None:
            out["server_id"] = self._server["server_id"]
        snap = self._snapshot.snapshotter if self._snapshot is not None else None
        if snap is not None and snap.progress:
            out["snapshot"] = {t: {"rows": p.rows, "total_estimate": p.total_estimate, "done": p.done}
                               for t, p in snap.progress.items()}
        out.update(self._stream.status())
        out.update(self._incr.status())
        return out

    async def close(self) -> None:
        self._coord.close()
        await self._chunks.close()
        reader = self._stream.stop()
        if reader is not None:
            await asyncio.get_running_loop().run_in_executor(None, reader.join, 5.0)
            await self._stream.kill_dump(reader)
        if self._snapshot is not None:
            await self._snapshot.close()
        if self._ctl is not None:
            with contextlib.suppress(Exception):
                await self._ctl.ensure_closed()
            self._ctl = None

    def terminate(self) -> None:
        self._coord.close()
        self._chunks.terminate()
        self._stream.stop()
        if self._snapshot is not None:
            self._snapshot.terminate()
        if self._ctl is not None:
            with contextlib.suppress(Exception):
                self._ctl.close()
            self._ctl = None
