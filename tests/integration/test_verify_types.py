"""`cdcd verify` normalises the source the way the sources land it: no false drift on an inet host address,
a numeric(p,s) NaN, a zero date or a FLOAT, and real drift in those columns is still found."""

from __future__ import annotations

from datetime import date
from decimal import Decimal
from pathlib import Path

import pyarrow as pa
from test_verify import run_verify, write_mirror

from cdcd.config import parse_config
from devtools.servers import MariaDBServer, PostgresServer


def test_verify_postgres_inet_and_nan(pg_server: PostgresServer, pg_db: str, tmp_path: Path) -> None:
    pg_server.psql("CREATE TABLE n (id int PRIMARY KEY, ip inet, c cidr, x numeric(6,2));"
                   "INSERT INTO n VALUES (1, '::1', '10.0.0.0/8', 'NaN'), (2, '10.1.2.3/16', '::/0', 1.5)", pg_db)
    mirror = pa.table({"id": pa.array([1, 2], pa.int32()), "ip": ["::1", "10.1.2.3/16"], "c": ["10.0.0.0/8", "::/0"],
                       "x": pa.array([None, Decimal("1.50")], pa.decimal128(6, 2))})  # what the source lands
    write_mirror(tmp_path, "public.n", mirror)
    config = parse_config({"source": {"kind": "postgres", "port": pg_server.port, "user": "postgres",
                                      "database": pg_db, "tables": ["public.n"]}}, env={})
    code, text = run_verify(config, tmp_path)
    assert code == 0, text
    pg_server.psql("UPDATE n SET ip = '::2' WHERE id = 1", pg_db)
    code, text = run_verify(config, tmp_path)
    assert code == 1 and "changed key=['1']" in text, text


def test_verify_mariadb_zero_dates_and_float(maria_server: MariaDBServer, maria_db: str, tmp_path: Path) -> None:
    maria_server.sql("SET SESSION sql_mode = '';"
                     "CREATE TABLE z (id int PRIMARY KEY, d date, dt datetime, ts timestamp NULL, f float);"
                     "INSERT INTO z VALUES (1, '0000-00-00', '0000-00-00 00:00:00', '0000-00-00 00:00:00', 1.2345678),"
                     " (2, '2024-01-02', NULL, NULL, 16777218)", maria_db)
    mirror = pa.table({"id": pa.array([1, 2], pa.int32()), "d": pa.array([None, date(2024, 1, 2)], pa.date32()),
                       "dt": pa.array([None, None], pa.timestamp("us")),
                       "ts": pa.array([None, None], pa.timestamp("us", tz="UTC")),
                       "f": pa.array([1.2345678, 16777218.0], pa.float32())})
    write_mirror(tmp_path, f"{maria_db}.z", mirror)
    config = parse_config({"source": {"kind": "mariadb", "port": maria_server.port, "user": "root",
                                      "database": maria_db, "tables": [f"{maria_db}.z"],
                                      "mysql": {"server_id": 78}}}, env={})
    code, text = run_verify(config, tmp_path)
    assert code == 0, text
    maria_server.sql("UPDATE z SET f = 16777220 WHERE id = 2", maria_db)
    code, text = run_verify(config, tmp_path)
    assert code == 1 and "changed key=['2']" in text, text


def test_verify_reports_source_rows_whose_keys_collapse_once_zero_dates_land_as_null(
        maria_server: MariaDBServer, maria_db: str, tmp_path: Path) -> None:
    """Keys that differ only in a zero date land alike: the mirror holds one row, verify must not call it equal."""
    maria_server.sql("SET SESSION sql_mode = '';CREATE TABLE k (id INT, d DATE, v INT, PRIMARY KEY (id, d));"
                     "INSERT INTO k VALUES (1, '2024-00-15', 1), (1, '2024-00-16', 1), (2, '0000-01-01', 2),"
                     " (3, '2024-01-01', 3)", maria_db)
    # what lands, merged by key: one row of id 1
    mirror = pa.table({"id": pa.array([1, 2, 3], pa.int32()),
                       "d": pa.array([None, None, date(2024, 1, 1)], pa.date32()),
                       "v": pa.array([1, 2, 3], pa.int32())})
    write_mirror(tmp_path, f"{maria_db}.k", mirror)
    config = parse_config({"source": {"kind": "mariadb", "port": maria_server.port, "user": "root",
                                      "database": maria_db, "tables": [f"{maria_db}.k"],
                                      "mysql": {"server_id": 79}}}, env={})
    code, text = run_verify(config, tmp_path)
    assert code == 1 and "1 source rows share their landed key with another row" in text, text
    maria_server.sql("DELETE FROM k WHERE id = 1 AND d = '2024-00-16'", maria_db)
    code, text = run_verify(config, tmp_path)
    assert code == 0, text  # year 0 and zero months read as NULL, as they land
