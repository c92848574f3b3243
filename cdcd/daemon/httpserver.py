"""A small asyncio HTTP/1.1 server for /metrics, /healthz, /readyz, /status and the operator's requests.

Enough HTTP for Prometheus, kubelet/compose health checks, curl and the CLI:
GET and HEAD for the read-only endpoints, POST with a JSON object for the
operator's requests (``cdcd snapshot``, ``cdcd tables reload``), one request
per connection (``Connection: close``). POST is answered for loopback
clients carrying the control token only (``Authorization: Bearer``,
``token.py``): a request can make the daemon run SQL on the source. No
framework: the daemon must not grow a web stack for a handful of endpoints.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import ipaddress
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import structlog

from cdcd.daemon.token import authorized
from cdcd.errors import ConfigError

_log = structlog.get_logger("cdcd.http")
_MAX_HEADER_BYTES = 16384
_MAX_BODY_BYTES = 65536
_READ_TIMEOUT_S = 10.0
_REASONS = {200: "OK", 202: "Accepted", 400: "Bad Request", 401: "Unauthorized", 403: "Forbidden", 404: "Not Found",
            405: "Method Not Allowed", 413: "Content Too Large", 503: "Service Unavailable"}


@dataclass(frozen=True, slots=True)
class Response:
    status: int
    body: bytes
    content_type: str = "text/plain; charset=utf-8"

    @classmethod
    def json(cls, status: int, doc: Any) -> Response:
        return cls(status, (json.dumps(doc, default=str, indent=2) + "\n").encode(), "application/json")


Handler = Callable[[], Awaitable[Response] | Response]
#: A POST endpoint: gets the request's JSON object.
PostHandler = Callable[[dict[str, Any]], Awaitable[Response] | Response]


class HttpServer:
    def __init__(self, host: str, port: int, routes: dict[str, Handler],
                 post_routes: dict[str, PostHandler] | None = None, token: str | None = None) -> None:
        self.host, self.port = host, port
        self.routes = routes
        self.post_routes = post_routes or {}
        self._token = token  # what a POST must carry; None: POST endpoints are refused
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        try:
            self._server = await asyncio.start_server(self._serve, self.host, self.port)
        except OSError as exc:
            hint = "another process listens there" if exc.errno == errno.EADDRINUSE else exc.strerror
            raise ConfigError(
                f"http.listen {self.host}:{self.port}: cannot listen ({hint}); "
                "set http.listen to a free address, or to \"\" to turn the HTTP endpoints off"
            ) from exc
        sock = self._server.sockets[0].getsockname()
        self.port = int(sock[1])
        _log.info("http listening", address=f"{self.host}:{self.port}",
                  endpoints=sorted([*self.routes, *self.post_routes]))

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2.0)
            self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), _READ_TIMEOUT_S)
            method, path = _parse_request_line(head)
            if method == "POST":
                response = await self._post(path, head, reader, writer.get_extra_info("peername"))
            else:
                response = await self._dispatch(method, path)
            await _write(writer, response, include_body=method != "HEAD")
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ConnectionError):
            pass  # a client that went away or sent garbage gets nothing more
        except ValueError:
            with contextlib.suppress(ConnectionError):
                await _write(writer, Response(400, b"bad request\n"), include_body=True)
        except Exception as exc:  # an endpoint bug must not take the daemon down
            _log.error("http handler failed", error=str(exc), error_type=type(exc).__name__)
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _dispatch(self, method: str, path: str) -> Response:
        handler = self.routes.get(path.split("?", 1)[0])
        if handler is None:
            if path.split("?", 1)[0] in self.post_routes:
                return Response(405, b"only POST, with a JSON object\n")
            return Response(404, f"not found; endpoints: {', '.join(sorted(self.routes))}\n".encode())
        if method not in ("GET", "HEAD"):
            return Response(405, b"only GET and HEAD\n")
        result = handler()
        return await result if not isinstance(result, Response) else result

    async def _post(self, path: str, head: bytes, reader: asyncio.StreamReader, peer: Any) -> Response:
        handler = self.post_routes.get(path.split("?", 1)[0])
        if handler is None:
            return Response(404 if path.split("?", 1)[0] not in self.routes else 405,
                            f"no POST endpoint {path}; POST endpoints: {', '.join(sorted(self.post_routes))}\n"
                            .encode())
        if not _is_loopback(peer):
            return Response.json(403, {"error": f"{path} is answered for clients on this host only (loopback); "
                                                "run the cdcd command on the daemon's host"})
        if self._token is None or not authorized(_header(head, b"authorization"), self._token):
            return Response.json(401, {"error": f"{path} needs the daemon's control token (Authorization: Bearer); "
                                                "the cdcd commands send it: run them as the daemon's user, or set "
                                                "http.token_file (docs/operations.md, \"Control token\")"})
        length = _content_length(head)
        if length > _MAX_BODY_BYTES:
            return Response.json(413, {"error": f"request body of {length} bytes; at most {_MAX_BODY_BYTES}"})
        body = await asyncio.wait_for(reader.readexactly(length), _READ_TIMEOUT_S) if length else b"{}"
        try:
            doc = json.loads(body)
        except ValueError as exc:
            return Response.json(400, {"error": f"the request body is not JSON: {exc}"})
        if not isinstance(doc, dict):
            return Response.json(400, {"error": "the request body must be a JSON object"})
        result = handler(doc)
        return await result if not isinstance(result, Response) else result


def _is_loopback(peer: Any) -> bool:
    try:
        address = ipaddress.ip_address(str(peer[0]).split("%", 1)[0])
    except (TypeError, IndexError, ValueError):
        return False
    mapped = getattr(address, "ipv4_mapped", None)  # ::ffff:127.0.0.1 on a dual-stack listener
    return bool((mapped or address).is_loopback)


def _header(head: bytes, name: bytes) -> str | None:
    """The value of the request header ``name`` (lower case), or None."""
    for line in head.split(b"\r\n")[1:]:
        key, _, value = line.partition(b":")
        if key.strip().lower() == name:
            return value.strip().decode("latin-1")
    return None


def _content_length(head: bytes) -> int:
    value = _header(head, b"content-length")
    if value is None:
        return 0
    length = int(value)  # ValueError: a 400 answer
    if length < 0:
        raise ValueError("negative Content-Length")
    return length


def _parse_request_line(head: bytes) -> tuple[str, str]:
    if len(head) > _MAX_HEADER_BYTES:
        raise ValueError("request header too large")
    line = head.split(b"\r\n", 1)[0].decode("latin-1")
    parts = line.split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/"):
        raise ValueError(f"malformed request line {line!r}")
    return parts[0], parts[1]


async def _write(writer: asyncio.StreamWriter, response: Response, include_body: bool) -> None:
    reason = _REASONS.get(response.status, "")
    head = (
        f"HTTP/1.1 {response.status} {reason}\r\n"
        f"Content-Type: {response.content_type}\r\n"
        f"Content-Length: {len(response.body)}\r\n"
        "Cache-Control: no-store\r\n"
        "Connection: close\r\n\r\n"
    ).encode()
    writer.write(head + (response.body if include_body else b""))
    await writer.drain()
