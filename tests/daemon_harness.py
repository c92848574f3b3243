"""The daemon as a real process for crash tests: start `cdcd run`, wait, SIGKILL, read what landed.

Batches are held unacked with ``landing.ack = "consumed"``; the test plays the consumer by writing
"consumed" markers for the batches it wants acked. Subclasses supply the source's config sections.
"""

from __future__ import annotations

import abc
import json
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from support.landed import landed_ids
from support.spark import consume_once, verify_equal
from support.waits import WAIT_S, tail, wait_for

from cdcd.checkpoint.store import Checkpoint
from cdcd.landing.reader import LandedBatch, mark_consumed, read_batches

CDCD = str(Path(sys.executable).with_name("cdcd"))
__all__ = ["CDCD", "WAIT_S", "DaemonHarness", "rows", "streamed_values"]


def rows(batch: LandedBatch) -> list[dict[str, Any]]:
    """The batch's rows, without a new snapshot's opening truncates (no row of the table)."""
    out: list[dict[str, Any]] = []
    for table in batch.tables.values():
        out.extend(r for r in table.to_pylist() if not (r["_cdc_op"] == "t" and r["_cdc_snapshot"]))
    return out


def streamed_values(landing: Path, column: str = "id") -> set[Any]:
    """Values of ``column`` in rows that landed as streamed changes, not as snapshot reads.

    Wait for a row inserted last to be here, not merely landed: a daemon restarted after a kill may resume an
    unfinished snapshot whose remaining key range holds that row, and land it as a snapshot read long before
    the stream has delivered the changes committed before it.
    """
    return {r.get(column) for b in read_batches(landing) for t in b.tables.values()
            for r in t.select([c for c in (column, "_cdc_snapshot") if c in t.column_names]).to_pylist()
            if column in t.column_names and not r["_cdc_snapshot"]}


class DaemonHarness(abc.ABC):
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.landing, self.state = tmp / "landing", tmp / "state"
        self.procs: list[subprocess.Popen[bytes]] = []
        self.log = tmp / "daemon-0.log"

    @abc.abstractmethod
    def source_sections(self) -> dict[str, dict[str, Any]]:
        """The ``source`` (and ``source.<kind>``) sections of the daemon's config."""

    def config(self, ack: str, **extra: dict[str, Any]) -> Path:
        doc: dict[str, dict[str, Any]] = {
            **self.source_sections(),
            "snapshot": {"chunk_rows": 25},
            "state": {"path": str(self.state)},
            "landing": {"path": str(self.landing), "ack": ack, "max_batch_events": 20, "max_batch_delay_ms": 50},
            "runtime": {"max_inflight_batches": 4, "shutdown_grace_s": 5},
            "http": {"listen": ""},
            "log": {"format": "json", "level": "info"},
        }
        for k, v in extra.items():
            doc.setdefault(k, {}).update(v)
        path = self.tmp / f"cdcd-{len(self.procs)}.toml"
        path.write_text("".join(f"[{s}]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in vals.items())
                                for s, vals in doc.items()))
        return path

    def start(self, ack: str, **extra: dict[str, Any]) -> subprocess.Popen[bytes]:
        cfg = self.config(ack, **extra)
        self.log = self.tmp / f"daemon-{len(self.procs)}.log"
        proc = subprocess.Popen([CDCD, "run", "-c", str(cfg)], stdout=open(self.log, "wb"),  # noqa: SIM115
                                stderr=subprocess.STDOUT)
        self.procs.append(proc)
        return proc

    def wait(self, what: str, predicate: Callable[[], Any], timeout: float = WAIT_S) -> Any:
        """Wait for ``predicate``, failing early when the daemon started last exits."""
        return wait_for(what, predicate, timeout, procs=self.procs[-1:], log=self.log)

    def tail(self) -> str:
        return tail(self.log)

    def kill(self) -> None:
        self.procs[-1].send_signal(signal.SIGKILL)
        self.procs[-1].wait(30)

    def landed_ids(self) -> set[Any]:
        return landed_ids(self.landing)

    def batches(self) -> list[LandedBatch]:
        return read_batches(self.landing) if self.landing.exists() else []

    def checkpoint(self) -> Checkpoint | None:
        # Read the file directly, as any reader of a running daemon's state directory should.
        path = self.state / "checkpoint.json"
        try:
            return Checkpoint.from_bytes(path.read_bytes(), path)
        except FileNotFoundError:
            return None

    def consume_upto(self, n_events: int) -> tuple[list[dict[str, Any]], int]:
        """Mark consumed the landed batches, in order, until at least ``n_events`` events are acked."""
        acked: list[dict[str, Any]] = []
        last = 0
        for b in self.batches():
            if len(acked) >= n_events:
                break
            mark_consumed(self.landing, b.seq)
            acked += rows(b)
            last = b.seq
        return acked, last

    def spark_and_verify(self, cfg: Path | None = None, fmt: str = "parquet") -> None:
        """Run the Spark consumer once (Parquet, or ``fmt``) over the landing zone, then `cdcd verify` against the
        source that ``cfg`` names (default: a fresh config of this harness, i.e. the server the data lives on now).
        Both in the worker's shared Spark session: the test asks for the ``spark`` fixture."""
        from pyspark.sql import SparkSession

        assert SparkSession.getActiveSession() is not None, "a test that calls spark_and_verify asks for `spark`"
        target = self.tmp / "target"
        consume_once(self.landing, target, fmt)
        verify_equal(cfg or self.config("landed"), target)

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()
