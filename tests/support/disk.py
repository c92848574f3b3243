"""Small real volumes for the disk-fault tests: a tmpfs mounted in the test's directory, filled on purpose.

Mounting needs root or CAP_SYS_ADMIN; without it the test is skipped with the reason.
"""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def tmpfs(path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` (``64k``, ``16m``) mounted at ``path`` (made if missing), unmounted afterwards."""
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(path)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs at {path} (needs root or CAP_SYS_ADMIN): {done.stderr.strip()}")
    try:
        yield path
    finally:
        if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], check=True)


def fill(mount: Path, leave: int = 0) -> Path:
    """Take every free byte of ``mount`` with a filler file, then give ``leave`` bytes back: with ``leave=0`` the
    next write there fails with ENOSPC. Returns the filler (unlink it to free the volume)."""
    filler = mount / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for size in (1 << 20, 4096, 1):
            with contextlib.suppress(OSError):
                while True:
                    os.write(fd, b"\0" * size)
        with pytest.raises(OSError) as full:
            os.write(fd, b"\0")
        assert full.value.errno == errno.ENOSPC, full.value
    finally:
        os.close(fd)
    if leave:
        os.truncate(filler, filler.stat().st_size - leave)
    return filler
