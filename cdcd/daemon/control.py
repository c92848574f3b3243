"""Talking to a running daemon from the CLI: find it, signal it, ask its status.

The daemon is found through the lock file of its state directory (the pid
of the ``flock`` holder), so ``cdcd stop`` works without a pid file and
cannot signal a stale pid: a process that exited released the lock.
"""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.error
import urllib.request
from typing import Any

import psutil

from cdcd.checkpoint.store import CheckpointStore
from cdcd.config import Config
from cdcd.daemon.token import client_token
from cdcd.errors import ConfigError


def daemon_pid(config: Config) -> int | None:
    """The pid of the daemon holding ``state.path``, or None."""
    pid = CheckpointStore(config.state.path, config.state.keep_checkpoints).holder_pid()
    return pid if pid and pid > 0 else None


def _gone(pid: int) -> bool:
    try:
        return bool(psutil.Process(pid).status() == psutil.STATUS_ZOMBIE)  # exited, not reaped by its parent yet
    except psutil.NoSuchProcess:
        return True


def signal_and_wait(config: Config, sig: signal.Signals, timeout_s: float) -> tuple[int | None, bool]:
    """Send ``sig`` to the daemon and wait for it to release the state directory and exit.

    Returns (pid or None when no daemon runs, whether it exited in time).
    """
    pid = daemon_pid(config)
    if pid is None:
        return None, True
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return pid, True
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if daemon_pid(config) != pid and _gone(pid):
            return pid, True
        time.sleep(0.1)
    return pid, False


def http_base(config: Config) -> str | None:
    if not config.http.enabled:
        return None
    host, port = config.http.host_port
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"  # a wildcard listen address is reachable on loopback
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def fetch_status(config: Config, timeout_s: float = 3.0) -> dict[str, Any] | None:
    """The running daemon's /status document, or None when it cannot be reached."""
    base = http_base(config)
    if base is None:
        return None
    try:
        with urllib.request.urlopen(f"{base}/status", timeout=timeout_s) as resp:
            doc = json.loads(resp.read())
    except (urllib.error.URLError, OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


class Unreachable(Exception):
    """The daemon's HTTP listener did not answer (connection refused, timeout)."""


def post(config: Config, path: str, doc: dict[str, Any], timeout_s: float = 10.0) -> tuple[int, dict[str, Any]]:
    """POST ``doc`` to the running daemon's ``path``: (HTTP status, the answer's JSON object).

    Raises ``Unreachable`` when nothing answers (no daemon, or it listens elsewhere), ``ValueError``
    when ``http.listen`` is off (the requests need the listener), ``ConfigError`` when the control token
    cannot be read.
    """
    base = http_base(config)
    if base is None:
        raise ValueError("http.listen is off")
    try:
        token = client_token(config)
    except ConfigError:
        if daemon_pid(config) is None:  # no daemon wrote one: say that, not that the token is missing
            raise Unreachable(f"no daemon holds {config.state.path}") from None
        raise
    request = urllib.request.Request(f"{base}{path}", data=json.dumps(doc).encode(), method="POST",
                                     headers={"Content-Type": "application/json", "Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            status, body = resp.status, resp.read()
    except urllib.error.HTTPError as exc:  # an answer: the daemon refused the request
        status, body = exc.code, exc.read()
    except (urllib.error.URLError, OSError) as exc:
        raise Unreachable(f"{base}: {getattr(exc, 'reason', exc)}") from exc
    try:
        answer = json.loads(body)
    except ValueError:
        answer = {"error": body.decode(errors="replace").strip()}
    return status, answer if isinstance(answer, dict) else {"answer": answer}
