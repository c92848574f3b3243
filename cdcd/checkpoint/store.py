"""The checkpoint store: one JSON document per daemon in ``state.path``.

Layout of the state directory::

    checkpoint.json          the current checkpoint
    history/<save_id>.json   earlier checkpoints: the newest ``keep`` of them, and one per tier interval
                             (by default one a minute for an hour, one an hour for a day)
    lock                     flock()ed by the running daemon; holds its pid

A save writes a temp file, fsyncs it, hard-links the previous current
document into ``history/`` and renames the new one over ``checkpoint.json``,
then fsyncs the state directory: a crash leaves the old checkpoint or the new
one. ``history/`` itself is not fsynced on each save (two fsyncs per save, not
three): a crash may lose the newest history entries, never the current one.
Every document carries a SHA-256 of its body; a document that fails the check
is refused (never treated as "no checkpoint").
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from cdcd.config import StateConfig
from cdcd.errors import CheckpointError, CheckpointFatal, StateDirLocked, StateError
from cdcd.fsutil import fsync_dir, remove_temps, storage_fix, write_durably
from cdcd.positions import Position, position_from_json

FORMAT_VERSION = 1
CURRENT = "checkpoint.json"
HISTORY = "history"
LOCK = "lock"

RECOVERY_HINT = (
    "inspect the saved checkpoints with `cdcd checkpoint list -c CONFIG` and roll back to an earlier one with "
    "`cdcd checkpoint rollback -c CONFIG --to SAVE_ID`; or, to start over with a new snapshot, move the state "
    "directory aside"
)


@dataclass(slots=True)
class Checkpoint:
    """What is durably committed: the last acked batch and where the source stands."""

    source_kind: str
    batch_seq: int = 0
    event_count: int = 0
    position: Position | None = None
    source_state: dict[str, Any] = field(default_factory=dict)
    save_id: int = 0
    saved_at: str = ""

    def body(self) -> dict[str, Any]:
        return {
            "format_version": FORMAT_VERSION,
            "save_id": self.save_id,
            "saved_at": self.saved_at,
            "source_kind": self.source_kind,
            "batch_seq": self.batch_seq,
            "event_count": self.event_count,
            "position": None if self.position is None else self.position.to_json(),
            "source_state": self.source_state,
        }

    def to_bytes(self) -> bytes:
        body = self.body()
        body["sha256"] = _digest(body)
        return (json.dumps(body, indent=2, sort_keys=True) + "\n").encode()

    @classmethod
    def from_bytes(cls, data: bytes, origin: Path) -> Checkpoint:
        def refuse(why: str) -> CheckpointFatal:
            return CheckpointFatal(f"checkpoint {origin} is unusable: {why}. To recover, {RECOVERY_HINT}")

        try:
            doc = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise refuse(f"not valid JSON ({exc}); the file is corrupt or truncated") from None
        if not isinstance(doc, dict):
            raise refuse("not a JSON object")
        digest = doc.pop("sha256", None)
        if digest != _digest(doc):
            raise refuse("its SHA-256 does not match its contents; the file is corrupt")
        if doc.get("format_version") != FORMAT_VERSION:
            found = doc.get("format_version")
            raise refuse(f"format_version {found!r} is not {FORMAT_VERSION} (written by another cdcd version)")
        try:
            return cls(
                source_kind=doc["source_kind"],
                batch_seq=int(doc["batch_seq"]),
                event_count=int(doc["event_count"]),
                position=None if doc["position"] is None else position_from_json(doc["position"]),
                source_state=dict(doc["source_state"]),
                save_id=int(doc["save_id"]),
                saved_at=str(doc["saved_at"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise refuse(f"a field is missing or has the wrong type ({exc!r})") from None


def _digest(body: dict[str, Any]) -> str:
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(canonical).hexdigest()


@dataclass(frozen=True)
class HistoryTier:
    """Keep one earlier checkpoint per ``every_s`` among those saved in the last ``span_s`` seconds."""

    every_s: float
    span_s: float


#: One a minute for an hour, one an hour for a day: a quiet source saves on every heartbeat, so a count
#: alone would reach back only minutes; a day matches the landing zone's default retention.
DEFAULT_TIERS = (HistoryTier(60, 3600), HistoryTier(3600, 86400))


def history_to_keep(saved: list[tuple[Path, float]], keep: int, tiers: tuple[HistoryTier, ...],
                    now: float) -> set[Path]:
    """Of the history entries ``saved`` (path, save time; oldest first), the ones to keep: the newest ``keep``,
    and per tier the oldest entry of each ``every_s`` interval within its span. The oldest of an interval
    stays the same as newer saves come, so a kept entry is never traded for a newer one of its interval."""
    kept = {path for path, _ in saved[max(0, len(saved) - keep):]}
    for tier in tiers:
        seen: set[int] = set()
        for path, at in saved:
            if now - at > tier.span_s:
                continue
            interval = int(at // tier.every_s)
            if interval not in seen:
                seen.add(interval)
                kept.add(path)
    return kept


def store_for(state: StateConfig) -> CheckpointStore:
    """The checkpoint store the ``[state]`` section describes."""
    tiers = tuple(HistoryTier(t.every_s, t.span_s) for t in state.checkpoint_history)
    return CheckpointStore(state.path, state.keep_checkpoints, tiers)


class CheckpointStore:
    """Loads and saves checkpoints in a state directory and guards it with a lock."""

    def __init__(self, path: str | Path, keep: int = 10, tiers: tuple[HistoryTier, ...] = DEFAULT_TIERS) -> None:
        self.path = Path(path)
        self.keep = keep
        self.tiers = tiers
        self._lock_fd: int | None = None
        self._last_save_id = 0

    @property
    def current_path(self) -> Path:
        return self.path / CURRENT

    @property
    def history_path(self) -> Path:
        return self.path / HISTORY

    # -- lock -----------------------------------------------------------------

    def lock(self) -> None:
        """Take the exclusive lock on the state directory, or refuse naming the holder. Held already: nothing to do."""
        if self._lock_fd is not None:
            return
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CheckpointFatal(
                f"state directory {self.path} cannot be created: {exc.strerror}; set state.path to a writable directory"
            ) from exc
        fd = os.open(self.path / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            holder = self.holder_pid()
            who = f"pid {holder}" if holder else "another process"
            raise StateDirLocked(
                f"state directory {self.path} is locked by {who}: another cdcd daemon is running on it. "
                "Stop it first (`cdcd stop -c CONFIG`) or give this one its own state.path"
            ) from None
        # Overwritten in place and never emptied: a restart on a full volume needs no new block for it.
        pid = f"{os.getpid()}\n".encode()
        try:
            os.pwrite(fd, pid, 0)
            os.ftruncate(fd, len(pid))
            os.fsync(fd)
        except OSError as exc:
            os.close(fd)
            raise CheckpointError(
                f"state directory {self.path}: cannot write the daemon's pid into {self.path / LOCK}: "
                f"{exc.strerror or exc}; {storage_fix(exc)}"
            ) from exc
        self._lock_fd = fd

    def unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing releases the flock; the stale pid is read only under the lock
            self._lock_fd = None

    @property
    def locked(self) -> bool:
        return self._lock_fd is not None

    def holder_pid(self) -> int | None:
        """The pid of the daemon holding the lock, or None when nobody holds it."""
        lock = self.path / LOCK
        if self._lock_fd is not None:
            return os.getpid()
        try:
            fd = os.open(lock, os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                text = lock.read_text().strip()
                return int(text) if text.isdigit() else -1
            fcntl.flock(fd, fcntl.LOCK_UN)
            return None
        finally:
            os.close(fd)

    def _require_unlocked_by_others(self, action: str) -> None:
        holder = self.holder_pid()
        if holder is not None and holder != os.getpid():
            raise StateError(f"cannot {action} while the daemon (pid {holder}) runs on {self.path}; stop it first")

    # -- load / save ------------------------------------------------------------

    def load(self) -> Checkpoint | None:
        """The current checkpoint; None only when none was ever saved.

        Temp files a crash left behind are removed only by the lock holder: a
        reader such as `cdcd status` must not delete a running daemon's save.
        """
        if self.locked:
            remove_temps(self.path)
        try:
            data = self.current_path.read_bytes()
        except FileNotFoundError:
            if self.history():
                raise CheckpointFatal(
                    f"checkpoint {self.current_path} is missing although {self.history_path} holds earlier ones. "
                    f"To recover, {RECOVERY_HINT}"
                ) from None
            return None
        ckpt = Checkpoint.from_bytes(data, self.current_path)
        self._last_save_id = max(self._last_save_id, ckpt.save_id)
        return ckpt

    def save(self, ckpt: Checkpoint) -> Checkpoint:
        """Durably replace the current checkpoint; the old one goes to history."""
        self._last_save_id += 1
        ckpt.save_id = self._last_save_id
        ckpt.saved_at = datetime.now(UTC).isoformat(timespec="milliseconds")
        try:
            self._install(ckpt.to_bytes())
        except OSError as exc:
            self._last_save_id -= 1
            raise CheckpointError(
                f"saving the checkpoint in {self.path} failed: {exc.strerror or exc}; {storage_fix(exc)}. "
                "cdcd retries the save until it succeeds; reading pauses while the batches wait"
            ) from exc
        return ckpt

    def _install(self, data: bytes) -> None:
        self.history_path.mkdir(exist_ok=True)
        current = self.current_path
        if current.exists():
            # A hard link keeps the previous version in history at no copying cost.
            previous = self._history_name(current)
            if not previous.exists():
                os.link(current, previous)
            self._prune()
        write_durably(current, data, sync_dir=False)
        fsync_dir(self.path)
        # history/ is not fsynced: a crash may lose the newest history links (and undo a prune), which only
        # shortens (or lengthens) the list `cdcd checkpoint list` and rollback offer; the current checkpoint,
        # the only one the daemon resumes from, is durable above. The next save's fsyncs usually carry them.

    def _history_name(self, current: Path) -> Path:
        try:
            save_id = int(json.loads(current.read_bytes()).get("save_id", 0))
        except (ValueError, AttributeError):
            save_id = int(time.time() * 1000)  # a corrupt current still goes to history, under a unique name
        return self.history_path / f"{save_id:012d}.json"

    def _prune(self) -> None:
        saved: list[tuple[Path, float]] = []
        for path in sorted(self.history_path.glob("*.json")):
            with contextlib.suppress(FileNotFoundError):
                saved.append((path, path.stat().st_mtime))  # a history entry is a link to the saved file
        kept = history_to_keep(saved, self.keep, self.tiers, time.time())
        for path, _ in saved:
            if path not in kept:
                path.unlink(missing_ok=True)

    # -- history and rollback ---------------------------------------------------

    def history(self) -> list[Path]:
        """Earlier checkpoints, oldest first."""
        if not self.history_path.is_dir():
            return []
        return sorted(self.history_path.glob("*.json"))

    def entries(self) -> list[tuple[Path, Checkpoint | CheckpointFatal]]:
        """Every checkpoint on disk, oldest first, current last; unreadable ones as their error."""
        out: list[tuple[Path, Checkpoint | CheckpointFatal]] = []
        paths = [*self.history(), *([self.current_path] if self.current_path.exists() else [])]
        for path in paths:
            try:
                out.append((path, Checkpoint.from_bytes(path.read_bytes(), path)))
            except CheckpointFatal as exc:
                out.append((path, exc))
        return out

    def rollback(self, save_id: int) -> Checkpoint:
        """Make the historical checkpoint ``save_id`` the current one (refused while a daemon runs)."""
        self._require_unlocked_by_others("roll back the checkpoint")
        source = self.history_path / f"{save_id:012d}.json"
        if not source.exists():
            known = ", ".join(p.stem.lstrip("0") or "0" for p in self.history()) or "none"
            raise CheckpointFatal(f"no checkpoint with save id {save_id} in {self.history_path} (saved ids: {known})")
        ckpt = Checkpoint.from_bytes(source.read_bytes(), source)
        latest = max([self._last_save_id, *(int(p.stem) for p in self.history())])
        if self.current_path.exists():
            with contextlib.suppress(CheckpointFatal):
                latest = max(latest, Checkpoint.from_bytes(self.current_path.read_bytes(), self.current_path).save_id)
        self._last_save_id = latest
        return self.save(ckpt)
