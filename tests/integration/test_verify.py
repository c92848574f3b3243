"""`cdcd verify` against real PostgreSQL and MariaDB servers and a Parquet mirror."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import tempfile
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cdcd.config import Config, parse_config
from cdcd.verify import verify
from devtools.servers import MariaDBServer, PostgresServer

TS = datetime(2024, 3, 4, 5, 6, 7, 123456, tzinfo=UTC)


def write_mirror(target: Path, table: str, data: pa.Table) -> None:
    bucket = target / "tables" / table / "cdc_bucket=0"
    bucket.mkdir(parents=True)
    n = data.num_rows
    data = data.append_column("_cdc_pos", pa.array([f"pg:{i:016x}:0000000001" for i in range(n)]))
    pq.write_table(data, bucket / "part-0.parquet")


def run_verify(config: Config, target: Path) -> tuple[int, str]:
    out = io.StringIO()
    code = verify(config, str(target), out)
    return code, out.getvalue()


def pg_config(server: PostgresServer, db: str, tables: list[str]) -> Config:
    return parse_config(
        {"source": {"kind": "postgres", "port": server.port, "user": "postgres", "database": db, "tables": tables}},
        env={},
    )


PG_MIRROR = pa.table(
    {
        "id": pa.array([1, 2, 3], pa.int64()),
        "amount": pa.array([Decimal("1.50"), Decimal("2.00"), None], pa.decimal128(12, 2)),
        "ratio": pa.array([0.1, 2.5, None], pa.float32()),
        "at": pa.array([TS, TS, None], pa.timestamp("us", tz="UTC")),
        "blob": pa.array([b"\x00\x01", b"", None], pa.binary()),
        "doc": pa.array(['{"b": [1, 2], "a": "x"}', "[]", None], pa.string()),
        "tags": pa.array([["a", "b"], [], None], pa.list_(pa.string())),
        "u": pa.array(["a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11", None, None], pa.string()),
        "n": pa.array(["123.4500", None, None], pa.string()),  # unconstrained numeric lands as its text
    }
)


def test_verify_postgres_equal_then_detects_drift(pg_server: PostgresServer, pg_db: str, tmp_path: Path) -> None:
    pg_server.psql(
        """CREATE TABLE items (id bigint PRIMARY KEY, amount numeric(12,2), ratio real, at timestamptz,
                              blob bytea, doc jsonb, tags text[], u uuid, n numeric);
           INSERT INTO items VALUES
             (1, 1.5, 0.1, '2024-03-04 07:06:07.123456+02', '\\x0001', '{"a": "x", "b": [1,2]}', '{a,b}',
              'a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11', 123.4500),
             (2, 2, 2.5, '2024-03-04 05:06:07.123456Z', '', '[]', '{}', NULL, NULL),
             (3, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL);""",
        pg_db,
    )
    config = pg_config(pg_server, pg_db, ["public.items"])
    write_mirror(tmp_path, "public.items", PG_MIRROR)
    code, text = run_verify(config, tmp_path)
    assert code == 0, text
    assert "public.items: OK source=3 mirror=3" in text

    pg_server.psql("UPDATE items SET amount = 9.99 WHERE id = 2; DELETE FROM items WHERE id = 3;"
                   "INSERT INTO items (id) VALUES (4)", pg_db)
    code, text = run_verify(config, tmp_path)
    assert code == 1
    assert "DRIFT" in text and "missing=1 extra=1 changed=1" in text
    assert "missing key=['4']" in text and "extra key=['3']" in text and "changed key=['2']" in text
    assert "'amount': '9.99'" in text and "'amount': '2'" in text  # both versions are shown


def test_verify_reports_a_table_without_mirror(pg_server: PostgresServer, pg_db: str, tmp_path: Path) -> None:
    pg_server.psql("CREATE TABLE t (k int PRIMARY KEY); INSERT INTO t VALUES (7)", pg_db)
    code, text = run_verify(pg_config(pg_server, pg_db, ["public.t"]), tmp_path)
    assert code == 1 and "missing key=['7']" in text


def test_verify_mariadb(maria_server: MariaDBServer, maria_db: str, tmp_path: Path) -> None:
    maria_server.sql(
        """CREATE TABLE items (id bigint unsigned PRIMARY KEY, amount decimal(10,3), f float, d double,
                              at timestamp(6) NULL, dt datetime(6), t time(6), b varbinary(8), j json, e enum('x','y'));
           INSERT INTO items VALUES
             (18446744073709551615, 1.5, 1.1, 2.25, '2024-03-04 05:06:07.123456', '2024-03-04 05:06:07',
              '01:02:03.5', 0x00ff, '{"k": [1, 2]}', 'y'),
             (1, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL);""",
        maria_db,
    )
    mirror = pa.table(
        {
            "id": pa.array([Decimal("18446744073709551615"), Decimal(1)], pa.decimal128(20, 0)),
            "amount": pa.array([Decimal("1.500"), None], pa.decimal128(10, 3)),
            "f": pa.array([1.1, None], pa.float32()),
            "d": pa.array([2.25, None], pa.float64()),
            "at": pa.array([TS.replace(second=7), None], pa.timestamp("us", tz="UTC")),
            "dt": pa.array([datetime(2024, 3, 4, 5, 6, 7), None], pa.timestamp("us")),
            "t": pa.array([(3723 * 1_000_000 + 500_000), None], pa.int64()),  # duration, as Spark keeps it
            "b": pa.array([b"\x00\xff", None], pa.binary()),
            "j": pa.array(['{"k": [1, 2]}', None], pa.string()),
            "e": pa.array(["y", None], pa.string()),
        }
    )
    write_mirror(tmp_path, f"{maria_db}.items", mirror)
    config = parse_config(
        {
            "source": {
                "kind": "mariadb", "port": maria_server.port, "user": "root", "database": maria_db,
                "tables": [f"{maria_db}.items"], "mysql": {"server_id": 77},
            }
        },
        env={},
    )
    code, text = run_verify(config, tmp_path)
    assert code == 0, text
    maria_server.sql("UPDATE items SET j = '{\"k\": [1, 3]}' WHERE id = 1", maria_db)
    code, text = run_verify(config, tmp_path)
    assert code == 1 and "changed key=['1']" in text, text


def _self_signed(where: Path) -> tuple[Path, Path]:
    where.mkdir(parents=True)
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
                    "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost",
                    "-keyout", str(where / "server.key"), "-out", str(where / "server.crt")],
                   check=True, capture_output=True)
    return where / "server.crt", where / "server.key"


def test_verify_connects_with_the_sources_tls_settings(tmp_path: Path) -> None:
    """A TLS-only PostgreSQL (hostssl) and `sslmode = "verify-full"`: verify checks the certificate like the daemon."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    certs = Path(tempfile.mkdtemp(prefix="cdcd-verify-tls-"))
    cert, key = _self_signed(certs / "server")
    stranger, _ = _self_signed(certs / "other")  # a certificate that did not sign the server's
    os.chmod(certs, 0o755)
    os.chmod(certs / "server", 0o755)
    os.chmod(key, 0o600)
    if os.geteuid() == 0:
        for f in (key, cert):
            shutil.chown(f, "postgres")
    server = PostgresServer(settings={"ssl": "on", "ssl_cert_file": f"'{cert}'", "ssl_key_file": f"'{key}'"}).start()
    try:
        hba = server.root / "data" / "pg_hba.conf"  # TCP connections only with TLS
        lines = [line.replace("host ", "hostssl ", 1) if line.startswith("host ") else line
                 for line in hba.read_text().splitlines()]
        hba.write_text("\n".join([*lines, "hostnossl all all 0.0.0.0/0 reject", ""]))
        server.psql("SELECT pg_reload_conf(); CREATE TABLE items (id bigint PRIMARY KEY, v text);"
                    "INSERT INTO items VALUES (1, 'a'), (2, 'b');")
        target = tmp_path / "target"
        write_mirror(target, "public.items", pa.table({"id": pa.array([1, 2], pa.int64()), "v": ["a", "b"]}))

        def config(root: Path) -> Config:
            return parse_config({"source": {
                "kind": "postgres", "host": "localhost", "port": server.port, "user": "cdc_pw",
                "password": "secret", "database": "postgres", "tables": ["public.items"],
                "sslmode": "verify-full", "sslrootcert": str(root)}}, env={})

        code, out = run_verify(config(cert), target)
        assert code == 0, out
        assert "public.items: OK" in out
        code, out = run_verify(config(stranger), target)  # the server's certificate is not trusted: refused
        assert code == 2, out
    finally:
        server.stop()
        shutil.rmtree(certs, ignore_errors=True)


def test_verify_table_option_on_the_command_line(pg_server: PostgresServer, pg_db: str, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str], spark: object) -> None:
    """`cdcd verify --table` compares only the tables named (repeatable); a name not captured is exit 2.

    Run in-process beside a running Spark session (the worker's, ``spark``), the command leaves that session and
    its JVM running: it ends only a session it started (its caller's notebook or test goes on; the fixture's
    teardown fails the test if the JVM was ended)."""
    from cdcd.cli import main

    pg_server.psql("CREATE TABLE a (k int PRIMARY KEY); CREATE TABLE b (k int PRIMARY KEY);"
                   "INSERT INTO a VALUES (1); INSERT INTO b VALUES (2)", pg_db)
    write_mirror(tmp_path / "target", "public.a", pa.table({"k": pa.array([1], pa.int32())}))
    cfg = tmp_path / "cdcd.toml"
    cfg.write_text(f'[source]\nkind = "postgres"\nport = {pg_server.port}\nuser = "postgres"\n'
                   f'database = "{pg_db}"\ntables = ["public.a", "public.b"]\nsslmode = "disable"\n')
    base = ["verify", "-c", str(cfg), "--target", str(tmp_path / "target")]
    assert main([*base, "--table", "public.a"]) == 0
    out = capsys.readouterr().out
    assert "public.a: OK" in out and "public.b" not in out
    assert main(base) == 1 and "public.b: DRIFT" in capsys.readouterr().out
    assert main([*base, "--table", "public.a", "--table", "public.b"]) == 1
    capsys.readouterr()
    assert main([*base, "--table", "public.c"]) == 2
    err = capsys.readouterr().err
    assert "verify --table public.c: not a captured table" in err and "public.a, public.b" in err
