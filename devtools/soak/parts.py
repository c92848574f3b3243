"""The soak's parts that hold no fault logic: a cdcd process it starts and restarts, and the landing zone's own
disk (a tmpfs, so that a fault can fill it)."""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from devtools.soak.common import ROOT


@dataclass
class Proc:
    """`cdcd run` or `cdcd spark run` as a real process; every start appends to one log file."""

    name: str
    argv: list[str]
    log: Path
    proc: subprocess.Popen[bytes] | None = None
    starts: int = 0
    down_on_purpose: bool = False

    def start(self) -> None:
        self.starts += 1
        with open(self.log, "ab") as f:
            f.write(f"\n===== soak: start {self.starts} of {self.name} at {time.strftime('%H:%M:%S')} =====\n"
                    .encode())
            f.flush()
            self.proc = subprocess.Popen(self.argv, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)
        self.down_on_purpose = False

    def last_error(self) -> str:
        """The last error line this process logged (since its last start), for a note: the work directory of a
        passing soak is removed, its logs with it."""
        try:
            text = self.log.read_text(errors="replace").rsplit("===== soak: start", 1)[-1]
        except OSError:
            return ""
        errors = [line for line in text.splitlines() if '"level": "error"' in line]
        return f" (last error: {errors[-1][:600]})" if errors else " (no error logged)"

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, sig: int, timeout: float) -> int | None:
        """Send ``sig`` and wait up to ``timeout``: the exit code, or None if it hung (then it is SIGKILLed)."""
        assert self.proc is not None
        self.down_on_purpose = True
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(30)
            return None


class LandingDisk:
    """A tmpfs mounted on the landing zone, so that "disk-full" can fill it (tests/e2e/test_faults_disk.py)."""

    def __init__(self, landing: Path, minutes: float, notes: list[str]) -> None:
        self.landing, self.minutes, self.notes = landing, minutes, notes
        self.mounted = False

    def mount(self) -> None:
        """Mount it; where that is refused (no root), the soak runs without disk-full faults and says so."""
        self.landing.mkdir(parents=True)
        size_mb = int(min(8192, 512 + self.minutes * 60))
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m,mode=0755", "tmpfs",
                               str(self.landing)], capture_output=True, text=True)
        if done.returncode == 0:
            self.mounted = True
        else:
            self.notes.append(f"no disk-full faults: cannot mount a tmpfs ({done.stderr.strip()})")

    def fill(self) -> None:
        fd = os.open(self.landing / "soak-filler", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for size in (1 << 20, 4096, 1):
                try:
                    while True:
                        os.write(fd, b"\0" * size)
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
        finally:
            os.close(fd)

    def free(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            (self.landing / "soak-filler").unlink()

    def unmount(self) -> None:
        if self.mounted:
            if subprocess.run(["umount", str(self.landing)], capture_output=True).returncode != 0:
                subprocess.run(["umount", "-l", str(self.landing)], check=False)
            self.mounted = False
