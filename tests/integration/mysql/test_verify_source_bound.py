"""Verify's status reads on a MariaDB/MySQL source (the binlog position, the binlogged GTID set) are bounded by
runtime.source_read_timeout_s: a silent server ends verify with a SourceError naming the statement (exit 2), it
never waits forever."""

from __future__ import annotations

import asyncio

import pytest
from faultproxy import FaultProxy
from my_helpers import my_config

from cdcd.errors import SourceError
from cdcd.sources.mysql.connection import connect_params
from cdcd.verify.sides import _binlog_position, _binlogged_gtids
from devtools.servers import MariaDBServer

READ_TIMEOUT_S = 1.5
FAILSAFE_S = 60  # far past the bound: the test fails instead of hanging if the bound is gone


async def test_a_silent_server_ends_verifys_status_reads(maria_server: MariaDBServer, maria_db: str) -> None:
    with FaultProxy(maria_server.port) as proxy:
        config = my_config(maria_server, maria_db, ["t"], source={"port": proxy.port})
        conn = await connect_params(config).open()
        try:
            async with conn.cursor() as cur:
                assert await _binlog_position(cur, "SHOW MASTER STATUS", READ_TIMEOUT_S) is not None
                assert await _binlogged_gtids(cur, "mariadb", READ_TIMEOUT_S) is not None  # the fixtures wrote
                proxy.blackhole()
                async with asyncio.timeout(FAILSAFE_S):
                    with pytest.raises(SourceError, match=r"SHOW MASTER STATUS.*no answer within"):
                        await _binlog_position(cur, "SHOW MASTER STATUS", READ_TIMEOUT_S)
        finally:
            conn.close()
