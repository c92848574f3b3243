"""The bulk snapshot reader (mysqlclient) over TLS: every source.sslmode against a MariaDB with TLS.

The bulk connections must be exactly as safe as the aiomysql connection they join: encrypted when it is
(the server's TLS counters count every connection the snapshot opens), the chain checked against the same
CA, the host name checked for verify-full only. Values are compared with the aiomysql reader's.
"""

from __future__ import annotations

import shutil
import ssl
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pymysql
import pytest
import structlog
from my_helpers import execute, my_config
from source_driver import SourceDriver
from test_mysql_snapshot_bulk import EXTRA, _rows, _same
from test_mysql_tls import Certs, _openssl, make_certs

from cdcd.config import Config
from cdcd.errors import SourceError, SourceFatal
from cdcd.events import Item, Mark, MarkKind
from cdcd.sources.mysql import MySqlSource, bulkread
from cdcd.sources.mysql import snapshot as mysql_snapshot
from cdcd.sources.mysql.tls import ClientTls, Tls, TlsError
from devtools.servers import MariaDBServer

pytestmark = pytest.mark.skipif(not bulkread.available(), reason="mysqlclient is not installed")

MODES = ["disable", "prefer", "require", "verify-ca", "verify-full"]
TABLES = ["zk", "fk", "ek", "bk", "n"]


@pytest.fixture(scope="module")
def certs() -> Iterator[Certs]:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    c = make_certs()
    try:
        yield c
    finally:
        shutil.rmtree(c.dir, ignore_errors=True)


@pytest.fixture(scope="module")
def tls_server(certs: Certs) -> Iterator[MariaDBServer]:
    server = MariaDBServer(settings={"ssl-ca": str(certs.ca), "ssl-cert": str(certs.server_crt),
                                     "ssl-key": str(certs.server_key)}).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def tls_db(tls_server: MariaDBServer) -> str:
    db = tls_server.create_database("bulk_tls")
    execute(tls_server, db, *EXTRA)  # zk (zero dates), fk, ek, bk, n: 8000+ rows
    return db


def _counters(server: MariaDBServer) -> dict[str, int]:
    conn = pymysql.connect(host="127.0.0.1", port=server.port, user="root", password="", ssl_disabled=True)
    try:
        with conn.cursor() as cur:
            cur.execute("SHOW GLOBAL STATUS WHERE Variable_name IN ('Connections', 'Ssl_finished_accepts')")
            return {str(k): int(v) for k, v in cur.fetchall()}
    finally:
        conn.close()


async def _snapshot(cfg: Config, bulk: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[list[Item], str, list[Any]]:
    """Snapshot with the bulk reader allowed or not; the items, the reader that ran and the log events."""
    with monkeypatch.context() as m, structlog.testing.capture_logs() as logs:
        m.setattr(bulkread, "available", lambda: bulk)
        async with SourceDriver(MySqlSource(cfg), None, None, False) as d:
            items = await d.take(lambda got: any(isinstance(i, Mark) and i.kind is MarkKind.SNAPSHOT_DONE
                                                 for i in got))
            snap = d.source._snapshot.snapshotter  # type: ignore[union-attr]
            assert snap is not None
            reader = snap.reader
    return items, reader, logs


def _readers(logs: list[Any]) -> list[Any]:
    return [e for e in logs if e["event"] == "mysql.snapshot.reader"]


def _assert_same(ref_items: list[Item], bulk_items: list[Item]) -> None:
    ref, bulk = _rows(ref_items), _rows(bulk_items)
    assert set(ref) == set(bulk) == set(TABLES)
    for table in TABLES:
        assert len(ref[table]) == len(bulk[table]), table
        for (want, want_keys), (got, got_keys) in zip(ref[table], bulk[table], strict=True):
            for name in want:
                assert _same(want[name], got[name]), (table, name, want[name], got[name])
            assert want_keys == got_keys, table


@pytest.mark.parametrize("mode", MODES)
async def test_bulk_reader_serves_every_sslmode(mode: str, tls_server: MariaDBServer, tls_db: str, certs: Certs,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    root = {"sslrootcert": str(certs.ca)} if mode.startswith("verify") else {}
    cfg = my_config(tls_server, tls_db, TABLES, source={"sslmode": mode, **root},
                    snapshot={"chunk_rows": 1000, "parallelism": 2})
    ref_items, ref_reader, _ = await _snapshot(cfg, False, monkeypatch)
    before = _counters(tls_server)
    bulk_items, reader, logs = await _snapshot(cfg, True, monkeypatch)
    after = _counters(tls_server)
    assert (ref_reader, reader) == ("aiomysql", "bulk")
    encrypted = mode != "disable"
    assert [(e["reader"], e["sslmode"], e["tls"]) for e in _readers(logs)] == [("bulk", mode, encrypted)]
    # every connection the source opened (control, snapshot, bulk, binlog) is encrypted, or none is
    opened = after["Connections"] - before["Connections"] - 1  # less the counting connection itself
    assert opened >= 1 + 2 * 2  # the control connection, two snapshot connections and their two bulk ones
    assert after["Ssl_finished_accepts"] - before["Ssl_finished_accepts"] == (opened if encrypted else 0)
    _assert_same(ref_items, bulk_items)


async def test_prefer_against_a_plain_server_reads_in_bulk_unencrypted(
        maria_server: MariaDBServer, monkeypatch: pytest.MonkeyPatch) -> None:
    db = maria_server.create_database("bulk_prefer_plain")
    execute(maria_server, db, *EXTRA[3:5])
    cfg = my_config(maria_server, db, ["fk"], source={"sslmode": "prefer"})
    _, reader, logs = await _snapshot(cfg, True, monkeypatch)
    assert reader == "bulk"
    assert [(e["reader"], e["tls"]) for e in _readers(logs)] == [("bulk", False)]


def _der(crt: Path) -> bytes:
    return ssl.PEM_cert_to_DER_cert(crt.read_text())


def _bulk(server: MariaDBServer, tls: Tls, verified: Path | None = None) -> bulkread.BulkConnection:
    """A bulk connection joining one that verified the certificate ``verified`` (verify-full pins it)."""
    mapped = tls.for_mysqlclient(True, _der(verified) if verified is not None else None)
    assert isinstance(mapped, ClientTls), mapped
    return bulkread.BulkConnection({"host": tls.host, "port": server.port, "user": "cdc", "password": "secret",
                                    "connect_timeout": 5}, 10.0, mapped)


@pytest.mark.parametrize("mode", ["require", "verify-ca", "verify-full"])
def test_wrong_ca_fails_naming_the_server_and_the_ca_file(mode: str, tls_server: MariaDBServer,
                                                          certs: Certs) -> None:
    conn = _bulk(tls_server, Tls.build(mode, certs.other_ca, "127.0.0.1", tls_server.port), certs.server_crt)
    with pytest.raises(TlsError) as info:
        conn.open()
    msg = str(info.value)
    assert f"127.0.0.1:{tls_server.port}" in msg and f"source.sslrootcert = '{certs.other_ca}'" in msg, msg
    assert f"source.sslmode = '{mode}'" in msg and "bulk reader" in msg, msg


def test_host_name_checked_for_verify_full_only(tls_server: MariaDBServer, certs: Certs) -> None:
    """A certificate from the right CA for another name: verify-ca and require (with the CA) accept it, as the
    aiomysql connections do; verify-full refuses it; without a CA, require does not look at it."""
    saved = certs.server_crt.read_bytes(), certs.server_key.read_bytes()
    _serve(tls_server, certs, certs.elsewhere_crt.read_bytes(), certs.elsewhere_key.read_bytes())
    try:
        for mode, root in (("verify-ca", certs.ca), ("require", certs.ca), ("require", None), ("prefer", None)):
            conn = _bulk(tls_server, Tls.build(mode, root, "127.0.0.1", tls_server.port))
            conn.open()
            try:
                assert conn.cipher, mode
            finally:
                conn.close()
        # even pinned to the very certificate it is shown, the name must match
        conn = _bulk(tls_server, Tls.build("verify-full", certs.ca, "127.0.0.1", tls_server.port),
                     certs.elsewhere_crt)
        with pytest.raises(TlsError, match=r"bulk reader .* source.sslmode = 'verify-full'"):
            conn.open()
    finally:
        _serve(tls_server, certs, *saved)


def _serve(server: MariaDBServer, certs: Certs, crt: bytes, key: bytes) -> None:
    certs.server_crt.write_bytes(crt)
    certs.server_key.write_bytes(key)
    execute(server, "mysql", "FLUSH SSL")


def test_verify_full_pins_the_verified_certificate(tls_server: MariaDBServer, certs: Certs) -> None:
    """A certificate from the right CA that libmariadb's own name check takes for 127.0.0.1 (no
    subjectAltName, CN=127.0.0.1; Python refuses it) but not the one the snapshot connection verified: the
    bulk connection refuses it, and says so as a retryable error (a replaced certificate reconnects)."""
    saved = certs.server_crt.read_bytes(), certs.server_key.read_bytes()
    d = certs.dir
    (d / "nosan.ext").write_text("basicConstraints = CA:FALSE\n")
    _openssl("req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-subj",
             "/CN=127.0.0.1", "-keyout", str(d / "nosan.key"), "-out", str(d / "nosan.csr"))
    _openssl("x509", "-req", "-in", str(d / "nosan.csr"), "-CA", str(certs.ca), "-CAkey", str(d / "ca.key"),
             "-CAcreateserial", "-days", "2", "-extfile", str(d / "nosan.ext"), "-out", str(d / "nosan.crt"))
    verified = d / "verified.crt"
    verified.write_bytes(saved[0])
    _serve(tls_server, certs, (d / "nosan.crt").read_bytes(), (d / "nosan.key").read_bytes())
    try:
        conn = _bulk(tls_server, Tls.build("verify-full", certs.ca, "127.0.0.1", tls_server.port), verified)
        with pytest.raises(SourceError, match="not the one the snapshot connection verified") as info:
            conn.open()
        assert not isinstance(info.value, SourceFatal)
    finally:
        _serve(tls_server, certs, *saved)
    conn = _bulk(tls_server, Tls.build("verify-full", certs.ca, "127.0.0.1", tls_server.port), verified)
    conn.open()  # the verified certificate is back
    try:
        assert conn.cipher
    finally:
        conn.close()


@pytest.mark.parametrize("mode", ["verify-ca", "verify-full"])
def test_system_cas_without_sslrootcert(mode: str, tls_server: MariaDBServer, certs: Certs,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Without sslrootcert both connections trust OpenSSL's default CAs (here SSL_CERT_FILE): the same set."""
    monkeypatch.setenv("SSL_CERT_FILE", str(certs.ca))
    conn = _bulk(tls_server, Tls.build(mode, None, "127.0.0.1", tls_server.port), certs.server_crt)
    conn.open()
    try:
        assert conn.cipher
    finally:
        conn.close()
    monkeypatch.setenv("SSL_CERT_FILE", str(certs.other_ca))
    with pytest.raises(TlsError, match=r"checked against the system CAs \(source.sslrootcert is not set\)"):
        _bulk(tls_server, Tls.build(mode, None, "127.0.0.1", tls_server.port), certs.server_crt).open()


async def test_localhost_keeps_the_aiomysql_reader_said_once(
        maria_server: MariaDBServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """libmariadb takes 'localhost' for its Unix socket (another path, maybe another server): the aiomysql
    reader runs, and the warning comes once."""
    db = maria_server.create_database("bulk_localhost")
    execute(maria_server, db, *EXTRA[3:5])
    cfg = my_config(maria_server, db, ["fk"], source={"host": "localhost"})
    monkeypatch.setattr(mysql_snapshot, "_told", set())
    warned = []
    for _ in range(2):
        _, reader, logs = await _snapshot(cfg, True, monkeypatch)
        assert reader == "aiomysql"
        assert [(e["reader"], e["tls"]) for e in _readers(logs)] == [("aiomysql", False)]
        warned += [e for e in logs if e["event"] == "mysql.snapshot.bulk_reader_off"]
    assert len(warned) == 1 and "Unix socket" in warned[0]["reason"]
