"""A primary keepalive's position is offered to the stream reader (``take_keepalive``) only when no XLogData
came after it: data after it is what the server decoded past that position."""

from __future__ import annotations

import asyncio
import struct
from types import SimpleNamespace
from typing import Any

from cdcd.sources.postgres.wire import protocol as p
from cdcd.sources.postgres.wire.replication import ReplicationConnection


def _xlog(start: int, end: int, data: bytes) -> bytes:
    return p.copy_data(b"w" + struct.pack("!QQq", start, end, 7) + data)


def _keepalive(end: int, reply: bool) -> bytes:
    return p.copy_data(b"k" + struct.pack("!Qq?", end, 8, reply))


async def _next(stream: Any) -> list[bytes]:
    return await asyncio.wait_for(anext(stream), 5)  # type: ignore[no-any-return]


class _Writer:
    def __init__(self) -> None:
        self.sent: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.sent.append(data)

    def is_closing(self) -> bool:
        return False


async def test_a_keepalive_is_offered_only_when_no_data_followed_it() -> None:
    reader = asyncio.StreamReader()
    writer = _Writer()
    conn = ReplicationConnection(reader, writer, SimpleNamespace(where="test"))  # type: ignore[arg-type]
    conn._copy_both = True
    stream = conn.xlog()
    reader.feed_data(_xlog(1, 2, b"B") + _keepalive(10, True) + _xlog(11, 12, b"C"))
    assert await _next(stream) == [b"B", b"C"]
    assert not conn.keepalive_pending and conn.take_keepalive() is None  # data came after it
    assert len(writer.sent) == 1  # a reply asked for is sent at once all the same
    reader.feed_data(_xlog(13, 14, b"B") + _keepalive(20, False) + _keepalive(30, True))
    assert await _next(stream) == [b"B"]
    assert conn.take_keepalive() == (30, True)  # the last one's position; a reply was asked for
    assert conn.take_keepalive() is None  # taken once
    reader.feed_data(_keepalive(40, False))
    assert await _next(stream) == []  # a keepalive alone: the reader is told
    assert conn.take_keepalive() == (40, False)
