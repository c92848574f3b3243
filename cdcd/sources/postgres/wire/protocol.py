"""PostgreSQL frontend/backend protocol: pure encoders, decoders and auth math.

No I/O here: ``replication.py`` moves the bytes. Everything is a function of
bytes (or a small incremental parser fed with bytes), so it is unit-testable
without a server. Only what a streaming-replication client needs is covered.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import struct
import unicodedata
from collections.abc import Iterator
from dataclasses import dataclass

PROTOCOL_VERSION = 196608  # 3.0
SSL_REQUEST_CODE = 80877103
PG_EPOCH_US = 946684800 * 1_000_000  # 2000-01-01 in Unix microseconds

_I32 = struct.Struct("!i")
_HDR = struct.Struct("!cI")


class ProtocolError(Exception):
    """The server sent something this client does not understand."""


# ---------------------------------------------------------------- frontend messages

def _message(kind: bytes, payload: bytes) -> bytes:
    return kind + _I32.pack(len(payload) + 4) + payload


def _cstr(text: str) -> bytes:
    return text.encode() + b"\x00"


def ssl_request() -> bytes:
    return struct.pack("!ii", 8, SSL_REQUEST_CODE)


def startup_message(params: dict[str, str]) -> bytes:
    body = struct.pack("!i", PROTOCOL_VERSION) + b"".join(_cstr(k) + _cstr(v) for k, v in params.items()) + b"\x00"
    return _I32.pack(len(body) + 4) + body


def password_message(password: str) -> bytes:
    return _message(b"p", _cstr(password))


def sasl_initial_response(mechanism: str, data: bytes) -> bytes:
    return _message(b"p", _cstr(mechanism) + _I32.pack(len(data)) + data)


def sasl_response(data: bytes) -> bytes:
    return _message(b"p", data)


def query_message(sql: str) -> bytes:
    return _message(b"Q", _cstr(sql))


def copy_data(payload: bytes) -> bytes:
    return _message(b"d", payload)


def copy_done() -> bytes:
    return _message(b"c", b"")


def terminate_message() -> bytes:
    return _message(b"X", b"")


# ---------------------------------------------------------------- backend messages

@dataclass(frozen=True, slots=True)
class BackendMessage:
    kind: bytes
    payload: bytes


class MessageBuffer:
    """Splits a byte stream into backend messages; feed it whatever the socket gave.

    The buffer is one ``bytes`` object and an offset, not a bytearray: a message's payload is then a slice of
    it (one copy), and ``take_xlog`` can cut every XLogData of a socket read out of it in one loop. A read
    that cannot complete the message at the head waits in a list until enough bytes are there, so a message
    spanning many reads is joined once, not once per read.
    """

    def __init__(self) -> None:
        self._buf = b""
        self._pos = 0
        self._waiting: list[bytes] = []
        self._waiting_len = 0
        self._need = 0  # bytes the message at the head needs (from _pos), as far as known

    def feed(self, data: bytes) -> None:
        self._waiting.append(bytes(data))
        self._waiting_len += len(data)
        rest = len(self._buf) - self._pos
        if rest + self._waiting_len < self._need:
            return
        parts = self._waiting
        if rest:
            parts.insert(0, self._buf[self._pos:])
        self._buf = parts[0] if len(parts) == 1 else b"".join(parts)
        self._pos = 0
        self._waiting = []
        self._waiting_len = 0

    def __iter__(self) -> Iterator[BackendMessage]:
        return self

    def __next__(self) -> BackendMessage:
        buf, pos = self._buf, self._pos
        if len(buf) - pos < 5:
            self._need = 5
            raise StopIteration
        kind, length = _HDR.unpack_from(buf, pos)
        end = pos + 1 + length
        if end > len(buf):
            self._need = 1 + length
            raise StopIteration
        self._pos = end
        self._need = 0
        return BackendMessage(kind, buf[pos + 5 : end])

    def take_xlog(self, out: list[bytes]) -> tuple[int, BackendMessage | None]:
        """The XLogData messages at the head, in bulk: appends each one's WAL data (a pgoutput message) to
        ``out`` and returns the highest WAL end among them (0: none) and the first message of any other kind
        (a keepalive's CopyData too), consumed; None when the buffer ends first (a partial message stays).

        One ``struct`` call, one slice and one append per message: no message or XLogData object.
        """
        buf, pos = self._buf, self._pos
        size = len(buf)
        top = 0
        self._need = 0
        frame = _XLOG_FRAME.unpack_from
        head = _XLOG_FRAME.size
        short = head - 1  # a shorter length cannot hold XLogData's header
        last = size - head  # the last offset where a whole frame header fits
        append = out.append
        while pos <= last:
            kind, length, tag, _, wal_end = frame(buf, pos)
            end = pos + 1 + length
            if kind != b"d" or tag != b"w" or length < short:
                self._pos = pos
                return top, next(self, None)
            if end > size:
                self._pos = pos
                self._need = 1 + length
                return top, None
            append(buf[pos + head : end])
            if wal_end > top:
                top = wal_end
            pos = end
        self._pos = pos
        return top, next(self, None)

    @property
    def pending(self) -> int:
        return len(self._buf) - self._pos + self._waiting_len


# Fields of ErrorResponse / NoticeResponse.
ERROR_FIELDS = {"S": "severity", "V": "severity", "C": "sqlstate", "M": "message", "D": "detail", "H": "hint"}


def parse_error_fields(payload: bytes) -> dict[str, str]:
    out: dict[str, str] = {}
    for part in payload.split(b"\x00"):
        if not part:
            continue
        name = ERROR_FIELDS.get(chr(part[0]))
        if name:
            out[name] = part[1:].decode(errors="replace")
    return out


def parse_auth(payload: bytes) -> tuple[int, bytes]:
    """AuthenticationXxx: the request code and its data."""
    (code,) = _I32.unpack_from(payload)
    return code, payload[4:]


def parse_parameter_status(payload: bytes) -> tuple[str, str]:
    name, value, _ = payload.split(b"\x00", 2)
    return name.decode(), value.decode()


def parse_row_description(payload: bytes) -> list[str]:
    (count,) = struct.unpack_from("!h", payload)
    names: list[str] = []
    pos = 2
    for _ in range(count):
        end = payload.index(b"\x00", pos)
        names.append(payload[pos:end].decode())
        pos = end + 1 + 18  # table oid, column no, type oid, type size, typmod, format
    return names


def parse_data_row(payload: bytes) -> list[str | None]:
    (count,) = struct.unpack_from("!h", payload)
    values: list[str | None] = []
    pos = 2
    for _ in range(count):
        (size,) = _I32.unpack_from(payload, pos)
        pos += 4
        if size < 0:
            values.append(None)
        else:
            values.append(payload[pos : pos + size].decode())
            pos += size
    return values


# ---------------------------------------------------------------- replication CopyData

@dataclass(frozen=True, slots=True)
class XLogData:
    start: int
    wal_end: int
    send_time_us: int
    data: bytes


@dataclass(frozen=True, slots=True)
class Keepalive:
    wal_end: int
    send_time_us: int
    reply_requested: bool


_XLOG = struct.Struct("!QQq")
#: A CopyData frame around XLogData: kind, length, tag, WAL start, WAL end, then the send time (not read).
_XLOG_FRAME = struct.Struct("!cIcQQ8x")
_KEEPALIVE = struct.Struct("!Qq?")
_STATUS = struct.Struct("!cQQQq?")


def parse_copy_data(payload: bytes) -> XLogData | Keepalive:
    tag = payload[:1]
    if tag == b"w":
        if len(payload) < _XLOG.size + 1:
            raise ProtocolError(f"a replication XLogData message of {len(payload)} bytes is truncated")
        start, end, ts = _XLOG.unpack_from(payload, 1)
        return XLogData(start, end, ts, payload[25:])
    if tag == b"k":
        if len(payload) < _KEEPALIVE.size + 1:
            raise ProtocolError(f"a replication keepalive message of {len(payload)} bytes is truncated")
        end, ts, reply = _KEEPALIVE.unpack_from(payload, 1)
        return Keepalive(end, ts, reply)
    raise ProtocolError(f"unexpected replication CopyData message {tag!r}")


def standby_status_update(write: int, flush: int, apply: int, now_us: int, reply: bool = False) -> bytes:
    """The 'r' message; ``now_us`` is Unix microseconds."""
    return copy_data(_STATUS.pack(b"r", write, flush, apply, now_us - PG_EPOCH_US, reply))


# ---------------------------------------------------------------- authentication math

def md5_password(user: str, password: str, salt: bytes) -> str:
    inner = hashlib.md5((password + user).encode()).hexdigest()
    return "md5" + hashlib.md5(inner.encode() + salt).hexdigest()


def _saslprep(password: str) -> str:
    # RFC 4013 in its common subset: map non-ASCII spaces to space, drop "mapped to nothing", NFKC.
    # PostgreSQL itself falls back to the raw bytes when SASLprep fails, so this never rejects.
    mapped = "".join(" " if unicodedata.category(c) == "Zs" else c for c in password if c not in "\u00ad\u200b\ufeff")
    return unicodedata.normalize("NFKC", mapped)


class ScramClient:
    """SCRAM-SHA-256 (RFC 5802 / 7677) without channel binding."""

    mechanism = "SCRAM-SHA-256"

    def __init__(self, password: str, nonce: str | None = None) -> None:
        self._password = _saslprep(password).encode()
        self._nonce = nonce or base64.b64encode(os.urandom(18)).decode()
        self._client_first_bare = f"n=,r={self._nonce}"
        self._server_signature = b""

    def client_first(self) -> bytes:
        return ("n,," + self._client_first_bare).encode()

    def client_final(self, server_first: bytes) -> bytes:
        text = server_first.decode()
        attrs = dict(part.split("=", 1) for part in text.split(","))
        nonce, salt, iterations = attrs["r"], base64.b64decode(attrs["s"]), int(attrs["i"])
        if not nonce.startswith(self._nonce):
            raise ProtocolError("SCRAM: the server's nonce does not extend ours")
        salted = hashlib.pbkdf2_hmac("sha256", self._password, salt, iterations)
        client_key = hmac.digest(salted, b"Client Key", "sha256")
        stored_key = hashlib.sha256(client_key).digest()
        without_proof = f"c=biws,r={nonce}"
        auth_message = f"{self._client_first_bare},{text},{without_proof}".encode()
        signature = hmac.digest(stored_key, auth_message, "sha256")
        proof = bytes(a ^ b for a, b in zip(client_key, signature, strict=True))
        server_key = hmac.digest(salted, b"Server Key", "sha256")
        self._server_signature = hmac.digest(server_key, auth_message, "sha256")
        return f"{without_proof},p={base64.b64encode(proof).decode()}".encode()

    def verify_server_final(self, server_final: bytes) -> None:
        attrs = dict(part.split("=", 1) for part in server_final.decode().split(","))
        if "e" in attrs:
            raise ProtocolError(f"SCRAM: server reported error {attrs['e']}")
        if not hmac.compare_digest(base64.b64decode(attrs.get("v", "")), self._server_signature):
            raise ProtocolError("SCRAM: the server's signature is wrong (not the server we think it is)")
