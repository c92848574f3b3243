"""What the benchmark's scenarios share: result rows, source configs, waits on the daemon, a paced writer."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from typing import Any

from bench.harness import Daemon, Timed
from devtools.servers import MariaDBServer, PostgresServer

Row = dict[str, Any]


def pair(measure: str, unit: str, ours: Timed, base: Timed | None, baseline: str, **extra: Any) -> Row:
    row: Row = {"measure": measure, "unit": unit, "cdcd": round(ours.rate, 1), "cdcd_seconds": round(ours.seconds, 2),
                "items": ours.items, "baseline": baseline}
    if base is not None:
        row.update(baseline_rate=round(base.rate, 1), baseline_seconds=round(base.seconds, 2),
                   ratio=round(ours.rate / base.rate, 3))
    row.update(extra)
    return row


def pg_source(pg: PostgresServer, db: str, tables: list[str], slot: str = "cdcd") -> dict[str, Any]:
    return {"kind": "postgres", "port": pg.port, "user": "postgres", "database": db, "tables": tables,
            "sslmode": "disable", "postgres": {"slot": slot, "publication": "cdcd"}}


def maria_source(m: MariaDBServer, db: str, tables: list[str]) -> dict[str, Any]:
    return {"kind": "mariadb", "port": m.port, "user": "root", "database": db, "tables": tables,
            "sslmode": "disable", "mysql": {"server_id": 9001}}


def free_port() -> int:
    from devtools.servers import free_port

    return free_port()


def wait_ready(port: int, daemon: Daemon, timeout: float = 60) -> None:
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


def wait_checkpoint(daemon: Daemon, timeout: float = 60) -> None:
    """Wait until the daemon saved a first checkpoint (its slot and watermark are durable)."""
    state = daemon.work / "state" / "checkpoint.json"
    deadline = time.monotonic() + timeout
    while not state.exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"no checkpoint within {timeout}s:\n{daemon.tail()}")
        time.sleep(0.05)



def paced_inserts(client: list[str], statement: Callable[[int, int], str], rate: int, per_tx: int,
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
