"""The container image's `spark` stage can run its own default (`cdcd spark run`, Delta Lake): the stage's jar
step, run into a temporary prefix (no container engine here), puts the pinned jars where the image's
CDCD_SPARK_JARS points and where the job's jar lookup (cdcd.spark.jars) finds them; its metrics port, health
check and command agree."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from cdcd.spark import jars

ROOT = Path(__file__).resolve().parents[2]
CONTAINERFILE = ROOT / "deploy" / "container" / "Containerfile"


def stages() -> dict[str, str]:
    text = CONTAINERFILE.read_text().replace("\\\n", " ")
    parts = re.split(r"^FROM ", text, flags=re.MULTILINE)
    return {m.group(1): part for part in parts if (m := re.search(r" AS (\S+)\s*$", part.splitlines()[0]))}


def env(stage: str) -> dict[str, str]:
    out = {}
    for line in re.findall(r"^ENV (.+)$", stage, re.MULTILINE):
        out.update(dict(re.findall(r"(\w+)=(\S+)", line)))
    return out


def maven_repo(tmp_path: Path) -> Path:
    """A Maven repository (Maven Central's layout, with .sha1 files) of the bootstrap's cached jars."""
    if jars.cached_jars() is None:
        pytest.skip(f"the Spark jars are not cached in {jars.cache_dir()}; run scripts/bootstrap.sh")
    repo = tmp_path / "maven"
    for coordinate in jars.PACKAGES:
        url = jars.jar_url(coordinate, repo.as_uri())
        path = Path(url.removeprefix("file://"))
        path.parent.mkdir(parents=True, exist_ok=True)
        data = (jars.cache_dir() / jars.jar_name(coordinate)).read_bytes()
        path.write_bytes(data)
        Path(f"{path}.sha1").write_text(hashlib.sha1(data).hexdigest() + "\n")
    return repo


def test_the_spark_stage_puts_the_pinned_jars_where_the_job_looks_for_them(tmp_path: Path) -> None:
    found = stages()
    fetch = re.search(r"(/opt/cdcd/bin/python -m cdcd\.spark\.jars --fetch (\S+))", found["build-spark"])
    assert fetch, "the build-spark stage fetches the jars with `python -m cdcd.spark.jars --fetch DIR`"
    command, directory = fetch.group(1), fetch.group(2)
    assert "COPY --from=build-spark /opt/cdcd /opt/cdcd" in found["spark"] and directory.startswith("/opt/cdcd/")
    assert env(found["spark"])["CDCD_SPARK_JARS"] == directory
    # the stage's step, into a prefix and from a local mirror of Maven Central
    prefix = tmp_path / "image"
    argv = shlex.split(command)
    argv[0] = sys.executable
    argv[-1] = str(prefix) + directory
    done = subprocess.run([*argv, "--repo", maven_repo(tmp_path).as_uri()], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    # the job's lookup, with the image's environment
    lookup = ("import json; from cdcd.spark import jars; found = jars.cached_jars(); "
              "print(json.dumps([str(p) for p in found] if found else None)); "
              "print(json.dumps(jars.local_settings('delta').get('spark.jars')))")
    out = subprocess.run([sys.executable, "-c", lookup], capture_output=True, text=True, check=True, timeout=60,
                         env={**os.environ, "CDCD_SPARK_JARS": str(prefix) + directory}).stdout.splitlines()
    paths = json.loads(out[0])
    assert paths == [f"{prefix}{directory}/{jars.jar_name(c)}" for c in jars.PACKAGES]
    assert json.loads(out[1]) == ",".join(paths)


def test_a_jar_that_does_not_match_its_published_sha1_is_refused(tmp_path: Path) -> None:
    repo = maven_repo(tmp_path)
    first = Path(jars.jar_url(jars.PACKAGES[0], repo.as_uri()).removeprefix("file://"))
    Path(f"{first}.sha1").write_text("0" * 40 + "\n")
    done = subprocess.run([sys.executable, "-m", "cdcd.spark.jars", "--fetch", str(tmp_path / "jars"), "--repo",
                           repo.as_uri()], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "SHA-1" in done.stderr, done.stderr
    assert not (tmp_path / "jars" / jars.jar_name(jars.PACKAGES[0])).exists()


def test_the_spark_stage_serves_and_checks_the_consumers_health() -> None:
    spark = stages()["spark"]
    port = re.search(r"^EXPOSE (\d+)$", spark, re.MULTILINE)
    assert port, "the spark stage exposes the consumer's metrics port"
    cmd = json.loads(re.search(r"^CMD (\[.+\])$", spark, re.MULTILINE).group(1))  # type: ignore[union-attr]
    assert cmd[cmd.index("--metrics-listen") + 1] == f"0.0.0.0:{port.group(1)}"
    assert f"127.0.0.1:{port.group(1)}/healthz" in spark and "HEALTHCHECK" in spark
    assert "python -m cdcd.sparkcds" in spark  # the class-data sharing archive, built with the image's JVM
