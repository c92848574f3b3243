"""MariaDB 10.11, real server: XA transactions on captured tables and positions that depend on the binlog alone.

MariaDB binlogs a two-phase XA transaction as two event groups: the XA PREPARE group holds the rows
(its GTID event flagged "prepared XA", ending with an XA_PREPARE_LOG_EVENT), and XA COMMIT / XA
ROLLBACK is a later group of its own with no rows. cdcd does not stage prepared transactions, so it
refuses them on captured tables rather than land rows that may be rolled back.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from my_helpers import Driver

from cdcd.config import Config
from cdcd.errors import SourceFatal
from cdcd.events import ChangeEvent

NEVER = {"mode": "never"}


async def test_xa_on_a_captured_table_is_refused_and_its_rows_never_emitted(
        make_config: Callable[..., Config], sql: Callable[..., Any]) -> None:
    sql("CREATE TABLE t (id INT PRIMARY KEY, v INT)", "CREATE TABLE other (id INT PRIMARY KEY)")
    async with Driver(make_config(["t"], snapshot=NEVER)) as d:
        # XA on a table cdcd does not capture passes, and so does one-phase XA (an ordinary transaction)
        sql("XA START 'o'", "INSERT INTO other VALUES (1)", "XA END 'o'", "XA PREPARE 'o'")
        sql("XA ROLLBACK 'o'")
        sql("XA START 'p'", "INSERT INTO t VALUES (1, 1)", "XA END 'p'", "XA COMMIT 'p' ONE PHASE")
        first = await d.events(1)
        assert [e.after for e in first] == [{"id": 1, "v": 1}]
        sql("XA START 'r'", "INSERT INTO t VALUES (2, 2)", "XA END 'r'", "XA PREPARE 'r'")
        sql("XA ROLLBACK 'r'")  # row 2 never existed
        sql("INSERT INTO t VALUES (3, 3)")
        got: list[ChangeEvent] = []
        with pytest.raises(SourceFatal, match="two-phase XA transaction") as err:
            got += await d.events(2, timeout=30)
    assert all(e.after != {"id": 2, "v": 2} for e in got), "the rows of a rolled-back XA transaction landed"
    assert "XA PREPARE" in str(err.value) and "mysql-bin." in str(err.value)


async def test_positions_do_not_depend_on_the_captured_tables(maria_server: Any, maria_db: str,
                                                               make_config: Callable[..., Config],
                                                               sql: Callable[..., Any]) -> None:
    sql("CREATE TABLE a (id INT PRIMARY KEY)", "CREATE TABLE b (id INT PRIMARY KEY)")
    only_b = Driver(make_config(["b"], snapshot=NEVER))
    both = Driver(make_config(["a", "b"], snapshot=NEVER))
    async with only_b, both:
        sql("BEGIN", "INSERT INTO a VALUES (1)", "INSERT INTO b VALUES (1)", "INSERT INTO a VALUES (2), (3), (4)",
            "INSERT INTO b VALUES (2), (3)", "COMMIT")
        narrow = await only_b.events(3)
        wide = [e for e in await both.events(7) if e.table.name == "b"]
    assert [e.after for e in narrow] == [e.after for e in wide] == [{"id": 1}, {"id": 2}, {"id": 3}]
    # the same row change has the same position whatever else is captured: a restart with another
    # source.tables inside this transaction skips exactly what was delivered
    assert [e.position for e in narrow] == [e.position for e in wide]
