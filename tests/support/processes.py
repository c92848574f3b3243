"""Processes still running that mention a directory: what a command left behind."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
import urllib.error
import urllib.request
from pathlib import Path

import psutil


def processes_mentioning(directory: Path) -> list[str]:
    """``pid: command line`` of each process whose command line or working directory names ``directory``."""
    found = []
    for proc in psutil.process_iter(["pid", "cmdline", "cwd"]):
        with_dir = " ".join(proc.info["cmdline"] or []) + " " + (proc.info["cwd"] or "")
        if str(directory) in with_dir:
            found.append(f"{proc.info['pid']}: {' '.join(proc.info['cmdline'] or [])}")
    return found


CDCD = str(Path(sys.executable).with_name("cdcd"))


def spark_consumer(log: Path, env: dict[str, str], *args: str) -> subprocess.Popen[bytes]:
    """``cdcd spark run --log-format json *args`` as a process, its output (both streams) in ``log``."""
    with open(log, "wb") as out:
        return subprocess.Popen([CDCD, "spark", "run", "--log-format", "json", *args], stdout=out,
                                stderr=subprocess.STDOUT, env=env)


def finished(proc: subprocess.Popen[bytes], log: Path, timeout: float) -> tuple[int, str]:
    """The exit code and output of ``proc`` once it ends; killed (and the test failed) past ``timeout``."""
    try:
        proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    return proc.returncode, log.read_text(errors="replace")


def daemon_phase(cfg: Path) -> str | None:
    """The source's phase in the /status of the daemon run with ``cfg`` ("snapshot", "streaming"); None while it
    does not answer yet."""
    listen = tomllib.loads(cfg.read_text())["http"]["listen"]
    try:
        with urllib.request.urlopen(f"http://{listen}/status", timeout=5) as resp:
            phase: str | None = (json.loads(resp.read()).get("source") or {}).get("phase")
            return phase
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return None
