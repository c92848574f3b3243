"""TLS for every MySQL/MariaDB connection, per ``source.sslmode`` (libpq's meaning).

- ``disable``: plain TCP.
- ``prefer``: TLS when the server offers it, else plain; the certificate is not checked.
- ``require``: TLS or fail; the certificate is not checked, except that with
  ``source.sslrootcert`` set it must chain to it (as libpq does).
- ``verify-ca``: TLS; the certificate must chain to ``source.sslrootcert`` (the
  system CAs when unset).
- ``verify-full``: as verify-ca, and the certificate must name ``source.host``.

``ssl_context`` is the pure heart. The MySQL protocol starts TLS inside the
handshake, and only when the server advertises the SSL capability; aiomysql and
PyMySQL would then send an unencrypted "let's do TLS" answer (or, PyMySQL
1.2, fall back to plain), so both connection classes here decide themselves
when they see the server's greeting: encrypt, fall back (prefer) or refuse
with an error that says what to do (the other modes).
"""

from __future__ import annotations

import hashlib
import ssl
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiomysql
import pymysql
from pymysql.constants import CLIENT

from cdcd.errors import SourceFatal

SSLMODES = ("disable", "prefer", "require", "verify-ca", "verify-full")

_HOSTNAME_MISMATCH = (62, 64)  # X509_V_ERR_HOSTNAME_MISMATCH, X509_V_ERR_IP_ADDRESS_MISMATCH


class TlsError(SourceFatal):
    """A TLS problem no retry cures: the message names it, ``fix`` says what to change."""

    def __init__(self, problem: str, fix: str) -> None:
        super().__init__(f"{problem}: {fix}")
        self.problem = problem
        self.fix = fix


def ssl_context(sslmode: str, sslrootcert: Path | None, host: str) -> ssl.SSLContext | None:
    """The TLS context for ``sslmode``; None for disable (plain TCP).

    prefer and require (without sslrootcert) encrypt without checking the certificate; require with
    sslrootcert, verify-ca and verify-full check the chain against sslrootcert (system CAs when unset);
    verify-full also checks that the certificate names ``host``.
    """
    if sslmode not in SSLMODES:
        raise TlsError(f"source.sslmode = {sslmode!r} is not a TLS mode", f"use one of {', '.join(SSLMODES)}")
    if sslmode == "disable":
        return None
    verify = sslmode in ("verify-ca", "verify-full") or (sslmode == "require" and sslrootcert is not None)
    if not verify:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        return ctx
    if sslmode == "verify-full" and not host:
        raise TlsError("source.sslmode = 'verify-full' needs a host name to check the certificate against, but "
                       "source.host is empty", "set source.host to the name in the server's certificate")
    try:
        ctx = ssl.create_default_context(cafile=str(sslrootcert) if sslrootcert is not None else None)
    except (OSError, ssl.SSLError) as exc:
        reason = getattr(exc, "strerror", None) or getattr(exc, "reason", None) or str(exc)
        raise TlsError(f"source.sslrootcert = '{sslrootcert}' cannot be loaded ({reason})",
                       "point it at the PEM file of the CA certificate that signed the server's certificate") from exc
    # Python 3.13 turns on strict X.509 checks that the certificates MySQL generates itself do not pass
    ctx.verify_flags &= ~getattr(ssl, "VERIFY_X509_STRICT", 0)
    ctx.check_hostname = sslmode == "verify-full"
    return ctx


@dataclass(frozen=True)
class Tls:
    """The TLS policy of one source: its mode, context and where it connects (for messages)."""

    sslmode: str
    context: ssl.SSLContext | None
    host: str
    port: int
    sslrootcert: Path | None = None

    @classmethod
    def build(cls, sslmode: str, sslrootcert: Path | None, host: str, port: int) -> Tls:
        return cls(sslmode, ssl_context(sslmode, sslrootcert, host), host, port, sslrootcert)

    @property
    def required(self) -> bool:
        return self.sslmode not in ("disable", "prefer")

    @property
    def where(self) -> str:
        return f"{self.host}:{self.port}"

    def describe(self) -> str:
        """What this mode checks, for `cdcd check`."""
        return {
            "disable": "not requested",
            "prefer": "certificate not verified",
            "require": "certificate verified against source.sslrootcert" if self.sslrootcert is not None
            else "certificate not verified",
            "verify-ca": "certificate verified",
            "verify-full": "certificate and host name verified",
        }[self.sslmode]

    def no_tls_offered(self) -> TlsError:
        return TlsError(
            f"the server at {self.where} does not offer TLS but source.sslmode = '{self.sslmode}'",
            "enable TLS on the server (ssl_cert and ssl_key in my.cnf, then restart it) or set "
            "source.sslmode = 'prefer'",
        )

    def explain(self, exc: BaseException) -> TlsError | None:
        """The TlsError behind a failed connect (a certificate or handshake problem), or None."""
        for e in _chain(exc):
            if isinstance(e, TlsError):
                return e
        for e in _chain(exc):
            if isinstance(e, ssl.SSLCertVerificationError):
                detail = e.verify_message or e.reason or str(e)
                if e.verify_code in _HOSTNAME_MISMATCH:
                    return TlsError(
                        f"the TLS certificate of the server at {self.where} does not name '{self.host}' and "
                        f"source.sslmode = '{self.sslmode}' ({detail})",
                        "set source.host to a name the certificate lists (its subjectAltName), issue the server a "
                        f"certificate for '{self.host}', or set source.sslmode = 'verify-ca'",
                    )
                trusted = f"source.sslrootcert = '{self.sslrootcert}'" if self.sslrootcert is not None \
                    else "the system CAs (source.sslrootcert is not set)"
                return TlsError(
                    f"the TLS certificate of the server at {self.where} is not trusted with source.sslmode = "
                    f"'{self.sslmode}' ({detail}; checked against {trusted})",
                    "set source.sslrootcert to the PEM file of the CA that signed the server's certificate "
                    "(MySQL: ca.pem in its data directory; MariaDB: its ssl_ca)",
                )
        for e in _chain(exc):
            if isinstance(e, ssl.SSLError):
                return TlsError(
                    f"the TLS handshake with the server at {self.where} failed ({e.reason or e}) with "
                    f"source.sslmode = '{self.sslmode}'",
                    "check the server's TLS set-up (ssl_cert, ssl_key, tls_version) and source.sslrootcert",
                )
        return None

    # ------------------------------------------------------------ connections
    async def connect(self, **kwargs: Any) -> aiomysql.Connection:
        """An aiomysql connection (``aiomysql.connect`` arguments) encrypted per the mode."""
        conn = _AioConnection(cdcd_tls=self, **kwargs)
        await conn._connect()
        return conn

    def connect_blocking(self, **kwargs: Any) -> pymysql.connections.Connection:
        """A PyMySQL connection (``pymysql.connect`` arguments) encrypted per the mode; TLS failures raise
        TlsError."""
        if "db" in kwargs:  # pymysqlreplication's name; PyMySQL deprecates it
            kwargs["database"] = kwargs.pop("db")
        try:
            return _PyConnection(cdcd_tls=self, **kwargs)
        except Exception as exc:
            tls_exc = self.explain(exc)
            if tls_exc is None or tls_exc is exc:
                raise
            raise tls_exc from exc

    def for_mysqlclient(self, encrypted: bool, peer_cert: bytes | None = None) -> ClientTls | str:
        """mysqlclient keywords for a connection that joins one this policy opened, never weaker than it;
        ``encrypted``: whether that one runs TLS (prefer decides at the greeting); ``peer_cert``: the DER
        certificate it verified. A str says why no mapping can promise that (the caller keeps the
        aiomysql connection then).

        libmariadb (Connector/C 3.3) verifies the chain whenever it has a CA, and its
        MYSQL_OPT_SSL_VERIFY_SERVER_CERT (mysqlclient's VERIFY_CA and VERIFY_IDENTITY alike) also checks
        the host name: verify-ca and require with sslrootcert map to REQUIRED with the CA, verify-full to
        VERIFY_IDENTITY with the CA (test_mysql_snapshot_bulk_tls.py pins each against a real server).
        Its host name check is looser than Python's (partial wildcards, the CN for an IP address), so
        verify-full also pins the certificate the joined connection verified (libmariadb's ssl-fp).
        """
        if self.host == "localhost":  # libmariadb takes 'localhost' for its Unix socket: another path
            return "source.host = 'localhost' makes libmariadb connect through the Unix socket"
        if not encrypted:
            if self.required:  # cannot happen: the connection it joins would have failed
                raise self.no_tls_offered()
            return ClientTls({"ssl_mode": "DISABLED"}, False, self)
        assert self.context is not None  # encrypted
        if self.context.verify_mode == ssl.CERT_NONE:
            return ClientTls({"ssl_mode": "REQUIRED"}, True, self)
        cas: dict[str, str] = {}
        if self.sslrootcert is not None:
            cas["ca"] = str(self.sslrootcert)
        else:  # the system CAs, where OpenSSL (and so Python's default context) finds them
            paths = ssl.get_default_verify_paths()
            if paths.cafile is not None and Path(paths.cafile).is_file():
                cas["ca"] = paths.cafile
            if paths.capath is not None and Path(paths.capath).is_dir():
                cas["capath"] = paths.capath
            if not cas:
                return "source.sslrootcert is not set and OpenSSL's default CA locations do not exist"
        if not self.context.check_hostname:
            return ClientTls({"ssl_mode": "REQUIRED", "ssl": cas}, True, self)
        if peer_cert is None:
            return "the certificate the snapshot connection verified is not available to pin"
        return ClientTls({"ssl_mode": "VERIFY_IDENTITY", "ssl": cas}, True, self,
                         hashlib.sha1(peer_cert).hexdigest())  # libmariadb 3.3 pins SHA-1 only

    def start_tls(self, server_capabilities: int) -> bool:
        """Whether to start TLS, given the server's capabilities; raises when it must but cannot."""
        if self.context is None:
            return False
        if server_capabilities & CLIENT.SSL:
            return True
        if self.required:
            raise self.no_tls_offered()
        return False


@dataclass(frozen=True)
class ClientTls:
    """A mysqlclient connection's TLS: its connect keywords, whether it must be encrypted, the policy."""

    options: dict[str, Any]
    encrypted: bool
    policy: Tls
    fingerprint: str | None = None  # SHA-1 of the certificate the joined connection verified (verify-full)

    def failed(self, detail: str) -> TlsError:
        """The error for a refused TLS handshake (libmariadb's message ``detail``)."""
        p = self.policy
        trusted = f"source.sslrootcert = '{p.sslrootcert}'" if p.sslrootcert is not None \
            else "the system CAs (source.sslrootcert is not set)"
        checked = "" if p.context is None or p.context.verify_mode == ssl.CERT_NONE else f"; checked against {trusted}"
        return TlsError(
            f"the snapshot's bulk reader (mysqlclient) could not set up TLS with the server at {p.where} with "
            f"source.sslmode = '{p.sslmode}' ({detail}{checked})",
            "set source.sslrootcert to the PEM file of the CA that signed the server's certificate (MariaDB: its "
            "ssl_ca), and with verify-full source.host to a name the certificate lists",
        )


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """The exception, its causes and contexts, and PyMySQL's ``original_exception``."""
    seen: set[int] = set()
    todo: list[BaseException] = [exc]
    while todo:
        e = todo.pop(0)
        if id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        for nxt in (e.__cause__, e.__context__, getattr(e, "original_exception", None)):
            if isinstance(nxt, BaseException):
                todo.append(nxt)


class _AioConnection(aiomysql.Connection):  # type: ignore[misc]
    """aiomysql asks for TLS whenever it has a context, even when the server has none; this decides per
    the mode once the server's greeting is in."""

    def __init__(self, *, cdcd_tls: Tls, **kwargs: Any) -> None:
        self._cdcd_tls = cdcd_tls
        super().__init__(ssl=cdcd_tls.context, **kwargs)

    async def _request_authentication(self) -> None:
        if not self._cdcd_tls.start_tls(self.server_capabilities):
            self._ssl_context = None
            self.client_flag &= ~CLIENT.SSL
        await super()._request_authentication()


class _PyConnection(pymysql.connections.Connection):  # type: ignore[misc]
    """PyMySQL (the binlog stream) with the same decision; without a context it must not fall back to its
    own opportunistic TLS either."""

    def __init__(self, *, cdcd_tls: Tls, **kwargs: Any) -> None:
        self._cdcd_tls = cdcd_tls
        if cdcd_tls.context is None:
            kwargs["ssl_disabled"] = True
        else:
            kwargs["ssl"] = cdcd_tls.context
        super().__init__(**kwargs)

    def _request_authentication(self) -> None:
        if not self._cdcd_tls.start_tls(self.server_capabilities):
            self.ssl = False
            self.client_flag &= ~CLIENT.SSL
        super()._request_authentication()
