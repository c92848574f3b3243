"""Durable file writes shared by the checkpoint store and the landing zone.

Temp file (``.<name>.<pid>.tmp``), fsync, rename, fsync the directory: a crash
leaves the old file or the new one, never half of one.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

TEMP_PREFIX = "."
TEMP_SUFFIX = ".tmp"


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temp_name(final: Path) -> Path:
    """The temporary sibling a durable write goes through; readers ignore it."""
    return final.with_name(f"{TEMP_PREFIX}{final.name}.{os.getpid()}{TEMP_SUFFIX}")


def is_temp(path: Path) -> bool:
    return path.name.startswith(TEMP_PREFIX) and path.name.endswith(TEMP_SUFFIX)


def write_durably(final: Path, data: bytes, sync_dir: bool = True) -> None:
    """Write ``data`` to ``final`` so that a crash leaves the old file or the new one."""
    tmp = temp_name(final)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, final)
    except OSError as exc:
        # A full disk must not keep the half-written temp file: it holds the space the retry needs.
        tmp.unlink(missing_ok=True)
        if exc.filename is None:  # os.write() names no file: name the one being written
            exc.filename = str(final)
        raise
    if sync_dir:
        fsync_dir(final.parent)


def remove_temps(directory: Path) -> list[Path]:
    """Delete temp files a crash left behind; return what was removed."""
    removed = []
    if directory.is_dir():
        for entry in directory.iterdir():
            if entry.is_file() and is_temp(entry):
                entry.unlink(missing_ok=True)
                removed.append(entry)
    return removed


_STORAGE_FIXES = {
    errno.ENOSPC: "the volume is full: free space on it (or move the directory to a larger volume)",
    errno.EDQUOT: "the disk quota is exhausted: free space or raise the quota of the daemon's user",
    errno.EROFS: "the volume is mounted read-only: remount it read-write",
    errno.EIO: "an I/O error: check the disk and the kernel log (dmesg)",
    errno.EACCES: "permission denied: make the directory writable by the daemon's user",
    errno.EPERM: "permission denied: make the directory writable by the daemon's user",
}


def storage_fix(exc: OSError) -> str:
    """What the operator should do about a failed write, by errno."""
    return _STORAGE_FIXES.get(exc.errno or 0, "check the disk, its free space and permissions")
