"""The MySQL/MariaDB snapshot's bulk reader: mysqlclient (C) in a worker thread, columns cast in Arrow.

The aiomysql reader decodes every value of every row in pure Python (PyMySQL's protocol parser and
converters). Here each snapshot worker has a second connection through mysqlclient (libmariadb, C)
with no converters at all: a streamed result (``SSCursor``, ``mysql_use_result``, the GIL released
while libmariadb reads) gives the raw text of each value, ``str`` for character columns and ``bytes``
for the others. A group of rows becomes Arrow columns with one ``pa.array`` call per column and
Arrow's vectorized casts (integers, floats, decimals, dates, timestamps from their text).

Exact values: whenever a cast refuses a column of a group (a zero date, a value out of range, a type
without a cast such as TIME or BIT), that column of that group is decoded value by value the way
PyMySQL decodes the text protocol (``_pymysql_value``: its per-type decoders, its choice of ``str``
or ``bytes``), then goes through the same ``column_array`` and converters as the aiomysql reader, so
both readers land the same values, warnings and resume keys (the differential test is the judge).

The connection joins the worker's consistent snapshot (``snapshot.begin_consistent`` starts it on
both and checks MariaDB's snapshot position), keeps the session settings of ``open_connection``
(UTC, REPEATABLE READ) and the limits: connect timeout, and ``read_timeout``/``write_timeout`` of
``runtime.source_read_timeout_s`` on every read of the result. TLS: the aiomysql
connection it joins has already decided at the server's greeting (``tls.py``); ``Tls.for_mysqlclient``
turns that decision into mysqlclient's options (TLS on exactly when it is on there, the same CA and host
name check), and ``open`` checks the session really is encrypted (``Ssl_cipher``) before any read.
"""

from __future__ import annotations

import contextlib
import functools
import os
import tempfile
from collections.abc import Iterator, Sequence
from datetime import date
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from pymysql import converters as pymysql_converters
from pymysql.constants import FIELD_TYPE

from cdcd.errors import SourceError, SourceFatal
from cdcd.events import TableSchema
from cdcd.sources.mysql.failures import FATAL_CODES
from cdcd.sources.mysql.rowarrays import column_array, zero_warning
from cdcd.sources.mysql.tls import ClientTls
from cdcd.sources.mysql.types import Converter

#: Field types PyMySQL keeps as bytes when their charset is binary (else decodes with the connection's).
_SSL_CONNECTION_ERROR = 2026  # CR_SSL_CONNECTION_ERROR: the handshake or the certificate check failed

_TEXT_TYPES = {FIELD_TYPE.BIT, FIELD_TYPE.BLOB, FIELD_TYPE.LONG_BLOB, FIELD_TYPE.MEDIUM_BLOB, FIELD_TYPE.STRING,
               FIELD_TYPE.TINY_BLOB, FIELD_TYPE.VAR_STRING, FIELD_TYPE.VARCHAR, FIELD_TYPE.GEOMETRY}


def available() -> bool:
    """Whether mysqlclient is installed (else the snapshot reads through aiomysql)."""
    try:
        import MySQLdb  # noqa: F401
    except ImportError:
        return False
    return True


class BulkConnection:
    """One worker's mysqlclient connection. Blocking: call it from a thread, one call at a time.

    ``tls``: the TLS of the connection it joins, as mysqlclient options (None: plain TCP)."""

    def __init__(self, settings: dict[str, Any], read_timeout_s: float, tls: ClientTls | None = None) -> None:
        self._settings = settings
        self._read_timeout_s = read_timeout_s
        self._tls = tls
        self._conn: Any = None
        self._cursor: Any = None
        self.cipher = ""  # the session's TLS cipher once open ('' when plain)

    @property
    def where(self) -> str:
        return f"{self._settings['host']}:{self._settings['port']}"

    def open(self) -> None:
        import MySQLdb

        s = self._settings
        limit = max(1, round(self._read_timeout_s))
        tls = self._tls.options if self._tls is not None else {"ssl_mode": "DISABLED"}
        try:
            with _pin_file(self._tls.fingerprint if self._tls is not None else None) as pin:
                self._conn = MySQLdb.connect(
                    host=s["host"], port=int(s["port"]), user=s["user"], password=s.get("password") or "",
                    charset="utf8mb4", connect_timeout=int(s.get("connect_timeout", 10)), read_timeout=limit,
                    write_timeout=limit, conv={}, autocommit=True, **tls, **pin)
            cur = self._conn.cursor()
            cur.execute("SHOW SESSION STATUS LIKE 'Ssl_cipher'")
            cipher = _text((cur.fetchone() or (None, None))[1]) or ""
            cur.execute("SET SESSION time_zone = '+00:00'")
            cur.execute("SET SESSION TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            cur.close()
        except MySQLdb.Error as exc:
            self.close()
            code = exc.args[0] if exc.args and isinstance(exc.args[0], int) else None
            if code == _SSL_CONNECTION_ERROR and self._tls is not None and "Fingerprint" in str(exc):
                raise SourceError(f"the snapshot's bulk reader reached a server at {self.where} whose TLS "
                                  "certificate is not the one the snapshot connection verified (replaced in "
                                  f"between, or an interception): {exc}; reconnecting") from exc
            if code == _SSL_CONNECTION_ERROR and self._tls is not None:
                raise self._tls.failed(str(exc.args[1] if len(exc.args) > 1 else exc)) from exc
            raise SourceError(f"cannot connect the snapshot's bulk reader to {self.where}: {exc}") from exc
        if self._tls is not None and self._tls.encrypted and not cipher:
            self.close()  # never read over a weaker connection than the one it joins
            raise self._tls.failed("the session is not encrypted (Ssl_cipher is empty)")
        self.cipher = cipher

    def execute(self, sql: str) -> list[tuple[Any, ...]]:
        """A statement on the connection (the snapshot's BEGIN, status, COMMIT); its rows."""
        import MySQLdb

        try:
            cur = self._conn.cursor()
            cur.execute(sql)
            rows = list(cur.fetchall() or ())
            cur.close()
            return [tuple(_text(v) for v in r) for r in rows]
        except MySQLdb.Error as exc:
            raise self._error(exc) from exc

    def start(self, sql: str, params: Sequence[Any]) -> list[int]:
        """Run a chunk query as a streamed result; returns the field types of its columns."""
        import MySQLdb
        import MySQLdb.cursors

        try:
            self._cursor = self._conn.cursor(MySQLdb.cursors.SSCursor)
            self._cursor.execute(sql, tuple(params) if params else None)
            return [int(d[1]) for d in self._cursor.description]
        except MySQLdb.Error as exc:
            raise self._error(exc) from exc

    def fetch(self, n: int) -> list[tuple[Any, ...]]:
        import MySQLdb

        try:
            return list(self._cursor.fetchmany(n))
        except MySQLdb.Error as exc:
            raise self._error(exc) from exc

    def end_result(self) -> None:
        if self._cursor is not None:
            cursor, self._cursor = self._cursor, None
            cursor.close()

    def _error(self, exc: BaseException) -> SourceError:
        code = exc.args[0] if exc.args and isinstance(exc.args[0], int) else None
        msg = exc.args[1] if len(exc.args) > 1 else str(exc)
        where = f"snapshot on {self.where} (bulk reader)"
        if code in FATAL_CODES:
            return SourceFatal(f"{where}: server error {code}: {msg}; check the cdc user's privileges (see "
                               "`cdcd check`) and source.tables")
        if code is not None and 2000 <= code < 3000:  # client errors: a lost connection, the read timeout
            return SourceError(f"{where}: connection lost or no answer within the read timeout "
                               f"(runtime.source_read_timeout_s) ({code}: {msg}); reconnecting")
        return SourceError(f"{where}: {exc}; reconnecting")

    def close(self) -> None:
        conn, self._conn, self._cursor = self._conn, None, None
        if conn is not None:
            with contextlib.suppress(Exception):  # closing a broken connection: nothing left to save
                conn.close()


@contextlib.contextmanager
def _pin_file(fingerprint: str | None) -> Iterator[dict[str, str]]:
    """libmariadb's certificate pin (``ssl-fp``, which mysqlclient has no keyword for) as an option file
    for ``MySQLdb.connect``'s ``read_default_file``; removed once connected."""
    if fingerprint is None:
        yield {}
        return
    fd, path = tempfile.mkstemp(prefix="cdcd-bulk-tls-", suffix=".cnf")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(f"[client]\nssl-fp={fingerprint}\n")
        yield {"read_default_file": path}
    finally:
        os.unlink(path)


def _text(v: Any) -> Any:
    return v.decode() if isinstance(v, bytes) else v


def _pymysql_value(raw: Any, field_type: int) -> Any:
    """The value PyMySQL gives for this raw text-protocol value (mysqlclient without converters)."""
    if raw is None:
        return None
    if isinstance(raw, bytes):
        if field_type == FIELD_TYPE.JSON:
            raw = raw.decode("utf-8")
        elif field_type not in _TEXT_TYPES:
            raw = raw.decode("ascii")
        # else a binary-charset text type: bytes, as PyMySQL keeps it
    decode = pymysql_converters.decoders.get(field_type)
    if decode is None or decode is pymysql_converters.through:
        return raw
    return decode(raw)


def driver_row(raw: tuple[Any, ...], field_types: Sequence[int]) -> tuple[Any, ...]:
    """A raw row as the aiomysql reader's driver row (for the resume key and zero-date key texts)."""
    return tuple(_pymysql_value(v, t) for v, t in zip(raw, field_types, strict=True))


def _castable(type_: pa.DataType) -> bool:
    """Landed types Arrow casts exactly from MySQL's text of a value."""
    return bool(pa.types.is_integer(type_) or pa.types.is_floating(type_) or pa.types.is_decimal(type_)
                or type_ == pa.date32() or pa.types.is_timestamp(type_))


def _cast_text(raw: pa.Array, type_: pa.DataType) -> pa.Array | None:
    """A column of raw texts (binary) cast in Arrow, or None when Arrow has no exact cast for it."""
    try:
        text = raw.cast(pa.string())
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        return None
    try:
        if pa.types.is_float32(type_):  # read as DOUBLE (col * 1E0): rounded to float32 as pa.array does
            return pc.cast(pc.cast(text, pa.float64()), type_)
        if pa.types.is_timestamp(type_) and type_.tz is not None:
            out = pc.cast(pc.cast(text, pa.timestamp(type_.unit)), type_)  # the session is UTC
        else:
            out = pc.cast(text, type_)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        return None  # a zero date, a value out of range: value by value
    if (type_ == pa.date32() or pa.types.is_timestamp(type_)) and _before_year_1(out):
        return None  # Arrow takes year 0 ('0000-01-01'), which PyMySQL and the binlog give as a zero date
    return out


_YEAR_1_DAYS = (date(1, 1, 1) - date(1970, 1, 1)).days
_YEAR_1_US = _YEAR_1_DAYS * 86_400_000_000


def _before_year_1(values: pa.Array) -> bool:
    """Whether a cast date32 / timestamp[us] column holds a date of year 0 (MySQL stores years 0-9999; Python,
    PyMySQL and the stream have no year 0, so such a value lands as NULL with the zero-date warning)."""
    is_date = pa.types.is_date32(values.type)
    low = pc.min(values.cast(pa.int32() if is_date else pa.int64())).as_py()
    return low is not None and low < (_YEAR_1_DAYS if is_date else _YEAR_1_US)


def _column_kinds(schema: TableSchema, field_types: Sequence[int]) -> list[pa.DataType | None]:
    """Per column, the Arrow type its raw values are taken in by ``_columns`` (None: kept as Python values).

    Character columns landed as text: ``string`` (the driver's str, or UTF-8 bytes for a binary charset);
    columns Arrow casts from their text: ``binary`` (the driver gives bytes); every other column is
    decoded value by value from the raw values."""
    kinds: list[pa.DataType | None] = []
    for col, ftype in zip(schema.columns, field_types, strict=True):
        if pa.types.is_string(col.type) and (ftype in _TEXT_TYPES or ftype == FIELD_TYPE.JSON):
            kinds.append(pa.string())
        elif ftype not in _TEXT_TYPES and ftype != FIELD_TYPE.JSON and _castable(col.type):
            kinds.append(pa.binary())
        else:
            kinds.append(None)
    return kinds


def _columns(raw: list[tuple[Any, ...]], kinds: list[pa.DataType | None]) -> list[pa.Array | None]:
    """The raw rows' columns as Arrow arrays of ``kinds`` (None where a column is kept as Python values),
    or all None when Arrow refuses a value (the caller then goes column by column).

    One ``pa.array`` over the rows as a struct transposes them in C++: the same conversions as one
    ``pa.array`` per column of ``zip(*raw)``, without a Python tuple per column (30% of the reader's CPU
    time on narrow rows)."""
    fields = [pa.field(f"c{i}", k if k is not None else pa.binary()) for i, k in enumerate(kinds)]
    try:
        rows = pa.array(raw, pa.struct(fields))
    except (pa.ArrowException, TypeError, ValueError, OverflowError):
        return [None] * len(kinds)  # e.g. invalid UTF-8 in a character column: column by column, as before
    return [None if k is None else rows.field(i) for i, k in enumerate(kinds)]


def raw_rows_to_table(schema: TableSchema, convs: list[Converter | None], raw: list[tuple[Any, ...]],
                      field_types: Sequence[int]) -> pa.Table:
    """A group of raw rows -> the RowBlock's Arrow table, equal to ``rowarrays.rows_to_table`` on the
    aiomysql reader's driver rows."""
    kinds = _column_kinds(schema, field_types)
    bulk = _columns(raw, kinds) if raw else [None] * len(kinds)
    arrays = []
    for i, (col, conv, ftype, kind) in enumerate(zip(schema.columns, convs, field_types, kinds, strict=True)):
        fast: pa.Array | None = None
        values: list[Any] | None = None
        if not raw:
            values = []
        elif kind is not None:
            got = bulk[i]
            if got is None:  # Arrow refused some value of the group: this column on its own
                values = [r[i] for r in raw]
                got = _plain_array(values, kind)
            if got is not None:
                fast = got if pa.types.is_string(kind) else _cast_text(got, col.type)
        if fast is not None:
            arrays.append(fast)
            continue
        if values is None:
            values = [r[i] for r in raw]
        driver = [_pymysql_value(v, ftype) for v in values]
        try:
            arrays.append(column_array(driver, col.type, conv,
                                       functools.partial(zero_warning, schema.table, col.name)))
        except (pa.ArrowException, TypeError, ValueError, OverflowError) as exc:
            raise SourceFatal(f"snapshot of {schema.table}: column {col.name!r} ({col.source_type}): values do not "
                              f"fit Arrow type {col.type}: {exc}; the type mapping for this column is wrong") from exc
    return pa.Table.from_arrays(arrays, schema=pa.schema([pa.field(c.name, c.type) for c in schema.columns]))


def _plain_array(values: list[Any], kind: pa.DataType) -> pa.Array | None:
    try:
        return pa.array(values, kind)
    except (pa.ArrowException, TypeError, ValueError, OverflowError):
        return None
