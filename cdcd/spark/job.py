"""`cdcd spark run`: a Structured Streaming job from the landing zone into Spark tables.

``--once`` applies what is landed (and what lands meanwhile) and exits,
without a streaming query. Otherwise a stream watches ``LANDING/manifests/``; each micro-batch applies every
landed batch up to the newest manifest it saw, in batch seq order (seqs may
have gaps), one landing run at a time. The target's own journal
(``cdcd.spark.state``) is the commit record: a batch is skipped when the
target already holds it, whatever Spark's checkpoint says, and its consumed
marker is written only after the target commit. How a segment of batches
reaches the tables is the format's ``TableFormat`` (``cdcd.spark.strategy``), chosen once (``make_strategy``):
``cdcd.spark.parquet``, ``cdcd.spark.delta`` or ``cdcd.spark.iceberg``. Runnable with spark-submit
through ``cdcd/spark/consumer.py``:
``spark-submit cdcd/spark/consumer.py --landing L --target T [--once]``; its arguments are
``cdcd.spark.args`` (one parser for every way to start it).

It logs in the daemon's format (``cdcd.logging``): one line per merge, and a failed merge as
one error line naming the table, the batches and the fix where one is known (``describe``), the
Java or Python trace at debug only. ``--metrics-listen`` serves Prometheus metrics and
``/healthz`` (``cdcd.spark.metrics``).

SIGTERM and SIGINT (``cdcd.spark.stopping``, docs/spark.md "Stopping"): the merge in progress finishes, no other
starts, the streaming query, the session and the local JVM stop, exit 0; a second signal or ``--stop-timeout``
abandon the merge (exit 3). Exit codes: 0 done or stopped, 1 a merge or the query failed, 2 unusable arguments,
3 stopped without finishing the merge in progress.
"""

from __future__ import annotations

import argparse
import os
import signal
import sqlite3
import sys
import threading
import time
from pathlib import Path
from types import FrameType

import structlog
from pyspark.sql import DataFrame, SparkSession

from cdcd.daemon.exitcodes import ExitCode
from cdcd.errors import CdcdError, ConfigError
from cdcd.landing.layout import MANIFESTS
from cdcd.landing.manifest import Manifest
from cdcd.landing.objstore import Location, is_object_url
from cdcd.landing.reader import is_consumed, landed_seqs, mark_consumed, read_manifest
from cdcd.landing.zone import read_zone_id
from cdcd.logging import configure_logging, get_logger
from cdcd.spark import args as arguments
from cdcd.spark.args import DEFAULT_BUCKETS, DEFAULT_LEASE_S, FORMATS
from cdcd.spark.failure import Failure, describe
from cdcd.spark.formats import lakehouse_format
from cdcd.spark.lakehouse import Lakehouse
from cdcd.spark.lease import hold_target
from cdcd.spark.metastore import CatalogRefused, Registrar, java_options, local_settings
from cdcd.spark.metrics import MetricsServer, Progress
from cdcd.spark.objtarget import PARQUET_REFUSED, open_store, spark_url
from cdcd.spark.parquet import Parquet
from cdcd.spark.session import (
    end_local_jvm,
    halt_jvm,
    object_store_conf,
    quiet_python_loggers,
    session,
    stop_local,
    under_spark_submit,
    use_metastore,
    use_object_store,
)
from cdcd.spark.state import ConsumerState, ForeignZone, TargetLocked, TargetStore
from cdcd.spark.stopping import DEFAULT_STOP_TIMEOUT_S, GUARD, JVM_EXIT_S, STOP_SIGNALS
from cdcd.spark.strategy import Segment, TableFormat

__all__ = ["DEFAULT_BUCKETS", "FORMATS", "Consumer", "Failure", "describe", "main", "run"]

#: Events applied in one merge at most: each merge has a fixed cost of a few Spark jobs, so
#: all visible batches go into one merge unless that would make it too large for memory.
MAX_SEGMENT_EVENTS = 2_000_000

_log = get_logger("cdcd.spark")


def make_strategy(fmt: str, store: TargetStore, buckets: int) -> TableFormat:
    """The strategy of the target format ``fmt``; a Delta Lake or Iceberg target is marked as the format's."""
    if fmt == "parquet":
        return Parquet(store, buckets)
    strategy = lakehouse_format(fmt, store.target)
    strategy.claim(store.state_dir)
    return strategy


class MergeFailed(CdcdError):
    """A merge failed; its error line is logged already (``Failure``)."""

    def __init__(self, failure: Failure) -> None:
        super().__init__(f"batches {failure.batches}{f' of {failure.table}' if failure.table else ''}: "
                         f"{failure.error}")
        self.failure = failure


class Consumer:
    """Applies landed batches through the format's strategy; for the stream handler and the start-up catch-up."""

    def __init__(self, spark: SparkSession, landing: Path, target: Path, fmt: str = "parquet",
                 buckets: int = DEFAULT_BUCKETS, progress: Progress | None = None,
                 stop: threading.Event | None = None) -> None:
        self.spark = spark
        self.landing = landing
        self.fmt = fmt
        self.store = open_store(target)
        self.lock = threading.Lock()
        self.stopping = False
        #: set by a stop signal: the merge in progress finishes, no other starts (the next run applies them)
        self.stop = stop if stop is not None else threading.Event()
        self.failed: CdcdError | None = None  # a merge of the stream failed: the loop stops and exits 1
        self.registrar: Registrar | None = None  # --register-tables: new tables get their names after the commit
        self.state: ConsumerState = self.store.recover()
        self.strategy = make_strategy(fmt, self.store, buckets)
        self.applied_events = 0
        self.applied_seconds = 0.0
        self.progress = progress if progress is not None else Progress(landing, fmt)
        self.progress.applied_seq = self.state.applied_seq
        self.progress.tables = {t: (None, s.watermark) for t, s in self.state.tables.items()}
        if self.state.applied_seq in landed_seqs(landing):
            self.progress.applied_created_at = read_manifest(landing, self.state.applied_seq).created_at

    def on_micro_batch(self, df: DataFrame, batch_id: int) -> None:
        # The micro-batch's new manifests are the newest ones (manifests appear in seq order), so
        # applying every visible batch covers them without a Spark job to read them; the journal,
        # not Spark's checkpoint, says what is already applied.
        with self.lock:
            if self.stopping:  # fail the micro-batch: Spark must not count it as done
                raise InterruptedError("cdcd-spark: stopping")
            if self.failed is not None:  # the loop stops the query; the next run applies what is pending
                return
            try:
                self.apply_upto(max(landed_seqs(self.landing), default=0))
            except MergeFailed as exc:  # logged; not raised into Spark, whose report would repeat it with traces
                self.failed = exc
            except CatalogRefused as exc:  # the batches are committed; the name is the operator's to free
                _log.error(str(exc))
                self.failed = exc

    def apply_upto(self, upto: int) -> None:
        zone = self._check_zone()
        pending = [s for s in landed_seqs(self.landing) if self.state.applied_seq < s <= upto]
        for seq in landed_seqs(self.landing):  # committed before a crash that came before the marker
            if seq <= self.state.applied_seq and not is_consumed(self.landing, seq):
                mark_consumed(self.landing, seq)
        manifests = [(s, read_manifest(self.landing, s)) for s in pending]
        segment: list[tuple[int, Manifest]] = []
        size = 0
        for seq, manifest in manifests:
            self._same_zone(zone, seq, manifest)
            # one daemon run per merge: the dedupe of re-delivered events relies on it
            if segment and (manifest.run_id != segment[0][1].run_id or size >= MAX_SEGMENT_EVENTS):
                if self.stop.is_set():
                    return
                self._apply_segment(segment)
                segment, size = [], 0
            segment.append((seq, manifest))
            size += manifest.event_count
        if segment and not self.stop.is_set():
            self._apply_segment(segment)

    def _check_zone(self) -> str | None:
        """Refuse a landing zone this target was not built from (docs/landing-format.md, zone identity)."""
        zone = read_zone_id(self.landing)
        note = self.store.check_zone(zone, self.landing, self.state.applied_seq)
        if note:
            _log.info(note)
        return zone

    def _same_zone(self, zone: str | None, seq: int, manifest: Manifest) -> None:
        other = manifest.zone_id  # absent in version 1 manifests
        if zone is not None and other is not None and other != zone:
            raise ForeignZone(f"landing zone {self.landing}: batch {seq} belongs to zone {other}, not to this "
                              f"zone ({zone}); remove the batches copied in from another zone")

    def _apply_segment(self, batches: list[tuple[int, Manifest]]) -> None:
        started, wall = time.monotonic(), time.time()
        segment = Segment(self.landing, batches)
        try:
            self.store.guard()  # a target on object storage: its lease still held
            tables = sorted(segment.tables())
            self.strategy.files_before(tables)
            applied = self.strategy.apply(self.spark, segment, self.state.tables)
            new_state = ConsumerState(segment.last, dict(self.state.tables))
            new_state.tables.update(applied.tables)
            journal = {"state": new_state.to_json(), "files": applied.files, "buckets": applied.buckets}
            self.state = self.store.commit(journal)
            for seq, _ in batches:
                mark_consumed(self.landing, seq)
        except Exception as exc:
            failure = describe(self._lease_lost() or exc, self.landing, self.store.target, self.fmt, batches)
            failure.log(self.fmt)
            self.progress.failures += 1
            raise MergeFailed(failure) from exc
        if self.registrar is not None:  # after the commit: a name is only given to a table that exists
            self.registrar.register(applied.tables)
        took = time.monotonic() - started
        self.applied_events += applied.events
        self.applied_seconds += took
        try:
            added, rewritten = self.strategy.files_after(applied, tables, wall)
        except (OSError, ValueError, sqlite3.Error) as exc:  # the merge is committed: its line goes out without them
            _log.warning("the merge's files not counted", error=str(exc), error_type=type(exc).__name__)
            added = rewritten = None
        names = [f"{s}.{t}" for s, t in tables]
        _log.info("merge applied", batches=f"{segment.first}..{segment.last}", tables=names, events=applied.events,
                  seconds=round(took, 3), files_added=added, files_rewritten=rewritten, format=self.fmt,
                  steps={t: {j: round(s, 3) for j, s in js.items()} for t, js in applied.timings.items()})
        p = self.progress
        p.merge_seconds.observe(took)
        p.batches, p.events = p.batches + len(batches), p.events + applied.events
        p.tables = {**p.tables, **{t: (segment.last if t in names else p.tables.get(t, (None, ""))[0], s.watermark)
                                   for t, s in self.state.tables.items()}}
        p.applied_created_at = batches[-1][1].created_at
        p.applied_seq = self.state.applied_seq


    def _lease_lost(self) -> TargetLocked | None:
        """The lease's loss, when that ended the merge: the lease fenced the JVM (``lease.Lease.fence``), and the
        JVM's dropped connection is only its consequence."""
        try:
            self.store.guard()
        except TargetLocked as exc:
            return exc
        return None


def run(
    landing: str,
    target: str,
    once: bool,
    fmt: str = "delta",
    checkpoint: str | None = None,
    buckets: int = DEFAULT_BUCKETS,
    dedicated: bool = False,
    metrics_listen: tuple[str, int] | None = None,
    stop_timeout: float = DEFAULT_STOP_TIMEOUT_S,
    lease_s: float = DEFAULT_LEASE_S,
    register: bool = False,
) -> int:
    """Run the consumer; the exit code: 0 done or stopped by SIGTERM/SIGINT, 1 failed, 2 unusable arguments,
    3 stopped without finishing the merge in progress (a second signal, or ``stop_timeout`` seconds after the
    first: ``cdcd.spark.stopping``).

    ``dedicated``: the process runs this consumer alone (``cdcd spark run``, the module, spark-submit): a local
    session it starts loads the extension of ``fmt`` only (``session.session``), the process takes SIGTERM and
    SIGINT (on the main thread), and the session and its local JVM are stopped before the target is unlocked.
    ``metrics_listen``: (host, port) of /metrics and /healthz (``cdcd.spark.metrics``). ``register``: the Delta
    tables by name in the session catalog (``cdcd.spark.metastore``)."""
    if dedicated and GUARD.install():
        GUARD.limit_s = stop_timeout
        GUARD.on_force(_end_jvm_now)
    stop = GUARD.requested if GUARD.installed else threading.Event()
    if not structlog.is_configured():  # run in-process by other code (tests, the CDS training): log to stderr
        structlog.configure(logger_factory=structlog.PrintLoggerFactory(file=sys.stderr))
    if fmt not in FORMATS:
        _log.error(f"--format {fmt!r} is not one of {', '.join(FORMATS)}")
        return ExitCode.USAGE
    if stop_timeout <= 0:
        _log.error(f"--stop-timeout {stop_timeout:g} is not a number of seconds above 0")
        return ExitCode.USAGE
    landing_path, target_path = Path(landing), Path(target)
    if is_object_url(target) and fmt == "parquet":
        _log.error(PARQUET_REFUSED)
        return ExitCode.USAGE
    if is_object_url(landing) or is_object_url(target):  # boto3 finds the store from the URL; Spark uses S3A
        use_object_store()
    if register:
        problem = _metastore_for(fmt, target)
        if problem:
            _log.error(problem)
            return ExitCode.USAGE
    if not is_object_url(landing) and not landing_path.is_dir():
        _log.error(f"landing zone {landing} does not exist; point --landing at the daemon's landing.path")
        return ExitCode.USAGE
    progress = Progress(landing_path, fmt)
    server = None
    if metrics_listen is not None:
        server = MetricsServer(*metrics_listen, progress)
        try:
            server.start()
        except ConfigError as exc:
            _log.error(str(exc))
            return ExitCode.USAGE
    try:
        try:  # before the session starts: a consumer refused here costs no JVM
            release = hold_target(target_path, lease_s, on_lost=halt_jvm)
        except CdcdError as exc:  # held by another consumer (2), or its store refused or unreachable (1)
            _log.error(str(exc))
            return ExitCode.USAGE if isinstance(exc, TargetLocked) else ExitCode.FAILURE
        try:
            if fmt != "parquet":  # classpath, session extensions, the target's format
                problem = lakehouse_format(fmt, target_path).prepare_run(dedicated)
                if problem:
                    _log.error(problem)
                    return ExitCode.USAGE
            if stop.is_set():  # before anything started: no session, no JVM, nothing written
                _log.info("stopped before the session started")
                return ExitCode.OK
            return _run_locked(landing_path, target_path, once, fmt, checkpoint, buckets, progress, stop, dedicated,
                               register and fmt == "delta")
        finally:
            release()  # the target's lock or lease; the local JVM writes no more: it has exited
    finally:
        if progress.phase != "failed":
            progress.phase = "stopped"
        if server is not None:
            server.close()


def _metastore_for(fmt: str, target: str) -> str | None:
    """--register-tables: the session's Hive support, set before it starts; the reason when it cannot be."""
    if fmt == "parquet":  # a Parquet mirror's buckets are swapped under its journal: a reader by name could see
        return ("--register-tables with --format parquet: refused: a plain Parquet table over the mirror could read "
                "a bucket while a merge swaps it; use --format delta or iceberg (docs/spark.md, Tables by name)")
    if fmt == "iceberg":
        _log.info("--register-tables: Iceberg tables are in the catalog cdcd already: "
                  "spark.table('cdcd.tables.<schema>.<table>') (docs/spark.md, Tables by name)")
        return None
    if under_spark_submit():  # the cluster's metastore (hive-site.xml, --conf spark.hadoop.hive.metastore.uris)
        use_metastore({"spark.sql.catalogImplementation": "hive"}, "")
    elif is_object_url(target):
        return (f"--register-tables with --target {target}: a local session's embedded metastore is a file under "
                "a local target; run under spark-submit with the cluster's metastore (--conf spark.hadoop.hive."
                "metastore.uris=thrift://HOST:9083) (docs/spark.md, Tables by name)")
    else:
        use_metastore(local_settings(Path(target)), java_options(Path(target)))
    return None


def _end_jvm_now() -> None:
    """A forced exit's step: the local JVM ended, so that nothing writes to the target once its lock is released."""
    end_local_jvm(JVM_EXIT_S)


def _run_locked(landing_path: Path, target_path: Path, once: bool, fmt: str, checkpoint: str | None,
                buckets: int, progress: Progress, stop: threading.Event, dedicated: bool, register: bool) -> int:
    spark = session(fmt)
    if is_object_url(landing_path) or is_object_url(target_path):
        object_store_conf(spark)
    code: int = ExitCode.FAILURE
    try:
        code = _apply(spark, landing_path, target_path, once, fmt, checkpoint, buckets, progress, stop, register)
        return code
    finally:
        if dedicated:  # the work is done: stopping the session and its JVM is bounded (``TEARDOWN_S``)
            GUARD.decided(code)
            try:
                stop_local(spark, JVM_EXIT_S)
            except Exception as exc:  # the JVM is gone already (it failed): the exit code stands
                _log.warning("stopping the Spark session failed", error=str(exc).split("\n", 1)[0],
                             error_type=type(exc).__name__)


def _apply(spark: SparkSession, landing_path: Path, target_path: Path, once: bool, fmt: str,
           checkpoint: str | None, buckets: int, progress: Progress, stop: threading.Event,
           register: bool = False) -> int:
    shown = Location.parse(landing_path).url if is_object_url(landing_path) else str(landing_path)
    _log.info("consumer starting", master=spark.sparkContext.master, landing=shown,
              target=spark_url(target_path), format=fmt, once=once)
    progress.phase = "catching up"
    try:
        consumer = Consumer(spark, landing_path, target_path, fmt, buckets, progress, stop)
        if register:  # tables created before the option was on get their names now
            consumer.registrar = _registrar(spark, consumer.strategy)
            consumer.registrar.register(consumer.state.tables)
        consumer.apply_upto(max(landed_seqs(landing_path), default=0))
        if once:  # and what landed during that catch-up, as a stream would: no streaming query to start
            consumer.apply_upto(max(landed_seqs(landing_path), default=0))
    except (ForeignZone, CatalogRefused) as exc:  # arguments, or a catalog, that do not go with the target
        _log.error(str(exc))
        return _failed(progress, str(exc), ExitCode.USAGE)
    except MergeFailed as exc:  # logged with its table, batches and fix; the next run retries it
        return _failed(progress, str(exc), ExitCode.FAILURE)
    except Exception as exc:
        failure = describe(exc, landing_path, target_path, fmt, [])
        _log.error("consumer failed", error=failure.error, fix=failure.fix)
        _log.debug("consumer failed: trace", trace=failure.trace)
        return _failed(progress, failure.error, ExitCode.FAILURE)
    if once or stop.is_set():
        if stop.is_set():
            progress.phase = "stopping"
        _done(consumer)
        return ExitCode.OK
    return _stream(spark, consumer, landing_path, checkpoint or spark_url(target_path, "checkpoint"))


def _registrar(spark: SparkSession, strategy: TableFormat) -> Registrar:
    implementation = spark.conf.get("spark.sql.catalogImplementation", None)
    if implementation != "hive" or not isinstance(strategy, Lakehouse):
        raise CatalogRefused(f"--register-tables: the session's catalog is {implementation!r}, not a Hive "
                             "metastore: start spark-submit with --conf spark.sql.catalogImplementation=hive (or "
                             "without a --conf that sets it otherwise) (docs/spark.md, Tables by name)")
    return Registrar(spark, strategy)


def _failed(progress: Progress, reason: str, code: int) -> int:
    progress.phase, progress.reason = "failed", reason
    return code


def _done(consumer: Consumer) -> None:
    rate = consumer.applied_events / consumer.applied_seconds if consumer.applied_seconds > 0 else 0.0
    _log.info("done", events=consumer.applied_events, merge_seconds=round(consumer.applied_seconds, 3),
              events_per_s=round(rate, 1), stopped=consumer.stop.is_set())


def _stream(spark: SparkSession, consumer: Consumer, landing: Path, checkpoint: str) -> int:
    """Apply new manifests as they appear, until a stop signal (``consumer.stop``); the exit code."""
    stop = consumer.stop
    if not GUARD.installed and threading.current_thread() is threading.main_thread():
        # run in-process by other code: SIGTERM/SIGINT end the stream (``cdcd spark run`` has its guard)
        def on_signal(signum: int, frame: FrameType | None) -> None:
            stop.set()

        for sig in STOP_SIGNALS:
            signal.signal(sig, on_signal)
    if is_object_url(landing):  # a prefix, not a directory: nothing to create
        manifests = f"{Location.parse(landing).url}/{MANIFESTS}"
    else:
        (landing / MANIFESTS).mkdir(exist_ok=True)
        manifests = str(landing / MANIFESTS)
    stream = (
        spark.readStream.format("text")
        .option("wholetext", "true")
        .option("maxFileAge", "3650d")
        .option("ignoreMissingFiles", "true")  # consumed batches may be expired meanwhile
        .load(manifests)
    )
    writer = stream.writeStream.foreachBatch(consumer.on_micro_batch).option("checkpointLocation", checkpoint)
    writer = writer.trigger(processingTime="1 second")
    query = writer.start()
    progress = consumer.progress
    progress.tick()
    progress.phase = "following"
    _log.info("following the landing zone", landing=str(landing), checkpoint=checkpoint)
    try:
        while query.isActive:
            progress.tick()
            if stop.is_set() or consumer.failed is not None:
                progress.phase = "stopping"
                with consumer.lock:  # waits for the running micro-batch to finish
                    consumer.stopping = True
                query.stop()
                break
            query.awaitTermination(1)
    except Exception as exc:
        found = describe(exc, landing, consumer.store.target, consumer.fmt, [])
        _log.error("streaming query failed", error=found.error, fix=found.fix)
        _log.debug("streaming query failed: trace", trace=found.trace)
        return _failed(progress, found.error, ExitCode.FAILURE)
    if consumer.failed is not None:
        return _failed(progress, str(consumer.failed), ExitCode.FAILURE)
    ended = query.exception()
    if ended is not None and not consumer.stopping:
        found = describe(ended, landing, consumer.store.target, consumer.fmt, [])
        _log.error("streaming query failed", error=found.error, fix=found.fix)
        _log.debug("streaming query failed: trace", trace=found.trace)
        return _failed(progress, found.error, ExitCode.FAILURE)
    _done(consumer)
    return ExitCode.OK


def configure(level: str, fmt: str) -> None:
    """cdcd's log on stderr in the daemon's format; py4j and PySpark quiet (``session.quiet_python_loggers``)."""
    configure_logging(level, fmt, stream="stderr")  # type: ignore[arg-type]
    quiet_python_loggers()


def run_args(args: argparse.Namespace) -> int:
    """Run with the arguments of ``cdcd.spark.args`` (``cdcd spark run``, ``python -m cdcd.spark.consumer``)."""
    GUARD.install()  # before the logging is configured: a stop signal from now on ends it with its exit code
    configure(args.log_level, args.log_format)
    os.environ["CDCD_DELTA_READERS"] = args.delta_readers  # read where the Delta target is made (cdcd.spark.delta)
    return run(args.landing, args.target, args.once, args.format, args.checkpoint, args.buckets, dedicated=True,
               metrics_listen=args.metrics_listen, stop_timeout=args.stop_timeout, lease_s=args.lease_seconds,
               register=args.register_tables)


def main(argv: list[str] | None = None) -> int:
    return run_args(arguments.parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
