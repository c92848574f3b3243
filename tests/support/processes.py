"""Processes still running that mention a directory: what a command left behind."""

from __future__ import annotations

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
