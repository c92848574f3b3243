"""`cdcd run` as a real process against the session PostgreSQL: signals, exit codes,
checkpoints after graceful stop / force-stop / SIGKILL, sd_notify, HTTP endpoints,
one daemon per state directory, `cdcd stop` and `cdcd status`."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.waits import WAIT_S, wait_for

from cdcd.checkpoint.store import CheckpointStore
from cdcd.daemon.exitcodes import ExitCode
from cdcd.landing.reader import mark_consumed, read_batches
from devtools.servers import PostgresServer, free_port

CDCD = str(Path(sys.executable).with_name("cdcd"))
_n = itertools.count(1)


# -- helpers ------------------------------------------------------------------------------


class Daemon:
    """One `cdcd run` subprocess, its log and its HTTP endpoints."""

    def __init__(self, cfg: Path, http_port: int, env: dict[str, str] | None = None) -> None:
        self.cfg = cfg
        self.port = http_port
        self.log_path = cfg.parent / f"daemon-{next(_n)}.log"
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen([CDCD, "run", "-c", str(cfg)], stdout=self._log, stderr=subprocess.STDOUT,
                                     text=True, env={**os.environ, **(env or {})})

    def get(self, path: str) -> tuple[int, str] | None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=5) as resp:
                return resp.status, resp.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return None

    def status(self) -> dict[str, Any]:
        got = self.get("/status")
        assert got is not None and got[0] == 200, got
        doc: dict[str, Any] = json.loads(got[1])
        return doc

    def stats(self) -> dict[str, Any]:
        stats: dict[str, Any] = self.status()["stats"]
        return stats

    def wait(self, what: str, predicate: Callable[[], Any], timeout: float = WAIT_S) -> Any:
        return wait_for(what, predicate, timeout, procs=self.proc, log=self.log_path)

    def wait_ready(self) -> None:
        self.wait("/readyz 200", lambda: (self.get("/readyz") or (0,))[0] == 200)

    def exit_code(self, timeout: float = WAIT_S) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"daemon did not exit:\n{self.log_path.read_text()[-3000:]}") from None

    def log_lines(self) -> list[dict[str, Any]]:
        out = []
        for line in self.log_path.read_text().splitlines():
            with contextlib.suppress(ValueError):
                out.append(json.loads(line))
        return out

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self._log.close()


@pytest.fixture
def daemons() -> Iterator[list[Daemon]]:
    started: list[Daemon] = []
    try:
        yield started
    finally:
        for d in started:
            d.close()


def make_config(tmp_path: Path, port: int, database: str, **sections: dict[str, Any]) -> tuple[Path, int]:
    http_port = free_port()
    doc: dict[str, dict[str, Any]] = {
        "source": {"kind": "postgres", "port": port, "user": "postgres", "database": database,
                   "tables": ["public.orders"], "connect_timeout_s": 60,
                   "postgres": {"slot": f"s_{database}", "publication": f"p_{database}"}},
        "state": {"path": str(tmp_path / "state")},
        "landing": {"path": str(tmp_path / "landing"), "max_batch_events": 20, "max_batch_delay_ms": 50},
        "http": {"listen": f"127.0.0.1:{http_port}"},
        "log": {"format": "json"},
    }
    for name, values in sections.items():
        doc.setdefault(name, {}).update(values)
    lines = []
    for section, values in doc.items():
        nested = {k: v for k, v in values.items() if isinstance(v, dict)}
        lines.append(f"[{section}]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in values.items() if not isinstance(v, dict)]
        for sub, subvalues in nested.items():
            lines.append(f"[{section}.{sub}]")
            lines += [f"{k} = {json.dumps(v)}" for k, v in subvalues.items()]
    cfg = tmp_path / "cdcd.toml"
    cfg.write_text("\n".join(lines) + "\n")
    return cfg, http_port


def create_orders(pg: PostgresServer, db: str, rows: int) -> None:
    pg.psql("CREATE TABLE orders (id int PRIMARY KEY, amount numeric(10,2), note text);"
            f"INSERT INTO orders SELECT g, g * 1.5, 'row ' || g FROM generate_series(1, {rows}) g", db)


def insert_rows(pg: PostgresServer, db: str, first: int, count: int, per_tx: int = 10) -> None:
    for start in range(first, first + count, per_tx):
        end = min(start + per_tx, first + count) - 1
        pg.psql(f"INSERT INTO orders SELECT g, g, 'new' FROM generate_series({start}, {end}) g", db)


def workload(pg: PostgresServer, db: str, first: int, count: int) -> subprocess.Popen[bytes]:
    """A background writer: one committed insert every few milliseconds."""
    sql = (f"DO $$ BEGIN FOR i IN {first}..{first + count - 1} LOOP "
           "INSERT INTO orders VALUES (i, i, 'stream'); COMMIT; PERFORM pg_sleep(0.005); END LOOP; END $$")
    from devtools.servers import pg_bindir

    return subprocess.Popen([str(pg_bindir() / "psql"), "-X", "-q", "-h", "127.0.0.1", "-p", str(pg.port),
                             "-U", "postgres", "-d", db, "-c", sql], stdout=subprocess.DEVNULL)


def landed(tmp_path: Path) -> dict[int, list[dict[str, Any]]]:
    """Rows of every landed batch by seq."""
    out: dict[int, list[dict[str, Any]]] = {}
    for batch in read_batches(tmp_path / "landing"):
        out[batch.seq] = [row for table in batch.tables.values() for row in table.to_pylist()]
    return out


# -- graceful stop, force-stop, crash ----------------------------------------------------------


def test_sigterm_mid_stream_exits_0_with_everything_checkpointed(
    pg_server: PostgresServer, pg_db: str, tmp_path: Path, daemons: list[Daemon]
) -> None:
    create_orders(pg_server, pg_db, 100)
    cfg, http = make_config(tmp_path, pg_server.port, pg_db)
    d = Daemon(cfg, http)
    daemons.append(d)
    d.wait_ready()
    writer = workload(pg_server, pg_db, 1001, 2000)
    try:
        d.wait("streamed events committed", lambda: d.stats()["events_committed"] > 150)
        d.proc.send_signal(signal.SIGTERM)
        assert d.exit_code() == ExitCode.OK
    finally:
        writer.kill()
        writer.wait()
    ckpt = CheckpointStore(tmp_path / "state").load()
    batches = landed(tmp_path)
    assert ckpt is not None and batches
    # Every delivered batch was acked and is covered by the checkpoint: nothing landed beyond it. The
    # checkpoint may be a batch or more ahead: a batch of marks only (a commit, a heartbeat) is not landed.
    assert max(batches) <= ckpt.batch_seq
    assert sum(len(rows) for rows in batches.values()) == ckpt.event_count
    ids = [row["id"] for rows in batches.values() for row in rows]
    assert len(ids) == len(set(ids)) and set(range(1, 101)) <= set(ids)
    assert any(e["event"] == "stopped gracefully" for e in d.log_lines())


def test_second_sigterm_during_grace_force_stops(
    pg_server: PostgresServer, pg_db: str, tmp_path: Path, daemons: list[Daemon]
) -> None:
    create_orders(pg_server, pg_db, 100)
    # ack = consumed and no consumer: acks come only from what this test marks consumed.
    cfg, http = make_config(tmp_path, pg_server.port, pg_db, landing={"ack": "consumed"},
                            runtime={"shutdown_grace_s": 300})
    d = Daemon(cfg, http)
    daemons.append(d)
    d.wait_ready()
    d.wait("batches landed", lambda: len(landed(tmp_path)) >= 2)
    # Batch numbers have gaps (a batch of marks only is committed without landing): ack the first landed one.
    first = min(landed(tmp_path))
    mark_consumed(tmp_path / "landing", first)
    d.wait(f"batch {first} committed", lambda: d.stats()["committed_batch_seq"] == first)
    d.proc.send_signal(signal.SIGTERM)
    d.wait("stopping", lambda: d.status()["stopping"] and (d.get("/readyz") or (0,))[0] == 503)
    d.proc.send_signal(signal.SIGTERM)
    assert d.exit_code() == ExitCode.FORCE_STOPPED
    ckpt = CheckpointStore(tmp_path / "state").load()
    assert ckpt is not None and ckpt.batch_seq == first and ckpt.event_count == len(landed(tmp_path)[first])
    forced = [e for e in d.log_lines() if e["event"].startswith("force-stopped")]
    assert forced and forced[0]["dropped_events"] > 0 and forced[0]["committed_batch"] == first


def test_sigkill_then_restart_replays_only_unacked_batches(
    pg_server: PostgresServer, pg_db: str, tmp_path: Path, daemons: list[Daemon]
) -> None:
    create_orders(pg_server, pg_db, 20)
    # Room for every batch in flight: nothing is acked until the test marks batches consumed.
    cfg, http = make_config(tmp_path, pg_server.port, pg_db, landing={"ack": "consumed"},
                            runtime={"max_inflight_batches": 20})
    d = Daemon(cfg, http)
    daemons.append(d)
    d.wait_ready()
    d.wait("snapshot landed", lambda: sum(len(r) for r in landed(tmp_path).values()) == 21)  # + its truncate
    snapshot = sorted(landed(tmp_path))
    for seq in snapshot:
        mark_consumed(tmp_path / "landing", seq)
    d.wait("snapshot committed", lambda: d.stats()["events_committed"] == 21)  # and its opening truncate
    insert_rows(pg_server, pg_db, 1001, 80, per_tx=20)
    d.wait("80 streamed events landed", lambda: sum(len(r) for r in landed(tmp_path).values()) == 101)
    before = landed(tmp_path)
    streamed = sorted(set(before) - set(snapshot))
    acked = [*snapshot, *streamed[:2]]
    for seq in streamed[:2]:
        mark_consumed(tmp_path / "landing", seq)
    acked_events = sum(len(before[seq]) for seq in acked)
    d.wait("acked batches committed", lambda: d.stats()["events_committed"] == acked_events)
    d.proc.kill()
    d.exit_code()
    ckpt = CheckpointStore(tmp_path / "state").load()
    assert ckpt is not None and ckpt.event_count == acked_events and ckpt.batch_seq >= acked[-1]

    cfg, http = make_config(tmp_path, pg_server.port, pg_db, landing={"ack": "landed"})
    d2 = Daemon(cfg, http)
    daemons.append(d2)
    d2.wait_ready()
    d2.wait("replay committed", lambda: d2.stats()["events_committed"] >= 101)
    d2.proc.send_signal(signal.SIGTERM)
    assert d2.exit_code() == ExitCode.OK
    after = landed(tmp_path)
    replayed = [row["id"] for seq, rows in after.items() if seq > max(before) for row in rows]
    acked_ids = {row["id"] for seq in acked for row in before[seq]}
    unacked_ids = [row["id"] for seq, rows in before.items() if seq not in acked for row in rows]
    assert unacked_ids and sorted(replayed) == sorted(unacked_ids)  # every unacked event once more ...
    assert not acked_ids & set(replayed)  # ... and nothing that was acked
    final = CheckpointStore(tmp_path / "state").load()
    assert final is not None and final.event_count == 101 and final.batch_seq >= max(after)


# -- sd_notify, HTTP, one daemon per state directory, stop and status ---------------------------


class GatedProxy:
    """A TCP proxy to the database that holds every connection until ``release()``."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream = upstream_port
        self.gate = threading.Event()
        self.closed = threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.listener.settimeout(0.2)
        threading.Thread(target=self._accept, daemon=True).start()

    def release(self) -> None:
        self.gate.set()

    def close(self) -> None:
        self.closed.set()
        self.listener.close()

    def _accept(self) -> None:
        while not self.closed.is_set():
            try:
                client, _ = self.listener.accept()
            except (TimeoutError, OSError):
                continue
            threading.Thread(target=self._pipe, args=(client,), daemon=True).start()

    def _pipe(self, client: socket.socket) -> None:
        while not self.gate.wait(0.2):
            if self.closed.is_set():
                client.close()
                return
        with client, socket.create_connection(("127.0.0.1", self.upstream)) as server:
            peers = {client: server, server: client}
            while not self.closed.is_set():
                ready, _, _ = select.select(list(peers), [], [], 0.2)
                for sock in ready:
                    data = sock.recv(65536)
                    if not data:
                        return
                    peers[sock].sendall(data)


def _messages(sock: socket.socket) -> list[dict[str, str]]:
    out = []
    while True:
        try:
            data = sock.recv(4096, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return out
        out.append(dict(line.split("=", 1) for line in data.decode().splitlines()))


def _metrics(d: Daemon) -> dict[str, float]:
    got = d.get("/metrics")
    assert got is not None and got[0] == 200
    out = {}
    for family in text_string_to_metric_families(got[1]):
        for s in family.samples:
            label = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{label}}}" if label else s.name] = s.value
    return out


def test_notify_http_single_daemon_stop_and_status(
    pg_server: PostgresServer, pg_db: str, tmp_path: Path, daemons: list[Daemon]
) -> None:
    create_orders(pg_server, pg_db, 30)
    proxy = GatedProxy(pg_server.port)
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(tmp_path / "notify.sock"))
    received: list[dict[str, str]] = []
    try:
        cfg, http = make_config(tmp_path, proxy.port, pg_db)
        d = Daemon(cfg, http, env={"NOTIFY_SOCKET": str(tmp_path / "notify.sock"), "WATCHDOG_USEC": "1000000"})
        daemons.append(d)

        # Before the source connects: HTTP answers, /readyz says no, systemd has heard no READY.
        d.wait("/healthz", lambda: (d.get("/healthz") or (0,))[0] == 200)
        assert (d.get("/readyz") or (0,))[0] == 503
        assert _metrics(d)["cdcd_ready"] == 0
        received += _messages(notify)
        assert received and all("READY" not in m for m in received)

        proxy.release()
        d.wait_ready()
        d.wait("READY=1", lambda: any(m.get("READY") == "1" for m in (received.__iadd__(_messages(notify)))))
        ready_at = next(i for i, m in enumerate(received) if m.get("READY") == "1")
        assert "STATUS" in received[ready_at]

        # Counters move with a workload and the exposition parses.
        d.wait("snapshot committed", lambda: _metrics(d)["cdcd_events_committed_total"] == 31)  # and its truncate
        first = _metrics(d)
        insert_rows(pg_server, pg_db, 501, 40)
        d.wait("40 more events", lambda: _metrics(d)["cdcd_events_committed_total"] >= first[
            "cdcd_events_committed_total"] + 40)
        second = _metrics(d)
        assert second["cdcd_events_seen_total"] >= first["cdcd_events_seen_total"] + 40
        assert second["cdcd_table_events_total{table=public.orders}"] >= 40
        assert second["cdcd_ready"] == 1 and second["cdcd_source_connected"] == 1
        assert second["cdcd_snapshot_completed"] == 1 and "cdcd_postgres_slot_lag_bytes" in second
        # a schema change is counted per table, and /status shows the table's last one (issue 28)
        pg_server.psql("ALTER TABLE orders ADD COLUMN tag text DEFAULT 'x'; INSERT INTO orders VALUES (900, 1, 'n')",
                       pg_db)
        d.wait("the schema change committed",
               lambda: _metrics(d).get("cdcd_schema_changes_total{table=public.orders}") == 1)
        change = d.status()["stats"]["schema_changes"]["public.orders"]
        assert (change["version"], change["count"]) == (1, 1) and change["position"].startswith("pg:")
        assert change["at"] >= time.time() - 600

        d.wait("WATCHDOG=1", lambda: any(m.get("WATCHDOG") == "1" for m in (received.__iadd__(_messages(notify)))))

        # A second daemon on the same state directory (and so the same http.listen) is refused naming the first:
        # the state lock comes before the HTTP port.
        second_run = subprocess.run([CDCD, "run", "-c", str(cfg)], capture_output=True, text=True, timeout=WAIT_S)
        assert second_run.returncode == ExitCode.STATE_DIR_LOCKED
        assert f"locked by pid {d.proc.pid}" in second_run.stdout + second_run.stderr

        # A request that changes state needs the control token the daemon wrote for its own user; the CLI sends it.
        token_file = tmp_path / "state" / "http-token"
        assert token_file.stat().st_mode & 0o777 == 0o600
        request = urllib.request.Request(f"http://127.0.0.1:{d.port}/tables/reload", data=b"{}", method="POST")
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=5)
        assert refused.value.code == 401
        reload = subprocess.run([CDCD, "tables", "reload", "-c", str(cfg)], capture_output=True, text=True,
                                timeout=WAIT_S)
        assert reload.returncode == 0 and "source.tables unchanged" in reload.stdout, reload.stderr
        token = token_file.read_text().strip()
        status = subprocess.run([CDCD, "status", "-c", str(cfg), "--json"], capture_output=True, text=True,
                                timeout=WAIT_S)
        assert token not in status.stdout and token not in d.log_path.read_text()
        doc = json.loads(status.stdout)
        assert doc["running"] and doc["state"] == "running" and doc["pid"] == d.proc.pid
        assert doc["checkpoint"]["event_count"] >= 70 and doc["source"]["phase"] == "streaming"

        stop = subprocess.run([CDCD, "stop", "-c", str(cfg)], capture_output=True, text=True, timeout=WAIT_S)
        assert stop.returncode == 0 and f"pid {d.proc.pid}) stopped" in stop.stdout
        assert d.exit_code() == ExitCode.OK
        received += _messages(notify)
        assert any(m.get("STOPPING") == "1" for m in received[ready_at:])
    finally:
        proxy.close()
        notify.close()


def test_sighup_rereads_the_log_level(pg_server: PostgresServer, pg_db: str, tmp_path: Path,
                                      daemons: list[Daemon]) -> None:
    create_orders(pg_server, pg_db, 5)
    cfg, http = make_config(tmp_path, pg_server.port, pg_db)
    d = Daemon(cfg, http)
    daemons.append(d)
    d.wait_ready()
    assert not any(e["level"] == "debug" for e in d.log_lines())
    cfg.write_text(cfg.read_text().replace('format = "json"', 'format = "json"\nlevel = "debug"'))
    d.proc.send_signal(signal.SIGHUP)
    d.wait("level change logged", lambda: any(e["event"].startswith("SIGHUP") for e in d.log_lines()))
    insert_rows(pg_server, pg_db, 100, 5)
    d.wait("debug lines", lambda: any(e["level"] == "debug" for e in d.log_lines()))
    d.proc.send_signal(signal.SIGINT)
    assert d.exit_code() == ExitCode.OK


def test_unreachable_source_is_a_fatal_exit(tmp_path: Path, daemons: list[Daemon]) -> None:
    cfg, http = make_config(tmp_path, free_port(), "app", source={"connect_timeout_s": 5})
    d = Daemon(cfg, http)
    daemons.append(d)
    code = d.exit_code()
    assert code == ExitCode.SOURCE_FATAL, d.log_path.read_text()[-2000:]
    assert any(e["level"] == "error" for e in d.log_lines())


def test_sigquit_force_stops(pg_server: PostgresServer, pg_db: str, tmp_path: Path, daemons: list[Daemon]) -> None:
    create_orders(pg_server, pg_db, 5)
    cfg, http = make_config(tmp_path, pg_server.port, pg_db)
    d = Daemon(cfg, http)
    daemons.append(d)
    d.wait_ready()
    d.wait("snapshot committed", lambda: d.stats()["events_committed"] == 6)  # and its opening truncate
    force = subprocess.run([CDCD, "force-stop", "-c", str(cfg)], capture_output=True, text=True, timeout=WAIT_S)
    assert force.returncode == 0, force.stderr
    assert d.exit_code() == ExitCode.FORCE_STOPPED
    ckpt = CheckpointStore(tmp_path / "state").load()
    assert ckpt is not None and ckpt.event_count == 6


# -- a stop always ends, with the documented exit code (issue 27) -----------------------------------------


def _fill_notify_queue(path: str) -> int:
    """Queue datagrams on the notify socket until it is full, as a service manager that stopped reading."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as probe:
        queued = 0
        while True:
            try:
                probe.sendto(b"PROBE=1", socket.MSG_DONTWAIT, path)
            except BlockingIOError:
                return queued
            queued += 1


def test_sigterm_stops_while_the_service_manager_does_not_read_its_notify_socket(
    pg_server: PostgresServer, pg_db: str, tmp_path: Path, daemons: list[Daemon]
) -> None:
    """The reported hang: sd_notify's blocking send held the event loop once the manager's queue was full (PID 1
    under load), so the graceful stop never started and a second SIGTERM did nothing."""
    create_orders(pg_server, pg_db, 20)
    path = str(tmp_path / "notify.sock")
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(path)
    notify.settimeout(WAIT_S)
    try:
        cfg, http = make_config(tmp_path, pg_server.port, pg_db)
        d = Daemon(cfg, http, env={"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "1000000"})
        daemons.append(d)
        while b"READY=1" not in notify.recv(4096):
            pass
        assert _fill_notify_queue(path) > 0  # from now on nobody reads it
        d.proc.send_signal(signal.SIGTERM)  # STOPPING=1 (and the watchdog pings before it) meet the full queue
        assert d.exit_code() == ExitCode.OK
        events = [e["event"] for e in d.log_lines()]
        assert "stopped gracefully" in events
        assert any(e.startswith("sd_notify: the service manager is not reading") for e in events)
    finally:
        notify.close()


def _pending(pid: int, sig: int) -> bool:
    """Whether ``sig`` waits to be delivered to process ``pid`` (/proc's pending-signal masks)."""
    masks = [int(line.split()[1], 16) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
             if line.startswith(("SigPnd:", "ShdPnd:"))]
    return any(m & (1 << (sig - 1)) for m in masks)


def test_second_sigterm_ends_the_daemon_while_its_event_loop_is_held(
    pg_server: PostgresServer, pg_db: str, tmp_path: Path
) -> None:
    """Synchronous code holding the event loop (here: a log line written to a stdout pipe nobody reads, as a
    stalled log collector leaves it) must not make the daemon deaf: a second SIGTERM force-stops it (exit 3)."""
    create_orders(pg_server, pg_db, 20)
    cfg, http = make_config(tmp_path, pg_server.port, pg_db, runtime={"shutdown_grace_s": 300})
    fifo = tmp_path / "stdout.fifo"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    filler = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)  # its own open file: the daemon's stays blocking
    out = os.open(fifo, os.O_WRONLY)
    proc = subprocess.Popen([CDCD, "run", "-c", str(cfg)], stdout=out, stderr=subprocess.STDOUT)
    os.close(out)
    logged = bytearray()

    def drain() -> None:
        with contextlib.suppress(BlockingIOError):
            while chunk := os.read(reader, 65536):
                logged.extend(chunk)

    def ready() -> bool:
        drain()
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{http}/readyz", timeout=5) as resp:
                return bool(resp.status == 200)
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False

    try:
        wait_for("/readyz 200", ready, procs=proc)
        with contextlib.suppress(BlockingIOError):  # the pipe is full: the daemon's next log line blocks it
            while True:
                os.write(filler, b"x" * 4096)
        proc.send_signal(signal.SIGTERM)  # its log line ("stop signal: stopping gracefully") holds the loop
        # A second SIGTERM sent while the first is still pending would merge with it: wait until it was delivered.
        wait_for("the first SIGTERM delivered", lambda: not _pending(proc.pid, signal.SIGTERM), procs=proc)
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(WAIT_S)
        except subprocess.TimeoutExpired:
            raise AssertionError("the daemon did not exit after two SIGTERMs while its event loop was held") from None
        assert code == ExitCode.FORCE_STOPPED
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        for fd in (reader, filler):
            os.close(fd)


def test_a_late_second_sigterm_exits_with_the_graceful_code(
    pg_server: PostgresServer, pg_db: str, tmp_path: Path, daemons: list[Daemon]
) -> None:
    """SIGTERMs that arrive after the graceful stop finished its work (an impatient operator, a supervisor
    repeating its signal) leave the exit code at 0: the process is never ended by the signal's default action."""
    create_orders(pg_server, pg_db, 20)
    cfg, http = make_config(tmp_path, pg_server.port, pg_db)
    d = Daemon(cfg, http)
    daemons.append(d)
    d.wait_ready()
    d.wait("snapshot committed", lambda: d.stats()["events_committed"] == 21)  # and its opening truncate
    d.proc.send_signal(signal.SIGTERM)
    wait_for("the graceful stop's work done", lambda: any(e["event"] == "stopped gracefully" for e in d.log_lines()))
    deadline = time.monotonic() + WAIT_S
    while d.proc.poll() is None and time.monotonic() < deadline:  # until it exited: any moment of the exit is hit
        d.proc.send_signal(signal.SIGTERM)
        time.sleep(0.001)
    assert d.exit_code() == ExitCode.OK
