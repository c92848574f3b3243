"""The benchmark measures: each cdcd figure next to its raw-tool baseline on the same data."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from bench import workloads
from bench.harness import VENV_BIN, Daemon, Timed, run_daemon_until, run_timed, write_config
from cdcd.landing import layout
from devtools.servers import MariaDBServer, PostgresServer, binary, pg_bindir

Row = dict[str, Any]


def _pair(measure: str, unit: str, ours: Timed, base: Timed | None, baseline: str, **extra: Any) -> Row:
    row: Row = {"measure": measure, "unit": unit, "cdcd": round(ours.rate, 1), "cdcd_seconds": round(ours.seconds, 2),
                "items": ours.items, "baseline": baseline}
    if base is not None:
        row.update(baseline_rate=round(base.rate, 1), baseline_seconds=round(base.seconds, 2),
                   ratio=round(ours.rate / base.rate, 3))
    row.update(extra)
    return row


def _pg_source(pg: PostgresServer, db: str, tables: list[str], slot: str = "cdcd") -> dict[str, Any]:
    return {"kind": "postgres", "port": pg.port, "user": "postgres", "database": db, "tables": tables,
            "sslmode": "disable", "postgres": {"slot": slot, "publication": "cdcd"}}


def _maria_source(m: MariaDBServer, db: str, tables: list[str]) -> dict[str, Any]:
    return {"kind": "mariadb", "port": m.port, "user": "root", "database": db, "tables": tables,
            "sslmode": "disable", "mysql": {"server_id": 9001}}


# -- PostgreSQL -------------------------------------------------------------------------------


def pg_stream(pg: PostgresServer, work: Path, sizes: dict[str, int]) -> list[Row]:
    work.mkdir(parents=True)
    db = pg.create_database("bench_stream")
    pg.psql(workloads.PG_NARROW, db)
    pg.psql(workloads.PG_WIDE, db)
    pg.psql("CREATE PUBLICATION cdcd FOR TABLE narrow, wide", db)
    for slot in ("raw", "cdcd"):
        pg.psql(f"SELECT pg_create_logical_replication_slot('{slot}', 'pgoutput')", db)
    rows = []
    for table, count, fill in (("narrow", sizes["stream"], workloads.pg_insert_narrow),
                               ("wide", sizes["stream_wide"], workloads.pg_insert_wide)):
        fill(pg, db, 1, count, 1000)
        end = pg.psql("SELECT pg_current_wal_lsn()", db)
        base = run_timed([str(pg_bindir() / "pg_recvlogical"), "--start", "--no-loop", "-S", "raw", "-P", "pgoutput",
                          "-o", "proto_version=1", "-o", "publication_names=cdcd", "-E", end, "-f", "/dev/null",
                          "-h", "127.0.0.1", "-p", str(pg.port), "-U", "postgres", "-d", db], count)
        tables = ["public.narrow", "public.wide"]
        config = write_config(work / f"{table}.toml", _pg_source(pg, db, tables), work,
                              snapshot={"mode": "never"})
        ours = run_daemon_until(config, work, count)
        rows.append(_pair(f"PostgreSQL streaming, {table} table", "events/s", ours, base,
                          "pg_recvlogical (pgoutput) to /dev/null", peak_rss_mb=ours.peak_rss_mb))
    return rows


def pg_snapshot(pg: PostgresServer, work: Path, sizes: dict[str, int]) -> list[Row]:
    work.mkdir(parents=True)
    db = pg.create_database("bench_snapshot")
    pg.psql(workloads.PG_NARROW, db)
    pg.psql(workloads.PG_WIDE, db)
    workloads.pg_insert_narrow(pg, db, 1, sizes["pg_snapshot"], 500_000)
    workloads.pg_insert_wide(pg, db, 1, sizes["snapshot_wide"], 50_000)
    pg.psql("VACUUM ANALYZE", db)
    rows = []
    for table, count in (("narrow", sizes["pg_snapshot"]), ("wide", sizes["snapshot_wide"])):
        base = run_timed([str(pg_bindir() / "psql"), "-X", "-q", "-h", "127.0.0.1", "-p", str(pg.port), "-U",
                          "postgres", "-d", db, "-c", f"COPY {table} TO STDOUT (FORMAT binary)", "-o", "/dev/null"],
                         count)
        run_dir = work / table
        run_dir.mkdir()
        config = write_config(run_dir / "cdcd.toml", _pg_source(pg, db, [f"public.{table}"], slot=f"snap_{table}"),
                              run_dir, snapshot={"mode": "initial_only", "parallelism": 2})
        ours = run_daemon_until(config, run_dir, count, exits=True)
        rows.append(_pair(f"PostgreSQL snapshot, {table} table", "rows/s", ours, base,
                          "COPY ... TO STDOUT (FORMAT binary) to /dev/null", peak_rss_mb=ours.peak_rss_mb))
    return rows


# -- MariaDB -----------------------------------------------------------------------------------


def _maria_position(m: MariaDBServer) -> tuple[str, int, str]:
    """The binlog's end now: (file, offset, GTID position)."""
    file, pos = m.sql("SHOW MASTER STATUS").split("\t")[:2]
    return file, int(pos), m.sql("SELECT @@GLOBAL.gtid_binlog_pos").strip()


#: Seconds the bare pymysqlreplication loop waits for the server's next packet.
BARE_READ_TIMEOUT_S = 60


def _bare_pymysqlreplication(m: MariaDBServer, start: tuple[str, int, str], table: str, rows: int) -> Timed:
    """The floor: pymysqlreplication decoding the same binlog range, rows counted, nothing else.

    Against MariaDB, pymysqlreplication ignores ``log_file``/``log_pos`` (it asks for the first binlog from
    offset 4), so the reader starts at the range's GTID position instead; a row of another table means it
    read the wrong range, which is an error, not a figure. Every read has ``read_timeout``: after one
    (fewer rows than expected, or a silent server) pymysqlreplication reconnects and reads the range again
    from its start, which is refused rather than counting rows twice. (``blocking=False`` is no way out:
    against MariaDB with a GTID start the server drops such a stream part-way, and the library reconnects.)
    """
    from pymysqlreplication import BinLogStreamReader
    from pymysqlreplication.row_event import DeleteRowsEvent, UpdateRowsEvent, WriteRowsEvent

    began = time.perf_counter()
    reader = BinLogStreamReader(
        connection_settings={"host": "127.0.0.1", "port": m.port, "user": "root", "passwd": "",
                             "read_timeout": BARE_READ_TIMEOUT_S},
        server_id=9002, blocking=True, auto_position=start[2],
        only_events=[WriteRowsEvent, UpdateRowsEvent, DeleteRowsEvent], is_mariadb=True,
    )
    seen = 0
    first: object = None  # the stream connection the rows came through
    try:
        for event in reader:
            if event.table != table:
                raise RuntimeError(f"the bare pymysqlreplication loop read rows of {event.table!r}, not {table!r}: "
                                   f"it did not start at {start}")
            # a new connection object is pymysqlreplication's reconnect (private, but the only sign of it)
            connection = reader._stream_connection
            first = first if first is not None else connection
            if connection is not first:
                raise RuntimeError("the bare pymysqlreplication loop read the range again (it reconnected after a "
                                   f"read that took over {BARE_READ_TIMEOUT_S}s): no figure")
            seen += len(event.rows)
            if seen >= rows:
                break
    finally:
        reader.close()
    return Timed(time.perf_counter() - began, seen)


def maria_stream(m: MariaDBServer, work: Path, sizes: dict[str, int]) -> list[Row]:
    work.mkdir(parents=True)
    db = m.create_database("bench_stream")
    m.sql(workloads.MARIA_NARROW, db)
    m.sql(workloads.MARIA_WIDE, db)
    rows = []
    tables = [f"{db}.narrow", f"{db}.wide"]
    for table, count, fill in (("narrow", sizes["stream"], workloads.maria_insert_narrow),
                               ("wide", sizes["stream_wide"], workloads.maria_insert_wide)):
        http_port = _free_port()
        config = write_config(work / f"{table}.toml", _maria_source(m, db, tables), work,
                              snapshot={"mode": "never"}, http={"listen": f"127.0.0.1:{http_port}"})
        daemon = Daemon(config, work).start()
        try:
            _wait_ready(http_port, daemon)
            already = daemon.committed_events()
            daemon.pause()  # the binlog waits on the server while the workload is written
            start = _maria_position(m)
            fill(m, db, 1, count, 1000)
            end = _maria_position(m)
            daemon.resume()
            seconds = daemon.wait_committed(already + count, timeout=1800)
            ours = Timed(seconds, count, daemon.peak_rss_mb())
        finally:
            daemon.stop()
        bare = _bare_pymysqlreplication(m, start, table, count)
        c_tool = run_timed([binary("mariadb-binlog"), "--read-from-remote-server", "-h", "127.0.0.1", "-P",
                            str(m.port), "-u", "root", f"--start-position={start[1]}", f"--stop-position={end[1]}",
                            "--verbose", start[0]], count)
        rows.append(_pair(f"MariaDB streaming, {table} table", "rows/s", ours, bare, "bare pymysqlreplication loop",
                          peak_rss_mb=ours.peak_rss_mb, mariadb_binlog_rate=round(c_tool.rate, 1),
                          ratio_to_mariadb_binlog=round(ours.rate / c_tool.rate, 3)))
    return rows


MARIA_SMALL_TX_RATES = (20_000, 30_000)  # rows/s of the steady writer, in transactions of LATENCY_PER_TX rows


def maria_small_tx(m: MariaDBServer, work: Path, sizes: dict[str, int]) -> list[Row]:
    """Rows/s landed while one client commits small transactions at each rate of ``MARIA_SMALL_TX_RATES``.

    The binlog brings a table map and a rows event per transaction: what costs per transaction, not per row,
    shows here. The ratio is the daemon's rate over the writer's (1: it kept up), both timed from the writer's
    start; the notes give how long the daemon needed after the writer's last commit, and its CPU time.
    """
    work.mkdir(parents=True)
    db = m.create_database("bench_small_tx")
    m.sql(workloads.MARIA_NARROW, db)
    rows = []
    for n, rate in enumerate(MARIA_SMALL_TX_RATES):
        run = work / f"rate_{rate}"
        run.mkdir()
        http_port = _free_port()
        # the latency measure's batching: a batch every 20 ms adds its own cost per batch to the per-transaction one
        config = write_config(run / "cdcd.toml", _maria_source(m, db, [f"{db}.narrow"]), run,
                              snapshot={"mode": "never"}, http={"listen": f"127.0.0.1:{http_port}"},
                              landing={"max_batch_delay_ms": 20, "max_batch_events": 5000})
        daemon = Daemon(config, run).start()
        try:
            _wait_ready(http_port, daemon)
            already = daemon.committed_events()
            cpu = daemon.cpu_seconds()
            began = time.perf_counter()
            written = _maria_steady_writer(m, db, rate, LATENCY_PER_TX, sizes["latency_s"], (n + 1) * 100_000_000)
            wrote = time.perf_counter() - began
            daemon.wait_committed(already + written, timeout=600)
            seconds = time.perf_counter() - began
            cpu = daemon.cpu_seconds() - cpu
            peak = daemon.peak_rss_mb()
        finally:
            daemon.stop()
        rows.append(_pair(f"MariaDB streaming, transactions of {LATENCY_PER_TX} rows written at {rate:,} rows/s",
                          "rows/s", Timed(seconds, written, peak), Timed(wrote, written),
                          "the writer (one mariadb client session), same span start", peak_rss_mb=peak,
                          notes=["max_batch_delay_ms=20",
                                 f"the writer committed {round(written / wrote):,} rows/s for {wrote:.1f} s",
                                 f"the last row landed {seconds - wrote:.2f} s after the writer's last commit",
                                 f"daemon CPU {cpu:.1f} s ({cpu / seconds:.0%} of one core)"]))
    return rows


def _maria_steady_writer(m: MariaDBServer, db: str, rate: int, per_tx: int, seconds: float, first_id: int) -> int:
    """``_paced_inserts`` through one mariadb client: autocommitted statements of ``per_tx`` rows."""
    client = [binary("mariadb"), "-u", "root", "-h", "127.0.0.1", "-P", str(m.port), f"--database={db}"]
    return _paced_inserts(client, lambda lo, hi: "INSERT INTO narrow (id, a, b) VALUES "
                          + ",".join(f"({k},1,'x')" for k in range(lo, hi + 1)) + ";",
                          rate, per_tx, seconds, first_id, "the small-transaction writer's mariadb client")


def maria_snapshot(m: MariaDBServer, work: Path, sizes: dict[str, int]) -> list[Row]:
    work.mkdir(parents=True)
    db = m.create_database("bench_snapshot")
    m.sql(workloads.MARIA_NARROW, db)
    m.sql(workloads.MARIA_WIDE, db)
    workloads.maria_insert_narrow(m, db, 1, sizes["snapshot"], 100_000)
    workloads.maria_insert_wide(m, db, 1, sizes["snapshot_wide"], 50_000)
    rows = []
    for table, count in (("narrow", sizes["snapshot"]), ("wide", sizes["snapshot_wide"])):
        base = run_timed(["sh", "-c", f"{binary('mariadb')} --quick -h 127.0.0.1 -P {m.port} -u root -D {db} "
                          f"-e 'SELECT * FROM {table}' > /dev/null"], count)
        run_dir = work / table
        run_dir.mkdir()
        config = write_config(run_dir / "cdcd.toml", _maria_source(m, db, [f"{db}.{table}"]), run_dir,
                              snapshot={"mode": "initial_only", "parallelism": 2})
        ours = run_daemon_until(config, run_dir, count, exits=True)
        rows.append(_pair(f"MariaDB snapshot, {table} table", "rows/s", ours, base,
                          "mariadb --quick SELECT * to /dev/null", peak_rss_mb=ours.peak_rss_mb))
    return rows


# -- latency and memory -------------------------------------------------------------------------


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
    config = write_config(work / "cdcd.toml", _pg_source(pg, db, ["public.narrow"], slot=slot), work,
                          snapshot={"mode": "never"},
                          landing={"max_batch_delay_ms": delay_ms, "max_batch_events": 5000})
    pg.psql(f"SELECT pg_create_logical_replication_slot('{slot}', 'pgoutput')", db)
    daemon = Daemon(config, work).start()
    try:
        _wait_checkpoint(daemon)
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
    """``_paced_inserts`` through one psql session: transactions of ``per_tx`` rows."""
    psql = [str(pg_bindir() / "psql"), "-X", "-q", "-h", "127.0.0.1", "-p", str(pg.port), "-U", "postgres", "-d", db]
    return _paced_inserts(psql, lambda lo, hi: "INSERT INTO narrow (id, a, b) SELECT g, 1, 'x' FROM "
                          f"generate_series({lo},{hi}) g;", rate, per_tx, seconds, first_id,
                          "the latency writer's psql")


def _paced_inserts(client: list[str], statement: Callable[[int, int], str], rate: int, per_tx: int,
                   seconds: float, first_id: int, what: str) -> int:
    """Feed ``client`` (a SQL client reading stdin) one ``statement(lo, hi)`` (ids lo..hi) per ``per_tx`` rows
    at ``rate`` rows/s for ``seconds``; the rows written.

    Paced from the start time (a late statement is followed at once by the next), so a writer that cannot
    keep up shows in the achieved commit rate the caller measures from the landed commit times.
    """
    proc = subprocess.Popen(client, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
    assert proc.stdin is not None
    interval = per_tx / rate
    next_id, began = first_id, time.monotonic()
    ticks = int(seconds / interval)
    for i in range(ticks):
        proc.stdin.write((statement(next_id, next_id + per_tx - 1) + "\n").encode())
        proc.stdin.flush()
        next_id += per_tx
        delay = began + (i + 1) * interval - time.monotonic()
        if delay > 0:
            time.sleep(delay)
    proc.stdin.close()
    if proc.wait(timeout=300) != 0:
        raise RuntimeError(f"{what} exited with {proc.returncode}")
    return ticks * per_tx


def pg_rss(pg: PostgresServer, work: Path, sizes: dict[str, int]) -> list[Row]:
    """Peak RSS streaming one huge transaction, and snapshotting a large table."""
    work.mkdir(parents=True)
    db = pg.create_database("bench_rss")
    pg.psql(workloads.PG_NARROW, db)
    pg.psql("CREATE TABLE big (LIKE narrow INCLUDING ALL)", db)
    pg.psql("CREATE PUBLICATION cdcd FOR TABLE narrow", db)
    pg.psql("SELECT pg_create_logical_replication_slot('rss', 'pgoutput')", db)
    n_tx = sizes["rss_tx"]
    pg.psql(f"INSERT INTO narrow (id, a, b) SELECT g, g % 1000, 'row ' || g FROM generate_series(1, {n_tx}) g", db)
    stream_dir = work / "stream"
    stream_dir.mkdir()
    config = write_config(stream_dir / "cdcd.toml", _pg_source(pg, db, ["public.narrow"], slot="rss"), stream_dir,
                          snapshot={"mode": "never"})
    tx = run_daemon_until(config, stream_dir, n_tx)
    n_snap = sizes["rss_snapshot"]
    workloads_fill_big(pg, db, n_snap)
    snap_dir = work / "snapshot"
    snap_dir.mkdir()
    config = write_config(snap_dir / "cdcd.toml", _pg_source(pg, db, ["public.big"], slot="big"), snap_dir,
                          snapshot={"mode": "initial_only"})
    snap = run_daemon_until(config, snap_dir, n_snap)
    return [
        {"measure": f"peak RSS, streaming one {n_tx:,}-row transaction", "unit": "MB",
         "peak_rss_mb": round(tx.peak_rss_mb or 0, 1), "events_per_s": round(tx.rate, 1), "baseline": "none"},
        {"measure": f"peak RSS, snapshot of a {n_snap:,}-row table", "unit": "MB",
         "peak_rss_mb": round(snap.peak_rss_mb or 0, 1), "rows_per_s": round(snap.rate, 1), "baseline": "none"},
    ]


def workloads_fill_big(pg: PostgresServer, db: str, rows: int) -> None:
    for lo in range(1, rows + 1, 1_000_000):
        hi = min(lo + 999_999, rows)
        pg.psql(f"INSERT INTO big (id, a, b) SELECT g, g % 1000, 'row ' || g FROM generate_series({lo}, {hi}) g", db)


# -- Spark --------------------------------------------------------------------------------------------


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
    config = write_config(work / "cdcd.toml", _pg_source(pg, db, ["public.narrow"], slot="follow"), work,
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
    config = write_config(work / "cdcd.toml", _pg_source(pg, db, ["public.narrow"], slot="spark_small"), work,
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
    return [{"measure": f"Spark consumer ({SPARK_FORMAT}), a 100-row batch into a {rows:,}-row mirror",
             "unit": "s", "cdcd": round(applied[1], 2), "cdcd_seconds": round(seconds, 2), "items": 100,
             "baseline": "none", "mirror_rows": rows, "mirror_files": files,
             "files_rewritten": m.get("numTargetFilesRemoved"), "rows_copied": m.get("numTargetRowsCopied"),
             "deletion_vectors_added": m.get("numTargetDeletionVectorsAdded"),
             "build_seconds": round(build_seconds, 1),
             "build_rate": round(built[0] / built[1], 1) if built else None,
             "steps": steps[-1] if steps else None}]  # the consumer's seconds per statement


# -- helpers --------------------------------------------------------------------------------------------


def _free_port() -> int:
    from devtools.servers import free_port

    return free_port()


def _wait_ready(port: int, daemon: Daemon, timeout: float = 60) -> None:
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=1) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        if daemon.proc is not None and daemon.proc.poll() is not None:
            raise RuntimeError(f"cdcd exited with {daemon.proc.returncode}:\n{daemon.tail()}")
        time.sleep(0.1)
    raise RuntimeError(f"cdcd was not ready within {timeout}s:\n{daemon.tail()}")


def _wait_checkpoint(daemon: Daemon, timeout: float = 60) -> None:
    """Wait until the daemon saved a first checkpoint (its slot and watermark are durable)."""
    state = daemon.work / "state" / "checkpoint.json"
    deadline = time.monotonic() + timeout
    while not state.exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"no checkpoint within {timeout}s:\n{daemon.tail()}")
        time.sleep(0.05)


# -- incremental snapshots -----------------------------------------------------------------------------


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
    source = _pg_source(pg, db, ["public.stream"], slot="incr")
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
        _wait_checkpoint(plain)
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
    config = write_config(initial_dir / "cdcd.toml", _pg_source(pg, db, ["public.big"], slot="incr_initial"),
                          initial_dir, snapshot={"mode": "initial_only", "parallelism": 1})
    initial = run_daemon_until(config, initial_dir, rows_big, exits=True)
    return [
        _pair(f"PostgreSQL streaming at {rate:,} events/s during an incremental snapshot of {rows_big:,} rows",
              "events/s", with_snapshot, without, "the same writer, no snapshot running",
              catch_up_s=round(lag_snapshot, 2), baseline_catch_up_s=round(lag_plain, 2)),
        _pair(f"PostgreSQL incremental snapshot while streaming, {rows_big:,} rows", "rows/s",
              Timed(snap_s, rows_big, peak), initial,
              "the initial snapshot of the same table, one reader (snapshot.parallelism = 1)",
              chunk_rows=50_000, peak_rss_mb=peak),
    ]
