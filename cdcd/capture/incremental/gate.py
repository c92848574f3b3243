"""The pause of the incremental snapshots: the chunk task waits here between chunks while it is closed.

Closed while the source's retention budget runs low (``cdcd.capture.retention``): a chunk read adds load on the
source and holds the stream's delivery of the chunk's rows, and the slot (or the checkpoint's binlog file) must be
released first. A chunk already read still goes out; the next one waits until the gate opens again.
"""

from __future__ import annotations

import asyncio


class Gate:
    """Open (no reason) or closed (with the reason /status shows)."""

    def __init__(self) -> None:
        self.reason: str | None = None
        self._open = asyncio.Event()
        self._open.set()

    def close(self, reason: str) -> None:
        self.reason = reason
        self._open.clear()

    def open(self) -> None:
        self.reason = None
        self._open.set()

    async def wait(self, most_s: float) -> bool:
        """Wait until the gate is open, at most ``most_s``; whether it is."""
        try:
            await asyncio.wait_for(self._open.wait(), most_s)
        except TimeoutError:
            return False
        return True
