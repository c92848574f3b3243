"""The bulk XLogData reader (``MessageBuffer.take_xlog``): the same messages as the message-at-a-time path,
under any split of the byte stream, and every message as soon as its last byte is there."""

from __future__ import annotations

import asyncio
import struct
import time
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cdcd.sources.postgres.wire import protocol as p
from cdcd.sources.postgres.wire.replication import ReplicationConnection


def _xlog(start: int, end: int, data: bytes) -> bytes:
    return p.copy_data(b"w" + struct.pack("!QQq", start, end, 7) + data)


def _keepalive(end: int, reply: bool) -> bytes:
    return p.copy_data(b"k" + struct.pack("!Qq?", end, 8, reply))


frames = st.one_of(
    st.builds(lambda s, e, d: ("x", _xlog(s, e, d)), st.integers(0, 2**63), st.integers(0, 2**63),
              st.binary(max_size=60)),
    st.builds(lambda e, r: ("k", _keepalive(e, r)), st.integers(0, 2**63), st.booleans()),
    st.builds(lambda b: ("n", b"N" + struct.pack("!i", len(b) + 4) + b), st.binary(max_size=20)),
)


def _reference(stream: bytes) -> tuple[list[bytes], int, list[tuple[bytes, bytes]]]:
    """Message at a time: the XLogData payloads, the highest WAL end of any CopyData, the other messages."""
    buf = p.MessageBuffer()
    buf.feed(stream)
    datas: list[bytes] = []
    top = 0
    others: list[tuple[bytes, bytes]] = []
    for msg in buf:
        if msg.kind == b"d":
            item = p.parse_copy_data(msg.payload)
            top = max(top, item.wal_end)
            if isinstance(item, p.XLogData):
                datas.append(item.data)
                continue
        others.append((msg.kind, msg.payload))
    return datas, top, others


@given(st.lists(frames, max_size=30), st.lists(st.integers(min_value=1, max_value=97), min_size=1, max_size=40))
def test_bulk_reader_equals_message_at_a_time_under_any_split(items: list[tuple[str, bytes]],
                                                               cuts: list[int]) -> None:
    stream = b"".join(frame for _, frame in items)
    want_datas, want_top, want_others = _reference(stream)
    buf = p.MessageBuffer()
    datas: list[bytes] = []
    others: list[tuple[bytes, bytes]] = []
    top = 0
    pos, i = 0, 0
    while pos < len(stream):
        step = cuts[i % len(cuts)]
        buf.feed(stream[pos : pos + step])
        pos, i = pos + step, i + 1
        while True:
            wal_end, msg = buf.take_xlog(datas)
            top = max(top, wal_end)
            if msg is None:
                break
            if msg.kind == b"d":
                top = max(top, p.parse_copy_data(msg.payload).wal_end)
            others.append((msg.kind, msg.payload))
    assert datas == want_datas
    assert all(type(d) is bytes for d in datas)
    assert top == want_top
    assert others == want_others
    assert buf.pending == 0


def test_each_message_is_there_as_soon_as_its_last_byte_is() -> None:
    big = _xlog(1, 2, bytes(range(256)) * 4000)  # about 1 MB, waits for many reads
    small = _xlog(3, 4, b"I-small")
    buf = p.MessageBuffer()
    got: list[bytes] = []
    for at in range(0, len(big) - 1, 4096):
        buf.feed(big[at : min(at + 4096, len(big) - 1)])
        assert buf.take_xlog(got) == (0, None) and not got
    buf.feed(big[-1:])
    assert buf.take_xlog(got) == (2, None) and got == [bytes(range(256)) * 4000]
    got.clear()
    for i in range(len(small)):  # the big message's length must not hold back the next one
        buf.feed(small[i : i + 1])
        _, msg = buf.take_xlog(got)
        assert msg is None
        assert (got == [b"I-small"]) == (i == len(small) - 1)
    assert buf.pending == 0


def test_a_truncated_xlogdata_is_a_protocol_error() -> None:
    buf = p.MessageBuffer()
    buf.feed(p.copy_data(b"w" + bytes(10)))
    got: list[bytes] = []
    _, msg = buf.take_xlog(got)
    assert msg is not None and not got
    with pytest.raises(p.ProtocolError, match="truncated"):
        p.parse_copy_data(msg.payload)


async def _next(stream: Any, within: float) -> list[bytes]:
    return await asyncio.wait_for(anext(stream), within)  # type: ignore[no-any-return]


async def test_a_waiting_reader_is_woken_even_when_only_part_of_a_message_came() -> None:
    """``wake_at``: the stream yields an empty list when no whole message came by then, whatever bytes did
    (a keepalive, the first half of a message), and the message once its last byte is there."""
    reader = asyncio.StreamReader()
    conn = ReplicationConnection(reader, None, SimpleNamespace(where="test"))  # type: ignore[arg-type]
    stream = conn.xlog()
    reader.feed_data(_xlog(1, 2, b"I-first"))
    assert await _next(stream, 5) == [b"I-first"]
    later = _xlog(3, 4, b"I-second")
    for part in (_keepalive(3, False), later[:9]):  # nothing whole: no message to yield
        conn.wake_at = time.monotonic() + 0.05
        reader.feed_data(part)
        assert await _next(stream, 5) == []  # the stall bound (minutes) would time this out
        assert conn.wake_at is None
    conn.wake_at = time.monotonic() + 60
    reader.feed_data(later[9:])
    assert await _next(stream, 5) == [b"I-second"]
    assert conn.wake_at is None
