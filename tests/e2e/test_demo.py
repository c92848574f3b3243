"""scripts/demo.sh runs to completion and leaves no process behind; with --object-store too (the landing zones and
the tables on a throwaway S3 server, the consumer on a throwaway Spark standalone cluster)."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
from support.processes import processes_mentioning

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.spark
@pytest.mark.timeout(900)  # the object-store demo took 5 min alone, and over the suite's 600 s beside other runs
@pytest.mark.parametrize("extra", [[], ["--object-store"]], ids=["local", "object-store"])
def test_demo_runs_and_leaves_nothing_running(extra: list[str]) -> None:
    # Every temporary directory of the demo (servers, daemons, Spark) lands under one directory that the
    # database servers' unprivileged user may use (pytest's tmp_path is private to root).
    tmp_path = Path(tempfile.mkdtemp(prefix="cdcd-demo-test-"))
    os.chmod(tmp_path, 0o1777)  # like /tmp: the servers write their own temporary files here
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    try:
        proc = subprocess.run([str(ROOT / "scripts" / "demo.sh"), "--workload-seconds", "3", *extra],
                              cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900,
                              start_new_session=True)
        leftovers = processes_mentioning(tmp_path)
        # The demo captures as the least-privileged roles the docs describe, its secret readable by its owner only.
        work = next(tmp_path.glob("cdcd-demo-*"))
        assert (work / "cdc-password").stat().st_mode & 0o777 == 0o600
        for name in ("postgres", "mariadb"):
            assert 'user = "cdc"' in (work / name / "cdcd.toml").read_text()
            # the tables are in the demo's directory after it (--object-store: copied from the S3 server)
            assert any((work / name / "target" / "tables").glob("*.orders/_delta_log/*.json")), name
    finally:
        shutil.rmtree(tmp_path, ignore_errors=True)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    out = proc.stdout
    assert "== cdcd demo summary ==" in out and "stopped everything the demo started" in out
    for name in ("postgres", "mariadb"):
        line = next(line for line in out.splitlines() if line.startswith(name))
        assert "spark ok" in line and "verify ok" in line, line
    if extra:
        assert "spark-submit --master spark://127.0.0.1:" in out
        for name in ("postgres", "mariadb"):
            assert f"landing zone s3://cdcd-demo/{name}/landing" in out
            assert f"Delta Lake mirrors s3a://cdcd-demo/{name}/target/tables" in out
    assert leftovers == []
