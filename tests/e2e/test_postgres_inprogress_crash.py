"""A SIGKILL of the daemon while the server streams an in-progress transaction (pgoutput protocol 2)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from daemon_harness import rows
from test_postgres_crash import Setup as CrashSetup
from test_postgres_crash import _check_flush_within_checkpoint

from cdcd.sources.postgres.inprogress import SPOOL_DIR, SUFFIX
from devtools.servers import PostgresServer


class Setup(CrashSetup):
    """The crash test's daemon setup, plus a look at the in-progress spool."""

    def spooled(self) -> int:
        """Bytes in the daemon's in-progress spool files."""
        d = self.state / SPOOL_DIR
        return sum(p.stat().st_size for p in d.iterdir() if p.name.endswith(SUFFIX)) if d.is_dir() else 0

    def landed(self) -> list[dict[str, Any]]:
        return [r for b in self.batches() for r in rows(b)]


@pytest.fixture
def setup(tmp_path: Path, pg_server: PostgresServer, pg_db: str) -> Iterator[Setup]:
    pg_server.psql(f"ALTER DATABASE \"{pg_db}\" SET logical_decoding_work_mem = '64kB'")
    s = Setup(tmp_path, pg_server, pg_db)
    try:
        yield s
    finally:
        s.close()


def _replay(landed: list[dict[str, Any]]) -> dict[int, str]:
    """Apply landed rows by position, as a consumer does."""
    table: dict[int, str] = {}
    for r in sorted(landed, key=lambda r: r["_cdc_pos"]):
        if r["_cdc_op"] == "d":
            table.pop(r["id"], None)
        else:
            table[r["id"]] = r["v"]
    return table


def test_sigkill_mid_stream_rereads_the_transaction_and_lands_it_once(setup: Setup) -> None:
    s = setup
    s.server.psql("CREATE TABLE t (id int PRIMARY KEY, v text)", s.db)
    s.start("landed", snapshot={"mode": "never"})
    s.wait("the start mark in the checkpoint", lambda: s.checkpoint() is not None)
    s.server.psql("INSERT INTO t SELECT g, 'committed' FROM generate_series(1, 10) g", s.db)
    s.wait("the first 10 rows landed", lambda: len(s.landed()) >= 10)

    loop = asyncio.new_event_loop()
    conn = loop.run_until_complete(asyncpg.connect(s.server.dsn(s.db)))
    try:
        loop.run_until_complete(conn.execute(
            "BEGIN; INSERT INTO t SELECT g, repeat('x', 30) FROM generate_series(11, 20010) g;"
            " UPDATE t SET v = 'changed' WHERE id <= 5; DELETE FROM t WHERE id BETWEEN 6 AND 8"))
        s.wait("the open transaction spooled", lambda: s.spooled() > 200_000)
        assert {r["id"] for r in s.landed()} == set(range(1, 11)), "nothing of an open transaction may land"
        _check_flush_within_checkpoint(s)
        s.kill()
        assert s.spooled() > 0  # the killed daemon's spool is still there
        leftover = s.state / SPOOL_DIR / f"4242{SUFFIX}"
        leftover.write_bytes(b"a record cut short")
        landed_before = len(s.landed())

        s.start("landed", snapshot={"mode": "never"})
        s.wait("the spool of the killed run removed", lambda: not leftover.exists())
        s.wait("the open transaction streamed again", lambda: s.spooled() > 200_000)
        loop.run_until_complete(conn.execute(
            "INSERT INTO t SELECT g, 'late' FROM generate_series(20011, 25000) g; COMMIT"))
    finally:
        loop.run_until_complete(conn.close())
        loop.close()

    source = {int(r.split("|")[0]): r.split("|")[1]
              for r in s.server.psql("SELECT id, v FROM t", s.db).splitlines()}
    assert len(source) == 24997
    s.wait("the committed transaction landed", lambda: _replay(s.landed()) == source)
    landed = s.landed()
    positions = [r["_cdc_pos"] for r in landed]
    assert len(positions) == len(set(positions)), "an event landed twice"
    assert len(landed) == landed_before + 20000 + 5 + 3 + 4990
    s.wait("the spool emptied", lambda: s.spooled() == 0)
    commit_lsn = int(max(positions).split(":")[1], 16)
    s.wait("the slot confirmed the transaction", lambda: s.confirmed_flush() >= commit_lsn)
    _check_flush_within_checkpoint(s)


def test_a_full_state_volume_holds_the_stream_until_the_spool_fits(setup: Setup) -> None:
    """The spool of a streamed transaction cannot be written (ENOSPC): the stream reconnects with backoff and the
    server sends the transaction again; once the volume has room it lands, exactly once."""
    from test_faults_disk import fill, tmpfs  # the tmpfs helpers of the disk fault tests

    s = setup
    s.server.psql("CREATE TABLE t (id int PRIMARY KEY, v text)", s.db)
    with tmpfs(s.state, "32m"):
        s.start("landed", snapshot={"mode": "never"})
        s.wait("the start mark in the checkpoint", lambda: s.checkpoint() is not None)
        filler = fill(s.state)
        s.server.psql("INSERT INTO t SELECT g, repeat('x', 30) FROM generate_series(1, 20000) g", s.db)
        s.wait("the spool failure reported", lambda: "cannot write the in-progress transaction spool" in s.tail()
               or "cannot create the in-progress transaction spool" in s.tail())
        assert s.landed() == [], "nothing of a transaction that could not be staged may land"
        filler.unlink()
        s.wait("the transaction landed", lambda: len(s.landed()) >= 20000)
        landed = s.landed()
        assert sorted(r["id"] for r in landed) == list(range(1, 20001))
        assert len({r["_cdc_pos"] for r in landed}) == 20000
        s.kill()
