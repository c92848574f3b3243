"""The benchmark's incremental snapshot measure: a re-read of a large table while the stream runs."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from pathlib import Path

from bench import workloads
from bench.common import Row, pair, pg_source, wait_checkpoint
from bench.harness import Daemon, Timed, run_daemon_until, write_config
from devtools.servers import PostgresServer, pg_bindir


def _writer(pg: PostgresServer, db: str, start: int, rate: int, stop: threading.Event, seconds: float) -> int:
    """Insert into ``stream`` at ``rate`` rows/s (100-row transactions, one psql session) until ``stop`` is set or
    ``seconds`` passed; the rows written."""
    psql = subprocess.Popen([str(pg_bindir() / "psql"), "-X", "-q", "-h", "127.0.0.1", "-p", str(pg.port), "-U",
                             "postgres", "-d", db], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
    assert psql.stdin is not None
    per_tx = 100
    lo, began, i = start, time.monotonic(), 0
    while not stop.is_set() and time.monotonic() - began < seconds:
        psql.stdin.write(f"INSERT INTO stream (id, a, b) SELECT g, 1, 'x' FROM generate_series({lo},{lo + per_tx - 1})"
                         " g;\n".encode())
        psql.stdin.flush()
        lo, i = lo + per_tx, i + 1
        delay = began + i * per_tx / rate - time.monotonic()
        if delay > 0:
            time.sleep(delay)
    psql.stdin.close()
    psql.wait(600)
    return lo - start


def _incremental_rows(daemon: Daemon) -> tuple[int, str | None]:
    try:
        state = json.loads((daemon.work / "state" / "checkpoint.json").read_bytes())["source_state"]
    except (FileNotFoundError, json.JSONDecodeError, KeyError):
        return 0, None
    job = (state.get("incremental") or {}).get("public.big") or {}
    return int(job.get("rows", 0)), job.get("status")


def pg_incremental(pg: PostgresServer, work: Path, sizes: dict[str, int]) -> list[Row]:
    """A table added on restart is snapshotted incrementally while a writer streams at a steady rate: the rate the
    stream is delivered at (and how far it lags) next to the same writer without a snapshot, and the incremental
    snapshot's rows/s next to the initial snapshot's (one reader)."""
    work.mkdir(parents=True)
    db = pg.create_database("bench_incremental")
    rows_big, rate = sizes["incremental"], sizes["incremental_rate"]
    pg.psql(workloads.PG_NARROW, db)
    workloads.pg_insert_narrow(pg, db, 1, rows_big, 100_000)
    pg.psql("ALTER TABLE narrow RENAME TO big; CREATE TABLE stream (LIKE big INCLUDING ALL)", db)
    pg.psql("VACUUM ANALYZE", db)
    source = pg_source(pg, db, ["public.stream"], slot="incr")
    source["postgres"]["publication"] = "incr"

    def streamed(daemon: Daemon, start_id: int, snapshot: bool, seconds: float) -> tuple[Timed, float, float]:
        """Write until the snapshot is done (or for ``seconds``); (stream delivered, catch-up s, snapshot s)."""
        stop, done_at = threading.Event(), [0.0]

        def watch() -> None:
            while snapshot and not stop.is_set():
                if _incremental_rows(daemon)[1] == "done":
                    done_at[0] = time.perf_counter() - daemon.started_at
                    stop.set()
                time.sleep(0.02)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        base = daemon.committed_events()
        began = time.perf_counter()
        written = _writer(pg, db, start_id, rate, stop, seconds)
        ended = time.perf_counter()
        stop.set()
        watcher.join(60)
        deadline = time.monotonic() + 1800
        while daemon.committed_events() - base - (_incremental_rows(daemon)[0] if snapshot else 0) < written:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the stream did not catch up:\n{daemon.tail()}")
            time.sleep(0.01)
        caught_up = time.perf_counter()
        return Timed(caught_up - began, written, daemon.peak_rss_mb()), caught_up - ended, done_at[0]

    source["tables"] = ["public.stream", "public.big"]
    added = Daemon(write_config(work / "added.toml", source, work, snapshot={"mode": "never"}), work)
    source["tables"] = ["public.stream"]
    plain = Daemon(write_config(work / "plain.toml", source, work, snapshot={"mode": "never"}), work).start()
    try:
        wait_checkpoint(plain)
        plain.stop()
        added.start()  # restarted with public.big added: snapshotted incrementally while streaming
        with_snapshot, lag_snapshot, snap_s = streamed(added, 20_000_000, True, 3600)
        peak = added.peak_rss_mb()
        added.stop()
        plain.start()
        without, lag_plain, _ = streamed(plain, 40_000_000, False, with_snapshot.seconds)
    finally:
        plain.stop()
        added.stop()
    initial_dir = work / "initial"
    initial_dir.mkdir()
    config = write_config(initial_dir / "cdcd.toml", pg_source(pg, db, ["public.big"], slot="incr_initial"),
                          initial_dir, snapshot={"mode": "initial_only", "parallelism": 1})
    initial = run_daemon_until(config, initial_dir, rows_big, exits=True)
    return [
        pair(f"PostgreSQL streaming at {rate:,} events/s during an incremental snapshot of {rows_big:,} rows",
              "events/s", with_snapshot, without, "the same writer, no snapshot running",
              catch_up_s=round(lag_snapshot, 2), baseline_catch_up_s=round(lag_plain, 2)),
        pair(f"PostgreSQL incremental snapshot while streaming, {rows_big:,} rows", "rows/s",
              Timed(snap_s, rows_big, peak), initial,
              "the initial snapshot of the same table, one reader (snapshot.parallelism = 1)",
              chunk_rows=50_000, peak_rss_mb=peak),
    ]
