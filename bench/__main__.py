"""``python -m bench [--quick]``: cdcd next to the raw tools, in one run, on this machine.

Every pair runs back to back on the same data so the ratio is fair on a noisy
machine. Results go to ``bench/results/latest.md`` and ``latest.json``; the
chart to ``docs/benchmarks.png``. A ``--quick`` run writes all three to ``bench/work/quick/`` (not committed).
"""

from __future__ import annotations

import argparse
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from bench import cluster, consumer, incremental, inprogress, latency, objstore, peers, scenarios
from bench.report import write_report
from devtools.servers import MariaDBServer, PostgresServer

ROOT = Path(__file__).resolve().parents[1]

SIZES = {
    # rows per workload; the default run stays under 10 minutes on 2 cores, --quick under 2
    "default": {"stream": 1_000_000, "stream_wide": 100_000, "snapshot": 1_000_000, "snapshot_wide": 200_000,
                # issue 14's PostgreSQL snapshot target is set on >= 5M rows (MariaDB's on the 1M of "snapshot")
                "pg_snapshot": 5_000_000,
                "latency_s": 20, "rss_tx": 2_000_000, "rss_snapshot": 5_000_000, "spark_small": 10_000_000,
                "incremental": 1_000_000, "incremental_rate": 10_000, "inprogress_tx": 2_000_000,
                "inprogress_pause_s": 0.5, "cluster": 1_000_000},
    "quick": {"stream": 50_000, "stream_wide": 10_000, "snapshot": 50_000, "snapshot_wide": 10_000,
              "pg_snapshot": 50_000, "latency_s": 2, "rss_tx": 100_000, "rss_snapshot": 200_000, "spark_small": 20_000,
              "incremental": 200_000, "incremental_rate": 5_000, "inprogress_tx": 100_000, "inprogress_pause_s": 0.05,
              "inprogress_work_mem": "1MB", "cluster": 20_000},
}


#: Before each measure the machine must be quiet: CPU use (all processes) under this share of its cores over
#: a second, so that the servers' work left by the measure before (MariaDB purging and flushing pages,
#: PostgreSQL's checkpointer and autovacuum, a JVM exiting) does not run inside the next one.
QUIET_CPU_SHARE = 0.15
#: The longest wait for it; a machine busy with other work is reported, not waited for.
QUIET_WAIT_S = 90.0
#: A checkpoint after the largest measure writes a few GB at most.
CHECKPOINT_TIMEOUT_S = 300.0


def wait_quiet(pg: PostgresServer, wait_s: float = QUIET_WAIT_S) -> float:
    """Checkpoint PostgreSQL, then wait (at most ``wait_s``) until the machine is quiet; the seconds waited."""
    began = time.monotonic()
    pg.psql("CHECKPOINT", timeout_s=CHECKPOINT_TIMEOUT_S)  # dirty pages written now, not inside the next measure
    while time.monotonic() - began < wait_s:
        if psutil.cpu_percent(interval=1.0) / 100 < QUIET_CPU_SHARE:
            return time.monotonic() - began
    if wait_s:
        print(f"bench: the machine stayed busier than {QUIET_CPU_SHARE:.0%} of its cores for {wait_s:g}s; "
              "measuring anyway", file=sys.stderr, flush=True)
    return time.monotonic() - began


def machine() -> dict[str, Any]:
    return {
        "cpu": platform.processor() or platform.machine(),
        "cores": psutil.cpu_count(),
        "memory_gb": round(psutil.virtual_memory().total / 2**30, 1),
        "os": platform.platform(),
        "python": sys.version.split()[0],
        "postgres": PostgresServer.version(),
        "mariadb": MariaDBServer.version(),
    }


def destinations(quick: bool, out: Path | None, chart: Path | None) -> tuple[Path, Path]:
    """Where the results and the chart go: a smoke run (``--quick``) never replaces a default run's committed
    ``bench/results/latest.*`` and ``docs/benchmarks.png``."""
    out = out or ROOT / "bench" / ("work/quick" if quick else "results")
    return out, chart or (out / "benchmarks.png" if quick else ROOT / "docs" / "benchmarks.png")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/bench.sh", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke run under 2 minutes")
    parser.add_argument("--out", type=Path, help="where results go (default bench/results; --quick: bench/work/quick)")
    parser.add_argument("--only", nargs="*", help="run only these measures (names as in the table)")
    parser.add_argument("--chart", type=Path,
                        help="chart PNG path (default docs/benchmarks.png; --quick: benchmarks.png in --out)")
    parser.add_argument("--no-spark", action="store_true", help="skip the Spark consumer measures")
    args = parser.parse_args(argv)
    args.out, args.chart = destinations(args.quick, args.out, args.chart)
    sizes = SIZES["quick" if args.quick else "default"]
    work = Path(tempfile.mkdtemp(prefix="cdcd-bench-"))
    started = time.monotonic()
    results: list[dict[str, Any]] = []
    settled: dict[str, float] = {}  # per measure: seconds waited for a quiet machine before it
    pg: PostgresServer | None = None
    maria: MariaDBServer | None = None
    try:
        # synchronous_commit=on: WAL is flushed at commit, so the walsender sends it at once (latency)
        pg_settings = {"wal_sender_timeout": "0", "max_wal_size": "4GB", "synchronous_commit": "on"}
        pg = PostgresServer(settings=pg_settings).start()
        maria = MariaDBServer(settings={"net_write_timeout": "3600", "max_binlog_size": "1073741824"}).start()
        plan: list[tuple[str, Callable[[], list[dict[str, Any]]]]] = [
            ("pg_stream", lambda: scenarios.pg_stream(pg, work / "pg_stream", sizes)),
            ("pg_snapshot", lambda: scenarios.pg_snapshot(pg, work / "pg_snapshot", sizes)),
            ("maria_stream", lambda: scenarios.maria_stream(maria, work / "maria_stream", sizes)),
            ("maria_snapshot", lambda: scenarios.maria_snapshot(maria, work / "maria_snapshot", sizes)),
            ("maria_small_tx", lambda: scenarios.maria_small_tx(maria, work / "maria_small_tx", sizes)),
            ("latency", lambda: latency.pg_latency(pg, work / "latency", sizes)),
            ("rss", lambda: scenarios.pg_rss(pg, work / "rss", sizes)),
            ("incremental", lambda: incremental.pg_incremental(pg, work / "incremental", sizes)),
            ("inprogress", lambda: inprogress.pg_inprogress(pg, work / "inprogress", sizes)),
            ("objstore", lambda: objstore.pg_landing_s3(pg, work / "objstore", sizes)),
        ]
        if not args.quick or (args.only and "debezium" in args.only):  # needs Maven and a JVM: not in smoke runs
            plan.append(("debezium", lambda: peers.debezium(pg, maria, work / "debezium", sizes, results)))
        if not args.no_spark:
            plan.append(("spark", lambda: consumer.spark_consumer(work / "pg_stream", work / "spark", results)))
            plan.append(("spark_small", lambda: consumer.spark_small(pg, work / "spark_small", sizes)))
            plan.append(("spark_follow", lambda: consumer.spark_follow(pg, work / "spark_follow", sizes)))
            plan.append(("spark_cluster", lambda: cluster.spark_cluster(pg, work / "spark_cluster", sizes)))
        for name, run in plan:
            if args.only and name not in args.only:
                continue
            # a --quick run is a smoke test (the test suite runs it beside other tests): checkpoint, no wait
            settled[name] = round(wait_quiet(pg, 0.0 if args.quick else QUIET_WAIT_S), 1)
            print(f"bench: {name} ... (machine quiet after {settled[name]:g}s)", file=sys.stderr, flush=True)
            t0 = time.monotonic()
            rows = run()
            for row in rows:
                row.setdefault("scenario", name)
            results.extend(rows)
            print(f"bench: {name} done in {time.monotonic() - t0:.0f}s", file=sys.stderr, flush=True)
    finally:
        for server in (pg, maria):
            if server is not None:
                server.stop()
        shutil.rmtree(work, ignore_errors=True)
    doc = {"mode": "quick" if args.quick else "default", "sizes": sizes, "machine": machine(),
           "elapsed_s": round(time.monotonic() - started, 1), "settled_s": settled, "results": results}
    markdown = write_report(doc, args.out, chart_png=args.chart)
    print(markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
