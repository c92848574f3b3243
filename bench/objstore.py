"""The landing zone on object storage next to local disk: the same PostgreSQL stream landed by ``cdcd run`` into
a directory and into ``s3://`` on a local S3 server (versitygw, devtools.s3server.S3Server), as events/s, and the
latency of a one-row transaction from commit to checkpoint on each (docs/benchmarks.md, "Object storage")."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

from bench import workloads
from bench.common import Row, pair, pg_source
from bench.harness import Daemon, run_daemon_until, write_config
from devtools.s3server import S3Server
from devtools.servers import PostgresServer

#: One-row transactions timed from commit to checkpoint, on each landing zone.
LATENCY_SAMPLES = 20


def landing_config(pg: PostgresServer, db: str, work: Path, slot: str, s3: S3Server | None,
                   batch_delay_ms: int | None = 0) -> Path:
    """A daemon streaming the narrow table from ``slot`` into ``s3://bench/SLOT`` (local disk without ``s3``);
    ``batch_delay_ms`` None: the default batching."""
    work.mkdir(parents=True)
    landing: dict[str, object] = {} if batch_delay_ms is None else {"max_batch_delay_ms": batch_delay_ms}
    if s3 is not None:
        (work / "s3-secret").write_text(s3.secret_key)
        landing.update(path=f"s3://bench/{slot}", s3={"endpoint": s3.endpoint, "region": s3.region,
                                                    "access_key_id": s3.access_key,
                                                    "secret_access_key_file": str(work / "s3-secret")})
    source = pg_source(pg, db, ["public.narrow"], slot=slot)
    return write_config(work / "cdcd.toml", source, work, landing=landing, snapshot={"mode": "never"})


def _latency(pg: PostgresServer, db: str, config: Path, work: Path, first_id: int, backlog: int) -> list[float]:
    """Seconds from each one-row commit until the daemon's checkpoint holds it (the daemon idle in between), once
    it has checkpointed its ``backlog`` (the events of its slot so far)."""
    daemon = Daemon(config, work).start()
    try:
        daemon.wait_committed(backlog, timeout=300)
        out = []
        for i in range(LATENCY_SAMPLES):
            before = daemon.committed_events()
            start = time.perf_counter()
            pg.psql(f"INSERT INTO narrow (id, a, b, c) VALUES ({first_id + i}, 1, 'x', now())", db)
            daemon.wait_committed(before + 1, timeout=60)
            out.append(time.perf_counter() - start)
        return out
    finally:
        daemon.stop()


def pg_landing_s3(pg: PostgresServer, work: Path, sizes: dict[str, int]) -> list[Row]:
    db = pg.create_database("bench_objstore")
    pg.psql(workloads.PG_NARROW, db)
    pg.psql("CREATE PUBLICATION cdcd FOR TABLE narrow", db)
    s3 = S3Server().start()
    try:
        s3.create_bucket("bench")
        count = sizes["stream"]
        zones: tuple[tuple[str, S3Server | None], ...] = (("disk", None), ("s3", s3))
        timed, lat = {}, {}
        for name, _ in zones:  # both slots see the same stream
            pg.psql(f"SELECT pg_create_logical_replication_slot('{name}', 'pgoutput')", db)
        workloads.pg_insert_narrow(pg, db, 1, count, 1000)
        for name, store in zones:
            timed[name] = run_daemon_until(landing_config(pg, db, work / name, name, store), work / name, count)
        for n, (name, _) in enumerate(zones):
            # the second daemon first reads the first one's latency rows from its own slot
            lat[name] = _latency(pg, db, work / name / "cdcd.toml", work / name, count + 1 + n * LATENCY_SAMPLES,
                                 count + n * LATENCY_SAMPLES)
        ms = {k: (round(statistics.median(v) * 1000, 1), round(max(v) * 1000, 1)) for k, v in lat.items()}
        return [
            pair("PostgreSQL streaming to object storage (local S3 server), narrow table", "events/s", timed["s3"],
                 timed["disk"], "cdcd landing the same stream on local disk", peak_rss_mb=timed["s3"].peak_rss_mb),
            {"measure": "latency, commit to checkpoint of a one-row transaction, object storage (local S3 server)",
             "unit": "ms", "p50_ms": ms["s3"][0], "p99_ms": ms["s3"][1], "events": LATENCY_SAMPLES,
             "config": "landing.max_batch_delay_ms = 0; p99 is the highest of the samples",
             "baseline": f"the same on local disk: p50 {ms['disk'][0]} ms, highest {ms['disk'][1]} ms"},
        ]
    finally:
        s3.stop()
