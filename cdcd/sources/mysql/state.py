"""The MySQL/MariaDB source's durable state and the pure ``fold`` that advances it.

Durable state (what ``fold`` returns, saved in the checkpoint)::

    {"snapshot": {"watermark": <position JSON>, "done": bool,
                  "tables": {"db.t": {"last_key": [...], "done": bool}}},
     "schemas": <SchemaHistory JSON>,
     "stream_start": <position JSON>,          # snapshot.mode = "never": where streaming began
     "server": {"server_id": int, "uuid": str, "epoch": int},
     "inside_tx": true,                        # present when the checkpoint's position is inside a transaction
     "seqs": "content",                        # seqs number transaction content (decode.py); absent: written by
                                               # an earlier version, byte offsets (matters only inside_tx)
     "tables_needing_snapshot": {"db.t": "DROP TABLE at ..."},  # replaced tables, until a re-snapshot ends
     "position_lost": {"count": 1, "last": {...}}}  # recoveries from a lost position (cdcd/capture/recovery.py)

Incremental snapshots keep ``tables``, ``incremental`` and ``incremental_queued`` too
(``cdcd/capture/incremental/state.py``, ``fold_incremental``).

``server`` is the identity of the server the positions belong to and their
epoch (``identity.py``): a failover to another server with the checkpoint's
GTIDs continues in the next epoch; a server whose binlog went back is refused.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from cdcd.capture.incremental import INCREMENTAL_KINDS, fold_incremental
from cdcd.capture.recovery import fold_position_lost
from cdcd.errors import CheckpointFatal
from cdcd.events import ChangeBlock, ChangeEvent, Item, Mark, MarkKind, Op, RowBlock, TableId
from cdcd.positions import MySqlPosition, position_from_json
from cdcd.sources.mysql.schema import SchemaHistory, schema_from_json
from cdcd.sources.mysql.types import key_to_json


@dataclass(frozen=True, slots=True)
class TableProgress:
    """One table's snapshot progress: resume after ``last_key`` (``types.key_to_json`` form)."""

    last_key: list[Any] | None = None
    done: bool = False


@dataclass(frozen=True, slots=True)
class SnapshotProgress:
    watermark: MySqlPosition
    done: bool
    tables: Mapping[str, TableProgress]


@dataclass(frozen=True, slots=True)
class MySqlState:
    """The checkpoint's MySQL/MariaDB state, typed, as the planner reads it (``fold_state`` writes the JSON)."""

    snapshot: SnapshotProgress | None = None
    stream_start: MySqlPosition | None = None  # snapshot.mode = "never": where streaming began
    server: dict[str, Any] | None = None  # {"server_id", "uuid", "epoch"}
    inside_tx: bool = False
    content_seqs: bool = True  # False: inside a transaction an earlier version numbered by byte offsets
    schemas: Mapping[str, Any] = field(default_factory=dict)  # SchemaHistory JSON
    stale: Mapping[str, str] = field(default_factory=dict)  # replaced tables -> why (tables_needing_snapshot)

    @classmethod
    def parse(cls, doc: Mapping[str, Any]) -> MySqlState:
        snap = doc.get("snapshot")
        progress = None
        if snap:
            tables = {name: TableProgress(e.get("last_key"), bool(e.get("done", False)))
                      for name, e in (snap.get("tables") or {}).items()}
            progress = SnapshotProgress(_mysql_position(snap["watermark"]), bool(snap.get("done")), tables)
        start = _mysql_position(doc["stream_start"]) if doc.get("stream_start") else None
        inside = bool(doc.get("inside_tx", False))
        return cls(progress, start, doc.get("server"), inside, not inside or doc.get("seqs") == SEQS,
                   doc.get("schemas") or {}, dict(doc.get("tables_needing_snapshot") or {}))


#: The ``seqs`` entry of the state: positions inside a transaction number its content (decode.py). Checkpoints
#: of earlier versions lack it; inside a transaction their seq is a byte offset in it, and the transaction keeps
#: that numbering after an upgrade (``Decoder.legacy_tx``) until it commits.
SEQS = "content"


def _mysql_position(doc: dict[str, Any]) -> MySqlPosition:
    pos = position_from_json(doc)
    if not isinstance(pos, MySqlPosition):
        raise CheckpointFatal(f"checkpoint position {doc!r} is not a MySQL binlog position: this state directory "
                              "belongs to another kind of source; point state.path at a fresh directory")
    return pos


#: Marks that say nothing of where the stream is: an incremental snapshot places them between any two items
_NOT_STREAM = frozenset((*INCREMENTAL_KINDS, MarkKind.SNAPSHOT_COVERED, MarkKind.WATERMARK))


def fold_state(state: dict[str, Any], items: Sequence[Item]) -> dict[str, Any]:
    """The source state once ``items`` are committed. Pure; ``state`` is not modified."""
    new = dict(state)
    snap: dict[str, Any] | None = new.get("snapshot")
    tables: dict[str, dict[str, Any]] = {k: dict(v) for k, v in ((snap or {}).get("tables") or {}).items()}
    if snap is not None:
        snap = dict(snap)
    last: dict[str, ChangeEvent | RowBlock] = {}
    history: SchemaHistory | None = None
    for item in items:
        if type(item) is ChangeBlock:  # streamed rows: their progress is the position alone
            continue
        if type(item) is ChangeEvent:
            if item.snapshot and item.op is not Op.TRUNCATE:  # a snapshot's opening truncate is no progress
                last[str(item.table)] = item
            continue
        if type(item) is RowBlock:
            # the batcher may have sliced the block: this slice's own last row is what is committed; rows of an
            # incremental snapshot (while streaming) have their own progress (INCREMENTAL_CHUNK)
            if item.snapshot and item.rows and snap is not None and not snap.get("done"):
                last[str(item.table)] = item
            continue
        assert isinstance(item, Mark)
        kind = item.kind
        if kind == MarkKind.SNAPSHOT_START:
            snap = {"watermark": item.position.to_json(), "done": False}
            tables = {t: {"last_key": None, "done": False} for t in item.detail["tables"]}
            last = {}
            new.pop("tables_needing_snapshot", None)  # the new snapshot reads every table again
        elif kind == MarkKind.SNAPSHOT_TABLE_DONE:
            _flush_keys(tables, last)
            tables.setdefault(item.detail["table"], {"last_key": None})["done"] = True
        elif kind == MarkKind.SNAPSHOT_DONE and snap is not None:
            snap["done"] = True
        elif kind in (MarkKind.SCHEMA, MarkKind.SNAPSHOT_TABLE_START):
            if history is None:
                history = SchemaHistory.from_json(new.get("schemas") or {})
            table = TableId.parse(item.detail["table"])
            assert isinstance(item.position, MySqlPosition)
            history.add_entry(item.position, schema_from_json(table, item.detail["schema"]))
        elif kind == MarkKind.STREAM_START:
            new["stream_start"] = item.position.to_json()
        elif kind == MarkKind.IDENTITY:
            new["server"] = dict(item.detail)
        elif kind == MarkKind.POSITION_LOST:  # going on from the current position (cdcd/capture/recovery.py)
            fold_position_lost(new, item)
            if snap is not None and not snap.get("done"):  # the tables it had left are re-read incrementally
                snap["done"] = True
        elif kind in INCREMENTAL_KINDS:
            fold_incremental(new, item)
    _flush_keys(tables, last)
    # content seqs from here on, unless the checkpoint is still inside a transaction an earlier version numbered
    if new.get("seqs") == SEQS or not state.get("inside_tx") or \
            any(type(i) is Mark and i.kind == MarkKind.COMMIT for i in items):
        new["seqs"] = SEQS
    # whether the checkpoint's position is inside a transaction: resuming by GTID on another server re-sends
    # a partly delivered transaction, whose delivered items must then be skipped. The last streamed item says;
    # an incremental snapshot's rows and Marks placed inside a transaction change nothing (none: as before).
    for tail in reversed(items):
        if (isinstance(tail, ChangeEvent | RowBlock) and tail.snapshot) or \
                (type(tail) is Mark and tail.kind in _NOT_STREAM):
            continue
        if ((type(tail) is ChangeEvent or type(tail) is ChangeBlock) and not tail.snapshot) or \
                (type(tail) is Mark and tail.kind in (MarkKind.SCHEMA, MarkKind.DDL)):
            new["inside_tx"] = True
        else:
            new.pop("inside_tx", None)
        break
    if snap is not None:
        snap["tables"] = tables
        new["snapshot"] = snap
    if history is not None:
        new["schemas"] = history.to_json()
    return new


def _flush_keys(tables: dict[str, dict[str, Any]], last: dict[str, ChangeEvent | RowBlock]) -> None:
    for name, ev in last.items():
        entry = tables.setdefault(name, {"last_key": None, "done": False})
        key = ev.key if isinstance(ev, ChangeEvent) else ev.last_key
        texts = ev.last_key_text() if isinstance(ev, RowBlock) else None
        if key is not None and texts:  # the server's text where the landed value is NULL (zero dates)
            key = tuple(v if t is None else t for v, t in zip(key, texts, strict=True))
        entry["last_key"] = key_to_json(key) if ev.schema.key and key is not None else None
    last.clear()
