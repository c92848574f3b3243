"""scripts/bench.sh --quick runs to the end and reports every measure it ran (a smoke run, no figures asserted)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_quick_smoke(tmp_path: Path) -> None:
    out = tmp_path / "results"
    # The Spark measure is covered by the Spark tests; here it would double the suite's Spark time.
    proc = subprocess.run(
        [str(ROOT / ".venv" / "bin" / "python"), "-m", "bench", "--quick", "--no-spark",
         "--out", str(out), "--chart", str(tmp_path / "chart.png")],
        cwd=ROOT, capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    doc = json.loads((out / "latest.json").read_text())
    measures = [r["measure"] for r in doc["results"]]
    for expected in ("PostgreSQL streaming", "PostgreSQL snapshot", "MariaDB streaming", "MariaDB snapshot",
                     "MariaDB streaming, transactions of 50 rows", "latency", "peak RSS",
                     "one 100,000-row transaction", "PostgreSQL streaming to object storage"):
        assert any(m.startswith(expected) for m in measures), (expected, measures)
    # inprogress: the database's logical_decoding_work_mem is 1 MB, so protocol 1 spills and protocol 2 streams
    inprogress = [r for r in doc["results"] if r.get("scenario") == "inprogress"]
    assert len(inprogress) == 4
    for row in inprogress:
        streamed = "protocol 2" in row["measure"]
        assert (row["stream_bytes"] > 0, row["spill_bytes"] > 0) == (streamed, not streamed), row
    for row in doc["results"]:
        if "baseline_rate" in row:
            assert row["cdcd"] > 0 and row["baseline_rate"] > 0 and row["ratio"] > 0
    assert "| measure | cdcd |" in (out / "latest.md").read_text()
    assert (tmp_path / "chart.png").stat().st_size > 0
