"""The Spark consumer's stop guard (cdcd/spark/stopping.py) in a real process receiving real signals, without Spark:
the first SIGTERM/SIGINT asks for a stop, a second one or the limit force exit 3 after the force steps (ending the
JVM), a signal after the exit code is decided exits with that code; never death by the signal."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

WAIT_S = 60
CHILD = """
import sys, time
from cdcd.spark.stopping import GUARD
assert GUARD.install()
GUARD.limit_s = float(sys.argv[1])
GUARD.on_force(lambda: print("force step ran", flush=True))
print("ready", flush=True)
mode = sys.argv[2]
GUARD.requested.wait()
print("stop requested", flush=True)
if mode == "clean":  # the merge in progress finished, the session and the JVM stopped
    GUARD.decided(0)
    sys.exit(0)
if mode == "teardown":  # the work is done; stopping the session hangs
    GUARD.decided(0)
    print("decided", flush=True)
time.sleep(600)  # a merge (or a teardown) that does not end
"""


class Child:
    def __init__(self, tmp_path: Path, mode: str, limit_s: float = 600) -> None:
        self.out = tmp_path / f"{mode}.log"
        with self.out.open("wb") as f:
            self.proc = subprocess.Popen([sys.executable, "-c", CHILD, str(limit_s), mode], stdout=f,
                                         stderr=subprocess.STDOUT)
        self.wait_for("ready")

    def text(self) -> str:
        return self.out.read_text()

    def wait_for(self, line: str) -> None:
        deadline = time.monotonic() + WAIT_S
        while line not in self.text():
            assert self.proc.poll() is None, f"exited {self.proc.returncode} before {line!r}:\n{self.text()}"
            assert time.monotonic() < deadline, f"no {line!r} within {WAIT_S}s:\n{self.text()}"
            time.sleep(0.01)

    def code(self) -> int:
        try:
            return self.proc.wait(WAIT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            pytest.fail(f"no exit within {WAIT_S}s:\n{self.text()}")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_asks_for_a_stop_and_the_job_exits_with_its_code(tmp_path: Path, sig: int) -> None:
    c = Child(tmp_path, "clean")
    c.proc.send_signal(sig)
    assert c.code() == 0, c.text()
    assert "force step ran" not in c.text()


def test_a_second_signal_abandons_the_merge_exit_3_after_the_force_steps(tmp_path: Path) -> None:
    c = Child(tmp_path, "hang")
    c.proc.send_signal(signal.SIGTERM)
    c.wait_for("stop requested")
    c.proc.send_signal(signal.SIGINT)
    assert c.code() == 3, c.text()
    assert "force step ran" in c.text() and "a second stop signal (SIGINT)" in c.text()


def test_the_stop_timeout_abandons_the_merge_with_exit_3_and_the_threads_stacks(tmp_path: Path) -> None:
    c = Child(tmp_path, "hang", limit_s=0.5)
    c.proc.send_signal(signal.SIGTERM)
    assert c.code() == 3, c.text()
    assert "force step ran" in c.text() and "the stop did not end in time" in c.text()
    assert "Thread 0x" in c.text() or "Current thread" in c.text()  # what held the stop


def test_a_signal_after_the_exit_code_is_decided_exits_with_that_code(tmp_path: Path) -> None:
    c = Child(tmp_path, "teardown")
    c.proc.send_signal(signal.SIGTERM)
    c.wait_for("decided")
    c.proc.send_signal(signal.SIGTERM)
    assert c.code() == 0, c.text()
