"""The tests' TCP fault proxy against a local echo server: forward, reset, refuse, blackhole."""

from __future__ import annotations

import socket
import socketserver
import threading
import time
from collections.abc import Iterator

import pytest
from faultproxy import FaultProxy


class _Echo(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        while data := self.request.recv(4096):
            self.request.sendall(data)


@pytest.fixture
def proxy() -> Iterator[FaultProxy]:
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Echo)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    with FaultProxy(server.server_address[1]) as p:
        yield p
    server.shutdown()
    server.server_close()


def _client(p: FaultProxy) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", p.port), timeout=5)
    s.settimeout(5)
    return s


def _echo(s: socket.socket, data: bytes) -> bytes:
    s.sendall(data)
    got = b""
    while len(got) < len(data):
        chunk = s.recv(4096)
        if not chunk:
            break
        got += chunk
    return got


def test_forwards_both_ways(proxy: FaultProxy) -> None:
    with _client(proxy) as s:
        assert _echo(s, b"hello" * 1000) == b"hello" * 1000


def test_reset_sends_rst_to_open_connections(proxy: FaultProxy) -> None:
    s = _client(proxy)
    assert _echo(s, b"x") == b"x"
    assert proxy.reset() == 1
    with pytest.raises(ConnectionResetError):
        s.sendall(b"y")
        s.recv(10)
    s.close()
    with _client(proxy) as s2:  # new connections still work
        assert _echo(s2, b"z") == b"z"


def test_refuse_then_accept_again(proxy: FaultProxy) -> None:
    proxy.refuse(1.0)
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", proxy.port), timeout=5)
    deadline = time.monotonic() + 10
    while True:
        try:
            s = _client(proxy)
            break
        except ConnectionRefusedError:
            assert time.monotonic() < deadline, "the proxy never listened again"
            time.sleep(0.1)
    with s:
        assert _echo(s, b"back") == b"back"


def test_blackhole_silences_open_connections_only(proxy: FaultProxy) -> None:
    s = _client(proxy)
    assert _echo(s, b"a") == b"a"
    assert proxy.blackhole() == 1
    s.settimeout(1.0)
    s.sendall(b"lost")
    with pytest.raises(TimeoutError):
        s.recv(10)  # no data, no FIN, no RST: the socket just stays silent
    with _client(proxy) as s2:
        assert _echo(s2, b"fresh") == b"fresh"
    s.close()
