"""The bounded steps of a runtime's stop: the reader paused, the pipeline tasks cancelled, the source closed. A
task that ignores its cancellation, or a source whose close hangs, never holds a stop longer than STOP_STEP_S."""

from __future__ import annotations

import asyncio
from typing import Any

from cdcd.runtime.interfaces import Source

#: The bound of each step of a stop outside the grace period: waiting for cancelled pipeline tasks to end,
#: closing the source (then its connections are aborted), closing the sink. A stop never waits longer on one.
STOP_STEP_S = 10.0


async def pause_reading(tasks: dict[str, asyncio.Task[None]], log: Any) -> None:
    """Cancel the reader (a stop): wait for it at most STOP_STEP_S, then go on without it."""
    reader = tasks.pop("reader", None)
    if reader is None or reader.done():
        return
    reader.cancel()
    # Kept (under another name: the timer seals only while "reader" is there) until it has ended, also when this
    # stop is itself cancelled while waiting: a force stop that follows cancels it again and waits (bounded). A
    # reader dropped here and still running was never ended: it filled the hand-over and waited there for ever.
    tasks["reader-cancelled"] = reader
    await asyncio.wait({reader}, timeout=STOP_STEP_S)  # never swallows a cancel of the stop itself
    if not reader.done():  # stuck in a finally: cancelled again and waited for (bounded) by the runtime's shutdown
        log.error(f"the reader did not stop within {STOP_STEP_S:g}s of being cancelled; the stop "
                  "goes on without it and aborts the source's connections at the end")
        return
    del tasks["reader-cancelled"]
    if not reader.cancelled() and (exc := reader.exception()) is not None:
        raise exc  # as ``await reader`` did: the stop reports how the reader ended


async def cancel_tasks(tasks: dict[str, asyncio.Task[None]], log: Any) -> None:
    """Cancel the pipeline tasks (but the caller's own) and wait for them at most STOP_STEP_S."""
    running = [t for t in tasks.values() if t is not asyncio.current_task()]
    tasks.clear()
    for t in running:
        t.cancel()
    # their errors went to the runtime's _task_done; a task that ignores its cancellation does not hold the stop
    if running:
        await asyncio.wait(running, timeout=STOP_STEP_S)
    stuck = sorted(t.get_name() for t in running if not t.done())
    if stuck:
        log.error(f"pipeline tasks did not end within {STOP_STEP_S:g}s of being cancelled; the stop goes "
                  "on without them", tasks=stuck)


async def close_source(source: Source, log: Any) -> None:
    """``source.close()``, waited for at most STOP_STEP_S; then its connections are aborted."""
    try:
        async with asyncio.timeout(STOP_STEP_S):
            await source.close()
    except TimeoutError:
        log.error(f"closing the source did not end within {STOP_STEP_S:g}s; its connections are aborted "
                  "(the server ends their sessions when it notices)")
        source.terminate()
