"""The one bounded wait of the tests: poll a predicate until it holds, fail early when a process it waits on
has exited, and say what was awaited (with the log's tail) when it fails."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

WAIT_S = 90.0


def tail(log: Path | None, chars: int = 3000) -> str:
    """The end of ``log`` (empty when there is none yet)."""
    return log.read_text(errors="replace")[-chars:] if log is not None and log.exists() else ""


def wait_for(what: str, predicate: Callable[[], Any], timeout: float = WAIT_S, *,
             procs: subprocess.Popen[Any] | Iterable[subprocess.Popen[Any]] = (), log: Path | None = None,
             step: float = 0.05) -> Any:
    """The predicate's first truthy value within ``timeout`` seconds; an AssertionError naming ``what`` when one
    of ``procs`` exits first or the time is up (with the tail of ``log``)."""
    watched = [procs] if isinstance(procs, subprocess.Popen) else list(procs)
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        for p in watched:
            if p.poll() is not None:
                raise AssertionError(f"{p.args} exited ({p.returncode}) while waiting for {what}:\n{tail(log)}")
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}:\n{tail(log)}")
        time.sleep(step)
