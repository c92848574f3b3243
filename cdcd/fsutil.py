"""Durable file writes shared by the checkpoint store and the landing zone.

Temp file (``.<name>.<pid>.tmp``), fsync, rename, fsync the directory: a crash
leaves the old file or the new one, never half of one.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
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


def write_temp(final: Path, data: bytes) -> Path:
    """Write ``data`` to ``final``'s temp sibling without fsync; return the temp path.

    For writers that fsync several files at once (``fsync_files``) before renaming them. A failed
    write removes the temp file: on a full disk it holds the space the retry needs.
    """
    tmp = temp_name(final)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        if exc.filename is None:
            exc.filename = str(final)
        raise
    return tmp


def _fsync_file(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        if exc.filename is None:
            exc.filename = str(path)
        raise


#: fsync releases the GIL and the kernel may serve concurrent fsyncs of one file system with one journal
#: commit: several files synced at once cost about one fsync's wait instead of one each.
_SYNC_POOL = ThreadPoolExecutor(max_workers=4, thread_name_prefix="cdcd-fsync")


def fsync_files(paths: Sequence[Path]) -> None:
    """fsync every file in ``paths``, in parallel; return once all are durable, raise the first error."""
    if len(paths) == 1:
        _fsync_file(paths[0])
        return
    futures = [_SYNC_POOL.submit(_fsync_file, p) for p in paths]
    errors = [f.exception() for f in futures]  # wait for every one: none may still run when the caller renames
    for exc in errors:
        if exc is not None:
            raise exc


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
