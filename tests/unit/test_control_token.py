"""The control token the daemon writes at start: new at each start, private, and kept from the previous start
when the state volume is full (a full disk is the checkpoint's health to report, not a refused start)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from support.disk import fill, tmpfs

from cdcd.config import Config, parse_config
from cdcd.daemon.token import client_token, daemon_token
from cdcd.errors import CheckpointError


@pytest.fixture
def state(tmp_path: Path) -> Iterator[Path]:
    with tmpfs(tmp_path / "state", "64k") as path:
        yield path


def _config(state: Path) -> Config:
    return parse_config({"source": {"kind": "postgres", "user": "cdc", "database": "app", "tables": ["public.t"]},
                         "state": {"path": str(state)}}, env={})


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
    fill(state)
    assert daemon_token(config) == previous
    assert client_token(config) == previous
    assert [p.name for p in state.iterdir() if p.name.startswith(".")] == [], "a temporary token file was left"


def test_a_full_state_volume_without_a_previous_token_refuses_the_start_with_the_fix(state: Path) -> None:
    fill(state)
    with pytest.raises(CheckpointError, match=r"cannot write the control token .*No space left.*free space"):
        daemon_token(_config(state))


def test_a_token_readable_by_others_is_not_kept(state: Path) -> None:
    config = _config(state)
    daemon_token(config)
    (state / "http-token").chmod(0o644)
    fill(state)
    with pytest.raises(CheckpointError, match="cannot write the control token"):
        daemon_token(config)
