"""How the consumer (``cdcd spark run``) hears SIGTERM and SIGINT: a stop always ends, with a documented exit code.

An operator's ``systemctl stop`` / ``docker stop`` sends SIGTERM at any moment: while the process loads pyspark,
while the JVM starts, during the catch-up, in a merge, idle between micro-batches, or while it shuts down.
``GUARD.install()`` runs first thing in the process (``cdcd spark run`` before pyspark is imported): from then on
no stop signal ends the process by the signal's default action (death by SIGTERM, exit status -15/143).

CPython's C-level handler writes the signal's number to a pipe (``signal.set_wakeup_fd``) whatever the main
thread is doing (a py4j call blocked in a socket read, a merge in the JVM), and a thread of its own reads it:

* the first stop signal sets ``requested``: the job lets the merge in progress finish (merges are idempotent and
  ordered: one abandoned half-way is applied again, unchanged, by the next run), starts no other one, stops the
  streaming query, the session and its JVM, and exits 0. That must end within ``limit_s``
  (``--stop-timeout``);
* a second stop signal, or ``limit_s`` passed: the merge in progress is abandoned: the JVM is ended (its stdin
  closed, then SIGKILL) and the process exits ``FORCE_STOPPED`` (3) within ``FORCE_EXIT_S``;
* once the job has decided its exit code (``decided``: its work is done, what is left is stopping the session
  and its JVM), a stop signal ends the JVM and exits with that code at once, and the rest takes at most
  ``TEARDOWN_S``.

The local JVM does not receive the signals itself (``cdcd.spark.session`` starts it with SIGTERM and SIGINT
ignored): a signal sent to the whole process group or control group (a shell's ^C, systemd's
``KillMode=control-group``) reaches the consumer alone, which then ends the JVM in order.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType

from cdcd.daemon.exitcodes import ExitCode
from cdcd.logging import get_logger
from cdcd.spark.args import DEFAULT_STOP_TIMEOUT_S  # the merge in progress, the query's, the session's, the JVM's stop

__all__ = ["DEFAULT_STOP_TIMEOUT_S", "FORCE_EXIT_S", "GUARD", "STOP_SIGNALS", "TEARDOWN_S", "StopGuard"]

#: A forced exit (a second stop signal, the limit) takes at most this: ending the JVM, then exit 3.
FORCE_EXIT_S = 10.0
#: Once the exit code is decided, stopping the session and the JVM takes at most this.
TEARDOWN_S = 30.0
#: How long the forced exit lets the JVM exit on its own (stdin closed) before it is killed.
JVM_EXIT_S = 5.0
#: Each diagnostic write before a forced exit waits at most this: stderr may be a pipe nobody reads.
_DIAGNOSE_S = 2.0

STOP_SIGNALS = {signal.SIGTERM: "SIGTERM", signal.SIGINT: "SIGINT"}
_WAKE = 0  # written by ``decided``: not a signal number

_log = get_logger("cdcd.spark")


def _ignore(signum: int, frame: FrameType | None) -> None:
    """The Python-level handler: the work is done by the thread that reads the wakeup pipe."""


class StopGuard:
    """Receives SIGTERM and SIGINT for the consumer and bounds the stop they start (the module's docstring)."""

    def __init__(self) -> None:
        self.requested = threading.Event()  # a stop signal came: finish the merge in progress, start no other
        self.limit_s = DEFAULT_STOP_TIMEOUT_S
        self.outcome: int | None = None  # the exit code, once the job decided it
        self.forcing: int | None = None  # the code of a forced exit under way
        self.installed = False
        self._lock = threading.Lock()
        self._deadline: float | None = None
        self._why = ""
        self._stops = 0
        self._force_steps: list[Callable[[], None]] = []
        self._read_fd = self._write_fd = -1

    def install(self) -> bool:
        """Take SIGTERM and SIGINT from now on; only the main thread can (else False: nothing done). Idempotent."""
        if self.installed:
            return True
        if threading.current_thread() is not threading.main_thread():
            return False
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._write_fd, False)  # set_wakeup_fd requires it; a full pipe drops a byte, never blocks
        signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)  # first: no signal between the two is lost
        for sig in STOP_SIGNALS:
            signal.signal(sig, _ignore)
        threading.Thread(target=self._watch, name="cdcd-spark-signals", daemon=True).start()
        self.installed = True
        return True

    def on_force(self, step: Callable[[], None]) -> None:
        """Run ``step`` (bounded: ending the JVM) before a forced exit."""
        with self._lock:
            self._force_steps.append(step)

    def hold(self) -> None:
        """Where the job meets a failure: if a forced exit is under way (it ends the JVM under a merge, so the
        merge fails), nothing more is reported or done: this waits for the forced exit to end the process."""
        if self.forcing is None:
            return
        time.sleep(FORCE_EXIT_S)  # the forced exit ends the process within this
        os._exit(self.forcing)

    def decided(self, code: int) -> None:
        """The job knows its exit code: what is left (the session, the JVM) may take ``TEARDOWN_S``, and a stop
        signal from now on exits with this code at once."""
        if not self.installed:
            return
        self.hold()
        with self._lock:
            self.outcome = int(code)
            self._arm(TEARDOWN_S, f"stopping the session and the JVM after the exit code {int(code)} was decided")
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
                           f"the stop did not end in time ({why}): the merge in progress, if any, is abandoned "
                           "(the next run applies it again); exiting", stacks=True)

    def _signal(self, signum: int) -> None:
        if signum not in STOP_SIGNALS:
            return
        name = STOP_SIGNALS[signal.Signals(signum)]
        with self._lock:
            code = self.outcome
            self._stops += 1
            first = self._stops == 1
            if code is None and first:
                self._arm(self.limit_s, f"{name} {self.limit_s:g}s ago (--stop-timeout)")
        if code is not None:  # the work is done: nothing to abandon, the exit code stands
            self._exit(code, f"{name} while stopping the session and the JVM; exiting now", stacks=False)
        if not first:
            self._exit(ExitCode.FORCE_STOPPED, f"a second stop signal ({name}): the merge in progress, if any, is "
                       "abandoned (the next run applies it again); exiting", stacks=False)
        self.requested.set()
        _log.info(f"stop signal ({name}): the merge in progress finishes, then the consumer stops; a second "
                  f"signal or {self.limit_s:g}s (--stop-timeout) abandon it (exit {int(ExitCode.FORCE_STOPPED)})",
                  signal=name)

    def _exit(self, code: int, message: str, stacks: bool) -> None:
        self.forcing = int(code)

        def diagnose() -> None:
            (_log.error if stacks else _log.warning)(message, exit_code=int(code))
            if stacks:  # what held the stop
                faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            for stream in (sys.stdout, sys.stderr):
                stream.flush()

        # Its own thread: a log write can block (a stderr nobody reads), the exit must not wait for it.
        writer = threading.Thread(target=diagnose, name="cdcd-spark-exit-log", daemon=True)
        writer.start()
        writer.join(_DIAGNOSE_S * (2 if stacks else 1))
        with self._lock:
            steps = list(self._force_steps)
        ender = threading.Thread(target=self._force, args=(steps,), name="cdcd-spark-force", daemon=True)
        ender.start()
        ender.join(FORCE_EXIT_S - 2 * _DIAGNOSE_S)
        os._exit(int(code))

    @staticmethod
    def _force(steps: list[Callable[[], None]]) -> None:
        for step in steps:
            try:
                step()
            except Exception as exc:  # the exit goes on: say what was left behind
                _log.error("ending the consumer's JVM failed", error=str(exc), error_type=type(exc).__name__)


#: The process's one guard (signal handlers are per process).
GUARD = StopGuard()
