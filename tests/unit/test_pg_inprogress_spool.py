"""The protocol-2 -> protocol-1 translation of in-progress transactions (``inprogress.py``), on crafted messages."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from cdcd.errors import SourceError
from cdcd.sources.postgres import inprogress as ip
from cdcd.sources.postgres.stream import STREAMING_SINCE
from cdcd.sources.postgres.wire import pgoutput as po
from cdcd.sources.postgres.wire.protocol import ProtocolError
from cdcd.sources.postgres.wire.replication import server_major

TS = 784_000_000_123_456  # microseconds since 2000-01-01


def insert(rel: int, value: bytes) -> bytes:
    """A protocol-1 Insert of one text column."""
    return b"I" + struct.pack("!I", rel) + b"N" + struct.pack("!H", 1) + b"t" + struct.pack("!I", len(value)) + value


def relation(oid: int) -> bytes:
    return b"R" + struct.pack("!I", oid) + b"public\x00t\x00d" + struct.pack("!H", 1) + b"\x01id\x00" + \
        struct.pack("!Ii", 23, -1)


def streamed(xid: int, msg: bytes) -> bytes:
    """The same message inside a stream block: the (sub)transaction's xid after the tag."""
    return msg[:1] + struct.pack("!I", xid) + msg[1:]


def start(xid: int, first: bool) -> bytes:
    return b"S" + struct.pack("!IB", xid, int(first))


STOP = b"E"


def commit(xid: int, lsn: int, end: int) -> bytes:
    return b"c" + struct.pack("!IBQQq", xid, 0, lsn, end, TS)


def abort(xid: int, subxid: int) -> bytes:
    return b"A" + struct.pack("!II", xid, subxid)


def run(spool: ip.InProgress, *chunks: list[bytes]) -> list[bytes]:
    out: list[bytes] = []
    for chunk in chunks:
        for messages in spool.translate(chunk):
            assert messages, "translate never hands out an empty list"
            out.extend(messages)
    return out


@pytest.fixture
def spool(tmp_path: Path) -> ip.InProgress:
    s = ip.InProgress(tmp_path / "spool")
    s.reset()
    return s


def spooled(spool: ip.InProgress) -> list[str]:
    return sorted(p.name for p in spool.directory.iterdir())


def test_messages_outside_stream_blocks_pass_through_unchanged(spool: ip.InProgress) -> None:
    msgs = [po.encode_begin(100, TS, 7), relation(16384), insert(16384, b"1"), po.encode_commit(100, 108, TS)]
    assert run(spool, msgs) == msgs


def test_a_streamed_transaction_comes_out_at_its_commit_as_protocol_1(spool: ip.InProgress) -> None:
    rows = [insert(16384, str(i).encode()) for i in range(5)]
    before = run(spool, [start(9, True), streamed(9, relation(16384)), *[streamed(9, r) for r in rows[:3]], STOP],
                 [start(9, False), *[streamed(9, r) for r in rows[3:]], STOP])
    assert before == []  # nothing before the commit
    assert spooled(spool) == ["9.spool"] and spool.status()["transactions"] == 1
    out = run(spool, [commit(9, 0x5000, 0x5040)])
    assert out == [po.encode_begin(0x5000, TS, 9), relation(16384), *rows, po.encode_commit(0x5000, 0x5040, TS)]
    begin, end = po.decode(out[0]), po.decode(out[-1])
    assert isinstance(begin, po.Begin) and begin.final_lsn == 0x5000 and begin.xid == 9
    assert isinstance(end, po.Commit) and (end.commit_lsn, end.end_lsn) == (0x5000, 0x5040)
    assert begin.commit_ts == end.commit_ts == po.pg_time(TS)
    assert spooled(spool) == [] and spool.status() == {"transactions": 0, "spool_bytes": 0, "committed": 1,
                                                         "aborted": 0, "aborted_subtransactions": 0}


def test_interleaved_streams_and_plain_transactions_keep_commit_order(spool: ip.InProgress) -> None:
    a, b = insert(1, b"a"), insert(1, b"b")
    plain = [po.encode_begin(0x300, TS, 12), insert(1, b"p"), po.encode_commit(0x300, 0x310, TS)]
    out = run(spool, [start(10, True), streamed(10, a), STOP, start(11, True), streamed(11, b), STOP, *plain,
                      start(10, False), streamed(10, a), STOP, commit(11, 0x400, 0x410), commit(10, 0x500, 0x510)])
    assert out == [*plain,
                   po.encode_begin(0x400, TS, 11), b, po.encode_commit(0x400, 0x410, TS),
                   po.encode_begin(0x500, TS, 10), a, a, po.encode_commit(0x500, 0x510, TS)]


def test_an_aborted_subtransaction_loses_its_changes_but_not_its_relation_messages(spool: ip.InProgress) -> None:
    keep1, gone, keep2 = insert(1, b"k1"), insert(1, b"gone"), insert(1, b"k2")
    out = run(spool, [start(20, True), streamed(20, keep1), streamed(21, relation(1)), streamed(21, gone),
                      streamed(22, gone), STOP, abort(20, 21), abort(20, 22), start(20, False), streamed(23, keep2),
                      STOP, commit(20, 0x900, 0x910)])
    assert out == [po.encode_begin(0x900, TS, 20), keep1, relation(1), keep2, po.encode_commit(0x900, 0x910, TS)]
    assert spool.status()["aborted_subtransactions"] == 2


def test_an_aborted_transaction_leaves_nothing(spool: ip.InProgress) -> None:
    after = [po.encode_begin(0x700, TS, 31), insert(1, b"x"), po.encode_commit(0x700, 0x710, TS)]
    out = run(spool, [start(30, True), streamed(30, insert(1, b"no")), STOP, abort(30, 30), *after])
    assert out == after and spooled(spool) == [] and spool.status()["aborted"] == 1
    assert run(spool, [abort(99, 99)]) == []  # an abort of a transaction never streamed here: nothing to drop


def test_a_first_segment_again_starts_the_transaction_over(spool: ip.InProgress) -> None:
    out = run(spool, [start(40, True), streamed(40, insert(1, b"old")), STOP,
                      start(40, True), streamed(40, insert(1, b"new")), STOP, commit(40, 0x100, 0x110)])
    assert out[1:-1] == [insert(1, b"new")]


def test_a_non_transactional_message_inside_a_block_passes_through(spool: ip.InProgress) -> None:
    hb = b"M" + b"\x00" + struct.pack("!Q", 0x42) + b"cdcd_heartbeat\x00" + struct.pack("!I", 0)
    out = run(spool, [start(50, True), streamed(0, hb), STOP])
    assert out == [hb]
    assert isinstance(po.decode(out[0]), po.LogicalMessage)


def test_an_origin_message_after_stream_start_is_left_out(spool: ip.InProgress) -> None:
    origin = b"O" + struct.pack("!Q", 0) + b"pg_16400\x00"  # no xid: PostgreSQL sends it right after Stream Start
    row = insert(1, b"x")
    out = run(spool, [start(55, True), origin, streamed(55, row), STOP, commit(55, 0x10, 0x20)])
    assert out[1:-1] == [row]


def test_the_replay_is_handed_out_in_bounded_lists_across_read_blocks(spool: ip.InProgress,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ip, "_READ_BLOCK", 7)  # records straddle every read
    rows = [insert(1, b"v" * (i % 13)) for i in range(ip.REPLAY_MESSAGES * 2 + 5)]
    run(spool, [start(60, True), *[streamed(60, r) for r in rows], STOP])
    lists = list(spool.translate([commit(60, 0x10, 0x20)]))
    assert all(len(m) <= ip.REPLAY_MESSAGES for m in lists) and len(lists) == 3
    assert [m for chunk in lists for m in chunk][1:-1] == rows


def test_replay_lists_are_bounded_in_bytes_too(spool: ip.InProgress) -> None:
    big = [insert(1, bytes([65 + i]) * (3 << 20)) for i in range(3)]  # 3 MB values: one list would hold all
    run(spool, [start(61, True), *[streamed(61, r) for r in big], STOP])
    lists = list(spool.translate([commit(61, 0x10, 0x20)]))
    assert [len(m) for m in lists] == [3, 2]  # Begin + two values reach 4 MB; the third value + Commit
    assert [m for chunk in lists for m in chunk][1:-1] == big


@pytest.mark.parametrize(("chunk", "error"), [
    ([start(70, False)], "without its first segment"),
    ([commit(71, 1, 2)], "never streamed"),
    ([STOP], "outside a stream block"),
    ([start(72, True), po.encode_begin(1, TS, 72)], "inside a stream block"),
    ([b"c\x00\x00"], "truncated"),
])
def test_protocol_violations_are_errors(spool: ip.InProgress, chunk: list[bytes], error: str) -> None:
    with pytest.raises(ProtocolError, match=error):
        run(spool, chunk)


def test_reset_removes_the_spool_of_an_earlier_run_and_nothing_else(tmp_path: Path) -> None:
    d = tmp_path / "spool"
    d.mkdir()
    (d / "1234.spool").write_bytes(b"half a record")
    (d / "notes.txt").write_text("not ours")
    s = ip.InProgress(d)
    s.reset()
    assert sorted(p.name for p in d.iterdir()) == ["notes.txt"]
    run(s, [start(5, True), streamed(5, insert(1, b"x")), STOP])
    s.close()
    assert sorted(p.name for p in d.iterdir()) == ["notes.txt"]


def test_a_spool_that_cannot_be_written_is_an_error_naming_the_fix(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    s = ip.InProgress(tmp_path / "file" / "spool")
    with pytest.raises(SourceError, match="stream_in_progress = false"):
        s.reset()


def test_discarding_spools_survives_a_failing_flush(spool: ip.InProgress, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a full volume the buffered rest of a spool cannot be flushed when it is closed: closing the connection's
    spools (and aborting a transaction) must still work, or the replication connection would stay open."""
    run(spool, [start(80, True), streamed(80, insert(1, b"x")), STOP, start(81, True), streamed(81, insert(1, b"y")),
                STOP])

    class Full:
        def __init__(self, real: object) -> None:
            self.real = real

        def close(self) -> None:
            self.real.close()  # type: ignore[attr-defined]
            raise OSError(28, "No space left on device")

    for txn in spool._txns.values():
        txn.file = Full(txn.file)  # type: ignore[assignment]
    assert run(spool, [abort(80, 80)]) == []
    spool.close()
    assert spooled(spool) == []


@pytest.mark.parametrize(("text", "major"), [("15.4 (Debian 15.4-1.pgdg120+1)", 15), ("17beta1", 17), ("14.0", 14),
                                             ("16devel", 16), ("9.6.24", 9), ("", 0), ("EnterpriseDB 15", 0)])
def test_the_server_major_version_decides_the_protocol(text: str, major: int) -> None:
    assert server_major(text) == major
    assert (server_major(text) >= STREAMING_SINCE) == (major >= 14)
