"""cdcd's row-image decoder against pymysqlreplication's, event by event, on a real MariaDB binlog.

Rows with edge and generated values of every type the fast path reads are
inserted, updated (FULL, MINIMAL and NOBLOB row images) and deleted; each rows
event is decoded by ``rowimage`` and by ``ev.rows`` (with cdcd's compat fix),
and the two must be identical: same keys in the same order, same value types
and reprs (Decimal exponents, microseconds), same ``none_sources``. The
columnar readers (what the ChangeBlock stream appends to column lists) must
give the same values, column by column.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from datetime import date, datetime, timedelta
from typing import Any

import pymysql
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pymysqlreplication import BinLogStreamReader
from pymysqlreplication.row_event import DeleteRowsEvent, UpdateRowsEvent, WriteRowsEvent

from cdcd.events import ChangeEvent, TableId
from cdcd.sources.mysql import (
    compat,  # noqa: F401  (the decoding cdcd compares against)
    decode,
)
from cdcd.sources.mysql.binlog import _EVENTS
from cdcd.sources.mysql.columnar import decimal_of
from cdcd.sources.mysql.rowimage import compile_table, unsupported_reason
from cdcd.sources.mysql.schema import SchemaHistory
from devtools.servers import MariaDBServer

_server_ids = itertools.count(7101)
_ids = itertools.count(1000)

ENUM_BIG = [f"v{i}" for i in range(300)]  # more than 255 labels: a 2-byte index
SET_BIG = [f"m{i}" for i in range(64)]  # 64 members: an 8-byte bitmap
SET_MID = SET_BIG[:20]  # a 3-byte bitmap
DECIMALS = [(1, 0), (5, 5), (4, 2), (10, 2), (18, 4), (18, 9), (19, 10), (30, 10), (38, 38), (65, 30), (65, 0),
            (20, 19), (9, 0), (10, 1)]

COLUMNS: list[tuple[str, str]] = [
    ("ti", "TINYINT"), ("tu", "TINYINT UNSIGNED"), ("si", "SMALLINT"), ("su", "SMALLINT UNSIGNED"),
    ("mi", "MEDIUMINT"), ("mu", "MEDIUMINT UNSIGNED"), ("i", "INT"), ("iu", "INT UNSIGNED"), ("bi", "BIGINT"),
    ("bu", "BIGINT UNSIGNED"), ("f", "FLOAT"), ("db", "DOUBLE"),
    *[(f"d{p}_{s}", f"DECIMAL({p},{s})") for p, s in DECIMALS],
    ("c", "CHAR(5)"), ("c255", "CHAR(255)"), ("vc", "VARCHAR(10)"), ("vcl", "VARCHAR(300)"),
    ("cl", "CHAR(10) CHARACTER SET latin1"), ("va", "VARCHAR(20) CHARACTER SET ascii"),
    ("tt", "TINYTEXT"), ("tx", "TEXT"), ("mt", "MEDIUMTEXT"), ("lt", "LONGTEXT"),
    ("bn", "BINARY(4)"), ("vb", "VARBINARY(10)"), ("vbl", "VARBINARY(1000)"), ("tb", "TINYBLOB"), ("bl", "BLOB"),
    ("mb", "MEDIUMBLOB"), ("lb", "LONGBLOB"),
    ("dt", "DATE"), *[(f"dtm{n}", f"DATETIME({n})") for n in range(7)],
    *[(f"ts{n}", f"TIMESTAMP({n}) NULL DEFAULT NULL") for n in range(7)], *[(f"tm{n}", f"TIME({n})") for n in range(7)],
    ("y", "YEAR"), ("j", "JSON"), ("e", "ENUM('a','b','it''s','😀')"),
    ("eb", "ENUM(" + ",".join(f"'{v}'" for v in ENUM_BIG) + ")"), ("st", "SET('x','y','z')"),
    ("st3", "SET(" + ",".join(f"'{v}'" for v in SET_MID) + ")"),
    ("stb", "SET(" + ",".join(f"'{v}'" for v in SET_BIG) + ")"),
    ("b1", "BIT(1)"), ("b7", "BIT(7)"), ("b8", "BIT(8)"), ("b10", "BIT(10)"), ("b64", "BIT(64)"),
]
NAMES = [n for n, _ in COLUMNS]
DDL = "CREATE TABLE t (id INT PRIMARY KEY, " + ", ".join(f"`{n}` {t}" for n, t in COLUMNS) + ") CHARACTER SET utf8mb4"


# ------------------------------------------------------------------ value strategies (SQL parameters)

def _int(lo: int, hi: int) -> st.SearchStrategy[Any]:
    return st.sampled_from([lo, hi, 0, -1 if lo < 0 else 1]) | st.integers(lo, hi)


def _dec(p: int, s: int) -> st.SearchStrategy[Any]:
    """Exact decimal text of up to p digits, s of them after the point (Decimal arithmetic would round)."""
    def render(n: int) -> str:
        digits = str(abs(n)).rjust(s + 1, "0")
        text = digits[:-s] + "." + digits[-s:] if s else digits
        return ("-" if n < 0 else "") + text

    top = 10 ** p - 1
    return st.sampled_from([-top, top, 0, 1, -1]).map(render) | st.integers(-top, top).map(render)


def _text(max_size: int, alphabet: st.SearchStrategy[str] | None = None) -> st.SearchStrategy[Any]:
    if alphabet is not None:
        return st.sampled_from(["", " "]) | st.text(alphabet, max_size=max_size)
    chars = st.characters(codec="utf-8", exclude_categories=("Cs",))
    return st.sampled_from(["", " ", "héllo 😀 ünï"[:max_size]]) | st.text(chars, max_size=max_size)


def _time(fsp: int) -> st.SearchStrategy[Any]:
    limit = 838 * 3600 + 59 * 60 + 59

    def render(v: tuple[int, int, int]) -> str:
        sign, secs, us = v
        us = us // 10 ** (6 - fsp) * 10 ** (6 - fsp) if fsp else 0
        h, rest = divmod(secs, 3600)
        return f"{'-' if sign else ''}{h}:{rest // 60:02d}:{rest % 60:02d}.{us:06d}"

    return st.tuples(st.booleans(), st.sampled_from([0, 1, limit]) | st.integers(0, limit),
                     st.sampled_from([0, 1, 999999]) | st.integers(0, 999999)).map(render)


def _datetime(fsp: int, lo: datetime, hi: datetime, zero: bool = True) -> st.SearchStrategy[Any]:
    def render(v: datetime) -> str:
        us = v.microsecond // 10 ** (6 - fsp) * 10 ** (6 - fsp)
        return v.replace(microsecond=us).strftime("%Y-%m-%d %H:%M:%S.%f")

    edges = ["0000-00-00 00:00:00"] if zero else []
    return st.sampled_from([*edges, render(lo), render(hi)]) | st.datetimes(lo, hi).map(render)


_LATIN = st.sampled_from(list("abcXYZ 09éüÿ€ß"))
_ASCII = st.characters(min_codepoint=0, max_codepoint=127)
_TS_LO, _TS_HI = datetime(1970, 1, 1, 0, 0, 1), datetime(2038, 1, 19, 3, 14, 7, 999999)


def _strategy(name: str, sql_type: str) -> st.SearchStrategy[Any]:
    t = sql_type.split("(")[0].split(" ")[0]
    ints = {"TINYINT": 7, "SMALLINT": 15, "MEDIUMINT": 23, "INT": 31, "BIGINT": 63}
    if t in ints:
        bits = ints[t]
        return _int(0, 2 ** (bits + 1) - 1) if "UNSIGNED" in sql_type else _int(-(2 ** bits), 2 ** bits - 1)
    fsp = int(name[-1]) if name[-1].isdigit() and t in ("DATETIME", "TIMESTAMP", "TIME") else 0
    table: dict[str, Callable[[], st.SearchStrategy[Any]]] = {  # lazy: only this column's is built
        "FLOAT": lambda: st.floats(width=32, allow_nan=False, allow_infinity=False),
        "DOUBLE": lambda: st.floats(allow_nan=False, allow_infinity=False),
        "CHAR": lambda: _text({"c": 5, "cl": 10}.get(name, 40), _LATIN if name == "cl" else None),
        "VARCHAR": lambda: _text({"vc": 10, "vcl": 300}.get(name, 20), _ASCII if name == "va" else None),
        "TINYTEXT": lambda: _text(60), "TEXT": lambda: _text(40), "MEDIUMTEXT": lambda: _text(40),
        "LONGTEXT": lambda: _text(40),
        "BINARY": lambda: st.binary(max_size=4), "VARBINARY": lambda: st.binary(max_size=10 if name == "vb" else 300),
        "TINYBLOB": lambda: st.binary(max_size=40), "BLOB": lambda: st.binary(max_size=40),
        "MEDIUMBLOB": lambda: st.binary(max_size=40), "LONGBLOB": lambda: st.binary(max_size=40),
        "DATE": lambda: st.sampled_from(["0000-00-00", "2020-00-00", "2020-05-00", "1000-01-01", "9999-12-31"])
        | st.dates(date(1000, 1, 1), date(9999, 12, 31)),
        "DATETIME": lambda: _datetime(fsp, datetime(1000, 1, 1), datetime(9999, 12, 31, 23, 59, 59, 999999)),
        "TIMESTAMP": lambda: _datetime(fsp, _TS_LO, _TS_HI),
        "TIME": lambda: _time(fsp), "YEAR": lambda: st.sampled_from([0, 1901, 2155]) | st.integers(1901, 2155),
        "JSON": lambda: st.sampled_from(['{"a": [1, 2.5, "x"], "b": null}', "[]", '"😀"', "1e300", "{}"]),
        "ENUM": lambda: st.sampled_from(ENUM_BIG if name == "eb" else ["a", "b", "it's", "😀"]),
        "SET": lambda: st.sets(st.sampled_from({"stb": SET_BIG, "st3": SET_MID}.get(name, ["x", "y", "z"]))).map(
            ",".join),
        "BIT": lambda: st.integers(0, 2 ** int(sql_type[4:-1]) - 1),
    }
    if t.startswith("DECIMAL"):
        p, s = sql_type[8:-1].split(",")
        return _dec(int(p), int(s))
    return table[t]()


ROW = st.fixed_dictionaries({n: st.none() | _strategy(n, t) for n, t in COLUMNS})


# ------------------------------------------------------------------ server helpers

def _connect(server: MariaDBServer, db: str) -> pymysql.connections.Connection:
    conn = pymysql.connect(host="127.0.0.1", port=server.port, user="root", password="", database=db,
                           charset="utf8mb4", autocommit=True)
    with conn.cursor() as cur:
        cur.execute("SET time_zone = '+00:00'")
    return conn


def _position(conn: pymysql.connections.Connection) -> tuple[str, int]:
    with conn.cursor() as cur:
        cur.execute("SHOW MASTER STATUS")
        row = cur.fetchone()
    assert row is not None
    return str(row[0]), int(row[1])


def _insert(cur: Any, rid: int, row: dict[str, Any]) -> None:
    cols = ", ".join(f"`{n}`" for n in row)
    cur.execute(f"INSERT INTO t (id, {cols}) VALUES (%s, {', '.join(['%s'] * len(row))})", [rid, *row.values()])


def _update(cur: Any, rid: int, row: dict[str, Any]) -> None:
    cur.execute("UPDATE t SET " + ", ".join(f"`{n}` = %s" for n in row) + " WHERE id = %s", [*row.values(), rid])


def _exact(v: Any) -> Any:
    """A form where equal means identical: type and repr of every value, dict key order kept."""
    if isinstance(v, dict):
        return [(k, _exact(x)) for k, x in v.items()]
    if isinstance(v, list):
        return [_exact(x) for x in v]
    if isinstance(v, set):
        return ("set", sorted(v))
    return (type(v).__name__, repr(v))


def compare_binlog(server: MariaDBServer, db: str, start: tuple[str, int]) -> dict[str, int]:
    """Decode every rows event of ``db`` from ``start`` both ways; returns how many rows of each kind matched."""
    reader = BinLogStreamReader(
        connection_settings={"host": "127.0.0.1", "port": server.port, "user": "root", "passwd": ""},
        server_id=next(_server_ids), log_file=start[0], log_pos=start[1], resume_stream=True, blocking=False,
        only_events=[WriteRowsEvent, UpdateRowsEvent, DeleteRowsEvent], only_schemas=[db],
    )
    seen = {"write": 0, "update": 0, "delete": 0}
    try:
        for ev in reader:
            columns = list(ev.table_map[ev.table_id].columns)
            decoder = compile_table(columns)
            assert decoder is not None, unsupported_reason(columns)
            ours = decoder.rows(ev)
            assert ours is not None, "the fast path declined a plain rows event"
            _compare_columns(decoder, ev, ours, columns)
            theirs = ev.rows  # decoded after ours: ours must not have moved the packet cursor
            assert len(ours) == len(theirs)
            for a, b in zip(ours, theirs, strict=True):
                assert _exact(a) == _exact(b), (a, b)
            kind = {WriteRowsEvent: "write", UpdateRowsEvent: "update", DeleteRowsEvent: "delete"}[type(ev)]
            seen[kind] += len(ours)
    finally:
        reader.close()
    return seen


def _from_form(form: tuple[str, int], v: Any) -> Any:
    kind, arg = form
    if kind == "micros":
        return datetime(1970, 1, 1) + timedelta(microseconds=v)
    if kind == "unscaled":
        return decimal_of(v, arg)
    assert kind == "utf8"
    return v.decode("utf-8")


def _compare_columns(decoder: Any, ev: Any, ours: list[Any], columns: list[Any]) -> None:
    """The columnar readers (``read_columns``) give each column the values of the row reader's rows: the
    after image (the before image of a delete) in the data lists, the before image of an update or a
    delete in the before lists; an empty SET is '' and a zero date's column is named for its warning."""
    names = [c.name for c in columns]
    data: list[list[Any]] = [[] for _ in names]
    before: list[list[Any]] = [[] for _ in names]
    zero: set[str] = set()
    assert decoder.read_columns(ev, data, before, zero) == len(ours)
    for k, form in enumerate(decoder.forms):  # the raw forms, as the builder turns them into the row reader's
        if form is not None:
            for lists in (data, before):
                lists[k] = [None if v is None else _from_form(form, v) for v in lists[k]]
    fixed_zero: set[str] = set()

    def fixed(values: dict[str, Any], sources: dict[str, str]) -> list[Any]:
        for k, v in sources.items():
            if v == "empty set":
                values = {**values, k: ""}
            elif v.startswith("out of"):
                fixed_zero.add(k)
        return [values[n] for n in names]

    if isinstance(ev, UpdateRowsEvent):
        olds = [fixed(r["before_values"], r["before_none_sources"]) for r in ours]
        news = [fixed(r["after_values"], r["after_none_sources"]) for r in ours]
    else:
        news = [fixed(r["values"], r["none_sources"]) for r in ours]
        olds = news if isinstance(ev, DeleteRowsEvent) else []
    assert _exact([list(c) for c in zip(*news, strict=True)] if news else [[] for _ in names]) == _exact(data)
    assert _exact([list(c) for c in zip(*olds, strict=True)] if olds else [[] for _ in names]) == _exact(before)
    assert zero == fixed_zero


@pytest.fixture
def table(maria_server: MariaDBServer, maria_db: str) -> Iterator[pymysql.connections.Connection]:
    conn = _connect(maria_server, maria_db)
    with conn.cursor() as cur:
        cur.execute(DDL)
    try:
        yield conn
    finally:
        conn.close()


# ------------------------------------------------------------------ tests

EDGE_ROWS: list[dict[str, Any]] = [
    {"ti": -128, "tu": 255, "si": -32768, "su": 65535, "mi": -8388608, "mu": 16777215, "i": -2147483648,
     "iu": 4294967295, "bi": -9223372036854775808, "bu": 18446744073709551615, "f": -3.4e38,
     "db": -1.7976931348623157e308,
     **{f"d{p}_{s}": "-" + "9" * (p - s) + ("." + "9" * s if s else "") for p, s in DECIMALS},
     "c": "😀😀😀😀😀", "c255": "é" * 255, "vc": "ü" * 10, "vcl": "😀" * 300, "cl": "€ÿ", "va": "~\x01",
     "tt": "x" * 63, "tx": "t" * 3000, "mt": "😀" * 1000, "lt": "l" * 70000,
     "bn": b"\x00\x00\x00\x00", "vb": b"\x00" * 10, "vbl": bytes(range(256)) * 3, "tb": b"\xff" * 255,
     "bl": b"\x00\xff" * 1000, "mb": b"m" * 70000, "lb": b"\x00",
     "dt": "1000-01-01", **{f"dtm{n}": "1000-01-01 00:00:00" for n in range(7)},
     **{f"ts{n}": "1970-01-01 00:00:01" for n in range(7)},
     **{f"tm{n}": "-838:59:59" for n in range(7)},
     "y": 1901, "j": "[]", "e": "a", "eb": "v0", "st": "", "st3": "", "stb": "", "b1": 0, "b7": 0, "b8": 0,
     "b10": 0, "b64": 0},
    {"ti": 127, "tu": 0, "si": 32767, "su": 0, "mi": 8388607, "mu": 0, "i": 2147483647, "iu": 0,
     "bi": 9223372036854775807, "bu": 0, "f": 1.17549435e-38, "db": 2.2250738585072014e-308,
     **{f"d{p}_{s}": "9" * (p - s) + ("." + "9" * s if s else "") for p, s in DECIMALS},
     "c": "", "c255": "", "vc": "", "vcl": "", "cl": "", "va": "", "tt": "", "tx": "", "mt": "", "lt": "",
     "bn": b"", "vb": b"", "vbl": b"", "tb": b"", "bl": b"", "mb": b"", "lb": b"",
     "dt": "9999-12-31", **{f"dtm{n}": "9999-12-31 23:59:59.999999" for n in range(7)},
     **{f"ts{n}": "2038-01-19 03:14:07.999999" for n in range(7)},
     **{f"tm{n}": "838:59:59.999999" for n in range(7)},
     "y": 2155, "j": '{"k": "😀"}', "e": "😀", "eb": "v299", "st": "x,y,z", "st3": ",".join(SET_MID),
     "stb": ",".join(SET_BIG), "b1": 1, "b7": 127, "b8": 255, "b10": 1023, "b64": 2 ** 64 - 1},
    {"ti": 0, "tu": 1, "si": -1, "su": 1, "mi": -1, "mu": 1, "i": -1, "iu": 1, "bi": -1, "bu": 9223372036854775808,
     "f": -0.0, "db": 0.1, **{f"d{p}_{s}": "0" for p, s in DECIMALS}, "c": " a", "c255": "a ", "vc": " ",
     "vcl": "a\x00b", "cl": "a", "va": "a", "tt": "\x00", "tx": "😀", "mt": "x", "lt": "",
     "bn": b"\x01", "vb": b"\x00\x01", "vbl": b"\xff", "tb": b"\x00", "bl": b"", "mb": b"\x00", "lb": b"",
     "dt": "0000-00-00", **{f"dtm{n}": "0000-00-00 00:00:00" for n in range(7)},
     **{f"ts{n}": "0000-00-00 00:00:00" for n in range(7)},
     **{f"tm{n}": "-00:00:00.000001" for n in range(7)},
     "y": 0, "j": "null", "e": "it's", "eb": "v255", "st": "y", "st3": "m19", "stb": "m63", "b1": 1, "b7": 64,
     "b8": 128, "b10": 512, "b64": 2 ** 63},
    {**{n: "-0.5" if n.startswith("d") and "_" in n and not n.endswith("_0") else None for n in NAMES},
     "dt": "2020-00-00", "dtm6": "2020-00-15 12:00:00.5", "tm3": "-12:34:56.789", "tm1": "-00:00:00.1"},
]


def test_edge_values_decode_exactly_like_pymysqlreplication(maria_server: MariaDBServer, maria_db: str,
                                                            table: pymysql.connections.Connection) -> None:
    conn = table
    start = _position(conn)
    with conn.cursor() as cur:
        for rid, row in enumerate(EDGE_ROWS, 1):
            _insert(cur, rid, row)
        cur.execute("INSERT INTO t (id) VALUES (99)")  # NULL everywhere
        # several rows in one event, then full-image updates and deletes of several rows per event
        cur.execute("UPDATE t SET tx = CONCAT(COALESCE(tx, ''), 'x'), ti = NULL WHERE id IN (1, 2, 3)")
        cur.execute("UPDATE t SET id = id + 100, dt = '2024-02-29' WHERE id IN (2, 99)")
        for image in ("MINIMAL", "NOBLOB"):
            cur.execute(f"SET SESSION binlog_row_image = {image}")
            cur.execute(f"UPDATE t SET vc = '{image[:3]}', st = '', b10 = {len(image)} WHERE id IN (1, 3)")
            cur.execute(f"UPDATE t SET lt = 'blob {image}' WHERE id = 4")
        cur.execute("DELETE FROM t WHERE id = 3")
        cur.execute("SET SESSION binlog_row_image = FULL")
        cur.execute("DELETE FROM t")
    seen = compare_binlog(maria_server, maria_db, start)
    assert seen == {"write": 5, "update": 3 + 2 + 2 * 3, "delete": 1 + 4}


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow, HealthCheck.data_too_large])
@given(rows=st.lists(ROW, min_size=1, max_size=4), changes=st.lists(ROW, min_size=1, max_size=4),
       minimal=st.booleans())
def test_generated_rows_decode_exactly_like_pymysqlreplication(maria_server: MariaDBServer, maria_db: str,
                                                               table: pymysql.connections.Connection,
                                                               rows: list[dict[str, Any]],
                                                               changes: list[dict[str, Any]], minimal: bool) -> None:
    conn = table
    ids = [next(_ids) for _ in rows]
    start = _position(conn)
    with conn.cursor() as cur:
        for rid, row in zip(ids, rows, strict=True):
            _insert(cur, rid, row)
        cur.execute(f"SET SESSION binlog_row_image = {'MINIMAL' if minimal else 'FULL'}")
        for rid, change in zip(ids, changes, strict=False):
            # a few columns only, as applications do: the MINIMAL after image has just these
            picked = dict(list(change.items())[rid % 7::5])
            _update(cur, rid, picked)
        cur.execute(f"DELETE FROM t WHERE id IN ({', '.join(map(str, ids))})")
        cur.execute("SET SESSION binlog_row_image = FULL")
    seen = compare_binlog(maria_server, maria_db, start)
    assert seen["write"] == len(rows) and seen["delete"] == len(rows)


def _decode_all(server: MariaDBServer, db: str, start: tuple[str, int]) -> list[Any]:
    reader = BinLogStreamReader(
        connection_settings={"host": "127.0.0.1", "port": server.port, "user": "root", "passwd": ""},
        server_id=next(_server_ids), log_file=start[0], log_pos=start[1], resume_stream=True, blocking=False,
        only_events=_EVENTS,
    )
    decoder = decode.Decoder("mariadb", {TableId(db, "t")}, SchemaHistory(), start[0], "", columnar=False)
    out = []
    try:
        for ev in reader:
            for item in decoder.feed(ev):
                if isinstance(item, ChangeEvent):
                    out.append((item.op, item.position, _exact(item.before), _exact(item.after), item.unavailable))
    finally:
        reader.close()
    return out


def test_decoder_items_are_the_same_on_both_paths(maria_server: MariaDBServer, maria_db: str,
                                                  table: pymysql.connections.Connection,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    conn = table
    start = _position(conn)
    with conn.cursor() as cur:
        for rid, row in enumerate(EDGE_ROWS, 1):
            _insert(cur, rid, row)
        cur.execute("SET SESSION binlog_row_image = MINIMAL")
        cur.execute("UPDATE t SET st = '', vc = 'm' WHERE id IN (1, 2)")
        cur.execute("SET SESSION binlog_row_image = FULL")
        cur.execute("UPDATE t SET st3 = 'm1', ts6 = NULL")
        cur.execute("DELETE FROM t")
    fast = _decode_all(maria_server, maria_db, start)
    monkeypatch.setattr(decode, "compile_table", lambda *args: None)
    slow = _decode_all(maria_server, maria_db, start)
    assert len(fast) == 4 + 2 + 4 + 4
    assert fast == slow
