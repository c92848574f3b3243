"""Reading a landing zone: what a consumer needs (the Spark job, ``cdcd verify``'s tests, the tools).

Batches are listed from ``manifests/`` only (docs/landing-format.md): a batch is
visible once its manifest is. ``mark_consumed`` is the one thing a consumer writes.

A zone on object storage (``s3://bucket/prefix``) is read the same way; the store is reached with boto3's
usual settings (AWS_ENDPOINT_URL, AWS_REGION, the credentials chain), or those ``use_store`` gives it.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from cdcd.errors import SinkFatal
from cdcd.events import TableId
from cdcd.fsutil import write_durably
from cdcd.landing import layout
from cdcd.landing.keyrange import KeyRange
from cdcd.landing.layout import CONSUMED, MANIFESTS
from cdcd.landing.manifest import FileEntry, Manifest, TableEntry, parse_manifest, read
from cdcd.landing.objstore import Location, ObjectStore, Settings, is_object_url

_stores: dict[str, ObjectStore] = {}


def use_store(url: str, settings: Settings) -> ObjectStore:
    """Read the zone at ``url`` with these settings (an endpoint, keys) instead of boto3's defaults."""
    location = Location.parse(url)
    store = _stores[location.url] = ObjectStore(location, settings)
    return store


def store_of(path: Path | str) -> ObjectStore | None:
    """The object store holding the zone at ``path``; None for a zone on a file system."""
    if not is_object_url(path):
        return None
    location = Location.parse(path)
    store = _stores.get(location.url)
    if store is None:
        store = _stores[location.url] = ObjectStore(location)
    return store


@dataclass(slots=True)
class LandedFile:
    """One landed data file, by path: what a consumer that reads the files itself (Spark) needs."""

    seq: int
    path: str
    entry: FileEntry  # the manifest's file entry


def table_files(landing: Path, segment: Sequence[tuple[int, Manifest]]) -> dict[tuple[str, str], list[LandedFile]]:
    """The landed files of a run of batches (seq, manifest), per (schema, table), in batch order."""
    out: dict[tuple[str, str], list[LandedFile]] = {}
    base = Location.parse(landing).url if is_object_url(landing) else None  # s3://bucket/prefix
    for seq, manifest in segment:
        for entry in manifest.files:
            name = (entry.table.schema, entry.table.name)
            where = f"{base}/{entry.path}" if base else str(landing / entry.path)
            out.setdefault(name, []).append(LandedFile(seq, where, entry))
    return out


@dataclass(frozen=True, slots=True)
class Covered:
    """What a run of batches says about one table's completed re-snapshots (docs/landing-format.md)."""

    below: str | None  # the mirror's rows of the table with a lower ``_cdc_pos`` are gone from the source
    seq: int  # the last batch that holds such a record
    # ranged records (``cdcd snapshot --where``): (below, the Spark SQL condition on the key), in batch order
    ranges: tuple[tuple[str, str], ...] = ()

    def gone(self, pos_column: str, literal: Callable[[str], str]) -> str:
        """The condition on the mirror's rows the records remove (Spark SQL)."""
        parts = [f"{pos_column} < {literal(self.below)}"] if self.below is not None else []
        ranged = self.ranged_gone(pos_column, literal)
        return " OR ".join([*parts, *([ranged] if ranged else [])])

    def ranged_gone(self, pos_column: str, literal: Callable[[str], str]) -> str | None:
        """The ranged records' part of ``gone``; None when there is none."""
        parts = [f"({pos_column} < {literal(b)} AND {cond})" for b, cond in self.ranges
                 if self.below is None or b > self.below]  # a whole-table record at or past it removes those
        return " OR ".join(parts) or None


def covered_tables(segment: Sequence[tuple[int, Manifest]]) -> dict[tuple[str, str], Covered]:
    """The covered records of a run of batches (seq, manifest) per (schema, table).

    Several whole-table records of one table merge into the highest ``below``: applied after the run's
    events, ``_cdc_pos < b1`` then ``_cdc_pos < b2`` removes what ``_cdc_pos < max(b1, b2)`` does. Ranged
    records are kept each with its own bound and condition.
    """
    out: dict[tuple[str, str], Covered] = {}
    for seq, manifest in segment:
        for c in manifest.covered:
            had = out.get((c.schema, c.name)) or Covered(None, seq)
            if c.range is None:
                below = c.below if had.below is None else max(c.below, had.below)
                out[(c.schema, c.name)] = Covered(below, seq, had.ranges)
            else:
                cond = KeyRange.from_json(c.range).to_spark_sql()
                out[(c.schema, c.name)] = Covered(had.below, seq, (*had.ranges, (c.below, cond)))
    return out


@dataclass(slots=True)
class BatchFile:
    """One landed data file, read into memory."""

    table: TableId
    schema: TableEntry
    data: pa.Table


@dataclass(slots=True)
class LandedBatch:
    seq: int
    manifest: Manifest
    files: list[BatchFile] = field(default_factory=list)
    consumed: bool = False

    @property
    def tables(self) -> dict[TableId, pa.Table]:
        """One Arrow table per source table (files of several schema versions are unified)."""
        out: dict[TableId, list[pa.Table]] = {}
        for f in self.files:
            out.setdefault(f.table, []).append(f.data)
        return {t: pa.concat_tables(parts, promote_options="permissive") for t, parts in out.items()}


def landed_seqs(path: Path | str) -> list[int]:
    """Seqs of the visible batches, ascending (they may have gaps)."""
    store = store_of(path)
    if store is not None:
        return sorted(s for s in (layout.manifest_seq(e.name) for e in store.listdir(MANIFESTS)) if s is not None)
    return layout.seqs_in(Path(path) / MANIFESTS)


def read_manifest(path: Path | str, seq: int) -> Manifest:
    """The checked manifest of batch ``seq``."""
    store = store_of(path)
    if store is not None:
        name = f"{MANIFESTS}/{layout.manifest_name(seq)}"
        blob = store.get(name)
        if blob is None:
            raise SinkFatal(f"landing manifest {store.location.url}/{name} does not exist; batch {seq} is not landed")
        return Manifest.from_json(parse_manifest(blob, f"{store.location.url}/{name}"))
    return read(Path(path) / MANIFESTS / layout.manifest_name(seq))


def _data(path: Path | str, entry: FileEntry) -> bytes:
    store = store_of(path)
    if store is None:
        return (Path(path) / entry.path).read_bytes()
    blob = store.get(entry.path)
    if blob is None:
        raise SinkFatal(f"landing zone {store.location.url}: {entry.path}, named by a manifest, is missing; restore "
                        "it or remove the batch")
    return blob


def read_batch(path: Path | str, seq: int, verify: bool = True) -> LandedBatch:
    root = path if is_object_url(path) else Path(path)
    manifest = read_manifest(root, seq)
    batch = LandedBatch(seq, manifest, consumed=is_consumed(root, seq))
    for entry in manifest.files:
        blob = _data(root, entry)
        if verify and hashlib.sha256(blob).hexdigest() != entry.sha256:
            raise SinkFatal(f"landing zone {root}: {entry.path} does not match its checksum in batch {seq}")
        t = entry.table
        batch.files.append(BatchFile(TableId(t.schema, t.name), t, pq.read_table(pa.BufferReader(blob))))
    return batch


def read_batches(path: Path | str, verify: bool = True) -> list[LandedBatch]:
    """Every visible batch in seq order, with its manifest and data."""
    return [read_batch(path, seq, verify) for seq in landed_seqs(path)]


def mark_consumed(path: Path | str, seq: int) -> None:
    """Record durably that the consumer has committed batch ``seq`` into its target."""
    store = store_of(path)
    if store is not None:
        store.put(f"{CONSUMED}/{layout.consumed_name(seq)}", f"{time.time():.6f}\n".encode())
        return
    consumed = Path(path) / CONSUMED
    consumed.mkdir(parents=True, exist_ok=True)
    write_durably(consumed / layout.consumed_name(seq), f"{time.time():.6f}\n".encode())


def is_consumed(path: Path | str, seq: int) -> bool:
    store = store_of(path)
    if store is not None:
        return store.get(f"{CONSUMED}/{layout.consumed_name(seq)}") is not None
    return (Path(path) / CONSUMED / layout.consumed_name(seq)).exists()


def consumed_seqs(path: Path | str) -> list[int]:
    store = store_of(path)
    if store is not None:
        return sorted(s for s in (layout.consumed_seq(e.name) for e in store.listdir(CONSUMED)) if s is not None)
    d = Path(path) / CONSUMED
    if not d.is_dir():
        return []
    return sorted(s for s in (layout.consumed_seq(e.name) for e in os.scandir(d)) if s is not None)
