"""The class-data sharing archive of the Spark job (cdcd/sparkcds.py, cdcd/spark/cds.py): built by a real training run,
mapped by a later local session, which then loads Spark's and Delta Lake's classes from it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from cdcd import sparkcds
from cdcd.spark import cds, jars

pytestmark = pytest.mark.spark

#: A session that only starts and touches Delta Lake; prints where one Spark and one Delta class came from.
PROBE = """
from cdcd.spark.session import session
s = session("delta")
s.sql("SELECT 1").collect()
"""


def test_archive_name_follows_jvm_and_jars(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cds.ENV, str(tmp_path))
    first = cds.archive()
    assert first is not None and first.parent == tmp_path
    assert cds.java_options() == ""  # no archive yet: the JVM starts as before
    monkeypatch.setenv(jars.ENV, str(tmp_path / "no-jars"))  # another jar set: another archive
    assert cds.archive() != first
    monkeypatch.setenv(cds.ENV, "off")
    assert cds.archive() is None and cds.java_options() == ""


def test_built_archive_is_mapped_by_a_local_session(tmp_path: Path) -> None:
    """The archive the bootstrap built (``python -m cdcd.sparkcds``, a real training run of this checkout in a
    fresh clone), or, when there is none (the bootstrap only warns when the build fails), one built here: so a
    broken build fails this test either way, and CI does not pay for a second training run."""
    if jars.cached_jars() is None:
        pytest.skip("the Delta Lake jars are not cached: run scripts/bootstrap.sh")
    env = dict(os.environ)
    env.pop(cds.DUMP_ENV, None)
    built = cds.archive()
    if built is not None and built.is_file():
        where = built.parent
    else:
        where = tmp_path
        env[cds.ENV] = str(where)
        build = subprocess.run([sys.executable, "-m", "cdcd.sparkcds"], env=env, capture_output=True, text=True,
                               timeout=sparkcds.BUILD_TIMEOUT)
        assert build.returncode == 0, build.stderr[-3000:]
    archives = list(where.glob("spark-*.jsa"))
    assert len(archives) == 1 and archives[0].stat().st_size > 10 * 2**20, archives
    assert not list(where.glob("*.tmp")), "the training run's temporary file was left behind"
    again = subprocess.run([sys.executable, "-m", "cdcd.sparkcds"], env=env, capture_output=True, text=True,
                           timeout=60)
    assert again.returncode == 0 and list(where.glob("spark-*.jsa")) == archives  # a second run: a file check
    # -Xshare:on: a JVM that cannot map the archive refuses to start instead of going on without it
    log = tmp_path / "classes.log"
    env["CDCD_SPARK_JAVA_OPTIONS"] = f"-XX:TieredStopAtLevel=1 -Xshare:on -Xlog:class+load=info:file={log}"
    probe = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=600)
    assert probe.returncode == 0, probe.stderr[-3000:]
    shared = {line.split()[1] for line in log.read_text().splitlines() if "shared objects file (top)" in line}
    # the dynamic archive ("top" layer) holds classes of Spark's jars and of Delta Lake's
    assert "org.apache.spark.sql.classic.SparkSession" in shared
    assert "io.delta.sql.DeltaSparkSessionExtension" in shared
