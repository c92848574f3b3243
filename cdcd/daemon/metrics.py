"""Prometheus metrics, computed from the runtime's status at scrape time.

Nothing is counted twice: the runtime keeps its own counters (RuntimeStats)
and this collector only translates ``Runtime.status()`` into metric families
when /metrics is scraped. The names are documented in docs/metrics.md.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, PlatformCollector, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from cdcd import __version__
from cdcd.daemon.retentionmetrics import retention_metrics
from cdcd.logging import scrub_text

StatusProvider = Callable[[], Mapping[str, Any]]
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_STATES = ("idle", "running", "stopping", "stopped")
_ERROR_LABEL_MAX = 300


def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _gauge(name: str, doc: str, value: Any) -> Iterator[Metric]:
    number = _num(value)
    if number is not None:
        yield GaugeMetricFamily(name, doc, value=number)


def _counter(name: str, doc: str, value: Any) -> Iterator[Metric]:
    number = _num(value)
    if number is not None:
        yield CounterMetricFamily(name, doc, value=number)


def _failing(prefix: str, what: str, since: Any, now: float) -> Iterator[Metric]:
    """``<prefix>_failing`` (0/1) and ``<prefix>_failing_seconds`` (how long, 0 while it works)."""
    start = _num(since)
    yield GaugeMetricFamily(f"{prefix}_failing", f"1 while {what} fail (retried until they succeed)",
                            value=float(start is not None))
    yield GaugeMetricFamily(f"{prefix}_failing_seconds", f"Seconds {what} have been failing without a success",
                            value=0.0 if start is None else max(0.0, now - start))


def metrics_from_status(
    status: Mapping[str, Any], *, ready: bool, now: float | None = None, monotonic_now: float | None = None
) -> list[Metric]:
    """The metric families for one ``Runtime.status()`` document. Pure: easy to check."""
    now = time.time() if now is None else now
    monotonic_now = time.monotonic() if monotonic_now is None else monotonic_now
    stats: Mapping[str, Any] = status.get("stats") or {}
    source: Mapping[str, Any] = status.get("source") or {}
    out: list[Metric] = []

    info = InfoMetricFamily("cdcd_build", "cdcd version and source kind")
    info.add_metric([], {"version": __version__, "source_kind": str(status.get("source_kind", ""))})
    out.append(info)
    state = GaugeMetricFamily("cdcd_state", "1 for the runtime's current lifecycle state", labels=["state"])
    for name in _STATES:
        state.add_metric([name], 1.0 if status.get("state") == name else 0.0)
    out.append(state)
    out += _gauge("cdcd_ready", "1 when the daemon is running and its source connected (/readyz)", int(ready))
    out += _gauge("cdcd_source_connected", "1 while the source is connected", int(bool(source.get("connected"))))
    out += _gauge("cdcd_milliseconds_behind_source",
                  "Source commit time of the last event read to now, in ms (Debezium MilliSecondsBehindSource)",
                  source.get("lag_ms"))

    out += _counter("cdcd_events_seen", "Change events read from the source (not counting re-deliveries)",
                    stats.get("events_seen"))
    out += _counter("cdcd_events_committed", "Change events landed, acknowledged and checkpointed (since first start)",
                    stats.get("events_committed"))
    out += _counter("cdcd_events_redelivered_skipped",
                    "Events the source re-delivered on resume that the checkpoint already covered, dropped",
                    stats.get("events_skipped"))
    out += _counter("cdcd_batches_delivered", "Batches handed to the landing zone", stats.get("batches_delivered"))
    out += _counter("cdcd_checkpoint_failures", "Checkpoint saves that failed (retried on a timer until one succeeds)",
                    stats.get("checkpoint_failures"))
    out += _failing("cdcd_checkpoint", "checkpoint saves", stats.get("checkpoint_failing_since"), now)
    sink: Mapping[str, Any] = status.get("sink") or {}
    out += _counter("cdcd_landing_write_failures", "Batches whose landing failed (disk full, I/O error); retried",
                    sink.get("write_failures"))
    if "write_failures" in sink:
        out += _failing("cdcd_landing", "landing writes", sink.get("failing_since"), now)
    out += _counter("cdcd_source_reconnects", "Reconnects after transient source errors",
                    stats.get("source_reconnects"))
    out += _gauge("cdcd_batches_inflight", "Batches delivered and not yet checkpointed", stats.get("batches_inflight"))
    out += _gauge("cdcd_batches_inflight_max", "runtime.max_inflight_batches", stats.get("max_inflight_batches"))
    out += _gauge("cdcd_queue_size", "Sealed batches waiting for an in-flight slot", stats.get("queue_size"))
    out += _gauge("cdcd_queue_capacity", "Capacity of the sealed-batch queue", stats.get("queue_capacity"))
    out += _gauge("cdcd_committed_batch_seq", "Sequence number of the last checkpointed batch",
                  stats.get("committed_batch_seq"))
    saved_at = _num(stats.get("checkpoint_saved_at"))
    if saved_at is not None:
        out += _gauge("cdcd_checkpoint_age_seconds", "Seconds since the last checkpoint save", max(0.0, now - saved_at))
    tick = _num(stats.get("last_tick"))
    if tick is not None:
        out += _gauge("cdcd_pipeline_tick_age_seconds", "Seconds since the pipeline loop last ticked (watchdog)",
                      max(0.0, monotonic_now - tick))

    out += _snapshot_metrics(source)
    out += _incremental_metrics(status.get("incremental_snapshots") or [])
    tables = CounterMetricFamily("cdcd_table_events", "Committed change events per source table", labels=["table"])
    for table, count in sorted((stats.get("table_events") or {}).items()):
        tables.add_metric([str(table)], float(count))
    out.append(tables)
    changes = CounterMetricFamily("cdcd_schema_changes", "Schema changes per source table landed and checkpointed "
                                  "since the daemon started", labels=["table"])
    for table, change in sorted((stats.get("schema_changes") or {}).items()):
        changes.add_metric([str(table)], float(change.get("count", 0)))
    out.append(changes)

    out += _gauge("cdcd_postgres_slot_lag_bytes",
                  "pg_wal_lsn_diff(pg_current_wal_lsn(), confirmed_flush_lsn) of the replication slot",
                  source.get("slot_lag_bytes"))
    if source.get("binlog_file") is not None:
        binlog = InfoMetricFamily("cdcd_mysql_binlog", "The binlog file the MySQL/MariaDB source reads")
        binlog.add_metric([], {"file": str(source["binlog_file"])})
        out.append(binlog)
    out += _gauge("cdcd_mysql_binlog_position", "Position in the current binlog file", source.get("binlog_pos"))
    out += _counter("cdcd_source_stream_reconnects",
                    "Reconnects of the replication/binlog stream inside the source (stalls and connection losses)",
                    source.get("reconnects"))
    out += _counter("cdcd_position_lost_recoveries",
                    "Recoveries from a lost source position since the daemon started (source.on_position_lost = "
                    "resnapshot): a new position, every table re-snapshotted", (source.get("position_lost") or {})
                    .get("recoveries"))

    out += _tables_metrics(source)
    out += retention_metrics(source)

    error = stats.get("last_error")
    out += _gauge("cdcd_last_error_present", "1 when the runtime has recorded an error", int(bool(error)))
    if error:
        last = InfoMetricFamily("cdcd_last_error", "The last error the runtime recorded")
        last.add_metric([], {"message": scrub_text(str(error))[:_ERROR_LABEL_MAX]})
        out.append(last)
    return out


def _snapshot_metrics(source: Mapping[str, Any]) -> Iterable[Metric]:
    snapshot: Mapping[str, Mapping[str, Any]] = source.get("snapshot") or {}
    phase = source.get("phase")
    all_done = bool(snapshot) and all(t.get("done") for t in snapshot.values())
    running = phase == "snapshot" and not all_done
    completed = all_done or phase == "streaming"
    yield GaugeMetricFamily("cdcd_snapshot_running", "1 while the initial snapshot runs", value=float(running))
    yield GaugeMetricFamily("cdcd_snapshot_completed", "1 once the snapshot is complete (or not needed)",
                            value=float(completed))
    yield GaugeMetricFamily("cdcd_snapshot_remaining_tables", "Tables whose snapshot is not finished",
                            value=float(sum(1 for t in snapshot.values() if not t.get("done"))))
    rows = CounterMetricFamily("cdcd_snapshot_rows_scanned", "Snapshot rows read per table", labels=["table"])
    estimate = GaugeMetricFamily("cdcd_snapshot_rows_estimate", "Estimated rows per table (planner statistics)",
                                 labels=["table"])
    for table, progress in sorted(snapshot.items()):
        rows_n, est = _num(progress.get("rows")), _num(progress.get("total_estimate"))
        if rows_n is not None:
            rows.add_metric([str(table)], rows_n)
        if est is not None:
            estimate.add_metric([str(table)], est)
    yield rows
    yield estimate


def _tables_metrics(source: Mapping[str, Any]) -> Iterable[Metric]:
    """What the operator acts on: the captured tables, those waiting for a re-snapshot, a failed reload."""
    captured = GaugeMetricFamily("cdcd_table_captured", "1 for each table the daemon captures now", labels=["table"])
    for table in source.get("tables") or ():
        captured.add_metric([str(table)], 1.0)
    yield captured
    pending = GaugeMetricFamily("cdcd_table_needs_snapshot",
                                "1 for each captured table waiting for a re-snapshot (dropped and re-created, ...)",
                                labels=["table"])
    for table in sorted(source.get("tables_needing_snapshot") or {}):
        pending.add_metric([str(table)], 1.0)
    yield pending
    yield GaugeMetricFamily("cdcd_table_reload_failed", "1 while the last table reload failed (see /status)",
                            value=float(bool(source.get("table_reload_error"))))
    yield GaugeMetricFamily("cdcd_incremental_snapshot_waiting",
                            "1 while an incremental snapshot waits for transactions open when its table was added",
                            value=float(source.get("incremental_waiting") is not None))


_INCREMENTAL_STATES = ("queued", "running", "done", "failed", "cancelled", "replaced")


def _incremental_metrics(jobs: Iterable[Mapping[str, Any]]) -> Iterable[Metric]:
    """The incremental snapshots of this process (``cdcd snapshot``, tables added while running).

    Per table the newest request counts (a table snapshotted twice shows its second run).
    """
    jobs = list(jobs)
    states = GaugeMetricFamily("cdcd_incremental_snapshots", "Incremental snapshot requests of this process by state",
                               labels=["state"])
    for name in _INCREMENTAL_STATES:
        states.add_metric([name], float(sum(1 for j in jobs if j.get("state") == name)))
    yield states
    newest = {str(j.get("table")): j for j in jobs}  # listed oldest first
    running = GaugeMetricFamily("cdcd_incremental_snapshot_running", "1 while the table's incremental snapshot runs",
                                labels=["table"])
    rows = GaugeMetricFamily("cdcd_incremental_snapshot_rows", "Rows the table's newest incremental snapshot emitted",
                             labels=["table"])
    chunks = GaugeMetricFamily("cdcd_incremental_snapshot_chunks",
                               "Chunks the table's newest incremental snapshot completed", labels=["table"])
    for table, j in sorted(newest.items()):
        running.add_metric([table], float(j.get("state") == "running"))
        rows.add_metric([table], _num(j.get("rows")) or 0.0)
        chunks.add_metric([table], _num(j.get("chunks")) or 0.0)
    yield running
    yield rows
    yield chunks


class StatusCollector(Collector):
    """A custom collector: every scrape reads the runtime's live status."""

    def __init__(self, provider: StatusProvider, ready: Callable[[], bool]) -> None:
        self._provider = provider
        self._ready = ready

    def collect(self) -> Iterable[Metric]:
        return metrics_from_status(self._provider(), ready=self._ready())


def make_registry(provider: StatusProvider, ready: Callable[[], bool]) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatusCollector(provider, ready))
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
