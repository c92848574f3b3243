"""Progress reporting: a rich live display on a TTY, periodic log lines otherwise.

The text is computed from ``Runtime.status()`` by pure functions so that the
TTY display, the log lines and sd_notify's ``STATUS=`` say the same thing.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # rich is loaded by render_live only: a daemon without a TTY never draws
    from rich.console import Group


@dataclass
class RateTracker:
    """Rows per second per table (and events per second overall) between two samples."""

    _last: dict[str, tuple[float, float]] = field(default_factory=dict)
    rates: dict[str, float] = field(default_factory=dict)

    def sample(self, key: str, value: float, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        previous = self._last.get(key)
        self._last[key] = (now, value)
        if previous is not None and now > previous[0]:
            rate = max(0.0, (value - previous[1]) / (now - previous[0]))
            # Smooth so the ETA does not jump with every sample.
            self.rates[key] = rate if key not in self.rates else 0.7 * self.rates[key] + 0.3 * rate
        return self.rates.get(key, 0.0)


def _fmt_int(value: Any) -> str:
    return f"{int(value):,}" if isinstance(value, int | float) else "-"


def _fmt_eta(remaining: float, rate: float) -> str:
    if rate <= 0 or remaining <= 0:
        return "-"
    seconds = int(remaining / rate)
    return f"{seconds // 3600}h{seconds // 60 % 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"


def summary_line(status: Mapping[str, Any]) -> str:
    """One line: state, phase, lag and commit progress (also sd_notify STATUS=)."""
    stats: Mapping[str, Any] = status.get("stats") or {}
    source: Mapping[str, Any] = status.get("source") or {}
    parts = [str(status.get("state", "?"))]
    if source.get("phase"):
        parts.append(str(source["phase"]))
    if isinstance(source.get("lag_ms"), int | float):
        parts.append(f"lag {int(source['lag_ms'])} ms")
    parts.append(f"{_fmt_int(stats.get('events_committed', 0))} events committed")
    parts.append(f"batch {stats.get('committed_batch_seq', 0)}")
    if stats.get("batches_inflight"):
        parts.append(f"{stats['batches_inflight']} in flight")
    snapshot: Mapping[str, Mapping[str, Any]] = source.get("snapshot") or {}
    if source.get("phase") == "snapshot" and snapshot:
        done = sum(1 for t in snapshot.values() if t.get("done"))
        rows = sum(int(t.get("rows") or 0) for t in snapshot.values())
        parts.append(f"snapshot {done}/{len(snapshot)} tables, {rows:,} rows")
    fault: Mapping[str, Any] | None = status.get("storage_fault")
    if fault:  # systemctl status shows why nothing moves
        parts.append(f"PAUSED for {fault.get('failing_for_s')}s: {fault.get('error')}")
    return ", ".join(parts)


def progress_fields(status: Mapping[str, Any], rates: RateTracker) -> dict[str, Any]:
    """The structured fields of a periodic progress log line."""
    stats: Mapping[str, Any] = status.get("stats") or {}
    source: Mapping[str, Any] = status.get("source") or {}
    committed = float(stats.get("events_committed") or 0)
    out: dict[str, Any] = {
        "state": status.get("state"),
        "phase": source.get("phase"),
        "lag_ms": source.get("lag_ms"),
        "events_committed": int(committed),
        "events_per_s": round(rates.sample("_events", committed), 1),
        "committed_batch": stats.get("committed_batch_seq"),
        "batches_inflight": stats.get("batches_inflight"),
    }
    snapshot: Mapping[str, Mapping[str, Any]] = source.get("snapshot") or {}
    if snapshot and source.get("phase") == "snapshot":
        tables = {}
        for name, t in sorted(snapshot.items()):
            rate = rates.sample(name, float(t.get("rows") or 0))
            remaining = float(t.get("total_estimate") or 0) - float(t.get("rows") or 0)
            tables[name] = {"rows": t.get("rows"), "done": bool(t.get("done")), "rows_per_s": round(rate, 1),
                            "eta": "done" if t.get("done") else _fmt_eta(remaining, rate)}
        out["snapshot"] = tables
    for key in ("slot_lag_bytes", "binlog_file", "binlog_pos"):
        if source.get(key) is not None:
            out[key] = source[key]
    if status.get("storage_fault"):
        out["storage_fault"] = status["storage_fault"]
    return out


def render_live(status: Mapping[str, Any], rates: RateTracker) -> Group:
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    """The TTY display: a per-table snapshot table while it runs, then one status line."""
    source: Mapping[str, Any] = status.get("source") or {}
    snapshot: Mapping[str, Mapping[str, Any]] = source.get("snapshot") or {}
    parts: list[Any] = []
    if snapshot and source.get("phase") == "snapshot":
        table = Table(title="snapshot", expand=False)
        for column in ("table", "rows", "estimate", "%", "rows/s", "ETA"):
            table.add_column(column, justify="left" if column == "table" else "right")
        for name, t in sorted(snapshot.items()):
            rows = float(t.get("rows") or 0)
            est = float(t.get("total_estimate") or 0)
            rate = rates.sample(name, rows)
            pct = "100" if t.get("done") else (f"{min(99.9, 100 * rows / est):.1f}" if est > 0 else "-")
            eta = "done" if t.get("done") else _fmt_eta(est - rows, rate)
            table.add_row(name, _fmt_int(rows), _fmt_int(est) if est else "-", pct, f"{rate:,.0f}", eta)
        parts.append(table)
    parts.append(Text(summary_line(status)))
    return Group(*parts)


def status_lines(doc: Mapping[str, Any]) -> list[str]:
    """`cdcd status`'s text of the daemon's /status document (or of what the state directory shows when the daemon
    does not answer), a line each."""
    out: list[str] = []

    if doc.get("stats") is not None:
        out.append(f"cdcd {doc.get('version', '')} (pid {doc.get('pid')}): {summary_line(doc)}")
        out.append(f"  ready: {'yes' if doc.get('ready') else 'no'}; uptime {doc.get('uptime_s')} s")
    elif doc["running"]:
        out.append(f"cdcd (pid {doc['pid']}) holds the state directory but its HTTP endpoint does not answer")
    else:
        out.append("cdcd is not running")
    source = doc.get("source") or {}
    for key in ("phase", "connected", "lag_ms", "slot_lag_bytes", "confirmed_flush_lsn", "binlog_file", "binlog_pos",
                "gtid"):
        if source.get(key) is not None:
            out.append(f"  source.{key}: {source[key]}")
    if source.get("tables"):
        out.append(f"  captured tables: {', '.join(source['tables'])}")
    for table, why in sorted((source.get("tables_needing_snapshot") or {}).items()):
        out.append(f"  needs a re-snapshot: {table}: {why}")
    lost = (source.get("position_lost") or {}).get("last")
    if lost:
        times = source["position_lost"].get("recoveries", 0)
        out.append(f"  position lost and recovered ({times} times by this process): "
                   f"{lost.get('lost')}; from {lost.get('from')} to {lost.get('to')}")
    retention = source.get("retention") or {}
    if retention.get("state"):
        head = "WARNING: retention budget" if retention.get("low") else "retention budget"
        paused = "; incremental snapshots paused" if retention.get("incremental_paused") else ""
        out.append(f"  {head} {retention['state']}: {retention.get('message', '')}{paused}")
    if source.get("table_reload_error"):
        out.append(f"  last table reload FAILED: {source['table_reload_error']}")
    if source.get("incremental_waiting"):
        out.append(f"  incremental snapshot waiting: {json.dumps(source['incremental_waiting'], default=str)}")
    if source.get("last_error"):
        out.append(f"  source.last_error: {source['last_error']}")
    for table, t in sorted((source.get("snapshot") or {}).items()):
        state = "done" if t.get("done") else "running"
        estimate = t.get("total_estimate")
        of = f" of ~{estimate}" if estimate else " (no row estimate: the table has no statistics yet)"
        out.append(f"  snapshot {table}: {t.get('rows', 0)} rows{of} ({state})")
    for job in doc.get("incremental_snapshots") or ():
        where = f" where {job['where']}" if job.get("where") else ""
        line = (f"  incremental snapshot {job.get('table')}{where}: {job.get('state')}, {job.get('chunks', 0)} chunks, "
                f"{job.get('rows', 0)} rows")
        if job.get("last_key") is not None:
            line += f", last key {json.dumps(job['last_key'])}"
        out.append(line + (f"; error: {job['error']}" if job.get("error") else ""))
    stats = doc.get("stats") or {}
    for table, c in sorted((stats.get("schema_changes") or {}).items()):
        at = datetime.fromtimestamp(c["at"], UTC).isoformat(timespec="seconds") if c.get("at") is not None else "?"
        out.append(f"  schema changed: {table}: version {c.get('version')} at {c.get('position')}, committed {at} "
                   f"({c.get('count')} since the start)")
    if stats.get("last_error"):
        out.append(f"  last error: {stats['last_error']}")
    fault = doc.get("storage_fault")
    if fault:
        out.append(f"  STORAGE FAULT for {fault.get('failing_for_s')} s: {fault.get('error')}")
    ckpt = doc.get("checkpoint")
    if ckpt:
        out.append(f"  checkpoint: batch {ckpt.get('batch_seq')}, {ckpt.get('event_count')} events, "
                   f"saved {ckpt.get('saved_at')}, position {json.dumps(ckpt.get('position'))}")
    else:
        out.append("  checkpoint: none yet")
    return out
