"""Positions inside a MariaDB/MySQL transaction number its content, not its bytes (issue 27, item 3).

After a GTID failover the new server re-sends the transaction the checkpoint is inside, and cdcd skips its
items up to the checkpoint's seq. The servers do not lay the transaction out byte for byte alike: a
group-committed transaction's GTID event on a MariaDB primary carries a commit id its replica's copy lacks,
MySQL's GTID events carry commit timestamps that differ, annotations and checksums may be on for one server and
off for the other. The events here are hand-made as pymysqlreplication leaves them after parsing their headers
(as in tests/unit/test_mysql_rowimage_layout.py): the same rows laid out differently must get the same seqs.
"""

from __future__ import annotations

import struct
from types import SimpleNamespace
from typing import Any

import pytest
from pymysqlreplication import event as bl
from pymysqlreplication.constants import FIELD_TYPE
from pymysqlreplication.row_event import DeleteRowsEvent, UpdateRowsEvent, WriteRowsEvent

from cdcd.events import ChangeBlock, ChangeEvent, Item, Mark, MarkKind, TableId
from cdcd.positions import MySqlPosition
from cdcd.sources.mysql.decode import Decoder
from cdcd.sources.mysql.schema import SchemaHistory
from cdcd.sources.mysql.state import MySqlState, fold_state

T, U = TableId("app", "t"), TableId("app", "u")
_TYPE_CODES = {WriteRowsEvent: 0x17, UpdateRowsEvent: 0x18, DeleteRowsEvent: 0x19}
ROWS_HEADER = 10  # what pymysqlreplication read of a rows event's body before its row images


def _col(type_: int, name: str, **kw: Any) -> SimpleNamespace:
    base = {"unsigned": False, "character_set_name": None, "enum_values": None, "set_values": None,
            "is_primary": name == "id"}
    return SimpleNamespace(type=type_, name=name, **(base | kw))


COLS = [_col(FIELD_TYPE.LONG, "id"), _col(FIELD_TYPE.VARCHAR, "note", max_length=40, character_set_name="utf8")]


def _row(i: int, note: str) -> bytes:
    raw = note.encode()
    return b"\x00" + struct.pack("<i", i) + bytes([len(raw)]) + raw


class Binlog:
    """One server's copy of a transaction: events at consecutive offsets, sized as that server writes them."""

    def __init__(self, start: int, checksum: bool = False) -> None:
        self.offset = start
        self.extra = 4 if checksum else 0  # binlog_checksum = CRC32 adds 4 bytes to every event
        self.tmaps = {1: SimpleNamespace(columns=COLS), 2: SimpleNamespace(columns=COLS)}

    def _place(self, ev: Any, size: int, event_type: int, **packet: Any) -> Any:
        size += self.extra
        self.offset += size
        ev.__dict__.update(packet=SimpleNamespace(log_pos=self.offset, event_size=size, event_type=event_type,
                                                  flags=0, **packet), event_type=event_type, timestamp=1_700_000_000)
        return ev

    def gtid(self, seq: int, size: int) -> Any:
        """MariaDB's GTID event: 42 bytes (with a commit id from a group commit: more)."""
        ev = object.__new__(bl.MariadbGtidEvent)
        ev.__dict__.update(domain_id=0, server_id=1, gtid_seq_no=seq, flags=0)
        return self._place(ev, size, 0xA2)

    def annotate(self, size: int = 60) -> Any:
        ev = object.__new__(bl.NotImplementedEvent)
        return self._place(ev, size, 160)

    def rows(self, cls: type, table: TableId, images: bytes) -> Any:
        ev = object.__new__(cls)
        tid = 1 if table == T else 2
        data = b"hdr" + images + b"CRC!"
        ev.__dict__.update(complete=True, number_of_columns=len(COLS), event_size=ROWS_HEADER + len(images),
                           schema=table.schema, table=table.name, columns_present_bitmap=b"\x03",
                           columns_present_bitmap2=b"\x03", _RowsEvent__rows=None, table_id=tid, table_map=self.tmaps,
                           _ignore_decode_errors=False)
        ev = self._place(ev, 19 + ROWS_HEADER + len(images), _TYPE_CODES[cls],
                         packet=SimpleNamespace(_data=data, _position=3), read_bytes=ROWS_HEADER)
        return ev

    def xid(self) -> Any:
        ev = object.__new__(bl.XidEvent)
        ev.__dict__.update(xid=7)
        return self._place(ev, 31, 0x10)


def transaction(b: Binlog, gtid_size: int, annotate: bool) -> list[Any]:
    """Rows of t, rows of an uncaptured table u, more rows of t in an update and a delete, then the commit."""
    out = [b.gtid(42, gtid_size)]
    if annotate:
        out.append(b.annotate())
    out.append(b.rows(WriteRowsEvent, T, b"".join(_row(i, f"n{i}") for i in range(1, 6))))
    if annotate:
        out.append(b.annotate(75))
    out.append(b.rows(WriteRowsEvent, U, b"".join(_row(i, "other table") for i in range(1, 4))))
    out.append(b.rows(UpdateRowsEvent, T, _row(2, "n2") + _row(2, "changed") + _row(3, "n3") + _row(3, "x")))
    out.append(b.rows(DeleteRowsEvent, T, _row(5, "n5")))
    out.append(b.xid())
    return out


def decode(events: list[Any], tables: set[TableId] | None = None, columnar: bool = False,
           legacy_tx: tuple[int, int, int] | None = None, file: str = "mysql-bin.000003") -> list[Item]:
    decoder = Decoder("mariadb", tables or {T}, SchemaHistory(), file, "0-1-41", columnar=columnar,
                      legacy_tx=legacy_tx)
    out: list[Item] = []
    for ev in events:
        out += decoder.feed(ev)
    return out


def seqs(items: list[Item]) -> list[tuple[str, int]]:
    """(what, seq) of every item and every row, in order."""
    out: list[tuple[str, int]] = []
    for item in items:
        if type(item) is ChangeBlock:
            start = item.start
            assert isinstance(start, MySqlPosition)
            row_seqs = item.seqs.to_pylist() if item.seqs is not None else \
                [start.seq + k for k in range(item.rows)]
            out += [(f"row {item.table}", s) for s in row_seqs]
        elif type(item) is ChangeEvent:
            assert isinstance(item.position, MySqlPosition)
            out.append((f"row {item.table}", item.position.seq))
        else:
            assert isinstance(item, Mark) and isinstance(item.position, MySqlPosition)
            out.append((item.kind.value, item.position.seq))
    return out


@pytest.mark.parametrize("columnar", [False, True], ids=["row-path", "columnar"])
def test_the_same_transaction_laid_out_differently_gets_the_same_seqs(columnar: bool) -> None:
    # the primary: a group-committed GTID event (commit id: 8 bytes more), annotations, far into its binlog
    primary = decode(transaction(Binlog(91_000), gtid_size=50, annotate=True), columnar=columnar)
    # its replica: a plain GTID event, no annotations, checksums on, elsewhere in another file
    replica = decode(transaction(Binlog(4_000, checksum=True), gtid_size=42, annotate=False), columnar=columnar,
                     file="mysql-bin.000001")
    assert seqs(primary) == seqs(replica)
    got = seqs(primary)
    assert [what for what, _ in got] == ["schema", *["row app.t"] * 8, "commit"]
    numbers = [s for _, s in got]
    assert numbers == sorted(set(numbers)), "seqs strictly increase"
    # MySQL: GTID events of different sizes (commit timestamps), the BEGIN query event after them
    assert seqs(decode(transaction(Binlog(500), gtid_size=65, annotate=False), columnar=columnar)) == got


def test_seqs_do_not_depend_on_the_captured_tables() -> None:
    """A reload that adds table u re-reads the transaction: t's rows keep their seqs, so the skip rule drops
    exactly what was delivered."""
    events = transaction(Binlog(1000), gtid_size=42, annotate=True)
    only_t = [x for x in seqs(decode(events)) if x[0] != "schema"]
    both = seqs(decode(transaction(Binlog(1000), gtid_size=42, annotate=True), tables={T, U}))
    assert only_t == [x for x in both if x[0] in ("row app.t", "commit")]
    assert [what for what, _ in both].count("row app.u") == 3


def test_an_earlier_versions_transaction_keeps_its_byte_offset_seqs() -> None:
    """A checkpoint of an earlier version inside a transaction numbered it by byte offsets: resuming inside it, its
    seqs stay byte offsets (the checkpoint's seq means the same rows); the next transaction numbers its content."""
    b = Binlog(2000)
    first = transaction(b, gtid_size=42, annotate=True)
    second = transaction(b, gtid_size=42, annotate=True)
    items = decode([*first, *second], legacy_tx=(0, 3, 2000))
    rows_event = first[2]
    offset = rows_event.packet.log_pos - rows_event.packet.event_size - 2000
    legacy = seqs([i for i in items if isinstance(i.position, MySqlPosition) and i.position.pos == 2000])
    assert legacy[0] == ("schema", offset + 1) and legacy[1] == ("row app.t", offset + 2)
    later = seqs([i for i in items if isinstance(i.position, MySqlPosition) and i.position.pos != 2000])
    fresh = seqs(decode(transaction(Binlog(9000), gtid_size=44, annotate=False)))
    assert later == [x for x in fresh if x[0] != "schema"]  # the history knows the table by then: no schema mark


def test_checkpoint_seqs_format_survives_an_upgrade() -> None:
    """The state says when positions inside a transaction number its content; an earlier version's checkpoint
    inside a transaction does not say so until that transaction commits."""
    pos = MySqlPosition.at("mysql-bin.000003", 2000, 300, "0-1-41")
    commit = Mark(MarkKind.COMMIT, MySqlPosition.at("mysql-bin.000003", 2000, 900, "0-1-42"), {})
    fresh = fold_state({}, [commit])
    assert fresh["seqs"] == "content" and MySqlState.parse(fresh).content_seqs
    old = {"inside_tx": True, "stream_start": pos.to_json()}
    assert not MySqlState.parse(old).content_seqs
    still_inside = fold_state(old, [Mark(MarkKind.DDL, pos, {"table": "app.t", "ddl": "x"})])
    assert "seqs" not in still_inside and not MySqlState.parse(still_inside).content_seqs
    committed = fold_state(old, [commit])
    assert committed["seqs"] == "content"
    assert MySqlState.parse(fold_state(committed, [Mark(MarkKind.DDL, pos, {"table": "app.t", "ddl": "x"})])) \
        .content_seqs
