"""In-progress transactions of pgoutput protocol 2: spooled to disk as they stream, replayed at Stream Commit.

With ``streaming 'on'`` the server sends a large transaction in blocks (Stream Start ... Stream Stop) while it
is still running, interleaved with other transactions, and ends it with Stream Commit or Stream Abort. Nothing
of it may become an event before the commit: its positions (``pg:<commit LSN>:<seq>``) need the commit LSN,
and its seq numbers depend on which subtransactions abort.

So each streamed message goes, still in wire form (the xid after the tag removed: its protocol-1 form), into
an append-only spool file per top-level transaction under ``state.path/pg-inprogress/``. At Stream Commit the
spool is replayed as exactly what protocol 1 would have sent at that point: Begin(commit LSN, commit time,
xid), the kept messages in the order the server streamed them (its LSN order), Commit. The decoder behind
(``stream.py``) cannot tell the difference, so events, their order and their positions do not depend on the
protocol, and a restart may decode a transaction in either mode. Stream Abort drops the spool; an abort of a
subtransaction (``subxid != xid``) marks that subxid, and the replay leaves out its changes (Relation and Type
messages stay: the server counts them as sent for the whole transaction).

Memory stays bounded whatever the transaction's size: writes go through a fixed buffer, the replay reads the
file in blocks and hands out lists of at most ``REPLAY_MESSAGES`` messages or about ``REPLAY_BYTES``.

The spool is not a recovery log: a new replication connection (a restart, a reconnect) makes the server send
every uncommitted transaction again from its first segment, so ``reset()`` deletes every spool file whenever
a connection starts, and the files are not fsynced. The slot never confirms past an unpublished transaction:
the flush position is the commit LSN of a checkpointed transaction (or a heartbeat), and a streamed
transaction's events reach the runtime only after its commit.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from cdcd.errors import SourceError
from cdcd.fsutil import storage_fix
from cdcd.sources.postgres.wire import pgoutput
from cdcd.sources.postgres.wire.protocol import ProtocolError

#: The spool directory's name under ``state.path``.
SPOOL_DIR = "pg-inprogress"
SUFFIX = ".spool"
#: At most this many messages, and about this many bytes (at least one message), per list the replay hands
#: out (and the runtime decodes before the next read): protocol 1 hands out what one socket read brought.
REPLAY_MESSAGES = 2048
REPLAY_BYTES = 1 << 22
_READ_BLOCK = 1 << 22
_WRITE_BUFFER = 1 << 20
_REC = struct.Struct("!II")  # the (sub)transaction's xid, the message's length
_KEPT_ON_ABORT = frozenset(b"RY")  # Relation and Type messages: the server will not send them again
_MESSAGE = ord("M")
_ORIGIN = ord("O")


@dataclass
class _Txn:
    """One streamed top-level transaction's spool file."""

    path: Path
    file: BinaryIO
    aborted: set[int] = field(default_factory=set)  # subtransactions whose changes the replay leaves out
    bytes: int = 0
    messages: int = 0


class InProgress:
    """Turns a protocol-2 message stream into the protocol-1 stream it stands for."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._txns: dict[int, _Txn] = {}
        self._current: _Txn | None = None  # the transaction of the open stream block
        self.committed = 0  # streamed transactions replayed (this process)
        self.aborted = 0  # streamed transactions dropped (this process)
        self.aborted_subtransactions = 0  # subtransaction aborts of spooled transactions (this process)

    # ------------------------------------------------------------ lifecycle

    def reset(self) -> None:
        """Forget every in-progress transaction and delete every spool file (also those of an earlier run):
        a new replication connection receives each uncommitted transaction again from its first segment."""
        self._close_files()
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            for entry in self.directory.iterdir():
                if entry.name.endswith(SUFFIX):
                    entry.unlink(missing_ok=True)
        except OSError as exc:
            raise self._storage_error("prepare", self.directory, exc) from exc

    def close(self) -> None:
        """Close and delete the spool files of this connection (best effort: ``reset`` at the next start)."""
        paths = [t.path for t in self._txns.values()]
        self._close_files()
        for path in paths:
            try:
                path.unlink(missing_ok=True)
            except OSError:  # removed at the next start; the error is not the caller's to handle now
                continue

    def _close_files(self) -> None:
        for txn in self._txns.values():
            _discard(txn.file)
        self._txns.clear()
        self._current = None

    def status(self) -> dict[str, Any]:
        return {"transactions": len(self._txns), "spool_bytes": sum(t.bytes for t in self._txns.values()),
                "committed": self.committed, "aborted": self.aborted,
                "aborted_subtransactions": self.aborted_subtransactions}

    # ------------------------------------------------------------ translation

    def translate(self, chunk: Iterable[bytes]) -> Iterator[list[bytes]]:
        """The protocol-1 messages ``chunk`` (protocol-2 messages, in arrival order) stands for, as lists.

        Messages outside stream blocks pass through; stream blocks go to their spool; a Stream Commit replays
        its transaction in place (a Begin, the kept messages, a Commit)."""
        out: list[bytes] = []
        for data in chunk:
            current = self._current
            if current is not None:
                if data[:1] == b"E":
                    self._current = None
                    continue
                if data[0] == _ORIGIN:
                    continue  # a Stream Start's Origin (the transaction was replicated here): no xid, no change
                subxid, body = pgoutput.split_streamed(data)
                if subxid == 0 and data[0] == _MESSAGE:
                    out.append(body)  # a non-transactional logical message (xid 0): not part of the transaction
                    continue
                self._append(current, subxid, body)
                continue
            tag = data[0]
            if tag not in pgoutput.STREAM_CONTROL_TAGS:
                out.append(data)
                continue
            msg = pgoutput.decode_stream_control(data)
            if isinstance(msg, pgoutput.StreamStart):
                self._start(msg)
            elif isinstance(msg, pgoutput.StreamCommit):
                if out:
                    yield out
                    out = []
                yield from self._replay(msg)
            elif isinstance(msg, pgoutput.StreamAbort):
                self._abort(msg)
            else:
                raise ProtocolError("pgoutput: Stream Stop outside a stream block")
        if out:
            yield out

    def _start(self, msg: pgoutput.StreamStart) -> None:
        txn = self._txns.get(msg.xid)
        if msg.first_segment:
            if txn is not None:  # the server starts this transaction over: what we have is stale
                self._drop(msg.xid)
            path = self.directory / f"{msg.xid}{SUFFIX}"
            try:
                file: BinaryIO = open(path, "wb", buffering=_WRITE_BUFFER)  # noqa: SIM115 (kept open across blocks)
            except OSError as exc:
                raise self._storage_error("create", path, exc) from exc
            txn = self._txns[msg.xid] = _Txn(path, file)
        elif txn is None:
            raise ProtocolError(f"pgoutput: a stream block of transaction {msg.xid} arrived without its first "
                                "segment")
        self._current = txn

    def _append(self, txn: _Txn, subxid: int, body: bytes) -> None:
        try:
            txn.file.write(_REC.pack(subxid, len(body)))
            txn.file.write(body)
        except OSError as exc:
            raise self._storage_error("write", txn.path, exc) from exc
        txn.bytes += len(body) + _REC.size
        txn.messages += 1

    def _abort(self, msg: pgoutput.StreamAbort) -> None:
        if msg.xid not in self._txns:
            return  # nothing of it was spooled on this connection: nothing to drop
        if msg.subxid == msg.xid:
            self._drop(msg.xid)
            self.aborted += 1
        else:
            self._txns[msg.xid].aborted.add(msg.subxid)
            self.aborted_subtransactions += 1

    def _drop(self, xid: int) -> None:
        txn = self._txns.pop(xid)
        if self._current is txn:
            self._current = None
        _discard(txn.file)
        txn.path.unlink(missing_ok=True)

    def _replay(self, msg: pgoutput.StreamCommit) -> Iterator[list[bytes]]:
        txn = self._txns.get(msg.xid)
        if txn is None:
            raise ProtocolError(f"pgoutput: Stream Commit of transaction {msg.xid}, which was never streamed on "
                                "this connection (its changes would be lost)")
        try:
            txn.file.flush()
        except OSError as exc:
            raise self._storage_error("write", txn.path, exc) from exc
        out = [pgoutput.encode_begin(msg.commit_lsn, msg.commit_ts_us, msg.xid)]
        size = 0
        for body in self._read(txn):
            out.append(body)
            size += len(body)
            if len(out) >= REPLAY_MESSAGES or size >= REPLAY_BYTES:
                yield out
                out = []
                size = 0
        out.append(pgoutput.encode_commit(msg.commit_lsn, msg.end_lsn, msg.commit_ts_us))
        # Dropped before the last list goes out: the runtime may keep the caller suspended there for long.
        self._drop(msg.xid)
        self.committed += 1
        yield out

    def _read(self, txn: _Txn) -> Iterator[bytes]:
        """The spooled messages in order, without the changes of aborted subtransactions."""
        aborted = txn.aborted
        unpack = _REC.unpack_from
        head = _REC.size
        try:
            with open(txn.path, "rb", buffering=0) as f:
                buf = b""
                pos = 0
                while True:
                    block = f.read(_READ_BLOCK)
                    if not block:
                        break
                    buf = buf[pos:] + block if pos < len(buf) else block
                    pos = 0
                    end = len(buf)
                    while pos + head <= end:
                        subxid, size = unpack(buf, pos)
                        if pos + head + size > end:
                            break
                        start = pos + head
                        pos = start + size
                        if aborted and subxid in aborted and buf[start] not in _KEPT_ON_ABORT:
                            continue
                        yield buf[start:pos]
                if pos != len(buf):
                    raise ProtocolError(f"in-progress spool {txn.path} ends inside a record ({len(buf) - pos} "
                                        "bytes left): it was changed behind cdcd's back")
        except OSError as exc:
            raise self._storage_error("read", txn.path, exc) from exc

    @staticmethod
    def _storage_error(what: str, path: Path, exc: OSError) -> SourceError:
        return SourceError(f"cannot {what} the in-progress transaction spool {path}: {exc.strerror or exc}; "
                           f"{storage_fix(exc)} (or set source.postgres.stream_in_progress = false to let the "
                           "server hold large transactions until they commit)")



def _discard(file: BinaryIO) -> None:
    """Close a spool file whose content is being thrown away. Closing flushes the write buffer, which fails
    on the very volume faults that end a spool (ENOSPC): that error concerns bytes no one will read, and the
    descriptor is closed anyway, so it must not stop the cleanup (the write itself already raised)."""
    try:
        file.close()
    except OSError:
        return


def spool_dir(state_path: Path) -> Path:
    return state_path / SPOOL_DIR
