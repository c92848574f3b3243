"""The benchmark's latency measures: how long a steadily written row takes to land."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pyarrow.parquet as pq

from bench import workloads
from bench.common import Row, paced_inserts, pg_source, wait_checkpoint
from bench.harness import Daemon, write_config
from cdcd.landing import layout
from devtools.servers import PostgresServer, pg_bindir

LATENCY_RATES = (5_000, 20_000)  # events/s of the steady writer; issue 14's target is p99 <= 50 ms at 20,000
LATENCY_PER_TX = 50  # rows per writer transaction


def pg_latency(pg: PostgresServer, work: Path, sizes: dict[str, int]) -> list[Row]:
    """Source commit to landed batch visible, at each steady rate of ``LATENCY_RATES``."""
    work.mkdir(parents=True)
    db = pg.create_database("bench_latency")
    pg.psql(workloads.PG_NARROW, db)
    pg.psql("CREATE PUBLICATION cdcd FOR TABLE narrow", db)
    # each rate on a slot and daemon of its own, writing ids of its own
    return [_latency_at(pg, db, work / f"rate_{rate}", rate, sizes["latency_s"], first_id=(n + 1) * 100_000_000)
            for n, rate in enumerate(LATENCY_RATES)]


class _ManifestWatch:
    """Notes when each batch manifest becomes visible, without taking CPU from the daemon it watches.

    The landing renames each manifest into ``manifests/`` (DESIGN.md section 5), so an inotify watch for
    ``IN_MOVED_TO`` wakes this thread the moment a batch becomes visible: no polling (a stat of the next
    names every millisecond took 11 % of one core of this 2-core machine), and no polling interval in the
    figure. A lost event (the kernel's queue overflowed) makes the run an error, not a figure.
    """

    WAKE_MS = 100  # how often the thread looks whether it should stop

    def __init__(self, manifests: Path) -> None:
        from inotify_simple import INotify, flags

        self.manifests = manifests
        self.seen: dict[int, float] = {}
        self._inotify = INotify()
        self._inotify.add_watch(manifests, flags.MOVED_TO)
        self._overflow = flags.Q_OVERFLOW
        self._error: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="manifest-watch", daemon=True)

    def __enter__(self) -> _ManifestWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)
        self._inotify.close()
        if self._error is None and self.seen:  # every batch landed after the first one seen was seen
            missed = sorted(set(layout.seqs_in(self.manifests)) - set(self.seen) - set(range(min(self.seen))))
            if missed:
                self._error = f"the manifest watch missed batches {missed[:5]}: no latency figure"
        if self._error is not None and exc[0] is None:
            raise RuntimeError(self._error)

    def _run(self) -> None:
        try:
            self._watch()
        except Exception as e:  # reported by __exit__: a figure without every batch would be wrong
            self._error = f"the manifest watch failed: {e!r}"

    def _watch(self) -> None:
        while not self._stop.is_set():
            events = self._inotify.read(timeout=self.WAKE_MS)
            now = time.time()
            for event in events:
                if event.mask & self._overflow:
                    self._error = "the manifest watch lost events (inotify queue overflow): no latency figure"
                    return
                seq = layout.manifest_seq(event.name)
                if seq is not None:
                    self.seen.setdefault(seq, now)


def _latency_at(pg: PostgresServer, db: str, work: Path, rate: int, seconds: int, first_id: int,
                delay_ms: int = 20) -> Row:
    work.mkdir()
    slot = f"latency_{first_id // 100_000_000}"  # one slot per run (the caller gives each its own ids)
    config = write_config(work / "cdcd.toml", pg_source(pg, db, ["public.narrow"], slot=slot), work,
                          snapshot={"mode": "never"},
                          landing={"max_batch_delay_ms": delay_ms, "max_batch_events": 5000})
    pg.psql(f"SELECT pg_create_logical_replication_slot('{slot}', 'pgoutput')", db)
    daemon = Daemon(config, work).start()
    try:
        wait_checkpoint(daemon)
        already = daemon.committed_events()
        with _ManifestWatch(work / "landing" / "manifests") as watch:
            total = _steady_writer(pg, db, rate, LATENCY_PER_TX, seconds, first_id)
            daemon.wait_committed(already + total, timeout=300)
        peak = daemon.peak_rss_mb()
    finally:
        daemon.stop()
    latencies: list[float] = []
    after_last: list[float] = []  # per batch: visible minus its last commit (what the batch's last event waited)
    first_commit, last_commit = float("inf"), 0.0
    data = work / "landing" / "data"
    for seq, visible_at in watch.seen.items():
        for f in data.glob(f"{seq:020d}-*.parquet"):
            t = pq.read_table(f, columns=["_cdc_commit_ts", "_cdc_snapshot"])
            stamps = [ts.timestamp() for ts, snap in zip(t.column(0).to_pylist(), t.column(1).to_pylist(), strict=True)
                      if not snap and ts is not None]
            if stamps:
                latencies.extend((visible_at - ts) * 1000 for ts in stamps)
                after_last.append((visible_at - max(stamps)) * 1000)
                first_commit, last_commit = min(first_commit, min(stamps)), max(last_commit, max(stamps))
    if not latencies:
        raise RuntimeError(f"no streamed events were landed during the latency run at {rate:,} events/s")
    latencies.sort()
    after_last.sort()
    achieved = len(latencies) / (last_commit - first_commit) if last_commit > first_commit else 0.0
    return {"measure": f"latency, commit to landed batch visible, {rate:,} events/s", "unit": "ms",
            "p50_ms": round(_pct(latencies, 0.5), 1), "p99_ms": round(_pct(latencies, 0.99), 1),
            "max_ms": round(latencies[-1], 1), "events": len(latencies), "target_rate": rate,
            "achieved_rate": round(achieved, 1), "batches": len(after_last),
            "batch_after_last_p50_ms": round(_pct(after_last, 0.5), 1),
            "batch_after_last_p99_ms": round(_pct(after_last, 0.99), 1),
            "peak_rss_mb": peak, "config": f"max_batch_delay_ms={delay_ms}", "baseline": "none"}


def _pct(values: list[float], q: float) -> float:
    """The ``q`` quantile of sorted ``values`` (nearest rank)."""
    return values[min(len(values) - 1, int(len(values) * q))]


def _steady_writer(pg: PostgresServer, db: str, rate: int, per_tx: int, seconds: float,
                   first_id: int = 10_000_000) -> int:
    """``paced_inserts`` through one psql session: transactions of ``per_tx`` rows."""
    psql = [str(pg_bindir() / "psql"), "-X", "-q", "-h", "127.0.0.1", "-p", str(pg.port), "-U", "postgres", "-d", db]
    return paced_inserts(psql, lambda lo, hi: "INSERT INTO narrow (id, a, b) SELECT g, 1, 'x' FROM "
                          f"generate_series({lo},{hi}) g;", rate, per_tx, seconds, first_id,
                          "the latency writer's psql")

