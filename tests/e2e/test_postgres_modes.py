"""snapshot.mode = initial_only with the real daemon: the snapshot lands, then the daemon exits cleanly."""

from __future__ import annotations

from pathlib import Path

from test_postgres_crash import Setup, rows

from devtools.servers import PostgresServer


def test_initial_only_lands_the_snapshot_and_exits(tmp_path: Path, pg_server: PostgresServer, pg_db: str) -> None:
    s = Setup(tmp_path, pg_server, pg_db)
    try:
        pg_server.psql("CREATE TABLE t (id int PRIMARY KEY, v int);"
                       "INSERT INTO t SELECT g, g FROM generate_series(1, 55) g", pg_db)
        proc = s.start("landed", snapshot={"mode": "initial_only"})
        assert proc.wait(90) == 0, s.log.read_text()[-3000:]
        landed = [r for b in s.batches() for r in rows(b)]
        assert sorted(r["id"] for r in landed) == list(range(1, 56)) and all(r["_cdc_snapshot"] for r in landed)
        ckpt = s.checkpoint()
        assert ckpt is not None and ckpt.source_state["snapshot"]["status"] == "done"
        assert pg_server.psql(f"SELECT count(*) FROM pg_replication_slots WHERE slot_name = '{s.slot}'",
                              pg_db) == "0"
        # A second run has nothing to do.
        proc = s.start("landed", snapshot={"mode": "initial_only"})
        assert proc.wait(90) == 0, s.log.read_text()[-3000:]
        assert sorted(r["id"] for b in s.batches() for r in rows(b)) == list(range(1, 56))
    finally:
        s.close()
