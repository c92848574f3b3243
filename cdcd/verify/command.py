"""`cdcd verify`: compare every captured source table (or those of ``--table``) with its mirror.

The source is read in one snapshot transaction, with the source's own connection code and TLS settings
(``cdcd.verify.sides``). A Delta Lake or Iceberg mirror is compared by bucket checksums computed where
the data lives, the source's in the database and the mirror's in Spark, and only the rows of differing
buckets are read (``cdcd.verify.ranges``: memory bounded). A Parquet mirror, or a table whose key has no
canonical text, is read whole with pyarrow and compared in memory as before (``cdcd.verify.compare``).
Exit code 0 when all tables match, 1 on any difference, 2 when the source or the target cannot be read.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any, TextIO

from cdcd.config import Config
from cdcd.errors import CdcdError, ConfigError, MirrorUnreadable, reason
from cdcd.events import TableId
from cdcd.verify.compare import TableDiff, compare
from cdcd.verify.mirror import lakehouse_frame, read_mirror, target_format
from cdcd.verify.progress import Progress
from cdcd.verify.ranges import TableCheck
from cdcd.verify.report import report
from cdcd.verify.settle import Settle
from cdcd.verify.sides import SourceSide, source_side
from cdcd.verify.source import SourceTable, read_source


def chosen_tables(config: Config, tables: list[str] | None) -> list[TableId]:
    captured = list(config.source.table_ids)
    if not tables:
        return captured
    by_name = {str(t): t for t in captured}
    unknown = [t for t in tables if t not in by_name]
    if unknown:
        raise ConfigError(f"verify --table {', '.join(unknown)}: not a captured table; captured: "
                          f"{', '.join(by_name) or 'none'} (name it as schema.table, as in source.tables)")
    return [by_name[t] for t in tables]


def _whole(config: Config, target: Path, tables: list[TableId]) -> list[TableDiff]:
    """Read each table whole on both sides and compare in memory (a Parquet mirror)."""
    diffs = []
    for t in asyncio.run(read_source(config, tables)):
        try:
            mirror_rows = read_mirror(target, str(t.table), t.columns)
        except Exception as exc:  # pyarrow, Spark or the catalog: reported, exit 2
            raise MirrorUnreadable(f"cannot read the mirror of {t.table} under {target}: {reason(exc)}") from exc
        diffs.append(compare(t, mirror_rows))
    return diffs


async def _by_buckets(config: Config, target: Path, fmt: str, tables: list[TableId],
                      progress: Progress, settle: Settle | None) -> list[TableDiff]:
    diffs = []
    async with source_side(config) as source:
        for t in tables:
            diffs.append(await _one_table(source, target, fmt, t, progress, settle))
    return diffs


async def _one_table(source: SourceSide, target: Path, fmt: str, t: TableId, progress: Progress,
                     settle: Settle | None) -> TableDiff:
    shape = await source.shape(t)
    try:
        frame: Any = lakehouse_frame(target, fmt, str(t))
        check = TableCheck(source, shape, frame)
        if not check.keyed():  # a key without a canonical text: the whole table in memory, as before
            mirror_rows = [] if frame is None else read_mirror(target, str(t), shape.columns)
            src = SourceTable(t, shape.columns, shape.key, await source.all_rows(shape))
            return compare(src, mirror_rows)
        diff = await check.run(lambda done, total: progress.update(str(t), done, total))
        if not diff.ok and settle is not None:
            keys = [k for k in (*diff.missing, *diff.extra, *diff.changed) if isinstance(k, tuple)]
            settled = await settle.run(shape, frame, check.mirror_keys, check.buckets_checked, check.differing, diff)
            if settled.note:
                print(f"verify: {t}: the differences were not re-checked: {settled.note}", file=sys.stderr)
            else:
                diff.rechecked, diff.unsettled = len(keys), settled.unsettled
            diff.missing, diff.extra, diff.changed = settled.missing, settled.extra, settled.changed
            diff.versions = settled.versions
    except CdcdError:
        raise
    except Exception as exc:  # Spark or the catalog: reported, exit 2
        raise MirrorUnreadable(f"cannot read the mirror of {t} under {target}: {reason(exc)}") from exc
    progress.done(str(t), check.buckets_checked, check.buckets_differing)
    return diff


def compare_tables(config: Config, path: Path, chosen: list[TableId], settle_timeout_s: float) -> list[TableDiff]:
    """Each table's differences (what `cdcd verify` reports); raises CdcdError when a side cannot be read."""
    fmt = target_format(path)
    if fmt == "parquet":
        return _whole(config, path, chosen)
    settle = Settle(config, path, fmt, settle_timeout_s) if settle_timeout_s > 0 else None
    with Progress() as progress:
        return asyncio.run(_by_buckets(config, path, fmt, chosen, progress, settle))


def verify(config: Config, target: str, out: TextIO | None = None, tables: list[str] | None = None,
           settle_timeout_s: float = 60.0) -> int:
    """Compare and print; the exit code (0 equal, 1 drift, 2 cannot read). Differences on a Delta Lake or Iceberg
    mirror are re-checked at one position of both sides within ``settle_timeout_s`` (0: not re-checked)."""
    out = out or sys.stdout
    try:
        diffs = compare_tables(config, Path(target), chosen_tables(config, tables), settle_timeout_s)
    except CdcdError as exc:
        print(f"verify: {exc}", file=sys.stderr)
        return 2
    report(diffs, out)
    return 0 if all(d.ok for d in diffs) else 1
