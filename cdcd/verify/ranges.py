"""Verify one table by bucket checksums: compare the buckets' checksums, then the rows of differing buckets.

A table's rows fall into buckets by a hash of their key (``cdcd.sources.postgres.checksums``); the source
computes each bucket's checksum in the database, the mirror in Spark (``cdcd.verify.mirror_sums``), so
an equal table moves one line per bucket, never its rows. Only buckets whose checksums differ are read,
CHUNK_BUCKETS at a time from each side, and compared row by row with the normal forms
(``cdcd.verify.compare``): that comparison decides, so a value the canonical texts write differently on
the two sides costs a read, never a false report. A table with a column whose type has no canonical
text on either side is compared that way in every bucket: still in bounded chunks.

Memory: at most CHUNK_BUCKETS buckets of each side at once, about CHUNK_BUCKETS * BUCKET_ROWS rows
(100,000) until a table passes MAX_BUCKETS * BUCKET_ROWS rows, when buckets grow; plus one checksum per
bucket and the keys of the differing rows.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from cdcd.verify.compare import TableDiff, compare
from cdcd.verify.mirror import arrow_rows
from cdcd.verify.mirror_sums import bucket_rows, canonical, digests
from cdcd.verify.report import SHOW_KEYS
from cdcd.verify.sides import SourceSide
from cdcd.verify.source import SourceTable, TableShape

BUCKET_ROWS = 1_000
MAX_BUCKETS = 65_536
CHUNK_BUCKETS = 100


def bucket_count(rows: int) -> int:
    return max(1, min(MAX_BUCKETS, -(-rows // BUCKET_ROWS)))


def _merge(total: TableDiff, part: TableDiff) -> None:
    for mine, theirs in ((total.missing, part.missing), (total.extra, part.extra), (total.changed, part.changed)):
        for k in theirs:
            if len(mine) < SHOW_KEYS and k in part.versions:
                total.versions[k] = part.versions[k]  # only the versions the report prints are kept
            mine.append(k)


class TableCheck:
    """One table's check: counts, checksums, then the rows of the differing buckets."""

    def __init__(self, source: SourceSide, shape: TableShape, frame: Any | None) -> None:
        self.source, self.shape, self.frame = source, shape, frame
        types = {f.name: f.dataType.simpleString() for f in frame.schema.fields} if frame is not None else {}
        self.mirror_exprs = [canonical(c.name, types.get(c.name)) for c in shape.columns]
        names = [c.name for c in shape.columns]
        self.key_pos = [names.index(k) for k in shape.key]
        self.buckets_checked = 0
        self.buckets_differing = 0
        self.differing: list[int] = []  # the buckets whose checksums differed, for the re-check
        # in the key's order, as the source's side orders them: the bucket hashes the same text on both sides
        self.mirror_keys = [e for e in (self.mirror_exprs[i] for i in self.key_pos) if e is not None]

    def summable(self) -> bool:
        """Both sides have a canonical text for every column (else every bucket is compared by rows)."""
        return None not in self.shape.canonical and None not in self.mirror_exprs

    def keyed(self) -> bool:
        """Both sides have a canonical text for the key columns: rows can be put in buckets."""
        return all(self.shape.canonical[i] is not None and self.mirror_exprs[i] is not None for i in self.key_pos)

    async def run(self, progress: Callable[[int, int], None]) -> TableDiff:
        shape = self.shape
        name = str(shape.table)
        rows = await self.source.count(shape)
        n = bucket_count(rows)
        mirror_keys = self.mirror_keys
        if self.summable() and self.frame is not None:
            src = await self.source.digests(shape, n)
            dst = digests(self.frame, [e for e in self.mirror_exprs if e is not None], mirror_keys, n)
            differing = sorted(b for b in src.keys() | dst.keys() if src.get(b) != dst.get(b))
            mirror_rows = sum(d[0] for d in dst.values())
        else:
            differing = list(range(n))
            mirror_rows = 0 if self.frame is None else int(self.frame.count())
        self.buckets_checked, self.buckets_differing, self.differing = n, len(differing), differing
        total = TableDiff(name, rows, mirror_rows, buckets=n, differing_buckets=len(differing))
        progress(0, len(differing))
        for start in range(0, len(differing), CHUNK_BUCKETS):
            chosen = differing[start:start + CHUNK_BUCKETS]
            src_rows = await self.source.rows(shape, n, chosen)
            dst_rows = [] if self.frame is None else arrow_rows(
                bucket_rows(self.frame, mirror_keys, n, chosen), shape.columns)
            part = compare(SourceTable(shape.table, shape.columns, shape.key, src_rows), dst_rows)
            _merge(total, part)
            progress(start + len(chosen), len(differing))
        return total
