"""Every query verify and repair send to a MariaDB/MySQL source is bounded by runtime.source_read_timeout_s: the
status reads (the binlog position, the binlogged GTID set), the checksums and the rows. A silent server or a
query slower than the limit ends verify with a SourceError naming the statement (exit 2); it never waits forever."""

from __future__ import annotations

import asyncio

import pytest
from faultproxy import FaultProxy
from my_helpers import execute, my_config

from cdcd.errors import SourceError
from cdcd.events import TableId
from cdcd.sources.mysql.connection import connect_params
from cdcd.verify.sides import _binlog_position, _binlogged_gtids, source_side
from cdcd.verify.source import BoundedCursor
from devtools.servers import MariaDBServer

READ_TIMEOUT_S = 1.5
FAILSAFE_S = 60  # far past the bound: the test fails instead of hanging if the bound is gone


async def test_a_silent_server_ends_verifys_status_reads(maria_server: MariaDBServer, maria_db: str) -> None:
    with FaultProxy(maria_server.port) as proxy:
        config = my_config(maria_server, maria_db, ["t"], source={"port": proxy.port})
        conn = await connect_params(config).open()
        try:
            async with conn.cursor() as raw:
                cur = BoundedCursor(raw, READ_TIMEOUT_S)
                assert await _binlog_position(cur, "SHOW MASTER STATUS") is not None
                assert await _binlogged_gtids(cur, "mariadb") is not None  # the fixtures wrote
                proxy.blackhole()
                async with asyncio.timeout(FAILSAFE_S):
                    with pytest.raises(SourceError, match=r"SHOW MASTER STATUS.*did not finish within"):
                        await _binlog_position(cur, "SHOW MASTER STATUS")
        finally:
            conn.close()


async def test_a_silent_server_ends_verifys_checksums(maria_server: MariaDBServer, maria_db: str) -> None:
    execute(maria_server, maria_db, "CREATE TABLE t (id int PRIMARY KEY, v varchar(20))",
            "INSERT INTO t VALUES (1, 'a'), (2, 'b'), (3, 'c')")
    with FaultProxy(maria_server.port) as proxy:
        config = my_config(maria_server, maria_db, ["t"], source={"port": proxy.port},
                           runtime={"source_read_timeout_s": READ_TIMEOUT_S})
        async with asyncio.timeout(FAILSAFE_S):
            with pytest.raises(SourceError, match=r"did not finish within runtime.source_read_timeout_s \(1.5 s\)"):
                async with source_side(config) as side:
                    shape = await side.shape(TableId(maria_db, "t"))
                    assert await side.count(shape) == 3
                    proxy.blackhole()
                    await side.digests(shape, 4)


async def test_a_query_slower_than_the_limit_is_named(maria_server: MariaDBServer, maria_db: str) -> None:
    # a view that takes a second per row: its rows take longer than the limit on a server that answers
    execute(maria_server, maria_db, "CREATE TABLE t (id int PRIMARY KEY)", "INSERT INTO t VALUES (1), (2), (3)",
            "CREATE VIEW slow AS SELECT id, SLEEP(1) AS s FROM t")
    config = my_config(maria_server, maria_db, ["t"], runtime={"source_read_timeout_s": READ_TIMEOUT_S})
    async with asyncio.timeout(FAILSAFE_S):
        with pytest.raises(SourceError, match=r"'SELECT `id`, `s` FROM .*slow`' did not finish within"):
            async with source_side(config) as side:
                await side.all_rows(await side.shape(TableId(maria_db, "slow")))
