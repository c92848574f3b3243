"""The captured table list and the checkpoint's form of incremental snapshots: the tables a connect adds or drops,
a reloaded list or a snapshot request checked against ``source.tables``, and the fold every source's state uses
for the incremental Marks."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from cdcd.capture.incremental.window import SnapshotJob
from cdcd.errors import ConfigError
from cdcd.events import Mark, MarkKind, TableId
from cdcd.positions import Position, position_from_json


def plan_tables(state: Mapping[str, Any], configured: list[TableId], fresh: bool, at: Position,
                log: Any) -> tuple[list[Mark], list[SnapshotJob]]:
    """At connect: compare ``source.tables`` with the captured list the checkpoint holds (``fresh``: a first start
    or a new snapshot, every table is in it). A table added gets its INCREMENTAL_START before the new TABLES list,
    so a crash cannot record it as captured without its snapshot; a table removed stops being captured. Returns
    the marks to announce and the jobs to run: the checkpoint's running ones, then the added tables'."""
    held = None if fresh else state.get("tables")
    if held is None and not fresh:
        # A checkpoint from before the list was kept: the initial snapshot's tables, else the configured list.
        done = (state.get("snapshot") or {}).get("tables") or {}
        held = list(done) if done else [str(t) for t in configured]
    captured = [TableId.parse(n) for n in held] if held is not None else list(configured)
    added = [t for t in configured if t not in captured]
    marks = [Mark(MarkKind.INCREMENTAL_START, at, {"table": str(t), "where": None}) for t in added]
    jobs = [] if fresh else jobs_from_state(state, configured)
    jobs += [SnapshotJob(t, None, started=True) for t in added]
    if added or held is None or captured != configured:
        marks.append(Mark(MarkKind.TABLES, at, {"tables": [str(t) for t in configured]}))
    if added:
        log.info("tables added to source.tables: snapshotting them incrementally while streaming",
                 tables=[str(t) for t in added])
    gone = [str(t) for t in captured if t not in configured]
    if gone:
        log.info("tables removed from source.tables: no longer captured (what was landed stays)", tables=gone)
    return marks, jobs


def parse_tables(tables: list[str]) -> list[TableId]:
    """A reloaded ``source.tables`` list, or a ConfigError saying what is wrong with it."""
    try:
        new = [TableId.parse(t) for t in tables]
    except ValueError as exc:
        raise ConfigError(f"table reload: {exc}") from None
    if not new or len(set(new)) != len(new):
        raise ConfigError(f"table reload: the list {tables!r} must name each table once, and at least one")
    return new


def check_table(name: str, configured: list[TableId]) -> TableId:
    """``name`` as a configured table, or a ConfigError naming the configured list."""
    try:
        table = TableId.parse(name)
    except ValueError as exc:
        raise ConfigError(f"snapshot request: {exc}") from None
    if table not in configured:
        listed = ", ".join(str(t) for t in configured)
        raise ConfigError(f"snapshot request: table {name!r} is not captured; source.tables lists: {listed}")
    return table


# -- the checkpoint's form, shared by every source's fold --------------------------------------------------

INCREMENTAL_KINDS = (MarkKind.INCREMENTAL_START, MarkKind.INCREMENTAL_CHUNK, MarkKind.INCREMENTAL_REREAD,
                     MarkKind.INCREMENTAL_DONE, MarkKind.TABLES, MarkKind.TABLE_REPLACED)


def fold_incremental(state: dict[str, Any], mark: Mark) -> None:
    """Fold one incremental-snapshot Mark into the source state (``state`` is the fold's own copy).

    ``state["incremental"]`` maps a table to ``{"where", "last_key", "rows", "chunks", "lw", "status"}``, plus
    ``"reread"`` (the keys waiting to be read again, when there are) and ``"repairs": true`` (a whole-table
    snapshot begun after its table was flagged replaced);
    ``state["incremental_queued"]`` lists the requests not started yet (``{"table", "where"}``, in order);
    ``state["tables"]`` is the captured table list (what a restart compares ``source.tables`` with);
    ``state["tables_needing_snapshot"]`` maps a replaced table to why, until a repairing snapshot completes.
    """
    kind = mark.kind
    queued = list(state.get("incremental_queued") or [])
    if kind is MarkKind.TABLES:
        state["tables"] = list(mark.detail["tables"])
        if queued:
            state["incremental_queued"] = [q for q in queued if q["table"] in state["tables"]]
        stale = {t: why for t, why in (state.get("tables_needing_snapshot") or {}).items() if t in state["tables"]}
        if stale:
            state["tables_needing_snapshot"] = stale
        else:
            state.pop("tables_needing_snapshot", None)
        return
    table = mark.detail["table"]
    if kind is MarkKind.TABLE_REPLACED:
        state["tables_needing_snapshot"] = {**(state.get("tables_needing_snapshot") or {}),
                                            table: mark.detail["why"]}
        return
    if kind is MarkKind.INCREMENTAL_START and mark.detail.get("queued"):
        state["incremental_queued"] = [*queued, {"table": table, "where": mark.detail.get("where")}]
        return
    jobs = {k: dict(v) for k, v in (state.get("incremental") or {}).items()}
    if kind is MarkKind.INCREMENTAL_START:
        if queued:  # the table's snapshot begins: it replaces every request of the table queued before
            state["incremental_queued"] = [q for q in queued if q["table"] != table]
        jobs[table] = {"where": mark.detail.get("where"), "last_key": None, "rows": 0, "chunks": 0, "lw": None,
                       "status": "running"}
        if mark.detail.get("repairs"):
            jobs[table]["repairs"] = True
    elif kind in (MarkKind.INCREMENTAL_CHUNK, MarkKind.INCREMENTAL_REREAD):
        entry = jobs.get(table)
        if entry is None or entry.get("status") != "running":
            return  # a chunk of a job the checkpoint no longer runs (replaced, or the table was removed)
        if kind is MarkKind.INCREMENTAL_REREAD:
            held = list(entry.get("reread") or [])
            entry["reread"] = held + [k for k in mark.detail["keys"] if k not in held]
        else:
            entry["last_key"] = mark.detail["last_key"]
            entry["rows"] = int(entry.get("rows", 0)) + int(mark.detail["rows"])
            entry["chunks"] = int(entry.get("chunks", 0)) + 1
            if entry.get("lw") is None:
                entry["lw"] = mark.detail["lw"]
            entry.pop("reread", None)
            if mark.detail.get("reread"):
                entry["reread"] = list(mark.detail["reread"])
        jobs[table] = entry
    elif kind is MarkKind.INCREMENTAL_DONE:
        entry = jobs.get(table)
        if entry is None:
            return
        why = mark.detail.get("failed") or mark.detail.get("cancelled")
        entry["status"] = "failed" if mark.detail.get("failed") else "cancelled" if why else "done"
        if why:
            entry["error"] = why
        entry.pop("reread", None)
        if entry.pop("repairs", False) and not why and state.get("tables_needing_snapshot"):
            stale = dict(state["tables_needing_snapshot"])
            stale.pop(table, None)
            state["tables_needing_snapshot"] = stale
            if not stale:
                del state["tables_needing_snapshot"]
        jobs[table] = entry
    state["incremental"] = jobs


def jobs_from_state(state: Mapping[str, Any], captured: list[TableId]) -> list[SnapshotJob]:
    """The checkpoint's running incremental snapshots of tables still captured, to resume, then its queued
    requests."""
    out: list[SnapshotJob] = []
    for name, entry in (state.get("incremental") or {}).items():
        table = TableId.parse(name)
        if entry.get("status") != "running" or table not in captured:
            continue
        lw = entry.get("lw")
        out.append(SnapshotJob(table, entry.get("where"), entry.get("last_key"), int(entry.get("rows", 0)),
                               int(entry.get("chunks", 0)), position_from_json(lw) if lw else None,
                               "queued", True, reread={tuple(k): list(k) for k in entry.get("reread") or []},
                               repairs=bool(entry.get("repairs"))))
    for q in state.get("incremental_queued") or []:  # requested, not started: they start from the beginning
        table = TableId.parse(q["table"])
        if table in captured:
            out.append(SnapshotJob(table, q.get("where")))
    return out


def stale_from_state(stale: Mapping[str, str], captured: list[TableId]) -> dict[TableId, str]:
    """The checkpoint's replaced tables (``tables_needing_snapshot``, a source state's ``stale``) that are still
    captured, for ``Incremental.resume``."""
    return {t: why for t, why in ((TableId.parse(name), why) for name, why in stale.items()) if t in captured}
