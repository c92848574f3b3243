"""The PostgreSQL source's durable state and the pure ``fold`` that advances it.

Durable state (what ``fold`` returns, saved in the checkpoint)::

    {"slot": "cdcd" | None,            # None: initial_only (no slot)
     "watermark": "0/16B3A40",         # snapshot watermark (the slot's consistent point)
     "flush_lsn": "0/16B3B10",         # commit LSN of the last fully committed transaction (or heartbeat)
     "snapshot": {"status": "running" | "done" | "none",
                  "tables": {"public.t": {"last_key": ["42"], "rows": 42, "done": false}}},
     "system": {"systemid": "7301...", "timeline": 1},   # the server's IDENTIFY_SYSTEM (identity.py)
     "tables": ["public.t"],           # the captured tables (a restart snapshots the ones source.tables gained)
     "oids": {"public.t": 16384},      # each captured table's relation OID: a restart compares it with the catalog
     "incremental": {"public.t": {...}},  # incremental snapshots (cdcd/capture/incremental/state.py)
     "tables_needing_snapshot": {"public.t": "it was dropped and re-created ..."},  # until a re-snapshot ends
     "columns": {"public.t": [["id", 1, "int4"], ...]},  # each table's columns as last landed: name, id, type
     "column_tops": {"public.t": 4},   # each table's largest column id ever landed
     "position_lost": {"count": 1, "last": {...}}}  # recoveries from a lost slot (cdcd/capture/recovery.py)

The standby status ``flush`` sent to the server is ``flush_lsn`` of a state
the runtime confirmed durable: never beyond the checkpoint.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from cdcd.capture.incremental import INCREMENTAL_KINDS, fold_incremental
from cdcd.capture.recovery import fold_position_lost
from cdcd.events import ChangeBlock, ChangeEvent, Item, MarkKind, Op, RowBlock, TableSchema, event_count
from cdcd.positions import format_lsn, parse_lsn
from cdcd.sources.postgres.types import key_text


@dataclass(frozen=True, slots=True)
class TableProgress:
    """One table's snapshot progress: resume after ``last_key`` (the server's text of each key column)."""

    last_key: list[str] | None = None
    rows: int = 0
    done: bool = False


@dataclass(frozen=True, slots=True)
class PgState:
    """The checkpoint's PostgreSQL state, typed, as the planner reads it (``fold_state`` writes the JSON form)."""

    empty: bool = True  # no state at all: a first start
    slot: str | None = None  # None: initial_only (no slot)
    watermark: int = 0
    flush_lsn: int = 0
    snapshot: str = "none"  # "running" | "done" | "none"
    tables: Mapping[str, TableProgress] = field(default_factory=dict)
    system: dict[str, Any] | None = None
    stale: Mapping[str, str] = field(default_factory=dict)  # replaced tables -> why (tables_needing_snapshot)
    oids: Mapping[str, int] = field(default_factory=dict)  # captured table -> its relation OID (none: an old state)
    #: captured table -> its columns as the committed batches last landed them: (name, id, source type)
    columns: Mapping[str, tuple[tuple[str, int | None, str], ...]] = field(default_factory=dict)
    column_tops: Mapping[str, int] = field(default_factory=dict)  # captured table -> its largest column id landed

    @classmethod
    def parse(cls, doc: Mapping[str, Any]) -> PgState:
        if not doc:
            return cls()
        snap = doc.get("snapshot") or {}
        watermark = parse_lsn(doc["watermark"]) if doc.get("watermark") else 0
        tables = {name: TableProgress(e.get("last_key"), int(e.get("rows", 0)), bool(e.get("done", False)))
                  for name, e in (snap.get("tables") or {}).items()}
        flush = parse_lsn(doc["flush_lsn"]) if doc.get("flush_lsn") else watermark
        return cls(False, doc.get("slot"), watermark, flush, str(snap.get("status") or "none"), tables,
                   doc.get("system"), dict(doc.get("tables_needing_snapshot") or {}),
                   {name: int(oid) for name, oid in (doc.get("oids") or {}).items()},
                   {name: tuple((c[0], c[1], c[2]) for c in cols) for name, cols in (doc.get("columns") or {}).items()},
                   {name: int(top) for name, top in (doc.get("column_tops") or {}).items()})


def fresh_state(slot: str | None, watermark: int, snapshot: bool,
                system: dict[str, Any] | None = None) -> dict[str, Any]:
    state: dict[str, Any] = {
        "slot": slot,
        "watermark": format_lsn(watermark),
        "flush_lsn": format_lsn(watermark),
        "snapshot": {"status": "running" if snapshot else "none", "tables": {}},
    }
    if system:
        state["system"] = dict(system)
    return state


def fold_state(state: dict[str, Any], items: Sequence[Item]) -> dict[str, Any]:
    """The source state once ``items`` are committed. Pure; ``state`` is not modified."""
    new = dict(state)
    snap = dict(new.get("snapshot") or {"status": "none", "tables": {}})
    tables: dict[str, dict[str, Any]] = {k: dict(v) for k, v in (snap.get("tables") or {}).items()}
    last: dict[str, ChangeEvent | RowBlock] = {}
    counts: dict[str, int] = {}
    schemas: dict[str, TableSchema] = {}  # each table's last landed schema in ``items``
    tops: dict[str, int] = {}  # each table's largest column id in ``items``
    schema: TableSchema | None = None
    for item in items:
        if isinstance(item, ChangeBlock | ChangeEvent | RowBlock) and item.schema is not schema:
            schema = item.schema
            name = str(schema.table)
            schemas[name] = schema
            tops[name] = max([tops.get(name, 0), *(c.id for c in schema.columns if c.id is not None)])
        if isinstance(item, ChangeBlock):  # streamed rows: their progress is the COMMIT mark's
            continue
        if isinstance(item, ChangeEvent | RowBlock):
            # a snapshot's opening truncate (events.snapshot_truncates) is no progress of its rows
            # rows of an incremental snapshot (while streaming) are no progress of the initial one: their
            # progress comes with their INCREMENTAL_CHUNK mark
            if item.snapshot and item.op is not Op.TRUNCATE and event_count(item) and snap.get("status") == "running":
                name = str(item.table)
                last[name] = item
                counts[name] = counts.get(name, 0) + event_count(item)
            continue
        kind = item.kind
        if kind == MarkKind.COMMIT:
            _advance_flush(new, parse_lsn(item.detail["lsn"]))
        elif kind == MarkKind.HEARTBEAT:
            _advance_flush(new, item.position.lsn)  # type: ignore[union-attr]
        elif kind == MarkKind.SNAPSHOT_TABLE_DONE:
            _flush_rows(tables, last, counts)
            tables.setdefault(item.detail["table"], {"last_key": None, "rows": 0})["done"] = True
        elif kind == MarkKind.SNAPSHOT_DONE:
            snap["status"] = "done"
        elif kind in INCREMENTAL_KINDS:
            fold_incremental(new, item)
            if kind == MarkKind.TABLES:
                _fold_oids(new, item.detail)
        elif kind == MarkKind.IDENTITY:
            new["system"] = dict(item.detail)
        elif kind == MarkKind.POSITION_LOST:  # a new slot after a lost one (cdcd/capture/recovery.py)
            fold_position_lost(new, item)
            new["slot"] = item.detail["slot"]
            new["watermark"] = new["flush_lsn"] = item.detail["lsn"]
            if snap.get("status") == "running":  # the tables it had left are re-read incrementally
                snap["status"] = "done"
        elif kind in (MarkKind.SNAPSHOT_START, MarkKind.STREAM_START):
            new = fresh_state(item.detail["slot"], parse_lsn(item.detail["watermark"]),
                              kind == MarkKind.SNAPSHOT_START, item.detail.get("system"))
            if item.detail.get("tables") is not None:
                new["tables"] = list(item.detail["tables"])
            _fold_oids(new, item.detail)
            snap, tables, last, counts, schemas, tops = dict(new["snapshot"]), {}, {}, {}, {}, {}
    _flush_rows(tables, last, counts)
    snap["tables"] = tables
    new["snapshot"] = snap
    _fold_columns(new, schemas, tops)
    return new


def _fold_columns(state: dict[str, Any], schemas: Mapping[str, TableSchema], seen: Mapping[str, int]) -> None:
    """The columns of each table's last landed schema (a start compares its first Relation message with them,
    ``tables.py``) and its largest column id landed (``seen``: those of ``items``), for the tables still captured."""
    cols = {**(state.get("columns") or {}),
            **{name: [[c.name, c.id, c.source_type] for c in s.columns] for name, s in schemas.items()}}
    tops = dict(state.get("column_tops") or {})
    for name, top in seen.items():
        tops[name] = max(tops.get(name, 0), top)
    captured = state.get("tables")
    for key, value in (("columns", cols), ("column_tops", tops)):
        kept = {t: v for t, v in value.items() if captured is None or t in captured}
        if kept:
            state[key] = kept
        else:
            state.pop(key, None)


def _fold_oids(state: dict[str, Any], detail: Mapping[str, Any]) -> None:
    """The relation OIDs a start or TABLES mark carries (``"oids"``, maybe only some tables'), over those kept,
    for the tables still captured. A mark without them (a checkpoint written before OIDs were kept) keeps none
    new: the next connect takes the catalog's."""
    oids = {**(state.get("oids") or {}), **(detail.get("oids") or {})}
    captured = state.get("tables")
    if captured is not None:
        oids = {t: oid for t, oid in oids.items() if t in captured}
    if oids:
        state["oids"] = oids
    else:
        state.pop("oids", None)


def _advance_flush(state: dict[str, Any], lsn: int) -> None:
    # Never backwards: a transaction resent after a restart must not pull the slot's flush position back.
    if lsn > parse_lsn(state.get("flush_lsn") or "0/0"):
        state["flush_lsn"] = format_lsn(lsn)


def _flush_rows(tables: dict[str, dict[str, Any]], last: dict[str, ChangeEvent | RowBlock],
                counts: dict[str, int]) -> None:
    for name, item in last.items():
        entry = tables.setdefault(name, {"last_key": None, "rows": 0, "done": False})
        key = item.key if isinstance(item, ChangeEvent) else item.last_key
        # The server's own text where the landed value cannot give it back (NaN, ±infinity, arrays).
        texts = item.last_key_text() if isinstance(item, RowBlock) else None
        entry["last_key"] = [t if texts and t is not None else key_text(v)
                             for v, t in zip(key, texts or [None] * len(key), strict=True)] if key else None
        entry["rows"] = int(entry.get("rows", 0)) + counts.get(name, 0)
        entry.setdefault("done", False)
    last.clear()
    counts.clear()
