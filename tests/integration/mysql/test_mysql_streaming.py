"""Binlog streaming through MySqlSource against the real MariaDB fixture."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
from my_helpers import Driver, events_of

from cdcd.config import Config
from cdcd.events import ChangeEvent, Mark, Op
from cdcd.positions import MySqlPosition


async def test_crud_key_change_transactions_rollback_truncate(make_config: Callable[..., Config],
                                                              sql: Callable[..., Any]) -> None:
    sql("CREATE TABLE t (id INT PRIMARY KEY, v VARCHAR(20))", "CREATE TABLE other (id INT PRIMARY KEY)")
    async with Driver(make_config(["t"])) as d:
        await d.until_mark("snapshot_done")
        sql("INSERT INTO t VALUES (1, 'a'), (2, 'b')")
        sql("INSERT INTO other VALUES (1)")  # not captured
        sql("UPDATE t SET v = 'a2' WHERE id = 1")
        sql("UPDATE t SET id = 10 WHERE id = 2")
        sql("DELETE FROM t WHERE id = 1")
        sql("BEGIN", "INSERT INTO t VALUES (3, 'c')", "UPDATE t SET v = 'c2' WHERE id = 3",
            "INSERT INTO t VALUES (4, 'd')", "COMMIT")
        sql("BEGIN", "INSERT INTO t VALUES (99, 'never')", "ROLLBACK")
        sql("TRUNCATE TABLE t")
        sql("INSERT INTO t VALUES (5, 'e')")
        evs = await d.events(10)
    assert [(e.op, e.before, e.after) for e in evs] == [
        (Op.CREATE, None, {"id": 1, "v": "a"}),
        (Op.CREATE, None, {"id": 2, "v": "b"}),
        (Op.UPDATE, {"id": 1, "v": "a"}, {"id": 1, "v": "a2"}),
        (Op.UPDATE, {"id": 2, "v": "b"}, {"id": 10, "v": "b"}),
        (Op.DELETE, {"id": 1, "v": "a2"}, None),
        (Op.CREATE, None, {"id": 3, "v": "c"}),
        (Op.UPDATE, {"id": 3, "v": "c"}, {"id": 3, "v": "c2"}),
        (Op.CREATE, None, {"id": 4, "v": "d"}),
        (Op.TRUNCATE, None, None),
        (Op.CREATE, None, {"id": 5, "v": "e"}),
    ]
    assert evs[3].before_key == (2,) and evs[3].key == (10,)
    assert evs[0].schema.key == ("id",) and evs[0].table.name == "t"
    positions = [e.position for e in evs]
    assert positions == sorted(positions) and len(set(positions)) == len(positions)
    # one transaction for the two-row insert and the three-statement one, with seq counting inside it
    assert evs[0].tx_id == evs[1].tx_id and evs[0].position.pos == evs[1].position.pos  # type: ignore[union-attr]
    tx = evs[5:8]
    assert len({e.tx_id for e in tx}) == 1 and len({e.position.pos for e in tx}) == 1  # type: ignore[union-attr]
    assert [e.position.seq for e in tx] == sorted(e.position.seq for e in tx)  # type: ignore[union-attr]
    assert tx[0].position.seq >= 1  # type: ignore[union-attr]
    assert all(e.tx_id and "-" in e.tx_id for e in evs)  # MariaDB GTIDs domain-server-seq
    assert all(e.commit_ts is not None and e.commit_ts.tzinfo is not None for e in evs)


async def test_commit_marks_carry_the_gtid_set_including_their_transaction(
        make_config: Callable[..., Config], sql: Callable[..., Any]) -> None:
    sql("CREATE TABLE t (id INT PRIMARY KEY)")
    async with Driver(make_config(["t"])) as d:
        await d.until_mark("snapshot_done")
        sql("INSERT INTO t VALUES (1)")
        got = await d.until_mark("commit")
    ev = events_of(got)[0]
    commit = got[-1]
    assert isinstance(commit, Mark) and commit.detail["events"] == 1
    assert isinstance(ev.position, MySqlPosition) and isinstance(commit.position, MySqlPosition)
    domain, server, seq = ev.tx_id.split("-")  # type: ignore[union-attr]
    assert f"{domain}-{server}-{seq}" in commit.position.gtid.split(",")
    assert f"{domain}-{server}-{seq}" not in ev.position.gtid.split(",")
    assert commit.position > ev.position


async def test_alter_mid_stream_and_replay_with_the_old_schema(make_config: Callable[..., Config],
                                                               sql: Callable[..., Any]) -> None:
    sql("CREATE TABLE t (id INT PRIMARY KEY, a VARCHAR(10), b INT)")
    config = make_config(["t"])
    async with Driver(config) as d:
        await d.until_mark("snapshot_done")
        await d.commit()
        position, state = d.position, d.state  # before the first insert
        sql("INSERT INTO t VALUES (1, 'x', 10)")
        sql("ALTER TABLE t ADD COLUMN c DECIMAL(10,2) AFTER a")
        sql("INSERT INTO t VALUES (2, 'y', 1.50, 20)")
        sql("ALTER TABLE t DROP COLUMN b")
        sql("INSERT INTO t VALUES (3, 'z', 2.25)")
        first = await d.events(3)
        await d.commit()
        later_state = d.state
    from decimal import Decimal
    assert [e.after for e in first] == [
        {"id": 1, "a": "x", "b": 10},
        {"id": 2, "a": "y", "c": Decimal("1.50"), "b": 20},
        {"id": 3, "a": "z", "c": Decimal("2.25")},
    ]
    versions = [e.schema.version for e in first]
    assert versions[0] < versions[1] < versions[2]
    assert [c.name for c in first[1].schema.columns] == ["id", "a", "c", "b"]
    assert len(later_state["schemas"][f"{config.source.tables[0]}"]) >= 3

    # restart from before the ALTERs: the old events decode with the schemas they were written with
    async with Driver(config, position, state) as d2:
        replay = await d2.events(3)
    assert [e.after for e in replay] == [e.after for e in first]
    assert [e.schema.column_names for e in replay] == [e.schema.column_names for e in first]
    assert [e.position for e in replay] == [e.position for e in first]

    # and a restart with the later state keeps the same version numbers
    async with Driver(config, position, later_state) as d3:
        replay2 = await d3.events(3)
    assert [e.schema.version for e in replay2] == versions


async def test_purged_binlog_is_fatal(make_config: Callable[..., Config], sql: Callable[..., Any]) -> None:
    from cdcd.errors import SourceFatal

    sql("CREATE TABLE t (id INT PRIMARY KEY)")
    config = make_config(["t"])
    async with Driver(config) as d:
        await d.until_mark("snapshot_done")
        sql("INSERT INTO t VALUES (1)")
        await d.events(1)
        await d.commit()
        position, state = d.position, d.state
    assert isinstance(position, MySqlPosition)
    sql("FLUSH BINARY LOGS", "INSERT INTO t VALUES (2)", "FLUSH BINARY LOGS")
    purge_until_gone(sql, position.file)
    d2 = Driver(config, position, state)
    with pytest.raises(SourceFatal) as err:
        await d2.__aenter__()
    await d2.source.close()
    msg = str(err.value)
    assert position.file in msg and "purged" in msg and "snapshot" in msg.lower()


def purge_until_gone(sql: Callable[..., Any], file: str) -> None:
    """PURGE skips files whose transactions the engine has not checkpointed yet: retry until it is gone."""
    for _ in range(100):
        newest = sql("SHOW BINARY LOGS")[-1][0]
        sql(f"PURGE BINARY LOGS TO '{newest}'")
        if file not in [r[0] for r in sql("SHOW BINARY LOGS")]:
            return
        time.sleep(0.1)
    raise AssertionError(f"{file} could not be purged: {sql('SHOW BINARY LOGS')}")


async def test_items_are_change_events_and_marks_in_position_order(make_config: Callable[..., Config],
                                                                   sql: Callable[..., Any]) -> None:
    sql("CREATE TABLE t (id INT PRIMARY KEY, v INT)")
    async with Driver(make_config(["t"])) as d:
        await d.until_mark("snapshot_done")
        sql("INSERT INTO t VALUES (1, 1), (2, 2)", "UPDATE t SET v = v + 1")
        got = await d.take(lambda items: sum(isinstance(i, Mark) and i.kind == "commit" for i in items) >= 2)
    positions = [i.position for i in got]
    assert positions == sorted(positions)
    assert all(isinstance(i, ChangeEvent | Mark) for i in got)
