"""What the soak's modules share: the tables, the fault kinds, its error, and its bounded waits."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CDCD = str(Path(sys.executable).with_name("cdcd"))
DB = "soak"
BASE_TABLES = ["t1", "t2"]  # captured from the start
EXTRA_TABLES = ["x1", "x2", "x3"]  # written from the start, captured when the "table-add" fault adds them
INITIAL_ROWS = 1000
GRACE_S = 20.0  # runtime.shutdown_grace_s
FAULT_KINDS = ("daemon-kill", "daemon-term", "consumer-kill", "consumer-term", "net-cut", "net-blackhole",
               "source-restart", "table-add", "table-resync", "disk-full")
# Schema changes are not injected yet: a later issue makes them exact. A fault kind for them goes into
# FAULT_KINDS with its branch in Soak.inject, and the workload's statements must then follow the new columns.


class SoakError(RuntimeError):
    """The soak could not go on (a process or the workload failed in a way it cannot recover from)."""


def say(text: str) -> None:
    print(f"soak: {time.strftime('%H:%M:%S')} {text}", flush=True)


def wait_for(what: str, predicate: Callable[[], bool], timeout: float, step: float = 0.5) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(step)
    raise SoakError(f"timed out after {timeout:g} s waiting for {what}")


def wait_with_progress(what: str, predicate: Callable[[], bool], progress: Callable[[], object], stall: float,
                       cap: float, step: float = 2.0) -> None:
    """Wait for ``predicate`` while ``progress()`` keeps changing: fail when it stands still for ``stall``
    seconds, or after ``cap`` seconds in all (a long soak's backlog takes longer than a short one's)."""
    start = last_change = time.monotonic()
    seen = progress()
    while not predicate():
        now = time.monotonic()
        if now - start > cap:
            raise SoakError(f"timed out after {cap:g} s waiting for {what} (last progress: {seen!r})")
        if now - last_change > stall:
            raise SoakError(f"no progress for {stall:g} s waiting for {what} (stuck at {seen!r})")
        time.sleep(step)
        current = progress()
        if current != seen:
            seen, last_change = current, time.monotonic()
