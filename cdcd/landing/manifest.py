"""Batch manifests: what a landed batch holds, written last to make it visible.

A manifest is a typed value (``Manifest``, its ``FileEntry`` per data file with the file's ``TableEntry``, its
``CoveredRecord`` per completed re-snapshot, its ``SchemaChangeRecord`` per schema change); the sink builds one
(``file_entry``, ``batch_manifest``) and writes ``Manifest.to_json()`` (sealed with its checksum), readers get one
back from ``read``. The fields and their JSON are docs/landing-format.md's ("Manifest"); ``load_manifest`` checks
the document as it is on disk.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pyarrow as pa

from cdcd.errors import SinkFatal
from cdcd.events import Column, TableSchema
from cdcd.landing.layout import DATA, FORMAT_NAME, FORMAT_VERSION, RANGED_VERSION, READABLE_VERSIONS
from cdcd.landing.values import value_from_json, value_to_json


def canonical(doc: dict[str, Any]) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def seal(doc: dict[str, Any]) -> dict[str, Any]:
    """Add the checksum over every other field."""
    body = {k: v for k, v in doc.items() if k != "checksum"}
    return {**body, "checksum": "sha256:" + hashlib.sha256(canonical(body)).hexdigest()}


@dataclass(frozen=True, slots=True)
class ColumnEntry:
    """One column of a file entry's table: ``{name, arrow_type, source_type, nullable}``, from version 4 with
    ``id`` (the column's identity in its table) and ``fill`` (``{"value": ...}``: the value the rows the table
    had when the column was added hold in it, ``cdcd.landing.values``) where the source knows them."""

    name: str
    arrow_type: str
    source_type: str
    nullable: bool
    id: int | None = None
    fill: dict[str, Any] | None = None  # {"value": <JSON of the column's type>}

    @classmethod
    def of(cls, column: Column) -> ColumnEntry:
        fill = None if column.fill is None else {"value": value_to_json(column.fill.value, column.type)}
        return cls(column.name, str(column.type), column.source_type, column.nullable, column.id, fill)

    def fill_value(self, kind: pa.DataType) -> Any:
        """The fill as a Python value of the column's Arrow type ``kind`` (the data file's)."""
        return None if self.fill is None else value_from_json(self.fill["value"], kind)

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"name": self.name, "arrow_type": self.arrow_type, "source_type": self.source_type,
                               "nullable": self.nullable}
        if self.id is not None:
            doc["id"] = self.id
        if self.fill is not None:
            doc["fill"] = self.fill
        return doc

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> ColumnEntry:
        return cls(doc["name"], doc["arrow_type"], doc["source_type"], doc["nullable"], doc.get("id"),
                   doc.get("fill"))


@dataclass(frozen=True, slots=True)
class TableEntry:
    """A file entry's ``table``: the table's schema for the file's rows."""

    schema: str  # the database name for MySQL/MariaDB
    name: str
    version: int
    key: tuple[str, ...]  # empty: no key
    columns: tuple[ColumnEntry, ...]

    @property
    def column_names(self) -> list[str]:
        return [c.name for c in self.columns]

    @classmethod
    def of(cls, schema: TableSchema) -> TableEntry:
        """The manifest's description of a table schema."""
        return cls(schema.table.schema, schema.table.name, schema.version, tuple(schema.key),
                   tuple(ColumnEntry.of(c) for c in schema.columns))

    def to_json(self) -> dict[str, Any]:
        return {"schema": self.schema, "name": self.name, "version": self.version, "key": list(self.key),
                "columns": [c.to_json() for c in self.columns]}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> TableEntry:
        return cls(doc["schema"], doc["name"], doc["version"], tuple(doc["key"]),
                   tuple(ColumnEntry.from_json(c) for c in doc["columns"]))


@dataclass(frozen=True, slots=True)
class FileEntry:
    """One data file of a batch."""

    path: str  # relative to the landing zone: data/<seq>-<n>.parquet
    table: TableEntry
    rows: int
    bytes: int
    sha256: str
    first_position: str
    last_position: str

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "table": self.table.to_json(), "rows": self.rows, "bytes": self.bytes,
                "sha256": self.sha256, "first_position": self.first_position, "last_position": self.last_position}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> FileEntry:
        return cls(doc["path"], TableEntry.from_json(doc["table"]), doc["rows"], doc["bytes"], doc["sha256"],
                   doc["first_position"], doc["last_position"])


@dataclass(frozen=True, slots=True)
class CoveredRecord:
    """A completed re-snapshot: the table's rows below ``below`` are gone from the source; with ``range`` (a
    ``cdcd.landing.keyrange.KeyRange`` as JSON, from version 5) only those whose key is in that range."""

    schema: str
    name: str
    below: str  # a _cdc_pos
    range: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"table": {"schema": self.schema, "name": self.name}, "below": self.below}
        if self.range is not None:
            doc["range"] = self.range
        return doc

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> CoveredRecord:
        return cls(doc["table"]["schema"], doc["table"]["name"], doc["below"], doc.get("range"))


@dataclass(frozen=True, slots=True)
class PositionLostRecord:
    """The source position was lost (slot gone, binlog purged or reset): the changes between ``from_position`` (the
    last position captured, None when unknown) and ``to_position`` (where capture went on) are not in the landing
    zone; whole-table re-snapshots follow (their covered records reconcile the mirror). ``lost`` says what the source
    reported."""

    lost: str
    from_position: str | None  # a _cdc_pos
    to_position: str  # a _cdc_pos

    def to_json(self) -> dict[str, Any]:
        return {"lost": self.lost, "from": self.from_position, "to": self.to_position}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> PositionLostRecord:
        return cls(doc["lost"], doc.get("from"), doc["to"])


@dataclass(frozen=True, slots=True)
class SchemaChangeRecord:
    """A table's schema changed at ``position``: its new version and columns, the DDL text where the source has it
    (MySQL/MariaDB; None for PostgreSQL, whose stream carries no statement)."""

    schema: str
    name: str
    version: int
    position: str  # a _cdc_pos
    statement: str | None
    columns: tuple[ColumnEntry, ...]

    @classmethod
    def of(cls, new: TableSchema, position: str, statement: str | None) -> SchemaChangeRecord:
        return cls(new.table.schema, new.table.name, new.version, position, statement,
                   tuple(ColumnEntry.of(c) for c in new.columns))

    def to_json(self) -> dict[str, Any]:
        return {"table": {"schema": self.schema, "name": self.name}, "version": self.version,
                "position": self.position, "statement": self.statement, "columns": [c.to_json() for c in self.columns]}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> SchemaChangeRecord:
        return cls(doc["table"]["schema"], doc["table"]["name"], doc["version"], doc["position"], doc["statement"],
                   tuple(ColumnEntry.from_json(c) for c in doc["columns"]))


@dataclass(frozen=True, slots=True)
class Manifest:
    """A batch's manifest. ``zone_id`` is None in version 1 manifests; ``covered`` is empty before version 3,
    ``schema_changes`` before version 4; ``position_lost`` is written only when not empty (a version 4 field that
    readers without it ignore)."""

    batch_seq: int
    run_id: str
    zone_id: str | None
    source_kind: str
    created_at: str
    event_count: int
    first_position: str | None  # None: no rows
    last_position: str | None
    files: tuple[FileEntry, ...]
    covered: tuple[CoveredRecord, ...] = ()
    version: int = FORMAT_VERSION
    schema_changes: tuple[SchemaChangeRecord, ...] = ()
    position_lost: tuple[PositionLostRecord, ...] = ()

    def __post_init__(self) -> None:
        if self.version < RANGED_VERSION and any(c.range is not None for c in self.covered):
            object.__setattr__(self, "version", RANGED_VERSION)  # older readers must refuse it (layout.py)

    def to_json(self) -> dict[str, Any]:
        """The sealed document (the JSON object of docs/landing-format.md, with its checksum)."""
        doc: dict[str, Any] = {
            "format": FORMAT_NAME,
            "version": self.version,
            "batch_seq": self.batch_seq,
            "run_id": self.run_id,
            "source_kind": self.source_kind,
            "created_at": self.created_at,
            "event_count": self.event_count,
            "first_position": self.first_position,
            "last_position": self.last_position,
            "files": [f.to_json() for f in self.files],
        }
        if self.version >= 2:
            doc["zone_id"] = self.zone_id
        if self.version >= 3:
            doc["covered"] = [c.to_json() for c in self.covered]
        if self.version >= 4:
            doc["schema_changes"] = [c.to_json() for c in self.schema_changes]
        if self.position_lost:
            doc["position_lost"] = [r.to_json() for r in self.position_lost]
        return seal(doc)

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Manifest:
        return cls(doc["batch_seq"], doc["run_id"], doc.get("zone_id"), doc["source_kind"], doc["created_at"],
                   doc["event_count"], doc["first_position"], doc["last_position"],
                   tuple(FileEntry.from_json(f) for f in doc["files"]),
                   tuple(CoveredRecord.from_json(c) for c in doc.get("covered", ())), doc["version"],
                   tuple(SchemaChangeRecord.from_json(c) for c in doc.get("schema_changes", ())),
                   tuple(PositionLostRecord.from_json(r) for r in doc.get("position_lost", ())))


def load_manifest(path: Path) -> dict[str, Any]:
    """Read and check a manifest's document; a damaged one is fatal (the landing zone was tampered with)."""
    try:
        blob = path.read_bytes()
    except OSError as exc:
        raise SinkFatal(f"landing manifest {path} cannot be read: {exc}; restore it or remove the batch") from exc
    return parse_manifest(blob, str(path))


def parse_manifest(blob: bytes, path: str) -> dict[str, Any]:
    """Check a manifest's document read from ``path`` (a file or an object's URL)."""
    try:
        doc = json.loads(blob)
    except ValueError as exc:
        raise SinkFatal(f"landing manifest {path} cannot be read: {exc}; restore it or remove the batch") from exc
    if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
        raise SinkFatal(f"landing manifest {path} is not a {FORMAT_NAME} manifest")
    if doc.get("version") not in READABLE_VERSIONS:
        raise SinkFatal(
            f"landing manifest {path} has format version {doc.get('version')!r}; this cdcd reads versions "
            f"{', '.join(map(str, READABLE_VERSIONS))} (writes {FORMAT_VERSION}): upgrade cdcd or drain the "
            "landing zone with the matching version"
        )
    if seal(doc)["checksum"] != doc.get("checksum"):
        raise SinkFatal(f"landing manifest {path}: checksum mismatch; the file was changed after landing")
    return doc


def read(path: Path) -> Manifest:
    """Read and check a manifest (``load_manifest``)."""
    return Manifest.from_json(load_manifest(path))


def file_entry(name: str, table: TableEntry, rows: int, blob: bytes, positions: set[str]) -> FileEntry:
    """A manifest's entry for the data file ``data/<name>`` holding ``blob``."""
    return FileEntry(f"{DATA}/{name}", table, rows, len(blob), hashlib.sha256(blob).hexdigest(), min(positions),
                     max(positions))


def covered_records(manifest: Manifest) -> list[tuple[str, str, str]]:
    """The (schema, table, below) records of a manifest; none before version 3."""
    return [(c.schema, c.name, c.below) for c in manifest.covered]


def batch_manifest(seq: int, run_id: str, zone_id: str, source_kind: str, rows: int, positions: set[str],
                   files: Iterable[FileEntry], covered: Iterable[CoveredRecord] = (),
                   schema_changes: Iterable[SchemaChangeRecord] = (),
                   position_lost: Iterable[PositionLostRecord] = ()) -> Manifest:
    """The manifest that publishes batch ``seq``'s data files (and its re-snapshot, schema-change and lost-position
    records)."""
    return Manifest(seq, run_id, zone_id, source_kind, datetime.now(UTC).isoformat(), rows,
                    min(positions) if positions else None, max(positions) if positions else None,
                    tuple(files), tuple(covered), schema_changes=tuple(schema_changes),
                    position_lost=tuple(position_lost))
