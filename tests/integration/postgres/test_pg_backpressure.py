"""A consumer that stops pulling must not make the server drop the replication connection."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from pg_helpers import Driver, pg_config

from devtools.servers import PostgresServer


@pytest.fixture(scope="module")
def short_timeout_server() -> Iterator[PostgresServer]:
    server = PostgresServer(settings={"wal_sender_timeout": "'2s'"}).start()
    try:
        yield server
    finally:
        server.stop()


async def test_status_updates_continue_while_the_consumer_pauses(short_timeout_server: PostgresServer) -> None:
    server = short_timeout_server
    server.create_database("bp")
    server.psql("CREATE TABLE t (id int PRIMARY KEY, pad text)", "bp")
    cfg = pg_config(server, "bp", ["public.t"], snapshot={"mode": "never"})
    async with Driver(cfg) as d:
        # Enough data to fill the socket buffers, so the server blocks on sending to us.
        server.psql("INSERT INTO t SELECT g, repeat('x', 200) FROM generate_series(1, 20000) g", "bp")
        await d.events(10)
        repl = d.source._stream.repl
        pid = server.psql("SELECT pid FROM pg_stat_replication", "bp")
        # backpressure: three times wal_sender_timeout without reading (2 s, not 1 s: a loaded test machine can
        # starve the event loop for a second, which is not what this test is about)
        await asyncio.sleep(6)
        assert server.psql("SELECT pid FROM pg_stat_replication", "bp") == pid
        evs = await d.events(20000 - 10)
        assert d.source._stream.repl is repl  # the same connection all along: no reconnect was needed
    assert evs[-1].after is not None and evs[-1].after["id"] == 20000
