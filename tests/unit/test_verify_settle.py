"""`cdcd verify`'s re-check says truly why the mirror did not reach the source's position in time: the daemon's
checkpoint short of it (the daemon stopped, or killed mid-snapshot), or the consumer behind the daemon."""

from __future__ import annotations

import asyncio
from pathlib import Path

from test_spark_operator_surface import land

from cdcd.checkpoint.store import Checkpoint, CheckpointStore
from cdcd.config import parse_config
from cdcd.positions import PgPosition, Position
from cdcd.spark.state import ConsumerState, TargetStore
from cdcd.verify.settle import Settle


class NoSnapshotSide:
    """A source side whose snapshot holds no checkpoint's transactions (PostgreSQL's, by position only)."""

    def holds_snapshot(self, pos: Position) -> bool:
        return False


def why_not(tmp_path: Path, checkpoint_lsn: int, daemon_seq: int, applied: int) -> str:
    landing, target = tmp_path / "landing", tmp_path / "target"
    land(landing, [1, 2, 3])
    config = parse_config({"source": {"kind": "postgres", "user": "u", "database": "d", "tables": ["public.t"]},
                           "state": {"path": str(tmp_path / "state")}, "landing": {"path": str(landing)}}, env={})
    (tmp_path / "state").mkdir()
    CheckpointStore(config.state.path).save(Checkpoint("postgres", daemon_seq, 1, PgPosition(checkpoint_lsn, 0)))
    TargetStore(target).save(ConsumerState(applied))
    settle = Settle(config, target, "delta", timeout_s=0)
    return asyncio.run(settle._mirror_reached(NoSnapshotSide(), PgPosition(1000, 0)))  # type: ignore[arg-type]


def test_a_checkpoint_short_of_the_position_names_the_daemon(tmp_path: Path) -> None:
    why = why_not(tmp_path, checkpoint_lsn=500, daemon_seq=2, applied=3)  # the consumer applied every batch
    assert "the daemon's checkpoint is at 0/1F4#0, batch 2, short of it" in why, why
    assert "consumer" not in why


def test_a_consumer_behind_the_checkpoint_is_named(tmp_path: Path) -> None:
    why = why_not(tmp_path, checkpoint_lsn=1200, daemon_seq=3, applied=1)
    assert "the consumer applied batch 1, not every batch up to 3" in why, why
    assert "daemon's checkpoint is at" not in why


def test_a_mirror_at_the_position_is_reached(tmp_path: Path) -> None:
    assert why_not(tmp_path, checkpoint_lsn=1200, daemon_seq=3, applied=3) == ""
