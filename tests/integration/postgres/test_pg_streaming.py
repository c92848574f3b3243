"""Streaming against a real PostgreSQL: order, images, TOAST, flush discipline, resume, reconnect."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from decimal import Decimal
from typing import Any

import asyncpg
import pytest
from pg_helpers import Driver, apply, changes, confirmed_flush, marks, wait_for

from cdcd.config import Config
from cdcd.errors import SourceFatal
from cdcd.events import ChangeEvent, MarkKind, Op
from cdcd.positions import PgPosition, parse_lsn
from devtools.servers import PostgresServer

pytestmark = pytest.mark.pg18  # also on PostgreSQL 18 (docs/testing.md)

NEVER = {"mode": "never"}


async def test_changes_come_in_commit_order_with_images(make_config: Callable[..., Config],
                                                        sql: Callable[[str], str]) -> None:
    sql("CREATE TABLE t (id int PRIMARY KEY, v text)")
    async with Driver(make_config(["public.t"], snapshot=NEVER)) as d:
        sql("BEGIN; INSERT INTO t VALUES (1, 'a'), (2, 'b'); INSERT INTO t VALUES (3, NULL); COMMIT")
        sql("BEGIN; UPDATE t SET v = 'a2' WHERE id = 1; UPDATE t SET id = 20 WHERE id = 2; DELETE FROM t WHERE id = 3;"
            " COMMIT")
        sql("TRUNCATE t")
        sql("INSERT INTO t VALUES (5, '')")
        evs = await d.events(8)
    assert [(e.op, e.key) for e in evs] == [
        (Op.CREATE, (1,)), (Op.CREATE, (2,)), (Op.CREATE, (3,)),
        (Op.UPDATE, (1,)), (Op.UPDATE, (20,)), (Op.DELETE, (3,)),
        (Op.TRUNCATE, None), (Op.CREATE, (5,)),
    ]
    assert evs[2].after == {"id": 3, "v": None}
    assert evs[3].before is None and evs[3].after == {"id": 1, "v": "a2"}
    assert evs[4].before == {"id": 2} and evs[4].before_key == (2,) and evs[4].after == {"id": 20, "v": "b"}
    assert evs[5].before == {"id": 3} and evs[5].after is None
    assert evs[7].after == {"id": 5, "v": ""}
    positions = [e.position for e in evs]
    assert positions == sorted(positions) and len(set(positions)) == len(positions)
    # Events of one transaction share the commit LSN and count up from 1.
    assert [p.seq for p in positions[:3]] == [1, 2, 3] and len({p.lsn for p in positions[:3]}) == 1
    assert len({e.tx_id for e in evs[:3]}) == 1 and evs[0].tx_id != evs[3].tx_id
    assert all(e.commit_ts is not None and e.commit_ts.tzinfo is not None for e in evs)


async def test_interleaved_transactions_arrive_in_commit_order(
        pg_server: PostgresServer, pg_db: str, make_config: Callable[..., Config], sql: Callable[[str], str]) -> None:
    sql("CREATE TABLE t (id int PRIMARY KEY, who text)")
    a = await asyncpg.connect(pg_server.dsn(pg_db))
    b = await asyncpg.connect(pg_server.dsn(pg_db))
    try:
        async with Driver(make_config(["public.t"], snapshot=NEVER)) as d:
            ta, tb = a.transaction(), b.transaction()
            await ta.start()
            await tb.start()
            await a.execute("INSERT INTO t VALUES (1, 'a')")
            await b.execute("INSERT INTO t VALUES (2, 'b')")
            await a.execute("INSERT INTO t VALUES (3, 'a')")
            await b.execute("INSERT INTO t VALUES (4, 'b')")
            await tb.commit()
            await a.execute("INSERT INTO t VALUES (5, 'a')")
            await ta.commit()
            items = await d.take(lambda got: len(marks(got, "commit")) >= 2)
    finally:
        await a.close()
        await b.close()
    evs = changes(items)
    assert [e.after["id"] for e in evs if e.after] == [2, 4, 1, 3, 5]
    commits = marks(items, "commit")
    assert commits[0].position < evs[2].position  # b's commit mark precedes a's events
    assert [i.position for i in items] == sorted(i.position for i in items)


async def test_unchanged_toast_is_unavailable_not_null(make_config: Callable[..., Config],
                                                       sql: Callable[[str], str]) -> None:
    sql("CREATE TABLE t (id int PRIMARY KEY, n int, big text); ALTER TABLE t ALTER big SET STORAGE EXTERNAL;"
        "CREATE TABLE f (id int PRIMARY KEY, n int, big text); ALTER TABLE f ALTER big SET STORAGE EXTERNAL;"
        "ALTER TABLE f REPLICA IDENTITY FULL")
    big = "".join(chr(0x41 + (i * 7919) % 26) for i in range(20000))
    async with Driver(make_config(["public.t", "public.f"], snapshot=NEVER)) as d:
        sql(f"INSERT INTO t VALUES (1, 0, '{big}'); INSERT INTO f VALUES (1, 0, '{big}')")
        sql("UPDATE t SET n = 1 WHERE id = 1; UPDATE f SET n = 1 WHERE id = 1")
        sql("DELETE FROM f WHERE id = 1")
        evs = await d.events(5)
    ins, upd_t, upd_f, del_f = evs[0], evs[2], evs[3], evs[4]
    assert ins.after is not None and ins.after["big"] == big
    assert upd_t.op is Op.UPDATE and upd_t.unavailable == ("big",)
    assert upd_t.after is not None and upd_t.after["n"] == 1
    mirror: dict[tuple[Any, ...], dict[str, Any]] = {}
    apply(mirror, [ins, upd_t])
    assert mirror[(1,)] == {"id": 1, "n": 1, "big": big}  # the consumer keeps the old value
    # REPLICA IDENTITY FULL: the old row is sent, so the value is known after all.
    assert upd_f.before is not None and upd_f.before["n"] == 0
    assert upd_f.after is not None and upd_f.unavailable == () and upd_f.after["big"] == big
    assert del_f.before == {"id": 1, "n": 1, "big": big}


async def test_flush_never_passes_the_checkpoint(pg_server: PostgresServer, make_config: Callable[..., Config],
                                                 sql: Callable[[str], str]) -> None:
    sql("CREATE TABLE t (id int PRIMARY KEY)")
    cfg = make_config(["public.t"], snapshot=NEVER)
    slot = cfg.source.postgres.slot
    async with Driver(cfg) as d:
        start = confirmed_flush(pg_server, slot)
        sql("INSERT INTO t SELECT generate_series(1, 50)")
        await d.events(10)
        await d.commit()  # 10 of 50 events: the transaction is not fully committed
        await asyncio.sleep(0)  # let the status update go out
        sql("SELECT 1")  # any round trip; the slot must not have moved past the partial transaction
        assert confirmed_flush(pg_server, slot) == start
        items = await d.take(lambda got: bool(marks(got, "commit")))
        await d.commit()
        assert d.position is not None
        commit_lsn = d.position.lsn  # type: ignore[union-attr]
        assert parse_lsn(d.state["flush_lsn"]) == commit_lsn
        await wait_for(lambda: confirmed_flush(pg_server, slot) == commit_lsn, what="slot flush advance")
        assert confirmed_flush(pg_server, slot) <= d.position.lsn  # type: ignore[union-attr]
        assert len(changes(items)) == 40


async def test_restart_mid_transaction_skips_the_acked_part(make_config: Callable[..., Config],
                                                            sql: Callable[[str], str]) -> None:
    sql("CREATE TABLE t (id int PRIMARY KEY)")
    cfg = make_config(["public.t"], snapshot=NEVER)
    async with Driver(cfg) as d:
        sql("INSERT INTO t VALUES (0)")
        await d.take(lambda got: bool(marks(got, "commit")))
        await d.commit()
        sql("INSERT INTO t SELECT generate_series(1, 30)")
        await d.events(12)
        await d.commit()
        position, state = d.position, d.state
    assert position is not None
    async with Driver(cfg, position, state) as d2:
        # The previous transaction's commit Mark may come again (Marks are not dropped): wait for this one's.
        items = await d2.take(lambda got: any(m.position > position for m in marks(got, "commit")))
    evs = changes(items)
    assert [e.after["id"] for e in evs if e.after] == list(range(13, 31))
    assert isinstance(position, PgPosition) and all(e.position > position for e in evs)


async def test_clean_restart_delivers_nothing(make_config: Callable[..., Config], sql: Callable[[str], str]) -> None:
    sql("CREATE TABLE t (id int PRIMARY KEY)")
    cfg = make_config(["public.t"], snapshot=NEVER, source={"postgres": {"slot": "clean_s", "publication": "clean_p",
                                                                         "heartbeat_s": 0.2}})
    async with Driver(cfg) as d:
        sql("INSERT INTO t SELECT generate_series(1, 5)")
        await d.take(lambda got: bool(marks(got, "commit")))
        await d.commit()
        position, state = d.position, d.state
    async with Driver(cfg, position, state) as d2:
        items = await d2.take(lambda got: len(marks(got, "heartbeat")) >= 2)
    assert changes(items) == []


async def test_heartbeats_advance_the_slot_on_an_idle_database(
        pg_server: PostgresServer, make_config: Callable[..., Config], sql: Callable[[str], str]) -> None:
    sql("CREATE TABLE t (id int PRIMARY KEY)")
    cfg = make_config(["public.t"], snapshot=NEVER, source={"postgres": {"slot": "hb_s", "publication": "hb_p",
                                                                         "heartbeat_s": 0.2}})
    async with Driver(cfg) as d:
        before = confirmed_flush(pg_server, "hb_s")
        pg_server.psql("CREATE TABLE IF NOT EXISTS other_db_noise (x int); INSERT INTO other_db_noise VALUES (1)")
        items = await d.take(lambda got: bool(marks(got, "heartbeat")))
        await d.commit()
        hb = marks(items, "heartbeat")[-1].position.lsn  # type: ignore[union-attr]
        assert hb > before and d.state["flush_lsn"] == marks(items, "heartbeat")[-1].position.__str__().split("#")[0]
        await wait_for(lambda: confirmed_flush(pg_server, "hb_s") == hb, what="heartbeat flush")
        status = d.source.status()
    assert status["connected"] is True and status["phase"] == "streaming"


async def test_connection_loss_reconnects_without_duplicates(
        pg_server: PostgresServer, make_config: Callable[..., Config], sql: Callable[[str], str]) -> None:
    sql("CREATE TABLE t (id int PRIMARY KEY)")
    cfg = make_config(["public.t"], snapshot=NEVER, runtime={"reconnect_max_s": 0.5},
                      source={"postgres": {"slot": "rc_s", "publication": "rc_p"}})
    async with Driver(cfg) as d:
        sql("INSERT INTO t SELECT generate_series(1, 10)")
        first = await d.events(10)
        await d.commit(5)  # half acked: after the reconnect the server resends, the source must not
        pg_server.psql("SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots WHERE slot_name = 'rc_s'")
        sql("INSERT INTO t SELECT generate_series(11, 15)")
        rest = await d.events(5)
    ids = [e.after["id"] for e in first + rest if e.after]
    assert ids == list(range(1, 16))


async def test_a_dropped_slot_is_fatal_not_a_silent_new_slot(
        pg_server: PostgresServer, make_config: Callable[..., Config], sql: Callable[[str], str]) -> None:
    sql("CREATE TABLE t (id int PRIMARY KEY); INSERT INTO t VALUES (1)")
    cfg = make_config(["public.t"], source={"postgres": {"slot": "gone_s", "publication": "gone_p"}})
    async with Driver(cfg) as d:
        await d.take(lambda got: bool(marks(got, "snapshot_done")))
        await d.commit()
        position, state = d.position, d.state
    pg_server.psql("SELECT pg_drop_replication_slot('gone_s')")
    with pytest.raises(SourceFatal, match=r"'gone_s' named by the checkpoint does not exist.*re-snapshot"):
        async with Driver(cfg, position, state):
            pass
    assert pg_server.psql("SELECT count(*) FROM pg_replication_slots WHERE slot_name = 'gone_s'") == "0"
    # snapshot.mode = when_needed: a new slot and a full snapshot, said loudly in the log.
    cfg2 = make_config(["public.t"], snapshot={"mode": "when_needed"},
                       source={"postgres": {"slot": "gone_s", "publication": "gone_p"}})
    async with Driver(cfg2, position, state) as d2:
        items = await d2.take(lambda got: bool(marks(got, "snapshot_done")))
    assert marks(items, MarkKind.SNAPSHOT_START) and [e.after for e in changes(items)] == [{"id": 1}]


@pytest.mark.parametrize("user", ["cdc_pw", "cdc_md5"])
async def test_password_authentication(user: str, make_config: Callable[..., Config], sql: Callable[[str], str],
                                       pg_db: str) -> None:
    sql("CREATE TABLE t (id int PRIMARY KEY)")
    cfg = make_config(["public.t"], snapshot=NEVER,
                      source={"user": user, "password": "secret",
                              "postgres": {"slot": f"auth_{user}", "publication": f"auth_{user}"}})
    async with Driver(cfg) as d:
        sql("INSERT INTO t VALUES (1)")
        evs = await d.events(1)
    assert evs[0].after == {"id": 1}
    bad = make_config(["public.t"], snapshot=NEVER, source={"user": user, "password": "wrong"})
    with pytest.raises(SourceFatal, match=r"authentication failed|password"):
        async with Driver(bad):
            pass


async def test_stream_events_are_change_events_of_the_right_table(
        make_config: Callable[..., Config], sql: Callable[[str], str]) -> None:
    sql("CREATE TABLE a (id int PRIMARY KEY); CREATE TABLE b (id int PRIMARY KEY); CREATE TABLE c (id int)")
    async with Driver(make_config(["public.a", "public.b"], snapshot=NEVER)) as d:
        sql("INSERT INTO c VALUES (0); INSERT INTO a VALUES (1); INSERT INTO b VALUES (2)")
        evs = await d.events(2)
    assert [(str(e.table), e.after) for e in evs] == [("public.a", {"id": 1}), ("public.b", {"id": 2})]
    assert all(isinstance(e, ChangeEvent) and not e.snapshot for e in evs)


async def test_schema_change_mid_stream_bumps_the_version(make_config: Callable[..., Config],
                                                          sql: Callable[[str], str]) -> None:
    sql("CREATE TABLE t (id int PRIMARY KEY, v text)")
    async with Driver(make_config(["public.t"], snapshot=NEVER)) as d:
        sql("INSERT INTO t VALUES (1, 'a')")
        sql("ALTER TABLE t ADD COLUMN n numeric(10,2) DEFAULT 1.5")
        sql("INSERT INTO t VALUES (2, 'b', 2.25)")
        sql("ALTER TABLE t DROP COLUMN v")
        sql("UPDATE t SET n = 3 WHERE id = 1")
        evs = await d.events(3)
    assert [e.schema.column_names for e in evs] == [("id", "v"), ("id", "v", "n"), ("id", "n")]
    assert [e.schema.version for e in evs] == [0, 1, 2]
    assert evs[1].after == {"id": 2, "v": "b", "n": Decimal("2.25")}
    assert evs[2].after == {"id": 1, "n": Decimal("3.00")} and evs[2].schema.key == ("id",)


async def test_slot_dropped_while_streaming_is_fatal(pg_server: PostgresServer, make_config: Callable[..., Config],
                                                     sql: Callable[[str], str]) -> None:
    sql("CREATE TABLE t (id int PRIMARY KEY)")
    cfg = make_config(["public.t"], snapshot=NEVER, runtime={"reconnect_max_s": 1},
                      source={"postgres": {"slot": "drop_s", "publication": "drop_p"}})
    async with Driver(cfg) as d:
        sql("INSERT INTO t VALUES (1)")
        await d.events(1)
        # An active slot cannot be dropped: end its walsender and drop it before cdcd reconnects.
        dropped = ""
        for _ in range(200):
            dropped = pg_server.psql(
                "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots WHERE slot_name = 'drop_s' "
                "AND active_pid IS NOT NULL; "
                "SELECT count(pg_drop_replication_slot(slot_name)) FROM pg_replication_slots "
                "WHERE slot_name = 'drop_s' AND NOT active")
            if dropped.endswith("1"):
                break
        assert dropped.endswith("1")
        with pytest.raises(SourceFatal, match="does not exist"):
            await d.events(1)


async def test_no_publication_is_created_for_a_table_without_replica_identity(
        pg_server: PostgresServer, pg_db: str, make_config: Callable[..., Config], sql: Callable[[str], str]) -> None:
    sql("CREATE TABLE k (v int); INSERT INTO k VALUES (1)")
    cfg = make_config(["public.k"], source={"postgres": {"slot": "blind_s", "publication": "blind_p"}})
    with pytest.raises(SourceFatal, match="REPLICA IDENTITY FULL"):
        async with Driver(cfg):
            pass
    assert sql("SELECT count(*) FROM pg_publication WHERE pubname = 'blind_p'") == "0"
    sql("UPDATE k SET v = 2")  # the application's updates still work
    sql("CREATE PUBLICATION blind_p FOR TABLE k WITH (publish = 'insert')")  # the operator's explicit choice
    async with Driver(cfg) as d:
        items = await d.take(lambda got: bool(marks(got, "snapshot_done")))
    assert [e.after for e in changes(items)] == [{"v": 2}]


async def test_partitioned_table_changes_arrive_under_its_own_name(make_config: Callable[..., Config],
                                                                    sql: Callable[[str], str]) -> None:
    sql("CREATE TABLE p (id int, region text, PRIMARY KEY (id, region)) PARTITION BY LIST (region);"
        "CREATE TABLE p_eu PARTITION OF p FOR VALUES IN ('eu'); CREATE TABLE p_us PARTITION OF p FOR VALUES IN ('us');"
        "INSERT INTO p VALUES (1, 'eu'), (2, 'us')")
    async with Driver(make_config(["public.p"])) as d:
        items = await d.take(lambda got: bool(marks(got, "snapshot_done")))
        sql("INSERT INTO p VALUES (3, 'eu'), (4, 'us'); DELETE FROM p WHERE id = 1")
        evs = await d.events(3)
    assert sorted(e.after["id"] for e in changes(items) if e.after) == [1, 2]
    assert [(str(e.table), e.op, e.key) for e in evs] == [
        ("public.p", Op.CREATE, (3, "eu")), ("public.p", Op.CREATE, (4, "us")), ("public.p", Op.DELETE, (1, "eu"))]
