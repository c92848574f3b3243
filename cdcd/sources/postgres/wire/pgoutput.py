"""Decoder of the pgoutput logical replication stream (protocol versions 1 and 2).

``decode(data)`` turns the payload of one XLogData message into one message
value. Pure: no I/O, no type conversion (values stay as the server's text
bytes; ``types.py`` converts them). ``RelationCache`` remembers the last
Relation message per relation OID, as the protocol requires.

Protocol 2 adds in-progress transaction streaming: ``decode_stream_control``
reads Stream Start/Stop/Commit/Abort, and ``split_streamed`` turns a message
inside a stream block (which carries the xid of its (sub)transaction after the
tag) back into its protocol-1 form. ``encode_begin``/``encode_commit`` write
the Begin and Commit a protocol-1 stream would have carried for a transaction
streamed in progress, so both protocols feed the same decoder
(``inprogress.py``).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Union

from cdcd.sources.postgres.wire.protocol import ProtocolError

PG_EPOCH = datetime(2000, 1, 1, tzinfo=UTC)

_Q = struct.Struct("!Q")
_q = struct.Struct("!q")
_I = struct.Struct("!I")
_i = struct.Struct("!i")
_H = struct.Struct("!H")
_BEGIN = struct.Struct("!QqI")
_COMMIT = struct.Struct("!BQQq")
_REL_COL_TAIL = struct.Struct("!Ii")
_STREAM_START = struct.Struct("!IB")
_STREAM_COMMIT = struct.Struct("!IBQQq")
_STREAM_ABORT = struct.Struct("!II")

# Tuple column kinds.
NULL = ord("n")
UNCHANGED = ord("u")
TEXT = ord("t")
BINARY = ord("b")

#: One column of a TupleData: None for NULL, ``UNCHANGED_TOAST`` for 'u', else the raw bytes.
TupleValue = Union[bytes, None, "_Unchanged"]


class _Unchanged:
    __slots__ = ()

    def __repr__(self) -> str:
        return "UNCHANGED_TOAST"


UNCHANGED_TOAST = _Unchanged()


def pg_time(us: int) -> datetime:
    return PG_EPOCH + timedelta(microseconds=us)


@dataclass(frozen=True, slots=True)
class Begin:
    final_lsn: int
    commit_ts: datetime
    xid: int


@dataclass(frozen=True, slots=True)
class Commit:
    commit_lsn: int
    end_lsn: int
    commit_ts: datetime


@dataclass(frozen=True, slots=True)
class Origin:
    lsn: int
    name: str


@dataclass(frozen=True, slots=True)
class RelationColumn:
    name: str
    type_oid: int
    typmod: int
    key: bool  # part of the replica identity


@dataclass(frozen=True, slots=True)
class Relation:
    oid: int
    namespace: str
    name: str
    replica_identity: str  # d(efault), n(othing), f(ull), i(ndex)
    columns: tuple[RelationColumn, ...]


@dataclass(frozen=True, slots=True)
class TypeMessage:
    oid: int
    namespace: str
    name: str


@dataclass(frozen=True, slots=True)
class Insert:
    relation: int
    new: tuple[TupleValue, ...]


@dataclass(frozen=True, slots=True)
class Update:
    relation: int
    old_kind: str | None  # 'K' (key only), 'O' (old row, REPLICA IDENTITY FULL) or None
    old: tuple[TupleValue, ...] | None
    new: tuple[TupleValue, ...]


@dataclass(frozen=True, slots=True)
class Delete:
    relation: int
    old_kind: str
    old: tuple[TupleValue, ...]


@dataclass(frozen=True, slots=True)
class Truncate:
    relations: tuple[int, ...]
    cascade: bool
    restart_identity: bool


@dataclass(frozen=True, slots=True)
class LogicalMessage:
    transactional: bool
    lsn: int
    prefix: str
    content: bytes


@dataclass(frozen=True, slots=True)
class StreamStart:
    xid: int
    first_segment: bool


@dataclass(frozen=True, slots=True)
class StreamStop:
    pass


@dataclass(frozen=True, slots=True)
class StreamCommit:
    xid: int
    commit_lsn: int
    end_lsn: int
    commit_ts_us: int  # as sent (microseconds since 2000-01-01): re-encoded unchanged into the Begin/Commit


@dataclass(frozen=True, slots=True)
class StreamAbort:
    xid: int
    subxid: int  # == xid: the whole transaction; else only this subtransaction's changes


StreamControl = StreamStart | StreamStop | StreamCommit | StreamAbort

#: Tags of the messages that carry an xid inside a stream block (protocol 2).
STREAMED_TAGS = frozenset(b"IUDTRYM")
#: Stream control tags: Start, Stop (E), Commit (c), Abort.
STREAM_CONTROL_TAGS = frozenset(b"SEcA")

Message = Begin | Commit | Origin | Relation | TypeMessage | Insert | Update | Delete | Truncate | LogicalMessage


def _cstring(data: bytes, pos: int) -> tuple[str, int]:
    end = data.index(b"\x00", pos)
    return data[pos:end].decode(), end + 1


def _tuple(data: bytes, pos: int) -> tuple[tuple[TupleValue, ...], int]:
    (count,) = _H.unpack_from(data, pos)
    pos += 2
    values: list[TupleValue] = []
    append = values.append
    for _ in range(count):
        kind = data[pos]
        pos += 1
        if kind in (TEXT, BINARY):
            (size,) = _I.unpack_from(data, pos)
            pos += 4
            append(data[pos : pos + size])
            pos += size
        elif kind == NULL:
            append(None)
        elif kind == UNCHANGED:
            append(UNCHANGED_TOAST)
        else:
            raise ProtocolError(f"pgoutput: unknown tuple column kind {chr(kind)!r}")
    return tuple(values), pos


def decode(data: bytes) -> Message:
    """Decode one pgoutput message."""
    tag = data[:1]
    if tag == b"I":
        (rel,) = _I.unpack_from(data, 1)
        if data[5:6] != b"N":
            raise ProtocolError("pgoutput: Insert without a new tuple")
        new, _ = _tuple(data, 6)
        return Insert(rel, new)
    if tag == b"U":
        (rel,) = _I.unpack_from(data, 1)
        pos = 5
        old_kind: str | None = None
        old: tuple[TupleValue, ...] | None = None
        marker = data[pos : pos + 1]
        if marker in (b"K", b"O"):
            old_kind = marker.decode()
            old, pos = _tuple(data, pos + 1)
            marker = data[pos : pos + 1]
        if marker != b"N":
            raise ProtocolError("pgoutput: Update without a new tuple")
        new, _ = _tuple(data, pos + 1)
        return Update(rel, old_kind, old, new)
    if tag == b"D":
        (rel,) = _I.unpack_from(data, 1)
        kind = data[5:6].decode()
        old, _ = _tuple(data, 6)
        return Delete(rel, kind, old)
    if tag == b"B":
        final_lsn, ts, xid = _BEGIN.unpack_from(data, 1)
        return Begin(final_lsn, pg_time(ts), xid)
    if tag == b"C":
        _flags, commit_lsn, end_lsn, ts = _COMMIT.unpack_from(data, 1)
        return Commit(commit_lsn, end_lsn, pg_time(ts))
    if tag == b"R":
        return _relation(data)
    if tag == b"Y":
        (oid,) = _I.unpack_from(data, 1)
        namespace, pos = _cstring(data, 5)
        name, _ = _cstring(data, pos)
        return TypeMessage(oid, namespace, name)
    if tag == b"T":
        (count,) = _I.unpack_from(data, 1)
        options = data[5]
        oids = struct.unpack_from(f"!{count}I", data, 6)
        return Truncate(tuple(oids), bool(options & 1), bool(options & 2))
    if tag == b"M":
        flags = data[1]
        (lsn,) = _Q.unpack_from(data, 2)
        prefix, pos = _cstring(data, 10)
        (size,) = _I.unpack_from(data, pos)
        return LogicalMessage(bool(flags & 1), lsn, prefix, data[pos + 4 : pos + 4 + size])
    if tag == b"O":
        (lsn,) = _Q.unpack_from(data, 1)
        name, _ = _cstring(data, 9)
        return Origin(lsn, name)
    raise ProtocolError(f"pgoutput: unknown message type {tag!r} (is the slot's plugin pgoutput, protocol 1 or 2?)")


def decode_stream_control(data: bytes) -> StreamControl:
    """Decode Stream Start ('S'), Stop ('E'), Commit ('c') or Abort ('A') (protocol 2)."""
    tag = data[:1]
    try:
        if tag == b"S":
            xid, first = _STREAM_START.unpack_from(data, 1)
            return StreamStart(xid, first == 1)
        if tag == b"E":
            return StreamStop()
        if tag == b"c":
            xid, _flags, commit_lsn, end_lsn, ts = _STREAM_COMMIT.unpack_from(data, 1)
            return StreamCommit(xid, commit_lsn, end_lsn, ts)
        if tag == b"A":
            # Protocol 4 (streaming = parallel) appends the abort LSN and time; we ask for 'on' and ignore them.
            xid, subxid = _STREAM_ABORT.unpack_from(data, 1)
            return StreamAbort(xid, subxid)
    except struct.error as exc:
        raise ProtocolError(f"pgoutput: truncated stream message {tag!r} ({len(data)} bytes): {exc}") from None
    raise ProtocolError(f"pgoutput: {tag!r} is not a stream control message")


def split_streamed(data: bytes) -> tuple[int, bytes]:
    """A message inside a stream block: the xid of the (sub)transaction that made it, and the message in
    its protocol-1 form (the same bytes without that xid)."""
    if data[0] not in STREAMED_TAGS or len(data) < 5:
        raise ProtocolError(f"pgoutput: unexpected message {data[:1]!r} inside a stream block")
    (xid,) = _I.unpack_from(data, 1)
    return xid, data[:1] + data[5:]


def encode_begin(final_lsn: int, commit_ts_us: int, xid: int) -> bytes:
    """The protocol-1 Begin message."""
    return b"B" + _BEGIN.pack(final_lsn, commit_ts_us, xid)


def encode_commit(commit_lsn: int, end_lsn: int, commit_ts_us: int) -> bytes:
    """The protocol-1 Commit message (flags 0)."""
    return b"C" + _COMMIT.pack(0, commit_lsn, end_lsn, commit_ts_us)


def _relation(data: bytes) -> Relation:
    (oid,) = _I.unpack_from(data, 1)
    namespace, pos = _cstring(data, 5)
    name, pos = _cstring(data, pos)
    ident = chr(data[pos])
    (ncols,) = _H.unpack_from(data, pos + 1)
    pos += 3
    cols: list[RelationColumn] = []
    for _ in range(ncols):
        flags = data[pos]
        col, pos = _cstring(data, pos + 1)
        type_oid, typmod = _REL_COL_TAIL.unpack_from(data, pos)
        pos += 8
        cols.append(RelationColumn(col, type_oid, typmod, bool(flags & 1)))
    # An empty namespace means pg_catalog in the protocol.
    return Relation(oid, namespace or "pg_catalog", name, ident, tuple(cols))


class RelationCache:
    """Relation messages by OID; a row message names its relation only by OID."""

    def __init__(self) -> None:
        self._by_oid: dict[int, Relation] = {}

    def add(self, rel: Relation) -> Relation | None:
        """Remember ``rel``; return the previous definition of the same OID, if any."""
        old = self._by_oid.get(rel.oid)
        self._by_oid[rel.oid] = rel
        return old

    def get(self, oid: int) -> Relation:
        try:
            return self._by_oid[oid]
        except KeyError:
            raise ProtocolError(f"pgoutput: row for relation {oid} arrived before its Relation message") from None

    def __contains__(self, oid: int) -> bool:
        return oid in self._by_oid

    def items(self) -> list[tuple[int, Relation]]:
        """Every relation received so far, by OID (the latest definition of each)."""
        return list(self._by_oid.items())
