"""BlockBuilder on hand-made pgoutput messages: equal to the row path; malformed messages are protocol errors."""

from __future__ import annotations

import struct

import pytest

from cdcd.positions import PgPosition
from cdcd.sources.postgres.columnar import BlockBuilder
from cdcd.sources.postgres.shape import RowDecoder, Warnings, shape_from_relation
from cdcd.sources.postgres.stream import PgStream
from cdcd.sources.postgres.types import TypeRegistry
from cdcd.sources.postgres.wire.pgoutput import Relation, RelationColumn, decode
from cdcd.sources.postgres.wire.protocol import ProtocolError

# the key is the flagged identity column (REPLICA IDENTITY DEFAULT); 'O' old rows are read all the same
REL = Relation(7, "public", "t", "d", (RelationColumn("id", 23, -1, True), RelationColumn("a", 25, -1, False),
                                       RelationColumn("b", 17, -1, False), RelationColumn("c", 1184, -1, False)))
SHAPE = shape_from_relation(REL, None, TypeRegistry(), 0)
U = object()  # an unchanged TOAST value


def tup(values: list[bytes | object | None]) -> bytes:
    out = struct.pack("!H", len(values))
    for v in values:
        if v is None:
            out += b"n"
        elif v is U:
            out += b"u"
        else:
            assert isinstance(v, bytes)
            out += b"t" + struct.pack("!I", len(v)) + v
    return out


def insert(*values: bytes | object | None) -> bytes:
    return b"I" + struct.pack("!I", 7) + b"N" + tup(list(values))


def update(new: list[bytes | object | None], old: list[bytes | object | None] | None = None,
           kind: bytes = b"O") -> bytes:
    head = b"U" + struct.pack("!I", 7)
    return head + (kind + tup(old) if old is not None else b"") + b"N" + tup(new)


def delete(old: list[bytes | object | None], kind: bytes = b"O") -> bytes:
    return b"D" + struct.pack("!I", 7) + kind + tup(old)


TS = b"2026-11-23 18:40:35.123456+00"
LONG = b"a value longer than twelve bytes \xc3\xa9"
MESSAGES = [
    insert(b"1", b"", b"\\x00ff", TS),
    insert(b"2", LONG, None, b"infinity"),
    insert(b"3", U, b"\\x", None),  # unchanged TOAST in an insert: unavailable
    update([b"2", U, b"\\x01", TS], [b"2", LONG, None, TS]),  # the whole old row fills it in
    update([b"4", U, None, TS], [b"3", U, b"\\x", None]),  # old unchanged too: stays unavailable; key change
    update([b"5", b"short", None, None], [b"5", None, None, None], kind=b"K"),
    update([b"6", LONG * 3, None, TS]),
    delete([b"1", b"", b"\\x00ff", TS]),
    delete([b"2", None, None, None], kind=b"K"),
]


def test_a_block_equals_the_row_path_message_by_message() -> None:
    builder = BlockBuilder(SHAPE, Warnings())
    for m in MESSAGES:
        builder.add(m)
    block = builder.build(PgPosition(0x99, 3), "12", None)
    dec = RowDecoder(SHAPE, Warnings())
    rows = [PgStream._row_event(None, decode(m), dec, PgPosition(0x99, 3 + i), "12", None)  # type: ignore[arg-type]
            for i, m in enumerate(MESSAGES)]
    got = block.events()
    assert len(got) == len(rows) == block.rows
    for a, b in zip(got, rows, strict=True):
        assert (a.op, a.position, a.before, a.after, a.unavailable, a.tx_id, a.key, a.before_key) == \
               (b.op, b.position, b.before, b.after, b.unavailable, b.tx_id, b.key, b.before_key)
    assert got[2].unavailable == ("a",) and got[3].after["a"] == LONG.decode()  # type: ignore[index]
    assert got[4].unavailable == ("a",) and got[4].before_key == (3,)
    assert len(builder) == 0  # the builder starts empty again


@pytest.mark.parametrize("message, error", [
    (insert(b"1", b"x", None), "has 3 columns, its Relation message 4"),
    (insert(b"1", b"x", None, TS)[:-3], "does not end where its tuple does"),
    (insert(b"1", b"x", None, TS) + b"\x00", "does not end where its tuple does"),
    (insert(b"1", b"x", None, TS).replace(b"N", b"X", 1), "Insert without a new tuple"),
    (b"U" + struct.pack("!I", 7) + b"K" + tup([b"1", None, None, None]) + b"Z" + tup([b"1", None, None, None]),
     "Update without a new tuple"),
    (insert(b"1", b"x", None, TS).replace(b"n", b"q", 1), "unknown tuple column kind 'q'"),
    (b"I\x00\x00", "truncated"),
])
def test_malformed_messages_are_protocol_errors(message: bytes, error: str) -> None:
    builder = BlockBuilder(SHAPE, Warnings())
    builder.add(insert(b"9", b"ok", None, TS))
    builder.add(message)
    with pytest.raises(ProtocolError, match=error):
        builder.build(PgPosition(1, 1), None, None)
