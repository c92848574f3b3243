"""The Spark consumer's Prometheus metrics and ``/healthz`` (``--metrics-listen HOST:PORT``; docs/metrics.md).

Served by the daemon's small HTTP server (``cdcd.daemon.httpserver``, asyncio) on a thread of its own with its
own event loop: the consumer itself is synchronous. The values are read at scrape time from ``Progress``, which
the job updates as it applies merges (each field is replaced whole, so a scrape from the server's thread reads
consistent values), and from the landing zone (the lag).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from prometheus_client import CollectorRegistry, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily
from prometheus_client.metrics_core import Metric

from cdcd import __version__
from cdcd.daemon.httpserver import HttpServer, Response
from cdcd.errors import CdcdError, ConfigError
from cdcd.landing.manifest import Manifest
from cdcd.landing.reader import landed_seqs, read_manifest
from cdcd.logging import get_logger

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
#: /healthz fails when a following consumer's loop has not ticked for this long (it ticks every second).
STALL_AFTER_S = 30.0
#: How long the server thread may take to start listening or to stop.
SERVER_WAIT_S = 10.0
MERGE_BUCKETS = (0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1800)
PHASES = ("starting", "catching up", "following", "stopping", "stopped", "failed")

_log = get_logger("cdcd.spark")


@dataclass(slots=True)
class Progress:
    """What the consumer has done and is doing; the job writes it, the scrape and /healthz read it."""

    landing: Path
    fmt: str
    phase: str = "starting"
    reason: str = ""  # why it failed (phase "failed")
    applied_seq: int = 0
    applied_created_at: str | None = None  # the landing time of the last applied batch (its manifest's created_at)
    tables: dict[str, tuple[int | None, str]] = field(default_factory=dict)  # table -> (batch seq, position)
    batches: int = 0
    events: int = 0
    failures: int = 0
    last_tick: float | None = None  # time.monotonic() of the following loop's last tick
    registry: CollectorRegistry = field(default_factory=lambda: CollectorRegistry(auto_describe=False))
    merge_seconds: Histogram = field(init=False)

    def __post_init__(self) -> None:
        self.merge_seconds = Histogram("cdcd_spark_merge_seconds", "Seconds per merge (one segment of landed "
                                       "batches, all its tables, the commit)", buckets=MERGE_BUCKETS,
                                       registry=self.registry)
        self.registry.register(_Collector(self))
        ProcessCollector(registry=self.registry)

    def tick(self) -> None:
        self.last_tick = time.monotonic()

    def health(self) -> tuple[bool, str]:
        """(healthy, what it is doing or why not)."""
        if self.phase == "following":
            age = None if self.last_tick is None else time.monotonic() - self.last_tick
            if age is not None and age > STALL_AFTER_S:
                return False, f"the following loop has not ticked for {age:.0f}s"
            return True, "following the landing zone"
        if self.phase == "catching up":
            return True, "catching up: applying the landed batches before following"
        if self.phase == "failed":
            return False, f"failed: {self.reason}"
        if self.phase == "starting":
            return False, "starting: the Spark session is starting"
        return False, self.phase


def _created(manifest: Manifest) -> float | None:
    return datetime.fromisoformat(manifest.created_at).timestamp()


def landing_lag(landing: Path, applied_seq: int, applied_created_at: str | None) -> tuple[int, float]:
    """Batches landed and not applied, and the newest landed batch's landing time minus the last applied one's
    (before the first merge: minus the oldest unapplied one's); (0, 0.0) when nothing waits."""
    waiting = [s for s in landed_seqs(landing) if s > applied_seq]
    if not waiting:
        return 0, 0.0
    newest = _created(read_manifest(landing, waiting[-1]))
    base = datetime.fromisoformat(applied_created_at).timestamp() if applied_created_at else None
    if base is None:
        base = _created(read_manifest(landing, waiting[0]))
    return len(waiting), max(0.0, newest - base) if newest is not None and base is not None else 0.0


class _Collector:
    def __init__(self, progress: Progress) -> None:
        self.p = progress

    def collect(self) -> Iterable[Metric]:
        p = self.p
        yield InfoMetricFamily("cdcd_spark", "The consumer's version, target format and landing zone",
                               value={"version": __version__, "format": p.fmt, "landing": str(p.landing)})
        yield GaugeMetricFamily("cdcd_spark_following", "1 while the consumer follows the landing zone (its "
                                "streaming query runs)", value=float(p.phase == "following"))
        yield GaugeMetricFamily("cdcd_spark_healthy", "1 when /healthz answers 200", value=float(p.health()[0]))
        yield GaugeMetricFamily("cdcd_spark_applied_batch_seq", "Seq of the last landed batch the target holds "
                                "(the target's journal)", value=float(p.applied_seq))
        seqs = GaugeMetricFamily("cdcd_spark_table_applied_batch_seq", "Seq of the last batch whose merge "
                                 "included the table (tables merged by this process)", labels=["table"])
        positions = InfoMetricFamily("cdcd_spark_table_position", "The highest applied position (_cdc_pos) of "
                                     "each table (the target's journal)", labels=["table"])
        for table, (seq, position) in sorted(p.tables.items()):
            if seq is not None:
                seqs.add_metric([table], float(seq))
            positions.add_metric([table], {"position": position})
        yield seqs
        yield positions
        yield CounterMetricFamily("cdcd_spark_batches_applied", "Landed batches applied by this process",
                                  value=float(p.batches))
        yield CounterMetricFamily("cdcd_spark_events_applied", "Change events applied by this process (re-delivered "
                                  "events the target held are not counted)", value=float(p.events))
        yield CounterMetricFamily("cdcd_spark_failures", "Merges that failed in this process (each ends the run "
                                  "with exit 1)", value=float(p.failures))
        if p.last_tick is not None:
            yield GaugeMetricFamily("cdcd_spark_loop_tick_age_seconds", "Seconds since the following loop last "
                                    f"ticked; /healthz fails above {STALL_AFTER_S:g}",
                                    value=time.monotonic() - p.last_tick)
        try:
            behind, seconds = landing_lag(p.landing, p.applied_seq, p.applied_created_at)
        except (OSError, CdcdError, ValueError) as exc:  # a manifest expired between the listing and the read
            _log.warning("consumer lag not measured", landing=str(p.landing), error=str(exc))
            return
        yield GaugeMetricFamily("cdcd_spark_lag_batches", "Landed batches the target does not hold yet",
                                value=float(behind))
        yield GaugeMetricFamily("cdcd_spark_lag_seconds", "Landing time of the newest landed batch minus that of "
                                "the last applied one; 0 when caught up", value=seconds)


class MetricsServer:
    """``/metrics`` and ``/healthz`` of ``progress`` on ``host:port``, served by a thread with its own event loop."""

    def __init__(self, host: str, port: int, progress: Progress) -> None:
        self.progress = progress
        self.server = HttpServer(host, port, {"/metrics": self._metrics, "/healthz": self._healthz})
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="cdcd-spark-metrics", daemon=True)

    def _metrics(self) -> Response:
        return Response(200, generate_latest(self.progress.registry), CONTENT_TYPE)

    def _healthz(self) -> Response:
        healthy, what = self.progress.health()
        return Response(200 if healthy else 503, f"{'ok' if healthy else 'unhealthy'}: {what}\n".encode())

    def start(self) -> None:
        """Listen, or raise ConfigError saying why not."""
        self.thread.start()
        try:
            asyncio.run_coroutine_threadsafe(self.server.start(), self.loop).result(SERVER_WAIT_S)
        except ConfigError as exc:
            self._stop_loop()
            cause = exc.__cause__
            why = getattr(cause, "strerror", None) or str(cause or exc)
            raise ConfigError(f"--metrics-listen {self.server.host}:{self.server.port}: cannot listen ({why}); "
                              "give a free HOST:PORT, or leave --metrics-listen out") from exc

    def close(self) -> None:
        try:
            asyncio.run_coroutine_threadsafe(self.server.close(), self.loop).result(SERVER_WAIT_S)
        finally:
            self._stop_loop()

    def _stop_loop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(SERVER_WAIT_S)
        if not self.thread.is_alive():
            self.loop.close()
