"""Incremental snapshots: the watermark-chunk algorithm (DBLog), run by the coordinator while the stream runs.

A table is read in key-ordered chunks while its changes keep streaming. Per chunk the source's ``ChunkReader``
makes a low watermark (LW), reads the chunk, makes a high watermark (HW) and says which transactions the
chunk's read did not see. The coordinator records every streamed change of the table being snapshotted
(``Window``); when the stream reaches the HW it emits the chunk's rows that no recorded change touched (either
image: the old key of a key change too) as ``r`` rows at the HW's position, so they sort after everything the
read saw and before every later change. A touched key's state comes from the stream instead, unless a change
that took it did not carry every column (PostgreSQL's unchanged TOAST: ``unavailable``): such a key is read
again (``SnapshotJob.reread``) with a later chunk, or in re-read rounds of their own after the last chunk,
until a read of it has no such change in its window. The proof sketch, the latency bound and the
checkpointed progress are in docs/runtime.md ("Incremental snapshots").

Progress reaches the checkpoint through Marks (``INCREMENTAL_START``, ``INCREMENTAL_CHUNK``,
``INCREMENTAL_REREAD``, ``INCREMENTAL_DONE``, ``TABLES``, ``TABLE_REPLACED``) that every source folds with
``fold_incremental``; a restart resumes after the last chunk the checkpoint holds, with its re-read keys.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import pyarrow as pa
import pyarrow.compute as pc

from cdcd.config import Config
from cdcd.errors import CdcdError, ConfigError, SourceError
from cdcd.events import ChangeBlock, ChangeEvent, Item, Mark, MarkKind, Op, RowBlock, TableId, TableSchema
from cdcd.positions import Position, position_from_json
from cdcd.retry import source_backoff

#: How long a read chunk waits for the stream to reach its HW before the reader is asked to look (an idle binlog).
POKE_S = 0.5


@dataclass
class SnapshotJob:
    """One table's incremental snapshot (a whole table, or the rows matching ``where``)."""

    table: TableId
    where: str | None = None
    last_key: list[Any] | None = None  # the last chunk's last key as the source keeps it (JSON): resume after it
    rows: int = 0  # rows emitted (chunk rows no streamed change superseded)
    chunks: int = 0
    below: Position | None = None  # the first chunk's low watermark (SNAPSHOT_COVERED's bound)
    state: str = "queued"  # queued | running | done | failed | cancelled | replaced
    started: bool = False  # its INCREMENTAL_START is in the stream (or in the checkpoint already)
    error: str | None = None
    # Keys to read again (the source's key form, as ``last_key``), each as its tuple -> its JSON list: a change
    # in a chunk's window took the key without carrying every column (unchanged TOAST)
    reread: dict[tuple[Any, ...], list[Any]] = field(default_factory=dict)
    repairs: bool = False  # a whole-table snapshot begun after its table was flagged replaced: its end clears it
    range_done: bool = False  # the key range ended (only re-read rounds are left): every key not in reread is whole

    def progress(self) -> dict[str, Any]:
        return {"table": str(self.table), "where": self.where, "state": self.state, "chunks": self.chunks,
                "rows": self.rows, "last_key": self.last_key, "reread": len(self.reread), "error": self.error}


@dataclass
class Chunk:
    """One chunk as read between its watermarks, waiting for the stream to reach ``hw``."""

    job: SnapshotJob
    schema: TableSchema
    data: pa.Table
    key_text: tuple[pa.Array | None, ...] | None
    last_key: list[Any] | None  # resume key (None: the chunk was empty)
    lw: Position
    hw: Position
    last: bool  # fewer rows than asked for: the table (or the WHERE range) ends here
    invisible: Callable[[str | None], bool]  # True for a transaction (id as streamed) the read did not see
    # the job's re-read keys this read also asked for (by key, in the same snapshot; ``data`` holds the rows found
    # and never twice a row of the chunk's own range)
    reread: list[list[Any]] = field(default_factory=list)
    emitted: asyncio.Event = field(default_factory=asyncio.Event)
    done: bool = False  # set when delivered: the job's last chunk (its range ended and nothing is left to re-read)


class ChunkReader(Protocol):
    """A source's part: watermarks and key-ordered chunk reads that write nothing to the source's tables."""

    async def prepare(self, job: SnapshotJob) -> None:
        """Before the job's first chunk read in this run (its first LW): wait until the reads can see every
        change of the table the stream will not deliver (PostgreSQL: transactions that wrote to it before it
        joined the publication). Raises like ``read``; a no-op where the stream delivers every change."""
        ...

    async def read(self, job: SnapshotJob, limit: int) -> Chunk:
        """LW, the chunk after ``job.last_key`` (at most ``limit`` rows, matching ``job.where``), HW. A reader
        that re-reads (``Incremental.key_json`` set) also reads up to ``limit`` of ``job.reread`` by key in the
        same snapshot and names them in ``Chunk.reread``."""
        ...

    def poke(self, chunk: Chunk) -> None:
        """The stream delivered nothing at or after ``chunk.hw`` for a while: if it is idle past the HW, hand it an
        item there (MariaDB: a WATERMARK mark); nothing to do where the HW is itself a stream item (PostgreSQL)."""
        ...

    def job_error(self, exc: BaseException) -> str | None:
        """A message when ``exc`` is the job's own fault (a bad WHERE, a table gone): it fails, the stream
        goes on. None: a connection problem, retried with backoff."""
        ...

    async def close(self) -> None:
        ...

    def terminate(self) -> None:
        ...


class Window:
    """The streamed changes of the table being snapshotted, kept until no later chunk can need them."""

    def __init__(self, table: TableId) -> None:
        self.table = table
        # (position, transaction, key, partial): key None is a truncate; partial, a change that left the key
        # without some column's value (``unavailable``)
        self._seen: list[tuple[Position, str | None, tuple[Any, ...] | None, bool]] = []

    def record(self, ev: ChangeEvent | ChangeBlock) -> None:
        if type(ev) is ChangeBlock:  # its rows' keys and key changes, exactly as one ChangeEvent per row
            self._seen.extend(ev.touched())
            return
        assert type(ev) is ChangeEvent
        if ev.op is Op.TRUNCATE:
            self._seen.append((ev.position, ev.tx_id, None, False))
            return
        key = ev.key
        if key is not None:
            self._seen.append((ev.position, ev.tx_id, key, bool(ev.unavailable)))
        old = ev.before_key
        if old is not None:
            self._seen.append((ev.position, ev.tx_id, old, False))

    def touched(self, chunk: Chunk) -> tuple[set[tuple[Any, ...]], bool]:
        """Keys a change after the LW (or one the read did not see) touched; True when a truncate did."""
        keys: set[tuple[Any, ...]] = set()
        truncated = False
        lw, invisible = chunk.lw, chunk.invisible
        for pos, tx, key, _partial in self._seen:
            if pos > lw or invisible(tx):  # type: ignore[operator]
                if key is None:
                    truncated = True
                else:
                    keys.add(key)
        return keys, truncated

    def partial(self, chunk: Chunk) -> set[tuple[Any, ...]]:
        """Keys a change after the LW (or one the read did not see) left without some column's value: the
        stream cannot give their whole row where the mirror has none to keep the value from."""
        lw, invisible = chunk.lw, chunk.invisible
        return {key for pos, tx, key, partial in self._seen
                if partial and key is not None and (pos > lw or invisible(tx))}  # type: ignore[operator]

    def prune(self, chunk: Chunk) -> None:
        """Forget what no later chunk can need: changes before this HW that this chunk's read saw (a later
        read, with a later snapshot and a later LW, sees them too)."""
        hw, invisible = chunk.hw, chunk.invisible
        self._seen = [s for s in self._seen if s[0] > hw or invisible(s[1])]  # type: ignore[operator]


def partial_key_changes(item: ChangeEvent | ChangeBlock) -> list[ChangeEvent]:
    """The key changes of ``item`` that did not carry every column (rare: only these rows become events)."""
    if type(item) is ChangeEvent:
        return [item] if item.unavailable and item.before_key is not None else []
    assert type(item) is ChangeBlock
    if item.unavailable is None or item.key_changed is None:
        return []
    return [ev for ev in item.events() if ev.unavailable and ev.before_key is not None]


def rows_with(data: pa.Table, key: tuple[str, ...], keys: set[tuple[Any, ...]]) -> set[tuple[Any, ...]]:
    """The members of ``keys`` that are keys of rows of ``data``."""
    mask = keep_mask(data, key, keys)
    if mask is None:
        return set()
    hit = data.filter(pc.invert(mask))
    return {tuple(v) for v in zip(*(hit.column(k).to_pylist() for k in key), strict=True)} & keys


def keep_mask(data: pa.Table, key: tuple[str, ...], touched: set[tuple[Any, ...]]) -> pa.Array | None:
    """Rows of ``data`` whose key is not in ``touched`` (None: keep all)."""
    if not touched or not data.num_rows:
        return None
    if len(key) == 1:
        col = data.column(key[0])
        values = [k[0] for k in touched]
        try:
            return pc.invert(pc.is_in(col, value_set=pa.array(values, type=col.type)))
        except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
            pass  # a key type is_in cannot take: compare in Python
    columns = [data.column(k).to_pylist() for k in key]
    return pa.array([tuple(v) not in touched for v in zip(*columns, strict=True)], type=pa.bool_())


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

    def _rereads(self, chunk: Chunk) -> None:
        """The job's re-read keys after ``chunk``: the ones it read are settled, unless a change in its window
        left them without a column; so is every row of the chunk such a change took."""
        job, window = chunk.job, self.window
        assert window is not None and self.key_json is not None
        read = {tuple(k) for k in chunk.reread}
        for k in read:
            job.reread.pop(k, None)
        partial = window.partial(chunk)
        if not partial:
            return
        found = rows_with(chunk.data, chunk.schema.key, partial)
        for key in partial:
            text = self.key_json(chunk.schema, key)
            if key in found or tuple(text) in read:
                job.reread.setdefault(tuple(text), text)

    def _finish(self, chunk: Chunk, at: Position) -> list[Item]:
        """The chunk's rows no change after its LW touched, and its marks, at ``at`` (its HW or later)."""
        self.pending = None
        job, window = chunk.job, self.window
        assert window is not None
        touched, truncated = window.touched(chunk)
        if self.key_json is not None:
            self._rereads(chunk)
        window.prune(chunk)
        data, texts = chunk.data, chunk.key_text
        if truncated:
            data = data.slice(0, 0)
            texts = None if texts is None else tuple(None if t is None else t.slice(0, 0) for t in texts)
        else:
            mask = keep_mask(data, chunk.schema.key, touched)
            if mask is not None:
                data = data.filter(mask)
                texts = None if texts is None else tuple(None if t is None else t.filter(mask) for t in texts)
        out: list[Item] = []
        if data.num_rows:
            out.append(RowBlock(chunk.schema, at, data, Op.READ, True, key_text=texts))
        job.rows += data.num_rows
        job.chunks += 1
        job.last_key = chunk.last_key if chunk.last_key is not None else job.last_key
        if job.below is None:
            job.below = chunk.lw
        table = str(job.table)
        out.append(Mark(MarkKind.INCREMENTAL_CHUNK, at, {
            "table": table, "last_key": job.last_key, "rows": data.num_rows, "lw": chunk.lw.to_json(),
            "reread": list(job.reread.values())}))
        # The range ended: done once no key waits for its re-read (else re-read rounds follow, each reading the
        # range's end again, which finds the rows inserted past it meanwhile)
        job.range_done = job.range_done or chunk.last
        chunk.done = chunk.last and not job.reread
        if chunk.done:
            if job.where is None:
                out.append(Mark(MarkKind.SNAPSHOT_COVERED, at, {"table": table, "below": job.below}))
                if job.repairs:
                    self.stale.pop(job.table, None)
            out.append(Mark(MarkKind.INCREMENTAL_DONE, at, {"table": table}))
        chunk.emitted.set()
        return out

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
                    # error (a connection closed by a reconnect, a server restarting) is retried with the backoff
                    # (SourceFatal once runtime.source_retry_timeout_s is spent: then the reload failed).
                    if not isinstance(exc, CdcdError):
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


def plan_tables(state: Mapping[str, Any], configured: list[TableId], fresh: bool, at: Position,
                log: Any) -> tuple[list[Mark], list[SnapshotJob]]:
    """At connect: compare ``source.tables`` with the captured list the checkpoint holds (``fresh``: a first start
    or a new snapshot, every table is in it). A table added gets its INCREMENTAL_START before the new TABLES list,
    so a crash cannot record it as captured without its snapshot; a table removed stops being captured. Returns
    the marks to announce and the jobs to run: the checkpoint's running ones, then the added tables'."""
    held = None if fresh else state.get("tables")
    if held is None and not fresh:
        # A checkpoint from before the list was kept: the initial snapshot's tables, else the configured list.
        done = (state.get("snapshot") or {}).get("tables") or {}
        held = list(done) if done else [str(t) for t in configured]
    captured = [TableId.parse(n) for n in held] if held is not None else list(configured)
    added = [t for t in configured if t not in captured]
    marks = [Mark(MarkKind.INCREMENTAL_START, at, {"table": str(t), "where": None}) for t in added]
    jobs = [] if fresh else jobs_from_state(state, configured)
    jobs += [SnapshotJob(t, None, started=True) for t in added]
    if added or held is None or captured != configured:
        marks.append(Mark(MarkKind.TABLES, at, {"tables": [str(t) for t in configured]}))
    if added:
        log.info("tables added to source.tables: snapshotting them incrementally while streaming",
                 tables=[str(t) for t in added])
    gone = [str(t) for t in captured if t not in configured]
    if gone:
        log.info("tables removed from source.tables: no longer captured (what was landed stays)", tables=gone)
    return marks, jobs


def parse_tables(tables: list[str]) -> list[TableId]:
    """A reloaded ``source.tables`` list, or a ConfigError saying what is wrong with it."""
    try:
        new = [TableId.parse(t) for t in tables]
    except ValueError as exc:
        raise ConfigError(f"table reload: {exc}") from None
    if not new or len(set(new)) != len(new):
        raise ConfigError(f"table reload: the list {tables!r} must name each table once, and at least one")
    return new


def check_table(name: str, configured: list[TableId]) -> TableId:
    """``name`` as a configured table, or a ConfigError naming the configured list."""
    try:
        table = TableId.parse(name)
    except ValueError as exc:
        raise ConfigError(f"snapshot request: {exc}") from None
    if table not in configured:
        listed = ", ".join(str(t) for t in configured)
        raise ConfigError(f"snapshot request: table {name!r} is not captured; source.tables lists: {listed}")
    return table


# -- the checkpoint's form, shared by every source's fold --------------------------------------------------

INCREMENTAL_KINDS = (MarkKind.INCREMENTAL_START, MarkKind.INCREMENTAL_CHUNK, MarkKind.INCREMENTAL_REREAD,
                     MarkKind.INCREMENTAL_DONE, MarkKind.TABLES, MarkKind.TABLE_REPLACED)


def fold_incremental(state: dict[str, Any], mark: Mark) -> None:
    """Fold one incremental-snapshot Mark into the source state (``state`` is the fold's own copy).

    ``state["incremental"]`` maps a table to ``{"where", "last_key", "rows", "chunks", "lw", "status"}``, plus
    ``"reread"`` (the keys waiting to be read again, when there are) and ``"repairs": true`` (a whole-table
    snapshot begun after its table was flagged replaced);
    ``state["incremental_queued"]`` lists the requests not started yet (``{"table", "where"}``, in order);
    ``state["tables"]`` is the captured table list (what a restart compares ``source.tables`` with);
    ``state["tables_needing_snapshot"]`` maps a replaced table to why, until a repairing snapshot completes.
    """
    kind = mark.kind
    queued = list(state.get("incremental_queued") or [])
    if kind is MarkKind.TABLES:
        state["tables"] = list(mark.detail["tables"])
        if queued:
            state["incremental_queued"] = [q for q in queued if q["table"] in state["tables"]]
        stale = {t: why for t, why in (state.get("tables_needing_snapshot") or {}).items() if t in state["tables"]}
        if stale:
            state["tables_needing_snapshot"] = stale
        else:
            state.pop("tables_needing_snapshot", None)
        return
    table = mark.detail["table"]
    if kind is MarkKind.TABLE_REPLACED:
        state["tables_needing_snapshot"] = {**(state.get("tables_needing_snapshot") or {}),
                                            table: mark.detail["why"]}
        return
    if kind is MarkKind.INCREMENTAL_START and mark.detail.get("queued"):
        state["incremental_queued"] = [*queued, {"table": table, "where": mark.detail.get("where")}]
        return
    jobs = {k: dict(v) for k, v in (state.get("incremental") or {}).items()}
    if kind is MarkKind.INCREMENTAL_START:
        if queued:  # the table's snapshot begins: it replaces every request of the table queued before
            state["incremental_queued"] = [q for q in queued if q["table"] != table]
        jobs[table] = {"where": mark.detail.get("where"), "last_key": None, "rows": 0, "chunks": 0, "lw": None,
                       "status": "running"}
        if mark.detail.get("repairs"):
            jobs[table]["repairs"] = True
    elif kind in (MarkKind.INCREMENTAL_CHUNK, MarkKind.INCREMENTAL_REREAD):
        entry = jobs.get(table)
        if entry is None or entry.get("status") != "running":
            return  # a chunk of a job the checkpoint no longer runs (replaced, or the table was removed)
        if kind is MarkKind.INCREMENTAL_REREAD:
            held = list(entry.get("reread") or [])
            entry["reread"] = held + [k for k in mark.detail["keys"] if k not in held]
        else:
            entry["last_key"] = mark.detail["last_key"]
            entry["rows"] = int(entry.get("rows", 0)) + int(mark.detail["rows"])
            entry["chunks"] = int(entry.get("chunks", 0)) + 1
            if entry.get("lw") is None:
                entry["lw"] = mark.detail["lw"]
            entry.pop("reread", None)
            if mark.detail.get("reread"):
                entry["reread"] = list(mark.detail["reread"])
        jobs[table] = entry
    elif kind is MarkKind.INCREMENTAL_DONE:
        entry = jobs.get(table)
        if entry is None:
            return
        why = mark.detail.get("failed") or mark.detail.get("cancelled")
        entry["status"] = "failed" if mark.detail.get("failed") else "cancelled" if why else "done"
        if why:
            entry["error"] = why
        entry.pop("reread", None)
        if entry.pop("repairs", False) and not why and state.get("tables_needing_snapshot"):
            stale = dict(state["tables_needing_snapshot"])
            stale.pop(table, None)
            state["tables_needing_snapshot"] = stale
            if not stale:
                del state["tables_needing_snapshot"]
        jobs[table] = entry
    state["incremental"] = jobs


def jobs_from_state(state: Mapping[str, Any], captured: list[TableId]) -> list[SnapshotJob]:
    """The checkpoint's running incremental snapshots of tables still captured, to resume, then its queued
    requests."""
    out: list[SnapshotJob] = []
    for name, entry in (state.get("incremental") or {}).items():
        table = TableId.parse(name)
        if entry.get("status") != "running" or table not in captured:
            continue
        lw = entry.get("lw")
        out.append(SnapshotJob(table, entry.get("where"), entry.get("last_key"), int(entry.get("rows", 0)),
                               int(entry.get("chunks", 0)), position_from_json(lw) if lw else None,
                               "queued", True, reread={tuple(k): list(k) for k in entry.get("reread") or []},
                               repairs=bool(entry.get("repairs"))))
    for q in state.get("incremental_queued") or []:  # requested, not started: they start from the beginning
        table = TableId.parse(q["table"])
        if table in captured:
            out.append(SnapshotJob(table, q.get("where")))
    return out


def stale_from_state(stale: Mapping[str, str], captured: list[TableId]) -> dict[TableId, str]:
    """The checkpoint's replaced tables (``tables_needing_snapshot``, a source state's ``stale``) that are still
    captured, for ``Incremental.resume``."""
    return {t: why for t, why in ((TableId.parse(name), why) for name, why in stale.items()) if t in captured}
