"""TLS per sslmode against a PostgreSQL with ssl=on and a self-signed certificate."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from cdcd.errors import SourceError, SourceFatal
from cdcd.sources.postgres.catalog import connect_sql
from cdcd.sources.postgres.wire.replication import ConnectParams, ReplicationConnection
from devtools.servers import PostgresServer


@pytest.fixture(scope="module")
def tls_server() -> Iterator[tuple[PostgresServer, Path]]:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    certs = Path(tempfile.mkdtemp(prefix="cdcd-pg-tls-"))
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
                    "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost",
                    "-keyout", str(certs / "server.key"), "-out", str(certs / "server.crt")],
                   check=True, capture_output=True)
    os.chmod(certs, 0o755)
    os.chmod(certs / "server.key", 0o600)
    if os.geteuid() == 0:
        for f in (certs / "server.key", certs / "server.crt"):
            shutil.chown(f, "postgres")
    server = PostgresServer(settings={"ssl": "on", "ssl_cert_file": f"'{certs / 'server.crt'}'",
                                      "ssl_key_file": f"'{certs / 'server.key'}'"}).start()
    try:
        yield server, certs / "server.crt"
    finally:
        server.stop()
        shutil.rmtree(certs, ignore_errors=True)


def params(server: PostgresServer, sslmode: str, host: str = "127.0.0.1", root: Path | None = None) -> ConnectParams:
    return ConnectParams(host=host, port=server.port, user="cdc_pw", database="postgres", password="secret",
                         sslmode=sslmode, sslrootcert=root, connect_timeout_s=5)


@pytest.mark.parametrize("mode", ["prefer", "require", "verify-ca", "verify-full", "disable"])
async def test_sslmodes(mode: str, tls_server: tuple[PostgresServer, Path]) -> None:
    server, cert = tls_server
    host = "localhost" if mode == "verify-full" else "127.0.0.1"
    p = params(server, mode, host, cert if mode.startswith("verify") else None)
    repl = await ReplicationConnection.connect(p)
    try:
        assert repl.tls is (mode != "disable")
        assert (await repl.identify_system())["dbname"] == "postgres"
    finally:
        await repl.close()
    conn = await connect_sql(p)
    try:
        assert await conn.fetchval("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()") is (mode != "disable")
    finally:
        await conn.close()


async def test_verification_failures(tls_server: tuple[PostgresServer, Path], pg_server: PostgresServer) -> None:
    server, cert = tls_server
    with pytest.raises(SourceError):  # the certificate is not trusted by the system store
        await ReplicationConnection.connect(params(server, "verify-ca"))
    with pytest.raises(SourceError):  # the name 127.0.0.1 is not in the certificate
        await ReplicationConnection.connect(params(server, "verify-full", "127.0.0.1", cert))
    with pytest.raises(SourceFatal, match="does not accept TLS"):  # the plain fixture server has ssl off
        await ReplicationConnection.connect(params(pg_server, "require"))
    plain = await ReplicationConnection.connect(params(pg_server, "prefer"))
    assert plain.tls is False
    await plain.close()
