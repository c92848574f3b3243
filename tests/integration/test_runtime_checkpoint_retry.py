"""The commit barrier never wedges: a checkpoint save that fails is retried on its own timer.

A real PostgreSQL source and landing zone; the checkpoint store fails its saves with ENOSPC while
``failing`` is set (the same OSError a full disk raises; the real filesystem case is in
tests/e2e/test_faults_disk.py). With every in-flight slot taken no further ack comes, so only a
timer can save the checkpoint once the disk has room again.
"""

from __future__ import annotations

import asyncio
import errno
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from cdcd.checkpoint.store import CheckpointStore
from cdcd.config import Config, parse_config
from cdcd.errors import StateError
from cdcd.landing.reader import landed_seqs
from cdcd.runtime.runtime import Runtime, RuntimeState
from cdcd.sinks import make_sink
from cdcd.sources import make_source
from devtools.servers import PostgresServer

ROWS = 25
INFLIGHT = 2


class FlakyStore(CheckpointStore):
    """A checkpoint store whose disk is full while ``failing`` is set."""

    failing = False

    def _install(self, data: bytes) -> None:
        if self.failing:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.current_path))
        super()._install(data)


def _config(pg_server: PostgresServer, db: str, tmp_path: Path, grace: float) -> Config:
    return parse_config(
        {
            "source": {
                "kind": "postgres", "port": pg_server.port, "user": "postgres", "database": db,
                "tables": ["public.items"], "sslmode": "disable",
                "postgres": {"slot": f"s_{db}", "publication": f"p_{db}"},
            },
            "landing": {"path": str(tmp_path / "landing"), "ack": "landed", "max_batch_events": 10,
                        "max_batch_delay_ms": 50},
            "state": {"path": str(tmp_path / "state")},
            "runtime": {"max_inflight_batches": INFLIGHT, "shutdown_grace_s": grace, "reconnect_max_s": 1.0},
            "http": {"listen": ""},
        },
        env={},
    )


async def _wait_for(what: str, predicate: Callable[[], object], timeout: float = 60) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


async def _start_failing(pg_server: PostgresServer, db: str, tmp_path: Path,
                         grace: float = 30) -> tuple[Runtime, FlakyStore]:
    """A runtime that committed the snapshot, then saves fail while 60 more rows stream in."""
    pg_server.psql("CREATE TABLE items (id int PRIMARY KEY, v text)", db)
    pg_server.psql(f"INSERT INTO items SELECT g, 'v' || g FROM generate_series(1, {ROWS}) g", db)
    config = _config(pg_server, db, tmp_path, grace)
    store = FlakyStore(config.state.path)
    rt = Runtime(config, source=make_source(config), sink=make_sink(config), store=store)
    await rt.start()
    await _wait_for("the snapshot committed", lambda: rt.stats.events_committed >= ROWS + 1)
    store.failing = True
    for i in range(6):
        pg_server.psql(f"INSERT INTO items SELECT g, 'w' FROM generate_series({100 + i * 10}, {109 + i * 10}) g", db)
    await _wait_for("every in-flight slot taken by acked, unsaved batches",
                    lambda: rt.status()["stats"]["batches_inflight"] == INFLIGHT and rt.stats.checkpoint_failures)
    return rt, store


@pytest.fixture
def db(pg_server: PostgresServer, pg_db: str) -> str:
    return pg_db


async def test_failed_save_is_retried_on_a_timer_and_the_pipeline_resumes(
    pg_server: PostgresServer, db: str, tmp_path: Path
) -> None:
    rt, store = await _start_failing(pg_server, db, tmp_path)
    try:
        committed = rt.stats.events_committed
        failures = rt.stats.checkpoint_failures
        # No ack can arrive now: more failures mean the timer retries.
        await _wait_for("the save retried by the timer", lambda: rt.stats.checkpoint_failures >= failures + 2)
        assert rt.stats.events_committed == committed
        assert rt.status()["checkpoint_failing"] is True
        assert "free space" in (rt.stats.checkpoint_error or "")
        on_disk = CheckpointStore(store.path).load()
        assert on_disk is not None and on_disk.event_count == committed
        store.failing = False
        await _wait_for("every row committed", lambda: rt.stats.events_committed >= ROWS + 1 + 60)
        assert rt.status()["checkpoint_failing"] is False and rt.stats.checkpoint_failing_since is None
        await rt.stop()
        on_disk = CheckpointStore(store.path).load()
        assert on_disk is not None and on_disk.event_count == ROWS + 1 + 60  # + the snapshot's opening truncate
    finally:
        if rt.state is RuntimeState.RUNNING:
            await rt.force_stop()


async def test_graceful_stop_waits_for_the_save_within_the_grace_period(
    pg_server: PostgresServer, db: str, tmp_path: Path
) -> None:
    rt, store = await _start_failing(pg_server, db, tmp_path, grace=60)
    committed = rt.stats.events_committed
    stopping = asyncio.ensure_future(rt.stop())
    await asyncio.sleep(1.0)  # the disk stays full for a while into the grace period
    assert not stopping.done()
    store.failing = False
    await stopping
    assert rt.state is RuntimeState.STOPPED
    # Everything read before the stop is landed and checkpointed (the rest streams at the next start).
    on_disk = CheckpointStore(store.path).load()
    assert on_disk is not None and on_disk.event_count == rt.stats.events_committed > committed
    assert on_disk.batch_seq >= max(landed_seqs(tmp_path / "landing"))


async def test_graceful_stop_while_saves_keep_failing_names_the_checkpoint_and_loses_nothing(
    pg_server: PostgresServer, db: str, tmp_path: Path
) -> None:
    rt, store = await _start_failing(pg_server, db, tmp_path, grace=1.5)
    committed = rt.stats.events_committed
    with pytest.raises(StateError, match="the checkpoint cannot be saved: saving the checkpoint in"):
        await rt.stop()
    await rt.force_stop()
    on_disk = CheckpointStore(store.path).load()
    assert on_disk is not None and on_disk.event_count == committed  # not advanced
    # The disk has room again: a restart delivers every row the failed saves did not cover.
    store = FlakyStore(store.path)
    rt = Runtime(rt.config, source=make_source(rt.config), sink=make_sink(rt.config), store=store)
    await rt.start()
    try:
        await _wait_for("every row committed after the restart", lambda: rt.stats.events_committed >= ROWS + 1 + 60)
    finally:
        await rt.stop()
    on_disk = CheckpointStore(store.path).load()
    assert on_disk is not None and on_disk.event_count == ROWS + 1 + 60  # + the snapshot's opening truncate
