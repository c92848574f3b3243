"""The benchmark's Spark consumer measures: merging landed batches into Delta Lake tables."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

from bench import workloads
from bench.common import Row, pg_source
from bench.harness import VENV_BIN, Daemon, write_config
from devtools.servers import PostgresServer

SPARK_FORMAT = "delta"  # the consumer's default target format, named in the measures


def _spark_once(landing: Path, target: Path) -> tuple[float, str]:
    """``cdcd spark run --once --format delta``: seconds (Spark start-up included) and its log."""
    began = time.perf_counter()
    proc = subprocess.run([str(VENV_BIN / "cdcd"), "spark", "run", "--once", "--format", SPARK_FORMAT,
                           "--landing", str(landing), "--target", str(target)],
                          capture_output=True, text=True, timeout=3600)
    seconds = time.perf_counter() - began
    if proc.returncode != 0:
        raise RuntimeError(f"cdcd spark run failed ({proc.returncode}): {proc.stderr[-3000:]}")
    return seconds, proc.stderr


def _log_events(log: str, event: str) -> list[dict[str, Any]]:
    """The consumer's JSON log lines (its output is not a TTY) of ``event``."""
    found = []
    for line in log.splitlines():
        if line.startswith("{") and f'"{event}"' in line:
            doc = json.loads(line)
            if doc.get("event") == event:
                found.append(doc)
    return found


def _applied(log: str) -> tuple[int, float] | None:
    """The consumer's own figure from its last log line: events and seconds spent in merges (no start-up)."""
    done = _log_events(log, "done")
    if not done or not done[-1].get("merge_seconds"):
        return None
    return int(done[-1]["events"]), float(done[-1]["merge_seconds"])


def spark_consumer(stream_work: Path, target: Path, landed: list[Row]) -> list[Row]:
    """Events/s applied by ``cdcd spark run --once`` over the streaming run's landing zone, next to the
    rate at which the daemon landed the same events in the same run (``landed``: the pg_stream rows)."""
    landing = stream_work / "landing"
    from cdcd.landing.reader import read_batches

    events = sum(sum(t.num_rows for t in b.tables.values()) for b in read_batches(landing, verify=False))
    seconds, log = _spark_once(landing, target)
    # pg_stream's own rows only: other rows also start "PostgreSQL streaming" (the incremental snapshot's
    # writer, the Debezium comparison repeating cdcd's figures) and are not the daemon landing these events
    daemon = [r for r in landed if r.get("scenario") == "pg_stream"]
    row: Row = {"measure": f"Spark consumer ({SPARK_FORMAT}), events applied to the mirror", "unit": "events/s",
                "cdcd": round(events / seconds, 1), "cdcd_seconds": round(seconds, 2), "items": events,
                "baseline": "cdcd landing the same events (pg_stream, this run); cdcd includes Spark start-up"}
    if daemon:  # the daemon's rate over both streaming tables: the events this consumer applies
        rate = sum(r["items"] for r in daemon) / sum(r["cdcd_seconds"] for r in daemon)
        row.update(baseline_rate=round(rate, 1), baseline_seconds=round(sum(r["cdcd_seconds"] for r in daemon), 2),
                   ratio=round(events / seconds / rate, 3))
    applied = _applied(log)
    if applied:  # the consumer's own figure: the time spent in merges, without the JVM and session start-up
        row.update(applied_rate=round(applied[0] / applied[1], 1), applied_seconds=round(applied[1], 2))
        if daemon:
            row["applied_ratio"] = round(row["applied_rate"] / row["baseline_rate"], 3)
    return [row]


def _delta_files(table: Path) -> tuple[int, dict[str, Any]]:
    """A Delta table's live data files and the last commit's operation and metrics, from its JSON log."""
    live: set[str] = set()
    last: dict[str, Any] = {}
    for commit in sorted((table / "_delta_log").glob("*.json")):
        actions = [json.loads(line) for line in commit.read_text().splitlines()]
        # a deletion vector is a remove and an add of the same path in one commit, in either order
        live -= {a["remove"]["path"] for a in actions if "remove" in a}
        live |= {a["add"]["path"] for a in actions if "add" in a}
        last = next((a["commitInfo"] for a in actions if "commitInfo" in a), last)
    return len(live), last


def spark_follow(pg: PostgresServer, work: Path, sizes: dict[str, int]) -> list[Row]:
    """The consumer as it runs in production: a streaming ``cdcd spark run`` that has been running (it applied two
    small batches of the table first, so its tables exist and its JVM has run merges) follows the landing zone
    while the daemon catches up on the narrow streaming workload at full speed. Reported: the rate at which the
    consumer applied the events, counted from the daemon's start until the last batch was applied, next to the
    daemon's own landing rate, and the lag between the daemon's last checkpoint and that moment."""
    from cdcd.landing.reader import consumed_seqs, landed_seqs

    work.mkdir(parents=True)
    count, first = sizes["stream"], 10_000
    db = pg.create_database("bench_follow")
    pg.psql(workloads.PG_NARROW, db)
    pg.psql("CREATE PUBLICATION cdcd FOR TABLE narrow", db)
    pg.psql("SELECT pg_create_logical_replication_slot('follow', 'pgoutput')", db)
    config = write_config(work / "cdcd.toml", pg_source(pg, db, ["public.narrow"], slot="follow"), work,
                          snapshot={"mode": "never"})
    landing, target = work / "landing", work / "spark"
    landing.mkdir()
    log = open(work / "spark.log", "wb")  # noqa: SIM115 - owned by the consumer process
    consumer = subprocess.Popen([str(VENV_BIN / "cdcd"), "spark", "run", "--format", SPARK_FORMAT,
                                 "--landing", str(landing), "--target", str(target)], stdout=log, stderr=log)
    daemon = Daemon(config, work)
    deadline = time.monotonic() + 1800

    def all_applied() -> None:
        seqs = set(landed_seqs(landing))
        while not seqs <= set(consumed_seqs(landing)):
            if consumer.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the consumer stopped following: {(work / 'spark.log').read_text()[-3000:]}")
            time.sleep(0.05)

    try:
        for lo in (1, first + 1):  # two first batches: one creates the tables, the next is merged into them
            workloads.pg_insert_narrow(pg, db, lo, first, 1000)
            daemon.start()
            daemon.wait_committed(lo + first - 1, timeout=600)
            daemon.stop()
            all_applied()
        workloads.pg_insert_narrow(pg, db, 2 * first + 1, count, 1000)
        daemon.start()
        landed = daemon.wait_committed(2 * first + count, timeout=1800)
        all_applied()
        applied = time.perf_counter() - daemon.started_at
    finally:
        daemon.stop()
        consumer.terminate()
        try:
            consumer.wait(120)
        except subprocess.TimeoutExpired:
            consumer.kill()
            consumer.wait()
        log.close()
    merges = len(_log_events((work / "spark.log").read_text(), "merge applied")) - 2  # the first batches'
    return [{"measure": f"Spark consumer ({SPARK_FORMAT}) following the daemon, events applied to the mirror",
             "unit": "events/s", "cdcd": round(count / applied, 1), "cdcd_seconds": round(applied, 2),
             "items": count, "baseline": "cdcd landing the same events (the daemon of this measure)",
             "baseline_rate": round(count / landed, 1), "baseline_seconds": round(landed, 2),
             # no ratio: a follower ends after the daemon's last batch by construction; the lag is the measure
             "lag_seconds": round(applied - landed, 2), "merges": merges}]


#: Runs a command and prints, last on stderr, the peak RSS in KiB of its largest process: RUSAGE_CHILDREN of a
#: fresh process covers the command and the descendants it reaped (verify's Spark JVM), nothing of the bench.
_PEAK = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:], timeout=3600); "
         "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr); sys.exit(r.returncode)")


def _verify(config: Path, target: Path, rows: int) -> Row:
    """``cdcd verify`` of the whole mirror against the source: rows per second (Spark's start-up included) and
    the peak RSS of its largest process (verify's own, or its Spark JVM)."""
    began = time.perf_counter()
    proc = subprocess.run([str(VENV_BIN / "python"), "-c", _PEAK, str(VENV_BIN / "cdcd"), "verify", "-c",
                           str(config), "--target", str(target)], capture_output=True, text=True, timeout=3700)
    seconds = time.perf_counter() - began
    if proc.returncode != 0:
        raise RuntimeError(f"cdcd verify found drift or failed ({proc.returncode}): "
                           f"{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    peak_kib = int(proc.stderr.strip().splitlines()[-1])
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("public.narrow:")), "")
    return {"measure": f"cdcd verify, a {rows:,}-row {SPARK_FORMAT} mirror against PostgreSQL",
            "unit": "rows/s", "cdcd": round(rows / seconds, 1), "cdcd_seconds": round(seconds, 1), "items": rows,
            "baseline": "none", "peak_rss_mb": round(peak_kib / 1024, 1), "report": line}


def spark_small(pg: PostgresServer, work: Path, sizes: dict[str, int]) -> list[Row]:
    """A 100-row batch into a large Delta mirror: its time and what it rewrote.

    The mirror is built the way users get one: the daemon lands an initial snapshot of the
    table, ``cdcd spark run --once`` applies it. Then 100 neighbouring rows are updated,
    the daemon lands them, and a second ``--once`` run applies that batch alone.
    """
    work.mkdir(parents=True)
    rows = sizes["spark_small"]
    db = pg.create_database("bench_spark_small")
    pg.psql(workloads.PG_NARROW, db)
    pg.psql("CREATE PUBLICATION cdcd FOR TABLE narrow", db)
    for lo in range(1, rows + 1, 1_000_000):
        pg.psql(f"INSERT INTO narrow (id, a, b) SELECT g, g % 1000, 'row ' || g "
                f"FROM generate_series({lo}, {min(lo + 999_999, rows)}) g", db)
    config = write_config(work / "cdcd.toml", pg_source(pg, db, ["public.narrow"], slot="spark_small"), work,
                          snapshot={"mode": "initial", "parallelism": 2})
    landing, target = work / "landing", work / "spark"
    daemon = Daemon(config, work).start()
    try:
        daemon.wait_committed(rows, timeout=1800)
        build_seconds, build_log = _spark_once(landing, target)
        lo = rows // 2
        pg.psql(f"UPDATE narrow SET a = a + 1, b = 'updated' WHERE id BETWEEN {lo} AND {lo + 99}", db)
        daemon.wait_committed(rows + 100, timeout=300)
    finally:
        daemon.stop()
    seconds, log = _spark_once(landing, target)
    applied = _applied(log)
    if applied is None or applied[0] != 100:
        raise RuntimeError(f"the 100-row batch was not applied on its own: {log[-3000:]}")
    files, commit = _delta_files(target / "tables" / "public.narrow")
    if commit.get("operation") != "MERGE":
        raise RuntimeError(f"the mirror's last commit is {commit.get('operation')}, not the batch's MERGE")
    m = {k: int(v) for k, v in commit.get("operationMetrics", {}).items() if str(v).isdigit()}
    built = _applied(build_log)
    steps = [json.dumps({k: m[k] for k in ("batches", "seconds", "steps")}) for m in _log_events(log, "merge applied")]
    verified = _verify(config, target, rows)  # the source is as the mirror now: the daemon is stopped
    return [verified, {"measure": f"Spark consumer ({SPARK_FORMAT}), a 100-row batch into a {rows:,}-row mirror",
             "unit": "s", "cdcd": round(applied[1], 2), "cdcd_seconds": round(seconds, 2), "items": 100,
             "baseline": "none", "mirror_rows": rows, "mirror_files": files,
             "files_rewritten": m.get("numTargetFilesRemoved"), "rows_copied": m.get("numTargetRowsCopied"),
             "deletion_vectors_added": m.get("numTargetDeletionVectorsAdded"),
             "build_seconds": round(build_seconds, 1),
             "build_rate": round(built[0] / built[1], 1) if built else None,
             "steps": steps[-1] if steps else None}]  # the consumer's seconds per statement

