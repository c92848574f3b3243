"""Incremental snapshots: the watermark-chunk algorithm (DBLog), run by the coordinator while the stream runs.

A table is read in key-ordered chunks while its changes keep streaming. Per chunk the source's ``ChunkReader``
makes a low watermark (LW), reads the chunk, makes a high watermark (HW) and says which transactions the
chunk's read did not see. The coordinator records every streamed change of the table being snapshotted
(``Window``); when the stream reaches the HW it emits the chunk's rows that no recorded change touched (either
image: the old key of a key change too) as ``r`` rows at the HW's position, so they sort after everything the
read saw and before every later change. A touched key's state comes from the stream instead, unless a change
that took it did not carry every column (PostgreSQL's unchanged TOAST: ``unavailable``): such a key is read
again (``SnapshotJob.reread``) with a later chunk, or in re-read rounds of their own after the last chunk,
until a read of it has no such change in its window. The proof sketch, the latency bound and the
checkpointed progress are in docs/runtime.md ("Incremental snapshots").

Progress reaches the checkpoint through Marks (``INCREMENTAL_START``, ``INCREMENTAL_CHUNK``,
``INCREMENTAL_REREAD``, ``INCREMENTAL_DONE``, ``TABLES``, ``TABLE_REPLACED``) that every source folds with
``fold_incremental``; a restart resumes after the last chunk the checkpoint holds, with its re-read keys.
"""

from cdcd.capture.incremental.runner import POKE_S, Incremental
from cdcd.capture.incremental.state import (
    INCREMENTAL_KINDS,
    check_table,
    fold_incremental,
    jobs_from_state,
    parse_tables,
    plan_tables,
    stale_from_state,
)
from cdcd.capture.incremental.window import (
    Chunk,
    ChunkReader,
    SnapshotJob,
    Window,
    keep_mask,
    partial_key_changes,
    rows_with,
)

__all__ = [
    "INCREMENTAL_KINDS", "POKE_S", "Chunk", "ChunkReader", "Incremental", "SnapshotJob", "Window", "check_table",
    "fold_incremental", "jobs_from_state", "keep_mask", "parse_tables", "partial_key_changes", "plan_tables",
    "rows_with", "stale_from_state",
]
