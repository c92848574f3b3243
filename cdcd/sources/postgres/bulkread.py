"""Binary COPY chunks straight into Arrow: the snapshot's bulk reader (Apache Arrow ADBC, libpq).

``adbc-driver-postgresql`` runs a query as ``COPY (query) TO STDOUT (FORMAT binary)`` and decodes
the rows into Arrow arrays in C++ (the GIL is released while it reads and decodes). Each snapshot
worker opens one such connection next to its asyncpg one, inside a ``REPEATABLE READ READ ONLY``
transaction that imports the same exported snapshot, so both read the same instant.

Not every type's binary form is decoded by the driver exactly as cdcd lands it (numeric: NaN and
the scale; uuid: a 16-byte extension type). Columns whose source type is in ``NATIVE`` or
``TEMPORAL`` are read as the driver decodes them (dates and timestamps with ±infinity and values
Python cannot hold handled here); every other column is selected as its text output
(``format('%s', col)``, exactly what COPY text and pgoutput send) and converted by the text path's
column converters (``copytext.CopyDecoder.text_column``), so both readers land the same values and
warnings: a per-column fallback.

Timeouts: ``statement_timeout`` is ``runtime.source_read_timeout_s`` (a chunk query that gets no
answer is cancelled by the server), libpq's ``connect_timeout`` is ``source.connect_timeout_s``, and
TCP keepalives and ``tcp_user_timeout`` take a dead network for a lost connection. TLS: ``sslmode``
and ``sslrootcert`` are libpq's own parameters, passed as they are.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import quote, urlencode

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from cdcd.errors import SourceError, SourceFatal, reason
from cdcd.sockets import KEEPALIVE_COUNT, KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S
from cdcd.sources.postgres.catalog import quote_ident, quote_literal
from cdcd.sources.postgres.connection import ConnectParams
from cdcd.sources.postgres.copytext import UNREPRESENTABLE, CopyDecoder, needs_key_text
from cdcd.sources.postgres.shape import INFINITE, TableShape, Warnings
from cdcd.sources.postgres.types import SESSION_SETTINGS, key_text

#: Source types (plain, not domains) whose binary form the driver decodes to exactly the landed value.
NATIVE = {"bool": pa.bool_(), "int2": pa.int16(), "int4": pa.int32(), "int8": pa.int64(),
          "float4": pa.float32(), "float8": pa.float64(), "text": pa.string(), "bytea": pa.binary(),
          "json": pa.string(), "jsonb": pa.string()}  # json(b): the driver hands out the text output
#: Dates and timestamps: decoded natively, with ±infinity and values Python cannot hold handled here
#: exactly as the text path does (``_Temporal``).
TEMPORAL = {"date": pa.date32(), "timestamp": pa.timestamp("us"), "timestamptz": pa.timestamp("us", tz="UTC")}
#: Character types keep their typmod in the source type name (``varchar(20)``); the binary form is the text.
_CHAR_TYPES = ("varchar", "bpchar")

_T = TypeVar("_T")

#: Bytes per Arrow batch the driver hands out: one RowBlock each.
BATCH_BYTES = 4 << 20


def available() -> bool:
    """Whether the ADBC PostgreSQL driver is installed (else the snapshot reads text COPY)."""
    try:
        import adbc_driver_postgresql.dbapi  # noqa: F401
    except ImportError:
        return False
    return True


def native_type(source_type: str, landed: pa.DataType) -> bool:
    """The driver's decoding of ``source_type`` is the landed value as is."""
    base = source_type.split("(", 1)[0]
    if base in _CHAR_TYPES:
        return bool(landed == pa.string())
    if base == "numeric":  # numeric(p,s) landed as a decimal: the driver's text, cast as the text path does
        return bool(pa.types.is_decimal(landed))
    want = NATIVE.get(source_type) or TEMPORAL.get(source_type)
    return want is not None and bool(want == landed)


def libpq_uri(params: ConnectParams) -> str:
    """The libpq URI of ``params``: TLS, timeouts and keepalives as the other connections have them."""
    auth = quote(params.user, safe="")
    if params.password is not None:
        auth += ":" + quote(params.password, safe="")
    host = f"[{params.host}]" if ":" in params.host else params.host
    query: dict[str, str] = {
        "sslmode": params.sslmode,
        "connect_timeout": str(max(1, round(params.connect_timeout_s))),
        "application_name": params.application_name,
        "client_encoding": "UTF8",
        "keepalives": "1",
        "keepalives_idle": str(KEEPALIVE_IDLE_S),
        "keepalives_interval": str(KEEPALIVE_INTERVAL_S),
        "keepalives_count": str(KEEPALIVE_COUNT),
        # unacknowledged data on a dead network: given up after the read timeout, like a silent server
        "tcp_user_timeout": str(int(params.read_timeout_s * 1000)),
    }
    if params.sslrootcert is not None:
        query["sslrootcert"] = str(params.sslrootcert)
    return f"postgresql://{auth}@{host}:{params.port}/{quote(params.database, safe='')}?{urlencode(query)}"


@dataclass(frozen=True, slots=True)
class Plan:
    """How one table's chunks are selected and turned into landed columns."""

    select: str  # the select list: native columns as they are, the others as their text output
    native: tuple[bool, ...]  # per landed column
    key_text_at: dict[int, int]  # key field -> index in the result of its text (a column or an extra one)


def plan(shape: TableShape, key_fields: Sequence[int]) -> Plan:
    cols = shape.schema.columns
    native = tuple(native_type(c.source_type, c.type) for c in cols)
    exprs = [quote_ident(c.name) if n else _as_text(c.name) for c, n in zip(cols, native, strict=True)]
    key_text_at: dict[int, int] = {}
    for i in key_fields:
        if not native[i] or cols[i].type == pa.string():
            key_text_at[i] = i  # the column is the server's text already
        elif needs_key_text(cols[i].type):
            key_text_at[i] = len(exprs)  # e.g. float4, bytea: the server's text as well, for the resume key
            exprs.append(_as_text(cols[i].name))
        # else ints, float8, bool: key_text() of the landed value casts back to exactly the same value
    return Plan(", ".join(exprs), native, key_text_at)


def _as_text(name: str) -> str:
    q = quote_ident(name)
    return f"CASE WHEN {q} IS NULL THEN NULL ELSE format('%s', {q}) END"


class BulkConnection:
    """One worker's ADBC connection in the snapshot transaction. Blocking: call it from a thread."""

    def __init__(self, params: ConnectParams, batch_bytes: int = BATCH_BYTES) -> None:
        self._params = params
        self._batch_bytes = batch_bytes
        self._conn: Any = None
        self._cursor: Any = None
        self._reader: Any = None
        self._lock = threading.Lock()  # close() from the event loop vs. a chunk read in its thread

    def open(self, snapshot_name: str) -> None:
        import adbc_driver_manager
        import adbc_driver_postgresql.dbapi as dbapi

        try:
            # autocommit: the driver sends no BEGIN of its own; ours opens the snapshot transaction
            self._conn = dbapi.connect(libpq_uri(self._params), autocommit=True)
            self._cursor = self._conn.cursor()
            self._cursor.adbc_statement.set_options(
                **{"adbc.postgresql.batch_size_hint_bytes": str(self._batch_bytes)})
            for name, value in SESSION_SETTINGS.items():
                if name != "client_encoding":
                    self._cursor.execute(f"SET {name} = {quote_literal(value)}")
            self._cursor.execute(f"SET statement_timeout = {int(self._params.read_timeout_s * 1000)}")
            self._cursor.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
            self._cursor.execute(f"SET TRANSACTION SNAPSHOT {quote_literal(snapshot_name)}")
        except adbc_driver_manager.Error as exc:
            self.close()
            raise _error(self._params, exc) from exc
        except OSError as exc:
            self.close()
            raise SourceError(f"{self._params.where}: the bulk reader cannot connect: {reason(exc)}") from exc

    def start(self, query: str) -> None:
        """Run a chunk query; its batches come from ``next_batch``."""
        import adbc_driver_manager

        with self._lock:
            if self._cursor is None:
                raise SourceError(f"snapshot of {self._params.where}: the bulk reader's connection is closed")
            try:
                self._cursor.execute(query)
                self._reader = self._cursor.fetch_record_batch()
            except adbc_driver_manager.Error as exc:
                raise _error(self._params, exc) from exc

    def next_batch(self) -> pa.RecordBatch | None:
        """The chunk's next batch, None at its end."""
        import adbc_driver_manager

        with self._lock:
            if self._reader is None:
                return None
            try:
                batch: pa.RecordBatch = self._reader.read_next_batch()
                return batch
            except StopIteration:
                self._reader = None
                return None
            except (adbc_driver_manager.Error, pa.ArrowException) as exc:
                raise _error(self._params, exc) from exc

    def cancel(self) -> None:
        """Stop a running chunk query (thread-safe in ADBC): the reading thread gets an error and returns."""
        cursor = self._cursor
        if cursor is not None:
            with contextlib.suppress(Exception):  # best effort while closing: the connection is closed next
                cursor.adbc_cancel()

    def close(self, wait_s: float = 5.0) -> None:
        """Cancel what runs, then close once the reading thread let go (a stuck one keeps the connection
        until the process exits rather than having it freed under its feet)."""
        self.cancel()
        if not self._lock.acquire(timeout=wait_s):
            return
        try:
            conn, self._conn, self._cursor, self._reader = self._conn, None, None, None
            if conn is not None:
                with contextlib.suppress(Exception):  # closing a broken connection: nothing left to save
                    conn.close()
        finally:
            self._lock.release()


async def call(fn: Callable[[], _T], limit_s: float, what: str) -> _T:
    """``fn()`` in a thread of its own, waited for at most ``limit_s``.

    libpq has no read timeout: on a connection silenced by the network (no FIN, no RST) a read waits
    forever, and ``statement_timeout``'s error cannot arrive either. So the wait is bounded here; the
    query is cancelled and the thread, still blocked in libpq, is a daemon thread: it holds neither the
    event loop nor the process's exit, and its connection is given up (``BulkConnection.close``).
    """
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[_T] = loop.create_future()

    def settle(result: _T | None, exc: BaseException | None) -> None:
        if fut.done():
            return  # given up (timeout or cancel): nobody waits for it
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(result)  # type: ignore[arg-type]

    def run() -> None:
        try:
            result, exc = fn(), None
        except BaseException as e:  # handed to the waiting coroutine
            result, exc = None, e
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile (process stopping)
            loop.call_soon_threadsafe(settle, result, exc)

    threading.Thread(target=run, name="cdcd-pg-bulk", daemon=True).start()
    try:
        async with asyncio.timeout(limit_s):
            return await fut
    except TimeoutError as exc:
        raise SourceError(f"{what}: no answer within {limit_s:g}s (runtime.source_read_timeout_s); the "
                          "connection is taken for dead, reconnecting") from exc


class ChunkCursor:
    """A table's key-ordered chunks as one sequence of converted batches. Blocking: one call at a time."""

    def __init__(self, bulk: BulkConnection, convert: BatchConverter, query: Callable[[list[str] | None], str],
                 chunk_rows: int, after: list[str] | None) -> None:
        self._bulk = bulk
        self._convert = convert
        self._query = query
        self._chunk_rows = chunk_rows
        self.after = after  # the key the next chunk starts after (None: the table's start)
        self._open = False
        self._rows = 0  # rows of the open chunk so far
        self._done = False

    def next(self) -> tuple[pa.Table, tuple[pa.Array | None, ...], list[str]] | None:
        """The next batch as (landed columns, key texts, resume key); None after the table's last row."""
        while not self._done:
            if not self._open:
                self._bulk.start(self._query(self.after))
                self._open, self._rows = True, 0
            batch = self._bulk.next_batch()
            if batch is None:
                self._open = False
                self._done = self._rows < self._chunk_rows  # a short chunk is the table's last
                continue
            if batch.num_rows:
                data, texts, after = self._convert.convert(batch)
                self._rows += batch.num_rows
                self.after = after
                return data, texts, after
        return None


def _error(params: ConnectParams, exc: BaseException) -> SourceError:
    text = str(exc).strip()
    if "statement timeout" in text:
        return SourceError(f"snapshot of {params.where}: a chunk query got no answer within "
                           f"{params.read_timeout_s:g}s (runtime.source_read_timeout_s); reconnecting")
    if "permission denied" in text:
        return SourceFatal(f"snapshot of {params.where}: {text}; grant SELECT on the table to source.user")
    if "password authentication failed" in text or "no pg_hba.conf entry" in text:
        return SourceFatal(f"{params.where}: authentication failed ({text}); check source.user and the password")
    return SourceError(f"snapshot of {params.where} (bulk reader): {text}")


class BatchConverter:
    """An ADBC batch of one chunk -> the landed columns, key texts and the last row's resume key."""

    def __init__(self, shape: TableShape, warnings: Warnings, key_fields: Sequence[int], bulk_plan: Plan) -> None:
        self.shape = shape
        self.plan = bulk_plan
        self._key_fields = list(key_fields)
        self._text = CopyDecoder(shape, warnings, key_fields)
        self._schema = pa.schema([pa.field(c.name, c.type) for c in shape.schema.columns])
        self._warnings = warnings

    def convert(self, batch: pa.RecordBatch) -> tuple[pa.Table, tuple[pa.Array | None, ...], list[str]]:
        cols = self.shape.schema.columns
        arrays: list[pa.Array] = []
        for i, (col, native) in enumerate(zip(cols, self.plan.native, strict=True)):
            got = batch.column(i)
            if native and pa.types.is_decimal(col.type):
                # the driver spells NaN and ±Infinity as nan and ±inf; the digits are the server's
                arrays.append(self._text.text_column(i, _numeric_spelling(_plain(got))))
            elif native:
                if got.type != col.type:
                    got = self._native_cast(i, got)
                if col.source_type in TEMPORAL:
                    got = self._temporal(i, got)
                arrays.append(got)
            else:
                arrays.append(self._text.text_column(i, _plain(got)))
        texts: list[pa.Array | None] = []
        for i in self._key_fields:
            at = self.plan.key_text_at.get(i)
            texts.append(_plain(batch.column(at)) if at is not None and needs_key_text(cols[i].type) else None)
        data = pa.Table.from_arrays(arrays, schema=self._schema)
        last = batch.num_rows - 1
        after = []
        for i in self._key_fields:
            at = self.plan.key_text_at.get(i)
            if at is not None:
                after.append(str(_plain(batch.column(at))[last].as_py()))
            else:
                after.append(key_text(arrays[i][last].as_py()))
        return data, tuple(texts), after

    def _temporal(self, i: int, got: pa.Array) -> pa.Array:
        """The driver's dates and timestamps as the text path lands them.

        The driver shifts PostgreSQL's epoch (2000) to Arrow's (1970) without an overflow check, so
        ±infinity (the int extremes on the wire) arrive as two fixed values (``_infinities``): those land
        as the type's largest/smallest value with the INFINITE warning. Other values outside what Python
        can hold (BC dates, years after 9999) land as NULL with the unrepresentable warning.
        """
        col = self.shape.schema.columns[i]
        is_date = col.type == pa.date32()
        raw = got.cast(pa.int32() if is_date else pa.int64())
        values = np.asarray(raw.fill_null(0).to_numpy(zero_copy_only=False))
        plus, minus, lowest, highest = _DATE_LIMITS if is_date else _TS_LIMITS
        infinite = (values == plus) | (values == minus)
        outside = ((values < lowest) | (values > highest)) & ~infinite
        if raw.null_count:
            valid = np.asarray(raw.is_valid().to_numpy(zero_copy_only=False))
            infinite &= valid
            outside &= valid
        if not infinite.any() and not outside.any():
            return got
        if infinite.any():
            self._warnings.once(self.shape.table, col.name, INFINITE, source_type=col.source_type)
        if outside.any():
            self._warnings.once(self.shape.table, col.name, UNREPRESENTABLE,
                                error=f"a {col.source_type} value is outside the range Python/Arrow can hold")
        fixed = np.where(values == plus, highest, np.where(values == minus, lowest, values))
        mask = np.asarray(raw.is_null().to_numpy(zero_copy_only=False)) | outside
        return pa.array(fixed, type=raw.type, mask=mask).cast(col.type)

    def _native_cast(self, i: int, got: pa.Array) -> pa.Array:
        col = self.shape.schema.columns[i]
        storage = _plain(got)
        if storage.type == col.type:
            return storage
        raise SourceFatal(f"snapshot of {self.shape.table}: the bulk reader decoded column {col.name} "
                          f"({col.source_type}) as {got.type}, not {col.type}; please report this with the "
                          "table's definition")


def _numeric_spelling(col: pa.Array) -> pa.Array:
    for driver, server in (("nan", "NaN"), ("inf", "Infinity"), ("-inf", "-Infinity")):
        col = pc.if_else(pc.equal(col, driver), server, col)
    return col


def _wrapped(infinity: int, bits: int, shift: int) -> int:
    """``infinity + shift`` in two's complement of ``bits`` bits (what the driver's unchecked add gives)."""
    v = (infinity + shift) & ((1 << bits) - 1)
    return v - (1 << bits) if v >= 1 << (bits - 1) else v


_PG_EPOCH_US = 946_684_800_000_000  # 2000-01-01 - 1970-01-01
_PG_EPOCH_DAYS = 10_957
#: (+infinity as it arrives, -infinity as it arrives, the smallest and largest value Python holds)
_TS_LIMITS = (_wrapped(2**63 - 1, 64, _PG_EPOCH_US), _wrapped(-(2**63), 64, _PG_EPOCH_US),
              -62_135_596_800_000_000, 253_402_300_799_999_999)
_DATE_LIMITS = (_wrapped(2**31 - 1, 32, _PG_EPOCH_DAYS), _wrapped(-(2**31), 32, _PG_EPOCH_DAYS), -719_162, 2_932_896)


def _plain(arr: pa.Array) -> pa.Array:
    """An extension array's storage (the driver tags text results of some types, e.g. arrow.json)."""
    if isinstance(arr.type, pa.BaseExtensionType):
        return arr.storage
    return arr
