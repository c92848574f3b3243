"""The incremental snapshots of one source (``Incremental``): the job queue, the chunk task that reads between
watermarks (and runs table reloads), and the coordinator's side that hands a chunk's rows to the stream once it
reaches the chunk's HW."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from cdcd.capture.incremental.gate import Gate
from cdcd.capture.incremental.window import Chunk, ChunkReader, SnapshotJob, Window, partial_key_changes
from cdcd.config import Config
from cdcd.errors import CdcdError, SourceError, SourceUnavailable
from cdcd.events import ChangeBlock, ChangeEvent, Item, Mark, MarkKind, TableId, TableSchema
from cdcd.positions import Position
from cdcd.retry import source_backoff

#: How long a read chunk waits for the stream to reach its HW before the reader is asked to look (an idle binlog).
POKE_S = 0.5


class Incremental:
    """The incremental snapshots of one source: the job queue, the chunk task and the window."""

    def __init__(self, config: Config, log: Any, where: str) -> None:
        self._config = config
        self._log = log
        self._where = where
        self.chunk_rows = config.snapshot.chunk_rows
        self.reader: ChunkReader | None = None
        self.jobs: collections.deque[SnapshotJob] = collections.deque()
        self.finished: list[SnapshotJob] = []  # done or failed in this process, for /status
        self.current: SnapshotJob | None = None
        self.window: Window | None = None
        self.pending: Chunk | None = None  # read, waiting for the stream to reach its HW
        self._prepared: SnapshotJob | None = None  # the job ``reader.prepare`` last returned for
        self._delivered: Position | None = None  # the last streamed item ``before`` let through
        self.dropped: set[TableId] = set()  # tables no longer captured: their streamed changes are dropped
        self._out: list[Item] = []  # marks to emit before the next streamed item
        # work for the chunk task (a reload) and the future its submitter awaits
        self._work: collections.deque[tuple[Callable[[], Awaitable[None]], asyncio.Future[None]]] = collections.deque()
        self._wake = asyncio.Event()
        self._error: BaseException | None = None
        self.reload_error: str | None = None  # why the last table reload failed (None: it worked, or none yet)
        self._task: asyncio.Task[None] | None = None
        self.gate = Gate()  # closed while the source's retention budget runs low (cdcd/capture/retention.py)
        self.last: Callable[[], Position | None] = lambda: None  # the coordinator's last delivered position
        # Tables whose mirror a re-snapshot must repair (dropped and re-created under the same name): table ->
        # why. The stream goes on; /status lists them until a whole-table snapshot begun after the flag completes.
        # The checkpoint keeps them (TABLE_REPLACED; ``stale_from_state`` at connect).
        self.stale: dict[TableId, str] = {}
        #: The source's key form of a landed key (as ``SnapshotJob.last_key``), used to read keys again; None: the
        #: source's reader cannot re-read keys, and a key whose superseding change lacked a column keeps the gap.
        self.key_json: Callable[[TableSchema, tuple[Any, ...]], list[Any]] | None = None
        #: A source's reading of a DDL/schema mark: the table it replaced and why (MariaDB's binlog DDL).
        self.replaced: Callable[[Mark], tuple[TableId, str] | None] = lambda mark: None

    # -- what the source asks for ---------------------------------------------------------------

    def resume(self, jobs: list[SnapshotJob], stale: Mapping[TableId, str] | None = None) -> None:
        """The checkpoint's running jobs (already started), then the jobs of this process the checkpoint does
        not hold yet (their uncommitted progress is read again). ``stale``: the checkpoint's replaced tables
        (kept with those this process flagged since)."""
        if stale:
            self.stale = {**stale, **self.stale}
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()  # a reconnect: the old run's stream is gone (its connections are closed by terminate)
        held = {j.table for j in jobs}
        keep = [j for j in (*([self.current] if self.current else []), *self.jobs)
                if j.table not in held and j.state in ("queued", "running")]
        for j in keep:
            j.last_key, j.rows, j.chunks, j.below, j.state, j.started = None, 0, 0, None, "queued", False
            j.reread, j.range_done = {}, False
        self.jobs = collections.deque([*jobs, *keep])
        self.current, self.window, self.pending, self._error = None, None, None, None
        self._wake.set()

    def request(self, table: TableId, where: str | None) -> None:
        """Queue a snapshot of ``table`` (a running or queued one of the same table is replaced at its start)."""
        self.jobs.append(SnapshotJob(table, where))
        at = self.last()
        if at is not None:  # durable once committed: a restart runs it (``fold_incremental``, "queued")
            self._out.append(Mark(MarkKind.INCREMENTAL_START, at, {"table": str(table), "where": where,
                                                                    "queued": True}))
        self._wake.set()

    def mark_stale(self, table: TableId, why: str) -> None:
        """``table`` was dropped and re-created (or replaced): log it once, list it in /status (and keep it in
        the checkpoint) until a whole-table re-snapshot begun after it completes."""
        if table in self.stale:
            return
        self.stale[table] = why
        at = self.last()
        if at is not None:
            self._out.append(Mark(MarkKind.TABLE_REPLACED, at, {"table": str(table), "why": why}))
        self._log.error(f"table {table} was replaced on the source: {why}; its mirror may keep rows of the old table "
                        f"and miss rows of the new one. The other tables go on streaming. Fix: `cdcd snapshot -c "
                        f"CONFIG {table}` (a whole-table incremental snapshot; the consumer then drops the old rows)",
                        table=str(table))

    def submit(self, work: Callable[[], Awaitable[None]]) -> asyncio.Future[None]:
        """Run ``work`` in the chunk task before the next chunk (a table reload: catalog reads, publication).

        The future is done once ``work`` is: its result, or its error (also logged and in ``/status``). A reconnect
        that cancels the chunk task while ``work`` runs puts it back first in line: the next run does it again
        (``work`` must leave nothing half done when cancelled)."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._work.append((work, done))
        self._wake.set()
        return done

    def cancel(self, tables: set[TableId], why: str) -> None:
        """Tables no longer captured (a reload): their queued jobs go, the running one ends as cancelled, their
        replaced flags go (the TABLES mark drops them from the checkpoint). Called in the chunk task between chunks
        (``submit``), so no chunk of it is pending."""
        for t in tables:
            self.stale.pop(t, None)
        gone = [j for j in self.jobs if j.table in tables]
        self.jobs = collections.deque(j for j in self.jobs if j.table not in tables)
        job = self.current
        if job is not None and job.table in tables:
            gone.append(job)
            self.current, self.window = None, None
        at = self.last()
        for j in gone:
            j.state, j.error = "cancelled", why
            self.finished.append(j)
            if j.started and at is not None:  # the checkpoint holds it as running: record the end
                self._out.append(Mark(MarkKind.INCREMENTAL_DONE, at, {"table": str(j.table), "cancelled": why}))
            self._log.warning("incremental snapshot cancelled", table=str(j.table), where=j.where, reason=why,
                              chunks=j.chunks)

    def emit(self, mark: Mark) -> None:
        """A mark to deliver before the next streamed item."""
        self._out.append(mark)

    def status(self) -> dict[str, Any]:
        """The incremental snapshots' part of a source's ``/status`` (empty when there is nothing to say)."""
        out: dict[str, Any] = {}
        if self.busy or self.finished:
            out["incremental_snapshots"] = self.progress()
        if self.gate.reason:
            out["incremental_paused"] = self.gate.reason
        if self.reload_error:
            out["table_reload_error"] = self.reload_error
        if self.stale:
            out["tables_needing_snapshot"] = {str(t): why for t, why in sorted(self.stale.items())}
        return out

    def progress(self) -> list[dict[str, Any]]:
        active = [self.current] if self.current is not None else []
        return [j.progress() for j in (*self.finished, *active, *self.jobs)]

    @property
    def busy(self) -> bool:
        return self.current is not None or bool(self.jobs) or bool(self._work)

    # -- the coordinator's side -------------------------------------------------------------------

    def start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name="cdcd-incremental")

    def stop(self) -> None:
        """The stream ends (a stop, a reconnect): cancel the chunk task (no wait: whoever is stopping the reader
        must not wait on a chunk read); the job in progress goes back to the queue, resumed from its progress."""
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
        self.pending = None
        if self.current is not None:  # read again by the next run, from the checkpoint's progress
            self.jobs.appendleft(self.current)
            self.current, self.window = None, None

    def before(self, item: Item) -> tuple[list[Item], bool]:
        """Items to deliver before ``item`` (chunk rows whose HW it reached, marks), and whether ``item`` goes."""
        if self._error is not None:
            err, self._error = self._error, None
            raise err
        if type(item) is Mark and item.kind in (MarkKind.DDL, MarkKind.SCHEMA):
            hit = self.replaced(item)
            if hit is not None:  # its TABLE_REPLACED goes before the DDL: a restart after it cannot miss the flag
                self.mark_stale(*hit)
        out: list[Item] = []
        if self._out:
            out, self._out = self._out, []
        pending = self.pending
        first = item.start if type(item) is ChangeBlock else item.position  # a block's rows all go after the chunk
        if pending is not None and first >= pending.hw:  # type: ignore[operator]
            # The stream may have passed the HW before the chunk task set ``pending`` (the read returns after
            # the HW is written): the rows then go at the last delivered position, never below what is already
            # out. No key of theirs ties with a delivered change: every change after the LW took its key out.
            at = pending.hw
            if self._delivered is not None and self._delivered > at:  # type: ignore[operator]
                at = self._delivered
            out.extend(self._finish(pending, at))
        if isinstance(item, ChangeEvent | ChangeBlock) and not item.snapshot:
            table = item.schema.table
            if table in self.dropped:
                return out, False
            window = self.window
            if window is not None and table == window.table:
                window.record(item)
            if item.unavailable and self.key_json is not None:
                for moved in partial_key_changes(item):
                    out.extend(self._reread_moved(moved, out))
        if type(item) is not Mark or item.kind not in (MarkKind.IDENTITY, MarkKind.WATERMARK):
            self._delivered = item.position
        return out, True

    def _reread_moved(self, ev: ChangeEvent, out: list[Item]) -> list[Item]:
        """A key change that did not carry every column: the new key keeps the old key's values in the mirror,
        which may have none yet (a key not read so far, or one waiting for its re-read). Read the new key again;
        the mark goes before the change, so a checkpoint that holds the change holds the key too. Once the range
        ended, only a key moved from one waiting for its re-read needs it (every other key is whole): re-read
        rounds then end even while keys keep changing. A started job waiting for its turn (resumed after a
        restart, before its first LW) needs it too: the keys it delivered before are in the mirror."""
        job, key, old = self.current, ev.key, ev.before_key
        if job is None or job.table != ev.table:
            job = next((j for j in self.jobs if j.started and j.table == ev.table), None)
        if job is None or self.key_json is None or key is None or old is None:
            return []
        if job.range_done and tuple(self.key_json(ev.schema, old)) not in job.reread:
            return []
        text = self.key_json(ev.schema, key)
        if tuple(text) in job.reread:
            return []
        job.reread[tuple(text)] = text
        at = out[-1].position if out else self._delivered if self._delivered is not None else self.last()
        if at is None:
            return []
        return [Mark(MarkKind.INCREMENTAL_REREAD, at, {"table": str(job.table), "keys": [text]})]

    def _finish(self, chunk: Chunk, at: Position) -> list[Item]:
        """The chunk's rows no change after its LW touched, and its marks, at ``at`` (its HW or later)."""
        self.pending = None
        window = self.window
        assert window is not None
        return window.deliver(chunk, at, self.key_json, self.stale)

    # -- the chunk task ----------------------------------------------------------------------------

    async def _run(self) -> None:
        try:
            await self._loop()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # raised into the stream by the next ``before``
            self._error = exc

    async def _loop(self) -> None:
        retry = source_backoff(self._config, f"incremental snapshot reads on {self._where}")
        while True:
            while self._work:
                work, done = self._work[0]
                try:
                    await work()
                except asyncio.CancelledError:  # a reconnect or a stop: it stays first in line for the next run
                    raise
                except Exception as exc:  # a reload that cannot be done (a publication cdcd may not change):
                    # the stream goes on with the tables it had; the error is logged and in /status. A driver's
                    # error (a connection closed by a reconnect, a server restarting) and a source that cannot be
                    # reached (SourceUnavailable) are retried with the backoff (SourceFatal once
                    # runtime.source_retry_timeout_s is spent: then the reload failed).
                    if not isinstance(exc, CdcdError) or isinstance(exc, SourceUnavailable):
                        try:
                            delay = retry.failure(exc)
                        except SourceError as gave_up:
                            exc = gave_up
                        else:
                            self._log.warning("table reload interrupted; retrying", error=str(exc) or repr(exc),
                                              retry_in_s=round(delay, 2))
                            await asyncio.sleep(delay)
                            continue
                    self._work.popleft()
                    self.reload_error = str(exc) or repr(exc)
                    self._log.error("table reload failed; still capturing the previous tables",
                                    error=self.reload_error)
                    if not done.done():
                        done.set_exception(exc)
                        done.exception()  # logged above: no "never retrieved" warning when nobody awaits it
                    continue
                self._work.popleft()
                self.reload_error = None
                if retry.attempts:
                    retry.success()
                if not done.done():
                    done.set_result(None)
            if self.current is None:
                if not self.jobs:
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                self._begin(self.jobs.popleft())
                if self.current is None:
                    continue  # replaced by a newer request of the same table
            job = self.current
            assert job is not None and self.reader is not None
            if self.gate.reason is not None:  # between chunks: the slot or binlog file first while its budget is low
                await self.gate.wait(POKE_S)  # a table reload submitted meanwhile still runs (the loop's top)
                continue
            try:
                if self._prepared is not job:  # once per job and run, before its first chunk's LW
                    await self.reader.prepare(job)
                    self._prepared = job
                chunk = await self.reader.read(job, self.chunk_rows)
            except Exception as exc:  # sorted below: the job's fault, a fatal error, or a retry
                why = self.reader.job_error(exc)
                if why is not None:
                    self._fail(job, why)
                    continue
                if isinstance(exc, SourceError) and exc.fatal:
                    raise
                delay = retry.failure(exc)  # SourceFatal once runtime.source_retry_timeout_s is spent
                self._log.warning("incremental snapshot chunk read failed; retrying", table=str(job.table),
                                  error=str(exc) or repr(exc), retry_in_s=round(delay, 2))
                await asyncio.sleep(delay)
                continue
            if retry.attempts:
                retry.success()
            self.pending = chunk
            while not chunk.emitted.is_set():  # the stream reaches the HW: one chunk in memory at a time
                try:
                    await asyncio.wait_for(chunk.emitted.wait(), POKE_S)
                except TimeoutError:
                    self.reader.poke(chunk)
            if chunk.done:
                job.state = "done"
                self._log.info("incremental snapshot done", table=str(job.table), rows=job.rows,
                               chunks=job.chunks, where=job.where)
                self.finished.append(job)
                self.current, self.window = None, None

    def _begin(self, job: SnapshotJob) -> None:
        # A newer request for the same table replaces a queued one (the newest wins); a started one (resumed
        # after a restart) is being read and runs to its end first.
        if not job.started and any(j.table == job.table for j in self.jobs):
            job.state = "replaced"
            self.finished.append(job)
            return
        self.current = job
        self.window = Window(job.table)  # recording starts before the first LW
        job.state = "running"
        if not job.started:
            job.started = True
            job.repairs = job.where is None and job.table in self.stale
            at = self.last()
            if at is not None:
                detail: dict[str, Any] = {"table": str(job.table), "where": job.where}
                if job.repairs:
                    detail["repairs"] = True
                self._out.append(Mark(MarkKind.INCREMENTAL_START, at, detail))
        self._log.info("incremental snapshot started", table=str(job.table), where=job.where,
                       after=job.last_key)

    def _fail(self, job: SnapshotJob, why: str) -> None:
        job.state, job.error = "failed", why
        self._log.error("incremental snapshot failed", table=str(job.table), where=job.where, error=why)
        at = self.last()
        if at is not None:
            self._out.append(Mark(MarkKind.INCREMENTAL_DONE, at, {"table": str(job.table), "failed": why}))
        self.finished.append(job)
        self.current, self.window = None, None
