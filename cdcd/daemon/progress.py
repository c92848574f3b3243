"""Progress reporting: a rich live display on a TTY, periodic log lines otherwise.

The text is computed from ``Runtime.status()`` by pure functions so that the
TTY display, the log lines and sd_notify's ``STATUS=`` say the same thing.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
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
