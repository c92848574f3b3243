"""`cdcd spark run`: a Structured Streaming job from the landing zone into Spark tables.

``--once`` applies what is landed (and what lands meanwhile) and exits,
without a streaming query. Otherwise a stream watches ``LANDING/manifests/``; each micro-batch applies every
landed batch up to the newest manifest it saw, in batch seq order (seqs may
have gaps), one landing run at a time. The target's own journal
(``cdcd.spark.state``) is the commit record: a batch is skipped when the
target already holds it, whatever Spark's checkpoint says, and its consumed
marker is written only after the target commit. How a segment of batches
reaches the tables is the format's ``ApplyStrategy`` (``cdcd.spark.strategy``):
``cdcd.spark.parquet`` or ``cdcd.spark.lakehouse``. Runnable with spark-submit
through ``cdcd/spark/consumer.py``:
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

from cdcd.landing.layout import MANIFESTS
from cdcd.landing.reader import is_consumed, landed_seqs, mark_consumed, read_manifest
from cdcd.landing.zone import read_zone_id
from cdcd.spark.lakehouse import LakehouseStrategy, prepare_run
from cdcd.spark.parquet import ParquetStrategy
from cdcd.spark.session import log, session
from cdcd.spark.state import ConsumerState, ForeignZone, TargetLocked, TargetStore, lock_target
from cdcd.spark.strategy import ApplyStrategy, Segment

DEFAULT_BUCKETS = 16
#: Events applied in one merge at most: each merge has a fixed cost of a few Spark jobs, so
#: all visible batches go into one merge unless that would make it too large for memory.
MAX_SEGMENT_EVENTS = 2_000_000
FORMATS = ("parquet", "delta", "iceberg")


def make_strategy(fmt: str, spark: SparkSession, store: TargetStore, buckets: int) -> ApplyStrategy:
    """The apply strategy of the target format ``fmt``."""
    if fmt == "parquet":
        return ParquetStrategy(spark, store, buckets)
    return LakehouseStrategy(spark, store, fmt)


class Consumer:
    """Applies landed batches through the format's strategy; for the stream handler and the start-up catch-up."""

    def __init__(self, spark: SparkSession, landing: Path, target: Path, fmt: str = "parquet",
                 buckets: int = DEFAULT_BUCKETS) -> None:
        self.spark = spark
        self.landing = landing
        self.store = TargetStore(target)
        self.lock = threading.Lock()
        self.stopping = False
        self.state: ConsumerState = self.store.recover()
        self.strategy = make_strategy(fmt, spark, self.store, buckets)
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
            if seq <= self.state.applied_seq and not is_consumed(self.landing, seq):
                mark_consumed(self.landing, seq)
        manifests = [(s, read_manifest(self.landing, s)) for s in pending]
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
            log(note)
        return zone

    def _same_zone(self, zone: str | None, seq: int, manifest: dict[str, Any]) -> None:
        other = manifest.get("zone_id")  # absent in version 1 manifests
        if zone is not None and other is not None and other != zone:
            raise ForeignZone(f"landing zone {self.landing}: batch {seq} belongs to zone {other}, not to this "
                              f"zone ({zone}); remove the batches copied in from another zone")

    def _apply_segment(self, batches: list[tuple[int, dict[str, Any]]]) -> None:
        started = time.monotonic()
        segment = Segment(self.landing, batches)
        applied = self.strategy.apply(segment, self.state.tables)
        new_state = ConsumerState(segment.last, dict(self.state.tables))
        new_state.tables.update(applied.tables)
        journal = {"state": new_state.to_json(), "files": applied.files, "buckets": applied.buckets}
        self.state = self.store.commit(journal)
        for seq, _ in batches:
            mark_consumed(self.landing, seq)
        took = time.monotonic() - started
        self.applied_events += applied.events
        self.applied_seconds += took
        jobs = ", ".join(f"{t} {j} {s:.1f}s" for t, js in applied.timings.items() for j, s in js.items())
        log(f"applied batches {segment.first}..{segment.last}: {applied.events} events in {len(applied.timings)} "
            f"tables, {took:.1f}s ({self.strategy.label}{jobs})")


def run(
    landing: str,
    target: str,
    once: bool,
    fmt: str = "delta",
    checkpoint: str | None = None,
    buckets: int = DEFAULT_BUCKETS,
    dedicated: bool = False,
) -> int:
    """Run the consumer; the exit code: 0 done or stopped by SIGTERM, 1 failed, 2 unusable arguments.

    ``dedicated``: the process runs this consumer alone (``cdcd spark run``), so a local session it starts
    loads the extension of ``fmt`` only (``session.session``)."""
    if fmt not in FORMATS:
        log(f"--format {fmt!r} is not one of {', '.join(FORMATS)}")
        return 2
    if fmt != "parquet":
        problem = prepare_run(fmt, Path(target), dedicated)  # classpath, session extensions, target's format
        if problem:
            log(problem)
            return 2
    landing_path, target_path = Path(landing), Path(target)
    if not landing_path.is_dir():
        log(f"landing zone {landing} does not exist; point --landing at the daemon's landing.path")
        return 2
    try:
        lock = lock_target(target_path)
    except TargetLocked as exc:
        log(str(exc))
        return 2
    try:
        return _run_locked(landing_path, target_path, once, fmt, checkpoint, buckets)
    finally:
        os.close(lock)  # releases the target's consumer lock


def _run_locked(landing_path: Path, target_path: Path, once: bool, fmt: str, checkpoint: str | None,
                buckets: int) -> int:
    landing, target = str(landing_path), str(target_path)
    spark = session(fmt)
    log(f"Spark master {spark.sparkContext.master}; landing {landing}, target {target}, format {fmt}")
    consumer = Consumer(spark, landing_path, target_path, fmt, buckets)
    try:
        consumer.apply_upto(max(landed_seqs(landing_path), default=0))
        if once:  # and what landed during that catch-up, as a stream would: no streaming query to start
            consumer.apply_upto(max(landed_seqs(landing_path), default=0))
    except ForeignZone as exc:  # the arguments point at a zone and a target that do not go together
        log(str(exc))
        return 2
    except Exception as exc:  # a failed batch is reported and retried by the next run
        log(f"failed: {exc}")
        return 1
    if once:
        _done(consumer)
        return 0
    return _stream(spark, consumer, landing_path, checkpoint or str(target_path / "checkpoint"))


def _done(consumer: Consumer) -> None:
    if consumer.applied_seconds > 0:
        rate = consumer.applied_events / consumer.applied_seconds
        log(f"done: {consumer.applied_events} events applied ({rate:.1f} events/s)")


def _stream(spark: SparkSession, consumer: Consumer, landing: Path, checkpoint: str) -> int:
    """Apply new manifests as they appear, until SIGTERM/SIGINT; the exit code."""
    manifests = landing / MANIFESTS
    manifests.mkdir(exist_ok=True)
    stream = (
        spark.readStream.format("text")
        .option("wholetext", "true")
        .option("maxFileAge", "3650d")
        .option("ignoreMissingFiles", "true")  # consumed batches may be expired meanwhile
        .load(str(manifests))
    )
    writer = stream.writeStream.foreachBatch(consumer.on_micro_batch).option("checkpointLocation", checkpoint)
    writer = writer.trigger(processingTime="1 second")
    query = writer.start()
    stop = threading.Event()
    if threading.current_thread() is threading.main_thread():

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
        log(f"failed: {exc}")
        return 1
    failure = query.exception()
    if failure is not None and not consumer.stopping:
        log(f"failed: {failure}")
        return 1
    _done(consumer)
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
    return run(args.landing, args.target, args.once, args.format, args.checkpoint, args.buckets, dedicated=True)


if __name__ == "__main__":
    sys.exit(main())
