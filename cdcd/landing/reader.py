"""Reading a landing zone: what a consumer needs (the Spark job, ``cdcd verify``'s tests, the tools).

Batches are listed from ``manifests/`` only (docs/landing-format.md): a batch is
visible once its manifest is. ``mark_consumed`` is the one thing a consumer writes.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from cdcd.errors import SinkFatal
from cdcd.events import TableId
from cdcd.fsutil import write_durably
from cdcd.landing import layout
from cdcd.landing.layout import CONSUMED, MANIFESTS
from cdcd.landing.manifest import FileEntry, Manifest, TableEntry, read


@dataclass(slots=True)
class LandedFile:
    """One landed data file, by path: what a consumer that reads the files itself (Spark) needs."""

    seq: int
    path: str
    entry: FileEntry  # the manifest's file entry


def table_files(landing: Path, segment: Sequence[tuple[int, Manifest]]) -> dict[tuple[str, str], list[LandedFile]]:
    """The landed files of a run of batches (seq, manifest), per (schema, table), in batch order."""
    out: dict[tuple[str, str], list[LandedFile]] = {}
    for seq, manifest in segment:
        for entry in manifest.files:
            name = (entry.table.schema, entry.table.name)
            out.setdefault(name, []).append(LandedFile(seq, str(landing / entry.path), entry))
    return out


@dataclass(frozen=True, slots=True)
class Covered:
    """What a run of batches says about one table's completed re-snapshots (docs/landing-format.md)."""

    below: str  # the mirror's rows of the table with a lower ``_cdc_pos`` are gone from the source
    seq: int  # the last batch that holds such a record


def covered_tables(segment: Sequence[tuple[int, Manifest]]) -> dict[tuple[str, str], Covered]:
    """The covered records of a run of batches (seq, manifest) per (schema, table).

    Several records of one table merge into the highest ``below``: applied after the run's
    events, ``_cdc_pos < b1`` then ``_cdc_pos < b2`` removes what ``_cdc_pos < max(b1, b2)`` does.
    """
    out: dict[tuple[str, str], Covered] = {}
    for seq, manifest in segment:
        for c in manifest.covered:
            had = out.get((c.schema, c.name))
            out[(c.schema, c.name)] = Covered(max(c.below, had.below) if had else c.below, seq)
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
    return layout.seqs_in(Path(path) / MANIFESTS)


def read_manifest(path: Path | str, seq: int) -> Manifest:
    """The checked manifest of batch ``seq``."""
    return read(Path(path) / MANIFESTS / layout.manifest_name(seq))


def read_batch(path: Path | str, seq: int, verify: bool = True) -> LandedBatch:
    root = Path(path)
    manifest = read_manifest(root, seq)
    batch = LandedBatch(seq, manifest, consumed=is_consumed(root, seq))
    for entry in manifest.files:
        blob = (root / entry.path).read_bytes()
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
    consumed = Path(path) / CONSUMED
    consumed.mkdir(parents=True, exist_ok=True)
    write_durably(consumed / layout.consumed_name(seq), f"{time.time():.6f}\n".encode())


def is_consumed(path: Path | str, seq: int) -> bool:
    return (Path(path) / CONSUMED / layout.consumed_name(seq)).exists()


def consumed_seqs(path: Path | str) -> list[int]:
    d = Path(path) / CONSUMED
    if not d.is_dir():
        return []
    return sorted(s for s in (layout.consumed_seq(e.name) for e in os.scandir(d)) if s is not None)
