"""The consumer's own commit record in the target: state file and redo journal.

``TARGET/state/consumer.json`` says which landed batches are in the target
and, per table, the highest applied position (the dedupe watermark). A
micro-batch is staged under ``TARGET/work/``, then committed by writing
``TARGET/state/journal.json`` (the moves to make and the new state); the
moves are replayed from the journal after a crash, so a micro-batch is in
the target entirely or not at all, whatever Spark's own checkpoint says.

``TARGET/state/zone.json`` binds the target to the one landing zone it is
built from (the zone's ``zone_id``, docs/landing-format.md): batch seqs are
only meaningful within one zone.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from cdcd.errors import CdcdError
from cdcd.fsutil import fsync_dir, write_durably

STATE_DIR = "state"
WORK_DIR = "work"
TABLES_DIR = "tables"
CHANGELOG_DIR = "changelog"
ZONE_BINDING = "zone.json"
CONSUMER_LOCK = "consumer.lock"


class ForeignZone(CdcdError):
    """The landing zone is not the one the target was built from."""


class TargetLocked(CdcdError):
    """Another consumer is applying to the same target."""


def lock_target(target: Path) -> int:
    """Take the target's consumer lock (``TARGET/state/consumer.lock``, flock; released when the process exits)
    and return its descriptor, or raise TargetLocked naming the holder.

    One consumer per target: each relies on the target's record read before a commit (the Delta file
    adoption does not ask Delta again inside its transaction), so a second one could apply a batch twice.
    """
    state = target / STATE_DIR
    state.mkdir(parents=True, exist_ok=True)
    fd = os.open(state / CONSUMER_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "another process"
        os.close(fd)
        raise TargetLocked(
            f"target {target} is in use by another cdcd spark consumer (pid {holder}): one consumer per target. "
            "Stop that one first, or give this one its own --target") from None
    pid = f"{os.getpid()}\n".encode()
    os.pwrite(fd, pid, 0)
    os.ftruncate(fd, len(pid))
    return fd


@dataclass(slots=True)
class TableState:
    watermark: str = ""  # highest applied _cdc_pos
    run_id: str = ""  # landing run that applied it (snapshot rows share one position inside a run)
    columns: list[list[str]] = field(default_factory=list)  # the mirror's [name, spark type]
    buckets: int = 0
    rows: int | None = None  # rows in the mirror (None: unknown, a state written before it was kept)


@dataclass(slots=True)
class ConsumerState:
    applied_seq: int = 0
    tables: dict[str, TableState] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"applied_seq": self.applied_seq, "tables": {k: asdict(v) for k, v in self.tables.items()}}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> ConsumerState:
        return cls(int(doc["applied_seq"]), {k: TableState(**v) for k, v in doc.get("tables", {}).items()})


class TargetStore:
    """File-level operations on the target directory (a local or shared POSIX path)."""

    def __init__(self, target: Path) -> None:
        self.target = target
        self.state_dir = target / STATE_DIR
        self.work_dir = target / WORK_DIR
        for d in (target, self.state_dir, self.work_dir, target / TABLES_DIR, target / CHANGELOG_DIR):
            d.mkdir(parents=True, exist_ok=True)

    @property
    def journal_path(self) -> Path:
        return self.state_dir / "journal.json"

    def table_dir(self, table: str) -> Path:
        return self.target / TABLES_DIR / table

    def changelog_dir(self, table: str) -> Path:
        return self.target / CHANGELOG_DIR / table

    def load(self) -> ConsumerState:
        path = self.state_dir / "consumer.json"
        if not path.exists():
            return ConsumerState()
        return ConsumerState.from_json(json.loads(path.read_text()))

    def save(self, state: ConsumerState) -> None:
        write_durably(self.state_dir / "consumer.json", json.dumps(state.to_json(), indent=1).encode())

    def bound_zone(self) -> str | None:
        """The zone_id of the landing zone this target is built from; None before the first binding."""
        path = self.state_dir / ZONE_BINDING
        if not path.exists():
            return None
        return str(json.loads(path.read_text())["zone_id"])

    def bind_zone(self, zone_id: str, landing: Path) -> None:
        doc = {"zone_id": zone_id, "landing": str(landing)}
        write_durably(self.state_dir / ZONE_BINDING, json.dumps(doc).encode())

    def check_zone(self, zone_id: str | None, landing: Path, applied_seq: int) -> str:
        """Bind a new target to the zone, or refuse a zone the target does not belong to.

        Returns a line for the log when it bound the target, else "". A zone
        without an identity (an older daemon, not restarted since) and a target
        without a binding (an older consumer) cannot be checked: the target is
        bound to the zone the first time both are known.
        """
        if zone_id is None:
            return ""
        bound = self.bound_zone()
        if bound is None:
            self.bind_zone(zone_id, landing)
            if applied_seq:
                return (f"target {self.target} (applied up to batch {applied_seq}, no zone binding yet) is now "
                        f"bound to landing zone {zone_id}")
            return ""
        if bound != zone_id:
            raise ForeignZone(
                f"landing zone {landing} (zone_id {zone_id}) does not belong to target {self.target}, which was "
                f"built from landing zone {bound}: the zone was created again (e.g. by a re-snapshot, which "
                "numbers batches from 1 again), so applying it here would skip or mix batches. Point --target at "
                "a new, empty directory for this zone (and retire the old target once the new one is complete), "
                f"or point --landing at zone {bound}. Nothing was applied or marked consumed."
            )
        return ""

    def guard(self) -> None:
        """Before a merge writes to the tables: raise when this consumer may not (on a file system the lock, taken
        for the whole run, suffices; ``ObjectTargetStore`` checks its lease)."""

    def commit(self, journal: dict[str, Any]) -> ConsumerState:
        """Make the staged micro-batch the target's content: journal first, then the moves."""
        write_durably(self.journal_path, json.dumps(journal).encode())
        return self.roll_forward()

    def recover(self) -> ConsumerState:
        """After a crash: finish a committed micro-batch, drop an uncommitted one."""
        if self.journal_path.exists():
            return self.roll_forward()
        self._clear_work()
        return self.load()

    def roll_forward(self) -> ConsumerState:
        journal = json.loads(self.journal_path.read_text())
        trash = self.work_dir / "trash"
        trash.mkdir(exist_ok=True)
        for src, dst in journal["files"]:  # changelog files: plain idempotent renames
            s, d = Path(src), Path(dst)
            if s.exists():
                d.parent.mkdir(parents=True, exist_ok=True)
                os.replace(s, d)
                fsync_dir(d.parent)
        for n, (new, dst) in enumerate(journal["buckets"]):  # mirror buckets: replace the directory
            d = Path(dst)
            if new is not None and not Path(new).exists():
                continue  # replaced before the crash
            if new is None and not d.exists():
                continue  # an emptied bucket that never existed, or removed before the crash
            if d.exists():
                old = trash / str(n)
                if old.exists():
                    shutil.rmtree(old)
                os.replace(d, old)
            if new is not None:
                d.parent.mkdir(parents=True, exist_ok=True)
                os.replace(new, d)
            fsync_dir(d.parent)
        state = ConsumerState.from_json(journal["state"])
        self.save(state)
        self.journal_path.unlink()
        fsync_dir(self.state_dir)
        self._clear_work()
        return state

    def _clear_work(self) -> None:
        for entry in self.work_dir.iterdir():
            if entry.is_dir():
                shutil.rmtree(entry)
            else:
                entry.unlink()
