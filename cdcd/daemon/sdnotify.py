"""The systemd notification protocol (sd_notify(3)), implemented directly.

A datagram of ``KEY=VALUE`` lines to the unix socket named by
``NOTIFY_SOCKET`` (a leading ``@`` means the abstract namespace). Without
that variable every call is a no-op, so the daemon behaves the same outside
systemd. ``WATCHDOG=1`` is rate-limited to half the ``WATCHDOG_USEC``
interval, as systemd recommends.

Sending never blocks: the event loop that sends also runs the signal
handlers. A blocking ``sendto`` waits as soon as the manager's socket holds
``net.unix.max_dgram_qlen`` unread datagrams (10 by default; PID 1 under
load, a supervisor that stopped reading), and a daemon waiting there heard
no SIGTERM any more (issue 27). A message that cannot go at once is held,
merged with the next one (``READY=1`` and ``STOPPING=1`` are kept, the
newest ``STATUS=`` wins) and sent with it.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Mapping

import structlog

_log = structlog.get_logger("cdcd.sdnotify")


class Notifier:
    def __init__(self, address: str | None, watchdog_usec: int | None = None) -> None:
        self.address = address
        self.watchdog_interval_s = watchdog_usec / 1e6 if watchdog_usec else None
        self._last_ping: float | None = None
        self._sock: socket.socket | None = None
        self._warned = False
        self._held: dict[str, str | int] = {}  # fields that could not be sent yet (the manager's queue was full)
        self._warned_full = False

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Notifier:
        env = os.environ if env is None else env
        address = env.get("NOTIFY_SOCKET") or None
        usec: int | None = None
        raw = env.get("WATCHDOG_USEC", "")
        pid = env.get("WATCHDOG_PID", "")
        # WATCHDOG_PID names the process that must ping; another one (a child) must not.
        if raw.isdigit() and int(raw) > 0 and (not pid or pid == str(os.getpid())):
            usec = int(raw)
        return cls(address, usec)

    @property
    def enabled(self) -> bool:
        return self.address is not None

    @property
    def watchdog_enabled(self) -> bool:
        return self.enabled and self.watchdog_interval_s is not None

    def notify(self, **fields: str | int) -> bool:
        """Send one message; ``notify(READY=1, STATUS="...")``. Returns whether it was sent.

        Never blocks: when the manager's queue is full the fields are held and go out with the next call."""
        if self.address is None:
            return False
        fields = {**self._held, **fields}
        message = "\n".join(f"{key}={value}" for key, value in fields.items()).encode()
        target = "\0" + self.address[1:] if self.address.startswith("@") else self.address
        try:
            if self._sock is None:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                sock.setblocking(False)
                self._sock = sock
            self._sock.sendto(message, target)
        except BlockingIOError:
            self._held = fields
            if not self._warned_full:  # once per episode: the next tick would repeat it every second
                _log.warning("sd_notify: the service manager is not reading its notify socket (its queue is "
                             "full); the message is held and sent with the next one", socket=self.address,
                             held=sorted(fields))
                self._warned_full = True
            return False
        except OSError as exc:
            if not self._warned:  # the service manager went away: say so once, not on every tick
                _log.warning("sd_notify failed", socket=self.address, error=str(exc))
                self._warned = True
            return False
        if self._warned_full:
            _log.info("sd_notify: the service manager reads its notify socket again; held messages sent",
                      socket=self.address)
        self._held, self._warned_full = {}, False
        return True

    def ready(self, status: str) -> bool:
        return self.notify(READY=1, STATUS=status)

    def status(self, status: str) -> bool:
        return self.notify(STATUS=status)

    def stopping(self, status: str = "stopping") -> bool:
        return self.notify(STOPPING=1, STATUS=status)

    def watchdog(self) -> bool:
        """Ping the watchdog if it is due (called from every pipeline tick)."""
        if not self.watchdog_enabled or self.watchdog_interval_s is None:
            return False
        now = time.monotonic()
        if self._last_ping is not None and now - self._last_ping < self.watchdog_interval_s / 2:
            return False
        self._last_ping = now
        return self.notify(WATCHDOG=1)

    def close(self) -> None:
        if self._held:
            self.notify()  # one last try, still without blocking: STOPPING=1 may be among them
        if self._sock is not None:
            self._sock.close()
            self._sock = None
