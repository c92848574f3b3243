"""The sealed batches' way to the checkpoint (``Committer``): the deliverer hands each batch to the sink through the
commit barrier, the acker receives the sink's acks, and the contiguous acked prefix is checkpointed, then confirmed
to the source (``confirm``) and the sink (``committed``). A save that fails (disk full, I/O error) is retried by
its own timer task with a capped backoff until it succeeds: the acks have all arrived already, so waiting for the
next one would wedge the barrier once every in-flight slot is taken.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from typing import Any

from cdcd.checkpoint.store import Checkpoint, CheckpointStore
from cdcd.config import Config
from cdcd.errors import CheckpointError, SinkError
from cdcd.events import ChangeBlock, ChangeEvent, Mark, RowBlock, event_count, is_schema_change, lands
from cdcd.retry import Backoff
from cdcd.runtime.barrier import CommitBarrier
from cdcd.runtime.interfaces import Batch, Sink, Source
from cdcd.runtime.stats import RuntimeStats

#: Cap of the checkpoint save retry: a save is a few KB, so retrying often costs nothing and the
#: pipeline resumes within seconds of the disk recovering.
_CHECKPOINT_RETRY_MAX_S = 5.0


class Committer:
    """The deliverer, the acker and the checkpoint saves of one runtime. The runtime spawns ``deliver`` and
    ``ack`` as its pipeline tasks and sets ``checkpoint``, ``barrier`` and ``handoff`` at each start; the retry
    timer of a failed save is one of its tasks too (``tasks``, ``spawn``), so a stop cancels it and its error
    fails the pipeline."""

    def __init__(self, config: Config, source: Source, sink: Sink, store: CheckpointStore, stats: RuntimeStats,
                 log: Any, tasks: dict[str, asyncio.Task[None]],
                 spawn: Callable[[str, Coroutine[Any, Any, None]], None]) -> None:
        self.config = config
        self.source = source
        self.sink = sink
        self.store = store
        self.stats = stats
        self._log = log
        self._tasks = tasks
        self._spawn = spawn
        self._lock = asyncio.Lock()
        self.checkpoint: Checkpoint  # the last saved (or loaded) checkpoint; set by the runtime's start
        self.source_state: dict[str, Any]  # its source state, which the next fold starts from
        self.barrier: CommitBarrier
        self.handoff: asyncio.Queue[Batch]  # sealed batches waiting for an in-flight slot

    async def deliver(self) -> None:
        """The deliverer task: sealed batches to the sink, in seq order, each once an in-flight slot is free."""
        while True:
            batch = await self.handoff.get()
            try:
                await self.barrier.reserve()
                self.barrier.add(batch)
                # a completed re-snapshot's mark lands too (the consumer removes the rows it did not see), and so
                # does a schema change (the change-log records it)
                if batch.event_count or any(type(i) is Mark and lands(i) for i in batch.items):
                    await self._deliver_with_retry(batch)
                    self.stats.batches_delivered += 1
                else:  # only marks: nothing to land, progress to checkpoint
                    self.barrier.ack(batch.seq)
                    await self.commit()
            finally:
                self.handoff.task_done()

    async def _deliver_with_retry(self, batch: Batch) -> None:
        retry = Backoff(max_s=self.config.runtime.reconnect_max_s)  # no budget: landing waits for the space
        while True:
            try:
                await self.sink.deliver(batch)
                return
            except SinkError as exc:
                if exc.fatal:
                    raise
                self.stats.last_error = str(exc)
                delay = retry.failure(exc)
                self._log.warning("landing the batch failed, retrying", batch=batch.seq, error=str(exc),
                                  retry_in_s=round(delay, 2))
                await asyncio.sleep(delay)

    async def ack(self) -> None:
        """The acker task: the sink's acks; each that completes a contiguous prefix commits it."""
        async for seq in self.sink.acks():
            if self.barrier.ack(seq):
                await self.commit()
        # Only close() ends the acks; ending while running would silently stall the pipeline.
        raise SinkError("the sink stopped acknowledging batches while the runtime was running")

    async def _retry_checkpoint(self) -> None:
        """Retry a failed checkpoint save on a timer until it succeeds (no further ack may ever come)."""
        retry = Backoff(max_s=min(_CHECKPOINT_RETRY_MAX_S, self.config.runtime.reconnect_max_s))
        while True:
            await asyncio.sleep(retry.failure(CheckpointError("checkpoint save failed")))
            if await self.commit():
                return

    async def commit(self) -> bool:
        """Checkpoint the contiguous acked prefix, then tell the source and the sink.

        False when the save failed: the prefix stays committable and the retry timer runs.
        """
        async with self._lock:
            batches = self.barrier.committable()
            if not batches:
                return True
            items = [item for batch in batches for item in batch.items]
            state = self.source.fold(self.source_state, items)
            last = batches[-1]
            events = sum(b.event_count for b in batches)
            # Never backwards: after a restart the source may re-send progress marks older than the checkpoint
            # (the skip rule drops only row events), so the last item need not be the highest: take the highest
            # of the saved position, the last item and every mark (rows arrive in order; marks fold the flush).
            position = self.checkpoint.position
            for item in (*(i for i in items if type(i) is Mark), last.items[-1]) if last.items else ():
                if position is None or item.position > position:  # type: ignore[operator]
                    position = item.position
            ckpt = Checkpoint(
                source_kind=self.source.kind,
                batch_seq=last.seq,
                event_count=self.barrier.committed_events + events,
                position=position,
                source_state=state,
            )
            try:
                ckpt = await asyncio.to_thread(self.store.save, ckpt)
            except CheckpointError as exc:
                if exc.fatal:
                    raise
                self._save_failed(exc, last.seq, sum(b.event_count for b in batches))
                return False
            self._save_succeeded()
            self.checkpoint, self.source_state = ckpt, state
            await self.barrier.mark_durable(batches)
            self._count_committed(batches, ckpt)
            if ckpt.position is not None:
                await self.source.confirm(ckpt.position, state)
            try:
                await self.sink.committed(last.seq)
            except SinkError as exc:
                if exc.fatal:
                    raise
                # Retention is housekeeping: the data is safe, the next commit tries again.
                self.stats.last_error = str(exc)
                self._log.warning("landing retention failed; retried at the next commit", error=str(exc))
            return True

    def _save_failed(self, exc: CheckpointError, batch: int, events: int) -> None:
        """Count and report a failed save and make sure the retry timer runs."""
        stats = self.stats
        stats.checkpoint_failures += 1
        stats.checkpoint_error = stats.last_error = str(exc)
        now, since = time.time(), stats.checkpoint_failing_since
        first = since is None
        if since is None:
            since = stats.checkpoint_failing_since = now
        retry = self._tasks.get("checkpoint-retry")
        if retry is None or retry.done():
            self._spawn("checkpoint-retry", self._retry_checkpoint())
        # The first failure is an error, the retries (every few seconds at most, once the slots are full) warnings.
        log = self._log.error if first else self._log.warning
        log("checkpoint save failed; retrying on a timer, reading is paused once the in-flight batches are full",
            error=str(exc), batch=batch, uncommitted_events=events, failures=stats.checkpoint_failures,
            failing_for_s=round(now - since, 1))

    def _save_succeeded(self) -> None:
        stats = self.stats
        if stats.checkpoint_failing_since is not None:
            self._log.warning("checkpoint saves work again; the pipeline resumes",
                              failed_for_s=round(time.time() - stats.checkpoint_failing_since, 1),
                              failures=stats.checkpoint_failures)
            stats.checkpoint_failing_since = None

    def _count_committed(self, batches: list[Batch], ckpt: Checkpoint) -> None:
        stats = self.stats
        stats.events_committed = ckpt.event_count
        stats.committed_batch_seq = ckpt.batch_seq
        stats.committed_position = ckpt.position.encoded if ckpt.position else None
        stats.checkpoint_saved_at = time.time()
        per_table = stats.table_events
        for batch in batches:
            for item in batch.items:
                if type(item) is ChangeEvent or type(item) is RowBlock or type(item) is ChangeBlock:
                    name = str(item.schema.table)
                    per_table[name] = per_table.get(name, 0) + event_count(item)
                elif type(item) is Mark and is_schema_change(item):
                    name = str(item.detail["change"].table)
                    count = stats.schema_changes.get(name, {}).get("count", 0) + 1
                    stats.schema_changes[name] = {"version": item.detail["change"].version, "count": count,
                                                  "position": item.position.encoded, "at": stats.checkpoint_saved_at}
        self._log.debug("checkpoint saved", batch=ckpt.batch_seq, position=str(ckpt.position),
                        events=ckpt.event_count)
