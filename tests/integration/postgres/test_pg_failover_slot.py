"""source.postgres.failover_slot (issue 29, section 3): on PostgreSQL 18 the slot cdcd creates is a failover slot
(and not one without the key); PostgreSQL 15 refuses the key at connect and in `cdcd check`. The standby's side and
a promotion: tests/e2e/test_pg_failover.py."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from pg_helpers import Driver, pg_config

from cdcd.errors import ConfigError
from cdcd.sources.postgres import PostgresSource
from devtools.servers import PostgresServer


@pytest.fixture
def pg18_db(pg18_server: PostgresServer) -> Iterator[str]:
    name = pg18_server.create_database("failover")
    pg18_server.psql("CREATE TABLE t (id int PRIMARY KEY)", name)
    try:
        yield name
    finally:
        pg18_server.drop_slots(name)
        pg18_server.psql(f"DROP DATABASE {name}")


def _postgres(db: str, failover: bool | None) -> dict[str, object]:
    options: dict[str, object] = {"slot": f"s_{db}", "publication": f"p_{db}"}
    if failover is not None:
        options["failover_slot"] = failover
    return {"postgres": options}


async def test_failover_slot_on_18_and_without_the_key(pg18_server: PostgresServer, pg18_db: str) -> None:
    for failover, slot in ((True, "s_failover"), (None, "s_plain")):
        cfg = pg_config(pg18_server, pg18_db, ["public.t"], source={"postgres": {
            "slot": slot, "publication": "p_failover", **({"failover_slot": failover} if failover else {})}},
            snapshot={"mode": "never"})
        checks = {r.name: r for r in await PostgresSource(cfg).preflight()}
        assert checks["failover_slot"].ok and "not created yet" in checks["failover_slot"].detail
        assert checks["failover_slot"].detail.endswith("with failover" if failover else "without failover")
        # no standby is named: fine without failover, a failure (with the fix) when the slot should survive one
        sync = checks["synchronized_standby_slots"]
        assert sync.ok is (not failover) and "is empty" in sync.detail, sync
        async with Driver(cfg):
            pass
        flag = pg18_server.psql(f"SELECT failover FROM pg_replication_slots WHERE slot_name = '{slot}'", pg18_db)
        assert flag == ("t" if failover else "f")
        checks = {r.name: r for r in await PostgresSource(cfg).preflight()}
        assert checks["failover_slot"].ok and f"failover = {'true' if failover else 'false'}" in \
            checks["failover_slot"].detail
    # a slot made without failover while the key asks for it: check names the fix
    cfg = pg_config(pg18_server, pg18_db, ["public.t"], source={"postgres": {
        "slot": "s_plain", "publication": "p_failover", "failover_slot": True}})
    bad = {r.name: r for r in await PostgresSource(cfg).preflight()}["failover_slot"]
    assert not bad.ok and 'ALTER_REPLICATION_SLOT "s_plain" (FAILOVER true)' in bad.fix


async def test_failover_slot_is_refused_before_17(pg_server: PostgresServer, pg_db: str) -> None:
    pg_server.psql("CREATE TABLE t (id int PRIMARY KEY)", pg_db)
    cfg = pg_config(pg_server, pg_db, ["public.t"], source=_postgres(pg_db, True))
    checks = {r.name: r for r in await PostgresSource(cfg).preflight()}
    assert not checks["failover_slot"].ok and "PostgreSQL 17+" in checks["failover_slot"].fix
    with pytest.raises(ConfigError, match=r"failover_slot = true: .* runs PostgreSQL 15, failover slots need 17"):
        async with Driver(cfg):
            pass
    assert pg_server.psql(f"SELECT count(*) FROM pg_replication_slots WHERE slot_name = 's_{pg_db}'") == "0"
    # without the key nothing about failover is reported on 15
    cfg = pg_config(pg_server, pg_db, ["public.t"], source=_postgres(pg_db, None))
    assert not [r for r in await PostgresSource(cfg).preflight() if "failover" in r.name or "synchron" in r.name]
