"""The peer users would pick instead of cdcd: Debezium's embedded engine, on the streaming workloads.

``bench/debezium/`` is a small Maven project (Debezium's embedded engine with the PostgreSQL and
MariaDB connectors and a consumer that only counts change events). It is built once with Maven
into ``.jars/debezium`` (dependencies from Maven Central into ``.jars/.m2``, as the Spark jars),
rebuilt only when its sources change. When it cannot be built (no Maven, no Java, Maven Central
unreachable) the Debezium rows say "not measured" and why; the rest of the run goes on.

Each Debezium run reads a freshly written copy of ``pg_stream``'s and ``maria_stream``'s workloads
(same tables, sizes and transactions) and is compared with the cdcd figure of those measures in the
same run.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from bench import workloads
from devtools.servers import MariaDBServer, PostgresServer

Row = dict[str, Any]
S = TypeVar("S")
Fill = Callable[[S, str, int, int, int], None]  # workloads.*_insert_*: (server, db, start, count, per_tx)

ROOT = Path(__file__).resolve().parents[1]
PROJECT = ROOT / "bench" / "debezium"
JARS = ROOT / ".jars"
BUILD = JARS / "debezium"
MAIN_CLASS = "cdcd.bench.DebeziumCount"
BUILD_TIMEOUT_S = 1200  # a first build downloads ~80 jars from Maven Central
RUN_TIMEOUT_S = 1800


def debezium_version() -> str:
    """The Debezium version the pom pins (``debezium.version``)."""
    pom = (PROJECT / "pom.xml").read_text()
    start = pom.index("<debezium.version>") + len("<debezium.version>")
    return pom[start:pom.index("</debezium.version>", start)]


def _sources_digest() -> str:
    h = hashlib.sha256()
    for path in sorted([PROJECT / "pom.xml", *(PROJECT / "src").rglob("*.java")]):
        h.update(path.relative_to(PROJECT).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def classpath(build_dir: Path = BUILD) -> str:
    return f"{build_dir / 'debezium-count-1.jar'}:{build_dir / 'lib'}/*"


def build(build_dir: Path = BUILD, mvn: str = "mvn", repo: Path = JARS / ".m2", offline: bool = False) -> str | None:
    """Build ``bench/debezium`` into ``build_dir`` unless already built from these sources.

    Returns None when ready, else why it could not be built (the bench reports "not measured").
    ``repo`` is Maven's local repository; ``offline`` runs Maven with ``-o`` (with an empty ``repo``,
    what an unreachable Maven Central looks like, for tests).
    """
    stamp = build_dir / ".sources-sha256"
    digest = _sources_digest()
    if stamp.is_file() and stamp.read_text().strip() == digest and (build_dir / "debezium-count-1.jar").is_file():
        return None
    for tool, package in ((mvn, "maven"), ("java", "default-jre-headless")):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (scripts/bootstrap.sh installs {package})"
    if build_dir.exists():
        shutil.rmtree(build_dir)  # no stale dependency jars from another Debezium version on the classpath
    build_dir.mkdir(parents=True)
    log = build_dir / "mvn.log"
    cmd = [mvn, "-q", "-B", "-Dstyle.color=never", *(["-o"] if offline else []), "package",
           f"-Dmaven.repo.local={repo}", f"-Dbench.build.dir={build_dir}"]
    try:
        with open(log, "wb") as out:
            proc = subprocess.run(cmd, cwd=PROJECT, stdout=out, stderr=subprocess.STDOUT, timeout=BUILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return f"`mvn package` in bench/debezium did not finish within {BUILD_TIMEOUT_S} s (log: {log})"
    if proc.returncode != 0:
        errors = [line for line in log.read_text(errors="replace").splitlines() if "[ERROR]" in line]
        first = errors[0].replace("[ERROR]", "").strip()[:300] if errors else "no [ERROR] line"
        return (f"`mvn package` in bench/debezium failed ({proc.returncode}); is Maven Central reachable? "
                f"First error: {first} (log: {log})")
    stamp.write_text(digest + "\n")
    return None


@dataclass
class DebeziumRun:
    """One run of the counting engine."""

    seconds: float  # process start (JVM start-up included) until the last event, as the bench saw it
    events: int
    from_start_jvm: float  # the JVM's own clock, from its start
    from_first_event: float
    first_key: str  # the first counted event's key, e.g. "Struct{id=1}"
    peak_rss_mb: float | None

    @property
    def rate(self) -> float:
        return self.events / self.seconds

    @property
    def rate_from_first_event(self) -> float:
        return self.events / self.from_first_event if self.from_first_event > 0 else float("inf")


def run_engine(properties: dict[str, str], events: int, work: Path, timeout: float = RUN_TIMEOUT_S) -> DebeziumRun:
    """Run the engine until it consumed ``events`` change events; raise with its log if it cannot."""
    work.mkdir(parents=True, exist_ok=True)
    props = work / "engine.properties"
    props.write_text("".join(f"{k}={v.replace(chr(92), chr(92) * 2)}\n" for k, v in properties.items()))
    log = work / "debezium.log"
    cmd = ["java", "-Dorg.slf4j.simpleLogger.defaultLogLevel=warn", "-cp", classpath(), MAIN_CLASS, str(props),
           str(events), str(int(timeout))]
    with open(log, "wb") as err:
        began = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err)
        peak = None
        deadline = time.monotonic() + timeout + 60
        try:
            while proc.poll() is None:  # watch the JVM's high-water RSS until it exits
                peak = _vm_hwm_mb(proc.pid) or peak
                if time.monotonic() > deadline:
                    raise RuntimeError(f"Debezium did not exit within {timeout + 60:.0f} s; log {log}:\n"
                                       f"{_tail(log)}")
                time.sleep(0.05)
            seconds = time.perf_counter() - began
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert proc.stdout is not None
    out = proc.stdout.read().decode(errors="replace").strip()
    proc.stdout.close()
    if proc.returncode != 0 or not out:
        raise RuntimeError(f"Debezium exited with {proc.returncode} before {events} events; log {log}:\n{_tail(log)}")
    figures = json.loads(out.splitlines()[-1])
    return DebeziumRun(seconds, int(figures["events"]), float(figures["seconds_from_start"]),
                       float(figures["seconds_from_first_event"]), str(figures["first_key"]), peak)


def _vm_hwm_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except (FileNotFoundError, ProcessLookupError):
        return None
    return None


def _tail(path: Path) -> str:
    try:
        return path.read_text(errors="replace")[-3000:]
    except FileNotFoundError:
        return ""


def _engine_base(work: Path) -> dict[str, str]:
    return {
        "name": "bench",
        "topic.prefix": "bench",
        "offset.storage": "org.apache.kafka.connect.storage.FileOffsetBackingStore",
        "offset.storage.file.filename": str(work / "offsets.dat"),
        "include.schema.changes": "false",
    }


# -- PostgreSQL -------------------------------------------------------------------------------------


def pg_run(pg: PostgresServer, db: str, table: str, count: int, fill: Fill[PostgresServer], work: Path,
           timeout: float = RUN_TIMEOUT_S) -> DebeziumRun:
    slot = f"dbz_{table}"
    # a slot of its own, created before the workload: Debezium (no stored offset) streams from it
    pg.psql(f"SELECT pg_create_logical_replication_slot('{slot}', 'pgoutput')", db)
    fill(pg, db, 1, count, 1000)
    props = _engine_base(work) | {
        "connector.class": "io.debezium.connector.postgresql.PostgresConnector",
        "database.hostname": "127.0.0.1", "database.port": str(pg.port), "database.user": "postgres",
        "database.password": "unused", "database.dbname": db, "plugin.name": "pgoutput", "slot.name": slot,
        "publication.name": "dbz", "publication.autocreate.mode": "disabled", "snapshot.mode": "no_data",
        "table.include.list": "public.narrow,public.wide",
    }
    try:
        return run_engine(props, count, work, timeout)
    finally:
        pg.psql(f"SELECT pg_drop_replication_slot('{slot}')", db)  # free its WAL for the next measures


# -- MariaDB ----------------------------------------------------------------------------------------


def maria_run(m: MariaDBServer, db: str, table: str, count: int, fill: Fill[MariaDBServer], work: Path,
              timeout: float = RUN_TIMEOUT_S) -> DebeziumRun:
    file, pos = m.sql("SHOW MASTER STATUS").split("\t")[:2]
    gtids = m.sql("SELECT @@GLOBAL.gtid_binlog_pos")
    fill(m, db, 1, count, 1000)
    props = _engine_base(work) | {
        # debezium-connector-mariadb: the connector Debezium 3 documents for MariaDB (MariaDB GTIDs, the
        # MariaDB JDBC driver); its MySQL connector also streamed from MariaDB 10.11 in a trial, unsupported
        "connector.class": "io.debezium.connector.mariadb.MariaDbConnector",
        "database.hostname": "127.0.0.1", "database.port": str(m.port), "database.user": "root",
        "database.password": "", "database.server.id": "9003", "database.ssl.mode": "disable",
        "database.include.list": db, "table.include.list": f"{db}.narrow,{db}.wide",
        "schema.history.internal": "io.debezium.storage.file.history.FileSchemaHistory",
        "schema.history.internal.file.filename": str(work / "schema-history.dat"),
        # only the captured tables' DDL: other databases on the server may hold types its parser refuses
        "schema.history.internal.store.only.captured.databases.ddl": "true",
        "schema.history.internal.store.only.captured.tables.ddl": "true",
        # start where the workload starts: the offset is preset in the file store; "recovery" rebuilds
        # the (empty) schema history from the tables and then streams from that offset
        "snapshot.mode": "recovery",
        # the MariaDB connector resumes by GTID (it cannot start from a file/position alone)
        "bench.offset": json.dumps({"file": file, "pos": int(pos), "gtids": gtids}, separators=(",", ":")),
    }
    return run_engine(props, count, work, timeout)


# -- the measure ------------------------------------------------------------------------------------


CASES = [("PostgreSQL", "narrow", "stream", "events/s"), ("PostgreSQL", "wide", "stream_wide", "events/s"),
         ("MariaDB", "narrow", "stream", "rows/s"), ("MariaDB", "wide", "stream_wide", "rows/s")]


def _row(source: str, table: str, count: int, unit: str, earlier: list[Row]) -> tuple[Row, Row | None]:
    """The comparison row, with cdcd's figure from the same run's streaming measure when it ran."""
    cdcd_row = next((r for r in earlier if r.get("measure") == f"{source} streaming, {table} table"), None)
    row: Row = {"measure": f"{source} streaming, {table} table: cdcd vs Debezium", "unit": unit,
                "cdcd": cdcd_row["cdcd"] if cdcd_row else None,
                "cdcd_seconds": cdcd_row["cdcd_seconds"] if cdcd_row else None, "items": count}
    return row, cdcd_row


def not_measured(why: str, sizes: dict[str, int], earlier: list[Row]) -> list[Row]:
    """The Debezium rows when Debezium could not be built: cdcd's figure, and why there is no ratio."""
    rows = []
    for source, table, size, unit in CASES:
        row, _ = _row(source, table, sizes[size], unit, earlier)
        row.update(baseline="Debezium embedded engine", notes=[f"Debezium not measured: {why}"])
        rows.append(row)
    return rows


def debezium(pg: PostgresServer, maria: MariaDBServer, work: Path, sizes: dict[str, int],
             earlier: list[Row]) -> list[Row]:
    """Debezium's rate on each streaming workload, and cdcd / Debezium with ``earlier`` results."""
    why_not = build()
    if why_not is not None:
        return not_measured(why_not, sizes, earlier)
    work.mkdir(parents=True)
    version = debezium_version()
    pg_db = pg.create_database("bench_debezium")
    pg.psql(workloads.PG_NARROW, pg_db)
    pg.psql(workloads.PG_WIDE, pg_db)
    pg.psql("CREATE PUBLICATION dbz FOR TABLE narrow, wide", pg_db)
    maria_db = maria.create_database("bench_debezium")
    maria.sql(workloads.MARIA_NARROW, maria_db)
    maria.sql(workloads.MARIA_WIDE, maria_db)
    rows = []
    for source, table, size, unit in CASES:
        row, cdcd_row = _row(source, table, sizes[size], unit, earlier)
        run_dir = work / f"{source.lower()}_{table}"
        if source == "PostgreSQL":
            pg_fill = workloads.pg_insert_narrow if table == "narrow" else workloads.pg_insert_wide
            run = pg_run(pg, pg_db, table, sizes[size], pg_fill, run_dir)
        else:
            maria_fill = workloads.maria_insert_narrow if table == "narrow" else workloads.maria_insert_wide
            run = maria_run(maria, maria_db, table, sizes[size], maria_fill, run_dir)
        rows.append(_compare(row, source, run, version, cdcd_row))
    return rows


def _compare(row: Row, source: str, run: DebeziumRun, version: str, cdcd_row: Row | None) -> Row:
    """Fill the Debezium figures; the ratio column compares like with like.

    PostgreSQL: cdcd's figure includes its start-up, so Debezium's includes the JVM's.
    MariaDB: cdcd's figure starts when the already-connected daemon is resumed, so Debezium's
    starts at its first event.
    """
    plugin = "pgoutput" if source == "PostgreSQL" else "binlog"
    if source == "PostgreSQL":
        base, base_s = run.rate, run.seconds
        label = f"Debezium {version} embedded engine ({plugin}), counting consumer, JVM start-up included"
        other = f"Debezium from its first event: {run.rate_from_first_event:,.0f} {row['unit']}"
    else:
        base, base_s = run.rate_from_first_event, run.from_first_event
        label = f"Debezium {version} embedded engine ({plugin}), counting consumer, from its first event"
        other = f"Debezium with JVM start-up: {run.rate:,.0f} {row['unit']} in {run.seconds:.2f} s"
    notes = [other]
    if cdcd_row is None:
        notes.append(f"no cdcd figure in this run: add {'pg_stream' if source == 'PostgreSQL' else 'maria_stream'}"
                     " to --only")
    else:
        notes.append(f"cdcd / Debezium with JVM start-up: {cdcd_row['cdcd'] / run.rate:.2f}; "
                     f"from Debezium's first event: {cdcd_row['cdcd'] / run.rate_from_first_event:.2f}")
    if run.peak_rss_mb is not None:
        notes.append(f"Debezium peak RSS {run.peak_rss_mb:,.0f} MB")
    row.update(baseline=label, debezium_version=version, baseline_rate=round(base, 1),
               baseline_seconds=round(base_s, 2),
               debezium_rate_with_startup=round(run.rate, 1), debezium_seconds=round(run.seconds, 2),
               debezium_rate_from_first_event=round(run.rate_from_first_event, 1),
               debezium_seconds_from_first_event=round(run.from_first_event, 2),
               debezium_peak_rss_mb=None if run.peak_rss_mb is None else round(run.peak_rss_mb, 1), notes=notes)
    if cdcd_row is not None:
        row["ratio"] = round(cdcd_row["cdcd"] / base, 3)
    return row
