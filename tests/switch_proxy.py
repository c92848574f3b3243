"""A TCP forwarder on 127.0.0.1 whose target can be switched: "the same address" across a failover.

``switch(port)`` points new connections at another server and cuts the open ones, as a virtual IP or a
proxy does when the primary changes.
"""

from __future__ import annotations

import contextlib
import socket
import threading


class SwitchProxy:
    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        self.port = int(self._listener.getsockname()[1])
        self._lock = threading.Lock()
        self._open: list[socket.socket] = []
        self._closed = False
        threading.Thread(target=self._accept, name="switch-proxy", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port), timeout=5)
                upstream.settimeout(None)
            except OSError:
                client.close()  # the target is down: the client sees the connection closed
                continue
            with self._lock:
                self._open += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                s.close()

    def switch(self, target_port: int) -> None:
        """New connections go to ``target_port``; open ones are cut."""
        self.target_port = target_port
        with self._lock:
            conns, self._open = self._open, []
        for s in conns:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        self.switch(self.target_port)
