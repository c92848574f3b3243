"""The landing replay: every landed event applied per table by the rule of docs/landing-format.md, compared with
the source by verify's comparison."""

from __future__ import annotations

import asyncio
from io import StringIO
from pathlib import Path
from typing import Any

from cdcd.config import load_config
from cdcd.landing.manifest import covered_records
from cdcd.landing.reader import landed_seqs, read_batch
from cdcd.verify.compare import compare
from cdcd.verify.report import report
from cdcd.verify.source import read_source


def replay(landing: Path, config_path: Path, out: Path) -> tuple[bool, str]:
    """The landing zone applied per docs/landing-format.md ("Applying batches"), compared with the source.

    Every event of a table in position order (a truncate and a ``covered`` record before the events at
    their position): upserts, deletes, key changes remove the old key, truncates and ``covered`` records
    remove every row below their position, ``_cdc_unavailable`` columns keep the previous value. The result
    is compared with the source by `cdcd verify`'s comparison (same normal forms)."""
    config = load_config(config_path)
    events: dict[str, list[tuple[str, int, int, int, dict[str, Any], list[str]]]] = {}
    for seq in landed_seqs(landing):
        batch = read_batch(landing, seq)
        for f in batch.files:
            name = str(f.table)
            for r in f.data.to_pylist():
                tie = 0 if r["_cdc_op"] == "t" else 1
                events.setdefault(name, []).append((r["_cdc_pos"], tie, seq, r["_cdc_index"], r, list(f.schema.key)))
        for schema, table, below in covered_records(batch.manifest):
            events.setdefault(f"{schema}.{table}", []).append((below, 0, seq, -1, {"_cdc_op": "covered"}, []))
    lines: list[str] = []
    ok = True
    for source_table in asyncio.run(read_source(config)):
        name = str(source_table.table)
        state: dict[tuple[Any, ...], dict[str, Any]] = {}
        for _, _, _, _, r, key in sorted(events.get(name, []), key=lambda e: e[:4]):
            op = r["_cdc_op"]
            if op in ("t", "covered"):
                state.clear()
                continue
            k = tuple(r[c] for c in key)
            if op == "d":
                state.pop(k, None)
                continue
            before = r.get("_cdc_before_key")
            prev = state.pop(tuple(before[c] for c in key), None) if before else state.get(k)
            row = {c: v for c, v in r.items() if not c.startswith("_cdc_")}
            for c in r.get("_cdc_unavailable") or []:
                row[c] = prev.get(c) if prev is not None else "<unavailable, no earlier value>"
            state[k] = row
        diff = compare(source_table, [[row.get(c.name) for c in source_table.columns] for row in state.values()])
        buf = StringIO()
        report([diff], buf)
        lines.append(buf.getvalue())
        ok = ok and diff.ok
    text = "".join(lines)
    out.write_text(text)
    return ok, text
