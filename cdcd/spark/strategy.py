"""What the job asks of a target format: apply one segment of landed batches.

The job (``cdcd.spark.job``) cuts the landed batches into segments (one daemon
run each, bounded in size), hands each to the format's ``TableFormat`` (chosen
once, ``job.make_strategy``), then commits the outcome in the target's journal
and marks the batches consumed. One strategy per format, each owning its DDL,
its commit record and its apply: ``cdcd.spark.parquet`` (the bucket rewrite),
``cdcd.spark.delta`` and ``cdcd.spark.iceberg`` (MERGE INTO, sharing
``cdcd.spark.lakehouse``); all apply the one ordering rule of ``cdcd.spark.rule``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from pyspark.sql import SparkSession

from cdcd.landing.manifest import Manifest
from cdcd.landing.reader import Covered, LandedFile, covered_tables, table_files
from cdcd.spark.state import TableState


@dataclass(frozen=True, slots=True)
class Segment:
    """A run of landed batches (seq, manifest) of one daemon run, in seq order, applied in one merge."""

    landing: Path
    batches: list[tuple[int, Manifest]]

    @property
    def first(self) -> int:
        return self.batches[0][0]

    @property
    def last(self) -> int:
        return self.batches[-1][0]

    @property
    def run_id(self) -> str:
        return self.batches[0][1].run_id

    def tables(self) -> dict[tuple[str, str], list[LandedFile]]:
        """The segment's landed files per (schema, table), in batch order."""
        return table_files(self.landing, self.batches)

    def covered(self) -> dict[tuple[str, str], Covered]:
        """The segment's covered records (completed re-snapshots) per (schema, table).

        A record says: every row the source still has was landed at a position at or above ``below``
        (docs/landing-format.md), so the table's mirror rows with ``_cdc_pos < below`` were deleted
        behind cdcd's back and go. It is the truncate rule with a threshold that is not the record's own
        position, applied after the segment's events (a segment is one daemon run, whose positions
        increase, so every event after the record is above ``below`` and nothing it writes is removed).
        The change-log gets nothing: it holds what the source sent, and the source sent no delete. Each
        format applies them in its own apply.
        """
        return covered_tables(self.batches)


@dataclass(slots=True)
class Applied:
    """What a strategy did with a segment; the job commits it in the target's journal."""

    tables: dict[str, TableState] = field(default_factory=dict)  # new state per "schema.table"
    events: int = 0
    timings: dict[str, dict[str, float]] = field(default_factory=dict)  # seconds per table and step, for the log
    files: list[tuple[str, str]] = field(default_factory=list)  # staged files to move into place
    buckets: list[tuple[str | None, str]] = field(default_factory=list)  # staged directories to swap in


class TableFormat(Protocol):
    """One target format (``--format``): its DDL, its commit record, its apply."""

    #: The --format value.
    name: str

    def apply(self, spark: SparkSession, segment: Segment, tables: dict[str, TableState]) -> Applied:
        """Apply the segment on top of the tables' current state (from the journal); stage what needs a commit."""
        ...

    def files_before(self, tables: list[tuple[str, str]]) -> None:
        """Called before a merge of these tables (``files_after``)."""
        ...

    def files_after(self, applied: Applied, tables: list[tuple[str, str]],
                    since: float) -> tuple[int | None, int | None]:
        """Data files the merge (started at ``since``, epoch seconds) added, and files it rewrote or removed, read
        from what it committed (the merge's log line); None: not known."""
        ...


#: The attribute ``applying`` sets on an exception: the table whose statements raised it ("schema.table").
FAILED_TABLE = "cdcd_table"


@contextmanager
def applying(table: str) -> Iterator[None]:
    """Around one table's statements in a strategy: an exception raised inside names the table for the job's
    error line (``FAILED_TABLE``)."""
    try:
        yield
    except Exception as exc:
        if getattr(exc, FAILED_TABLE, None) is None:
            with suppress(AttributeError):  # an exception type with __slots__: the error line names no table
                setattr(exc, FAILED_TABLE, table)
        raise
