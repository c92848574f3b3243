"""The metrics of the source's retention budget (``/status`` ``source.retention``; cdcd/capture/retention.py):
the shared gauges, then PostgreSQL's slot and MariaDB/MySQL's binlog expiry. Listed in docs/metrics.md."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric

_STATES = ("ok", "low", "unreserved", "lost", "unlimited", "unknown")
_WAL_STATUSES = ("reserved", "extended", "unreserved", "lost")


def _value(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _gauge(name: str, doc: str, value: Any) -> Iterator[Metric]:
    number = _value(value)
    if number is not None:
        yield GaugeMetricFamily(name, doc, value=number)


def retention_metrics(source: Mapping[str, Any]) -> Iterator[Metric]:
    doc: Mapping[str, Any] | None = source.get("retention")
    if not doc:
        return
    yield GaugeMetricFamily("cdcd_source_retention_low", "1 while the source's retention budget is within "
                            "source.retention.margin or past it (incremental snapshots paused)",
                            value=float(bool(doc.get("low"))))
    state = GaugeMetricFamily("cdcd_source_retention_state", "1 for the retention budget's current state",
                              labels=["state"])
    for name in _STATES:
        state.add_metric([name], float(doc.get("state") == name))
    yield state
    yield from _gauge("cdcd_source_retention_seconds_left", "Seconds before the source drops what the checkpoint "
                      "needs, at the current WAL rate (PostgreSQL) or until the checkpoint's binlog file expires",
                      doc.get("left_s"))
    yield from _gauge("cdcd_source_retention_fraction_left", "Share of the retention budget left (0-1)",
                      doc.get("fraction_left"))
    yield GaugeMetricFamily("cdcd_incremental_snapshots_paused", "1 while incremental snapshots wait for the "
                            "retention budget to recover", value=float(bool(doc.get("incremental_paused"))))
    if doc.get("kind") == "wal":
        status = GaugeMetricFamily("cdcd_postgres_slot_wal_status",
                                   "1 for the slot's wal_status (pg_replication_slots)", labels=["wal_status"])
        for name in _WAL_STATUSES:
            status.add_metric([name], float(doc.get("wal_status") == name))
        yield status
        yield from _gauge("cdcd_postgres_slot_safe_wal_size_bytes", "safe_wal_size of the slot: WAL the server may "
                          "still write before the slot is in danger of being invalidated", doc.get("safe_wal_size"))
        yield from _gauge("cdcd_postgres_max_slot_wal_keep_size_bytes", "max_slot_wal_keep_size in bytes (-1: "
                          "unlimited)", doc.get("max_slot_wal_keep_size_bytes"))
        yield from _gauge("cdcd_postgres_slot_retained_wal_bytes", "WAL the slot holds (from its restart_lsn to the "
                          "server's current position)", doc.get("retained_bytes"))
        yield from _gauge("cdcd_postgres_wal_rate_bytes_per_second", "WAL written per second between the last two "
                          "readings", doc.get("wal_rate_bytes_s"))
    elif doc.get("kind") == "binlog":
        yield from _gauge("cdcd_mysql_binlog_expire_seconds", "The server's binlog expiry (binlog_expire_logs_seconds "
                          "or expire_logs_days; 0: never)", doc.get("binlog_expire_seconds"))
        yield from _gauge("cdcd_mysql_checkpoint_binlog_age_seconds", "Seconds since the checkpoint's binlog file was "
                          "closed (estimated; absent while it is the newest)", doc.get("checkpoint_binlog_age_s"))
        yield from _gauge("cdcd_mysql_binlogs_after_checkpoint", "Binlog files on the server newer than the "
                          "checkpoint's", doc.get("binlogs_after_checkpoint"))
