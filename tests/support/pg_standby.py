"""A physical standby of a throwaway PostgreSQL 17+ that synchronises the primary's failover slots.

``start_standby`` takes a base backup (pg_basebackup) of ``primary`` into a temporary directory and starts it as a
hot standby streaming from its own physical slot on the primary, with ``hot_standby_feedback`` and
``sync_replication_slots = on`` (``primary_conninfo`` names the database, as slot synchronisation needs), on a
free port. ``promote`` makes it the primary. Stopped like any ``PostgresServer`` (``stop()``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from support.waits import wait_for

from devtools.servers import PostgresServer, ServerError, _run_as, free_port, service_user


def start_standby(primary: PostgresServer, slot: str, database: str) -> PostgresServer:
    """A hot standby of ``primary`` on its physical slot ``slot`` (created here), synchronising the failover
    slots of ``database``."""
    primary.psql(f"SELECT pg_create_physical_replication_slot('{slot}', true)")
    standby = PostgresServer(bindir=primary.bindir)
    standby.root = Path(tempfile.mkdtemp(prefix="cdcd-pg-standby-"))
    os.chmod(standby.root, 0o755)
    owner = service_user()
    if owner:
        shutil.chown(standby.root, owner)
    subprocess.run([str(standby.bin / "pg_basebackup"), "-h", "127.0.0.1", "-p", str(primary.port), "-U", "postgres",
                    "-D", str(standby.data), "-X", "stream", "-c", "fast", "--no-sync"],
                   check=True, capture_output=True, timeout=180, **_run_as(owner))
    standby.port = free_port()
    conf = {
        "port": str(standby.port),
        "unix_socket_directories": f"'{standby.root}'",
        "primary_conninfo": f"'host=127.0.0.1 port={primary.port} user=postgres dbname={database}'",
        "primary_slot_name": f"'{slot}'",
        "hot_standby": "on",
        "hot_standby_feedback": "on",
        "sync_replication_slots": "on",
    }
    with open(standby.data / "postgresql.conf", "a") as f:
        f.writelines(f"{k} = {v}\n" for k, v in conf.items())
    (standby.data / "standby.signal").touch()
    if owner:
        shutil.chown(standby.data / "standby.signal", owner)
    standby._launch()
    return standby


def wait_slot_synced(standby: PostgresServer, slot: str, timeout: float = 120) -> None:
    """Until the standby holds a synchronised copy of the logical slot ``slot`` that is ready for use after a
    promotion (not temporary: the slot sync worker made it persistent)."""
    query = f"SELECT synced AND NOT temporary FROM pg_replication_slots WHERE slot_name = '{slot}'"
    wait_for(f"the standby on port {standby.port} to synchronise slot {slot!r}", lambda: standby.psql(query) == "t",
             timeout, log=standby.root / "server.log", step=0.2)


def promote(standby: PostgresServer) -> None:
    """Promote the standby and wait (at most 60 s) until it accepts writes."""
    if standby.psql("SELECT pg_promote(true, 60)") != "t":
        raise ServerError(f"the standby on port {standby.port} was not promoted within 60 s")
