"""The control token: what a request that changes the daemon's state (``POST /snapshot``,
``POST /tables/reload``) must carry, as ``Authorization: Bearer <token>``.

The token comes from ``http.token_file`` when that is set (a secret the operator manages), else the
daemon makes a new random one at every start and writes it to ``<state.path>/http-token``, readable by
the daemon's user only: whoever may read the daemon's state directory may ask it to act, as with a unix
socket's file permissions. When the state volume cannot take the new token (full, read-only), the daemon
keeps the one its previous start wrote, so a full disk is reported by the checkpoint's health, as every
other save failure, rather than refusing the start.
``/metrics``, ``/healthz``, ``/readyz`` and ``/status`` need no token.
The token never appears in a log line, an error or ``/status``.
"""

from __future__ import annotations

import hmac
import os
import secrets
from pathlib import Path

import structlog

from cdcd.config import Config
from cdcd.errors import CheckpointError, ConfigError
from cdcd.fsutil import storage_fix

STATE_TOKEN = "http-token"

_log = structlog.get_logger("cdcd.daemon")


def _state_token_path(config: Config) -> Path:
    return config.state.path / STATE_TOKEN


def _read(path: Path, key: str, fix: str) -> str:
    try:
        token = path.read_text().strip()
    except OSError as exc:
        raise ConfigError(f"{key}: cannot read the control token {path}: {exc.strerror}; {fix}") from exc
    if not token:
        raise ConfigError(f"{key}: the control token file {path} is empty; put a random string in it")
    return token


def daemon_token(config: Config) -> str:
    """The token the running daemon accepts (called once at start, with the state directory locked)."""
    if config.http.token_file is not None:
        return _read(config.http.token_file, "http.token_file", "check the path and that the daemon's user may "
                     "read it")
    token = secrets.token_urlsafe(32)
    path = _state_token_path(config)
    temp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, f"{token}\n".encode())
        finally:
            os.close(fd)
        os.replace(temp, path)
    except OSError as exc:
        temp.unlink(missing_ok=True)
        problem = f"cannot write the control token {path}: {exc.strerror or exc}; {storage_fix(exc)}"
        previous = _previous_token(path)
        if previous is None:
            raise CheckpointError(f"state directory {path.parent}: {problem}") from exc
        _log.warning("control token kept from the previous start", path=str(path), problem=problem)
        return previous
    return token


def _previous_token(path: Path) -> str | None:
    """The token an earlier start wrote, if it is still there, non-empty and private to the daemon's user."""
    try:
        if path.stat().st_mode & 0o077:
            return None
        return path.read_text().strip() or None
    except OSError:
        return None


def client_token(config: Config) -> str:
    """The token a ``cdcd`` command sends to the daemon of ``config``."""
    if config.http.token_file is not None:
        return _read(config.http.token_file, "http.token_file", "run the command as a user who may read it")
    return _read(_state_token_path(config), "state.path", "run the command as the daemon's user (the token the "
                 "daemon wrote at its start is readable by that user only), or set http.token_file for both")


def authorized(header: str | None, token: str) -> bool:
    """Whether an ``Authorization`` header carries ``token`` (compared in constant time)."""
    if header is None or not header.startswith("Bearer "):
        return False
    return hmac.compare_digest(header[len("Bearer "):].strip().encode(), token.encode())
