"""A table without a primary key cannot be snapshotted while a real MariaDB source streams: a reload adding it is
refused, naming the table and the fix, and the table is not recorded as captured (a reconnect during a reload:
``postgres/test_pg_reload_faults.py``)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
from my_helpers import Driver
from test_mysql_incremental import catch_up, marks

from cdcd.config import Config
from cdcd.events import Item, MarkKind
from cdcd.sources.mysql import MySqlSource
from devtools.servers import MariaDBServer


async def test_a_keyless_table_is_refused_at_reload_and_not_recorded_as_captured(
        maria_server: MariaDBServer, maria_db: str, make_config: Callable[..., Config],
        sql: Callable[..., list[Any]]) -> None:
    sql("CREATE TABLE s (id int PRIMARY KEY)", "CREATE TABLE k (id int, v int)", "INSERT INTO k VALUES (1, 1)",
        "CREATE TABLE u (id int NOT NULL, UNIQUE KEY (id))")
    async with Driver(make_config(["s"], snapshot={"mode": "never"})) as d:
        src = d.source
        assert isinstance(src, MySqlSource)
        got: list[Item] = []
        await catch_up(d, maria_server, maria_db, got)
        applied = src.reload_tables([f"{maria_db}.s", f"{maria_db}.k", f"{maria_db}.u"])
        with pytest.raises(Exception, match=rf"{maria_db}\.k, {maria_db}\.u .*no primary key.*ADD PRIMARY KEY"):
            await asyncio.wait_for(applied, 30)
        assert f"{maria_db}.k" in src.status()["table_reload_error"]
        sql("INSERT INTO k VALUES (2, 2)")
        await catch_up(d, maria_server, maria_db, got)
        await d.commit()
        state = d.state
    assert not marks(got, MarkKind.INCREMENTAL_START)
    assert not [m for m in marks(got, MarkKind.TABLES) if f"{maria_db}.k" in m.detail["tables"]]
    assert f"{maria_db}.k" not in (state.get("tables") or [])
    assert not [i for i in got if getattr(i, "table", None) is not None and i.table.name == "k"]  # type: ignore[attr-defined]
