"""The runtime: drives a source into a sink through the commit barrier.

Four tasks make the pipeline:

* the reader pulls items from ``source.stream()``, drops those the
  checkpoint already covers, and fills the open batch;
* the timer seals the open batch when it is old enough and ticks the
  watchdog;
* the deliverer hands sealed batches to the sink in seq order, waiting for a
  free in-flight slot first (backpressure reaches the reader through the
  bounded hand-off queue);
* the acker receives acks, and for the contiguous acked prefix saves the
  checkpoint, then tells the source (``confirm``) and the sink (``committed``).
  A save that fails (disk full, I/O error) is retried by its own timer task
  with a capped backoff until it succeeds: the acks have all arrived already,
  so waiting for the next one would wedge the barrier once every in-flight
  slot is taken.

The reader and the timer are here; the deliverer, the acker and the checkpoint
saves are the ``Committer``'s (``commit.py``); the bounded steps of a stop are
in ``stopping.py``, the counters in ``stats.py``.

``start``/``stop``/``force_stop`` follow the state table of DESIGN.md
section 2; ``stop`` and ``force_stop`` mirror asyncpg's ``close`` and
``terminate``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Coroutine
from dataclasses import asdict
from typing import Any

import structlog

from cdcd.checkpoint.store import Checkpoint, CheckpointStore, store_for
from cdcd.config import Config
from cdcd.errors import CheckpointFatal, SourceError, StateError
from cdcd.events import ChangeBlock, ChangeEvent, Item, RowBlock, event_count
from cdcd.positions import Position
from cdcd.retry import Backoff, source_backoff
from cdcd.runtime.barrier import CommitBarrier
from cdcd.runtime.batcher import Batcher
from cdcd.runtime.commit import Committer
from cdcd.runtime.interfaces import Batch, ResumePoint, Sink, Source
from cdcd.runtime.state import RuntimeState
from cdcd.runtime.stats import RuntimeStats
from cdcd.runtime.stopping import STOP_STEP_S, cancel_tasks, close_source, pause_reading

__all__ = ["STOP_STEP_S", "Runtime", "RuntimeState", "RuntimeStats"]


class Runtime:
    def __init__(self, config: Config, source: Source, sink: Sink, store: CheckpointStore | None = None) -> None:
        self.config = config
        self.source = source
        self.sink = sink
        self.store = store or store_for(config.state)
        self.state = RuntimeState.IDLE
        self.stats = RuntimeStats(
            max_inflight_batches=config.runtime.max_inflight_batches, queue_capacity=_handoff_capacity()
        )
        self.on_tick: Callable[[], None] | None = None
        self._log = structlog.get_logger("cdcd.runtime").bind(source=config.source.kind)
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._done: asyncio.Future[None] | None = None
        self._committer = Committer(config, source, sink, self.store, self.stats, self._log, self._tasks,
                                    self._spawn)

    # -- lifecycle ----------------------------------------------------------------

    async def start(self) -> None:
        """Load the checkpoint, connect the source and start the pipeline."""
        if self.state is RuntimeState.RUNNING:
            raise StateError("runtime already started")
        if self.state is RuntimeState.STOPPING:
            raise StateError("runtime is currently stopping; wait for it to stop before starting it again")
        self.store.lock()
        try:
            await self._prepare()
        except BaseException:
            self.source.terminate()
            with contextlib.suppress(Exception):
                await self.sink.close()
            self.store.unlock()
            raise
        self._done = asyncio.get_running_loop().create_future()
        self.state = RuntimeState.RUNNING
        for name, coro in (("reader", self._read()), ("timer", self._time()),
                           ("deliverer", self._committer.deliver()), ("acker", self._committer.ack())):
            self._spawn(name, coro)
        position = self._committer.checkpoint.position
        self._log.info("runtime started", batch=self._next_seq - 1, position=str(position) if position else None)

    async def _prepare(self) -> None:
        ckpt = self.store.load()
        kind = self.source.kind
        if ckpt is not None and ckpt.source_kind != kind:
            raise CheckpointFatal(
                f"checkpoint {self.store.current_path} belongs to a {ckpt.source_kind} source but source.kind is "
                f"{kind}; give this source its own state.path"
            )
        committer = self._committer
        checkpoint = committer.checkpoint = ckpt or Checkpoint(source_kind=kind)
        landed = await self.sink.open()
        # Batches landed before a crash but never checkpointed keep their seqs: never reuse them.
        self._next_seq = max(checkpoint.batch_seq, landed) + 1
        self._barrier = committer.barrier = CommitBarrier(self._next_seq - 1, checkpoint.event_count,
                                                          self.config.runtime.max_inflight_batches)
        committer.source_state = dict(checkpoint.source_state)
        self._skip_upto: Position | None = checkpoint.position
        self._batcher = Batcher(self.config.landing.max_batch_events, self.config.landing.max_batch_delay_ms / 1000)
        self._handoff: asyncio.Queue[Batch] = asyncio.Queue(maxsize=_handoff_capacity())
        committer.handoff = self._handoff
        self._batch_opened = asyncio.Event()
        self.stats.checkpoint_failing_since = None  # a restart after a stop while saves failed starts afresh
        self.stats.events_committed = checkpoint.event_count
        self.stats.committed_batch_seq = checkpoint.batch_seq
        self.stats.committed_position = checkpoint.position.encoded if checkpoint.position else None
        await self.source.connect(ResumePoint(checkpoint.position, dict(committer.source_state)))

    async def wait(self) -> None:
        """Wait for the pipeline to end; re-raise the error that ended it."""
        if self._done is None:
            raise StateError("runtime was never started")
        await asyncio.shield(self._done)

    async def stop(self) -> None:
        """Graceful stop: stop reading, land what was read, wait for acks, checkpoint, close."""
        if self.state is RuntimeState.IDLE:
            self.state = RuntimeState.STOPPED
            return
        if self.state is RuntimeState.STOPPED:
            return
        if self.state is RuntimeState.STOPPING:
            raise StateError("runtime is currently stopping")
        self.state = RuntimeState.STOPPING
        grace = self.config.runtime.shutdown_grace_s
        try:
            await pause_reading(self._tasks, self._log)
            try:
                # asyncio.timeout, not wait_for: Python 3.11's wait_for can lose the cancellation it sends
                # when the coroutine's own inner timeout fires at the same moment, and then waits for a drain
                # that never comes (a stop that hung past its grace period, consumed mode, loaded machine)
                async with asyncio.timeout(grace):
                    await self._flush_and_drain()
            except TimeoutError:
                self.state = RuntimeState.RUNNING  # reading stays paused; force_stop() may follow
                pending = self._pending_events()
                why = "batches not acknowledged yet"
                if self.stats.checkpoint_failing_since is not None:
                    why = f"the checkpoint cannot be saved: {self.stats.checkpoint_error}"
                raise StateError(
                    f"{pending} uncommitted events remain after the {grace:g}s grace period "
                    f"({why}); call force_stop() to drop them, or wait and stop again"
                ) from None
        except asyncio.CancelledError:
            if self.state is RuntimeState.STOPPING:
                self.state = RuntimeState.RUNNING
            raise
        await self._shutdown(graceful=True)

    async def force_stop(self) -> list[ChangeEvent]:
        """Stop at once: drop pending batches (returned); the checkpoint stays at the last acked batch."""
        if self.state is RuntimeState.IDLE:
            self.state = RuntimeState.STOPPED
            return []
        if self.state is RuntimeState.STOPPED:
            return []
        if self.state is RuntimeState.STOPPING:
            raise StateError("runtime is currently stopping")
        self.state = RuntimeState.STOPPING
        await cancel_tasks(self._tasks, self._log)
        dropped: list[Item] = []
        for batch in self._barrier.drop_all():
            dropped.extend(batch.items)
        while not self._handoff.empty():
            dropped.extend(self._handoff.get_nowait().items)
        dropped.extend(self._batcher.items)
        self._batcher.items = []
        events: list[ChangeEvent] = []
        for i in dropped:
            if type(i) is ChangeEvent:
                events.append(i)
            elif type(i) is RowBlock or type(i) is ChangeBlock:
                events.extend(i.events())  # the caller gets rows, however they were read
        self._log.warning("force stop: pending events dropped", dropped_events=len(events),
                          committed_batch=self._barrier.committed_seq)
        await self._shutdown(graceful=False)
        return events

    # -- status -----------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        self._refresh_gauges()
        ckpt: Checkpoint | None = getattr(self._committer, "checkpoint", None)
        return {
            "state": self.state.value,
            "checkpoint_failing": self.stats.checkpoint_failing_since is not None,
            "stats": asdict(self.stats),
            "source": self.source.status(),
            "sink": self.sink.status(),
            "checkpoint": None if ckpt is None else {
                "save_id": ckpt.save_id,
                "saved_at": ckpt.saved_at,
                "batch_seq": ckpt.batch_seq,
                "event_count": ckpt.event_count,
                "position": None if ckpt.position is None else ckpt.position.to_json(),
                "path": str(self.store.current_path),
            },
        }

    def _refresh_gauges(self) -> None:
        if hasattr(self, "_barrier"):
            self.stats.batches_inflight = self._barrier.inflight
            self.stats.queue_size = self._handoff.qsize()

    # -- pipeline tasks -----------------------------------------------------------------

    async def _read(self) -> None:
        retry = source_backoff(self.config, f"reading the {self.source.kind} source")
        reconnect = False
        while True:
            try:
                if reconnect:
                    # Inside the try: a reconnect that fails (server still down) is retried like the error before it.
                    self.source.terminate()
                    committed = self._committer
                    await self.source.connect(ResumePoint(committed.checkpoint.position, dict(committed.source_state)))
                await self._read_stream(retry)
                break
            except SourceError as exc:
                if exc.fatal:
                    raise
                delay = retry.failure(exc)  # raises SourceFatal once runtime.source_retry_timeout_s is spent
                reconnect = True
                self.stats.last_error = str(exc)
                self.stats.source_reconnects += 1
                self._log.warning("source error, reconnecting", error=str(exc), retry_in_s=round(delay, 2),
                                  attempt=retry.attempts, failing_for_s=round(retry.failed_for_s(), 1))
                await asyncio.sleep(delay)
        # The source ended (snapshot.mode = initial_only): land the rest and stop gracefully.
        self._log.info("source stream ended; stopping after the last batch is committed")
        asyncio.get_running_loop().create_task(self._stop_after_end())

    async def _read_stream(self, retry: Backoff) -> None:
        batcher, stats, opened = self._batcher, self.stats, self._batch_opened
        recovering = retry.attempts > 0
        async for item in self.source.stream():
            if recovering:  # the source delivers again: the outage is over
                recovering = False
                retry.success()
                self._log.info("source recovered", reconnects=stats.source_reconnects)
            if isinstance(item, ChangeEvent | RowBlock | ChangeBlock):
                rows = event_count(item)
                if not item.snapshot:
                    skip = self._skip_upto
                    # Positions of one source kind compare; the checkpoint's kind was checked at start.
                    if skip is not None and item.position <= skip:  # type: ignore[operator]
                        stats.events_skipped += rows
                        continue
                    if skip is not None and type(item) is ChangeBlock:
                        # a checkpoint cut inside this transaction: the block's rows up to it are committed
                        kept = item.after(skip)
                        assert kept is not None  # its last row is above ``skip``
                        stats.events_skipped += rows - kept.rows
                        item, rows = kept, kept.rows
                    self._skip_upto = item.position
                stats.events_seen += rows
            rest: Item | None = item
            while rest is not None:
                if not batcher.items:
                    opened.set()  # wake the timer: this batch is due max_batch_delay_ms from now
                rest = batcher.add(rest)  # a block bigger than the room left is split
                if batcher.full:
                    await self._handoff.put(self._seal())

    async def _stop_after_end(self) -> None:
        with contextlib.suppress(StateError):
            await self.stop()

    async def _time(self) -> None:
        held = False  # the last pass found the open batch due but could not seal it
        while True:
            left = self._batcher.time_left()
            if left is None:
                self._batch_opened.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(1.0):
                        await self._batch_opened.wait()
            else:
                # a due batch that cannot be sealed (the hand-over full, or stopping) is looked at again
                # after HELD_POLL_S, not at once: sleep(0) in a loop held a core until the batch could go
                await asyncio.sleep(min(1.0, max(left, HELD_POLL_S if held else 0.0)))
            self.stats.last_tick = time.monotonic()
            if self.on_tick is not None:
                self.on_tick()
            left = self._batcher.time_left()
            # Never block here: the watchdog must keep ticking while backpressure holds the reader.
            due = left is not None and left <= 0
            sealable = not self._handoff.full() and self.state is RuntimeState.RUNNING and "reader" in self._tasks
            if due and sealable:
                self._handoff.put_nowait(self._seal())
            held = due and not sealable

    def _seal(self) -> Batch:
        batch = self._batcher.seal(self._next_seq)
        self._next_seq += 1
        return batch

    # -- helpers -------------------------------------------------------------------------

    def _spawn(self, name: str, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro, name=f"cdcd-{name}")
        self._tasks[name] = task
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None and self.state is not RuntimeState.STOPPED:
            asyncio.get_running_loop().create_task(self._fail(exc))

    async def _fail(self, exc: BaseException) -> None:
        if self.state is RuntimeState.STOPPED:
            return
        self.state = RuntimeState.STOPPING
        self.stats.last_error = str(exc)
        self._log.error("pipeline failed", error=str(exc), fatal=getattr(exc, "fatal", True),
                        error_type=type(exc).__name__)
        await cancel_tasks(self._tasks, self._log)
        await self._shutdown(graceful=False, error=exc)

    async def _flush_and_drain(self) -> None:
        """Hand the open batch to the deliverer, then wait until everything is committed."""
        while self._batcher.items:
            if self._handoff.full():
                await asyncio.sleep(0.05)  # seal only when it can be queued: a cancel never loses a sealed batch
            else:
                self._handoff.put_nowait(self._seal())
        await self._handoff.join()
        while self._barrier.inflight:
            if self._barrier.committable():
                await self._committer.commit()  # a save that fails is retried here each second, and by the timer
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(1.0):  # a stop's grace timeout cancels through it (see stop)
                    await self._barrier.wait_drained()

    def _pending_events(self) -> int:
        queued = sum(b.event_count for b in self._handoff._queue)  # type: ignore[attr-defined]
        return self._barrier.pending_events + queued + self._batcher.events

    async def _shutdown(self, graceful: bool, error: BaseException | None = None) -> None:
        try:
            await cancel_tasks(self._tasks, self._log)
            if graceful:
                await close_source(self.source, self._log)
            else:
                self.source.terminate()
        except BaseException:
            if graceful:  # cancelled (a force-stop request) before the source was closed: abort its connections
                self.source.terminate()
            raise
        finally:
            try:
                async with asyncio.timeout(STOP_STEP_S):
                    await self.sink.close()
            except TimeoutError:
                self._log.error(f"closing the landing sink did not end within {STOP_STEP_S:g}s; stopping without it")
            finally:
                self.store.unlock()
                self.state = RuntimeState.STOPPED
                if self._done is not None and not self._done.done():
                    if error is None:
                        self._done.set_result(None)
                    else:
                        self._done.set_exception(error)
                self._log.info("runtime stopped", graceful=graceful, committed_batch=self._barrier.committed_seq,
                               events_committed=self.stats.events_committed)


#: How often the timer looks again at a batch that is due but cannot be sealed yet.
HELD_POLL_S = 0.01


def _handoff_capacity() -> int:
    """Sealed batches waiting for an in-flight slot: one is enough to keep the sink busy."""
    return 1

