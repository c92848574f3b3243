"""A compressed MariaDB binlog (log_bin_compress = ON) stops cdcd with a clear error, never a silent gap."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from my_helpers import Driver

from cdcd.config import Config
from cdcd.errors import SourceFatal


@pytest.fixture
def compress(sql: Callable[..., Any]) -> Iterator[Callable[[bool], None]]:
    """Switch the shared server's binlog compression; always switched back off."""
    def switch(on: bool) -> None:
        sql(f"SET GLOBAL log_bin_compress = {'ON' if on else 'OFF'}")

    try:
        yield switch
    finally:
        switch(False)


async def test_connect_refuses_a_compressing_server(make_config: Callable[..., Config], sql: Callable[..., Any],
                                                    compress: Callable[[bool], None]) -> None:
    sql("CREATE TABLE t (id INT PRIMARY KEY, v TEXT)")
    compress(True)
    d = Driver(make_config(["t"]))
    with pytest.raises(SourceFatal, match="log_bin_compress"):
        await d.__aenter__()
    await d.source.close()


async def test_compressed_rows_in_the_stream_are_fatal(make_config: Callable[..., Config], sql: Callable[..., Any],
                                                       compress: Callable[[bool], None]) -> None:
    sql("CREATE TABLE t (id INT PRIMARY KEY, v TEXT)")
    async with Driver(make_config(["t"])) as d:
        await d.until_mark("snapshot_done")
        sql("INSERT INTO t VALUES (1, 'plain')")
        assert [e.after for e in await d.events(1)] == [{"id": 1, "v": "plain"}]
        compress(True)  # switched on while cdcd streams: the next rows arrive compressed
        sql(f"INSERT INTO t VALUES (2, '{'x' * 2000}')")  # above log_bin_compress_min_len
        with pytest.raises(SourceFatal, match="COMPRESSED_EVENT") as err:
            await d.events(1)
    assert "log_bin_compress" in str(err.value) and "re-snapshot" in str(err.value)
