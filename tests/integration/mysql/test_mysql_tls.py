"""TLS per source.sslmode against a MariaDB with TLS (certificates from a CA made here) and the plain fixture
server: the query connections (aiomysql), the binlog connections (PyMySQL) and the whole source."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pymysql
import pytest
from my_helpers import Driver, my_config

from cdcd.events import ChangeEvent
from cdcd.sources.mysql import MySqlSource
from cdcd.sources.mysql.snapshot import open_connection
from cdcd.sources.mysql.tls import Tls, TlsError
from devtools.servers import MariaDBServer

MODES = ["disable", "prefer", "require", "verify-ca", "verify-full"]


@dataclass
class Certs:
    dir: Path
    ca: Path  # signed the server's certificate
    other_ca: Path  # did not
    server_crt: Path
    server_key: Path
    elsewhere_crt: Path  # signed by ca, for db.example.com only
    elsewhere_key: Path


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def _ca(d: Path, name: str) -> tuple[Path, Path]:
    key, crt = d / f"{name}.key", d / f"{name}.crt"
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-days", "2",
             "-subj", f"/CN={name}", "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign", "-keyout", str(key), "-out", str(crt))
    return key, crt


def _leaf(d: Path, name: str, cn: str, san: str, ca_key: Path, ca_crt: Path) -> tuple[Path, Path]:
    key, csr, crt, ext = d / f"{name}.key", d / f"{name}.csr", d / f"{name}.crt", d / f"{name}.ext"
    ext.write_text(f"subjectAltName = {san}\nbasicConstraints = CA:FALSE\n"
                   "keyUsage = digitalSignature, keyEncipherment\nextendedKeyUsage = serverAuth\n")
    _openssl("req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-subj",
             f"/CN={cn}", "-keyout", str(key), "-out", str(csr))
    _openssl("x509", "-req", "-in", str(csr), "-CA", str(ca_crt), "-CAkey", str(ca_key), "-CAcreateserial",
             "-days", "2", "-extfile", str(ext), "-out", str(crt))
    key.chmod(0o644)  # throwaway test keys; the server runs as an unprivileged user
    return key, crt


def make_certs() -> Certs:
    d = Path(tempfile.mkdtemp(prefix="cdcd-my-tls-"))
    d.chmod(0o755)
    ca_key, ca = _ca(d, "ca")
    _, other = _ca(d, "other-ca")
    skey, scrt = _leaf(d, "server", "127.0.0.1", "IP:127.0.0.1,DNS:localhost", ca_key, ca)
    ekey, ecrt = _leaf(d, "elsewhere", "db.example.com", "DNS:db.example.com", ca_key, ca)
    # the server reads these paths; tests swap the files' contents (FLUSH SSL) and restore them
    live_crt, live_key = d / "live.crt", d / "live.key"
    shutil.copy(scrt, live_crt)
    shutil.copy(skey, live_key)
    return Certs(d, ca, other, live_crt, live_key, ecrt, ekey)


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


def settings(server: MariaDBServer, host: str = "127.0.0.1") -> dict[str, Any]:
    return {"host": host, "port": server.port, "user": "cdc", "password": "secret", "charset": "utf8mb4",
            "connect_timeout": 5}


def tls_for(server: MariaDBServer, mode: str, root: Path | None = None, host: str = "127.0.0.1") -> Tls:
    return Tls.build(mode, root, host, server.port)


async def aio_cipher(server: MariaDBServer, tls: Tls) -> str:
    """Connect with aiomysql (queries, snapshot, KILL) and return the session's Ssl_cipher ('' when plain)."""
    conn = await open_connection(settings(server, tls.host), tls)
    try:
        async with conn.cursor() as cur:
            await cur.execute("SHOW SESSION STATUS LIKE 'Ssl_cipher'")
            row = await cur.fetchone()
        return str(row[1] or "")
    finally:
        conn.close()


def binlog_cipher(server: MariaDBServer, tls: Tls) -> str:
    """Connect as the binlog reader does (PyMySQL) and return the session's Ssl_cipher."""
    conn = tls.connect_blocking(**settings(server, tls.host))
    try:
        with conn.cursor() as cur:
            cur.execute("SHOW SESSION STATUS LIKE 'Ssl_cipher'")
            row = cur.fetchone()
        return str(row[1] or "")
    finally:
        conn.close()


async def both_fail(server: MariaDBServer, tls: Tls, match: str) -> TlsError:
    with pytest.raises(TlsError, match=match):
        binlog_cipher(server, tls)
    with pytest.raises(TlsError, match=match) as info:
        await aio_cipher(server, tls)
    return info.value


@pytest.mark.parametrize("mode", MODES)
async def test_each_mode_against_the_tls_server(mode: str, tls_server: MariaDBServer, certs: Certs) -> None:
    tls = tls_for(tls_server, mode, certs.ca if mode.startswith("verify") else None)
    for cipher in (await aio_cipher(tls_server, tls), binlog_cipher(tls_server, tls)):
        assert bool(cipher) is (mode != "disable"), cipher


async def test_verify_full_checks_the_name(tls_server: MariaDBServer, certs: Certs) -> None:
    # the certificate lists both names
    assert await aio_cipher(tls_server, tls_for(tls_server, "verify-full", certs.ca, "localhost"))
    assert binlog_cipher(tls_server, tls_for(tls_server, "verify-full", certs.ca, "localhost"))
    # a certificate from the right CA for another name: verify-ca accepts it, verify-full does not
    shutil.copy(certs.elsewhere_crt, certs.server_crt)
    shutil.copy(certs.elsewhere_key, certs.server_key)
    try:
        tls_server.sql("FLUSH SSL")
        assert await aio_cipher(tls_server, tls_for(tls_server, "verify-ca", certs.ca))
        err = await both_fail(tls_server, tls_for(tls_server, "verify-full", certs.ca),
                              "certificate of the server at 127.0.0.1:.* does not name '127.0.0.1'")
        assert "verify-ca" in err.fix and "subjectAltName" in err.fix
    finally:
        shutil.copy(certs.dir / "server.crt", certs.server_crt)
        shutil.copy(certs.dir / "server.key", certs.server_key)
        tls_server.sql("FLUSH SSL")
    assert await aio_cipher(tls_server, tls_for(tls_server, "verify-full", certs.ca))


async def test_untrusted_certificate(tls_server: MariaDBServer, certs: Certs) -> None:
    err = await both_fail(tls_server, tls_for(tls_server, "verify-ca", certs.other_ca),
                          "is not trusted with source.sslmode = 'verify-ca' .*checked against "
                          f"source.sslrootcert = '{certs.other_ca}'")
    assert "source.sslrootcert" in err.fix
    await both_fail(tls_server, tls_for(tls_server, "verify-full", None),
                    "not trusted .*checked against the system CAs")
    # require with sslrootcert verifies the chain too (libpq); without it, it does not
    await both_fail(tls_server, tls_for(tls_server, "require", certs.other_ca), "not trusted")
    assert await aio_cipher(tls_server, tls_for(tls_server, "require", None))


@pytest.mark.parametrize("mode", ["require", "verify-ca", "verify-full"])
async def test_plain_server_refuses_required_tls(mode: str, maria_server: MariaDBServer, certs: Certs) -> None:
    err = await both_fail(maria_server, tls_for(maria_server, mode, certs.ca),
                          f"server at 127.0.0.1:{maria_server.port} does not offer TLS but "
                          f"source.sslmode = '{mode}'")
    assert "ssl_cert" in err.fix and "'prefer'" in err.fix
    assert "secret" not in str(err)


@pytest.mark.parametrize("mode", ["disable", "prefer"])
async def test_plain_server_works_with_disable_and_prefer(mode: str, maria_server: MariaDBServer) -> None:
    tls = tls_for(maria_server, mode)
    assert await aio_cipher(maria_server, tls) == ""
    assert binlog_cipher(maria_server, tls) == ""


def _counters(conn: pymysql.connections.Connection) -> dict[str, int]:
    with conn.cursor() as cur:
        cur.execute("SHOW GLOBAL STATUS WHERE Variable_name IN ('Connections', 'Ssl_accepts', "
                    "'Ssl_finished_accepts')")
        return {str(k): int(v) for k, v in cur.fetchall()}


@pytest.mark.parametrize("mode", ["verify-full", "disable"])
async def test_source_streams_over_tls(mode: str, tls_server: MariaDBServer, certs: Certs) -> None:
    """Every connection of a streaming source (control, binlog) is encrypted with verify-full, none with
    disable: the server's connection and TLS counters move together."""
    db = tls_server.create_database(f"tls_{mode.replace('-', '_')}")
    # the test's own connection is plain and opened before counting, so only the source's connections count
    own = pymysql.connect(host="127.0.0.1", port=tls_server.port, user="root", password="", database=db,
                          autocommit=True, ssl_disabled=True)
    try:
        with own.cursor() as cur:
            cur.execute("CREATE TABLE t (id INT PRIMARY KEY, v VARCHAR(10))")
        cfg = my_config(tls_server, db, ["t"], source={"sslmode": mode, "sslrootcert": str(certs.ca)},
                        snapshot={"mode": "never"})
        before = _counters(own)
        async with Driver(cfg) as d:
            with own.cursor() as cur:
                cur.execute("INSERT INTO t VALUES (1, 'tls')")
            events = await d.events(1)
            assert isinstance(events[0], ChangeEvent) and events[0].after == {"id": 1, "v": "tls"}
            reader = d.source._stream.reader
            assert reader is not None
            dump_threads = len(reader.thread_ids)
            after = _counters(own)
    finally:
        own.close()
    opened = after["Connections"] - before["Connections"]
    assert dump_threads >= 1 and opened >= 1 + dump_threads  # the control connection and the binlog's
    encrypted = after["Ssl_finished_accepts"] - before["Ssl_finished_accepts"]
    assert encrypted == (opened if mode == "verify-full" else 0)
    assert after["Ssl_accepts"] - before["Ssl_accepts"] == encrypted


async def test_check_reports_encryption(tls_server: MariaDBServer, maria_server: MariaDBServer,
                                        certs: Certs) -> None:
    async def tls_line(server: MariaDBServer, mode: str) -> Any:
        db = server.create_database(f"chk_{mode.replace('-', '_')}_{server.port}")
        server.sql("CREATE TABLE t (id INT PRIMARY KEY)", database=db)
        source = MySqlSource(my_config(server, db, ["t"], source={"sslmode": mode, "sslrootcert": str(certs.ca)}))
        try:
            results = {r.name: r for r in await source.preflight()}
        finally:
            await source.close()
        return results.get("tls", results["connect"])

    line = await tls_line(tls_server, "verify-full")
    assert line.ok and line.detail.startswith("encrypted with TLSv1.") \
        and "certificate and host name verified" in line.detail
    line = await tls_line(maria_server, "prefer")
    assert line.ok and line.detail.startswith("not encrypted: the server at") and "offers no TLS" in line.detail
    line = await tls_line(maria_server, "disable")
    assert line.ok and line.detail == "not encrypted (source.sslmode = 'disable')"
    line = await tls_line(maria_server, "require")
    assert line.name == "connect" and not line.ok and "does not offer TLS" in line.detail
    assert "ssl_cert" in line.fix
