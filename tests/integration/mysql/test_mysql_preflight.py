"""`cdcd check` rules against real MariaDB servers."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from my_helpers import execute, my_config

from cdcd.config import Config
from cdcd.sources.mysql import MySqlSource
from devtools.servers import MariaDBServer


@pytest.fixture(scope="module")
def minimal_server() -> Iterator[MariaDBServer]:
    server = MariaDBServer(settings={"binlog_row_image": "MINIMAL"}).start()
    try:
        yield server
    finally:
        server.stop()


async def test_preflight_passes_on_the_fixture_server(make_config: Callable[..., Config],
                                                      sql: Callable[..., Any]) -> None:
    sql("CREATE TABLE t (id INT PRIMARY KEY)")
    source = MySqlSource(make_config(["t"]))
    try:
        results = await source.preflight()
    finally:
        await source.close()
    failed = [r for r in results if not r.ok]
    assert failed == [], failed
    names = {r.name for r in results}
    assert {"binlog_format", "binlog_row_image", "binlog_row_metadata", "server_id", "log_bin",
            "privilege REPLICATION SLAVE", "privilege SELECT"} <= names
    assert any("mariadb" in r.detail for r in results if r.name == "server")


async def test_preflight_names_binlog_row_image_minimal(minimal_server: MariaDBServer) -> None:
    minimal_server.create_database("p")
    execute(minimal_server, "p", "CREATE TABLE t (id INT PRIMARY KEY)", "CREATE TABLE nokey (v INT)")
    source = MySqlSource(my_config(minimal_server, "p", ["t", "nokey"]))
    try:
        results = await source.preflight()
    finally:
        await source.close()
    failed = {r.name: r for r in results if not r.ok}
    assert set(failed) == {"binlog_row_image", "table p.nokey"}
    assert "MINIMAL" in failed["binlog_row_image"].detail and "FULL" in failed["binlog_row_image"].fix
    assert "primary key" in failed["table p.nokey"].detail


async def test_preflight_rejects_the_servers_own_server_id(maria_server: MariaDBServer, maria_db: str,
                                                           sql: Callable[..., Any]) -> None:
    sql("CREATE TABLE t (id INT PRIMARY KEY)")
    own = int(sql("SELECT @@server_id")[0][0])
    source = MySqlSource(my_config(maria_server, maria_db, ["t"], source={"mysql": {"server_id": own}}))
    try:
        results = await source.preflight()
    finally:
        await source.close()
    bad = [r for r in results if not r.ok]
    assert [r.name for r in bad] == ["server_id"] and "own" in bad[0].detail
