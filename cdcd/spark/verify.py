"""`cdcd verify`: compare every captured source table with its mirror.

The source is read in one snapshot transaction, with the source's own
connection code and TLS settings; a Parquet mirror with pyarrow, a Delta
Lake or Iceberg mirror through Spark. Rows are matched by primary key and compared by a hash of every
column's normal form (``cdcd.spark.normalize``). Exit code 0 when all tables
match, 1 on any difference, 2 when the source or the target cannot be read.
"""

from __future__ import annotations

import asyncio
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import pyarrow as pa
import pyarrow.dataset as ds

from cdcd.config import Config
from cdcd.errors import CdcdError
from cdcd.spark.normalize import normal, row_hash
from cdcd.spark.readers import SourceColumn, SourceTable, read_source

SHOW_KEYS = 10


@dataclass(slots=True)
class TableDiff:
    table: str
    source_rows: int
    mirror_rows: int
    missing: list[Any] = field(default_factory=list)  # in the source, not in the mirror
    extra: list[Any] = field(default_factory=list)  # in the mirror, not in the source
    changed: list[Any] = field(default_factory=list)
    versions: dict[Any, tuple[dict[str, Any] | None, dict[str, Any] | None]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not (self.missing or self.extra or self.changed)


def _normal_row(columns: list[SourceColumn], values: list[Any]) -> list[Any]:
    return [normal(v, c.float32, c.is_json) for c, v in zip(columns, values, strict=True)]


def _index(columns: list[SourceColumn], key: list[str], rows: list[list[Any]]) -> dict[Any, tuple[str, list[Any]]]:
    """key (JSON-able tuple of normal forms) -> (row hash, normal row)."""
    pos = [[c.name for c in columns].index(k) for k in key]
    out: dict[Any, tuple[str, list[Any]]] = {}
    for values in rows:
        n = _normal_row(columns, values)
        out[tuple(str(n[i]) for i in pos)] = (row_hash(n), n)
    return out


def target_format(target: Path) -> str:
    """The target's table format: TARGET/state/format (Delta Lake, Iceberg), else the Parquet mirror."""
    marker = target / "state" / "format"
    return marker.read_text().strip() if marker.exists() else "parquet"


def read_table(target: Path, table: str, kind: str = "tables") -> pa.Table | None:
    """A mirror (``tables``) or change-log (``changelog``) of any format as an Arrow table; None when absent.

    Parquet with pyarrow; Delta Lake and Iceberg through Spark with the job's own
    session and catalog settings (``cdcd.spark.lakehouse``).
    """
    fmt = target_format(target)
    if fmt == "parquet":
        path = target / kind / table
        return ds.dataset(path).to_table() if path.is_dir() else None
    from cdcd.spark.lakehouse import Names, prepare_run

    problem = prepare_run(fmt, target)
    if problem is not None:
        raise ValueError(problem)
    from pyspark.sql import SparkSession

    spark = SparkSession.getActiveSession()
    assert spark is not None
    names = Names(fmt, target)
    schema, name = table.split(".", 1)
    if not names.exists(spark, kind, schema, name):
        return None
    return spark.table(names.ref(kind, schema, name)).toArrow()


def read_mirror(target: Path, table: str, columns: list[SourceColumn]) -> list[list[Any]]:
    data = read_table(target, table)
    if data is None:
        return []
    have = set(data.column_names)
    cols = [data.column(c.name).to_pylist() if c.name in have else [None] * data.num_rows for c in columns]
    return [list(r) for r in zip(*cols, strict=True)] if cols else []


def compare(source: SourceTable, mirror_rows: list[list[Any]]) -> TableDiff:
    name = str(source.table)
    src = _index(source.columns, source.key, [list(r) for r in source.rows])
    dst = _index(source.columns, source.key, mirror_rows)
    diff = TableDiff(name, len(source.rows), len(mirror_rows))
    if len(dst) != len(mirror_rows):
        diff.extra.append("(the mirror holds a key more than once)")
    names = [c.name for c in source.columns]
    for k in sorted(src.keys() - dst.keys()):
        diff.missing.append(k)
        diff.versions[k] = (dict(zip(names, src[k][1], strict=True)), None)
    for k in sorted(dst.keys() - src.keys()):
        diff.extra.append(k)
        diff.versions[k] = (None, dict(zip(names, dst[k][1], strict=True)))
    for k in sorted(src.keys() & dst.keys()):
        if src[k][0] != dst[k][0]:
            diff.changed.append(k)
            diff.versions[k] = (dict(zip(names, src[k][1], strict=True)), dict(zip(names, dst[k][1], strict=True)))
    return diff


def report(diffs: list[TableDiff], out: TextIO) -> None:
    for d in diffs:
        status = "OK" if d.ok else "DRIFT"
        print(
            f"{d.table}: {status} source={d.source_rows} mirror={d.mirror_rows} "
            f"missing={len(d.missing)} extra={len(d.extra)} changed={len(d.changed)}",
            file=out,
        )
        for label, keys in (("missing", d.missing), ("extra", d.extra), ("changed", d.changed)):
            for k in keys[:SHOW_KEYS]:
                src, dst = d.versions.get(k, (None, None))
                print(f"  {label} key={list(k) if isinstance(k, tuple) else k}", file=out)
                print(f"    source: {src}", file=out)
                print(f"    mirror: {dst}", file=out)
            if len(keys) > SHOW_KEYS:
                print(f"  ... {len(keys) - SHOW_KEYS} more {label} keys", file=out)


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
