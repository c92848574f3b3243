"""The Spark session of the job and of ``cdcd verify``'s Delta Lake / Iceberg reader, built in one place.

Started locally (``cdcd spark run``, tests), the session gets ``local[2]``, the
cached Delta Lake / Iceberg jars and both formats' settings
(``cdcd.spark.jars.local_settings``) and the heap for large rows. Under
spark-submit, the master and ``--conf`` values spark-submit was given stand; a
Delta Lake or Iceberg run adds its format's extension to them before the
session starts (the jars come from ``--packages`` or ``--jars``).

A local session's JVM logs in cdcd's format (``spark_logging``): Spark's log4j lines at ERROR (WARN and Java
traces at ``--log-level debug``) and the JVM's own output go through a pipe into cdcd's log, py4j's and
PySpark's Python loggers are quiet below ERROR, and ``spark.sql.warehouse.dir`` is a temporary directory
removed at exit (the job's tables are paths or in its own Iceberg catalog: nothing is written there), so no
``spark-warehouse/`` appears in the working directory.

The local JVM ignores SIGTERM and SIGINT (``_start_jvm``): a stop signal sent to the whole process group or
control group (a shell's ^C, systemd's ``KillMode=control-group``, ``kill -- -PGID``) must not end it under a
merge the consumer is finishing; the consumer hears the signal (``cdcd.spark.stopping``) and ends the JVM in
order (``end_local_jvm``). The JVM still exits when the consumer's process is gone, however it ended: it exits
when its stdin closes (PySpark's gateway).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
from collections.abc import Callable, Iterator
from typing import IO, Any

from pyspark import SparkConf, SparkContext, java_gateway
from pyspark.java_gateway import launch_gateway
from pyspark.sql import SparkSession

from cdcd.logging import get_level, get_logger
from cdcd.spark import cds, jars
from cdcd.spark.jars import local_settings

_log = get_logger("cdcd.spark")
_jvm_log = get_logger("spark")

#: Session settings of each table format, fixed when the session starts (Spark refuses to change them later).
FORMAT_SETTINGS = {
    "delta": {"spark.sql.extensions": jars.DELTA_EXTENSION, "spark.sql.catalog.spark_catalog": jars.DELTA_CATALOG},
    "iceberg": {"spark.sql.extensions": jars.ICEBERG_EXTENSION},
}


def under_spark_submit() -> bool:
    """True when spark-submit started the JVM: its --master and --conf values must stand."""
    return "PYSPARK_GATEWAY_PORT" in os.environ


#: JVM flags of a local session (``CDCD_SPARK_JAVA_OPTIONS`` replaces them; docs/spark-internals.md, performance).
#: C1 only: a merge runs a wide variety of code (planning, Delta's log, code generated per statement) a few
#: times, and the C2 compiler spent more CPU compiling it than its code saved (a third of the JVM's CPU in a
#: one-shot run of a million events). The parallel collector: less CPU than G1 on two cores. The code cache
#: at the size the JVM reserves with C2: with C1 only it defaults to 48 MB, which a consumer filled in six
#: minutes; the JVM then stops compiling and fails where it needs room there ("Out of space in CodeCache").
JAVA_OPTIONS = "-XX:TieredStopAtLevel=1 -XX:ReservedCodeCacheSize=240m -XX:+UseParallelGC"


def large_row_settings(cds_archive: bool = True) -> dict[str, str]:
    """Local-session settings that let one row hold a value of tens of MB (docs/spark.md, memory).

    The JVM heap is fixed when the local session starts: ``CDCD_SPARK_DRIVER_MEMORY`` (default 2g,
    Spark's own default of 1g runs out on a 51 MB value). Under spark-submit, pass them as --conf.
    The JVM's flags too (``CDCD_SPARK_JAVA_OPTIONS``, default ``JAVA_OPTIONS``), and the class-data
    sharing archive when the bootstrap built one (``cdcd.spark.cds``) and ``cds_archive``.
    """
    archive = cds.java_options() if cds_archive else ""
    flags = " ".join(f for f in (os.environ.get("CDCD_SPARK_JAVA_OPTIONS", JAVA_OPTIONS), archive) if f)
    return {"spark.driver.memory": os.environ.get("CDCD_SPARK_DRIVER_MEMORY", "2g"),
            "spark.kryoserializer.buffer.max": "1g",
            "spark.driver.extraJavaOptions": flags}


def _submitted_session(fmt: str) -> None:
    """Start spark-submit's session with the format's settings added to the ones given with ``--conf``."""
    SparkContext._ensure_initialized()  # attaches to spark-submit's JVM, so that SparkConf() shows its values
    conf = SparkConf()
    builder = SparkSession.builder
    for k, v in FORMAT_SETTINGS[fmt].items():
        have = conf.get(k, "") or ""
        if k == "spark.sql.extensions" and have and v not in have.split(","):
            v = f"{have},{v}"
        elif have:
            v = have
        builder = builder.config(k, v)
    if _metastore and not conf.contains("spark.sql.catalogImplementation"):
        builder = builder.config("spark.sql.catalogImplementation", "hive")
    builder.getOrCreate()


#: S3A for an object-store landing zone: ``use_object_store`` sets it before the session starts.
_object_store: list[bool] = [False]
#: Tables by name (``use_metastore``): the settings of a local session's Hive metastore, and its JVM flags.
_metastore: dict[str, str] = {}
_metastore_java: list[str] = []


def use_metastore(settings: dict[str, str], java_options: str) -> None:
    """Start the session with Hive support (``cdcd.spark.metastore``): a local session with ``settings`` (its
    embedded metastore); under spark-submit only ``spark.sql.catalogImplementation=hive`` where --conf did not
    set it: the cluster's metastore settings stand. Static settings: called before the session starts."""
    _metastore.update(settings)
    _metastore_java[:] = [java_options]


def use_object_store() -> None:
    """The landing zone is on object storage: a local session starts with S3A's jars (``jars.local_settings``)."""
    _object_store[0] = True


def object_store_conf(spark: SparkSession) -> None:
    """Point Spark's S3A at the store the landing reader uses, from the same environment (boto3's names):
    AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL (then path-style addressing), AWS_REGION, AWS_ACCESS_KEY_ID and
    AWS_SECRET_ACCESS_KEY (with AWS_SESSION_TOKEN). ``s3://`` paths go to S3A too. A value given with
    ``--conf spark.hadoop.fs.s3a.*`` stands. The keys travel in the job's Hadoop configuration to the executors
    (their environment is the worker's) and are never logged (Spark redacts them in its UI)."""
    conf = spark.sparkContext._jsc.hadoopConfiguration()
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    wanted = {"fs.s3.impl": "org.apache.hadoop.fs.s3a.S3AFileSystem", "fs.s3a.endpoint": endpoint,
              "fs.s3a.path.style.access": "true" if endpoint else None,
              "fs.s3a.endpoint.region": os.environ.get("AWS_REGION"),
              "fs.s3a.access.key": os.environ.get("AWS_ACCESS_KEY_ID"),
              "fs.s3a.secret.key": os.environ.get("AWS_SECRET_ACCESS_KEY"),
              "fs.s3a.session.token": os.environ.get("AWS_SESSION_TOKEN")}
    if wanted["fs.s3a.session.token"]:
        wanted["fs.s3a.aws.credentials.provider"] = "org.apache.hadoop.fs.s3a.TemporaryAWSCredentialsProvider"
    for key, value in wanted.items():
        if value and conf.get(key) is None:
            conf.set(key, value)


APP_NAME = "cdcd-spark-consumer"
#: The JVM's log4j lines: a marker, the level, the logger, the message, at debug the Java trace; split by the
#: unit separator, line breaks escaped (``%enc{..}{CRLF}``): one line per event, parsed by ``_pump``.
_SEP = "\x1f"
_JVM_MARK = "cdcd-jvm"
_JVM_LEVELS = {"TRACE": "debug", "DEBUG": "debug", "INFO": "info", "WARN": "warning", "ERROR": "error",
               "FATAL": "error"}
#: What the JVM and Spark print at start outside log4j (Spark: a PySpark JVM counts as its shell): debug lines.
#: What the JVM prints around Spark's own log, shown at debug only. ``SLF4J:``: a library of the object-store jars
#: finds no SLF4J binding and says so in three lines; its messages then go nowhere, nothing failed.
_JVM_NOTICES = re.compile(r"^(WARNING: Using incubator modules|Picked up (JAVA_TOOL|_JAVA)_OPTIONS|Setting default "
                          r"log level to|To adjust logging level use sc.setLogLevel|SLF4J: )")
#: PySpark's own loggers of the SQL errors it converts (their own JSON handler, before the job reports the error).
_PYSPARK_LOGGERS = ("DataFrameQueryContextLogger", "SQLQueryContextLogger")
_files: dict[str, str] = {}


def _verbose() -> bool:
    return get_level() == "debug"


class _Py4jOnRootLogger(logging.Filter):
    """py4j logs some lines through the root logger, not its own: ``logging.exception("Exception while sending
    command.")`` when a call (a Java object's release at garbage collection, say) finds the JVM gone. They are
    shown at debug only, as debug lines: the consumer reports a failure itself, with its table, batches and fix."""

    def filter(self, record: logging.LogRecord) -> bool:
        if f"{os.sep}py4j{os.sep}" not in record.pathname:
            return True
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return _verbose()


def quiet_python_loggers() -> None:
    """py4j (a line per connection it closes) and PySpark's error loggers: ERROR and up, unless cdcd logs at debug;
    py4j's lines on the root logger at debug only (``_Py4jOnRootLogger``)."""
    logging.getLogger("py4j").setLevel(logging.INFO if _verbose() else logging.ERROR)
    for name in _PYSPARK_LOGGERS:
        logging.getLogger(name).setLevel(logging.DEBUG if _verbose() else logging.CRITICAL + 1)
    root = logging.getLogger()
    if not any(isinstance(f, _Py4jOnRootLogger) for f in root.filters):
        root.addFilter(_Py4jOnRootLogger())


def log4j_properties(verbose: bool) -> str:
    """The local JVM's log4j 2 configuration: one parseable line per event on stderr; ERROR (debug: WARN, traces)."""
    trace = f"{_SEP}%enc{{%throwable}}{{CRLF}}" if verbose else ""
    level = "warn" if verbose else "error"
    sep = "\\u001f"  # a properties file's escape of the separator
    pattern = f"{_JVM_MARK}{sep}%level{sep}%c{sep}%enc{{%m}}{{CRLF}}{trace.replace(_SEP, sep)}%n"
    return "\n".join([
        "status = error",
        "name = cdcd",
        "appender.out.type = Console",
        "appender.out.name = out",
        "appender.out.target = SYSTEM_ERR",
        "appender.out.layout.type = PatternLayout",
        f"appender.out.layout.pattern = {pattern}",
        "appender.out.layout.alwaysWriteExceptions = false",
        f"rootLogger.level = {level}",
        "rootLogger.appenderRef.out.ref = out",
        # Delta logs "Failed to translate filter EqualTo(__delta_internal_is_row_deleted,0)" at ERROR whenever
        # it reads a file with a deletion vector: the filter is applied after the Parquet read instead of in
        # it, nothing failed. Shown at debug only, so that an ERROR in the consumer's log is one to act on.
        "logger.deltafilter.name = org.apache.spark.sql.delta.DeltaParquetFileFormat",
        f"logger.deltafilter.level = {'warn' if verbose else 'fatal'}",
    ]) + "\n"


def _unescape(text: str) -> str:
    return text.replace("\\n", "\n").replace("\\r", "\r")


def _jvm_line(line: str) -> None:
    """One line of the local JVM's output, as a cdcd log line (logger ``spark``)."""
    parts = line.split(_SEP)
    if len(parts) >= 4 and parts[0] == _JVM_MARK:
        fields: dict[str, Any] = {"logger": parts[2]}
        if len(parts) > 4 and parts[4]:
            fields["trace"] = _unescape(_SEP.join(parts[4:]))
        getattr(_jvm_log, _JVM_LEVELS.get(parts[1], "warning"))(_unescape(parts[3]), **fields)
    elif _JVM_NOTICES.match(line):
        _jvm_log.debug(line, logger="jvm")
    else:  # not expected: shown
        _jvm_log.warning(line, logger="jvm")


def _pump(stream: IO[bytes]) -> None:
    try:
        for raw in iter(stream.readline, b""):
            line = raw.decode(errors="replace").rstrip("\r\n")
            if line.strip():
                _jvm_line(line)
    except Exception as exc:  # the pump must keep going as long as it can: say so if it cannot
        _log.error("reading the Spark JVM's output failed", error=str(exc), error_type=type(exc).__name__)


def warehouse_dir() -> str:
    """The local session's ``spark.sql.warehouse.dir``: a temporary directory (removed at exit), never the
    working directory's ``spark-warehouse/``: every table of the job is a path or in its ``cdcd`` catalog."""
    if "warehouse" not in _files:
        _files["warehouse"] = tempfile.mkdtemp(prefix="cdcd-spark-warehouse-")
        atexit.register(shutil.rmtree, _files["warehouse"], ignore_errors=True)
    return _files["warehouse"]


def _ignore_stop_signals(then: Callable[[], Any] | None) -> Callable[[], None]:
    """A ``preexec_fn``: ``then`` (PySpark's own, which ignores SIGINT), and SIGTERM and SIGINT ignored in the
    child. Ignored signals stay ignored across exec, through spark-submit's shell scripts into the JVM, which
    does not install its shutdown handlers for a signal ignored at its start."""

    def preexec() -> None:
        if then is not None:
            then()
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)

    return preexec


@contextlib.contextmanager
def _jvm_ignoring_stop_signals() -> Iterator[None]:
    """PySpark's ``launch_gateway`` starts the JVM with its own ``preexec_fn`` (it overrides one given in
    ``popen_kwargs``): for the call, its ``Popen`` adds ``_ignore_stop_signals`` to it."""
    original = java_gateway.Popen  # type: ignore[attr-defined]

    def popen(*args: Any, **kwargs: Any) -> subprocess.Popen[bytes]:
        kwargs["preexec_fn"] = _ignore_stop_signals(kwargs.get("preexec_fn"))
        return original(*args, **kwargs)

    java_gateway.Popen = popen  # type: ignore[attr-defined,assignment]
    try:
        yield
    finally:
        java_gateway.Popen = original  # type: ignore[attr-defined]


def local_jvm() -> subprocess.Popen[bytes] | None:
    """The local session's JVM process, when this process started it (not under spark-submit)."""
    proc = getattr(SparkContext._gateway, "proc", None)
    return proc if isinstance(proc, subprocess.Popen) else None


def end_local_jvm(wait_s: float) -> int | None:
    """End the JVM this process started: its stdin closed (the gateway exits, running Spark's shutdown hooks),
    at most ``wait_s`` to exit, then SIGKILL. Its exit status (None: there was none of ours)."""
    proc = local_jvm()
    if proc is None:
        return None
    if proc.stdin is not None:
        with contextlib.suppress(OSError):  # closed already, or the JVM is gone (a broken pipe)
            proc.stdin.close()
    try:
        return proc.wait(wait_s)
    except subprocess.TimeoutExpired:
        _log.warning("the Spark JVM did not exit in time after its stdin closed: killed", pid=proc.pid,
                     waited_s=wait_s)
        proc.kill()
        return proc.wait(wait_s)


def halt_jvm() -> None:
    """End this process's Spark JVM at once, whatever it is doing: the consumer lost the target (its lease,
    ``cdcd.spark.lease``) and nothing it still has under way may commit. A local JVM is killed; under spark-submit
    the driver's JVM halts (``Runtime.halt``: no shutdown hooks), which ends this process's gateway too. The
    merge in progress then fails, and the consumer exits with the failure code."""
    local = local_jvm()
    if local is not None:
        _log.error("the Spark JVM is killed: the consumer lost its target", pid=local.pid)
        local.kill()
        return
    if SparkContext._jvm is None:  # no session started yet: nothing writes
        return
    _log.error("the Spark driver's JVM is halted: the consumer lost its target")
    with contextlib.suppress(Exception):  # the gateway's connection ends with the JVM
        SparkContext._jvm.java.lang.Runtime.getRuntime().halt(1)


def stop_local(spark: SparkSession, wait_s: float) -> None:
    """Stop the session and end its local JVM (``end_local_jvm``); under spark-submit, the session only.

    py4j's gateway is left as it is: closing its connections while its callback server's thread reads one of
    them (``foreachBatch``) blocks on that reader."""
    try:
        spark.stop()
    finally:
        end_local_jvm(wait_s)


def _start_jvm(settings: dict[str, str]) -> None:
    """Start the local session's JVM with its output piped into cdcd's log (``_pump``), unless one runs."""
    if SparkContext._gateway is not None:
        return
    fd, path = tempfile.mkstemp(prefix="cdcd-log4j2-", suffix=".properties")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(log4j_properties(_verbose()))
        conf = SparkConf(loadDefaults=False)
        for k, v in settings.items():
            conf.set(k, v)
        conf.set("spark.driver.extraJavaOptions",
                 f"{settings.get('spark.driver.extraJavaOptions', '')} -Dlog4j2.configurationFile={path}".strip())
        piped = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT}
        with _jvm_ignoring_stop_signals():
            gateway = launch_gateway(conf, popen_kwargs=piped)  # type: ignore[no-untyped-call]
        proc = getattr(gateway, "proc", None)
        if proc is not None and proc.stdout is not None:
            threading.Thread(target=_pump, args=(proc.stdout,), name="cdcd-spark-jvm-log", daemon=True).start()
        SparkContext._ensure_initialized(gateway=gateway)
    finally:
        os.unlink(path)  # log4j read it when the JVM started


def session(fmt: str = "parquet", only: bool = False) -> SparkSession:
    """The active session; under spark-submit the one it configured, else a local one.

    ``fmt`` (``delta``, ``iceberg``) adds that format's settings to a session that
    spark-submit starts; a local session has both formats' settings, or with ``only``
    (a process that serves ``fmt`` alone: ``cdcd spark run``) that format's alone,
    which starts faster.
    """
    quiet_python_loggers()
    if SparkSession.getActiveSession() is None and under_spark_submit() and fmt in FORMAT_SETTINGS:
        _submitted_session(fmt)
    builder = SparkSession.builder.appName(APP_NAME)
    if SparkSession.getActiveSession() is None and not under_spark_submit():
        # the cached Delta Lake / Iceberg jars (cdcd/spark/jars.py) and the heap for large rows
        settings = {"spark.master": "local[2]", "spark.app.name": APP_NAME, "spark.ui.enabled": "false",
                    "spark.sql.shuffle.partitions": "4", "spark.sql.warehouse.dir": warehouse_dir(),
                    **local_settings(fmt if only else None, _object_store[0]),
                    # the archive holds the class path of its training run: with S3A's jars the JVM refuses it
                    # and says so at warning level
                    **large_row_settings(cds_archive=not _object_store[0]), **_metastore}
        if _metastore_java:
            settings["spark.driver.extraJavaOptions"] += " " + _metastore_java[0]
        _start_jvm(settings)
        for k, v in settings.items():
            builder = builder.config(k, v)
    spark = builder.getOrCreate()
    # the mirror must read back with pyarrow: no INT96, instants in UTC
    spark.conf.set("spark.sql.parquet.outputTimestampType", "TIMESTAMP_MICROS")
    spark.conf.set("spark.sql.session.timeZone", "UTC")
    # Parquet writes: a column's values are dictionary-encoded until the dictionary reaches this size, then
    # re-encoded plain. Positions, keys and most text values are unique: Parquet's default of 1 MB spent a
    # tenth of a merge's CPU building dictionaries it then dropped; columns of few values keep theirs
    spark.conf.set("parquet.dictionary.page.size", "65536")
    # a merge reads one landed file per batch: list them on the driver instead of in a Spark job
    spark.conf.set("spark.sql.sources.parallelPartitionDiscovery.threshold", "1000000")
    return spark
