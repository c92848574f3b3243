"""A following `cdcd spark run` stopped by SIGTERM at random moments (real Spark, real processes), as an operator's
`systemctl stop` / `docker stop` does while batches keep landing: while it starts, in a merge, idle between
micro-batches; to the consumer alone (docker stop) or to its whole process group, JVM included (systemd's
KillMode=control-group, a shell's ^C). Each stop ends with the documented exit code (0; 3 after a second SIGTERM
mid-merge), never by the signal, within a bound, with no JVM left; a restart then converges: the mirror equals
the state the landed batches describe and the change-log holds each event once (docs/spark.md, "Stopping")."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from support.spark import consume_once

from cdcd.events import ChangeEvent, Column, Op, TableId, TableSchema
from cdcd.landing.reader import consumed_seqs, landed_seqs
from cdcd.positions import PgPosition
from cdcd.runtime.interfaces import Batch
from cdcd.sinks.landing import LandingSink
from cdcd.verify.mirror import read_table

pytestmark = [pytest.mark.spark, pytest.mark.slow]

CDCD = str(Path(sys.executable).with_name("cdcd"))
ORDERS = TableSchema(TableId("public", "orders"), (Column("id", pa.int64(), "bigint", nullable=False),
                                                   Column("v", pa.string(), "text")), ("id",))
TS = datetime(2024, 1, 2, 3, 4, 5, tzinfo=UTC)
#: The consumer's bound on finishing the merge in progress after SIGTERM (high: the machine may be loaded).
STOP_TIMEOUT_S = 240
#: How long a stop may take at most: the bound above, then the JVM's and the session's stop (the exit code is
#: decided by then: 30 s), then a forced exit (10 s); this is a hang detector, not a timing assertion.
STOP_WAIT_S = STOP_TIMEOUT_S + 30 + 10 + 60
#: After a second SIGTERM: the forced exit's bound (10 s), with room for a loaded machine.
FORCE_WAIT_S = 90
WAIT_S = 600


class Lander:
    """Lands batches of upserts and deletes of ``public.orders`` (keys 1..60) on a thread, as the daemon does,
    and keeps the state they describe."""

    def __init__(self, landing: Path, rng: random.Random) -> None:
        self.landing = landing
        self.rng = rng
        self.expected: dict[int, str] = {}
        self.seq = 0
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.lock = threading.Lock()  # the test lands too
        self.thread = threading.Thread(target=self._run, name="lander", daemon=True)

    def land(self) -> None:
        with self.lock:
            self._land()

    def _land(self) -> None:
        self.seq += 1
        seq, events = self.seq, []
        for i in range(self.rng.randint(20, 200)):
            key = self.rng.randint(1, 60)
            pos = PgPosition(1_000_000 * seq + i, 0)
            if key in self.expected and self.rng.random() < 0.3:
                events.append(ChangeEvent(Op.DELETE, ORDERS, pos, before={"id": key}, tx_id=str(seq), commit_ts=TS))
                del self.expected[key]
            else:
                value = f"v{seq}.{i}"
                op = Op.UPDATE if key in self.expected else Op.CREATE
                events.append(ChangeEvent(op, ORDERS, pos, before={"id": key} if op is Op.UPDATE else None,
                                          after={"id": key, "v": value}, tx_id=str(seq), commit_ts=TS))
                self.expected[key] = value

        async def go() -> None:
            sink = LandingSink(self.landing)
            await sink.open()
            await sink.deliver(Batch(seq, events))
            await sink.close()

        asyncio.run(go())

    def _run(self) -> None:
        try:
            while not self.done.wait(self.rng.uniform(0.5, 4)):
                self.land()
        except BaseException as exc:  # reported by the test
            self.error = exc

    def stop(self) -> None:
        self.done.set()
        self.thread.join(WAIT_S)
        assert not self.thread.is_alive(), "the lander did not stop"
        if self.error is not None:
            raise self.error


def status_mask(pid: int, field: str) -> int:
    """A signal mask of /proc/PID/status (SigCgt: caught, SigPnd/ShdPnd: pending); 0 once the process is gone."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return 0
    return sum(int(line.split()[1], 16) for line in text.splitlines() if line.startswith(field))


def has(mask: int, sig: int) -> bool:
    return bool(mask & (1 << (sig - 1)))


def group_members(pgid: int) -> list[str]:
    """The live processes of a process group (a zombie holds nothing: spark-class's own subshell, reparented to
    init when the JVM that exec'd from its parent exits, is one until init reaps it)."""
    found = subprocess.run(["ps", "-o", "pid=,stat=,args=", "-g", str(pgid)], capture_output=True, text=True,
                           check=False)
    return [line.strip() for line in found.stdout.splitlines() if line.split()[1:2] != ["Z"] and line.strip()]


class Consumer:
    def __init__(self, tmp_path: Path, landing: Path, target: Path, n: int) -> None:
        self.log = tmp_path / f"consumer-{n}.log"
        with self.log.open("wb") as out:  # its own session: the process group a supervisor would signal
            self.proc = subprocess.Popen([CDCD, "spark", "run", "--landing", str(landing), "--target", str(target),
                                          "--format", "parquet", "--stop-timeout", str(STOP_TIMEOUT_S)],
                                         stdout=out, stderr=subprocess.STDOUT, env=os.environ, start_new_session=True)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, what: str, predicate: Callable[[], Any]) -> None:
        deadline = time.monotonic() + WAIT_S
        while not predicate():
            if self.proc.poll() is not None:
                pytest.fail(f"the consumer exited {self.proc.returncode} while waiting for {what}:\n"
                            f"{self.text()[-4000:]}")
            if time.monotonic() > deadline:
                pytest.fail(f"no {what} within {WAIT_S}s:\n{self.text()[-4000:]}")
            time.sleep(0.02)

    def wait_for_exit_or(self, what: str, predicate: Callable[[], Any]) -> None:
        deadline = time.monotonic() + WAIT_S
        while self.proc.poll() is None and not predicate():
            if time.monotonic() > deadline:
                pytest.fail(f"no {what} within {WAIT_S}s:\n{self.text()[-4000:]}")
            time.sleep(0.001)

    def term(self, group: bool) -> None:
        if group:  # systemd's KillMode=control-group: every process of the group, the JVM included
            os.killpg(self.proc.pid, signal.SIGTERM)
        else:  # docker stop: the main process only
            self.proc.send_signal(signal.SIGTERM)

    def delivered(self) -> bool:
        """The SIGTERM sent is no longer pending (a second one sent before would merge with it)."""
        return self.proc.poll() is not None or not has(status_mask(self.proc.pid, "SigPnd:")
                                                       | status_mask(self.proc.pid, "ShdPnd:"), signal.SIGTERM)

    def exit_code(self, within: float) -> int:
        try:
            return self.proc.wait(within)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            pytest.fail(f"the consumer did not exit within {within}s of SIGTERM:\n{self.text()[-4000:]}")

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):  # the group is gone
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


def staging(target: Path) -> bool:
    """A Parquet merge is in progress: it stages its change-log and mirror files under TARGET/work."""
    return any((target / "work").glob("*/t*"))


def test_sigterm_at_random_moments_ends_with_the_documented_code_and_a_restart_converges(spark: object,
                                                                                         tmp_path: Path) -> None:
    seed = int(os.environ.get("CDCD_TEST_SEED", random.randrange(2**32)))
    print(f"seed {seed} (CDCD_TEST_SEED)")
    rng = random.Random(seed)
    landing, target = tmp_path / "landing", tmp_path / "target"
    lander = Lander(landing, rng)
    for _ in range(3):
        lander.land()
    lander.thread.start()
    # (moment, the whole process group or the consumer alone, a second SIGTERM)
    rounds = [("start-up", True, False), ("mid-merge", False, False), ("idle", True, False),
              ("mid-merge", True, True), ("start-up", False, False)]
    outcomes = []
    consumers: list[Consumer] = []
    try:
        for n, (moment, group, twice) in enumerate(rounds):
            if moment == "mid-merge":
                lander.land()  # a batch to merge while it catches up, if the stream has none yet
            c = Consumer(tmp_path, landing, target, n)
            consumers.append(c)
            if moment == "start-up":  # from the moment it can hear a signal (or, today, once it says it started)
                c.wait_for("SIGTERM caught or the consumer started",
                           lambda c=c: has(status_mask(c.proc.pid, "SigCgt:"), signal.SIGTERM)
                           or "consumer starting" in c.text())
                time.sleep(rng.uniform(0, 10))
            elif moment == "mid-merge":
                c.wait_for("a merge in progress", lambda: staging(target))
                time.sleep(rng.uniform(0, 0.5))
            else:
                c.wait_for("a following consumer", lambda c=c: "following the landing zone" in c.text())
                time.sleep(rng.uniform(0, 3))
            c.term(group)
            if twice:
                c.wait_for_exit_or("the first SIGTERM delivered", c.delivered)
                if c.proc.poll() is None:
                    c.term(group)
                code = c.exit_code(FORCE_WAIT_S)
                # abandoned (3), or the merge finished and the stop's work was done before the second one came (0)
                expect = {3, 0}
            else:
                code = c.exit_code(STOP_WAIT_S)
                expect = {0}
            outcomes.append((moment, group, twice, code))
            assert code in expect, f"round {n} ({moment}, group={group}, twice={twice}) exited {code}, not " \
                                   f"{sorted(expect)}; rounds so far {outcomes}:\n{c.text()[-4000:]}"
            left = group_members(c.proc.pid)
            assert not left, f"processes of the consumer's group left after its exit: {left}"
        lander.stop()
        consume_once(landing, target, "parquet")  # the restart, in the worker's session (tests/support/spark.py)
    finally:
        lander.done.set()
        for c in consumers:
            c.kill()
    print(f"rounds: {outcomes}")
    assert consumed_seqs(landing) == landed_seqs(landing)
    mirror = read_table(target, "public.orders")
    assert mirror is not None
    rows = mirror.to_pylist()
    assert len(rows) == len({r["id"] for r in rows}), "a key is in the mirror twice"
    assert {r["id"]: r["v"] for r in rows} == lander.expected
    changelog = read_table(target, "public.orders", "changelog")
    assert changelog is not None
    events = [(r["_cdc_pos"], r["_cdc_index"]) for r in changelog.to_pylist()]
    assert len(events) == len(set(events)), "an event is in the change-log twice"
