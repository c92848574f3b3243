"""The control token the daemon writes at start: new at each start, private, and kept from the previous start
when the state volume is full (a full disk is the checkpoint's health to report, not a refused start)."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from cdcd.config import Config, parse_config
from cdcd.daemon.token import client_token, daemon_token
from cdcd.errors import CheckpointError


@pytest.fixture
def state(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "state"
    path.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(path)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs at {path} (needs root or CAP_SYS_ADMIN): {done.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


def _config(state: Path) -> Config:
    return parse_config({"source": {"kind": "postgres", "user": "cdc", "database": "app", "tables": ["public.t"]},
                         "state": {"path": str(state)}}, env={})


def _fill(path: Path) -> None:
    fd = os.open(path / "filler", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        for size in (4096, 1):
            with contextlib.suppress(OSError):
                while True:
                    os.write(fd, b"\0" * size)
    finally:
        os.close(fd)


def test_each_start_writes_a_new_private_token_the_commands_read(state: Path) -> None:
    config = _config(state)
    first = daemon_token(config)
    assert (state / "http-token").stat().st_mode & 0o777 == 0o600
    assert client_token(config) == first
    second = daemon_token(config)
    assert second != first and client_token(config) == second


def test_a_full_state_volume_keeps_the_previous_token(state: Path) -> None:
    config = _config(state)
    previous = daemon_token(config)
    _fill(state)
    assert daemon_token(config) == previous
    assert client_token(config) == previous
    assert [p.name for p in state.iterdir() if p.name.startswith(".")] == [], "a temporary token file was left"


def test_a_full_state_volume_without_a_previous_token_refuses_the_start_with_the_fix(state: Path) -> None:
    _fill(state)
    with pytest.raises(CheckpointError, match=r"cannot write the control token .*No space left.*free space"):
        daemon_token(_config(state))


def test_a_token_readable_by_others_is_not_kept(state: Path) -> None:
    config = _config(state)
    daemon_token(config)
    (state / "http-token").chmod(0o644)
    _fill(state)
    with pytest.raises(CheckpointError, match="cannot write the control token"):
        daemon_token(config)
