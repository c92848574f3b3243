"""`cdcd run` on the session PostgreSQL: a captured table dropped and re-created while the daemon was stopped is
listed in /status at the next start (the checkpoint keeps each table's relation OID), the other tables stream, and
`cdcd snapshot TABLE` clears it."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

from support.landed import landed_ids
from test_daemon_lifecycle import CDCD, WAIT_S, Daemon, create_orders, daemons, make_config

from cdcd.daemon.exitcodes import ExitCode
from devtools.servers import PostgresServer

__all__ = ["daemons"]  # the fixture


def test_a_table_replaced_while_the_daemon_was_stopped_is_listed_at_start_until_its_snapshot(
        pg_server: PostgresServer, pg_db: str, tmp_path: Path, daemons: list[Daemon]) -> None:
    create_orders(pg_server, pg_db, 100)
    pg_server.psql("CREATE TABLE items (id int PRIMARY KEY)", pg_db)
    cfg, http = make_config(tmp_path, pg_server.port, pg_db, snapshot={"chunk_rows": 40}, source={
        "tables": ["public.orders", "public.items"],
        "postgres": {"slot": f"s_{pg_db}", "publication": f"p_{pg_db}", "heartbeat_s": 0.5}})
    landing = tmp_path / "landing"
    d = Daemon(cfg, http)
    daemons.append(d)
    d.wait_ready()
    d.wait("the initial snapshot landed", lambda: len(landed_ids(landing, "public.orders")) >= 100)
    d.proc.send_signal(signal.SIGTERM)
    assert d.exit_code() == ExitCode.OK

    pg_server.psql("DROP TABLE orders", pg_db)  # while the daemon is stopped
    create_orders(pg_server, pg_db, 150)
    pg_server.psql("INSERT INTO items VALUES (1)", pg_db)

    d = Daemon(cfg, http)
    daemons.append(d)
    d.wait_ready()
    why = d.status()["source"]["tables_needing_snapshot"]["public.orders"]
    assert "dropped and re-created (relation OID" in why and f"publication 'p_{pg_db}' no longer covers it" in why
    pg_server.psql("INSERT INTO items VALUES (2)", pg_db)
    d.wait("the other table streams", lambda: {1, 2} <= landed_ids(landing, "public.items"))
    asked = subprocess.run([CDCD, "snapshot", "-c", str(cfg), "public.orders"], capture_output=True, text=True,
                           timeout=WAIT_S)
    assert asked.returncode == 0, asked.stderr
    d.wait("the flag cleared by the re-snapshot", lambda: "tables_needing_snapshot" not in d.status()["source"])
    d.wait("the new table's rows landed", lambda: set(range(101, 151)) <= landed_ids(landing, "public.orders"))
    d.proc.send_signal(signal.SIGTERM)
    assert d.exit_code() == ExitCode.OK

    d = Daemon(cfg, http)  # the new table's OID is the baseline now: no flag
    daemons.append(d)
    d.wait_ready()
    assert "tables_needing_snapshot" not in d.status()["source"]
    d.proc.send_signal(signal.SIGTERM)
    assert d.exit_code() == ExitCode.OK
