"""Every cell of the runtime state table (DESIGN.md section 2), with a real PostgreSQL and landing zone."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from cdcd.checkpoint.store import CheckpointStore
from cdcd.config import Config, parse_config
from cdcd.errors import StateError
from cdcd.runtime.runtime import Runtime, RuntimeState
from cdcd.sinks import make_sink
from cdcd.sources import make_source
from devtools.servers import PostgresServer

ROWS = 25


def _config(pg_server: PostgresServer, db: str, tmp_path: Path, ack: str, grace: float = 30) -> Config:
    return parse_config(
        {
            "source": {
                "kind": "postgres", "port": pg_server.port, "user": "postgres", "database": db,
                "tables": ["public.items"], "sslmode": "disable",
                "postgres": {"slot": f"s_{db}", "publication": f"p_{db}"},
            },
            "landing": {"path": str(tmp_path / "landing"), "ack": ack, "max_batch_events": 10,
                        "max_batch_delay_ms": 50},
            "state": {"path": str(tmp_path / "state")},
            "runtime": {"max_inflight_batches": 2, "shutdown_grace_s": grace},
            "http": {"listen": ""},
        },
        env={},
    )


@pytest.fixture
def items_db(pg_server: PostgresServer, pg_db: str) -> str:
    pg_server.psql("CREATE TABLE items (id int PRIMARY KEY, v text)", pg_db)
    pg_server.psql(f"INSERT INTO items SELECT g, 'v' || g FROM generate_series(1, {ROWS}) g", pg_db)
    return pg_db


def _runtime(config: Config) -> Runtime:
    return Runtime(config, source=make_source(config), sink=make_sink(config))


async def _wait_for(predicate, timeout: float = 60) -> None:  # type: ignore[no-untyped-def]
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.05)


async def test_idle_cells(pg_server: PostgresServer, items_db: str, tmp_path: Path) -> None:
    config = _config(pg_server, items_db, tmp_path, "landed")
    rt = _runtime(config)
    assert rt.state is RuntimeState.IDLE
    await rt.stop()
    assert rt.state is RuntimeState.STOPPED
    rt2 = _runtime(config)
    assert await rt2.force_stop() == []
    assert rt2.state is RuntimeState.STOPPED


async def test_running_and_stopped_cells(pg_server: PostgresServer, items_db: str, tmp_path: Path) -> None:
    config = _config(pg_server, items_db, tmp_path, "landed")
    rt = _runtime(config)
    await rt.start()
    assert rt.state is RuntimeState.RUNNING
    with pytest.raises(StateError, match="already started"):
        await rt.start()
    await _wait_for(lambda: rt.stats.events_committed >= ROWS)
    await rt.stop()  # running -> stopping -> stopped
    assert rt.state is RuntimeState.STOPPED
    ckpt = CheckpointStore(config.state.path).load()
    assert ckpt is not None and ckpt.event_count == ROWS + 1  # the rows and the snapshot's opening truncate
    # stopped: stop and force_stop are no-ops; start runs again and delivers nothing twice.
    await rt.stop()
    assert await rt.force_stop() == []
    assert rt.state is RuntimeState.STOPPED
    await rt.start()
    assert rt.state is RuntimeState.RUNNING
    pg_server.psql("INSERT INTO items VALUES (1000, 'after restart')", items_db)
    await _wait_for(lambda: rt.stats.events_committed >= ROWS + 2)
    await rt.stop()
    ckpt = CheckpointStore(config.state.path).load()
    assert ckpt is not None and ckpt.event_count == ROWS + 2


async def test_stopping_cells_and_refused_stop_then_force_stop(
    pg_server: PostgresServer, items_db: str, tmp_path: Path
) -> None:
    # Consumed mode with no consumer: nothing is ever acked, so stop() must refuse after the grace period.
    config = _config(pg_server, items_db, tmp_path, "consumed", grace=1.5)
    rt = _runtime(config)
    await rt.start()
    await _wait_for(lambda: rt.stats.batches_delivered >= 1)
    stopping = asyncio.ensure_future(rt.stop())
    await _wait_for(lambda: rt.state is RuntimeState.STOPPING)
    with pytest.raises(StateError, match="currently stopping"):
        await rt.start()
    with pytest.raises(StateError, match="currently stopping"):
        await rt.stop()
    with pytest.raises(StateError, match="currently stopping"):
        await rt.force_stop()
    with pytest.raises(StateError, match=r"(\d+) uncommitted events remain") as refused:
        await stopping
    assert rt.state is RuntimeState.RUNNING
    named = int(str(refused.value).split()[0])
    assert named > 0
    dropped = await rt.force_stop()
    assert rt.state is RuntimeState.STOPPED
    assert len(dropped) == named
    assert CheckpointStore(config.state.path).load() is None  # nothing was ever acked


async def test_cancelled_stop_returns_to_running_for_force_stop(
    pg_server: PostgresServer, items_db: str, tmp_path: Path
) -> None:
    config = _config(pg_server, items_db, tmp_path, "consumed", grace=30)
    rt = _runtime(config)
    await rt.start()
    await _wait_for(lambda: rt.stats.batches_delivered >= 1)
    stopping = asyncio.ensure_future(rt.stop())
    await _wait_for(lambda: rt.state is RuntimeState.STOPPING)
    stopping.cancel()
    with pytest.raises(asyncio.CancelledError):
        await stopping
    assert rt.state is RuntimeState.RUNNING
    dropped = await rt.force_stop()
    assert rt.state is RuntimeState.STOPPED and len(dropped) > 0


async def test_a_due_batch_that_cannot_be_sealed_does_not_spin_the_timer(
    pg_server: PostgresServer, items_db: str, tmp_path: Path
) -> None:
    """Consumed mode without a consumer: the in-flight batches are never acked, the hand-over fills, and the
    open batch comes due with nowhere to go. The timer looks at it again every HELD_POLL_S; it used to call
    sleep(0) in a loop (a core held at 100 % until a stop or force stop, and a stop that then hung)."""
    config = _config(pg_server, items_db, tmp_path, "consumed", grace=1.5)
    rt = _runtime(config)
    ticks = 0

    def tick() -> None:
        nonlocal ticks
        ticks += 1

    rt.on_tick = tick
    await rt.start()
    await _wait_for(lambda: rt.stats.batches_delivered >= 1)
    pg_server.psql("INSERT INTO items SELECT g, 'more' FROM generate_series(1000, 1002) g", items_db)
    await _wait_for(lambda: rt._handoff.full() and (rt._batcher.time_left() or 1.0) < 0)
    ticks = 0
    await asyncio.sleep(1.0)
    # at most one pass per HELD_POLL_S (0.01 s) plus slack; the spinning timer made tens of thousands
    assert ticks <= 300, ticks
    with pytest.raises(StateError, match="uncommitted events remain"):
        await rt.stop()
    assert rt.state is RuntimeState.RUNNING
    assert len(await rt.force_stop()) > 0
    assert rt.state is RuntimeState.STOPPED
