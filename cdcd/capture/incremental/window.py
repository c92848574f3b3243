"""An incremental snapshot's chunk and its window: the job, the chunk as read, the source's reader contract, and
the rule that drops a chunk's rows a streamed change superseded (docs/runtime.md, "Incremental snapshots")."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import pyarrow as pa
import pyarrow.compute as pc

from cdcd.errors import ConfigError
from cdcd.events import ChangeBlock, ChangeEvent, Item, Mark, MarkKind, Op, RowBlock, TableId, TableSchema
from cdcd.landing.keyrange import KeyRange, key_kind, parse_where
from cdcd.positions import Position


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

    def rereads(self, chunk: Chunk, key_json: Callable[[TableSchema, tuple[Any, ...]], list[Any]]) -> None:
        """The job's re-read keys after ``chunk``: the ones it read are settled, unless a change in its window
        left them without a column; so is every row of the chunk such a change took."""
        job = chunk.job
        read = {tuple(k) for k in chunk.reread}
        for k in read:
            job.reread.pop(k, None)
        partial = self.partial(chunk)
        if not partial:
            return
        found = rows_with(chunk.data, chunk.schema.key, partial)
        for key in partial:
            text = key_json(chunk.schema, key)
            if key in found or tuple(text) in read:
                job.reread.setdefault(tuple(text), text)

    def deliver(self, chunk: Chunk, at: Position,
                key_json: Callable[[TableSchema, tuple[Any, ...]], list[Any]] | None,
                stale: dict[TableId, str]) -> list[Item]:
        """The chunk's rows no change after its LW touched, and its marks, at ``at`` (its HW or later). A
        repairing snapshot's last chunk takes its table off ``stale``; ``key_json``: as ``Incremental.key_json``."""
        job = chunk.job
        touched, truncated = self.touched(chunk)
        if key_json is not None:
            self.rereads(chunk, key_json)
        self.prune(chunk)
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
                    stale.pop(job.table, None)
            else:
                covered = recorded_range(job.where, chunk.schema)
                if covered is not None:
                    out.append(Mark(MarkKind.SNAPSHOT_COVERED, at, {"table": table, "below": job.below,
                                                                    "range": covered.to_json()}))
            out.append(Mark(MarkKind.INCREMENTAL_DONE, at, {"table": table}))
        chunk.emitted.set()
        return out


def recorded_range(where: str, schema: TableSchema) -> KeyRange | None:
    """The key range a ``where`` re-sync covers; None for a condition accepted before conditions were checked
    (a request queued by an older cdcd): it re-reads its rows and records nothing, as then."""
    key = schema.key
    kind = key_kind(schema.column(key[0]).source_type) if len(key) == 1 else "other"
    try:
        return parse_where(where, key, str(schema.table), kind)
    except ConfigError:
        return None


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
