"""One local Spark session per pytest worker, shared by the Spark tests that run the consumer in-process.

Starting a session costs about 10 s of CPU (the JVM, Spark's and Delta Lake's / Iceberg's classes); the
first test of a worker that asks for the ``spark`` fixture (tests/conftest.py) pays it, the later ones find
the session warm. The session is the one the consumer builds for itself when it runs locally
(``cdcd.spark.session.session()``: ``local[2]``, the cached Delta Lake and Iceberg jars and both formats'
extensions), with expressions interpreted instead of compiled (``INTERPRETED``), so ``cdcd.spark.job.run``
inside a test finds it active and uses it. A test that needs another session configuration (a JVM flag, other
jars, one format's extension alone) starts its own process, as ``cdcd spark run`` does.

After each test the session is put back as it was started (``SharedSession.reset``): the settings a test
or the consumer set (an Iceberg catalog on the test's target, a commit property) are unset or restored,
the catalogs forgotten, temporary views dropped, cached data released. A table a test left in the
session's own catalog fails that test: it would be in the next test's way.
"""

from __future__ import annotations

from pathlib import Path

from pyspark.sql import SparkSession

#: The shared session evaluates expressions interpreted, not compiled (docs/testing.md, "Suite time"): the tests'
#: merges are small, and compiling the code Spark generates for each of a Delta merge's statements was a quarter
#: of the session's CPU (three Spark integration files: 306 s of CPU compiled, 227 s interpreted). Spark's own
#: fallback when a compile fails; internal to Spark, so the consumer never sets it: every consumer and verify the
#: e2e tests start as a process runs Spark's default.
INTERPRETED = {"spark.sql.codegen.factoryMode": "NO_CODEGEN"}


def _stopped(spark: SparkSession) -> bool:
    return spark.sparkContext._jsc is None  # SparkContext.stop() drops it


def _jvm_ended() -> bool:
    """The worker's local JVM exited or was told to (its stdin closed: ``cdcd.spark.session.end_local_jvm``)."""
    from cdcd.spark.session import local_jvm

    proc = local_jvm()
    return proc is not None and (proc.poll() is not None or (proc.stdin is not None and proc.stdin.closed))


def _forget_jvm() -> None:
    """Drop PySpark's references to an ended JVM, so that the next session starts a new one (PySpark reuses its
    gateway while it is set, and every call through a dead one fails: "... does not exist in the JVM")."""
    from pyspark import SparkContext

    SparkContext._gateway = None
    SparkContext._jvm = None
    SparkContext._active_spark_context = None
    SparkSession._instantiatedSession = None
    SparkSession._activeSession = None


class SharedSession:
    """The worker's local session: started at the first ``get``, again if a test stopped it or its JVM."""

    def __init__(self) -> None:
        self._spark: SparkSession | None = None
        self._settings: dict[str, str] = {}

    def get(self) -> SparkSession:
        if _jvm_ended():
            _forget_jvm()
            self._spark = None
        if self._spark is None or _stopped(self._spark):
            from cdcd.spark.session import session

            self._spark = session()
            for k, v in INTERPRETED.items():
                self._spark.conf.set(k, v)
            self._settings = dict(self._spark.conf.getAll)
        return self._spark

    def reset(self) -> None:
        """Put the session back as it was started; raises when the test left a table in its catalog."""
        spark = self._spark
        if spark is not None and _jvm_ended():
            _forget_jvm()
            self._spark = None
            raise AssertionError("the test ended the worker's Spark JVM, which the Spark tests share: the code under "
                                 "test stopped a session it did not start (tests/support/spark.py); the next test "
                                 "starts a new JVM")
        if spark is None or _stopped(spark):
            return
        now = dict(spark.conf.getAll)
        for k in now.keys() - self._settings.keys():
            spark.conf.unset(k)
        for k, v in self._settings.items():
            if now.get(k) != v:
                spark.conf.set(k, v)
        state = spark._jsparkSession.sessionState()
        state.catalogManager().reset()  # current catalog and namespace, the catalogs' instances
        # the session catalog itself (not pyspark's Catalog.listTables: it looks up every table, a second a call)
        found = state.catalog().listTables("default")  # tables and temporary views, as TableIdentifiers
        names = [(found.apply(i).database().isDefined(), found.apply(i).table()) for i in range(found.size())]
        for in_database, name in names:
            if not in_database:
                spark.catalog.dropTempView(name)
        spark.catalog.clearCache()
        jsc = spark.sparkContext._jsc
        assert jsc is not None
        for rdd in list(jsc.getPersistentRDDs().values()):  # localCheckpoint()s a test did not release
            rdd.unpersist(False)
        left = [name for in_database, name in names if in_database]
        for name in left:
            spark.sql(f"DROP TABLE IF EXISTS default.`{name}`")
        if left:
            raise AssertionError(f"the test left tables {left} in the shared Spark session's catalog (database "
                                 f"default; dropped now): drop them at the end of the test (tests/support/spark.py)")

    def stop(self) -> None:
        if self._spark is not None and not _stopped(self._spark):
            self._spark.stop()
        self._spark = None


def consume_once(landing: Path, target: Path, fmt: str = "parquet") -> None:
    """``cdcd spark run --once`` in the worker's shared session (the ``spark`` fixture): what an e2e test needs
    when the consumer's process is not what it tests. Its process (signals, exit codes, the JVM's end, the CLI)
    is tested with a real ``cdcd spark run`` in test_spark_kill, test_spark_stop, test_spark_follow,
    test_spark_lakehouse and test_spark_cluster; a run here saves a JVM's start and warm-up (issue 32)."""
    from cdcd.spark.job import run

    assert run(str(landing), str(target), once=True, fmt=fmt) == 0, "the consumer's run failed: see the log above"


def verify_output(cfg: Path, target: Path) -> tuple[int, str]:
    """``cdcd verify -c CFG --target TARGET`` in the worker's shared session: its exit code and report."""
    import io

    from cdcd.config import load_config
    from cdcd.verify import verify

    out = io.StringIO()
    code = verify(load_config(cfg), str(target), out)
    return code, out.getvalue()


def verify_equal(cfg: Path, target: Path) -> str:
    """``verify_output`` that must find every table equal (exit 0); the report."""
    code, report = verify_output(cfg, target)
    assert code == 0, report
    return report
