"""Where and how cdcd connects to PostgreSQL: one place for the source, `cdcd check` and `cdcd verify`.

``connect_params`` turns the config into ``ConnectParams`` (host, port, user,
database, password, TLS per ``source.sslmode``/``source.sslrootcert``,
timeouts); ``ssl_context`` gives libpq's meaning of ``sslmode`` to both the
asyncpg connections (``connect_sql``) and the replication connection
(``wire/replication.py``).
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg

from cdcd.config import Config
from cdcd.errors import SourceFatal, SourceUnavailable, reason
from cdcd.sockets import PG_SERVER_KEEPALIVES, keepalive_transport
from cdcd.sources.postgres.types import SESSION_SETTINGS


@dataclass(frozen=True, slots=True)
class ConnectParams:
    host: str
    port: int
    user: str
    database: str
    password: str | None = field(default=None, repr=False)  # never in a repr, log line or error
    sslmode: str = "prefer"
    sslrootcert: Path | None = None
    connect_timeout_s: float = 10.0
    read_timeout_s: float = 300.0  # a command's answer (runtime.source_read_timeout_s)
    application_name: str = "cdcd"

    @property
    def where(self) -> str:
        return f"postgres://{self.user}@{self.host}:{self.port}/{self.database}"


def ssl_context(sslmode: str, rootcert: Path | None) -> ssl.SSLContext | None:
    """The TLS context for ``sslmode`` with libpq's meaning; None for disable."""
    if sslmode == "disable":
        return None
    if sslmode in ("verify-ca", "verify-full") or (sslmode == "require" and rootcert is not None):
        ctx = ssl.create_default_context(cafile=str(rootcert) if rootcert else None)
        ctx.check_hostname = sslmode == "verify-full"
        return ctx
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


def connect_params(config: Config, application_name: str = "cdcd") -> ConnectParams:
    """The connection parameters of ``source`` in ``config``; ``application_name`` tells the sessions apart
    in ``pg_stat_activity`` (the daemon "cdcd", verify "cdcd-verify")."""
    src = config.source
    return ConnectParams(
        host=src.host, port=src.effective_port, user=src.user, database=src.database, password=src.secret(),
        sslmode=src.sslmode, sslrootcert=src.sslrootcert, connect_timeout_s=src.connect_timeout_s,
        read_timeout_s=config.runtime.source_read_timeout_s, application_name=application_name,
    )


async def connect_sql(params: ConnectParams) -> Any:
    """An asyncpg connection with the session settings the type converters expect."""
    ctx = ssl_context(params.sslmode, params.sslrootcert)
    ssl_arg: Any = params.sslmode if ctx is None or params.sslmode in ("prefer", "require") else ctx
    if params.sslmode == "require" and params.sslrootcert is not None:
        ssl_arg = ctx
    settings = {k: v for k, v in SESSION_SETTINGS.items() if k != "client_encoding"}
    settings["application_name"] = params.application_name
    settings.update(PG_SERVER_KEEPALIVES)
    try:
        # command_timeout bounds every query and every snapshot chunk (runtime.source_read_timeout_s).
        conn = await asyncpg.connect(
            host=params.host, port=params.port, user=params.user, password=params.password,
            database=params.database, ssl=ssl_arg, timeout=params.connect_timeout_s, server_settings=settings,
            command_timeout=params.read_timeout_s,
        )
        keepalive_transport(getattr(conn, "_transport", None))
        return conn
    except (asyncpg.InvalidPasswordError, asyncpg.InvalidAuthorizationSpecificationError) as exc:
        raise SourceFatal(f"{params.where}: authentication failed ({exc}); check source.user and the password") from exc
    except asyncpg.InvalidCatalogNameError as exc:
        raise SourceFatal(f"{params.where}: {exc}; check source.database") from exc
    except (OSError, TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
        raise SourceUnavailable(f"{params.where}: cannot connect: {reason(exc)}; check that the server runs and "
                          "listens") from exc
