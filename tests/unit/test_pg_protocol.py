"""Unit tests of the pure protocol layer: framing, replication messages, auth math."""

from __future__ import annotations

import base64
import struct

import pytest

from cdcd.sources.postgres.wire import protocol as p


def test_scram_rfc7677_vector() -> None:
    client = p.ScramClient("pencil", nonce="rOprNGfwEbeRWgbNEkqO")
    # RFC 7677 uses the user name "user"; PostgreSQL sends an empty one and the server ignores it.
    assert client.client_first() == b"n,,n=,r=rOprNGfwEbeRWgbNEkqO"
    client._client_first_bare = "n=user,r=rOprNGfwEbeRWgbNEkqO"
    server_first = b"r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,s=W22ZaJ0SNY7soEsUEjb6gQ==,i=4096"
    final = client.client_final(server_first)
    assert final == (b"c=biws,r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,"
                     b"p=dHzbZapWIk4jUhN+Ute9ytag9zjfMHgsqmmiz7AndVQ=")
    client.verify_server_final(b"v=6rriTRBi23WpRR/wtup+mMhUZUn/dB5nLTJRsjl95G4=")


def test_scram_rejects_a_wrong_server() -> None:
    client = p.ScramClient("pencil", nonce="abc")
    with pytest.raises(p.ProtocolError, match="nonce"):
        client.client_final(b"r=zzz,s=" + base64.b64encode(b"salt") + b",i=4096")
    client.client_final(b"r=abcdef,s=" + base64.b64encode(b"salt") + b",i=4096")
    with pytest.raises(p.ProtocolError, match="signature"):
        client.verify_server_final(b"v=" + base64.b64encode(b"x" * 32))
    with pytest.raises(p.ProtocolError, match="invalid-proof"):
        client.verify_server_final(b"e=invalid-proof")


def test_md5_password() -> None:
    # md5(md5("secret" + "cdc_md5").hex + salt).hex, computed independently with hashlib by hand.
    import hashlib

    inner = hashlib.md5(b"secretcdc_md5").hexdigest().encode()
    assert p.md5_password("cdc_md5", "secret", b"\x01\x02\x03\x04") == \
        "md5" + hashlib.md5(inner + b"\x01\x02\x03\x04").hexdigest()
    assert p.md5_password("u", "pw", b"abcd") != p.md5_password("u", "pw", b"abce")


def test_startup_and_query_framing() -> None:
    msg = p.startup_message({"user": "u", "replication": "database"})
    (length, version) = struct.unpack("!ii", msg[:8])
    assert length == len(msg) and version == 196608
    assert msg[8:] == b"user\x00u\x00replication\x00database\x00\x00"
    q = p.query_message("IDENTIFY_SYSTEM")
    assert q[:1] == b"Q" and struct.unpack("!i", q[1:5])[0] == len(q) - 1 and q.endswith(b"\x00")
    assert p.ssl_request() == struct.pack("!ii", 8, 80877103)
    assert p.copy_done() == b"c\x00\x00\x00\x04"


def test_message_buffer_splits_partial_reads() -> None:
    stream = p.copy_data(b"k" + struct.pack("!Qq?", 5, 6, True)) + b"Z\x00\x00\x00\x05I"
    buf = p.MessageBuffer()
    got: list[p.BackendMessage] = []
    for i in range(len(stream)):  # one byte at a time: the worst case
        buf.feed(stream[i : i + 1])
        got.extend(buf)
    assert [m.kind for m in got] == [b"d", b"Z"]
    assert got[1].payload == b"I"
    assert buf.pending == 0
    ka = p.parse_copy_data(got[0].payload)
    assert ka == p.Keepalive(5, 6, True)


def test_xlogdata_and_status_update() -> None:
    payload = b"w" + struct.pack("!QQq", 100, 200, 300) + b"B..."
    assert p.parse_copy_data(payload) == p.XLogData(100, 200, 300, b"B...")
    msg = p.standby_status_update(10, 9, 8, p.PG_EPOCH_US + 7, reply=True)
    assert msg[:1] == b"d"
    tag, write, flush, apply, ts, reply = struct.unpack("!cQQQq?", msg[5:])
    assert (tag, write, flush, apply, ts, reply) == (b"r", 10, 9, 8, 7, True)
    with pytest.raises(p.ProtocolError):
        p.parse_copy_data(b"x")


def test_backend_message_parsers() -> None:
    err = b"SERROR\x00VERROR\x00C42704\x00Mreplication slot \"s\" does not exist\x00\x00"
    assert p.parse_error_fields(err) == {"severity": "ERROR", "sqlstate": "42704",
                                         "message": 'replication slot "s" does not exist'}
    desc = struct.pack("!h", 2) + b"a\x00" + b"\x00" * 18 + b"b\x00" + b"\x00" * 18
    assert p.parse_row_description(desc) == ["a", "b"]
    row = struct.pack("!hi", 2, 3) + b"0/1" + struct.pack("!i", -1)
    assert p.parse_data_row(row) == ["0/1", None]
    assert p.parse_auth(struct.pack("!i", 5) + b"salt") == (5, b"salt")
    assert p.parse_parameter_status(b"server_version\x0015.4\x00") == ("server_version", "15.4")


def test_duration_settings() -> None:
    from cdcd.sources.postgres.wire.replication import parse_duration_s

    assert parse_duration_s("60s") == 60 and parse_duration_s("1min") == 60 and parse_duration_s("0") == 0
    assert parse_duration_s("500ms") == 0.5 and parse_duration_s("2h") == 7200
