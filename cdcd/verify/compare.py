"""Compare a source table's rows with its mirror's: matched by key, compared by a hash of each row's normal form."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from cdcd.verify.normalize import normal, row_hash
from cdcd.verify.source import SourceColumn, SourceTable


@dataclass(slots=True)
class TableDiff:
    table: str
    source_rows: int
    mirror_rows: int
    missing: list[Any] = field(default_factory=list)  # in the source, not in the mirror
    extra: list[Any] = field(default_factory=list)  # in the mirror, not in the source
    changed: list[Any] = field(default_factory=list)
    versions: dict[Any, tuple[dict[str, Any] | None, dict[str, Any] | None]] = field(default_factory=dict)
    buckets: int | None = None  # compared by bucket checksums (cdcd.verify.ranges): buckets checked
    differing_buckets: int = 0  # ... and those whose rows were read
    rechecked: int = 0  # differing keys re-checked at one position of source and mirror (cdcd.verify.settle)
    unsettled: int = 0  # ... of them changed again in every round: neither equal nor drift

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


def compare(source: SourceTable, mirror_rows: list[list[Any]]) -> TableDiff:
    name = str(source.table)
    src = _index(source.columns, source.key, [list(r) for r in source.rows])
    dst = _index(source.columns, source.key, mirror_rows)
    diff = TableDiff(name, len(source.rows), len(mirror_rows))
    if len(dst) != len(mirror_rows):
        diff.extra.append("(the mirror holds a key more than once)")
    if len(src) != len(source.rows):
        # keys that differ at the source only in values landed as NULL (MariaDB/MySQL zero or invalid dates,
        # docs/mysql.md): the mirror can hold one row per landed key, so the others are lost
        diff.missing.append(f"({len(source.rows) - len(src)} source rows share their landed key with another row: "
                            "a key column holds a value that lands as NULL, such as a zero date)")
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
