"""End to end on PostgreSQL, for each target format: a key change whose TOASTed column is unchanged, the old
row's last update and the key change in different batches, and a key shift inside one statement.

Split from test_spark_pipeline.py (its helpers); the worker's shared Spark session (tests/support/spark.py).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from test_spark_pipeline import BIG, config, load_config, rows, start, verify, wait_landed

from devtools.servers import PostgresServer

pytestmark = pytest.mark.spark

#: The source's side of a key change (PostgreSQL's unchanged-TOAST marker, REPLICA IDENTITY FULL) is the same
#: whatever the format, and each format's own apply of these events runs in-process on all three formats
#: (integration/test_spark_formats.py): end to end, Parquet (verify reads it with pyarrow) and Iceberg (verify
#: reads a lakehouse table through Spark). Its Delta run (167 s, twice Iceberg's) ran no Delta code the in-process
#: tests do not (issue 32).
FORMATS = ["iceberg", "parquet"]


def wait_all_landed(pg: PostgresServer, db: str, landing: Path, proc: subprocess.Popen[bytes], marker: int) -> None:
    """Insert a marker row into `events` and wait until it landed: everything before it did too."""
    pg.psql(f"INSERT INTO events VALUES ({marker}, 'marker')", db)
    wait_landed(landing, marker, proc)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", FORMATS)
def test_key_change_with_unchanged_toast_and_a_key_shift(
    spark: object, pg_server: PostgresServer, pg_db: str, tmp_path: Path, fmt: str
) -> None:
    """`UPDATE orders SET id = 2 WHERE id = 1` leaves the TOASTed `big` unchanged: the mirror keeps it.

    The old row's last update, the key change and a second key change land in
    different batches, each merged by its own consumer run; then a key shift inside
    one statement on a deferrable key with REPLICA IDENTITY FULL (`id = id + 1` over
    ids 1..3 leaves ids 2..4). `cdcd verify` exits 0 after each step.
    """
    from cdcd.spark.job import run

    pg_server.psql(
        "CREATE TABLE orders (id int PRIMARY KEY, amount numeric(10,2), note text, big text);"
        "CREATE TABLE events (id int PRIMARY KEY, what text);"
        "CREATE TABLE shift (id int PRIMARY KEY DEFERRABLE, v text, big text);"
        "ALTER TABLE shift REPLICA IDENTITY FULL;"
        f"INSERT INTO orders SELECT g, g, 'snap', {BIG} FROM generate_series(1, 5) g;"
        f"INSERT INTO shift SELECT g, 'v' || g, {BIG} FROM generate_series(1, 3) g;",
        pg_db,
    )
    cfg = config(tmp_path, pg_server, pg_db)
    text = cfg.read_text().replace('tables = ["public.orders", "public.events"]',
                                   'tables = ["public.orders", "public.events", "public.shift"]')
    cfg.write_text(text)
    landing, target = tmp_path / "landing", tmp_path / "target"
    daemon = start(cfg)
    steps = [
        "UPDATE orders SET amount = 7 WHERE id = 1",  # the old row's last update: `big` unchanged TOAST
        "UPDATE orders SET id = 2000 WHERE id = 1",  # the key change, in a later batch
        "UPDATE orders SET id = 3000 WHERE id = 2000; UPDATE orders SET note = 'n' WHERE id = 3",
        "UPDATE shift SET id = id + 1",  # a key shift inside one statement
    ]
    try:
        for n, step in enumerate(steps):
            pg_server.psql(step, pg_db)
            wait_all_landed(pg_server, pg_db, landing, daemon, 100 + n)
            assert run(str(landing), str(target), once=True, fmt=fmt) == 0
            assert verify(load_config(cfg), str(target)) == 0, f"drift after {step!r}"
    finally:
        daemon.kill()
        daemon.wait()
    orders = {r["id"]: r for r in rows(target, "public.orders")}
    assert set(orders) == {2, 3, 4, 5, 3000} and len(orders[3000]["big"]) > 10000
    assert sorted(r["id"] for r in rows(target, "public.shift")) == [2, 3, 4]
