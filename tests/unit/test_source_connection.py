"""The per-source connection modules: one place turns the config into what every connection uses."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from cdcd.config import parse_config
from cdcd.errors import SourceError, reason
from cdcd.sources.mysql import connection as my
from cdcd.sources.mysql.tls import TlsError
from cdcd.sources.postgres import connection as pg


def test_postgres_params_come_from_the_config() -> None:
    config = parse_config({"source": {"kind": "postgres", "host": "db", "port": 6543, "user": "cdc", "password": "pw",
                                      "database": "app", "tables": ["public.t"], "sslmode": "verify-full",
                                      "sslrootcert": "/etc/ca.pem", "connect_timeout_s": 3},
                           "runtime": {"source_read_timeout_s": 42}}, env={})
    params = pg.connect_params(config, application_name="cdcd-verify")
    assert (params.host, params.port, params.user, params.password, params.database) == ("db", 6543, "cdc", "pw", "app")
    assert (params.sslmode, params.sslrootcert, params.connect_timeout_s, params.read_timeout_s) == \
        ("verify-full", Path("/etc/ca.pem"), 3, 42)
    assert params.application_name == "cdcd-verify" and params.where == "postgres://cdc@db:6543/app"
    assert pg.ssl_context("disable", None) is None and pg.ssl_context("prefer", None) is not None


def test_mysql_params_come_from_the_config_and_build_tls_on_first_use(tmp_path: Path) -> None:
    missing = tmp_path / "missing.pem"
    config = parse_config({"source": {"kind": "mariadb", "host": "db", "port": 3307, "user": "cdc", "password": "pw",
                                      "database": "app", "tables": ["app.t"], "sslmode": "verify-ca",
                                      "sslrootcert": str(missing), "connect_timeout_s": 4.9,
                                      "mysql": {"server_id": 9}}}, env={})
    params = my.connect_params(config)
    assert params.settings() == {"host": "db", "port": 3307, "user": "cdc", "password": "pw", "charset": "utf8mb4",
                                 "connect_timeout": 4}
    assert params.binlog_settings(30.0)["read_timeout"] == 30.0 and params.where == "db:3307"
    with pytest.raises(TlsError, match="cannot be loaded"):  # a bad sslrootcert is a connect error, not a crash
        _ = params.tls
    plain = my.connect_params(parse_config({"source": {"kind": "mariadb", "port": 3306, "user": "u", "password": "p",
                                                       "database": "d", "tables": ["d.t"], "sslmode": "disable",
                                                       "mysql": {"server_id": 9}}}, env={}))
    assert plain.tls.context is None and plain.tls is plain.tls  # built once


def test_an_error_without_a_message_is_named_by_its_kind() -> None:
    assert reason(TimeoutError()) == "timed out"
    assert reason(ConnectionResetError()) == "ConnectionResetError"
    assert reason(OSError(111, "Connection refused")) == "[Errno 111] Connection refused"


async def test_a_server_that_never_answers_gives_a_connect_error_that_says_so() -> None:
    """A listener that accepts and stays silent (a hung server, a half-open proxy): the connect attempt ends
    after source.connect_timeout_s with an error that names the timeout, not "cannot connect: ;"."""
    silent = socket.create_server(("127.0.0.1", 0))
    try:
        port = silent.getsockname()[1]
        config = parse_config({"source": {"kind": "postgres", "host": "127.0.0.1", "port": port, "user": "cdc",
                                          "password": "pw", "database": "app", "tables": ["public.t"],
                                          "sslmode": "disable", "connect_timeout_s": 1}}, env={})
        with pytest.raises(SourceError, match=r"cannot connect: timed out; check that the server runs"):
            await pg.connect_sql(pg.connect_params(config))
    finally:
        silent.close()
