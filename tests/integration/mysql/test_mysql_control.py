"""The MySQL/MariaDB control connection (``MySqlServer.controlled``): one caller at a time, and every wait on it
bounded by runtime.source_read_timeout_s, the wait for the connection included. A silent server ends in a
classified SourceUnavailable (the runtime reconnects), never in a daemon that waits forever; a connection cut
short is dropped, and the next caller gets a new one."""

from __future__ import annotations

import asyncio

import pytest
from faultproxy import FaultProxy
from my_helpers import my_config

from cdcd.errors import SourceUnavailable
from cdcd.sources.mysql.connection import connect_params
from cdcd.sources.mysql.server import MySqlServer
from devtools.servers import MariaDBServer

READ_TIMEOUT_S = 1.5
FAILSAFE_S = 60  # far past the bound: the test fails instead of hanging if the bound is gone


def server_via(proxy: FaultProxy, maria_server: MariaDBServer, maria_db: str) -> MySqlServer:
    config = my_config(maria_server, maria_db, ["t"], source={"port": proxy.port},
                       runtime={"source_read_timeout_s": READ_TIMEOUT_S})
    return MySqlServer(config, connect_params(config))


async def test_a_silent_server_ends_the_binlog_position_query_and_the_next_caller_reconnects(
        maria_server: MariaDBServer, maria_db: str) -> None:
    with FaultProxy(maria_server.port) as proxy:
        server = server_via(proxy, maria_server, maria_db)
        try:
            assert (await server.query("SELECT 1")) == [(1,)]
            proxy.blackhole()
            async with asyncio.timeout(FAILSAFE_S):
                with pytest.raises(SourceUnavailable, match=r"binlog position query on mariadb .*read timeout"):
                    await server.current_position()
            # the silent connection was dropped: the next caller opens a new one (new connections still pass)
            assert (await server.query("SELECT 2")) == [(2,)]
            assert (await server.current_position()).file
            # and a stop while the server is silent ends too (its goodbye is bounded by source.connect_timeout_s)
            proxy.blackhole()
            async with asyncio.timeout(FAILSAFE_S):
                await server.close()
        finally:
            await server.close()


async def test_a_caller_waiting_behind_a_holder_that_never_ends_gets_a_timeout(
        maria_server: MariaDBServer, maria_db: str) -> None:
    with FaultProxy(maria_server.port) as proxy:
        server = server_via(proxy, maria_server, maria_db)
        holding, release = asyncio.Event(), asyncio.Event()

        async def holder() -> None:
            async with server.controlled(timeout=FAILSAFE_S):
                holding.set()
                await release.wait()

        task = asyncio.create_task(holder())
        try:
            await holding.wait()
            async with asyncio.timeout(FAILSAFE_S):
                with pytest.raises(SourceUnavailable, match=r"query on mariadb .*read timeout"):
                    await server.query("SELECT 1")
            release.set()
            await task
            assert (await server.query("SELECT 3")) == [(3,)]  # the holder's connection served it: still usable
        finally:
            release.set()
            await task
            await server.close()
