"""A TCP proxy for fault tests: forwards 127.0.0.1:port to a real server and injects network faults.

* ``reset()``: every open connection is aborted with a TCP RST, on both sides;
* ``refuse(seconds)``: stop listening, so new connections are refused, for that long;
* ``blackhole()``: every open connection goes silent in both directions, with no FIN and no RST, as after
  a NAT or firewall lost its state; connections opened later work normally.

The proxy runs its own asyncio loop in a daemon thread, so synchronous tests drive it.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import threading
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")
_CHUNK = 1 << 16


@dataclass(eq=False)
class _Pair:
    client: asyncio.StreamWriter
    upstream: asyncio.StreamWriter
    blackholed: bool = False


def _rst(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    with contextlib.suppress(OSError):
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


class FaultProxy:
    def __init__(self, target_port: int, target_host: str = "127.0.0.1") -> None:
        self.target = (target_host, target_port)
        self.port = 0
        self.accepted = 0
        self._pairs: set[_Pair] = set()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="faultproxy", daemon=True)
        self._server: asyncio.Server | None = None
        self._reopen: asyncio.TimerHandle | None = None

    # ------------------------------------------------------------ control (any thread)

    def start(self) -> FaultProxy:
        self._thread.start()
        self._call(self._listen())
        return self

    def reset(self) -> int:
        """RST every open connection (both sides); returns how many were reset."""
        return self._call(self._reset())

    def refuse(self, seconds: float) -> None:
        """Refuse new connections for ``seconds`` (the listening socket is closed, then reopened)."""
        self._call(self._refuse(seconds))

    def blackhole(self) -> int:
        """Silence every open connection for good; returns how many. New connections still work."""
        return self._call(self._blackhole())

    @property
    def open_connections(self) -> int:
        return len(self._pairs)

    def close(self) -> None:
        if not self._thread.is_alive():
            return
        with contextlib.suppress(Exception):
            self._call(self._close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(30)

    # ------------------------------------------------------------ the loop's side

    async def _listen(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", self.port, reuse_address=True)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await self._serve(reader, writer)
        except asyncio.CancelledError:
            # the proxy closes (``_close``): end normally, or the stream server's done-callback (Python 3.11)
            # logs the cancellation as an error with a traceback
            return

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            _rst(writer)
            return
        pair = _Pair(writer, up_writer)
        self._pairs.add(pair)
        await asyncio.gather(self._pump(pair, reader, up_writer), self._pump(pair, up_reader, writer),
                             return_exceptions=True)

    async def _pump(self, pair: _Pair, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        try:
            while True:
                data = await src.read(_CHUNK)
                if pair.blackholed:
                    if not data:
                        return  # a silenced path tells the other side nothing, not even the close
                    continue  # dropped on the floor, like packets to a lost NAT entry
                if not data:
                    break
                dst.write(data)
                await dst.drain()
        except (OSError, asyncio.IncompleteReadError):
            pass
        if not pair.blackholed:  # one side ended: end the other (a FIN, or the RST we got)
            self._pairs.discard(pair)
            for w in (pair.client, pair.upstream):
                w.transport.abort()

    async def _reset(self) -> int:
        pairs, self._pairs = list(self._pairs), set()
        for pair in pairs:
            pair.blackholed = True  # the pumps must not touch the aborted writers again
            _rst(pair.client)
            _rst(pair.upstream)
        return len(pairs)

    async def _refuse(self, seconds: float) -> None:
        if self._reopen is not None:
            self._reopen.cancel()
        if self._server is not None:
            self._server.close()  # stops listening at once; the open connections are not touched
            self._server = None

        def reopen() -> None:
            self._reopen = None
            self._loop.create_task(self._listen())

        self._reopen = self._loop.call_later(seconds, reopen)

    async def _blackhole(self) -> int:
        for pair in self._pairs:
            pair.blackholed = True
        return len(self._pairs)

    async def _close(self) -> None:
        if self._reopen is not None:
            self._reopen.cancel()
        if self._server is not None:
            self._server.close()
        for pair in list(self._pairs):
            for w in (pair.client, pair.upstream):
                w.transport.abort()
        self._pairs.clear()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:  # the pumps of silenced connections wait for ever: end them with the loop
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
