"""TCP keepalives for every source connection, so a peer that vanished is noticed by the kernel.

An idle connection to a crashed host or through a NAT/firewall that dropped
its state would otherwise wait for ever; with these settings the kernel gives
up after about ``KEEPALIVE_IDLE_S + KEEPALIVE_COUNT * KEEPALIVE_INTERVAL_S``
(60 s) of silence from the peer. A path that still acknowledges TCP but no
longer delivers data is the stall detectors' job (docs/operations.md).
"""

from __future__ import annotations

import contextlib
import socket
from typing import Any

KEEPALIVE_IDLE_S = 30
KEEPALIVE_INTERVAL_S = 10
KEEPALIVE_COUNT = 3


def keepalive(sock: Any) -> None:
    """Turn keepalives on with cdcd's timings (where the platform has the options)."""
    if sock is None:
        return
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for name, value in (("TCP_KEEPIDLE", KEEPALIVE_IDLE_S), ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
                            ("TCP_KEEPCNT", KEEPALIVE_COUNT)):
            opt = getattr(socket, name, None)
            if opt is not None:
                sock.setsockopt(socket.IPPROTO_TCP, opt, value)


def keepalive_transport(transport: Any) -> None:
    """``keepalive`` for an asyncio transport's socket (TLS transports included)."""
    if transport is None:
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        keepalive(sock)  # asyncio hands out a TransportSocket: setsockopt passes through


#: libpq-style server-side keepalives (the server probes us too and ends a backend whose client vanished).
PG_SERVER_KEEPALIVES = {
    "tcp_keepalives_idle": str(KEEPALIVE_IDLE_S),
    "tcp_keepalives_interval": str(KEEPALIVE_INTERVAL_S),
    "tcp_keepalives_count": str(KEEPALIVE_COUNT),
}
