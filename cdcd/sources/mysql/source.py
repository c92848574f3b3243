"""MySqlSource: the Source for ``source.kind`` "mariadb" and "mysql".

connect() validates the resume point (the binlog it needs is still on the
server, the server's identity and position epoch) and plans the run: a fresh
snapshot, the rest of an interrupted one, or streaming from the checkpoint.
The capture coordinator (``cdcd/capture/coordinator.py``) runs the plan with
this source's snapshot and binlog readers (``stream.py``). The control connection, the server's facts, the
position epoch and the recorded identity, which the planner and the readers share, are ``server.py``'s. The
durable source state and ``fold`` live in ``state.py``; connection parameters and TLS in ``connection.py``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import structlog

from cdcd.capture.contracts import CapturePlan
from cdcd.capture.coordinator import CaptureCoordinator
from cdcd.capture.incremental import SnapshotJob, check_table, parse_tables, plan_tables, stale_from_state
from cdcd.capture.recovery import Recovering
from cdcd.capture.retention import Retention, RetentionWatch
from cdcd.config import Config
from cdcd.errors import ConfigError, SourceError
from cdcd.events import Item, Mark, MarkKind, TableId
from cdcd.landing.keyrange import key_kind, parse_where
from cdcd.positions import MySqlPosition, Position
from cdcd.runtime.interfaces import CheckResult, ResumePoint, Source
from cdcd.sources.mysql.binlog import StartPoint
from cdcd.sources.mysql.chunks import MyChunkReader
from cdcd.sources.mysql.connection import connect_params
from cdcd.sources.mysql.ddl import parse_ddl
from cdcd.sources.mysql.expiry import EXPIRY_VARIABLES, BinlogExpiry, expiry_check
from cdcd.sources.mysql.failures import TRANSIENT_CODES, code_of, raise_query_error
from cdcd.sources.mysql.identity import (
    BinlogFacts,
    Verdict,
)
from cdcd.sources.mysql.plan import Step, after_verdict, first_step, resume_position
from cdcd.sources.mysql.preflight import ServerFacts, evaluate, tls_check
from cdcd.sources.mysql.queries import PRIMARY_KEY_SQL, quote_ident
from cdcd.sources.mysql.recover import MyRecoveries
from cdcd.sources.mysql.schema import SchemaHistory
from cdcd.sources.mysql.server import MySqlServer
from cdcd.sources.mysql.snapshot import SnapshotTask
from cdcd.sources.mysql.state import MySqlState, fold_state
from cdcd.sources.mysql.stream import MySqlSnapshot, MySqlStream
from cdcd.sources.mysql.tls import TlsError
from cdcd.sources.mysql.types import key_from_json

log = structlog.get_logger("cdcd.source.mysql")

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


class MySqlSource(Recovering, Source):
    """Binlog streaming and snapshots for MariaDB and MySQL."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.kind = config.source.kind
        self.tables = set(config.source.table_ids)
        self.conn = connect_params(config)  # address, credentials, TLS: shared with `cdcd check` and verify
        #: the control connection, the server's facts, the epoch and identity: shared with the readers
        self.server = MySqlServer(config, self.conn)
        self._coord = CaptureCoordinator(config, log, where=f"{config.source.kind} {self.conn.where}")
        self._stream = MySqlStream(self.server, self._coord, self.tables, None)
        # Incremental snapshots while streaming (cdcd/capture/incremental/): the chunk reads.
        self._chunks = MyChunkReader(self.server, self._stream, self._coord)
        self._incr = self._coord.incremental
        self._incr.last = self._stream.last_position
        self._incr.replaced = self._judge_mark
        self._snapshot: MySqlSnapshot | None = None  # the last snapshot run, for /status
        self._resumed_at: MySqlPosition | None = None  # the checkpoint's position: marks up to it are not new
        self._recoveries: MyRecoveries = MyRecoveries(config, self.server)  # on_position_lost, `cdcd recover`
        # the checkpoint's binlog file against the server's expiry while streaming: warnings, incremental pauses
        self._expiry = BinlogExpiry(self.conn, config.source.retention, self._stream.newest_event)
        if config.snapshot.mode != "initial_only":  # no binlog position to keep
            self._coord.retention = RetentionWatch(config.source.retention, self._expiry_probe, self._incr.gate,
                                                   log, config.source.connect_timeout_s
                                                   + config.runtime.source_read_timeout_s)

    # ------------------------------------------------------------ connect
    async def connect(self, resume: ResumePoint) -> None:
        self._resumed_at = resume.position if isinstance(resume.position, MySqlPosition) else None
        try:
            plan = await self._connect(resume)
        except Exception as exc:
            raise_query_error(exc, f"connecting to {self.server.where}")
        snapshot = None
        if plan.snapshot_tasks is not None:
            snapshot = MySqlSnapshot(self.server, plan.snapshot_tasks, plan.watermark, plan.fresh_snapshot)
            self._snapshot = snapshot
        self._stream.start = plan.start
        if plan.stream:
            self._incr.reader = self._chunks
            fresh = plan.fresh_snapshot or not resume.state or \
                any(isinstance(m, Mark) and m.kind is MarkKind.STREAM_START for m in plan.announce)
            at = self._recoveries.at or self._stream.resume_pos or \
                (resume.position if isinstance(resume.position, MySqlPosition) else None) \
                or MySqlPosition.epoch_start(self.server.epoch, "")
            marks, jobs = plan_tables(resume.state or {}, sorted(self.tables), fresh, at, log)
            # the checkpoint's replaced tables stay listed (a fresh snapshot reads every table: none stands)
            stale = MySqlState.parse(resume.state or {}).stale
            self._incr.resume(jobs, None if fresh else stale_from_state(stale, sorted(self.tables)))
            self._recoveries.queue(self._incr)  # a recovery re-reads every table
            if snapshot is not None and snapshot.fresh:
                snapshot.then = marks  # after the snapshot's start, at its watermark
            else:
                plan.announce.extend(marks)
        self._coord.start(CapturePlan(announce=plan.announce, snapshot=snapshot,
                                      stream=self._stream if plan.stream else None))
        self._coord.connected = True

    async def _connect(self, resume: ResumePoint) -> _Plan:
        server = self.server
        v = await server.variables()
        server.learn(v)
        server.history = SchemaHistory.from_json(resume.state.get("schemas") or {})
        return await self._make_plan(resume, v)

    async def _make_plan(self, resume: ResumePoint, v: dict[str, str]) -> _Plan:
        """Gather the facts, let ``plan.py`` decide (pure), carry the decision out."""
        mode = self.config.snapshot.mode
        server, stream = self.server, self._stream
        state = MySqlState.parse(resume.state)
        facts = await server.facts(v)
        recorded: dict[str, Any] | None = server.identity or state.server
        ckpt_epoch = resume.position.epoch if isinstance(resume.position, MySqlPosition) else 0
        server.epoch = max(server.epoch, int((recorded or {}).get("epoch", 0)), ckpt_epoch)
        server.forget_due()
        step = first_step(state, resume.position, mode)
        self._recoveries.check_step(step, resume.state or {})
        if step is Step.STREAM_FROM_NOW:
            server.adopt(facts, None)
            wm = server.stamp((await server.current_position()).position())
            return _Plan(start=server.start_at(wm), announce=[Mark(MarkKind.STREAM_START, wm, {}),
                                                              *server.marks(wm)])
        if step is Step.FRESH_SNAPSHOT:
            server.adopt(facts, None)
            return self._fresh_snapshot_plan(mode)
        if step is Step.RESUME_SNAPSHOT:
            assert state.snapshot is not None
            wm_pos = state.snapshot.watermark
            what = "the interrupted snapshot's watermark"
            verdict = self._judged(await server.facts_at(facts, wm_pos), recorded, wm_pos, what, mode)
            if verdict is Step.RESNAPSHOT:
                return self._resnapshot_plan(mode, facts)
            if verdict is Step.RECOVER:
                return await self._recover_plan(facts, resume.position)
            self._recoveries.not_lost()
            assert isinstance(verdict, Verdict)
            server.adopt(facts, verdict)
            tasks = [SnapshotTask(TableId.parse(t), key_from_json(e.last_key) if e.last_key else None)
                     for t, e in sorted(state.snapshot.tables.items()) if not e.done]
            return _Plan(snapshot_tasks=tasks, watermark=wm_pos, stream=mode != "initial_only",
                         announce=server.marks(server.mark_at(wm_pos)))
        if step is Step.DONE:
            return _Plan(stream=False)
        pos = resume_position(state, resume.position)
        last = self._coord.last
        if isinstance(last, MySqlPosition) and last > pos:
            # a reconnect of this process: the runtime holds everything emitted so far, resume after it
            pos = last
            stream.last_was_commit = stream.last_is_commit()
        else:
            stream.last_was_commit = not state.inside_tx
            if state.inside_tx and not state.content_seqs:
                stream.legacy_tx = (pos.epoch, pos.file_index, pos.pos)
        verdict = self._judged(await server.facts_at(facts, pos), recorded, pos, "the checkpoint", mode)
        if verdict is Step.RESNAPSHOT:
            return self._resnapshot_plan(mode, facts)
        if verdict is Step.RECOVER:
            return await self._recover_plan(facts, pos)
        assert isinstance(verdict, Verdict)
        if server.flavor == "mysql" and server.gtid_mode and pos.gtid and \
                self._recoveries.gtids_purged(pos.gtid, v.get("gtid_purged", "")):
            return await self._recover_plan(facts, pos)
        self._recoveries.not_lost()
        server.adopt(facts, verdict)
        stream.resume_from(pos)
        return _Plan(start=server.start_at(pos), announce=server.marks(server.mark_at(pos)))

    def _judged(self, facts: BinlogFacts, recorded: dict[str, Any] | None, pos: MySqlPosition, what: str,
                mode: str) -> Verdict | Step:
        """``judge`` and ``after_verdict``: a verdict to go on with, or ``Step.RESNAPSHOT`` (fatal otherwise)."""
        verdict = self.server.judge(facts, recorded, pos, what)
        decided = after_verdict(verdict, mode, pos, facts, what, self._recoveries.allowed)
        self._recoveries.judged(decided, verdict, pos, facts, what)
        if decided is Step.RESNAPSHOT and isinstance(verdict, str):
            log.warning("the checkpoint's binlog position is lost; snapshot.mode = when_needed takes a new snapshot",
                        problem=verdict)
        return decided

    def _resnapshot_plan(self, mode: str, facts: BinlogFacts) -> _Plan:
        """A new snapshot replacing a lost position: a new epoch on this server, so its rows and the changes after
        it sort above everything landed before."""
        # the columns keep their ids across the new snapshot (a consumer matches them by id)
        self.server.history = self.server.history.successor()
        self.server.epoch += 1
        self.server.adopt(facts, None)
        return self._fresh_snapshot_plan(mode)

    async def _recover_plan(self, facts: BinlogFacts, before: Position | None) -> _Plan:
        """Stream from the server's current position in a new epoch, after the recovery's marks."""
        at, announce = await self._recoveries.take(facts, sorted(self.tables), before, log)
        return _Plan(start=self.server.start_at(at), announce=announce)

    def _fresh_snapshot_plan(self, mode: str) -> _Plan:
        tasks = [SnapshotTask(t) for t in sorted(self.tables)]
        return _Plan(snapshot_tasks=tasks, fresh_snapshot=True, stream=mode != "initial_only")

    # ------------------------------------------------------------ stream: the coordinator runs the plan
    def stream(self) -> AsyncIterator[Item]:
        return self._coord.items()

    # ------------------------------------------------------------ commit
    def fold(self, state: dict[str, Any], items: Sequence[Item]) -> dict[str, Any]:
        return fold_state(state, items)

    async def confirm(self, position: Position, state: dict[str, Any]) -> None:
        """Nothing to tell the server (a binlog dump has no acknowledgements); the expiry watch follows the file."""
        if isinstance(position, MySqlPosition) and position.file:
            self._expiry.checkpoint_file = position.file

    async def _expiry_probe(self) -> Retention:
        reader = self._stream.reader
        if self._expiry.checkpoint_file is None:  # nothing checkpointed in this process yet: where the stream began
            resumed = self._resumed_at or self._stream.resume_pos
            start = self._stream.start
            self._expiry.checkpoint_file = (resumed.file if resumed is not None and resumed.file else None) or \
                (start.file if start is not None and start.file else None) or \
                (reader.decoder.file if reader is not None and reader.decoder.file else None)
        return await self._expiry.probe()

    # ------------------------------------------------------------ checks, status, shutdown
    async def preflight(self) -> list[CheckResult]:
        query = self.server.query
        try:
            v = await self.server.variables()
            grants = [str(r[0]) for r in await query("SHOW GRANTS FOR CURRENT_USER()")]
            tls_status = {str(k).lower(): str(v or "") for k, v in
                          await query("SHOW SESSION STATUS WHERE Variable_name IN ('Ssl_cipher', 'Ssl_version')")}
        except TlsError as exc:
            return [CheckResult("connect", False, exc.problem, exc.fix)]
        except SourceError as exc:
            return [CheckResult("connect", False, str(exc), "check source.host, source.port, user and password")]
        tables: dict[str, tuple[bool, tuple[str, ...]]] = {}
        for t in sorted(self.tables):
            tables[str(t)] = (await self.server.exists(t), tuple(k for k, _ in await self.server.primary_key(t)))
        facts = ServerFacts(v.get("version", ""), v, grants, tables, self.server.server_id)
        expiry = {str(k).lower(): str(v) for k, v in await query(EXPIRY_VARIABLES)}
        return [CheckResult("connect", True, f"{self.conn.user}@{self.conn.where}"),
                tls_check(self.conn.tls, tls_status.get("ssl_version", ""), tls_status.get("ssl_cipher", "")),
                *evaluate(facts), expiry_check(expiry)]

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
                # the key and its type: the condition must be one the merge can record as a key range
                await cur.execute(PRIMARY_KEY_SQL, (t.schema, t.name))
                key = [(str(r[0]), str(r[1])) for r in await cur.fetchall()]
        except Exception as exc:
            code = code_of(exc)
            if code is not None and code not in TRANSIENT_CODES and not 2000 <= code < 3000:  # the server's answer
                raise ConfigError(f"snapshot request: the condition {where!r} does not work on {t}: {exc.args[1]} "
                                  f"(the server's words on {self.server.where}, error {code}); "
                                  "correct --where") from None
            raise_query_error(exc, f"checking a snapshot condition on {self.server.where}")
        finally:
            conn.close()
        parse_where(where, [k for k, _ in key], str(t), key_kind(key[0][1]) if len(key) == 1 else "other")

    def reload_tables(self, tables: list[str]) -> asyncio.Future[None]:
        new = parse_tables(tables)
        if self.config.snapshot.mode == "initial_only":
            raise ConfigError("table reload: snapshot.mode = \"initial_only\" captures no stream")
        if any(t not in self.tables for t in new):
            self._check_incremental("table reload (an added table is snapshotted incrementally)")
        return self._incr.submit(lambda: self._apply_tables(new))

    def _judge_mark(self, mark: Mark) -> tuple[TableId, str] | None:
        """A DDL/schema mark, as the coordinator hands it on (before it goes out): a replaced table
        (``replaced_by``), or an added column whose existing rows hold values no event carries (a non-constant
        default: ``defaults.py``), which a whole-table incremental snapshot reads again."""
        unknown = mark.detail.get("unknown") if mark.kind is MarkKind.SCHEMA else None
        if not unknown:
            return replaced_by(mark)
        at = mark.position
        if isinstance(at, MySqlPosition) and self._resumed_at is not None and at <= self._resumed_at:
            return None  # re-sent after a restart: the re-read it asked for is in the checkpoint already
        table = TableId.parse(str(mark.detail["table"]))
        columns = ", ".join(str(name) for name, _ in unknown)
        schema = self.server.history.latest(table)
        no_gtids = self.server.flavor == "mysql" and not self.server.gtid_mode
        if self.config.snapshot.mode == "initial_only" or no_gtids or schema is None or not schema.key:
            log.error(f"table {table}: the rows it had before column(s) {columns} were added hold values no change "
                      "event carries (a default that is not a constant) and cdcd cannot read them again by itself "
                      "(no primary key, or MySQL without GTIDs): the mirror shows NULL there. Fix: take a new "
                      "snapshot of the table (docs/mysql.md, \"Schema changes\")", table=str(table), columns=columns)
            return None
        log.warning(f"table {table}: column(s) {columns} were added with a default that is not a constant; the table "
                    "is read again by an incremental snapshot so its existing rows land their values",
                    table=str(table), columns=columns)
        self._incr.request(table, None)
        return None

    def _check_incremental(self, what: str) -> None:
        """Incremental snapshots on MySQL fence their low watermark with GTIDs (cdcd/sources/mysql/chunks.py)."""
        if self.server.flavor == "mysql" and not self.server.gtid_mode:
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
        server = self.server
        for t in added:
            if not await server.exists(t):
                raise SourceError(f"table reload: table {t} does not exist on {server.where}; create it, or correct "
                                  "source.tables and reload again")
        keyless = [str(t) for t in added if not await server.primary_key(t)]
        if keyless:  # its incremental snapshot reads in primary-key order: refused before anything changes
            raise SourceError(f"table reload: {', '.join(keyless)} on {server.where} has no primary key, so it cannot "
                              "be snapshotted while streaming; not added. Fix: ALTER TABLE ... ADD PRIMARY KEY (...) "
                              "and reload again, or leave it out of source.tables")
        before = self.tables
        self.tables = set(new)
        self._stream.capture(self.tables)  # the next binlog connection's filter (the running one keeps its own set)
        try:
            await self._stream.restream("source.tables reloaded")
        except BaseException:
            self.tables = before
            self._stream.capture(before)
            raise
        self._incr.dropped = (self._incr.dropped | set(removed)) - set(added)
        self._incr.cancel(set(removed), "the table was removed from source.tables")
        at = self._stream.last_position()
        if at is None:
            at = MySqlPosition.epoch_start(self.server.epoch, "")
        for t in added:
            self._incr.emit(Mark(MarkKind.INCREMENTAL_START, at, {"table": str(t), "where": None}))
            self._incr.jobs.append(SnapshotJob(t, None, started=True))
        self._incr.emit(Mark(MarkKind.TABLES, at, {"tables": [str(t) for t in sorted(self.tables)]}))
        log.info("captured tables reloaded", added=[str(t) for t in added], removed=[str(t) for t in removed])

    def snapshot_progress(self) -> list[dict[str, Any]]:
        return self._incr.progress()

    def status(self) -> dict[str, Any]:
        coord = self._coord
        out: dict[str, Any] = {"connected": coord.connected, "phase": coord.phase, "flavor": self.server.flavor,
                               "reconnects": coord.reconnects, "last_error": coord.last_error,
                               "position_epoch": self.server.epoch, "tables": [str(t) for t in sorted(self.tables)]}
        if self.server.identity is not None:
            out["server_id"] = self.server.identity["server_id"]
        snap = self._snapshot.snapshotter if self._snapshot is not None else None
        if snap is not None and snap.progress:
            out["snapshot"] = {t: {"rows": p.rows, "total_estimate": p.total_estimate, "done": p.done}
                               for t, p in snap.progress.items()}
        out.update(self._stream.status())
        out.update(self._incr.status())
        if self._coord.retention is not None:
            out.update(self._coord.retention.status())
        out["position_lost"] = self._recoveries.status()
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
        await self.server.close()

    def terminate(self) -> None:
        self._coord.close()
        self._chunks.terminate()
        self._stream.stop()
        if self._snapshot is not None:
            self._snapshot.terminate()
        self.server.terminate()
