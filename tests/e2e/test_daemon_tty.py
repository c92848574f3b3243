"""On a TTY, `cdcd run` shows a live snapshot table per table, then a one-line streaming status."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from cdcd.landing.reader import landed_seqs, mark_consumed
from devtools.servers import PostgresServer

CDCD = str(Path(sys.executable).with_name("cdcd"))
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def _wait(what: str, predicate, timeout: float = 90) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def test_live_display_on_a_tty(pg_server: PostgresServer, pg_db: str, tmp_path: Path) -> None:
    pg_server.psql("CREATE TABLE items (id int PRIMARY KEY, v text);"
                   "INSERT INTO items SELECT g, 'v' || g FROM generate_series(1, 400) g", pg_db)
    landing = tmp_path / "landing"
    config = tmp_path / "cdcd.toml"
    sections = {
        "source": {"kind": "postgres", "port": pg_server.port, "user": "postgres", "database": pg_db,
                   "tables": ["public.items"], "sslmode": "disable"},
        "source.postgres": {"slot": f"tty_{pg_db}", "publication": f"tty_{pg_db}"},
        "snapshot": {"chunk_rows": 50},
        # Consumed mode with nobody consuming holds the snapshot still while the display is on screen.
        "landing": {"path": str(landing), "ack": "consumed", "max_batch_events": 50, "max_batch_delay_ms": 50},
        "runtime": {"max_inflight_batches": 2},
        "state": {"path": str(tmp_path / "state")},
        "http": {"listen": ""},
    }
    config.write_text("".join(f"[{name}]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in values.items())
                              for name, values in sections.items()))
    screen = tmp_path / "screen.txt"
    # script(1) gives the daemon a pseudo-terminal as stdout, as an operator's shell would.
    # `exec` so the shell script(1) starts is replaced by the daemon: the exit status is the daemon's own.
    proc = subprocess.Popen(["script", "-qfec", f"exec {CDCD} run -c {config}", str(screen)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        def text() -> str:
            return ANSI.sub("", screen.read_text(errors="replace")) if screen.exists() else ""

        _wait("the snapshot table", lambda: "public.items" in text() and "snapshot" in text())
        assert re.search(r"rows/s", text()) and "ETA" in text()
        assert '"event"' not in text()  # a TTY gets the display and console logs, not JSON lines

        def drain() -> bool:
            for seq in landed_seqs(landing):
                mark_consumed(landing, seq)
            return "streaming" in text() and "401 events committed" in text()  # 400 rows + the snapshot's truncate

        _wait("the streaming status line", drain)
    finally:
        # Only the daemon gets the stop signal; a shell in between would die of it and hide the exit code.
        for child in psutil.Process(proc.pid).children(recursive=True):
            if child.name() == "cdcd":
                child.send_signal(signal.SIGTERM)
        proc.wait(60)
    assert proc.returncode == 0
