"""One large PostgreSQL transaction, pgoutput protocol 1 next to protocol 2 (in-progress streaming), same run.

For each protocol and each shape of the transaction (one ``INSERT ... SELECT generate_series`` of ``n`` rows, as
fast as the server writes it; or ``PACED_STATEMENTS`` inserts of ``n / PACED_STATEMENTS`` rows with
``inprogress_pause_s`` between them (0.5 s; 0.05 s in a ``--quick`` run, a smoke test), a transaction that runs
longer than the server needs to decode it): a daemon
streams from a new slot, the transaction commits; measured are the seconds from its commit until its first and
its last row are landed and checkpointed, the server's spill and stream counters for the slot
(``pg_stat_replication_slots``, reset before the transaction), the peak size of cdcd's in-progress spool and
the daemon's peak RSS.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from bench import workloads
from bench.harness import Daemon, write_config
from cdcd.sources.postgres.inprogress import SPOOL_DIR, SUFFIX
from devtools.servers import PostgresServer

Row = dict[str, Any]

PACED_STATEMENTS = 20


def _spool_bytes(state: Path) -> int:
    d = state / SPOOL_DIR
    try:
        return sum(p.stat().st_size for p in d.iterdir() if p.name.endswith(SUFFIX))
    except FileNotFoundError:  # the directory, or a file removed at its commit while we looked
        return 0


class _SpoolWatcher(threading.Thread):
    """The peak size of the daemon's in-progress spool, sampled every 50 ms."""

    def __init__(self, state: Path) -> None:
        super().__init__(daemon=True)
        self.state = state
        self.peak = 0
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            self.peak = max(self.peak, _spool_bytes(self.state))
            time.sleep(0.05)


def _wait(daemon: Daemon, events: int, timeout: float) -> float:
    """time.time() when at least ``events`` events are checkpointed."""
    deadline = time.monotonic() + timeout
    while daemon.committed_events() < events:
        if time.monotonic() > deadline:
            raise RuntimeError(f"cdcd committed {daemon.committed_events()} of {events} events in {timeout}s:\n"
                               f"{daemon.tail()}")
        if daemon.proc is not None and daemon.proc.poll() is not None:
            raise RuntimeError(f"cdcd exited with {daemon.proc.returncode}; log:\n{daemon.tail()}")
        time.sleep(0.01)
    return time.time()


def _wait_checkpoint(daemon: Daemon, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not (daemon.work / "state" / "checkpoint.json").exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"no checkpoint within {timeout}s:\n{daemon.tail()}")
        time.sleep(0.05)


def _transaction(lo: int, n: int, pause_s: float | None) -> str:
    def insert(a: int, b: int) -> str:
        return f"INSERT INTO narrow (id, a, b) SELECT g, g % 1000, 'row ' || g FROM generate_series({a}, {b}) g;"

    if pause_s is None:
        return insert(lo, lo + n - 1)
    step = -(-n // PACED_STATEMENTS)
    parts = [insert(a, min(a + step, lo + n) - 1) for a in range(lo, lo + n, step)]
    return "BEGIN;" + f"SELECT pg_sleep({pause_s});".join(parts) + "COMMIT;"


def pg_inprogress(pg: PostgresServer, work: Path, sizes: dict[str, Any]) -> list[Row]:
    work.mkdir(parents=True)
    db = pg.create_database("bench_inprogress")
    pg.psql(workloads.PG_NARROW, db)
    if sizes.get("inprogress_work_mem"):  # small runs: a small transaction must exceed it too
        pg.psql(f"ALTER DATABASE {db} SET logical_decoding_work_mem = '{sizes['inprogress_work_mem']}'")
    work_mem = pg.psql("SHOW logical_decoding_work_mem", db)
    n = int(sizes["inprogress_tx"])
    pause_s = float(sizes["inprogress_pause_s"])
    rows: list[Row] = []
    runs = [(paced, proto) for paced in (False, True) for proto in (1, 2)]
    for i, (paced, proto) in enumerate(runs):
        d = work / f"run{i}"
        d.mkdir()
        slot = f"inprogress{i}"
        source = {"kind": "postgres", "port": pg.port, "user": "postgres", "database": db,
                  "tables": ["public.narrow"], "sslmode": "disable",
                  "postgres": {"slot": slot, "publication": "cdcd", "stream_in_progress": proto == 2}}
        config = write_config(d / "cdcd.toml", source, d, snapshot={"mode": "never"})
        daemon = Daemon(config, d).start()
        watcher = _SpoolWatcher(d / "state")
        try:
            _wait_checkpoint(daemon)
            base = daemon.committed_events()
            pg.psql(f"SELECT pg_stat_reset_replication_slot('{slot}')", db)
            watcher.start()
            began = time.time()
            pg.psql(_transaction(1 + i * n, n, pause_s if paced else None), db)
            committed = time.time()
            first = _wait(daemon, base + 1, 1800)
            last = _wait(daemon, base + n, 1800)
            rss = daemon.peak_rss_mb()
        finally:
            watcher.stop.set()
            if watcher.is_alive():
                watcher.join()
            daemon.stop()
        spill_txns, spill_bytes, stream_txns, stream_bytes = (int(x) for x in pg.psql(
            "SELECT spill_txns, spill_bytes, stream_txns, stream_bytes FROM pg_stat_replication_slots "
            f"WHERE slot_name = '{slot}'", db).split("|"))
        pg.psql(f"SELECT pg_drop_replication_slot('{slot}')", db)
        rows.append({
            "measure": f"one {n:,}-row transaction"
                       + (f" ({PACED_STATEMENTS} inserts, {pause_s} s apart)" if paced else " (one insert)")
                       + f", pgoutput protocol {proto}" + (" (in-progress streaming)" if proto == 2 else ""),
            "unit": "s", "commit_to_landed_s": round(last - committed, 2),
            "commit_to_first_s": round(first - committed, 2), "transaction_s": round(committed - began, 2),
            "spill_bytes": spill_bytes, "spill_txns": spill_txns, "stream_bytes": stream_bytes,
            "stream_txns": stream_txns, "spool_peak_mb": round(watcher.peak / 2**20, 1),
            "peak_rss_mb": round(rss or 0, 1), "logical_decoding_work_mem": work_mem, "baseline": "none",
        })
    return rows
