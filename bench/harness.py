"""Running cdcd and the raw tools, and timing them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

VENV_BIN = Path(sys.executable).parent


@dataclass
class Timed:
    seconds: float
    items: int
    peak_rss_mb: float | None = None

    @property
    def rate(self) -> float:
        return self.items / self.seconds if self.seconds > 0 else float("inf")


def run_timed(cmd: list[str], items: int, env: dict[str, str] | None = None) -> Timed:
    """Run a raw tool to completion and time it."""
    start = time.perf_counter()
    proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd[0]} failed ({proc.returncode}): {proc.stderr.decode(errors='replace')[-2000:]}")
    return Timed(elapsed, items)


def write_config(path: Path, source: dict[str, object], work: Path, **sections: dict[str, object]) -> Path:
    """A cdcd TOML config with state and landing under ``work``."""
    doc: dict[str, dict[str, object]] = {
        "source": source,
        "landing": {"path": str(work / "landing"), "max_batch_events": 50000, "max_batch_delay_ms": 200},
        "state": {"path": str(work / "state")},
        "http": {"listen": ""},
        "log": {"level": "warning", "format": "json"},
    }
    for name, values in sections.items():
        doc.setdefault(name, {}).update(values)
    path.write_text(_toml(doc))
    return path


def _toml(doc: dict[str, dict[str, object]]) -> str:
    lines: list[str] = []

    def section(prefix: str, table: dict[str, object]) -> None:
        scalars = {k: v for k, v in table.items() if not isinstance(v, dict)}
        lines.append(f"[{prefix}]")
        lines.extend(f"{k} = {json.dumps(v)}" for k, v in scalars.items())
        for k, v in table.items():
            if isinstance(v, dict):
                section(f"{prefix}.{k}", v)

    for name, table in doc.items():
        section(name, table)
    return "\n".join(lines) + "\n"


def run_daemon_until(config: Path, work: Path, events: int, exits: bool = False) -> Timed:
    """Start `cdcd run`, time it until ``events`` more events are checkpointed, stop it.

    With ``exits`` (snapshot.mode = initial_only) the daemon must also exit 0 by itself.
    """
    daemon = Daemon(config, work).start()
    try:
        target = daemon.committed_events() + events
        seconds = daemon.wait_committed(target, timeout=1800)
        timed = Timed(seconds, events, daemon.peak_rss_mb())
        if exits:
            daemon.wait_exit(120)
        return timed
    finally:
        daemon.stop()


class Daemon:
    """``cdcd run`` as a real process, watched through its checkpoint file."""

    def __init__(self, config: Path, work: Path) -> None:
        self.config = config
        self.work = work
        self.log = work / "daemon.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_at = 0.0

    def start(self) -> Daemon:
        logf = open(self.log, "ab")  # noqa: SIM115 - owned by the child
        self.started_at = time.perf_counter()
        self.proc = subprocess.Popen([str(VENV_BIN / "cdcd"), "run", "-c", str(self.config)],
                                     stdout=logf, stderr=logf)
        return self

    def committed_events(self) -> int:
        try:
            return int(json.loads((self.work / "state" / "checkpoint.json").read_bytes())["event_count"])
        except (FileNotFoundError, json.JSONDecodeError, KeyError):
            return 0

    def wait_committed(self, events: int, timeout: float) -> float:
        """Seconds from process start until ``events`` events are checkpointed."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.committed_events() >= events:
                return time.perf_counter() - self.started_at
            if self.proc is not None and self.proc.poll() is not None and self.committed_events() < events:
                raise RuntimeError(f"cdcd exited with {self.proc.returncode}; log:\n{self.tail()}")
            time.sleep(0.01)
        raise RuntimeError(f"cdcd committed {self.committed_events()} of {events} events in {timeout}s:\n{self.tail()}")

    def wait_exit(self, timeout: float) -> float:
        assert self.proc is not None
        rc = self.proc.wait(timeout)
        if rc != 0:
            raise RuntimeError(f"cdcd exited with {rc}; log:\n{self.tail()}")
        return time.perf_counter() - self.started_at

    def peak_rss_mb(self) -> float | None:
        """The process's high-water RSS (VmHWM) so far."""
        if self.proc is None:
            return None
        try:
            for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
        except FileNotFoundError:
            return None
        return None

    def cpu_seconds(self) -> float:
        """User and system CPU time of the process so far."""
        assert self.proc is not None
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def pause(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.started_at = time.perf_counter()
        os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def tail(self) -> str:
        try:
            return self.log.read_text(errors="replace")[-3000:]
        except FileNotFoundError:
            return ""
