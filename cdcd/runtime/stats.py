"""The runtime's counters (``RuntimeStats``): what ``/status`` and ``/metrics`` read at scrape time."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class RuntimeStats:
    """Counters for /status and /metrics; read at scrape time."""

    events_seen: int = 0
    events_committed: int = 0
    events_skipped: int = 0
    batches_delivered: int = 0
    batches_inflight: int = 0
    max_inflight_batches: int = 0
    queue_size: int = 0
    queue_capacity: int = 0
    committed_batch_seq: int = 0
    committed_position: str | None = None
    checkpoint_saved_at: float | None = None
    checkpoint_failures: int = 0
    #: Wall-clock time of the first failure of the current run of failed saves; None while saves succeed.
    checkpoint_failing_since: float | None = None
    checkpoint_error: str | None = None
    source_reconnects: int = 0
    last_error: str | None = None
    last_tick: float = field(default_factory=time.monotonic)
    table_events: dict[str, int] = field(default_factory=dict)
    #: Per table, its last schema change landed and checkpointed by this process: ``version``, ``position``, ``at``
    #: (the checkpoint's time) and ``count`` (changes since the start).
    schema_changes: dict[str, dict[str, Any]] = field(default_factory=dict)
