"""The checkpoint never moves backwards, even when the source re-sends older progress marks after a restart.

Real PostgreSQL, real runtime and landing zone: a restart mid-transaction makes the server send the
previous transaction again (the slot's flush position is that transaction's commit); its rows are
skipped by position, but its commit mark reaches a batch of its own while the acked part of the big
transaction is being skipped.
"""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path

import pytest

from cdcd.checkpoint.store import Checkpoint, CheckpointStore
from cdcd.config import Config, parse_config
from cdcd.landing.layout import MANIFESTS, manifest_name
from cdcd.landing.manifest import load_manifest
from cdcd.landing.reader import landed_seqs, mark_consumed
from cdcd.runtime.runtime import Runtime
from cdcd.sinks import make_sink
from cdcd.sources import make_source
from devtools.servers import PostgresServer

BIG = 60_000
FIRST = 40_000  # rows of the big transaction acked before the restart


def _config(pg: PostgresServer, db: str, tmp: Path) -> Config:
    return parse_config(
        {
            "source": {"kind": "postgres", "port": pg.port, "user": "postgres", "database": db,
                       "tables": ["public.t"], "sslmode": "disable",
                       "postgres": {"slot": f"s_{db}", "publication": f"p_{db}", "heartbeat_s": 3600}},
            "snapshot": {"mode": "never"},
            "landing": {"path": str(tmp / "landing"), "ack": "consumed", "max_batch_events": 10_000,
                        "max_batch_delay_ms": 20},
            "state": {"path": str(tmp / "state"), "keep_checkpoints": 1000},
            "runtime": {"max_inflight_batches": 4, "shutdown_grace_s": 5},
            "http": {"listen": ""},
        },
        env={},
    )


async def _until(what: str, predicate, timeout: float = 120) -> None:  # type: ignore[no-untyped-def]
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


def _rows(landing: Path) -> int:
    return sum(load_manifest(landing / MANIFESTS / manifest_name(s))["event_count"] for s in landed_seqs(landing))


@pytest.mark.slow
async def test_resent_commit_mark_never_moves_the_checkpoint_back(pg_server: PostgresServer, pg_db: str,
                                                                   tmp_path: Path) -> None:
    pg_server.psql("CREATE TABLE t (id int PRIMARY KEY)", pg_db)
    config = _config(pg_server, pg_db, tmp_path)
    landing = tmp_path / "landing"
    store = CheckpointStore(config.state.path)
    rt = Runtime(config, make_source(config), make_sink(config))
    await rt.start()
    try:
        pg_server.psql("INSERT INTO t VALUES (0)", pg_db)
        await _until("the first transaction landed", lambda: _rows(landing) >= 1)
        for seq in landed_seqs(landing):
            mark_consumed(landing, seq)
        await _until("the first transaction checkpointed", lambda: rt.stats.events_committed >= 1)
        pg_server.psql(f"INSERT INTO t SELECT generate_series(1, {BIG})", pg_db)
        acked = 0
        done = {s for s in landed_seqs(landing) if s <= rt.stats.committed_batch_seq}
        while acked < FIRST:  # ack the big transaction's batches in order until FIRST rows, never its end
            await _until("a batch of the big transaction", lambda: bool(set(landed_seqs(landing)) - done))
            seq = min(set(landed_seqs(landing)) - done)
            mark_consumed(landing, seq)
            done.add(seq)
            acked += load_manifest(landing / MANIFESTS / manifest_name(seq))["event_count"]
        assert acked < BIG
        await _until("the checkpoint inside the big transaction", lambda: rt.stats.events_committed >= 1 + acked)
    finally:
        await rt.force_stop()
    inside = store.load()
    assert inside is not None and inside.position is not None

    rt2 = Runtime(config, make_source(config), make_sink(config))
    await rt2.start()
    try:
        await _until("the acked part of the big transaction skipped", lambda: rt2.stats.events_skipped >= acked)
        await _until("the rest of the big transaction seen", lambda: rt2.stats.events_seen >= BIG - acked)
        await asyncio.sleep(0.5)  # batches of marks only are committed at once
    finally:
        await rt2.force_stop()
    saved: list[Checkpoint] = [c for _, c in store.entries() if isinstance(c, Checkpoint)]
    positions = [c.position for c in saved if c.position is not None]
    backwards = [(str(a), str(b)) for a, b in itertools.pairwise(positions) if b < a]  # type: ignore[operator]
    assert not backwards, f"the checkpoint moved backwards: {backwards}"
    final = store.load()
    assert final is not None and final.position is not None and final.position >= inside.position  # type: ignore[operator]
