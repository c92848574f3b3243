"""PostgresSource: the planner and the commit side of the PostgreSQL source.

``connect`` plans a run (a new slot and snapshot, the rest of an interrupted snapshot, or streaming from the
checkpoint) and hands it to the capture coordinator (``cdcd/capture/coordinator.py``), which runs the snapshot
(``snapshot.py``, ``PgSnapshot``) and the stream (``stream.py``, ``PgStream``). The durable source state and
``fold`` live in ``state.py``; connection parameters and TLS in ``connection.py``; the operator's requests while
streaming (``cdcd snapshot``, table reloads) in ``requests.py``; the server identity check in ``system.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any

import asyncpg
import structlog

from cdcd.capture.contracts import CapturePlan
from cdcd.capture.coordinator import CaptureCoordinator
from cdcd.capture.incremental import plan_tables, stale_from_state
from cdcd.capture.recovery import Recovering
from cdcd.capture.retention import RetentionWatch
from cdcd.config import Config
from cdcd.errors import SourceError, SourceFatal, reason
from cdcd.events import Item, Mark, MarkKind, TableId
from cdcd.positions import PgPosition, Position, format_lsn, parse_lsn
from cdcd.runtime.interfaces import CheckResult, ResumePoint, Source
from cdcd.sources.postgres import catalog
from cdcd.sources.postgres.catalog import SlotInfo
from cdcd.sources.postgres.chunks import PgChunkReader
from cdcd.sources.postgres.connection import connect_params
from cdcd.sources.postgres.failover import require_failover
from cdcd.sources.postgres.inprogress import InProgress, spool_dir
from cdcd.sources.postgres.plan import Step, decide
from cdcd.sources.postgres.recover import PgRecoveries, not_lost
from cdcd.sources.postgres.requests import PgRequests
from cdcd.sources.postgres.state import PgState, fold_state
from cdcd.sources.postgres.stream import PgStream
from cdcd.sources.postgres.system import PgSystem
from cdcd.sources.postgres.tables import PgTables, check_oids
from cdcd.sources.postgres.walbudget import WalBudget
from cdcd.sources.postgres.wire.replication import ReplicationConnection

if TYPE_CHECKING:  # the snapshot reader (numpy, pyarrow.compute) is loaded when a snapshot is due
    from cdcd.sources.postgres.snapshot import SnapshotReader, SnapshotTable

log = structlog.get_logger("cdcd.source.postgres")



class PostgresSource(Recovering, Source):
    kind = "postgres"

    def __init__(self, config: Config) -> None:
        src = config.source
        self._config = config
        self._params = connect_params(config)  # shared with `cdcd check` and verify
        self._slot = src.postgres.slot
        self._publication = src.postgres.publication
        self._failover = src.postgres.failover_slot  # a slot cdcd creates is a failover slot (17+, failover.py)
        self._mode = config.snapshot.mode
        self._t = PgTables(self._params, src.table_ids)  # its ``tables``: the captured set
        self._coord = CaptureCoordinator(config, log, phase="streaming", where=self._params.where)
        # The spool of in-progress transactions (protocol 2) lives in the state directory: one daemon per state.path.
        # Also without streaming: every connect removes what an earlier run left there.
        self._stream = PgStream(self._t, self._slot, self._publication, src.postgres.heartbeat_s, self._coord,
                                self._identity_on_connect, InProgress(spool_dir(config.state.path)),
                                src.postgres.stream_in_progress)
        # Incremental snapshots while streaming (cdcd/capture/incremental/): PostgreSQL's chunk reads.
        self._chunks = PgChunkReader(self._t, config.runtime.source_read_timeout_s)
        self._chunks.open_tx_limit_s = config.source.postgres.open_transactions_wait_s
        self._incr = self._coord.incremental
        self._incr.last = self._last_position
        self._incr.key_json = self._chunks.key_json  # keys whose superseding update lacked a TOAST value are re-read
        self._stream.replaced = self._incr.mark_stale  # a table dropped and re-created: /status, `cdcd snapshot`
        self._t.resnapshot = self._resnapshot  # a schema change the stream alone cannot land right
        self._reader: SnapshotReader | None = None  # opened while planning, run by the coordinator
        self._snapshot_tables: list[SnapshotTable] = []  # the last snapshot's progress, for /status
        self._start_mark: Mark | None = None
        self._watermark = PgPosition(0, 0)
        self._stream_changes = True
        self._sys = PgSystem(self._params, self._slot, self._reached)  # the server identity the checkpoint records
        self._announce: list[Item] = []  # Marks to emit before anything else (a new identity record)
        self._resume_position: PgPosition | None = None  # the checkpoint's position at connect
        self._recoveries: PgRecoveries = PgRecoveries(config, self._params, self._slot)  # on_position_lost, recover
        self._stream.replan_lost = config.source.on_position_lost == "resnapshot"  # a slot lost while streaming
        # the slot's WAL budget while streaming: warnings, and the incremental snapshots paused while it is low
        if config.snapshot.mode != "initial_only":  # without a slot there is no budget
            budget = WalBudget(self._params, self._slot, src.retention)
            self._coord.retention = RetentionWatch(src.retention, budget.probe, self._incr.gate, log,
                                                   src.connect_timeout_s + config.runtime.source_read_timeout_s)
        self._requests = PgRequests(config, self._t, self._publication, self._incr, self._chunks, self._stream,
                                    self._last_position, lambda: self._stream_changes)

    # ------------------------------------------------------------ connect: the planner

    async def connect(self, resume: ResumePoint) -> None:
        self._t.sql = await catalog.connect_sql(self._params)
        try:
            version = await catalog.server_version(self._t.sql)
            catalog.require_version(version, self._params.where)
            require_failover(version, self._failover, self._params.where)
            state = PgState.parse(resume.state or {})
            # a table the checkpoint captured may be gone (dropped while cdcd was stopped): flagged, not fatal,
            # unless the initial snapshot still has to read it
            absent_ok = frozenset() if state.snapshot == "running" else frozenset(map(TableId.parse, state.oids))
            await self._t.load(absent_ok)
            self._start_mark, self._announce, self._reader = None, [], None
            await self._plan(resume)
            # resuming the stream: its first Relation of each table is matched with what the last batches landed
            self._t.landed = {} if self._start_mark is not None else {
                TableId.parse(name): cols for name, cols in state.columns.items()}
            self._t.replayed_below = resume.position.lsn if isinstance(resume.position, PgPosition) else 0
            for name, top in state.column_tops.items():
                t = TableId.parse(name)
                self._t.tops[t] = max(self._t.tops.get(t, 0), top)
        except asyncpg.InsufficientPrivilegeError as exc:
            await self.close()
            raise SourceFatal(f"{self._params.where}: {exc}; run `cdcd check` for the privileges cdcd needs") from exc
        except (asyncpg.PostgresError, asyncpg.InterfaceError, OSError) as exc:
            await self.close()
            raise SourceError(f"{self._params.where}: connecting the source failed: {reason(exc)}") from exc
        except BaseException:
            await self.close()
            raise
        announce: list[Item] = [self._start_mark] if self._start_mark is not None else []
        if self._stream_changes:
            self._incr.reader = self._chunks
            self._announce.extend(self._table_marks(resume.state or {}))
            if self._start_mark is None:
                self._announce.append(self._check_oids(state))
        fresh = self._start_mark is not None and self._start_mark.kind is MarkKind.SNAPSHOT_START
        snapshot = None
        if self._reader is not None:
            from cdcd.sources.postgres.snapshot import PgSnapshot

            snapshot = PgSnapshot(self._reader, self._snapshot_tables, self._watermark, fresh)
        self._coord.start(CapturePlan(announce=[*announce, *self._announce], snapshot=snapshot,
                                      stream=self._stream if self._stream_changes else None))
        self._coord.connected = True

    async def _plan(self, resume: ResumePoint) -> None:
        """Gather the facts, let ``plan.decide`` choose the run (pure), carry it out."""
        state = PgState.parse(resume.state or {})
        slot: SlotInfo | None = None
        if self._mode == "initial_only":
            self._stream_changes = False
        else:
            # a table dropped while cdcd was stopped is left out (``_check_oids`` flags it); one re-created is added
            # again when cdcd owns the publication (and flagged), else the error names the statement to run
            present = [t for t in self._t.tables if t in self._t.infos]
            await catalog.ensure_publication(self._t.sql, self._publication, present, self._t.infos)
            slot = await catalog.slot_info(self._t.sql, self._slot)
        slot, lost = self._recoveries.judge(slot, state)  # lost: a slot that lost its WAL, dropped to recover
        self._recoveries.loaded(resume.state or {})
        step = decide(state, slot, self._slot, self._mode, self._params.where, self._recoveries.allowed)
        if self._recoveries.only and step is not Step.RECOVER:
            if step is Step.RESUME:  # a server restored or replaced is no lost slot: its own error and fix
                await self._verify_resumed(state, resume)
            raise not_lost(step, slot, self._slot)
        if step is Step.RECOVER:
            await self._recover(state, resume, lost)
            return
        if step is Step.SNAPSHOT_DONE:
            return
        if step is Step.SNAPSHOT_ONLY:
            await self._open_snapshot(None, state, slot=None)
            return
        if step is Step.NEW_SLOT_AFTER_LOSS:
            log.warning("the checkpoint's replication slot is gone; snapshot.mode=when_needed takes a new snapshot",
                        slot=state.slot)
            self._sys.record = None
            await self._sys.verify(None)
            await self._new_slot_with_snapshot()
            return
        if step is Step.RESUME:
            assert slot is not None
            self._watermark = PgPosition(state.watermark, 0)
            self._stream.flush_lsn = max(state.flush_lsn, slot.confirmed_flush_lsn or 0)
            if isinstance(resume.position, PgPosition):
                self._resume_position = resume.position
            if self._sys.record is None:
                self._sys.record = state.system
            if await self._sys.verify(None):
                at = self._resume_position or self._watermark
                self._announce = [Mark(MarkKind.IDENTITY, at, dict(self._sys.record or {}))]
            if state.snapshot == "running":
                await self._open_snapshot(None, state, slot=self._slot)
            return
        # No checkpoint state: a first start.
        self._sys.record = None
        await self._sys.verify(None)  # records the server's identity for the start Mark
        if step is Step.NEW_SLOT_STREAM:
            repl = await ReplicationConnection.connect(self._params)
            try:
                created = await repl.create_slot(self._slot, export_snapshot=False, failover=self._failover)
            finally:
                await repl.close()
            self._begin(created.consistent_point, snapshot=False)
        elif step is Step.NEW_SLOT_SNAPSHOT:
            await self._new_slot_with_snapshot()
        elif step is Step.SLOT_STREAM:
            assert slot is not None
            self._begin(slot.confirmed_flush_lsn or 0, snapshot=False)
        else:
            # A slot without a checkpoint (a crash before the first commit, or made by hand): keep it and
            # snapshot under a fresh snapshot; replaying from the slot's point onto that converges.
            # Move it to now first: its old point may predate the publication, which pgoutput cannot decode,
            # and everything before now is in the snapshot anyway.
            start = await catalog.advance_slot_to_now(self._t.sql, self._slot)
            log.warning("replication slot exists but there is no checkpoint; advanced it to now, snapshot under a "
                        "fresh snapshot and stream from there", slot=self._slot, lsn=format_lsn(start))
            self._begin(start, snapshot=True)
            await self._open_snapshot(None, PgState(), slot=self._slot)

    async def _recover(self, state: PgState, resume: ResumePoint, lost: str | None) -> None:
        """A new slot where the lost one was; the gap and a whole-table re-snapshot of every table go out first."""
        changed = await self._verify_resumed(state, resume)  # a restored or replaced server is no lost slot
        at, marks = await self._recoveries.take(self._t.sql, state, lost, resume.position, self._t.tables, log)
        self._watermark = self._resume_position = at
        self._stream.flush_lsn = at.lsn
        self._announce = [*([Mark(MarkKind.IDENTITY, at, dict(self._sys.record or {}))] if changed else []), *marks]

    async def _verify_resumed(self, state: PgState, resume: ResumePoint) -> bool:
        """``_verify_system`` against the checkpoint's identity and position."""
        self._sys.record = state.system
        if isinstance(resume.position, PgPosition):
            self._resume_position = resume.position
        return await self._sys.verify(None)

    def _last_position(self) -> PgPosition:
        """Where a mark of the running stream goes: the last delivered position, else where the run began."""
        last = self._coord.last
        if isinstance(last, PgPosition):
            return last
        return self._resume_position or self._watermark

    def _table_marks(self, state: dict[str, Any]) -> list[Item]:
        """Tables added to or removed from source.tables since the checkpoint (``plan_tables``); resumes the
        incremental snapshots the checkpoint holds as running."""
        fresh = self._start_mark is not None  # a first start or a new snapshot: every table is in it
        marks, jobs = plan_tables(state, self._t.tables, fresh, self._last_position(), log)
        # a table added now (or before a restart, its snapshot still running) may have joined the publication while
        # a transaction that wrote to it was open: the job's first chunk waits for those (``PgChunkReader.prepare``)
        self._chunks.joined.update(j.table for j in jobs if j.started)
        # a fresh start snapshots every table: no flag of the old state stands
        self._incr.resume(jobs, None if fresh else stale_from_state(PgState.parse(state).stale, self._t.tables))
        self._recoveries.queue(self._incr)  # a recovery re-reads every table
        self._incr.dropped = set()
        if fresh:  # the start mark carries the table list (``_begin``); nothing else is due
            return []
        return list(marks)

    def _check_oids(self, state: PgState) -> Mark:
        """The TABLES mark that keeps the relation OIDs, flagging a table dropped or re-created while cdcd was
        stopped (``tables.check_oids``)."""
        oids = check_oids(self._t, dict(state.oids), self._publication, self._incr)
        return Mark(MarkKind.TABLES, self._last_position(), {"tables": [str(t) for t in self._t.tables], "oids": oids})

    # ------------------------------------------------------------ operator requests (issue 13): requests.py

    def _resnapshot(self, table: TableId, why: str) -> None:
        """What ``cdcd snapshot TABLE`` does, asked by the stream (``PgTables.resnapshot``); a whole-table job
        already queued covers it."""
        if not any(j.table == table and j.where is None for j in self._incr.jobs):
            self._incr.request(table, None)

    def request_snapshot(self, table: str, where: str | None = None) -> None:
        self._requests.snapshot(table, where)

    async def check_where(self, table: str, where: str) -> None:
        await self._requests.check_where(table, where)

    def reload_tables(self, tables: list[str]) -> asyncio.Future[None]:
        return self._requests.reload(tables)

    def snapshot_progress(self) -> list[dict[str, Any]]:
        return self._incr.progress()

    def _reached(self) -> int:
        """The highest WAL position cdcd committed or emitted: the server's history must contain it."""
        last = self._coord.last
        last_lsn = last.lsn if isinstance(last, PgPosition) else 0
        ckpt = self._resume_position.lsn if self._resume_position is not None else 0
        return max(self._stream.flush_lsn, last_lsn, ckpt)

    def _begin(self, watermark: int, snapshot: bool, slot: str | None = "") -> None:
        """Record a first start: the Mark that puts slot and watermark into the checkpoint."""
        name = self._slot if slot == "" else slot
        self._watermark = PgPosition(watermark, 0)
        self._stream.flush_lsn = watermark
        # the captured list rides on the start mark: a fresh start captures every configured table
        detail: dict[str, Any] = {"slot": name, "watermark": format_lsn(watermark),
                                  "tables": [str(t) for t in self._t.tables], "oids": self._t.oids()}
        if self._sys.record:
            detail["system"] = dict(self._sys.record)
        kind = MarkKind.SNAPSHOT_START if snapshot else MarkKind.STREAM_START
        self._start_mark = Mark(kind, self._watermark, detail)

    async def _new_slot_with_snapshot(self) -> None:
        repl = await ReplicationConnection.connect(self._params)
        try:
            created = await repl.create_slot(self._slot, export_snapshot=True, failover=self._failover)
            self._begin(created.consistent_point, snapshot=True)
            # The exported snapshot lives until the replication connection's next command:
            # every worker imports it before we let go of the connection.
            await self._open_snapshot(created.snapshot_name, PgState(), slot=self._slot)
        finally:
            await repl.close()

    async def _open_snapshot(self, snapshot_name: str | None, state: PgState, slot: str | None) -> None:
        from cdcd.sources.postgres.snapshot import SnapshotReader, resume_tables

        self._snapshot_tables = tables = resume_tables(self._t, state)
        reader = SnapshotReader(self._params, self._config.snapshot.parallelism, self._config.snapshot.chunk_rows,
                                self._t.warnings, self._config.snapshot.chunk_bytes)
        await reader.open(snapshot_name, sum(1 for t in tables if not t.done))
        self._reader = reader
        if state.empty and self._start_mark is None:
            # initial_only first start: no slot; the watermark is the WAL position of the fresh snapshot.
            self._begin(reader.watermark_lsn or 0, snapshot=True, slot=slot)
        elif not state.empty:
            self._watermark = PgPosition(state.watermark, 0)

    # ------------------------------------------------------------ stream: the coordinator runs the plan

    def stream(self) -> AsyncIterator[Item]:
        return self._coord.items()

    async def _identity_on_connect(self, repl: ReplicationConnection) -> list[Item]:
        """Every replication (re)connect: the server must still hold what was captured; a new timeline is
        recorded with an identity Mark."""
        if await self._sys.verify(repl):
            at = self._coord.last or self._resume_position or PgPosition(self._stream.flush_lsn, 0)
            return [Mark(MarkKind.IDENTITY, at, dict(self._sys.record or {}))]
        return []

    # ------------------------------------------------------------ commit

    def fold(self, state: dict[str, Any], items: Sequence[Item]) -> dict[str, Any]:
        return fold_state(state, items)

    async def confirm(self, position: Position, state: dict[str, Any]) -> None:
        text = state.get("flush_lsn")
        if text:
            self._stream.confirm(parse_lsn(text))

    # ------------------------------------------------------------ the rest

    async def preflight(self) -> list[CheckResult]:
        from cdcd.sources.postgres.preflight import run_preflight

        return await run_preflight(self._params, self._t.tables, self._slot, self._publication, self._failover)

    def status(self) -> dict[str, Any]:
        coord = self._coord
        out: dict[str, Any] = {
            "connected": coord.connected,
            "phase": coord.phase,
            "slot": self._slot if self._stream_changes else None,
            "reconnects": coord.reconnects,
            "last_error": coord.last_error,
            "tables": [str(t) for t in self._t.tables],
            **self._stream.status(),
        }
        if self._sys.record:
            out["timeline"] = self._sys.record.get("timeline")
        out.update(self._incr.status())
        if self._coord.retention is not None:
            out.update(self._coord.retention.status())
        out["position_lost"] = self._recoveries.status()
        if self._chunks.waiting is not None:
            out["incremental_waiting"] = self._chunks.waiting
        if self._snapshot_tables:  # a snapshot ran: its module is loaded
            from cdcd.sources.postgres.snapshot import snapshot_status

            out["snapshot"] = snapshot_status(self._snapshot_tables)
        return out

    async def close(self) -> None:
        self._coord.close()
        await self._chunks.close()
        if self._reader is not None:
            await self._reader.close()
        await self._stream.close()
        if self._t.sql is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._t.sql.close(), 5)
        self._t.sql = None

    def terminate(self) -> None:
        self._coord.close()
        self._chunks.terminate()
        if self._reader is not None:
            self._reader.terminate()
        self._stream.terminate()
        if self._t.sql is not None:
            with contextlib.suppress(Exception):
                self._t.sql.terminate()
        self._t.sql = None
