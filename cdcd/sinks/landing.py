"""The landing zone sink: every batch as Parquet files plus a manifest, atomically.

Write order: the data files and the manifest under temporary names, all
fsynced together (in parallel); rename the data files; fsync ``data/``;
rename the manifest (the batch is visible); fsync ``manifests/`` (then it is
acked). A reader lists ``manifests/`` only and skips temp names, and the
manifest is renamed only once the data files' names are durable, so a crash
at any point leaves the whole batch or nothing visible; ``open()`` removes
the temp files and orphaned data files such a crash leaves.

Acks: ``landed`` acks right after the manifest is durable; ``consumed`` acks
when the consumer's marker ``consumed/<seq>`` appears. Retention removes
batches that are consumed, checkpointed and older than ``retention_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Literal

import pyarrow as pa
import structlog

from cdcd.errors import SinkError, SinkFatal
from cdcd.fsutil import fsync_dir, fsync_files, storage_fix, temp_name, write_temp
from cdcd.landing import layout
from cdcd.landing.layout import CONSUMED, DATA, MANIFESTS
from cdcd.landing.manifest import (
    FileEntry,
    Manifest,
    TableEntry,
    batch_manifest,
    canonical,
    file_entry,
)
from cdcd.landing.objstore import Location, ObjectStore, Settings, is_object_url
from cdcd.landing.zone import ensure_zone_id
from cdcd.retry import Backoff
from cdcd.runtime.interfaces import Batch, Sink
from cdcd.sinks.batchfiles import (
    _group,
    _parquet_bytes,
    _positions,
    covered,
    position_lost,
    schema_changes,
)
from cdcd.sinks.objlanding import ObjectLandingWriter

AckMode = Literal["landed", "consumed"]

_log = structlog.get_logger("cdcd.sinks")

#: How often the consumed-mode watcher looks for markers.
POLL_S = 0.1


class LandingWriter:
    """The synchronous, durable half of the sink (runs in a worker thread)."""

    def __init__(self, path: Path, run_id: str, source_kind: str = "") -> None:
        self.path = path
        self.run_id = run_id
        self.source_kind = source_kind
        self.zone_id = ""  # set by prepare()

    @property
    def dirs(self) -> tuple[Path, Path, Path]:
        return self.path / MANIFESTS, self.path / DATA, self.path / CONSUMED

    def prepare(self) -> int:
        """Create the layout, remove crash leftovers, return the highest landed seq."""
        for d in (self.path, *self.dirs):
            d.mkdir(parents=True, exist_ok=True)
        manifests, data, consumed = self.dirs
        for d in self.dirs:
            for entry in os.scandir(d):
                if layout.is_temp(entry.name):
                    os.unlink(entry.path)
        self.zone_id = ensure_zone_id(self.path)
        landed = set(layout.seqs_in(manifests))
        for entry in os.scandir(data):
            seq = layout.data_seq(entry.name)
            if seq is not None and seq not in landed:  # renamed before the crash, manifest never followed
                os.unlink(entry.path)
        markers = [s for s in (layout.consumed_seq(e.name) for e in os.scandir(consumed)) if s is not None]
        for seq in markers:
            if seq not in landed:  # retention was interrupted after removing the manifest
                os.unlink(consumed / layout.consumed_name(seq))
        for d in (self.path, *self.dirs):
            fsync_dir(d)
        return max([*landed, *markers], default=0)

    def stage(self, batch: Batch) -> Manifest:
        """Make the batch's data files durable and in place, its manifest durable under its temp name.

        Returns the manifest that ``publish`` renames into place. The data files and the manifest are
        written first and fsynced together (in parallel), then the data files are renamed and ``data/``
        is fsynced: the manifest's own fsync is off the path to visibility, and nothing is visible yet
        (readers list ``manifests/`` and skip temp names).
        """
        manifests, data, _ = self.dirs
        files: list[FileEntry] = []
        positions: set[str] = set()
        temps: list[tuple[Path, Path]] = []  # (temp, final) of each data file
        rows = 0
        for n, group in enumerate(_group(batch)):
            table = group.to_table(batch.seq)
            blob = _parquet_bytes(table)
            name = layout.data_name(batch.seq, n)
            temps.append((write_temp(data / name, blob), data / name))
            found = _positions(table)
            positions |= found
            rows += group.rows
            files.append(file_entry(name, TableEntry.of(group.schema), table.num_rows, blob, found))
        manifest = batch_manifest(batch.seq, self.run_id, self.zone_id, self.source_kind, rows, positions, files,
                                  covered(batch), schema_changes(batch), position_lost(batch))
        final = manifests / layout.manifest_name(batch.seq)
        manifest_temp = write_temp(final, canonical(manifest.to_json()))
        fsync_files([*(t for t, _ in temps), manifest_temp])
        for temp, path in temps:
            os.replace(temp, path)
        fsync_dir(data)  # the data files' names are durable before the manifest can name them
        return manifest

    def publish(self, manifest: Manifest) -> None:
        """Rename the staged manifest into place (the batch becomes visible) and make the rename durable."""
        manifests, _, _ = self.dirs
        final = manifests / layout.manifest_name(manifest.batch_seq)
        os.replace(temp_name(final), final)
        fsync_dir(manifests)

    def land(self, batch: Batch) -> Manifest:
        try:
            manifest = self.stage(batch)
            self.publish(manifest)
        except OSError:
            self.discard(batch.seq)
            raise
        # Arrow's allocator keeps freed memory per thread for reuse; hand it back so that RSS follows
        # the data in flight rather than the high-water mark of every thread that ever parsed a chunk.
        pa.default_memory_pool().release_unused()
        return manifest

    def discard(self, seq: int) -> None:
        """Remove what a failed landing of batch ``seq`` left: its temp files, and its data files
        unless its manifest made it visible. Frees the space a retry needs (disk full)."""
        manifests, data, _ = self.dirs
        visible = (manifests / layout.manifest_name(seq)).exists()
        prefix = f".{seq:020d}"
        with contextlib.suppress(OSError):  # best effort: the retry and open() remove what is left
            for d in (data, manifests):
                for entry in os.scandir(d):
                    temp = layout.is_temp(entry.name) and entry.name.startswith(prefix)
                    orphan = not visible and d is data and layout.data_seq(entry.name) == seq
                    if temp or orphan:
                        os.unlink(entry.path)

    def consumed(self, seqs: set[int]) -> set[int]:
        _, _, consumed = self.dirs
        return {s for s in seqs if (consumed / layout.consumed_name(s)).exists()}

    def expire(self, upto: int, retention_s: float, now: float) -> list[int]:
        """Remove consumed batches with seq <= ``upto`` whose marker is older than the retention.

        Goes by the consumer's markers, not the manifests: with no consumer there is nothing to look at, and
        a zone holding a day of unconsumed batches is not listed at every checkpoint.
        """
        manifests, data, consumed = self.dirs
        removed = []
        with os.scandir(consumed) as entries:
            for entry in entries:
                seq = layout.consumed_seq(entry.name)
                if seq is None or seq > upto:
                    continue
                try:
                    consumed_at = entry.stat().st_mtime
                except FileNotFoundError:
                    continue
                if now - consumed_at >= retention_s:
                    removed.append(seq)
        removed.sort()
        for seq in removed:
            (manifests / layout.manifest_name(seq)).unlink(missing_ok=True)  # invisible first, then the rest
        if removed:
            fsync_dir(manifests)
            gone = set(removed)
            for entry in os.scandir(data):
                if layout.data_seq(entry.name) in gone:
                    os.unlink(entry.path)
            for seq in removed:
                (consumed / layout.consumed_name(seq)).unlink(missing_ok=True)
        return removed


class LandingSink(Sink):
    """Lands batches in a directory for the Spark consumer (DESIGN.md section 5)."""

    def __init__(
        self, path: Path | str, ack: AckMode = "landed", retention_s: float = 86400.0, source_kind: str = "",
        s3: Settings | None = None, open_retry_s: float = 600.0, open_retry_max_s: float = 60.0,
    ) -> None:
        self.path = Path(path)
        self.ack = ack
        self.retention_s = retention_s
        self.open_retry_s, self.open_retry_max_s = open_retry_s, open_retry_max_s  # the store at start
        self.run_id = uuid.uuid4().hex
        self._writer: LandingWriter | ObjectLandingWriter
        if is_object_url(path):  # s3://bucket/prefix: cdcd/sinks/objlanding.py
            store = ObjectStore(Location.parse(path), s3)
            self.where = store.location.url
            self._writer = ObjectLandingWriter(store, self.run_id, source_kind)
        else:
            self.where = str(self.path)
            self._writer = LandingWriter(self.path, self.run_id, source_kind)
        self._acks: asyncio.Queue[int | None] = asyncio.Queue()
        self._pending: set[int] = set()
        self._watcher: asyncio.Task[None] | None = None
        self._expire_after = 0.0  # time.monotonic() before which ``committed`` does not look for expired batches
        self._closed = False
        self.landed_seq = 0
        # Write failures for /status, metrics and health: the runtime retries the batch meanwhile.
        self.write_failures = 0
        self.failing_since: float | None = None
        self.last_write_error: str | None = None

    async def open(self) -> int:
        # A sink may be opened again after close() (the runtime restarts from stopped): start afresh.
        self._acks = asyncio.Queue()
        self._pending.clear()
        self._closed = False
        retry = Backoff(max_s=self.open_retry_max_s, budget_s=self.open_retry_s, give_up=self._gave_up)
        while True:
            try:
                self.landed_seq = await asyncio.to_thread(self._writer.prepare)
                break
            except OSError as exc:
                raise SinkFatal(
                    f"landing zone {self.path}: cannot prepare it: {exc}; check that the directory is writable "
                    "by the daemon's user (landing.path)"
                ) from exc
            except SinkError as exc:  # object storage unreachable or failing at start: wait for it, bounded
                if exc.fatal:
                    raise
                self._failed(str(exc))
                delay = retry.failure(exc)
                _log.warning("landing zone not ready, retrying", error=str(exc), retry_in_s=round(delay, 2),
                             failing_for_s=round(retry.failed_for_s(), 1))
                await asyncio.sleep(delay)
        self.failing_since = None
        if self.ack == "consumed":
            self._watcher = asyncio.create_task(self._watch_consumed(), name="landing-consumed-watcher")
        return self.landed_seq

    async def deliver(self, batch: Batch) -> None:
        if batch.seq <= self.landed_seq:
            raise SinkFatal(
                f"landing zone {self.path}: batch {batch.seq} is not above the last landed batch "
                f"{self.landed_seq}; batch seqs must never be reused"
            )
        try:
            await asyncio.to_thread(self._writer.land, batch)
        except SinkError as exc:  # object storage: the store's error says what and where
            if exc.fatal:
                raise
            self._failed(f"{exc}. Nothing of the batch is visible and the checkpoint did not move; the batch is "
                         "retried until it lands")
            raise
        except OSError as exc:
            self.write_failures += 1
            self.failing_since = self.failing_since or time.time()
            where = exc.filename or self.path
            self.last_write_error = (
                f"landing zone {self.path}: batch {batch.seq} could not be landed ({where}: "
                f"{exc.strerror or exc}); {storage_fix(exc)}. Nothing of the batch is visible and the "
                "checkpoint did not move; the batch is retried until it lands"
            )
            raise SinkError(self.last_write_error) from exc
        self.failing_since = None
        self.landed_seq = batch.seq
        if self.ack == "landed":
            self._acks.put_nowait(batch.seq)
        else:
            self._pending.add(batch.seq)

    def _gave_up(self, elapsed: float, error: BaseException) -> BaseException:
        return SinkFatal(f"landing zone {self.where} did not answer for {elapsed:.0f} s at start "
                         f"(runtime.source_retry_timeout_s): {error}")

    def _failed(self, error: str) -> None:
        self.write_failures += 1
        self.failing_since = self.failing_since or time.time()
        self.last_write_error = error

    async def _watch_consumed(self) -> None:
        while not self._closed:
            if self._pending:
                done = await asyncio.to_thread(self._writer.consumed, set(self._pending))
                for seq in sorted(done):
                    self._pending.discard(seq)
                    self._acks.put_nowait(seq)
            await asyncio.sleep(POLL_S)

    async def acks(self) -> AsyncIterator[int]:
        while True:
            seq = await self._acks.get()
            if seq is None:
                return
            yield seq

    async def committed(self, batch_seq: int) -> None:
        # Retention counts in seconds: looking more often than once a second (or than the retention) is waste.
        now = time.monotonic()
        if now < self._expire_after:
            return
        self._expire_after = now + min(1.0, self.retention_s)
        try:
            await asyncio.to_thread(self._writer.expire, batch_seq, self.retention_s, time.time())
        except OSError as exc:
            self._expire_after = 0.0
            raise SinkError(f"landing zone {self.path}: retention cleanup failed: {exc}") from exc

    def status(self) -> dict[str, Any]:
        return {
            "path": self.where,
            "landed_seq": self.landed_seq,
            "write_failures": self.write_failures,
            "failing_since": self.failing_since,
            "last_write_error": self.last_write_error,
        }

    async def close(self) -> None:
        self._closed = True
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher
            self._watcher = None
        self._acks.put_nowait(None)
