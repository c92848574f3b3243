"""No false drift on a live source: the differences of the first comparison are re-checked where the source
and the mirror stand at one known position, and a key the change-log shows changed since is left out.

A round opens a new snapshot of the source and takes its positions (``cdcd.verify.sides``: ``before`` is at
or below every change the snapshot may lack, ``at`` at or above every change it holds), waits until the
mirror holds every change below ``at`` (the daemon's checkpoint is at or past ``at`` and the consumer applied
every landed batch up to the checkpoint's that holds anything: the consumer's own commit record,
TARGET/state/consumer.json, and the landing zone's manifests), then reads both sides
of the differing buckets again and the change-log's keys at or above ``before``. A key that still differs
and has no such change is drift: the mirror has everything the snapshot has, and nothing changed it since.
A key that changed is left out and checked again in the next round; after the last round it is reported
as unsettled, not as drift. Every wait is bounded by ``--settle-timeout``.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cdcd.checkpoint.store import CheckpointStore
from cdcd.config import Config
from cdcd.landing.reader import landed_seqs, read_manifest
from cdcd.positions import MySqlPosition, PgPosition, Position
from cdcd.spark.objtarget import applied_seq
from cdcd.verify.compare import TableDiff, compare
from cdcd.verify.mirror import arrow_rows, lakehouse_frame
from cdcd.verify.mirror_sums import bucket_rows
from cdcd.verify.normalize import normal
from cdcd.verify.ranges import CHUNK_BUCKETS
from cdcd.verify.report import SHOW_KEYS
from cdcd.verify.sides import SourceSide, source_side
from cdcd.verify.source import SourceTable, TableShape

ROUNDS = 3


class _All(set[tuple[str, ...]]):
    """Every key: the change-log shows a truncate since the snapshot."""

    def __contains__(self, key: object) -> bool:
        return True


ALL = _All()
POLL_S = 0.5


@dataclass(slots=True)
class Settled:
    """What the rounds left: the drift (keys and the versions the report prints), the keys still changing."""

    missing: list[Any] = field(default_factory=list)
    extra: list[Any] = field(default_factory=list)
    changed: list[Any] = field(default_factory=list)
    versions: dict[Any, Any] = field(default_factory=dict)
    unsettled: int = 0
    note: str = ""  # why the differences were not re-checked, when they were not


def _at_or_past(pos: Position, at: Position) -> bool:
    if isinstance(pos, MySqlPosition) and isinstance(at, MySqlPosition):
        return pos >= at
    if isinstance(pos, PgPosition) and isinstance(at, PgPosition):
        return pos >= at
    return False


class Settle:
    def __init__(self, config: Config, target: Path, fmt: str, timeout_s: float) -> None:
        self.config, self.target, self.fmt = config, target, fmt
        self.deadline = time.monotonic() + timeout_s
        self._empty: set[int] = set()  # landed batches with nothing to apply

    def _checkpoint(self) -> tuple[Position, int] | None:
        ckpt = CheckpointStore(self.config.state.path).load()
        return None if ckpt is None or ckpt.position is None else (ckpt.position, ckpt.batch_seq)

    def _applied_seq(self) -> int:
        return applied_seq(self.target)  # the consumer's record, on a file system or on object storage

    def _applied_through(self, seq: int) -> bool:
        """Whether the consumer applied every landed batch up to ``seq`` that holds something to apply (it does
        not record the empty ones, heartbeats on an idle source, in its commit record)."""
        applied = self._applied_seq()
        for s in landed_seqs(self.config.landing.path):
            if applied < s <= seq and s not in self._empty:
                m = read_manifest(self.config.landing.path, s)
                if m.files or m.covered or m.schema_changes or m.position_lost:
                    return False
                self._empty.add(s)
        return True

    def _in_epoch(self, pos: Position, like: Position) -> Position:
        """A binlog position the source named, in the checkpoint's position epoch (the source knows no epoch)."""
        if isinstance(pos, MySqlPosition) and isinstance(like, MySqlPosition):
            return MySqlPosition.at(pos.file, pos.pos, epoch=like.epoch)
        return pos

    async def _mirror_reached(self, side: SourceSide, at: Position) -> str:
        """Wait until the mirror holds every change below ``at`` (the snapshot's); '' then, else why not."""
        through: int | None = None  # the first checkpoint's batch at or past ``at``: it and those before hold them
        while True:
            found = self._checkpoint()
            if found is None:
                return f"no checkpoint in state.path {self.config.state.path} (is this the daemon's config?)"
            pos, seq = found
            if through is None and (_at_or_past(pos, self._in_epoch(at, pos)) or side.holds_snapshot(pos)):
                through = seq  # not a later checkpoint's: under steady writes it moves ahead of any consumer
            if through is not None and self._applied_through(through):
                return ""
            if time.monotonic() >= self.deadline:
                return f"the mirror did not reach the source's position {at} within --settle-timeout: " + (
                    f"the daemon's checkpoint is at {pos}, batch {seq}, short of it (is `cdcd run` running and "
                    "caught up?)" if through is None else
                    f"the consumer applied batch {self._applied_seq()}, not every batch up to {through}, the "
                    "daemon's first checkpoint past it (is `cdcd spark run` running?)")
            await asyncio.sleep(POLL_S)

    def _changed_keys(self, shape: TableShape, since: Position, like: Position) -> set[tuple[str, ...]]:
        """The keys of the change-log's rows at or above ``since``."""
        frame = lakehouse_frame(self.target, self.fmt, str(shape.table), "changelog")
        if frame is None:
            return set()
        cols = [c for c in shape.columns if c.name in shape.key]
        cols.sort(key=lambda c: shape.key.index(c.name))
        pos = self._in_epoch(since, like).encoded
        # a snapshot's rows (its reads, its opening truncate) change nothing: they may sit at the source's position
        # now, the snapshot's own
        since_rows = frame.where(f"_cdc_pos >= '{pos}' AND NOT coalesce(_cdc_snapshot, false) AND _cdc_op <> 'r'")
        rows = since_rows.select("_cdc_op", *[c.name for c in cols]).toArrow().to_pylist()
        if any(r["_cdc_op"] == "t" for r in rows):  # a truncate since changed every key
            return ALL
        return {tuple(str(normal(r[c.name], c.float32, c.is_json)) for c in cols) for r in rows}

    async def run(self, shape: TableShape, frame: Any, mirror_keys: list[str], buckets: int,
                  differing: list[int], first: TableDiff) -> Settled:
        out = Settled()
        # the notes (a key held twice) are not keys: they stand as the first comparison found them
        for mine, theirs in ((out.missing, first.missing), (out.extra, first.extra)):
            mine.extend(k for k in theirs if not isinstance(k, tuple))
        pending = {k for k in [*first.missing, *first.extra, *first.changed] if isinstance(k, tuple)}
        for _ in range(ROUNDS):
            if not pending:
                return out
            still: dict[Any, tuple[list[Any], Any]] = {}  # a pending key that differs again -> its list, versions
            async with source_side(self.config) as side:
                if side.before is None or side.at is None:
                    out.note = "the source does not tell its position"
                    break
                # waited with the snapshot open (its session shows in pg_stat_activity while verify waits)
                why = await self._mirror_reached(side, side.at)
                if why:
                    out.note = why
                    break
                for start in range(0, len(differing), CHUNK_BUCKETS):  # as the first comparison: bounded
                    chosen = differing[start:start + CHUNK_BUCKETS]
                    src_rows = await side.rows(shape, buckets, chosen)
                    dst_rows = arrow_rows(bucket_rows(frame, mirror_keys, buckets, chosen), shape.columns)
                    diff = compare(SourceTable(shape.table, shape.columns, shape.key, src_rows), dst_rows)
                    for mine, theirs in ((out.missing, diff.missing), (out.extra, diff.extra),
                                         (out.changed, diff.changed)):
                        still.update((k, (mine, diff.versions.get(k))) for k in theirs if k in pending)
                before = side.before
            found = self._checkpoint()
            assert found is not None  # _mirror_reached saw it
            moved = self._changed_keys(shape, before, found[0])  # read after the mirror: it covers what was read
            for k, (mine, versions) in still.items():
                if k not in moved:  # differs with the mirror past the snapshot, and nothing changed it since
                    pending.discard(k)
                    if len(mine) < SHOW_KEYS and versions is not None:
                        out.versions[k] = versions
                    mine.append(k)
            pending = {k for k in pending if k in still}  # equal now: it was lag
        else:
            out.unsettled = len(pending)
            return out
        # not re-checked: what the first comparison found and no round settled stands as drift
        for mine, theirs in ((out.missing, first.missing), (out.extra, first.extra), (out.changed, first.changed)):
            for k in theirs:
                if k in pending:
                    if k in first.versions and len(mine) < SHOW_KEYS:
                        out.versions[k] = first.versions[k]
                    mine.append(k)
        return out
