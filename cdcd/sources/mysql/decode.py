"""Binlog events → ChangeEvents and Marks: a pure function of pymysqlreplication events.

The decoder keeps only what the binlog itself says: the current file, where
the open transaction started, its GTID, the GTID set of completed
transactions, and the schema history. Positions are
``(file, transaction start, seq)``; every item of a transaction carries the
GTID set *before* it, its ``commit`` Mark the set *including* it, so resuming
by GTID from any item restarts at (or right after) its transaction.

Seqs number the transaction's *content*, the same on every server that holds
the transaction (a GTID replica after a failover) and whatever tables are
captured (``source.tables``, a reload): each rows event of any table takes
``1 + its row-image bytes`` seqs (the first for a possible schema mark, then
one per row; a row image is at least one byte), each DDL statement two, the
commit one. Event headers, GTID events (their size differs between a primary
and its replica: commit ids, commit timestamps), table maps, annotations,
checksums and event offsets take none. Rows events of tables that are not
captured are read for their size alone (the reader does not filter tables:
``binlog.py``). Checkpoints of earlier versions numbered by byte offset in the
transaction; the transaction such a checkpoint is inside keeps that numbering
(``legacy_tx``) so nothing of it is skipped or doubled, see ``state.py``.

Row changes go out as ``ChangeBlock``s (``columnar.py``): the rows events of one table and schema version
inside one transaction, cut at any other item (a schema mark, a DDL, the commit) and at a block's size
limits; each row keeps the position the row path gives it. ``columnar=False`` keeps the row path (one
``ChangeEvent`` per row), the reference of the differential tests; rows events rowimage cannot read
(column types it does not decode) take the row path either way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any

from pymysqlreplication import event as bl
from pymysqlreplication import row_event as rows
from pymysqlreplication.constants import NONE_SOURCE

from cdcd.errors import SourceFatal
from cdcd.events import ChangeEvent, Item, Mark, MarkKind, Op, TableId, TableSchema
from cdcd.positions import MySqlPosition, binlog_index
from cdcd.sources.mysql import compat  # noqa: F401  (fixes negative TIME decoding)
from cdcd.sources.mysql.alter import apply_alter
from cdcd.sources.mysql.binlogevents import event_start, refuse_undecoded, row_image_bytes
from cdcd.sources.mysql.columnar import DEFER_BYTES, DEFER_ROWS, BlockBuilder
from cdcd.sources.mysql.ddl import Action, parse_ddl
from cdcd.sources.mysql.gtid import GtidSet, MariaGtidSet, MySqlGtidSet, parse_gtid_set
from cdcd.sources.mysql.rowimage import TableDecoder, compile_table, table_map_signature
from cdcd.sources.mysql.schema import (
    SchemaHistory,
    refine_types,
    same_columns,
    same_shape,
    schema_from_table_map,
    schema_to_json,
)
from cdcd.sources.mysql.types import ZERO_DATE, Converter, ZeroValue, stream_converter, warn_once

_FL_STANDALONE = 1  # MariaDB GTID flag: the transaction is one statement (DDL), no XID follows
_FL_PREPARED_XA = 64  # MariaDB GTID flag: the group is an XA transaction's XA PREPARE (its rows)
_TX_CONTROL = ("BEGIN", "COMMIT", "ROLLBACK", "SAVEPOINT", "XA ", "RELEASE SAVEPOINT")


@dataclass
class _Decoded:
    schema: TableSchema
    convert: list[tuple[str, Converter]]
    fast: TableDecoder | None  # None: a column type rowimage does not read; pymysqlreplication decodes


def altered_mark(history: SchemaHistory, table: TableId, slot: MySqlPosition, actions: tuple[Action, ...],
                 flavor: str, query: str) -> Mark | None:
    """An ALTER TABLE of a captured table at ``slot``: a schema mark with the new version, when it changed a column
    (a length or an order too, not only the Arrow shape); None when it changed none (the next table map then
    defines the shape)."""
    current = history.at(table, replace(slot, seq=slot.seq - 1))  # the shape before the ALTER
    if current is None:
        return None
    altered = apply_alter(current, actions, history.next_id(table), flavor)
    if altered is None or same_columns(altered.schema, current):  # None: a clause the schema cannot take
        return None
    new = history.record(slot, altered.schema)
    detail = {"table": str(table), "schema": schema_to_json(new), "reason": "ddl",
              "ddl": query[:2000], "change": new}  # "change": the landing zone records it
    if altered.unknown:  # the source has the table read again (source.py, _judge_mark)
        detail["unknown"] = [list(u) for u in altered.unknown]
    return Mark(MarkKind.SCHEMA, slot, detail)


class Decoder:
    """Turns the binlog event sequence of one connection into items."""

    def __init__(self, flavor: str, tables: set[TableId], history: SchemaHistory, file: str, gtid: str,
                 epoch: int = 0, columnar: bool = True, defer_builds: bool = False,
                 legacy_tx: tuple[int, int, int] | None = None) -> None:
        self.flavor = flavor
        self.columnar = columnar  # row changes as ChangeBlocks; False: one ChangeEvent per row
        #: hand on small blocks' BlockBuilders unbuilt (DEFER_ROWS, DEFER_BYTES), for ``columnar.build_blocks``
        self.defer_builds = defer_builds
        self.epoch = epoch  # the server epoch of every position (cdcd.positions.MySqlPosition)
        self.tables = tables
        self.history = history
        self.file = file
        self.file_index = binlog_index(file) if file else 0
        self.gtid: GtidSet = parse_gtid_set(flavor, gtid)
        self._gtid_text = str(self.gtid)
        self.tx_start: int | None = None
        self.tx_gtid: tuple[Any, ...] | None = None
        self.tx_standalone = False
        self.tx_explicit = False
        self.tx_xa = False  # the open group is the XA PREPARE part of a two-phase XA transaction
        self.seq = 0
        self.tx_events = 0
        #: (epoch, file index, transaction start) of a transaction an earlier version's checkpoint is inside: its
        #: seqs stay byte offsets in the transaction, as that version numbered them (``_legacy`` while in it)
        self.legacy_tx = legacy_tx
        self._legacy = False
        self.last_ts: datetime | None = None
        #: table id -> (its last table-map event, how it decodes, the table map's shape, the history's schema)
        self._decoded: dict[int, tuple[Any, _Decoded, tuple[Any, ...], TableSchema]] = {}
        self._block: BlockBuilder | None = None  # rows gathered for the next ChangeBlock

    @property
    def pending(self) -> bool:
        """Rows read but not yet handed out (a block being gathered)."""
        return self._block is not None

    def _flush(self) -> Item:
        block = self._block
        assert block is not None
        self._block = None
        if self.defer_builds and block.rows < DEFER_ROWS and block.size < DEFER_BYTES:
            return block  # type: ignore[return-value]  # built by columnar.build_blocks before anyone reads it
        return block.build()

    def gtids_read(self) -> GtidSet:
        """A copy of the GTID set of every transaction read so far (``gtid`` itself changes as the stream goes)."""
        return parse_gtid_set(self.flavor, self._gtid_text)

    # ------------------------------------------------------------------ helpers
    def _pos(self) -> MySqlPosition:
        self.seq += 1
        assert self.tx_start is not None
        return MySqlPosition(self.file_index, self.tx_start, self.seq, self.file, self._gtid_text, self.epoch)

    def _begin(self, ev: Any, gtid: tuple[Any, ...] | None, standalone: bool, explicit: bool) -> None:
        self.tx_start = event_start(ev)
        self.tx_gtid = gtid
        self.tx_standalone = standalone
        self.tx_explicit = explicit
        self.tx_xa = False
        self.seq = 0
        self.tx_events = 0
        self._legacy = self.legacy_tx is not None and self.legacy_tx == (self.epoch, self.file_index, self.tx_start)

    def _reserve(self, seqs: int) -> None:
        """Move past seqs an event takes whether or not it yields items (content numbering, module doc)."""
        if self.tx_start is not None and not self._legacy:
            self.seq += seqs

    @property
    def tx_id(self) -> str:
        g = self.tx_gtid
        if g is None:
            return f"{self.file}:{self.tx_start}"
        if len(g) == 3:
            return f"{g[0]}-{g[1]}-{g[2]}"
        return f"{g[0]}:{g[1]}"

    def _commit(self, ev: Any) -> list[Item]:
        if self.tx_start is None:
            return []
        g = self.tx_gtid
        if g is not None:
            if isinstance(self.gtid, MariaGtidSet) and len(g) == 3:
                self.gtid.add(g[0], g[1], g[2])
            elif isinstance(self.gtid, MySqlGtidSet) and len(g) == 2:
                self.gtid.add(g[0], g[1])
            self._gtid_text = str(self.gtid)
        self.seq += 1
        pos = MySqlPosition(self.file_index, self.tx_start, self.seq, self.file, self._gtid_text, self.epoch)
        mark = Mark(MarkKind.COMMIT, pos,
                    {"events": self.tx_events, "tx": self.tx_id, "next_pos": int(ev.packet.log_pos)})
        self.tx_start = None
        self.tx_gtid = None
        return [mark]

    def _ts(self, ev: Any) -> datetime:
        ts = datetime.fromtimestamp(ev.timestamp, UTC)
        self.last_ts = ts
        return ts

    def _schema_for(self, ev: Any, table: TableId, items: list[Item]) -> _Decoded:
        # Every rows event takes a seq for a possible schema mark, emitted or not, so positions depend only
        # on the binlog, never on what the history already knew: a replay numbers events exactly as before.
        slot = self._pos()
        tmap = ev.table_map[ev.table_id]
        cached = self._decoded.get(ev.table_id)
        if cached is not None and cached[0] is tmap:
            return cached[1]
        current = self.history.at(table, slot)
        # Each transaction brings a new table-map event: the same columns under the same history schema
        # decode the same way, without deriving the schema again (13% of the binlog thread's time with
        # transactions of 50 rows).
        columns = list(tmap.columns)
        shape = (table, table_map_signature(columns), tuple(bool(getattr(c, "is_primary", False)) for c in columns),
                 bool(ev._ignore_decode_errors))
        if cached is not None and cached[2] == shape and cached[3] is current:
            self._decoded[ev.table_id] = (tmap, cached[1], shape, current)
            return cached[1]
        derived = refine_types(schema_from_table_map(table, list(tmap.columns)), current or self.history.latest(table))
        if current is None or not same_shape(current, derived):
            known = current is not None  # else the table's first schema: no change to record
            current = self.history.record(slot, derived)
            detail: dict[str, Any] = {"table": str(table), "schema": schema_to_json(current), "reason": "table map"}
            if known:  # a change no DDL told (one the parser did not read): recorded without a statement
                detail |= {"change": current, "ddl": None}
            items.append(Mark(MarkKind.SCHEMA, slot, detail))
        conv = [(c.name, f) for c in current.columns if (f := stream_converter(c.source_type)) is not None]
        d = _Decoded(current, conv, compile_table(columns, bool(ev._ignore_decode_errors)))
        self._decoded = {ev.table_id: (tmap, d, shape, current)} | {k: v for k, v in self._decoded.items()
                                                                   if k != ev.table_id}
        return d

    @staticmethod
    def _convert(d: _Decoded, row: dict[str, Any], none_sources: dict[str, str]) -> dict[str, Any]:
        """Converts in place: the row dicts are fresh from the decoder and used only here."""
        if none_sources:
            _fix_empty_sets(row, none_sources, d.schema.table)
        for name, f in d.convert:
            v = row.get(name)
            if v is not None:
                try:
                    row[name] = f(v)
                except ZeroValue as exc:  # the zero TIMESTAMP: NULL, as the snapshot lands it
                    warn_once(d.schema.table, name, ZERO_DATE, error=str(exc))
                    row[name] = None
        return row

    # ------------------------------------------------------------------ events
    def feed(self, ev: Any) -> list[Item]:
        handler = _HANDLERS.get(type(ev))
        if handler is None:
            return []
        if self._legacy and self.tx_start is not None:
            # an earlier version's numbering (byte offsets in the transaction), for the one transaction its
            # checkpoint is inside
            self.seq = max(self.seq, event_start(ev) - self.tx_start)
        if self._block is not None and handler is not Decoder._on_rows:
            items = handler(self, ev)
            if items or handler is not Decoder._on_not_implemented:  # annotations keep a block going
                return [self._flush(), *items]
            return items
        return handler(self, ev)

    def _where(self, ev: Any) -> str:
        return f"{self.file}:{event_start(ev)}"

    def _on_not_implemented(self, ev: bl.NotImplementedEvent) -> list[Item]:
        refuse_undecoded(ev, self.file)  # returns for an event that carries no row changes (annotations...)
        return []

    def _on_rotate(self, ev: bl.RotateEvent) -> list[Item]:
        self.file = ev.next_binlog
        self.file_index = binlog_index(self.file)
        return []

    def _on_gtid_list(self, ev: bl.MariadbGtidListEvent) -> list[Item]:
        if isinstance(self.gtid, MariaGtidSet):
            for g in ev.gtid_list:
                self.gtid.add(g.domain_id, g.server_id, g.gtid_seq_no)
            self._gtid_text = str(self.gtid)
        return []

    def _on_maria_gtid(self, ev: bl.MariadbGtidEvent) -> list[Item]:
        standalone = bool(ev.flags & _FL_STANDALONE)
        self._begin(ev, (ev.domain_id, ev.server_id, ev.gtid_seq_no), standalone, not standalone)
        self.tx_xa = bool(ev.flags & _FL_PREPARED_XA)
        return []

    def _on_xa_prepare(self, ev: bl.XAPrepareEvent) -> list[Item]:
        """The end of an XA transaction's XA PREPARE group (MySQL: or of an XA COMMIT ... ONE PHASE)."""
        return self._commit(ev)

    def _on_partial_update(self, ev: rows.PartialUpdateRowsEvent) -> list[Item]:
        if TableId(ev.schema, ev.table) not in self.tables:
            self._reserve(1 + row_image_bytes(ev))
            return []
        raise SourceFatal(
            f"the binlog holds a PARTIAL_UPDATE_ROWS_EVENT for {ev.schema}.{ev.table} at {self._where(ev)}: the "
            "server logs JSON updates as partial diffs (binlog_row_value_options = PARTIAL_JSON), which leave the "
            "new JSON value unknown. SET GLOBAL binlog_row_value_options = '' (and in my.cnf), then re-snapshot: "
            "stop cdcd, move the state directory (state.path) and the landing zone aside and start again")

    def _on_mysql_gtid(self, ev: bl.GtidEvent) -> list[Item]:
        sid, _, gno = ev.gtid.rpartition(":")
        self._begin(ev, (sid, int(gno)), False, False)
        return []

    def _on_xid(self, ev: bl.XidEvent) -> list[Item]:
        return self._commit(ev)

    def _on_query(self, ev: bl.QueryEvent) -> list[Item]:
        query = ev.query.strip()
        head = query[:20].upper()
        if head.startswith("BEGIN") or head.startswith("XA START"):
            if self.tx_start is None:
                self._begin(ev, None, False, True)
            self.tx_explicit = True
            self.tx_xa = self.tx_xa or head.startswith("XA START")
            return []
        if head.startswith("COMMIT") or (head.startswith("ROLLBACK") and not head.startswith("ROLLBACK TO")) \
                or head.startswith("XA COMMIT") or head.startswith("XA ROLLBACK"):
            return self._commit(ev)  # an XA outcome is a group of its own: no rows in it
        if head.startswith(_TX_CONTROL):
            return []
        if self.tx_start is None:
            self._begin(ev, None, True, False)
        schema = ev.schema.decode() if isinstance(ev.schema, bytes) else str(ev.schema or "")
        items = self._ddl(ev, query, schema)
        if self.tx_standalone or not self.tx_explicit:
            items += self._commit(ev)
        return items

    def _ddl(self, ev: Any, query: str, default_db: str) -> list[Item]:
        items: list[Item] = []
        ts = self._ts(ev)
        for ddl in parse_ddl(query, default_db, int(getattr(ev, "sql_mode", 0) or 0)):
            table = ddl.table
            captured = table is not None and (table in self.tables or ddl.new_table in self.tables)
            if not captured and self._legacy:
                continue  # an earlier version's numbering: seqs for captured tables' statements only
            # two seqs per statement, used or not, captured or not: positions depend only on the binlog
            slot, slot2 = self._pos(), self._pos()
            if table is None or not captured:
                continue
            if ddl.kind == "truncate" and table in self.tables:
                current = self.history.at(table, slot)
                if current is not None:
                    self.tx_events += 1
                    items.append(ChangeEvent(Op.TRUNCATE, current, slot, tx_id=self.tx_id, commit_ts=ts))
            elif ddl.kind == "alter" and table in self.tables and ddl.actions:
                mark = altered_mark(self.history, table, slot, ddl.actions, self.flavor, query)
                if mark is not None:
                    items.append(mark)
            elif ddl.kind == "rename" and ddl.new_table is not None:
                moved = self.history.at(table, slot)
                if ddl.new_table in self.tables and moved is not None:
                    columns = tuple(replace(c, fill=None) for c in moved.columns)
                    new = self.history.record(slot, TableSchema(ddl.new_table, columns, moved.key))
                    items.append(Mark(MarkKind.SCHEMA, slot,
                                      {"table": str(ddl.new_table), "schema": schema_to_json(new),
                                       "reason": "rename", "ddl": query[:2000], "change": new}))
                if table in self.tables:
                    items.append(Mark(MarkKind.DDL, slot2, {"table": str(table), "ddl": query[:2000]}))
            elif table in self.tables and ddl.kind in ("drop", "create", "alter"):
                items.append(Mark(MarkKind.DDL, slot2, {"table": str(table), "ddl": query[:2000]}))
        return items

    def _on_rows(self, ev: Any) -> list[Item]:
        size = row_image_bytes(ev)  # before anything decodes the rows (that moves the packet's cursor)
        table = TableId(ev.schema, ev.table)
        if table not in self.tables:
            self._reserve(1 + size)
            return []
        if self.tx_start is None:
            self._begin(ev, None, False, False)
        end = self.seq + 1 + size  # this event's seqs: a schema mark's, then one per row (module doc)
        items = self._rows(ev, table)
        if not self._legacy:
            self.seq = max(self.seq, end)
        return items

    def _rows(self, ev: Any, table: TableId) -> list[Item]:
        if self.tx_xa:
            raise SourceFatal(
                f"the binlog holds a two-phase XA transaction ({self.tx_id}) that changes captured table {table}, "
                f"at {self._where(ev)}: the server logs its rows at XA PREPARE and its outcome (XA COMMIT or XA "
                "ROLLBACK) as a later, separate event group, and cdcd does not stage prepared transactions, so it "
                "cannot tell committed rows from rolled-back ones. Keep captured tables out of XA transactions (or "
                "on MariaDB commit them with XA COMMIT ... ONE PHASE, an ordinary transaction in its binlog), then "
                "re-snapshot: stop cdcd, move the state directory (state.path) and the landing zone aside and start "
                "again")
        items: list[Item] = []
        d = self._schema_for(ev, table, items)
        ts = self._ts(ev)
        block = self._block
        if block is not None and (items or (block.schema is not d.schema and block.schema != d.schema)
                                  or block.fast is not d.fast or block.commit_ts != ts or block.full()):
            items.insert(0, self._flush())
            block = None
        if self.columnar and d.fast is not None:
            kind = "write" if type(ev) is rows.WriteRowsEvent else "update" if type(ev) is rows.UpdateRowsEvent \
                else "delete"
            if block is None:
                assert self.tx_start is not None
                start = MySqlPosition(self.file_index, self.tx_start, self.seq + 1, self.file, self._gtid_text,
                                      self.epoch)
                block = BlockBuilder(d.schema, d.convert, d.fast, start, self.tx_id, ts)
            n = block.add(kind, ev, self.seq + 1)
            if n is not None:
                self.seq += n
                self.tx_events += n
                if block.rows:
                    self._block = block
                    if block.full():
                        items.append(self._flush())
                return items
            if self._block is not None:  # an event rowimage cannot read: the row path, after the block
                items.append(self._flush())
        return items + self._row_events(ev, d, ts)

    def _row_events(self, ev: Any, d: _Decoded, ts: datetime) -> list[Item]:
        """The row path: one ChangeEvent per row."""
        items: list[Item] = []
        tx = self.tx_id
        schema = d.schema
        conv = self._convert
        decoded = d.fast.rows(ev) if d.fast is not None else None
        if decoded is None:
            decoded = ev.rows  # pymysqlreplication's own (slower) decoding: types or events rowimage does not read
        if isinstance(ev, rows.WriteRowsEvent):
            for r in decoded:
                after = conv(d, r["values"], r["none_sources"])
                items.append(ChangeEvent(Op.CREATE, schema, self._pos(), None, after, tx, ts,
                                         unavailable=_unavailable(r["none_sources"])))
        elif isinstance(ev, rows.UpdateRowsEvent):
            for r in decoded:
                before = conv(d, r["before_values"], r["before_none_sources"])
                after = conv(d, r["after_values"], r["after_none_sources"])
                items.append(ChangeEvent(Op.UPDATE, schema, self._pos(), before, after, tx, ts,
                                         unavailable=_unavailable(r["after_none_sources"])))
        elif isinstance(ev, rows.DeleteRowsEvent):
            for r in decoded:
                before = conv(d, r["values"], r["none_sources"])
                items.append(ChangeEvent(Op.DELETE, schema, self._pos(), before, None, tx, ts))
        self.tx_events += len(items)
        return items


def _unavailable(none_sources: dict[str, str]) -> tuple[str, ...]:
    """Columns the row image left out (binlog_row_image=MINIMAL/NOBLOB): unknown, not NULL."""
    if not none_sources:
        return ()
    return tuple(k for k, v in none_sources.items() if v == NONE_SOURCE.COLS_BITMAP)


_ZERO_SOURCES = (NONE_SOURCE.OUT_OF_DATE_RANGE, NONE_SOURCE.OUT_OF_DATETIME_RANGE, NONE_SOURCE.OUT_OF_DATETIME2_RANGE)


def _fix_empty_sets(row: dict[str, Any], none_sources: dict[str, str], table: TableId) -> None:
    """pymysqlreplication reports an empty SET as None; it is the empty string, not NULL.

    Zero dates (and zero months or days) also come as None: they stay NULL, with the snapshot's warning.
    """
    for k, v in none_sources.items():
        if v == NONE_SOURCE.EMPTY_SET:
            row[k] = ""
        elif v in _ZERO_SOURCES:
            warn_once(table, k, ZERO_DATE)


_HANDLERS: dict[type, Callable[[Decoder, Any], list[Item]]] = {
    bl.RotateEvent: Decoder._on_rotate,
    bl.MariadbGtidListEvent: Decoder._on_gtid_list,
    bl.MariadbGtidEvent: Decoder._on_maria_gtid,
    bl.GtidEvent: Decoder._on_mysql_gtid,
    bl.XidEvent: Decoder._on_xid,
    bl.QueryEvent: Decoder._on_query,
    rows.WriteRowsEvent: Decoder._on_rows,
    rows.UpdateRowsEvent: Decoder._on_rows,
    rows.DeleteRowsEvent: Decoder._on_rows,
    bl.NotImplementedEvent: Decoder._on_not_implemented,
    bl.XAPrepareEvent: Decoder._on_xa_prepare,
    rows.PartialUpdateRowsEvent: Decoder._on_partial_update,
}
