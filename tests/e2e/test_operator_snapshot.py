"""The operator's commands against a running `cdcd run` on the session PostgreSQL.

`cdcd snapshot TABLE` re-snapshots a table whose rows were deleted behind cdcd's back while
a workload writes, and the landing records what it covered (the Spark consumer's use of that
record, with `cdcd verify`, is tested in test_incremental_snapshot.py for both sources). `cdcd tables reload` and SIGHUP
re-read source.tables; a config that does not load changes nothing; progress shows in
/status, /metrics and `cdcd status`.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.landed import landed_ids
from test_daemon_lifecycle import CDCD, WAIT_S, Daemon, create_orders, daemons, make_config, workload

from cdcd.daemon.exitcodes import ExitCode
from cdcd.landing.manifest import covered_records
from cdcd.landing.reader import read_batches
from devtools.servers import PostgresServer

__all__ = ["daemons"]  # the fixture


def cdcd(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([CDCD, *args], capture_output=True, text=True, timeout=WAIT_S)


def job(d: Daemon, table: str) -> dict[str, Any] | None:
    """The newest incremental snapshot of ``table`` in the daemon's /status."""
    found = [j for j in d.status().get("incremental_snapshots") or [] if j["table"] == table]
    return found[-1] if found else None


def done(d: Daemon, table: str, before: int = 0) -> bool:
    jobs = [j for j in d.status().get("incremental_snapshots") or [] if j["table"] == table]
    assert not any(j["state"] == "failed" for j in jobs), jobs
    return len(jobs) > before and jobs[-1]["state"] == "done"


def metric(d: Daemon, name: str, table: str) -> float | None:
    got = d.get("/metrics")
    assert got is not None and got[0] == 200
    for family in text_string_to_metric_families(got[1]):
        for s in family.samples:
            if s.name == name and s.labels.get("table") == table:
                return float(s.value)
    return None


def source_max_id(pg: PostgresServer, db: str) -> int:
    return int(pg.psql("SELECT max(id) FROM orders", db).strip())


@pytest.mark.slow
def test_resnapshot_after_rows_deleted_behind_cdcds_back_records_what_it_covered(
        pg_server: PostgresServer, pg_db: str, tmp_path: Path, daemons: list[Daemon]) -> None:
    create_orders(pg_server, pg_db, 300)
    cfg, http = make_config(tmp_path, pg_server.port, pg_db, snapshot={"chunk_rows": 40})
    d = Daemon(cfg, http)
    daemons.append(d)
    d.wait_ready()
    d.wait("the initial snapshot landed", lambda: len(landed_ids(tmp_path / "landing")) >= 300)
    # behind cdcd's back: deletes while the table is out of the publication are never decoded
    pub = f"p_{pg_db}"
    for sql in (f"ALTER PUBLICATION {pub} DROP TABLE orders", "DELETE FROM orders WHERE id % 7 = 0",
                f"ALTER PUBLICATION {pub} ADD TABLE orders"):  # three transactions
        pg_server.psql(sql, pg_db)

    writer = workload(pg_server, pg_db, 1000, 300)  # inserts committed while the chunks are read
    try:
        asked = cdcd("snapshot", "-c", str(cfg), "public.orders")
        assert asked.returncode == 0, asked.stderr
        assert "queued: an incremental snapshot of public.orders" in asked.stdout
        d.wait("the re-snapshot done", lambda: done(d, "public.orders"))
    finally:
        assert writer.wait(WAIT_S) == 0
    progress = job(d, "public.orders")
    assert progress is not None and progress["chunks"] >= 6 and progress["rows"] >= 250, progress
    assert metric(d, "cdcd_incremental_snapshot_rows", "public.orders") == progress["rows"]
    assert metric(d, "cdcd_incremental_snapshot_running", "public.orders") == 0
    shown = cdcd("status", "-c", str(cfg))
    assert f"incremental snapshot public.orders: done, {progress['chunks']} chunks" in shown.stdout, shown.stdout

    last = source_max_id(pg_server, pg_db)
    d.wait("the workload landed", lambda: last in landed_ids(tmp_path / "landing"))
    d.proc.send_signal(signal.SIGTERM)
    assert d.exit_code() == ExitCode.OK
    records = [r for b in read_batches(tmp_path / "landing") for r in covered_records(b.manifest)]
    assert [(s, t) for s, t, _ in records] == [("public", "orders")]

    stopped = cdcd("snapshot", "-c", str(cfg), "public.orders")
    assert stopped.returncode == ExitCode.FAILURE and "no cdcd daemon runs on" in stopped.stderr


def test_tables_reload_and_sighup_and_refused_requests(
        pg_server: PostgresServer, pg_db: str, tmp_path: Path, daemons: list[Daemon]) -> None:
    create_orders(pg_server, pg_db, 20)
    pg_server.psql("CREATE TABLE items (id int PRIMARY KEY, name text);"
                   "INSERT INTO items SELECT g, 'item ' || g FROM generate_series(1, 100) g", pg_db)
    # a chunk fills a batch: the marks after the last chunk come in a batch of marks only, which lands
    # because it holds the covered record
    cfg, http = make_config(tmp_path, pg_server.port, pg_db, snapshot={"chunk_rows": 25},
                            landing={"max_batch_events": 25})
    cli = tmp_path / "cli.toml"  # the CLI's copy: finds the daemon while the daemon's file is broken
    shutil.copy(cfg, cli)
    good = cfg.read_text()
    d = Daemon(cfg, http)
    daemons.append(d)
    d.wait_ready()

    unknown = cdcd("snapshot", "-c", str(cli), "public.items", "--where", "id > 5")
    assert unknown.returncode == ExitCode.FAILURE
    assert "table 'public.items' is not captured; source.tables lists: public.orders" in unknown.stderr

    cfg.write_text(good.replace('tables = ["public.orders"]', 'tables = ["public.orders", "items"]'))
    broken = cdcd("tables", "reload", "-c", str(cli))
    assert broken.returncode == ExitCode.FAILURE
    assert "config not reloaded, the running daemon is unchanged" in broken.stderr and "items" in broken.stderr
    d.proc.send_signal(signal.SIGHUP)
    d.wait("SIGHUP refused", lambda: any(e["event"].startswith("SIGHUP: config not reloaded")
                                         for e in d.log_lines()))
    assert (d.get("/readyz") or (0,))[0] == 200 and job(d, "public.items") is None

    # a reload the daemon cannot apply (a table without a key to snapshot it by) exits 1 with the daemon's reason,
    # and the table is not captured
    pg_server.psql("CREATE TABLE nokey (v int)", pg_db)
    cfg.write_text(good.replace('tables = ["public.orders"]', 'tables = ["public.orders", "public.nokey"]'))
    failed = cdcd("tables", "reload", "-c", str(cli))
    assert failed.returncode == ExitCode.FAILURE and "public.nokey" in failed.stderr, failed.stdout + failed.stderr
    assert "added" not in failed.stdout
    assert d.status()["source"]["tables"] == ["public.orders"]
    assert "is not captured" in cdcd("snapshot", "-c", str(cli), "public.nokey").stderr

    cfg.write_text(good.replace('tables = ["public.orders"]', 'tables = ["public.orders", "public.items"]'))
    reloaded = cdcd("tables", "reload", "-c", str(cli))
    assert reloaded.returncode == 0, reloaded.stderr
    assert "added public.items" in reloaded.stdout
    d.wait("public.items snapshotted", lambda: done(d, "public.items"))
    d.wait("public.items landed", lambda: sum(
        t.num_rows for b in read_batches(tmp_path / "landing") for tid, t in b.tables.items()
        if str(tid) == "public.items") >= 100)
    # a condition the server cannot plan is refused with its words before anything is queued
    for bad, words in (("id >", "syntax error"), ("no_such_column = 1", 'column "no_such_column" does not exist'),
                       ("id > 1; DROP TABLE public.items", "syntax error")):
        refused = cdcd("snapshot", "-c", str(cli), "public.items", "--where", bad)
        assert refused.returncode == ExitCode.FAILURE and words in refused.stderr, refused.stderr
    assert job(d, "public.items")["where"] is None  # type: ignore[index]
    where = cdcd("snapshot", "-c", str(cli), "public.items", "--where", "id > 80")
    assert where.returncode == 0 and "the rows of public.items where id > 80" in where.stdout, where.stderr
    d.wait("the WHERE snapshot done", lambda: done(d, "public.items", before=1))
    assert job(d, "public.items")["rows"] == 20  # type: ignore[index]

    # SIGHUP with the table removed: no longer captured (what was landed stays)
    cfg.write_text(good)
    d.proc.send_signal(signal.SIGHUP)
    d.wait("SIGHUP reload", lambda: any(e["event"] == "SIGHUP: config reloaded" and e.get("tables_removed")
                                        == ["public.items"] for e in d.log_lines()))
    again = cdcd("tables", "reload", "-c", str(cli))
    assert again.returncode == 0 and "source.tables unchanged (public.orders)" in again.stdout
    d.proc.send_signal(signal.SIGTERM)
    assert d.exit_code() == ExitCode.OK
    # the whole-table snapshot of the added table records what it covered; the WHERE snapshot its key range too
    records = [r for b in read_batches(tmp_path / "landing") for r in covered_records(b.manifest)]
    assert [(s, t) for s, t, _ in records] == [("public", "items")] * 2
    ranges = [c.range for b in read_batches(tmp_path / "landing") for c in b.manifest.covered]
    assert ranges == [None, {"column": "id", "lo": 80, "lo_inclusive": False, "hi": None, "hi_inclusive": True}]
    no_http = tmp_path / "nohttp.toml"
    no_http.write_text(good.replace(f'listen = "127.0.0.1:{http}"', 'listen = ""'))
    off = cdcd("snapshot", "-c", str(no_http), "public.orders")
    assert off.returncode == ExitCode.CONFIG and "http.listen is off" in off.stderr


def test_a_replaced_table_stays_in_status_after_a_sigkill_until_its_snapshot_completes(
        pg_server: PostgresServer, pg_db: str, tmp_path: Path, daemons: list[Daemon]) -> None:
    from cdcd.checkpoint.store import Checkpoint

    create_orders(pg_server, pg_db, 100)
    cfg, http = make_config(tmp_path, pg_server.port, pg_db, snapshot={"chunk_rows": 40}, source={"postgres": {
        "slot": f"s_{pg_db}", "publication": f"p_{pg_db}", "heartbeat_s": 0.5}})
    path = tmp_path / "state" / "checkpoint.json"

    def flagged() -> dict[str, str]:
        ckpt = Checkpoint.from_bytes(path.read_bytes(), path) if path.exists() else None
        return dict((ckpt.source_state if ckpt else {}).get("tables_needing_snapshot") or {})

    d = Daemon(cfg, http)
    daemons.append(d)
    d.wait_ready()
    d.wait("the initial snapshot landed", lambda: len(landed_ids(tmp_path / "landing")) >= 100)
    pg_server.psql("DROP TABLE orders", pg_db)
    create_orders(pg_server, pg_db, 150)
    d.wait("the replaced table in /status", lambda: "public.orders" in d.status()["source"].get(
        "tables_needing_snapshot", {}))
    why = d.status()["source"]["tables_needing_snapshot"]["public.orders"]
    d.wait("the flag in the checkpoint", lambda: "public.orders" in flagged())
    d.proc.kill()
    d.proc.wait(WAIT_S)

    d = Daemon(cfg, http)  # the new daemon loads the new table's OID: only the checkpoint knows
    daemons.append(d)
    d.wait_ready()
    assert d.status()["source"]["tables_needing_snapshot"] == {"public.orders": why}
    # what the operator acts on shows in `cdcd status` and in the metrics
    shown = cdcd("status", "-c", str(cfg))
    assert "captured tables: public.orders" in shown.stdout and f"needs a re-snapshot: public.orders: {why}" \
        in shown.stdout, shown.stdout
    metrics = (d.get("/metrics") or (0, ""))[1]
    assert 'cdcd_table_needs_snapshot{table="public.orders"} 1.0' in metrics
    assert 'cdcd_table_captured{table="public.orders"} 1.0' in metrics and "cdcd_table_reload_failed 0.0" in metrics
    asked = cdcd("snapshot", "-c", str(cfg), "public.orders")
    assert asked.returncode == 0, asked.stderr
    d.wait("the re-snapshot done", lambda: done(d, "public.orders"))
    assert "tables_needing_snapshot" not in d.status()["source"]
    d.wait("the flag gone from the checkpoint", lambda: not flagged())
    d.proc.send_signal(signal.SIGTERM)
    assert d.exit_code() == ExitCode.OK
