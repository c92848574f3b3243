"""The bounded steps of a runtime's stop (cdcd/runtime/stopping.py) with real asyncio tasks."""

from __future__ import annotations

import asyncio

import structlog

from cdcd.runtime.stopping import cancel_tasks, pause_reading

log = structlog.get_logger()


async def _reader_that_swallows_one_cancel(hand_over: asyncio.Queue[int], started: asyncio.Event) -> None:
    """A reader whose first cancellation is lost (as Python 3.11's wait_for can lose one in a read with a timeout):
    it reads on and waits on the full hand-over, which nobody empties after a force stop."""
    started.set()
    try:
        await asyncio.sleep(3600)
    except asyncio.CancelledError:
        asyncio.current_task().uncancel()  # type: ignore[union-attr]
    await hand_over.put(1)


async def test_a_cancelled_stop_leaves_the_reader_to_the_force_stop_that_follows() -> None:
    hand_over: asyncio.Queue[int] = asyncio.Queue(maxsize=1)
    hand_over.put_nowait(0)  # full
    started = asyncio.Event()
    reader = asyncio.create_task(_reader_that_swallows_one_cancel(hand_over, started))
    tasks = {"reader": reader}
    await started.wait()
    stopping = asyncio.create_task(pause_reading(tasks, log))
    await asyncio.sleep(0.1)  # the stop waits for the reader, which read on
    stopping.cancel()  # the stop is cancelled (a force stop was asked for)
    await asyncio.gather(stopping, return_exceptions=True)
    assert "reader" not in tasks  # reading stays paused: the timer seals nothing more
    assert tasks.get("reader-cancelled") is reader  # but the reader is not forgotten
    await cancel_tasks(tasks, log)  # the force stop's step
    assert reader.cancelled() and tasks == {}


async def test_a_reader_that_ends_when_cancelled_is_gone_after_the_pause() -> None:
    started = asyncio.Event()

    async def reader_body() -> None:
        started.set()
        await asyncio.sleep(3600)

    tasks = {"reader": asyncio.create_task(reader_body())}
    await started.wait()
    await pause_reading(tasks, log)
    assert tasks == {}
