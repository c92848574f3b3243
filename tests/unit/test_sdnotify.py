"""The sd_notify datagrams, received on a real unix socket standing in for systemd."""

from __future__ import annotations

import os
import socket
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from cdcd.daemon.sdnotify import Notifier


@pytest.fixture
def notify_socket(tmp_path: Path) -> Iterator[tuple[str, socket.socket]]:
    path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(5)
    try:
        yield path, sock
    finally:
        sock.close()


def _fields(data: bytes) -> dict[str, str]:
    return dict(line.split("=", 1) for line in data.decode().splitlines())


def test_ready_status_stopping(notify_socket: tuple[str, socket.socket]) -> None:
    path, sock = notify_socket
    n = Notifier.from_env({"NOTIFY_SOCKET": path})
    assert n.enabled and not n.watchdog_enabled
    assert n.ready("running, streaming")
    assert _fields(sock.recv(4096)) == {"READY": "1", "STATUS": "running, streaming"}
    assert n.status("lag 12 ms")
    assert _fields(sock.recv(4096)) == {"STATUS": "lag 12 ms"}
    assert n.stopping()
    assert _fields(sock.recv(4096))["STOPPING"] == "1"
    n.close()


def test_abstract_namespace_socket() -> None:
    name = f"cdcd-test-{uuid.uuid4().hex}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + name)
    sock.settimeout(5)
    try:
        n = Notifier.from_env({"NOTIFY_SOCKET": "@" + name})
        assert n.ready("up")
        assert _fields(sock.recv(4096))["READY"] == "1"
    finally:
        sock.close()


def test_watchdog_pings_at_half_the_interval(notify_socket: tuple[str, socket.socket]) -> None:
    path, sock = notify_socket
    n = Notifier.from_env({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "3600000000", "WATCHDOG_PID": str(os.getpid())})
    assert n.watchdog_enabled
    assert n.watchdog()  # the first tick pings
    assert _fields(sock.recv(4096)) == {"WATCHDOG": "1"}
    assert not n.watchdog()  # the next tick, well within half an hour, does not


def test_watchdog_for_another_pid_is_ignored(notify_socket: tuple[str, socket.socket]) -> None:
    path, _ = notify_socket
    n = Notifier.from_env({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "1000000", "WATCHDOG_PID": "1"})
    assert not n.watchdog_enabled and not n.watchdog()


def test_without_notify_socket_everything_is_a_no_op() -> None:
    n = Notifier.from_env({"WATCHDOG_USEC": "1000000"})
    assert not n.enabled and not n.ready("x") and not n.stopping() and not n.watchdog()


def test_a_vanished_socket_does_not_raise(tmp_path: Path) -> None:
    n = Notifier.from_env({"NOTIFY_SOCKET": str(tmp_path / "gone.sock")})
    assert not n.ready("x")
    assert not n.status("y")


def _fill(path: str) -> int:
    """Queue datagrams on ``path`` until its queue is full, as a service manager that stopped reading leaves it."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    queued = 0
    with probe:
        while True:
            try:
                probe.sendto(b"PROBE=1", socket.MSG_DONTWAIT, path)
            except BlockingIOError:
                return queued
            queued += 1


def test_a_manager_that_does_not_read_never_blocks_the_sender(notify_socket: tuple[str, socket.socket]) -> None:
    """The event loop sends these and also runs the signal handlers: a blocking send on a full queue made the
    daemon deaf to SIGTERM (issue 27). The message is held and goes out, merged, with the next one."""
    path, sock = notify_socket
    n = Notifier.from_env({"NOTIFY_SOCKET": path})
    assert _fill(path) > 0
    sent: list[bool] = []
    sender = threading.Thread(target=lambda: sent.append(n.ready("running")), daemon=True)
    sender.start()
    sender.join(30)
    try:
        assert not sender.is_alive(), "Notifier.ready() blocked on the full notify socket"
        assert sent == [False]
        assert not n.stopping("stopping: waiting for acks")  # still full: held too
    finally:
        sock.setblocking(False)
        while True:  # what the manager reads once it catches up (also frees a blocked sender)
            try:
                data = sock.recv(4096)
            except BlockingIOError:
                break
            assert _fields(data) == {"PROBE": "1"}
        sock.settimeout(5)
        sender.join(30)
    assert n.status("stopping: 3 events left")
    assert _fields(sock.recv(4096)) == {"READY": "1", "STATUS": "stopping: 3 events left", "STOPPING": "1"}
    assert n.status("stopped")
    assert _fields(sock.recv(4096)) == {"STATUS": "stopped"}
    n.close()
