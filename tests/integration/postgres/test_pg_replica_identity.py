"""Replica identity rules against a real PostgreSQL: USING INDEX keys the events, a DEFERRABLE key is refused."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from pg_helpers import Driver

from cdcd.config import Config
from cdcd.errors import SourceFatal
from cdcd.events import ChangeEvent, Op
from cdcd.sources.postgres import PostgresSource
from devtools.servers import PostgresServer

NEVER = {"mode": "never"}


async def test_replica_identity_using_index_keys_events_on_the_index(make_config: Callable[..., Config],
                                                                     sql: Callable[[str], str]) -> None:
    sql("CREATE TABLE t (id int PRIMARY KEY, code text NOT NULL, v text);"
        "CREATE UNIQUE INDEX t_code ON t (code); ALTER TABLE t REPLICA IDENTITY USING INDEX t_code;"
        "INSERT INTO t VALUES (7, 'snap', 's')")
    async with Driver(make_config(["public.t"])) as d:
        snap = [e for e in await d.until_mark("snapshot_done") if isinstance(e, ChangeEvent) and e.op is Op.READ]
        sql("INSERT INTO t VALUES (1, 'a', 'x')")
        sql("UPDATE t SET code = 'b' WHERE id = 1")  # the identity changes: the old key comes with it
        sql("UPDATE t SET id = 2 WHERE id = 1")  # the primary key changes, the identity does not
        sql("DELETE FROM t WHERE id = 2")  # the delete carries the index's columns only
        evs = await d.events(4)
    assert snap and snap[0].schema.key == ("code",) and snap[0].key == ("snap",)
    assert all(e.schema.key == ("code",) for e in evs)
    assert [(e.op, e.key) for e in evs] == [(Op.CREATE, ("a",)), (Op.UPDATE, ("b",)), (Op.UPDATE, ("b",)),
                                            (Op.DELETE, ("b",))]
    assert evs[1].before_key == ("a",)
    assert evs[2].before_key is None  # same mirror row: keyed on code, which did not change
    assert evs[3].before == {"code": "b"}


async def test_deferrable_primary_key_is_refused_before_the_publication(
        pg_server: PostgresServer, pg_db: str, make_config: Callable[..., Config], sql: Callable[[str], str]) -> None:
    sql("CREATE TABLE d (id int PRIMARY KEY DEFERRABLE INITIALLY IMMEDIATE, v int); INSERT INTO d VALUES (1, 1)")
    cfg = make_config(["public.d"])
    results = {r.name: r for r in await PostgresSource(cfg).preflight()}
    check = results["replica_identity:public.d"]
    assert not check.ok and "DEFERRABLE" in check.detail and "REPLICA IDENTITY FULL" in check.fix
    with pytest.raises(SourceFatal, match="DEFERRABLE"):
        async with Driver(cfg):
            pass
    assert pg_server.psql(f"SELECT count(*) FROM pg_publication WHERE pubname = 'p_{pg_db}'", pg_db) == "0"
    # cdcd must never break the application's writes
    sql("UPDATE d SET v = 2 WHERE id = 1; DELETE FROM d WHERE id = 1; INSERT INTO d VALUES (1, 3)")
    # the named fix makes it capturable
    sql("ALTER TABLE d REPLICA IDENTITY FULL")
    assert (await PostgresSource(cfg).preflight())
    async with Driver(make_config(["public.d"], snapshot=NEVER)) as drv:
        sql("UPDATE d SET v = 4 WHERE id = 1")
        (ev,) = await drv.events(1)
    assert ev.op is Op.UPDATE and ev.key == (1,) and ev.after == {"id": 1, "v": 4}
    sql("UPDATE d SET v = 5 WHERE id = 1")  # and the application still writes with the publication in place


async def test_deferrable_key_is_refused_in_an_existing_publication_too(
        make_config: Callable[..., Config], sql: Callable[[str], str], pg_db: str) -> None:
    sql(f"CREATE TABLE d (id int PRIMARY KEY DEFERRABLE, v int); CREATE PUBLICATION p_{pg_db} FOR TABLE d")
    with pytest.raises(SourceFatal, match="DEFERRABLE"):
        async with Driver(make_config(["public.d"], snapshot=NEVER)):
            pass
