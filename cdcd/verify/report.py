"""What ``cdcd verify`` prints: a line per table, and the differing rows of each side."""

from __future__ import annotations

from typing import TextIO

from cdcd.verify.compare import TableDiff

SHOW_KEYS = 10


def report(diffs: list[TableDiff], out: TextIO) -> None:
    for d in diffs:
        status = "OK" if d.ok else "DRIFT"
        print(
            f"{d.table}: {status} source={d.source_rows} mirror={d.mirror_rows} "
            f"missing={len(d.missing)} extra={len(d.extra)} changed={len(d.changed)}"
            + ("" if d.buckets is None else f" buckets={d.buckets} differing={d.differing_buckets}")
            + (f" rechecked={d.rechecked}" if d.rechecked else "")
            + (f" unsettled={d.unsettled}" if d.unsettled else ""),
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
