"""The event model shared by every source, the runtime and the sinks.

A source turns the database's change stream into ``ChangeEvent`` values (row
changes), ``ChangeBlock`` values (consecutive streamed row changes of one table
in one transaction, as Arrow columns), ``RowBlock`` values (many rows of one
table at one position, already in Arrow columns: bulk snapshot reads) and
``Mark`` values (position-only progress such as heartbeats or "table snapshot
finished"). All are ``Item``s: totally ordered by position, batched by the
runtime and committed through the commit barrier. ChangeEvents and the rows of
ChangeBlocks and RowBlocks are landed.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from cdcd.positions import Position


class Op(enum.StrEnum):
    """The `_cdc_op` codes of the landing format."""

    CREATE = "c"
    UPDATE = "u"
    DELETE = "d"
    READ = "r"  # snapshot row
    TRUNCATE = "t"


@dataclass(frozen=True, slots=True, order=True)
class TableId:
    """A captured table. For MySQL/MariaDB ``schema`` is the database name."""

    schema: str
    name: str

    def __str__(self) -> str:
        return f"{self.schema}.{self.name}"

    @classmethod
    def parse(cls, text: str) -> TableId:
        schema, sep, name = text.partition(".")
        if not sep or not schema or not name or "." in name:
            raise ValueError(f"table {text!r} must be written as 'schema.table'")
        return cls(schema, name)


@dataclass(frozen=True, slots=True)
class Fill:
    """The value the rows a table had when a column was added hold in that column (its constant default: the
    source did not rewrite them, so no change event carries it). ``value`` is of the column's Arrow type."""

    value: Any


@dataclass(frozen=True, slots=True)
class Column:
    """A column as landed: its name, its Arrow type and the source's type name.

    ``id`` is the column's identity in its table where the source knows it (PostgreSQL's ``attnum``; a number
    cdcd gives each MySQL/MariaDB column): a rename keeps it, a column dropped and added again gets a new one.
    ``fill`` is set on the schema version that added the column when the rows existing then hold a value in it.
    """

    name: str
    type: pa.DataType
    source_type: str
    nullable: bool = True
    id: int | None = None
    fill: Fill | None = None


@dataclass(frozen=True, slots=True)
class TableSchema:
    """A table's shape at some point of the stream.

    ``version`` increases with every schema change the source sees, so sinks
    can tell cheaply whether two events share a schema.
    """

    table: TableId
    columns: tuple[Column, ...]
    key: tuple[str, ...]
    version: int = 0

    @property
    def column_names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.columns)

    def column(self, name: str) -> Column:
        for c in self.columns:
            if c.name == name:
                return c
        raise KeyError(f"column {name!r} is not in {self.table}")


Row = dict[str, Any]


@dataclass(slots=True)
class ChangeEvent:
    """One row change.

    ``after`` holds the new row for c/u/r; ``before`` the old row (or at least
    its key) for u/d where the source has it. ``unavailable`` names columns
    whose new value the source did not send (unchanged TOAST): they are not
    NULL, they are unknown, and consumers keep the old value.
    """

    op: Op
    schema: TableSchema
    position: Position
    before: Row | None = None
    after: Row | None = None
    tx_id: str | None = None
    commit_ts: datetime | None = None
    snapshot: bool = False
    unavailable: tuple[str, ...] = ()

    @property
    def table(self) -> TableId:
        return self.schema.table

    def key_of(self, row: Row | None) -> tuple[Any, ...] | None:
        if row is None:
            return None
        return tuple(row.get(k) for k in self.schema.key)

    @property
    def key(self) -> tuple[Any, ...] | None:
        """The key after the change (the deleted key for deletes)."""
        if self.op is Op.DELETE:
            return self.key_of(self.before)
        return self.key_of(self.after)

    @property
    def before_key(self) -> tuple[Any, ...] | None:
        """The old key of an update that changed the key, else None."""
        if self.op is not Op.UPDATE or self.before is None or not self.schema.key:
            return None
        old = self.key_of(self.before)
        return old if old != self.key_of(self.after) else None


@dataclass(slots=True)
class RowBlock:
    """Rows of one table that share op and position, as Arrow columns (a bulk snapshot chunk).

    ``data`` holds the table's columns in ``schema`` order and in their landed
    Arrow types, so the sink only appends the ``_cdc_`` columns. Each row
    counts as one event (batch size, metrics, checkpoint counts), and the
    runtime may split a block between batches (``slice``). Key-ordered
    sources resume after ``last_key``; where a key value's landed form cannot be
    turned back into the source's value (PostgreSQL NaN, ±infinity, arrays),
    ``key_text`` carries the source's own text of each row's key columns (one
    string array per key column, None for a column whose landed value is exact).
    """

    schema: TableSchema
    position: Position
    data: pa.Table
    op: Op = Op.READ
    snapshot: bool = True
    tx_id: str | None = None
    commit_ts: datetime | None = None
    key_text: tuple[pa.Array | None, ...] | None = None

    @property
    def table(self) -> TableId:
        return self.schema.table

    @property
    def rows(self) -> int:
        return int(self.data.num_rows)

    def slice(self, offset: int, length: int | None = None) -> RowBlock:
        """Rows ``offset`` to ``offset + length`` (zero-copy)."""
        texts = None if self.key_text is None else tuple(
            None if t is None else t.slice(offset, length) for t in self.key_text)
        return RowBlock(self.schema, self.position, self.data.slice(offset, length), self.op, self.snapshot,
                        self.tx_id, self.commit_ts, texts)

    def last_key_text(self) -> tuple[str | None, ...] | None:
        """``key_text`` of the last row (None entries: use the landed value), None without key_text."""
        if self.key_text is None or not self.rows:
            return None
        return tuple(None if t is None else t[self.rows - 1].as_py() for t in self.key_text)

    def key_at(self, index: int) -> tuple[Any, ...] | None:
        """The key values of row ``index`` as Python values (None for a table without a key)."""
        if not self.schema.key:
            return None
        return tuple(self.data.column(k)[index].as_py() for k in self.schema.key)

    @property
    def last_key(self) -> tuple[Any, ...] | None:
        return self.key_at(self.rows - 1) if self.rows else None

    def events(self) -> list[ChangeEvent]:
        """The rows as ChangeEvents (slow: for tests, and for callers that need Python rows)."""
        deleted = self.op is Op.DELETE
        return [ChangeEvent(self.op, self.schema, self.position, before=row if deleted else None,
                            after=None if deleted else row, tx_id=self.tx_id, commit_ts=self.commit_ts,
                            snapshot=self.snapshot)
                for row in self.data.to_pylist()]


#: ``ChangeBlock.before_kind`` codes: no old row, the old key (replica identity columns only), the whole old row.
BEFORE_NONE, BEFORE_KEY, BEFORE_FULL = 0, 1, 2
_OPS = {"c": Op.CREATE, "u": Op.UPDATE, "d": Op.DELETE}


@dataclass(slots=True)
class ChangeBlock:
    """Consecutive streamed row changes of one table and schema version inside one transaction, as Arrow columns.

    Row ``i`` is the change a ``ChangeEvent`` would carry at ``position_at(i)``: the positions of a block are
    its first row's position (``start``) and the next ``rows - 1`` sequence numbers, so ``position`` (the
    last row's, what the runtime and the checkpoint look at) and every row's come from ``start`` alone.

    * ``ops``: each row's ``_cdc_op`` code (c, u or d);
    * ``data``: the landed values in ``schema`` order and landed types: the new row of c/u, the old row of d
      (as ``ChangeEvent``: a delete lands its ``before``); unavailable values are NULL;
    * ``before`` (None when no row has one): each row's old values, NULL where ``before_kind`` is
      ``BEFORE_NONE``; for ``BEFORE_KEY`` rows only the ``identity`` columns belong to the old row;
    * ``unavailable`` (None when no row has any): each row's unavailable (unchanged TOAST) column names;
    * ``key_changed`` (None when no row changed its key): updates whose old key differs from the new one;
    * ``seqs`` (None: the rows' sequence numbers are consecutive from ``start``): each row's sequence number,
      increasing, for sources whose row positions have gaps (MySQL/MariaDB: a rows event's first row follows
      the seq its event's offset gives). ``start`` is the first row's position either way.

    ``events()`` gives the ChangeEvents (slow: for tests and for callers that need Python rows).
    """

    schema: TableSchema
    start: Position
    ops: pa.Array
    data: pa.Table
    before: pa.Table | None = None
    before_kind: pa.Array | None = None
    identity: tuple[str, ...] = ()
    unavailable: tuple[tuple[str, ...], ...] | None = None
    key_changed: pa.Array | None = None
    tx_id: str | None = None
    commit_ts: datetime | None = None
    snapshot: bool = False
    seqs: pa.Array | None = None

    @property
    def table(self) -> TableId:
        return self.schema.table

    @property
    def rows(self) -> int:
        return int(self.data.num_rows)

    def seq_at(self, index: int) -> int:
        """Row ``index``'s sequence number."""
        if self.seqs is None:
            return int(self.start.seq) + index
        return int(self.seqs[index].as_py())

    def position_at(self, index: int) -> Position:
        return dataclasses.replace(self.start, seq=self.seq_at(index))

    def positions(self) -> list[Position]:
        """Every row's position (``position_at`` of each row, made in one pass)."""
        start = self.start
        numbers = range(start.seq, start.seq + self.rows) if self.seqs is None else self.seqs.to_pylist()
        return [dataclasses.replace(start, seq=n) for n in numbers]

    @property
    def position(self) -> Position:
        """The last row's position."""
        return self.position_at(self.rows - 1)

    def slice(self, offset: int, length: int | None = None) -> ChangeBlock:
        """Rows ``offset`` to ``offset + length`` (zero-copy for the Arrow parts)."""
        end = self.rows if length is None else min(self.rows, offset + length)
        return ChangeBlock(
            self.schema, self.position_at(offset), self.ops.slice(offset, end - offset),
            self.data.slice(offset, end - offset),
            None if self.before is None else self.before.slice(offset, end - offset),
            None if self.before_kind is None else self.before_kind.slice(offset, end - offset), self.identity,
            None if self.unavailable is None else self.unavailable[offset:end],
            None if self.key_changed is None else self.key_changed.slice(offset, end - offset),
            self.tx_id, self.commit_ts, self.snapshot,
            None if self.seqs is None else self.seqs.slice(offset, end - offset))

    def after(self, position: Position) -> ChangeBlock | None:
        """The rows whose position is above ``position`` (None: no row is); the block itself when all are."""
        if self.start > position:  # type: ignore[operator]
            return self
        if self.position <= position:  # type: ignore[operator]
            return None
        # Only a position of this block's transaction (same commit point) can fall inside it.
        if self.seqs is None:
            return self.slice(position.seq - self.start.seq + 1)
        seqs = self.seqs.to_numpy(zero_copy_only=False)
        return self.slice(int(np.searchsorted(seqs, position.seq, side="right")))

    def position_parts(self) -> tuple[str, np.ndarray]:
        """What every row's encoded position is made of: the first row's encoding without its sequence
        number (10 digits), and each row's sequence number."""
        head = self.start.encoded
        seq = self.start.seq
        digits = f"{seq:010d}"
        if not head.endswith(digits):
            raise ValueError(f"position {head} does not end with its sequence number {digits}")
        numbers = np.arange(seq, seq + self.rows, dtype=np.int64) if self.seqs is None \
            else self.seqs.to_numpy(zero_copy_only=False).astype(np.int64)
        return head[: -len(digits)], numbers

    def encoded_positions(self) -> pa.Array:
        """``_cdc_pos`` of every row: the first row's encoding with each row's sequence number."""
        head, numbers = self.position_parts()
        padded = pc.utf8_lpad(pa.array(numbers).cast(pa.string()), 10, "0")
        return pc.binary_join_element_wise(head, padded, "")

    def key_rows(self) -> list[tuple[Any, ...]] | None:
        """Each row's key (``ChangeEvent.key``: the new key, the deleted key for deletes); None without a key."""
        if not self.schema.key:
            return None
        columns = [self.data.column(k).to_pylist() for k in self.schema.key]
        return list(zip(*columns, strict=True))

    def before_keys(self) -> list[tuple[Any, ...] | None]:
        """Each row's ``ChangeEvent.before_key``: the old key of an update that changed it, else None."""
        out: list[tuple[Any, ...] | None] = [None] * self.rows
        if self.key_changed is None or self.before is None or not self.schema.key:
            return out
        changed = np.flatnonzero(self.key_changed.to_numpy(zero_copy_only=False))
        if not len(changed):
            return out
        picked = self.before.select(list(self.schema.key)).take(pa.array(changed))
        columns = [picked.column(k).to_pylist() for k in self.schema.key]
        for i, key in zip(changed.tolist(), zip(*columns, strict=True), strict=True):
            out[i] = key
        return out

    def events(self) -> list[ChangeEvent]:
        """The rows as ChangeEvents (slow: for tests, and for callers that need Python rows)."""
        rows = self.data.to_pylist()
        ops = [_OPS[o] for o in self.ops.to_pylist()]
        olds: list[dict[str, Any] | None] = [None] * self.rows
        if self.before is not None and self.before_kind is not None:
            for i, (kind, old) in enumerate(zip(self.before_kind.to_pylist(), self.before.to_pylist(), strict=True)):
                if kind == BEFORE_FULL:
                    olds[i] = old
                elif kind == BEFORE_KEY:
                    olds[i] = {k: old[k] for k in self.identity}
        missing = self.unavailable or ((),) * self.rows
        positions = self.positions()
        out = []
        for i, (op, row, old, gone) in enumerate(zip(ops, rows, olds, missing, strict=True)):
            deleted = op is Op.DELETE
            out.append(ChangeEvent(op, self.schema, positions[i], before=old, after=None if deleted else row,
                                   tx_id=self.tx_id, commit_ts=self.commit_ts, snapshot=self.snapshot,
                                   unavailable=gone))
        return out

    def touched(self) -> list[tuple[Position, str | None, tuple[Any, ...], bool]]:
        """(position, tx, key, partial) of every key the rows touch, old keys of key changes too (the incremental
        snapshot's window records exactly these of a ChangeEvent: ``key``, with ``partial`` when the row lacks a
        column's value (``unavailable``), and ``before_key``)."""
        keys = self.key_rows()
        if keys is None:
            return []
        olds = self.before_keys() if self.key_changed is not None else None
        missing = self.unavailable
        out: list[tuple[Position, str | None, tuple[Any, ...], bool]] = []
        tx = self.tx_id
        positions = self.positions()
        for i, key in enumerate(keys):
            at = positions[i]
            out.append((at, tx, key, bool(missing and missing[i])))
            if olds is not None and olds[i] is not None:
                out.append((at, tx, olds[i], False))  # type: ignore[arg-type]
        return out


class MarkKind(enum.StrEnum):
    """What a ``Mark`` records. One set for every source; each source's ``fold`` reads the kinds it emits.

    Marks are never landed nor saved (the checkpoint holds what ``fold`` made of them), so the values are
    free to change; they are strings for logs and tests.
    """

    SNAPSHOT_START = "snapshot_start"  # a new snapshot begins at its watermark: the source state starts over
    STREAM_START = "stream_start"  # a first start without a snapshot (snapshot.mode = "never")
    SNAPSHOT_TABLE_START = "snapshot_table_start"  # a table's snapshot begins (MySQL: its schema)
    SNAPSHOT_TABLE_DONE = "snapshot_table_done"  # a table's snapshot rows are all delivered
    SNAPSHOT_DONE = "snapshot_done"  # the whole snapshot is delivered; streaming follows
    COMMIT = "commit"  # a streamed transaction ended
    HEARTBEAT = "heartbeat"  # progress without a transaction (PostgreSQL logical message)
    SCHEMA = "schema"  # a table's new schema (MySQL schema history)
    DDL = "ddl"  # DDL on a captured table that changes no tracked schema
    IDENTITY = "identity"  # the server the positions belong to (PostgreSQL system id/timeline, MySQL server/epoch)
    # a whole-table incremental snapshot is complete: the table's landed rows below ``detail["below"]`` (the first
    # chunk's low watermark) that nothing re-sent are gone from the source (docs/landing-format.md)
    SNAPSHOT_COVERED = "snapshot_covered"
    # incremental snapshots while streaming (cdcd/capture/incremental/; the source's fold keeps their progress)
    INCREMENTAL_START = "incremental_start"  # a table's incremental snapshot begins (detail: table, where)
    INCREMENTAL_CHUNK = "incremental_chunk"  # a chunk's rows are delivered (table, last_key, rows, lw)
    INCREMENTAL_DONE = "incremental_done"  # the table's last chunk is delivered (table)
    # keys an incremental snapshot must read again (table, keys): a key change that did not carry every column
    INCREMENTAL_REREAD = "incremental_reread"
    # a captured table was dropped and re-created (table, why): listed until a whole-table re-snapshot completes
    TABLE_REPLACED = "table_replaced"
    WATERMARK = "watermark"  # an idle binlog reached an incremental snapshot chunk's high watermark (nothing to fold)
    TABLES = "tables"  # the captured table list changed (detail: tables): what a restart compares source.tables to
    # the position was lost (slot gone, binlog purged or reset) and capture goes on from a new one (detail: lost,
    # from, to): the landing zone records the gap, every table is re-snapshotted (cdcd/capture/recovery.py)
    POSITION_LOST = "position_lost"


@dataclass(slots=True)
class Mark:
    """A position-only item: progress the checkpoint must record, nothing to land.

    ``detail`` carries what the source's ``fold`` needs to update its durable state.
    """

    kind: MarkKind
    position: Position
    detail: dict[str, Any] = field(default_factory=dict)


def is_schema_change(mark: Mark) -> bool:
    """A schema change the landing zone records (docs/landing-format.md, ``schema_changes``): a ``SCHEMA`` mark whose
    ``detail["change"]`` holds the table's new ``TableSchema`` (``detail["ddl"]``: the statement, where known)."""
    return mark.kind is MarkKind.SCHEMA and "change" in mark.detail


def lands(mark: Mark) -> bool:
    """A mark the landing zone records (a batch holding one lands even without rows): a completed re-snapshot, a
    schema change, a lost position."""
    return mark.kind is MarkKind.SNAPSHOT_COVERED or mark.kind is MarkKind.POSITION_LOST or is_schema_change(mark)


Item = ChangeEvent | Mark | RowBlock | ChangeBlock


def event_count(item: Item) -> int:
    """How many landed rows an item stands for."""
    if type(item) is ChangeEvent:
        return 1
    if type(item) is RowBlock or type(item) is ChangeBlock:
        return item.rows
    return 0


def snapshot_truncates(schemas: list[TableSchema], watermark: Position) -> list[ChangeEvent]:
    """What a NEW snapshot lands first: one truncate per table at its watermark.

    A snapshot that starts afresh (no checkpoint, or a re-snapshot) supersedes
    whatever an abandoned earlier attempt may have landed: rows it landed that
    the source has deleted since must leave the mirror. The truncate carries
    the snapshot's own position, so it removes every older row and keeps the
    new snapshot's rows (same position) and the stream after it
    (docs/landing-format.md, "Snapshot generations").
    """
    return [ChangeEvent(Op.TRUNCATE, s, watermark, snapshot=True) for s in schemas]
