"""`cdcd spark run`: a Structured Streaming job from the landing zone into Spark tables.

The stream watches ``LANDING/manifests/``; each micro-batch applies every
landed batch up to the newest manifest it saw, in batch seq order (seqs may
have gaps), one landing run at a time. The target's own journal
(``cdcd.spark.state``) is the commit record: a batch is skipped when the
target already holds it, whatever Spark's checkpoint says, and its consumed
marker is written only after the target commit. Runnable with spark-submit:
``spark-submit cdcd/spark/consumer.py --landing L --target T [--once]``.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any

from pyspark.sql import DataFrame, SparkSession

from cdcd.landing.layout import MANIFESTS, manifest_name
from cdcd.landing.manifest import load_manifest
from cdcd.landing.reader import LandedFile, landed_seqs, mark_consumed, table_files
from cdcd.landing.zone import read_zone_id
from cdcd.spark.jars import local_settings
from cdcd.spark.merge import TableResult, apply_table
from cdcd.spark.state import ConsumerState, ForeignZone, TableState, TargetStore

DEFAULT_BUCKETS = 16
#: Events applied in one merge at most: each merge has a fixed cost of a few Spark jobs, so
#: all visible batches go into one merge unless that would make it too large for memory.
MAX_SEGMENT_EVENTS = 2_000_000
FORMATS = ("parquet", "delta", "iceberg")


def under_spark_submit() -> bool:
    """True when spark-submit started the JVM: its --master and --conf values must stand."""
    return "PYSPARK_GATEWAY_PORT" in os.environ


def large_row_settings() -> dict[str, str]:
    """Local-session settings that let one row hold a value of tens of MB (docs/spark.md, memory).

    The JVM heap is fixed when the local session starts: ``CDCD_SPARK_DRIVER_MEMORY`` (default 2g,
    Spark's own default of 1g runs out on a 51 MB value). Under spark-submit, pass them as --conf.
    """
    return {"spark.driver.memory": os.environ.get("CDCD_SPARK_DRIVER_MEMORY", "2g"),
            "spark.kryoserializer.buffer.max": "1g"}


def session() -> SparkSession:
    """The active session; under spark-submit the one it configured, else a local one."""
    builder = SparkSession.builder.appName("cdcd-spark-consumer")
    if SparkSession.getActiveSession() is None and not under_spark_submit():
        builder = (builder.master("local[2]").config("spark.ui.enabled", "false")
                   .config("spark.sql.shuffle.partitions", "4"))
        # the cached Delta Lake / Iceberg jars (cdcd/spark/jars.py) and the heap for large rows
        for k, v in {**local_settings(), **large_row_settings()}.items():
            builder = builder.config(k, v)
    spark = builder.getOrCreate()
    # the mirror must read back with pyarrow: no INT96, instants in UTC
    spark.conf.set("spark.sql.parquet.outputTimestampType", "TIMESTAMP_MICROS")
    spark.conf.set("spark.sql.session.timeZone", "UTC")
    # a merge reads one landed file per batch: list them on the driver instead of in a Spark job
    spark.conf.set("spark.sql.sources.parallelPartitionDiscovery.threshold", "1000000")
    return spark


def _log(message: str) -> None:
    print(f"cdcd-spark: {message}", file=sys.stderr, flush=True)


class Consumer:
    """Applies landed batches to the target; shared by the stream handler and the start-up catch-up."""

    def __init__(self, spark: SparkSession, landing: Path, target: Path, buckets: int = DEFAULT_BUCKETS) -> None:
        self.spark = spark
        self.landing = landing
        self.store = TargetStore(target)
        self.buckets = buckets
        self.lock = threading.Lock()
        self.stopping = False
        self.state: ConsumerState = self.store.recover()
        self.applied_events = 0
        self.applied_seconds = 0.0

    def on_micro_batch(self, df: DataFrame, batch_id: int) -> None:
        # The micro-batch's new manifests are the newest ones (manifests appear in seq order), so
        # applying every visible batch covers them without a Spark job to read them; the journal,
        # not Spark's checkpoint, says what is already applied.
        with self.lock:
            if self.stopping:  # fail the micro-batch: Spark must not count it as done
                raise InterruptedError("cdcd-spark: stopping")
            self.apply_upto(max(landed_seqs(self.landing), default=0))

    def apply_upto(self, upto: int) -> None:
        zone = self._check_zone()
        pending = [s for s in landed_seqs(self.landing) if self.state.applied_seq < s <= upto]
        for seq in landed_seqs(self.landing):  # committed before a crash that came before the marker
            if seq <= self.state.applied_seq and not self._marked(seq):
                mark_consumed(self.landing, seq)
        manifests = [(s, load_manifest(self.landing / MANIFESTS / manifest_name(s))) for s in pending]
        segment: list[tuple[int, dict[str, Any]]] = []
        size = 0
        for seq, manifest in manifests:
            self._same_zone(zone, seq, manifest)
            # one daemon run per merge: the dedupe of re-delivered events relies on it
            if segment and (manifest["run_id"] != segment[0][1]["run_id"] or size >= MAX_SEGMENT_EVENTS):
                self._apply_segment(segment)
                segment, size = [], 0
            segment.append((seq, manifest))
            size += int(manifest["event_count"])
        if segment:
            self._apply_segment(segment)

    def _check_zone(self) -> str | None:
        """Refuse a landing zone this target was not built from (docs/landing-format.md, zone identity)."""
        zone = read_zone_id(self.landing)
        note = self.store.check_zone(zone, self.landing, self.state.applied_seq)
        if note:
            _log(note)
        return zone

    def _same_zone(self, zone: str | None, seq: int, manifest: dict[str, Any]) -> None:
        other = manifest.get("zone_id")  # absent in version 1 manifests
        if zone is not None and other is not None and other != zone:
            raise ForeignZone(f"landing zone {self.landing}: batch {seq} belongs to zone {other}, not to this "
                              f"zone ({zone}); remove the batches copied in from another zone")

    def _marked(self, seq: int) -> bool:
        return (self.landing / "consumed" / f"{seq:020d}").exists()

    def _apply_segment(self, segment: list[tuple[int, dict[str, Any]]]) -> None:
        started = time.monotonic()
        run_id = segment[0][1]["run_id"]
        per_table: dict[str, list[LandedFile]] = {
            f"{schema}.{name}": files for (schema, name), files in table_files(self.landing, segment).items()
        }
        work = self.store.work_dir / f"{segment[0][0]:020d}"
        results: dict[str, TableResult] = {}
        for n, (table, files) in enumerate(sorted(per_table.items())):
            prev = self.state.tables.get(table, TableState())
            results[table] = apply_table(
                self.spark,
                table,
                files,
                prev,
                run_id,
                self.store.table_dir(table),
                self.store.changelog_dir(table),
                work / f"t{n}",
                self.buckets,
            )
        new_state = ConsumerState(segment[-1][0], dict(self.state.tables))
        for table, r in results.items():
            new_state.tables[table] = r.state
        journal = {
            "state": new_state.to_json(),
            "files": [f for r in results.values() for f in r.files],
            "buckets": [b for r in results.values() for b in r.buckets],
        }
        self.state = self.store.commit(journal)
        for seq, _ in segment:
            mark_consumed(self.landing, seq)
        events = sum(r.events for r in results.values())
        took = time.monotonic() - started
        self.applied_events += events
        self.applied_seconds += took
        first, last = segment[0][0], segment[-1][0]
        jobs = ", ".join(f"{t} {j} {s:.1f}s" for t, r in results.items() for j, s in r.timings.items())
        _log(f"applied batches {first}..{last}: {events} events in {len(results)} tables, {took:.1f}s ({jobs})")


def run(
    landing: str,
    target: str,
    once: bool,
    fmt: str = "delta",
    checkpoint: str | None = None,
    buckets: int = DEFAULT_BUCKETS,
) -> int:
    """Run the consumer; the exit code: 0 done or stopped by SIGTERM, 1 failed, 2 unusable arguments."""
    if fmt not in FORMATS:
        _log(f"--format {fmt!r} is not one of {', '.join(FORMATS)}")
        return 2
    if fmt != "parquet":
        from cdcd.spark.lakehouse import prepare_run

        problem = prepare_run(fmt, Path(target))  # classpath, session extensions, target's format
        if problem:
            _log(problem)
            return 2
    landing_path, target_path = Path(landing), Path(target)
    if not landing_path.is_dir():
        _log(f"landing zone {landing} does not exist; point --landing at the daemon's landing.path")
        return 2
    spark = session()
    _log(f"Spark master {spark.sparkContext.master}; landing {landing}, target {target}, format {fmt}")
    if fmt == "parquet":
        consumer = Consumer(spark, landing_path, target_path, buckets)
    else:
        from cdcd.spark.lakehouse import LakehouseConsumer

        consumer = LakehouseConsumer(spark, landing_path, target_path, fmt)
    try:
        consumer.apply_upto(max(landed_seqs(landing_path), default=0))
    except ForeignZone as exc:  # the arguments point at a zone and a target that do not go together
        _log(str(exc))
        return 2
    except Exception as exc:  # a failed batch is reported and retried by the next run
        _log(f"failed: {exc}")
        return 1
    manifests = landing_path / MANIFESTS
    manifests.mkdir(exist_ok=True)
    stream = (
        spark.readStream.format("text")
        .option("wholetext", "true")
        .option("maxFileAge", "3650d")
        .option("ignoreMissingFiles", "true")  # consumed batches may be expired meanwhile
        .load(str(manifests))
    )
    writer = stream.writeStream.foreachBatch(consumer.on_micro_batch).option(
        "checkpointLocation", checkpoint or str(target_path / "checkpoint")
    )
    writer = writer.trigger(availableNow=True) if once else writer.trigger(processingTime="1 second")
    query = writer.start()
    stop = threading.Event()
    if not once and threading.current_thread() is threading.main_thread():

        def on_signal(signum: int, frame: FrameType | None) -> None:
            stop.set()

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
    try:
        while query.isActive:
            if stop.is_set():
                with consumer.lock:  # waits for the running micro-batch to finish
                    consumer.stopping = True
                query.stop()
                break
            query.awaitTermination(1)
    except Exception as exc:
        _log(f"failed: {exc}")
        return 1
    failure = query.exception()
    if failure is not None and not consumer.stopping:
        _log(f"failed: {failure}")
        return 1
    if consumer.applied_seconds > 0:
        rate = consumer.applied_events / consumer.applied_seconds
        _log(f"done: {consumer.applied_events} events applied ({rate:.1f} events/s)")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="cdcd spark run", description=__doc__)
    parser.add_argument("--landing", required=True, help="the daemon's landing.path")
    parser.add_argument("--target", required=True, help="where the change-log and mirror tables go")
    parser.add_argument("--once", action="store_true", help="apply what is landed now and exit")
    parser.add_argument("--format", default="delta", choices=FORMATS)
    parser.add_argument("--checkpoint", default=None, help="Spark checkpoint (default TARGET/checkpoint)")
    parser.add_argument("--buckets", type=int, default=DEFAULT_BUCKETS, help="hash buckets of a new mirror table")
    args = parser.parse_args(argv)
    return run(args.landing, args.target, args.once, args.format, args.checkpoint, args.buckets)


if __name__ == "__main__":
    sys.exit(main())
