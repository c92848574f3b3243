"""`cdcd verify`: compare every captured source table with its mirror.

The source is read in one snapshot transaction, with the source's own
connection code and TLS settings (``cdcd.verify.source``); a Parquet mirror
with pyarrow, a Delta Lake or Iceberg mirror through Spark
(``cdcd.verify.mirror``). Rows are matched by primary key and compared by a
hash of every column's normal form (``cdcd.verify.compare``,
``cdcd.verify.normalize``). Exit code 0 when all tables match, 1 on any
difference, 2 when the source or the target cannot be read.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import TextIO

from cdcd.config import Config
from cdcd.errors import CdcdError
from cdcd.verify.compare import compare
from cdcd.verify.mirror import read_mirror
from cdcd.verify.report import report
from cdcd.verify.source import read_source


def verify(config: Config, target: str, out: TextIO | None = None) -> int:
    """Compare and print; the exit code (0 equal, 1 drift, 2 cannot read)."""
    out = out or sys.stdout
    try:
        tables = asyncio.run(read_source(config))
    except CdcdError as exc:
        print(f"verify: {exc}", file=sys.stderr)
        return 2
    diffs = []
    for t in tables:
        try:
            mirror_rows = read_mirror(Path(target), str(t.table), t.columns)
        except Exception as exc:  # pyarrow, Spark or the catalog: reported, exit 2
            print(f"verify: cannot read the mirror of {t.table} under {target}: {exc}", file=sys.stderr)
            return 2
        diffs.append(compare(t, mirror_rows))
    report(diffs, out)
    return 0 if all(d.ok for d in diffs) else 1
