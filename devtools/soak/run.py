"""One soak of one source: the processes, the fault scheduler, the catch-up and the comparisons at the end."""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cdcd.landing.reader import consumed_seqs, landed_seqs, read_batch, read_manifest
from devtools.servers import free_port
from devtools.soak.common import (
    BASE_TABLES,
    CDCD,
    EXTRA_TABLES,
    FAULT_KINDS,
    GRACE_S,
    ROOT,
    SoakError,
    say,
    wait_for,
    wait_with_progress,
)
from devtools.soak.parts import LandingDisk, Proc
from devtools.soak.replay import replay
from devtools.soak.sources import MariaSource, PgSource, Source
from devtools.soak.workload import Workload

sys.path.insert(0, str(ROOT / "tests"))
from faultproxy import FaultProxy  # type: ignore[import-not-found]


@dataclass
class Soak:
    source: Source
    seed: int
    minutes: float
    fmt: str
    work: Path
    fault_pause: float = 11.5  # mean seconds between fault rounds (drawn from 0.25x..1.75x)
    faults: Counter[str] = field(default_factory=Counter)
    notes: list[str] = field(default_factory=list)  # unexpected exits, hangs, refusals: printed in the summary
    captured: list[str] = field(default_factory=lambda: list(BASE_TABLES))
    disk_free_at: float | None = None
    pending: list[tuple[float, str, Callable[[], None]]] = field(default_factory=list)
    # the newest consumed batch when the consumer was last faulted: the next consumer fault waits until a
    # merge has been applied since, so a consumer killed faster than it merges still moves forward
    consumer_fault_mark: int = -1

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.landing = self.work / "landing"
        self.target = self.work / "target"
        self.config_path = self.work / "cdcd.toml"
        self.http_port = free_port()
        self.disk = LandingDisk(self.landing, self.minutes, self.notes)
        self.t0 = time.monotonic()

    # ---- config and processes

    def write_config(self) -> None:
        doc: dict[str, dict[str, Any]] = {
            **self.source.sections(self.proxy.port, self.captured, self.work),
            "snapshot": {"chunk_rows": 200},
            "state": {"path": str(self.work / "state")},
            "landing": {"path": str(self.landing), "max_batch_events": 2000, "max_batch_delay_ms": 200,
                        "retention_s": 10**9},  # every batch stays, for the landing replay
            "runtime": {"shutdown_grace_s": GRACE_S, "reconnect_max_s": 2.0, "source_read_timeout_s": 10},
            "http": {"listen": f"127.0.0.1:{self.http_port}"},
            "log": {"format": "json", "level": "info"},
        }
        tmp = self.config_path.with_suffix(".tmp")
        tmp.write_text("".join(f"[{s}]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in vals.items())
                               for s, vals in doc.items()))
        tmp.replace(self.config_path)

    def status(self) -> dict[str, Any]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/status", timeout=10) as r:
                doc: dict[str, Any] = json.loads(r.read())
                return doc
        except (urllib.error.URLError, OSError, ValueError):
            return {}

    def cli(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run([CDCD, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)

    def elapsed(self) -> str:
        return f"{time.monotonic() - self.t0:.0f}s"

    # ---- faults

    def free_disk(self) -> None:
        self.disk.free()
        self.disk_free_at = None


    def pause(self) -> float:
        return self.rng.uniform(0.25 * self.fault_pause, 1.75 * self.fault_pause)

    def later(self, delay: float, what: str, action: Callable[[], None]) -> None:
        self.pending.append((time.monotonic() + delay, what, action))

    def restart_later(self, p: Proc) -> None:
        self.later(self.rng.uniform(0, 5), f"restart {p.name}", p.start)

    def inject(self, kind: str) -> str | None:
        """Inject one fault; what happened, or None when it does not apply now (nothing counted)."""
        rng = self.rng
        if kind in ("daemon-kill", "daemon-term", "consumer-kill", "consumer-term"):
            p = self.daemon if kind.startswith("daemon") else self.consumer
            if not p.running():
                return None
            if p is self.consumer:
                applied = max(consumed_seqs(self.landing), default=0)
                if applied <= self.consumer_fault_mark:
                    return None
                self.consumer_fault_mark = applied
            if kind.endswith("kill"):
                p.stop(signal.SIGKILL, 30)
                self.restart_later(p)
                return kind
            code = p.stop(signal.SIGTERM, GRACE_S + 30 if p is self.daemon else 180)
            if code is None:
                self.notes.append(f"{self.elapsed()}: {p.name} did not exit within its bound after SIGTERM "
                                  "(SIGKILLed)")
            elif code != 0:
                self.notes.append(f"{self.elapsed()}: {p.name} exited {code} after SIGTERM")
            self.restart_later(p)
            return kind
        if kind == "net-cut":
            refuse = rng.random() < 0.5
            if refuse:
                self.proxy.refuse(rng.uniform(1, 10))
            self.proxy.reset()
            return "net-cut+refuse" if refuse else kind
        if kind == "net-blackhole":
            self.proxy.blackhole()
            return kind
        if kind == "source-restart":
            return f"{kind}({self.source.restart(rng)})"
        if kind == "table-add":
            left = [t for t in EXTRA_TABLES if t not in self.captured]
            if not left:
                return None
            self.captured.append(rng.choice(left))
            self.write_config()
            if not self.daemon.running():
                return f"{kind}(while stopped)"
            if rng.random() < 0.5:
                assert self.daemon.proc is not None
                self.daemon.proc.send_signal(signal.SIGHUP)
                return f"{kind}(SIGHUP)"
            done = self.cli("tables", "reload", "-c", str(self.config_path))
            if done.returncode != 0:  # starting or stopping: it reads the config at its next start anyway
                self.notes.append(f"{self.elapsed()}: tables reload refused: {done.stderr.strip()[:200]}")
            return f"{kind}(reload)"
        if kind == "table-resync":
            if not self.daemon.running():
                return None
            table = self.source.table_id(rng.choice(self.captured))
            done = self.cli("snapshot", "-c", str(self.config_path), table)
            if done.returncode != 0:
                self.notes.append(f"{self.elapsed()}: snapshot {table} refused: {done.stderr.strip()[:200]}")
                return None
            return kind
        if kind == "disk-full":
            if not self.disk.mounted or self.disk_free_at is not None:
                return None
            self.disk.fill()
            duration = rng.uniform(5, 30)
            self.disk_free_at = time.monotonic() + duration
            self.later(duration, "free the landing disk", self.free_disk)
            return kind
        raise ValueError(kind)

    def supervise(self) -> None:
        """Run what is due; restart a process that exited on its own, as systemd would."""
        now = time.monotonic()
        due = [p for p in self.pending if p[0] <= now]
        self.pending = [p for p in self.pending if p[0] > now]
        for _, _, action in due:
            action()
        for p in (self.daemon, self.consumer):
            if p.proc is not None and not p.down_on_purpose and p.proc.poll() is not None:
                code = p.proc.returncode
                self.notes.append(f"{self.elapsed()}: {p.name} exited {code} on its own{p.last_error()}")
                if p is self.daemon and code in (6, 7, 78):
                    raise SoakError(f"the daemon exited {code}, which systemd does not restart; see {p.log}")
                p.down_on_purpose = True
                self.later(1.0, f"restart {p.name}", p.start)
        if self.workload.error is not None:
            raise self.workload.error

    # ---- the run

    def run(self) -> tuple[bool, str]:
        try:
            self.source.start()
            self.proxy = FaultProxy(self.source.port).start()
            self.disk.mount()
            self.write_config()
            self.daemon = Proc("daemon", [CDCD, "run", "-c", str(self.config_path)], self.work / "daemon.log")
            self.metrics_port = free_port()  # the consumer's metrics: checked against the landing zone at the end
            self.consumer = Proc("consumer", [CDCD, "spark", "run", "--landing", str(self.landing), "--target",
                                              str(self.target), "--format", self.fmt, "--metrics-listen",
                                              f"127.0.0.1:{self.metrics_port}"], self.work / "consumer.log")
            self.daemon.start()
            wait_for("the daemon's /readyz", lambda: self.status().get("state") is not None, 120)
            self.consumer.start()
            self.workload = Workload(self.source, self.seed + 1)
            self.workload.start()
            say(f"{self.source.kind}: daemon, consumer and workload running; faults for {self.minutes:g} min "
                f"(seed {self.seed}, work {self.work})")
            end = time.monotonic() + self.minutes * 60
            next_round = time.monotonic() + self.pause()
            while time.monotonic() < end:
                self.supervise()
                if time.monotonic() >= next_round:
                    n = self.rng.choices([1, 2, 3], [6, 3, 1])[0]
                    for kind in self.rng.sample(FAULT_KINDS, n):
                        done = self.inject(kind)
                        if done is not None:
                            self.faults[kind] += 1
                            say(f"{self.source.kind} {self.elapsed()}: {done}")
                        time.sleep(self.rng.uniform(0, 2))
                    next_round = time.monotonic() + self.pause()
                time.sleep(0.2)
            return self.finish()
        finally:
            for p in (getattr(self, "daemon", None), getattr(self, "consumer", None)):
                if p is not None and p.running():
                    p.stop(signal.SIGKILL, 30)
            if getattr(self, "workload", None) is not None and self.workload.is_alive():
                self.workload.stop_event.set()
                self.workload.join(60)
            if getattr(self, "proxy", None) is not None:
                self.proxy.close()
            self.source.stop()

    def settle_reloads(self) -> None:
        """Every table the config lists is captured before the fences go in. A reload the daemon gave up on (past
        its retry budget; /status keeps ``table_reload_error``) is sent again, as the operator would."""
        want = {self.source.table_id(t) for t in self.captured}

        resent: list[str] = []

        def captured() -> bool:
            src = self.status().get("source") or {}
            if want <= set(src.get("tables") or ()):
                return True
            error = src.get("table_reload_error")
            if error and error not in resent:  # each failure once: the daemon retries an outage by itself
                resent.append(error)
                self.notes.append(f"{self.elapsed()}: reload failed ({error[:160]}); sent again")
                self.cli("tables", "reload", "-c", str(self.config_path))
            return False

        wait_for(f"the daemon to capture {sorted(want)}", captured, 300, step=2.0)

    def finish(self) -> tuple[bool, str]:
        say(f"{self.source.kind}: workload stops; catching up")
        self.workload.finish()
        # run what is pending now (restarts, freeing the disk), and let a refused listener reopen
        for _, _, action in sorted(self.pending, key=lambda p: p[0]):
            action()
        self.pending.clear()
        self.free_disk()
        time.sleep(10)  # the longest refusal
        for p in (self.daemon, self.consumer):
            if not p.running():
                p.start()
        self.settle_reloads()
        # fences: one new row per captured table; once each has landed, the stream is past the workload
        fences = {t: 10**12 + i for i, t in enumerate(self.captured)}
        for t, fid in fences.items():
            self.source.admin(f"INSERT INTO {t} (id, v, note) VALUES ({fid}, 0, 'fence')")
        seen: set[str] = set()
        scanned: set[int] = set()

        def fences_landed() -> bool:
            self.supervise()
            for seq in landed_seqs(self.landing):
                if seq in scanned:
                    continue
                scanned.add(seq)
                batch = read_batch(self.landing, seq)
                for t, data in batch.tables.items():
                    fid = fences.get(t.name)
                    if fid is not None and fid in data.column("id").to_pylist():
                        seen.add(t.name)
            return seen == set(fences)

        wait_for(f"the fence rows of {sorted(fences)} to land", fences_landed, 600, step=1.0)

        def snapshots_done() -> bool:
            self.supervise()
            st = self.status()
            snaps = st.get("incremental_snapshots") or []
            return bool(st) and st.get("state") == "running" and all(
                s.get("state") not in ("queued", "running") for s in snaps)

        wait_for("the incremental snapshots to finish", snapshots_done, 900, step=1.0)
        wait_for("the daemon to commit everything it read", self.drained, 300, step=1.0)
        code = self.daemon.stop(signal.SIGTERM, GRACE_S + 60)
        if code != 0:
            raise SoakError(f"the daemon's graceful stop at the end exited {code} (None: hung); see {self.daemon.log}")

        def consumed() -> bool:
            self.supervise_consumer_only()
            done = set(consumed_seqs(self.landing))
            return all(s in done for s in landed_seqs(self.landing))

        wait_with_progress("the consumer to apply every landed batch", consumed,
                           lambda: len(consumed_seqs(self.landing)), stall=900, cap=max(900.0, self.minutes * 90))
        newest = max(landed_seqs(self.landing), default=0)
        wait_for("the consumer's metrics to show the newest landed batch applied, no lag",
                 lambda: self.consumer_metrics().get("cdcd_spark_applied_batch_seq") == newest
                 and self.consumer_metrics().get("cdcd_spark_lag_batches") == 0, 120, step=2.0)
        code = self.consumer.stop(signal.SIGTERM, 180)
        if code != 0:
            self.notes.append(f"the consumer's stop at the end exited {code} (None: hung)")
        verify = subprocess.run([CDCD, "verify", "-c", str(self.config_path), "--target", str(self.target)],
                                capture_output=True, text=True, timeout=1800, cwd=ROOT)
        (self.work / "verify.txt").write_text(verify.stdout + verify.stderr)
        replay_ok, replay_text = replay(self.landing, self.config_path, self.work / "replay.txt")
        events = sum(read_manifest(self.landing, s).event_count for s in landed_seqs(self.landing))
        ok = verify.returncode == 0 and replay_ok
        faults = " ".join(f"{k}={v}" for k, v in sorted(self.faults.items())) or "none"
        line = (f"soak {self.source.kind}: seed {self.seed}, {self.minutes:g} min, {self.fmt}; faults: {faults}; "
                f"workload {self.workload.commits} commits, {self.workload.rollbacks} rollbacks; "
                f"events landed {events} in {len(landed_seqs(self.landing))} batches; tables {len(self.captured)}; "
                f"verify {'equal' if verify.returncode == 0 else f'exit {verify.returncode}'}; "
                f"replay {'equal' if replay_ok else 'DRIFT'}; "
                f"notes: {len(self.notes)}")
        if verify.returncode != 0:
            print(verify.stdout[-4000:] + verify.stderr[-4000:], flush=True)
        if not replay_ok:
            print(replay_text[-4000:], flush=True)
        return ok, line

    def consumer_metrics(self) -> dict[str, float]:
        """The following consumer's unlabelled metrics (``--metrics-listen``), scraped now; {} when it does not
        answer."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as resp:
                text = resp.read().decode()
        except (urllib.error.URLError, OSError):
            return {}
        out: dict[str, float] = {}
        for line in text.splitlines():
            name, _, value = line.partition(" ")
            if line and not line.startswith("#") and "{" not in name:
                with contextlib.suppress(ValueError):
                    out[name] = float(value)
        return out

    def supervise_consumer_only(self) -> None:
        c = self.consumer
        if c.proc is not None and not c.down_on_purpose and c.proc.poll() is not None:
            self.notes.append(f"{self.elapsed()}: consumer exited {c.proc.returncode} on its own{c.last_error()}")
            self.consumer.start()

    def drained(self) -> bool:
        """Nothing in flight and nothing new read or committed for a second (as the demo waits)."""
        self.supervise()
        first = self.status().get("stats", {})
        time.sleep(1.0)
        second = self.status().get("stats", {})
        keys = ("events_seen", "events_committed")
        return bool(first) and bool(second) and second.get("batches_inflight") == 0 and all(
            first.get(k) == second.get(k) for k in keys)


def soak_one(kind: str, seed: int, minutes: float, fmt: str, keep: bool, fault_pause: float) -> bool:
    work = Path(tempfile.mkdtemp(prefix=f"cdcd-soak-{kind}-"))
    os.chmod(work, 0o755)
    source: Source = PgSource() if kind == "postgres" else MariaSource()
    soak = Soak(source, seed, minutes, fmt, work, fault_pause)
    ok, line = False, f"soak {kind}: seed {seed}: failed before the end"
    interrupted: BaseException | None = None
    try:
        ok, line = soak.run()
    except Exception as exc:
        traceback.print_exc()
        line = f"soak {kind}: seed {seed}: FAILED: {exc}"
    except BaseException as exc:  # SIGTERM (SystemExit) or ^C: say where things are, then go on ending
        interrupted = exc
        line = f"soak {kind}: seed {seed}: interrupted ({exc!r})"
    finally:
        landing = soak.landing
        if (keep or not ok) and soak.disk.mounted:  # the landing zone is on a tmpfs: keep a copy on disk
            with contextlib.suppress(FileNotFoundError):
                (soak.landing / "soak-filler").unlink()
            landing = work / "landing-kept"
            shutil.copytree(soak.landing, landing)
        soak.disk.unmount()
    for note in soak.notes:
        print(f"soak {kind} note: {note}", flush=True)
    print(line, flush=True)
    if ok and not keep:
        shutil.rmtree(work, ignore_errors=True)
    else:
        print(f"soak {kind}: work directory kept: {work} (daemon log {work / 'daemon.log'}, "
              f"consumer log {work / 'consumer.log'}, verify {work / 'verify.txt'}, replay {work / 'replay.txt'}, "
              f"landing zone {landing}); "
              f"again: scripts/soak.sh --source {kind} --seed {seed} --minutes {minutes:g} --format {fmt} "
              f"--fault-pause {fault_pause:g}",
              flush=True)
    if interrupted is not None:
        raise interrupted
    return ok
