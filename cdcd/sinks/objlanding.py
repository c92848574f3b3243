"""The landing writer for a zone on object storage (``landing.path = "s3://bucket/prefix"``).

No rename there, so the order is: each data file PUT under its final name, unique to this attempt
(``data/<seq>-<n>-<attempt>.parquet``); then the manifest, one conditional PUT (``If-None-Match: *``), which
makes the batch visible; only then is the batch acked. A failure before the manifest leaves data files no
manifest names (orphans): readers never see them (they go by manifests), the failed attempt deletes them when
it can, and ``prepare`` (the daemon's start) deletes any that are left. A refused conditional PUT means the
seq is taken: by this very run when an earlier attempt's PUT went through but its answer was lost (then the
batch is landed), otherwise by another writer (fatal: two daemons on one zone).
"""

from __future__ import annotations

import contextlib
import uuid

import pyarrow as pa

from cdcd.errors import SinkError, SinkFatal
from cdcd.landing import layout
from cdcd.landing.layout import CONSUMED, DATA, MANIFESTS
from cdcd.landing.manifest import FileEntry, Manifest, TableEntry, batch_manifest, canonical, file_entry, parse_manifest
from cdcd.landing.objstore import ObjectStore
from cdcd.landing.zone import ensure_object_zone_id
from cdcd.runtime.interfaces import Batch
from cdcd.sinks.batchfiles import _group, _parquet_bytes, _positions, covered, position_lost, schema_changes


class ObjectLandingWriter:
    """``LandingWriter``'s counterpart on object storage (runs in a worker thread, like it)."""

    def __init__(self, store: ObjectStore, run_id: str, source_kind: str = "") -> None:
        self.store = store
        self.run_id = run_id
        self.source_kind = source_kind
        self.zone_id = ""  # set by prepare()

    def prepare(self) -> int:
        """The zone's identity; orphaned data files and stray markers removed; the highest landed seq."""
        self.zone_id = ensure_object_zone_id(self.store)
        landed = {s for s in (layout.manifest_seq(e.name) for e in self.store.listdir(MANIFESTS)) if s is not None}
        orphans = [f"{DATA}/{e.name}" for e in self.store.listdir(DATA)
                   if layout.data_seq(e.name) is not None and layout.data_seq(e.name) not in landed]
        markers = [s for s in (layout.consumed_seq(e.name) for e in self.store.listdir(CONSUMED)) if s is not None]
        # a marker without its manifest: retention was interrupted after removing the manifest
        stray = [f"{CONSUMED}/{layout.consumed_name(s)}" for s in markers if s not in landed]
        self.store.delete([*orphans, *stray])
        return max([*landed, *markers], default=0)

    def land(self, batch: Batch) -> Manifest:
        attempt = uuid.uuid4().hex[:12]
        written: list[str] = []
        try:
            manifest = self._stage(batch, attempt, written)
        except SinkError:
            self._discard(written)
            raise
        # From here the files stay on failure: the manifest PUT may have gone through with its answer lost, and
        # then they are the batch (the retry finds the manifest, _taken); if not, prepare() removes them.
        if not self.store.create(f"{MANIFESTS}/{layout.manifest_name(batch.seq)}", canonical(manifest.to_json())):
            try:
                manifest = self._taken(batch.seq)
            except SinkFatal:
                self._discard(written)  # another writer's manifest names other files: these are nobody's
                raise
            self._discard(written)  # this attempt's files: an earlier attempt's manifest is the batch
        pa.default_memory_pool().release_unused()
        return manifest

    def _stage(self, batch: Batch, attempt: str, written: list[str]) -> Manifest:
        files: list[FileEntry] = []
        positions: set[str] = set()
        rows = 0
        for n, group in enumerate(_group(batch)):
            table = group.to_table(batch.seq)
            blob = _parquet_bytes(table)
            name = layout.data_name(batch.seq, n, attempt)
            written.append(f"{DATA}/{name}")
            self.store.put(f"{DATA}/{name}", blob)
            found = _positions(table)
            positions |= found
            rows += group.rows
            files.append(file_entry(name, TableEntry.of(group.schema), table.num_rows, blob, found))
        return batch_manifest(batch.seq, self.run_id, self.zone_id, self.source_kind, rows, positions, files,
                              covered(batch), schema_changes(batch), position_lost(batch))

    def _taken(self, seq: int) -> Manifest:
        """The manifest already at ``seq``: ours (an earlier attempt whose answer was lost) or another writer's."""
        name = f"{MANIFESTS}/{layout.manifest_name(seq)}"
        where = f"{self.store.location.url}/{name}"
        blob = self.store.get(name)
        if blob is None:  # refused as existing, then gone: ask again
            raise SinkError(f"landing zone {self.store.location.url}: {name} was refused as existing but cannot be "
                            f"read; batch {seq} is retried")
        manifest = Manifest.from_json(parse_manifest(blob, where))
        if manifest.run_id != self.run_id:
            raise SinkFatal(
                f"landing zone {self.store.location.url}: batch {seq} was published by another writer (run "
                f"{manifest.run_id}) while this daemon (run {self.run_id}) landed it: two daemons write to one "
                "landing zone. Stop one; each daemon needs its own landing.path")
        return manifest

    def _discard(self, names: list[str]) -> None:
        # Best effort: the store may be what failed; prepare() at the next start removes what is left.
        with contextlib.suppress(SinkError):
            self.store.delete(names)

    def consumed(self, seqs: set[int]) -> set[int]:
        markers = {layout.consumed_seq(e.name) for e in self.store.listdir(CONSUMED)}
        return {s for s in seqs if s in markers}

    def expire(self, upto: int, retention_s: float, now: float) -> list[int]:
        """Remove consumed batches with seq <= ``upto`` whose marker is older than the retention: the manifest
        first (the batch is invisible), then its data files, then the marker."""
        removed = sorted(
            seq for seq, entry in ((layout.consumed_seq(e.name), e) for e in self.store.listdir(CONSUMED))
            if seq is not None and seq <= upto and now - entry.modified >= retention_s)
        if not removed:
            return []
        gone = set(removed)
        self.store.delete([f"{MANIFESTS}/{layout.manifest_name(s)}" for s in removed])
        self.store.delete([f"{DATA}/{e.name}" for e in self.store.listdir(DATA) if layout.data_seq(e.name) in gone])
        self.store.delete([f"{CONSUMED}/{layout.consumed_name(s)}" for s in removed])
        return removed
