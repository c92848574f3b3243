"""The MySQL/MariaDB planner's decisions, pure: what a run does, from the checkpoint state, its position, the
mode and the verdict on the server's binlog (``identity.judge``, pure too).

``MySqlSource.connect`` gathers the facts (the server's variables, identity and binlog files) and carries the
decisions out (read the current position, open the snapshot, start the binlog); every case of the decisions
themselves is a unit test (tests/unit/test_mysql_plan.py).
"""

from __future__ import annotations

import enum

from cdcd.errors import PositionLost, SourceFatal
from cdcd.positions import MySqlPosition, Position
from cdcd.sources.mysql.identity import BinlogFacts, Verdict
from cdcd.sources.mysql.state import MySqlState

LOST_FIX = (
    "The changes since are lost to cdcd and the mirror cannot be brought up to date from this binlog. Re-snapshot: "
    "stop cdcd (`cdcd stop -c CONFIG`), move the state directory (state.path) and the landing zone (landing.path) "
    "aside, start again with snapshot.mode = \"initial\" and let `cdcd spark run` write to a fresh --target; or run "
    "`cdcd recover -c CONFIG` (the current binlog position, every table re-snapshotted incrementally into the same "
    "mirror), or set source.on_position_lost = \"resnapshot\" to do that by itself (see docs/operations.md, \"A lost "
    "position\")."
)

RESNAPSHOT_FIX = (
    "Run `cdcd recover -c CONFIG` (the current binlog position, every table re-snapshotted incrementally into the "
    "same mirror), or set source.on_position_lost = \"resnapshot\" to do that by itself (docs/operations.md, \"A lost "
    "position\"); keep "
    "binlogs longer (expire_logs_days / binlog_expire_logs_seconds) so this does not recur."
)


class Step(enum.Enum):
    FRESH_SNAPSHOT = "no checkpoint: a new snapshot"
    STREAM_FROM_NOW = "no checkpoint and snapshot.mode = never: stream from the server's current position"
    RESUME_SNAPSHOT = "finish the interrupted snapshot at its watermark"
    DONE = "initial_only and its snapshot is done: nothing to do"
    RESUME_STREAM = "stream from the checkpoint (or from the last position delivered in this process)"
    RESNAPSHOT = "the position is lost and snapshot.mode = when_needed: a new snapshot in a new epoch"
    RECOVER = "the position is lost, recovery allowed: stream from now in a new epoch, re-snapshot incrementally"


def first_step(state: MySqlState, position: Position | None, mode: str) -> Step:
    """What the checkpoint asks for, before the server's binlog is judged."""
    snap = state.snapshot
    if position is None and snap is None:
        return Step.STREAM_FROM_NOW if mode == "never" else Step.FRESH_SNAPSHOT
    if snap is not None and not snap.done:
        return Step.RESUME_SNAPSHOT
    if mode == "initial_only" and snap is not None:
        return Step.DONE
    return Step.RESUME_STREAM


def resume_position(state: MySqlState, position: Position | None) -> MySqlPosition:
    """Where streaming resumes: the checkpoint's position, else the snapshot's watermark or the stream start."""
    pos = position
    if pos is None:
        pos = state.snapshot.watermark if state.snapshot is not None else state.stream_start
        if pos is None:
            raise SourceFatal("the checkpoint's source state has neither a snapshot nor a stream start: it was "
                              "not written by this source; point state.path at a fresh directory")
    if not isinstance(pos, MySqlPosition):
        raise SourceFatal(f"the checkpoint position {pos} is not a MySQL binlog position: this state directory "
                          "belongs to another kind of source; point state.path at a fresh directory")
    return pos


def after_verdict(verdict: Verdict | str | None, mode: str, pos: MySqlPosition, facts: BinlogFacts,
                  what: str, recover: bool = False) -> Verdict | Step:
    """The judged position: its verdict (go on), ``Step.RECOVER`` (``recover``: source.on_position_lost =
    "resnapshot" or `cdcd recover`, which wins over when_needed), ``Step.RESNAPSHOT`` (when_needed), or a
    ``SourceFatal``.

    ``verdict`` is ``identity.judge``'s answer as a value: None = the binlog file was purged, a string = the
    position is lost (the server's history went back)."""
    if verdict is not None and not isinstance(verdict, str):
        return verdict
    if recover:
        return Step.RECOVER
    if mode == "when_needed":
        return Step.RESNAPSHOT
    if isinstance(verdict, str):
        raise PositionLost(f"{verdict}. {LOST_FIX}")
    raise PositionLost(f"{lost_problem(verdict, pos, facts, what)}: the changes since then are lost to cdcd. "
                       + RESNAPSHOT_FIX)


def lost_problem(verdict: str | None, pos: MySqlPosition, facts: BinlogFacts, what: str) -> str:
    """What was lost, as ``after_verdict`` says it: the server's words on a history that went back, or the purged
    binlog file."""
    if isinstance(verdict, str):
        return verdict
    files = facts.files
    oldest = files[0] if files else "(none)"
    return (f"binlog file {pos.file} needed to resume from {what} ({pos}, GTID {pos.gtid or 'n/a'}) is no longer on "
            f"the server (purged; the oldest binlog is {oldest})")
