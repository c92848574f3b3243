"""Benchmark tables and data, generated inside the servers so generation is fast."""

from __future__ import annotations

from devtools.servers import MariaDBServer, PostgresServer

PG_NARROW = """
CREATE TABLE IF NOT EXISTS public.narrow (
    id bigint PRIMARY KEY, a integer, b text, c timestamptz DEFAULT now()
)"""

PG_WIDE = """
CREATE TABLE IF NOT EXISTS public.wide (
    id bigint PRIMARY KEY,
    n1 numeric(18,4), n2 numeric(38,10), i1 integer, i2 bigint, i3 smallint,
    f1 double precision, f2 real, b1 boolean,
    t1 text, t2 text, t3 varchar(64),
    ts1 timestamptz, ts2 timestamptz, ts3 timestamp, d1 date,
    j1 jsonb, j2 jsonb, u1 uuid, x1 text
)"""

MARIA_NARROW = """
CREATE TABLE IF NOT EXISTS narrow (
    id bigint PRIMARY KEY, a int, b varchar(64), c timestamp(6) DEFAULT CURRENT_TIMESTAMP(6)
)"""

MARIA_WIDE = """
CREATE TABLE IF NOT EXISTS wide (
    id bigint PRIMARY KEY,
    n1 decimal(18,4), n2 decimal(38,10), i1 int, i2 bigint, i3 smallint,
    f1 double, f2 float, b1 tinyint(1),
    t1 text, t2 text, t3 varchar(64),
    ts1 timestamp(6) NULL, ts2 datetime(6), ts3 datetime, d1 date,
    j1 json, j2 json, u1 char(36), x1 text
)"""


def pg_insert_narrow(server: PostgresServer, db: str, start: int, count: int, per_tx: int) -> None:
    """Insert ``count`` narrow rows from id ``start`` in transactions of ``per_tx`` rows."""
    for lo in range(start, start + count, per_tx):
        hi = min(lo + per_tx, start + count) - 1
        server.psql(f"INSERT INTO narrow (id, a, b) SELECT g, g % 1000, 'row ' || g FROM generate_series({lo}, {hi}) g",
                    db)


def pg_insert_wide(server: PostgresServer, db: str, start: int, count: int, per_tx: int) -> None:
    for lo in range(start, start + count, per_tx):
        hi = min(lo + per_tx, start + count) - 1
        server.psql(
            "INSERT INTO wide SELECT g, g / 7.0, g * 1.0000000001, g % 100000, g * 31, g % 300, g / 3.0, g / 9.0,"
            " g % 2 = 0, repeat(md5(g::text), 6), md5(g::text), left(md5(g::text), 20),"
            " now(), now() - (g || ' seconds')::interval, localtimestamp, current_date,"
            " jsonb_build_object('id', g, 'tags', jsonb_build_array('a', 'b')), '{\"k\": 1}',"
            " md5(g::text)::uuid, 'x'"
            f" FROM generate_series({lo}, {hi}) g",
            db,
        )


def maria_insert_narrow(server: MariaDBServer, db: str, start: int, count: int, per_tx: int) -> None:
    for lo in range(start, start + count, per_tx):
        hi = min(lo + per_tx, start + count) - 1
        server.sql(f"INSERT INTO narrow (id, a, b) SELECT seq, seq % 1000, CONCAT('row ', seq) FROM seq_{lo}_to_{hi}",
                   db)


def maria_insert_wide(server: MariaDBServer, db: str, start: int, count: int, per_tx: int) -> None:
    for lo in range(start, start + count, per_tx):
        hi = min(lo + per_tx, start + count) - 1
        server.sql(
            "INSERT INTO wide SELECT seq, seq / 7, seq * 1.0000000001, seq % 100000, seq * 31, seq % 300, seq / 3,"
            " seq / 9, seq % 2, REPEAT(MD5(seq), 6), MD5(seq), LEFT(MD5(seq), 20),"
            " NOW(6), NOW(6) - INTERVAL seq SECOND, NOW(), CURDATE(),"
            " JSON_OBJECT('id', seq, 'tags', JSON_ARRAY('a', 'b')), '{\"k\": 1}', UUID(), 'x'"
            f" FROM seq_{lo}_to_{hi}",
            db,
        )
