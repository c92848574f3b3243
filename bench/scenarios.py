"""The benchmark's throughput measures: each cdcd figure next to its raw-tool baseline on the same data
(PostgreSQL and MariaDB streaming and snapshots), and the daemon's memory."""

from __future__ import annotations

import time
from pathlib import Path

from bench import workloads
from bench.common import Row, free_port, maria_source, paced_inserts, pair, pg_source, wait_ready
from bench.harness import Daemon, Timed, run_daemon_until, run_timed, write_config
from bench.latency import LATENCY_PER_TX
from devtools.servers import MariaDBServer, PostgresServer, binary, pg_bindir

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
        config = write_config(work / f"{table}.toml", pg_source(pg, db, tables), work,
                              snapshot={"mode": "never"})
        ours = run_daemon_until(config, work, count)
        rows.append(pair(f"PostgreSQL streaming, {table} table", "events/s", ours, base,
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
        config = write_config(run_dir / "cdcd.toml", pg_source(pg, db, [f"public.{table}"], slot=f"snap_{table}"),
                              run_dir, snapshot={"mode": "initial_only", "parallelism": 2})
        ours = run_daemon_until(config, run_dir, count, exits=True)
        rows.append(pair(f"PostgreSQL snapshot, {table} table", "rows/s", ours, base,
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
        http_port = free_port()
        config = write_config(work / f"{table}.toml", maria_source(m, db, tables), work,
                              snapshot={"mode": "never"}, http={"listen": f"127.0.0.1:{http_port}"})
        daemon = Daemon(config, work).start()
        try:
            wait_ready(http_port, daemon)
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
        rows.append(pair(f"MariaDB streaming, {table} table", "rows/s", ours, bare, "bare pymysqlreplication loop",
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
        http_port = free_port()
        # the latency measure's batching: a batch every 20 ms adds its own cost per batch to the per-transaction one
        config = write_config(run / "cdcd.toml", maria_source(m, db, [f"{db}.narrow"]), run,
                              snapshot={"mode": "never"}, http={"listen": f"127.0.0.1:{http_port}"},
                              landing={"max_batch_delay_ms": 20, "max_batch_events": 5000})
        daemon = Daemon(config, run).start()
        try:
            wait_ready(http_port, daemon)
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
        rows.append(pair(f"MariaDB streaming, transactions of {LATENCY_PER_TX} rows written at {rate:,} rows/s",
                          "rows/s", Timed(seconds, written, peak), Timed(wrote, written),
                          "the writer (one mariadb client session), same span start", peak_rss_mb=peak,
                          notes=["max_batch_delay_ms=20",
                                 f"the writer committed {round(written / wrote):,} rows/s for {wrote:.1f} s",
                                 f"the last row landed {seconds - wrote:.2f} s after the writer's last commit",
                                 f"daemon CPU {cpu:.1f} s ({cpu / seconds:.0%} of one core)"]))
    return rows


def _maria_steady_writer(m: MariaDBServer, db: str, rate: int, per_tx: int, seconds: float, first_id: int) -> int:
    """``paced_inserts`` through one mariadb client: autocommitted statements of ``per_tx`` rows."""
    client = [binary("mariadb"), "-u", "root", "-h", "127.0.0.1", "-P", str(m.port), f"--database={db}"]
    return paced_inserts(client, lambda lo, hi: "INSERT INTO narrow (id, a, b) VALUES "
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
        config = write_config(run_dir / "cdcd.toml", maria_source(m, db, [f"{db}.{table}"]), run_dir,
                              snapshot={"mode": "initial_only", "parallelism": 2})
        ours = run_daemon_until(config, run_dir, count, exits=True)
        rows.append(pair(f"MariaDB snapshot, {table} table", "rows/s", ours, base,
                          "mariadb --quick SELECT * to /dev/null", peak_rss_mb=ours.peak_rss_mb))
    return rows


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
    config = write_config(stream_dir / "cdcd.toml", pg_source(pg, db, ["public.narrow"], slot="rss"), stream_dir,
                          snapshot={"mode": "never"})
    tx = run_daemon_until(config, stream_dir, n_tx)
    n_snap = sizes["rss_snapshot"]
    workloads_fill_big(pg, db, n_snap)
    snap_dir = work / "snapshot"
    snap_dir.mkdir()
    config = write_config(snap_dir / "cdcd.toml", pg_source(pg, db, ["public.big"], slot="big"), snap_dir,
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

