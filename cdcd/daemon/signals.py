"""How ``cdcd run`` hears its signals: on a thread of its own, so that a stop always ends (issue 27).

asyncio's ``loop.add_signal_handler`` runs a handler on the event loop. While synchronous code holds the
loop (a blocking send to a notify socket nobody reads, a write to a stdout nobody reads, a stuck C call) no
handler runs: a second SIGTERM does nothing and the stop never ends. Here CPython's C-level handler writes
the signal's number to a pipe (``signal.set_wakeup_fd``) whatever the main thread is doing; a daemon thread
reads it, hands the signal to the loop (``call_soon_threadsafe``: the daemon's own handlers, as before) and
keeps the deadlines that bound the stop:

* after the first stop signal: ``runtime.shutdown_grace_s`` plus ``STOP_OVERRUN_S``;
* after a force-stop request (a second SIGTERM/SIGINT, or SIGQUIT): ``FORCE_EXIT_S``;
* once the daemon decided its exit code (its work is done): ``TEARDOWN_S`` for what is left, and a stop
  signal from then on exits at once with that code.

When a deadline passes, the thread logs why and writes the stack of every thread to stderr (what a py-spy
dump would show: the call that holds the loop), each within ``_DIAGNOSE_S`` since stdout may be the very thing
that blocks, and ends the process with ``os._exit``: with the decided code, else ``FORCE_STOPPED`` (nothing
more was saved: the checkpoint is at the last saved batch, as after any force-stop).

The Python-level handlers stay installed until the process exits: a late signal never kills it with the
signal's default action instead of the documented exit code.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import faulthandler
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

import structlog

from cdcd.daemon.exitcodes import ExitCode

_log = structlog.get_logger("cdcd.daemon")

#: After the first stop signal the process exits within the grace period plus this, whatever holds it. The
#: steps after the grace period are bounded in the runtime (cancelling tasks, closing the source and the
#: landing sink, a force-stop); this is the backstop for the event loop itself being held.
STOP_OVERRUN_S = 40.0
#: After a force-stop request the process exits within this.
FORCE_EXIT_S = 10.0
#: Once the exit code is decided, closing the HTTP server, the event loop and leftover threads takes at most this.
TEARDOWN_S = 10.0
#: Each diagnostic write before a forced exit waits at most this: stdout may be a pipe nobody reads.
_DIAGNOSE_S = 2.0

STOP = {signal.SIGTERM: "SIGTERM", signal.SIGINT: "SIGINT"}
FORCE = {signal.SIGQUIT: "SIGQUIT"}
RELOAD = {signal.SIGHUP: "SIGHUP"}
_WAKE = 0  # written by ``decided``: not a signal number


def _ignore(signum: int, frame: FrameType | None) -> None:
    """The Python-level handler: the work is done by the thread that reads the wakeup pipe."""


class SignalGuard:
    """Receives SIGTERM, SIGINT, SIGQUIT and SIGHUP for the daemon and bounds the stop they start."""

    def __init__(self, loop: asyncio.AbstractEventLoop, grace_s: float, on_stop: Callable[[str], None],
                 on_force: Callable[[str], None], on_reload: Callable[[], None]) -> None:
        self._loop = loop
        self._grace_s = grace_s
        self._on_stop, self._on_force, self._on_reload = on_stop, on_force, on_reload
        self._lock = threading.Lock()
        self._deadline: float | None = None
        self._why = ""
        self._stops = 0
        self.outcome: int | None = None  # the exit code, once the daemon decided it
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._write_fd, False)  # set_wakeup_fd requires it; a full pipe drops a byte, never blocks
        self._thread = threading.Thread(target=self._watch, name="cdcd-signals", daemon=True)
        self._context = contextvars.copy_context()  # the log context the handlers run in (source, database)

    def install(self) -> None:
        """From the main thread, with the event loop running and the log context bound."""
        self._context = contextvars.copy_context()
        for sig in (*STOP, *FORCE, *RELOAD):
            signal.signal(sig, _ignore)
        signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)
        self._thread.start()

    def decided(self, code: int) -> None:
        """The daemon knows its exit code: what is left of the stop may take ``TEARDOWN_S``."""
        with self._lock:
            self.outcome = int(code)
            self._arm(TEARDOWN_S, f"closing down after the exit code {int(code)} was decided")
        with contextlib.suppress(OSError):
            os.write(self._write_fd, bytes([_WAKE]))

    # -- the thread ------------------------------------------------------------------------

    def _arm(self, within_s: float, why: str) -> None:
        deadline = time.monotonic() + within_s
        if self._deadline is None or deadline < self._deadline:
            self._deadline, self._why = deadline, why

    def _watch(self) -> None:
        while True:
            with self._lock:
                deadline = self._deadline
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select([self._read_fd], [], [], wait)
            if ready:
                for signum in os.read(self._read_fd, 256):
                    self._signal(signum)
            elif deadline is not None and time.monotonic() >= deadline:
                with self._lock:
                    code, why = self.outcome, self._why
                self._exit(ExitCode.FORCE_STOPPED if code is None else code,
                           f"the stop did not end in time ({why}); exiting", stacks=True)

    def _signal(self, signum: int) -> None:
        if signum == _WAKE:
            return
        if signum in RELOAD:
            self._dispatch(self._on_reload)
            return
        name = STOP.get(signum) or FORCE.get(signum) or str(signum)  # type: ignore[call-overload]
        with self._lock:
            code = self.outcome
            if code is None:
                self._stops += 1
                if signum in FORCE or self._stops > 1:
                    self._arm(FORCE_EXIT_S, f"{name} asked for a force-stop {FORCE_EXIT_S:g}s ago")
                else:
                    self._arm(self._grace_s + STOP_OVERRUN_S,
                              f"{name} {self._grace_s + STOP_OVERRUN_S:g}s ago: the {self._grace_s:g}s grace "
                              f"period plus {STOP_OVERRUN_S:g}s")
        if code is not None:  # the work is done: nothing to force, the exit code stands
            self._exit(code, f"{name} after the stop finished its work; exiting now", stacks=False)
        self._dispatch(self._on_force if signum in FORCE else self._on_stop, name)

    def _dispatch(self, fn: Callable[..., None], *args: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args, context=self._context)
        except RuntimeError:  # the loop is closed: the process is exiting, the deadline still holds
            return

    def _exit(self, code: int, message: str, stacks: bool) -> None:
        def diagnose() -> None:
            level = _log.error if stacks else _log.info
            level(message, exit_code=code)
            if stacks:
                faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            for stream in (sys.stdout, sys.stderr):
                stream.flush()

        # Its own thread: a log write can block (a stdout nobody reads), the exit must not wait for it.
        context = self._context.copy()  # not the one the loop's callbacks enter
        writer = threading.Thread(target=context.run, args=(diagnose,), name="cdcd-exit-log", daemon=True)
        writer.start()
        writer.join(_DIAGNOSE_S * (2 if stacks else 1))
        os._exit(code)
