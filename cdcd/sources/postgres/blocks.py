"""Row messages into ``ChangeBlock``s: where the stream cuts the runs of row messages and how the blocks of one
socket read share their conversion.

The stream (``stream.py``) hands every socket read's pgoutput messages to a ``Blocks``: the consecutive row
messages of one relation inside one transaction gather in the relation's ``BlockBuilder`` (``columnar.py``), cut
at any other message (Begin, Commit, Relation, Truncate, ...), at a row of another relation and at
``BLOCK_ROWS`` rows or ``BLOCK_BYTES`` bytes. A block may span socket reads: the server sends a transaction's
changes after its commit (protocol 1) or cdcd replays it from its spool (protocol 2), so its Commit follows its
rows without waiting for the source, and a block per read would be a few dozen wide rows, too few for the
per-column work to pay. The other way round, the blocks of many small transactions of one read are converted
together (``_Pending``) and go out as slices, one per transaction.
"""

from __future__ import annotations

import operator
import re
import time
from dataclasses import dataclass
from datetime import datetime

from cdcd.events import Item, Mark, MarkKind, TableSchema
from cdcd.positions import PgPosition
from cdcd.sources.postgres.columnar import BlockBuilder
from cdcd.sources.postgres.wire import pgoutput

#: A ChangeBlock is cut at this many rows or wire bytes: bounds the memory a block holds while it is gathered
#: and converted (about three times its wire bytes at the peak: the joined messages, the Arrow columns, the
#: landed table), and is still enough rows for the per-column work to pay (700 rows of 1.5 kB).
BLOCK_ROWS = 8192
BLOCK_BYTES = 1 << 20
#: How long decoded rows may wait for the next socket reads, which then share their conversion: with small
#: transactions arriving one per read, a conversion per transaction is most of the event loop's time.
HOLD_S = 0.002
ROW_TAGS = frozenset(b"IUD")
_ROW_RUN = re.compile(rb"[IUD]+")
_TAG = operator.itemgetter(0)
_OID_BYTES = operator.itemgetter(slice(1, 5))
_UNPACK_OID = pgoutput._I.unpack_from


def segments(chunk: list[bytes]) -> list[tuple[bool, list[bytes]]]:
    """``chunk`` cut into runs of row messages (True) and the messages between them (False), in order."""
    tags = bytes(map(_TAG, chunk))
    out: list[tuple[bool, list[bytes]]] = []
    at = 0
    for run in _ROW_RUN.finditer(tags):
        a, b = run.span()
        if a > at:
            out.append((False, chunk[at:a]))
        out.append((True, chunk[a:b]))
        at = b
    if at < len(chunk):
        out.append((False, chunk[at:]))
    return out


def _bulk_run(part: list[bytes], builders: dict[int, BlockBuilder | None], block: BlockBuilder | None,
              rows: int, size: int) -> tuple[BlockBuilder | None, bool, int] | None:
    """A run of row messages taken whole: its table's builder (None: not captured), whether its first row cuts
    the open run (``block``, with ``rows`` rows of ``size`` wire bytes), its wire bytes. None when it spans
    tables or the open run would be cut inside it: the caller then takes it message by message, with the same
    cuts (``BLOCK_ROWS``, ``BLOCK_BYTES``) either way."""
    if len(set(map(_OID_BYTES, part))) != 1:
        return None
    (oid,) = _UNPACK_OID(part[0], 1)
    builder = builders.get(oid)
    cut = builder is not block or size >= BLOCK_BYTES or rows >= BLOCK_ROWS
    if builder is None:
        return None, cut, 0
    total = sum(map(len, part))
    held, had = (0, 0) if cut else (size, rows)
    if held + total - len(part[-1]) >= BLOCK_BYTES or had + len(part) - 1 >= BLOCK_ROWS:
        return None
    return builder, cut, total


@dataclass(slots=True)
class _Run:
    """Consecutive row messages of one relation in one transaction, waiting in their builder."""

    builder: BlockBuilder
    rows: int
    start: PgPosition
    tx_id: str | None
    commit_ts: datetime | None


class _Pending:
    """The items decoded from one socket read, in order, until they go out together.

    Each run of row messages becomes a ``ChangeBlock`` of its own (one transaction, as the runtime's skip
    rule and the landing's metadata columns expect), but the conversion runs once per builder for all its
    runs, and the block of each run is a zero-copy slice of that. At 400 commits of 50 rows per second, one
    per socket read, a build per transaction kept the event loop busy (profiled: 85% of its time in
    ``BlockBuilder.build``), so runs wait up to ``HOLD_S`` for the reads after them.
    """

    __slots__ = ("due", "items", "rows", "runs", "size")

    def __init__(self) -> None:
        self.items: list[Item | _Run] = []
        self.runs = 0
        self.rows = 0
        self.size = 0
        self.due = 0.0  # ``time.monotonic()`` by which the first run goes out

    def add(self, item: Item) -> None:
        self.items.append(item)

    def run(self, builder: BlockBuilder, rows: int, size: int, start: PgPosition, tx_id: str | None,
            commit_ts: datetime | None) -> None:
        if not self.runs:
            self.due = time.monotonic() + HOLD_S
        self.items.append(_Run(builder, rows, start, tx_id, commit_ts))
        self.runs += 1
        self.rows += rows
        self.size += size

    def full(self) -> bool:
        """Bounds what the runs hold in their builders, as the open run's cuts do."""
        return self.rows >= BLOCK_ROWS or self.size >= BLOCK_BYTES

    def flush(self) -> list[Item]:
        items, self.items, self.runs, self.rows, self.size = self.items, [], 0, 0, 0
        runs = [r for r in items if type(r) is _Run]
        if not runs:
            return items  # type: ignore[return-value]
        counts: dict[BlockBuilder, int] = {}
        for r in runs:
            counts[r.builder] = counts.get(r.builder, 0) + r.rows
        built = {b: b.build(PgPosition(0, 0), None, None, n) for b, n in counts.items()}
        offsets = dict.fromkeys(counts, 0)
        out: list[Item] = []
        for item in items:
            if type(item) is not _Run:
                out.append(item)  # type: ignore[arg-type]
                continue
            whole = built[item.builder]
            at = offsets[item.builder]
            offsets[item.builder] = at + item.rows
            part = whole if item.rows == whole.rows else whole.slice(at, item.rows)
            part.start, part.tx_id, part.commit_ts = item.start, item.tx_id, item.commit_ts
            out.append(part)
        return out



class Blocks:
    """Where the decoding of one replication connection stands: the transaction (its commit LSN, the seq of its
    last item, its xid and commit time), the run of row messages being gathered (its builder, the seq of its
    first row, its rows and wire bytes), the builders of the captured relations, and the items waiting to go out
    (``pending``). Between transactions (no Begin without its Commit yet): ``in_tx`` False; ``reached``: the
    highest WAL position an item took (a keepalive's position becomes a mark only beyond it)."""

    __slots__ = ("block", "builders", "commit_lsn", "commit_ts", "first", "in_tx", "pending", "reached", "rows",
                 "seq", "size", "xid")

    def __init__(self, reached: int) -> None:
        self.builders: dict[int, BlockBuilder | None] = {}  # by relation OID; None: a table not captured
        self.pending = _Pending()
        self.commit_lsn = 0
        self.seq = 0
        self.xid: str | None = None
        self.commit_ts: datetime | None = None
        self.block: BlockBuilder | None = None
        self.first = self.rows = self.size = 0
        self.in_tx = False
        self.reached = reached

    def schema_changes(self, changes: list[TableSchema]) -> None:
        """A schema-change mark per table a Relation message just changed (``changes``, emptied), for the landing
        zone's record (docs/landing-format.md, ``schema_changes``). Its position is the transaction's last one
        taken (the Relation takes none: the server sends it again after a restart only when its cache asks, so a
        seq of its own would renumber the rows after it): below the rows it comes before."""
        for new in changes:
            self.pending.add(Mark(MarkKind.SCHEMA, PgPosition(self.commit_lsn, self.seq),
                                  {"table": str(new.table), "change": new, "ddl": None}))
        changes.clear()

    def take_run(self, part: list[bytes]) -> bool:
        """A run of row messages taken whole when it is one table's and no cut falls inside it (``_bulk_run``);
        False: the caller takes it message by message (``add_row``), with the same cuts."""
        bulk = _bulk_run(part, self.builders, self.block, self.rows, self.size)
        if bulk is None:
            return False
        builder, cut, total = bulk
        if cut:  # as ``add_row`` cuts at the run's first row
            self.cut()
            self.block, self.first, self.rows, self.size = builder, self.seq + 1, 0, 0
        if builder is not None:
            builder.add_all(part)
            self.rows += len(part)
            self.size += total
        self.seq += len(part)
        return True

    def add_row(self, data: bytes) -> bool:
        """One row message. True when the run it cut filled ``pending``: flush it before the next message."""
        self.seq += 1
        (oid,) = _UNPACK_OID(data, 1)
        builder = self.builders.get(oid)
        full = False
        if builder is not self.block or self.size >= BLOCK_BYTES or self.rows >= BLOCK_ROWS:
            if self.block is not None and self.rows:
                self.pending.run(self.block, self.rows, self.size, PgPosition(self.commit_lsn, self.first),
                                 self.xid, self.commit_ts)
                full = self.pending.full()
            self.block, self.first, self.rows, self.size = builder, self.seq, 0, 0
        if builder is not None:  # None: a table not captured (a seq gap: the next row opens a run)
            builder.add(data)
            self.rows += 1
            self.size += len(data)
        return full

    def cut(self) -> None:
        """The open run, when it has rows, goes to ``pending`` (the caller opens the next one, or none)."""
        if self.block is not None and self.rows:
            self.pending.run(self.block, self.rows, self.size, PgPosition(self.commit_lsn, self.first), self.xid,
                             self.commit_ts)

    def end_run(self) -> None:
        """A message that is no row: the open run goes to ``pending`` and none is open."""
        if self.block is not None:
            self.cut()
            self.block, self.rows = None, 0
