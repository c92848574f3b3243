"""Where and how cdcd connects to MySQL/MariaDB: one place for the source, `cdcd check` and `cdcd verify`.

``connect_params`` turns the config into ``ConnectParams``: the address, the
credentials, the timeouts and the TLS policy (``tls.py``, per
``source.sslmode``/``source.sslrootcert``, built on first use so that a bad
``sslrootcert`` is a connect error). ``open_connection`` opens the sessions
every reader uses (UTC, REPEATABLE READ); the binlog dump takes
``binlog_settings``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiomysql

from cdcd.config import Config
from cdcd.errors import SourceError, SourceUnavailable, reason
from cdcd.sockets import keepalive_transport
from cdcd.sources.mysql.failures import TRANSIENT_CODES, code_of
from cdcd.sources.mysql.tls import Tls, TlsError


@dataclass(frozen=True)
class ConnectParams:
    """One MySQL/MariaDB server as cdcd reaches it."""

    host: str
    port: int
    user: str
    password: str = field(default="", repr=False)  # never in a repr, log line or error
    connect_timeout: int = 10
    sslmode: str = "prefer"
    sslrootcert: Path | None = None

    @functools.cached_property
    def tls(self) -> Tls:
        """The TLS policy of every connection (raises ``TlsError`` for a bad mode or sslrootcert)."""
        return Tls.build(self.sslmode, self.sslrootcert, self.host, self.port)

    @property
    def where(self) -> str:
        return f"{self.host}:{self.port}"

    def settings(self) -> dict[str, Any]:
        """aiomysql/PyMySQL connection keywords (without TLS: ``tls`` decides that)."""
        return {"host": self.host, "port": self.port, "user": self.user, "password": self.password,
                "charset": "utf8mb4", "connect_timeout": self.connect_timeout}

    def binlog_settings(self, stall_s: float) -> dict[str, Any]:
        """The binlog dump's keywords: its read timeout is the stall detector (the server sends a heartbeat
        every few seconds when idle)."""
        return {**self.settings(), "read_timeout": stall_s, "write_timeout": stall_s}

    async def open(self) -> aiomysql.Connection:
        """A session for queries and snapshots (``open_connection``)."""
        return await open_connection(self.settings(), self.tls)


def connect_params(config: Config) -> ConnectParams:
    """The connection parameters of ``source`` in ``config``."""
    src = config.source
    return ConnectParams(host=src.host, port=src.effective_port, user=src.user, password=src.secret() or "",
                         connect_timeout=int(src.connect_timeout_s), sslmode=src.sslmode, sslrootcert=src.sslrootcert)


async def open_connection(settings: dict[str, Any], tls: Tls | None = None) -> aiomysql.Connection:
    """A session for queries and snapshots (UTC, REPEATABLE READ), encrypted per ``tls`` (plain without)."""
    if tls is None:
        tls = Tls.build("disable", None, settings["host"], settings["port"])
    try:
        conn = await tls.connect(**settings, autocommit=True)
    except TlsError:
        raise
    except Exception as exc:
        tls_exc = tls.explain(exc)
        if tls_exc is not None:
            raise tls_exc from exc
        code = code_of(exc)
        # refused, reset or silent (2000-2999, the client's codes; or a server restarting): it may come back
        cls = SourceUnavailable if code is None or 2000 <= code < 3000 or code in TRANSIENT_CODES else SourceError
        raise cls(f"cannot connect to {settings['host']}:{settings['port']}: {reason(exc)}") from exc
    keepalive_transport(getattr(getattr(conn, "_writer", None), "transport", None))
    async with conn.cursor() as cur:
        await cur.execute("SET SESSION time_zone = '+00:00'")
        await cur.execute("SET SESSION TRANSACTION ISOLATION LEVEL REPEATABLE READ")
    return conn
