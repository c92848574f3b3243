"""The soak (scripts/soak.sh, devtools/soak/) with one minute of faults on PostgreSQL: the daemon and the
following Spark consumer under the mixed workload and the seeded faults must end with `cdcd verify` and the
landing replay equal (exit 0). About three minutes in all on a quiet machine (the server, the snapshot, the Spark
JVM, the catch-up, verify and the replay), more under load. docs/testing.md, "Soak"."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.spark]
ROOT = Path(__file__).resolve().parents[2]


def test_soak_one_minute_postgres() -> None:
    done = subprocess.run([str(ROOT / "scripts" / "soak.sh"), "--minutes", "1", "--source", "postgres",
                           "--seed", "27"], capture_output=True, text=True, timeout=1200, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-4000:]
    assert "verify equal; replay equal" in done.stdout, done.stdout[-3000:]
