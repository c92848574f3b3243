"""Which MySQL/MariaDB failures a reconnect may cure, for every connection of the source.

Connection loss, refusal, a server restarting or shutting down, a killed
connection and a timed-out read are transient (``SourceError``: the runtime
reconnects with backoff and resumes from the checkpoint, in the snapshot as in
the stream). Authentication, privileges, a missing table or database, and
errors in cdcd's own SQL are not (``SourceFatal``).
"""

from __future__ import annotations

import asyncio
from typing import NoReturn

import pymysql

from cdcd.errors import SourceError, SourceFatal, SourceUnavailable

#: Server and client error codes that mean the connection or the server went away, or a wait ran out.
TRANSIENT_CODES = frozenset({
    1040,  # too many connections
    1053,  # server shutdown in progress
    1152, 1153, 1154, 1155, 1156, 1157, 1158, 1159, 1160, 1161,  # aborted connection, network read/write errors
    1205, 1213,  # lock wait timeout, deadlock
    1317,  # query execution was interrupted
    1927,  # connection was killed (MariaDB)
    1969,  # query execution was interrupted (max_statement_time)
    2002, 2003, 2005, 2006, 2011, 2012, 2013, 2014, 2026, 2027, 2047, 2048, 2055,  # client: lost, refused, gone
    4031,  # disconnected by the server because of inactivity (MySQL 8)
})

#: Codes no retry can cure: credentials, privileges, unknown database or table.
FATAL_CODES = frozenset({1044, 1045, 1049, 1142, 1143, 1146, 1227, 1236, 1370})


def code_of(exc: BaseException) -> int | None:
    if isinstance(exc, pymysql.err.Error) and exc.args and isinstance(exc.args[0], int):
        return int(exc.args[0])
    return None


def query_error(exc: BaseException, where: str) -> BaseException:
    """The error to raise for a failed query or connection of the source (aiomysql and PyMySQL raise the
    same classes). Exceptions that are not database or network errors are returned unchanged."""
    if isinstance(exc, SourceError):
        return exc
    code = code_of(exc)
    if code is not None:
        msg = exc.args[1] if len(exc.args) > 1 else ""
        if code in FATAL_CODES:
            err: SourceError = SourceFatal(f"{where}: server error {code}: {msg}; check the cdc user's privileges "
                                           "(see `cdcd check`), source.tables and the password")
        elif code in TRANSIENT_CODES or 2000 <= code < 3000 or \
                isinstance(exc, pymysql.err.OperationalError | pymysql.err.InternalError):
            err = SourceUnavailable(f"{where}: connection lost or server unavailable ({code}: {msg}); reconnecting")
        else:
            err = SourceFatal(f"{where}: the server refused cdcd's query ({code}: {msg})")
    elif isinstance(exc, TimeoutError):
        err = SourceUnavailable(f"{where}: no answer within the read timeout (runtime.source_read_timeout_s); the "
                          "connection is taken for dead, reconnecting")
    elif isinstance(exc, pymysql.err.Error | OSError | EOFError | asyncio.IncompleteReadError):
        err = SourceUnavailable(f"{where}: connection lost: {exc!r}; reconnecting")
    else:
        return exc
    err.__cause__ = exc
    return err


def raise_query_error(exc: BaseException, where: str) -> NoReturn:
    """Raise ``query_error(exc, where)`` chained to ``exc``; ``exc`` itself when it is returned unchanged (a
    ``raise query_error(exc) from exc`` would make such an error its own cause)."""
    err = query_error(exc, where)
    if err is exc:
        raise exc
    raise err from exc
