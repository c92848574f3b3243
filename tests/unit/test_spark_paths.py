"""A URL the consumer cannot write to given as the consumer's or `cdcd verify`'s target (a store other than S3,
an s3:// URL without a bucket), or as a landing zone, is refused with the reason (exit 2), not taken for a local
directory named `gs:`; a Parquet target on object storage is refused too (its commit renames directories), before
anything starts. Targets on S3 themselves: tests/e2e/test_spark_object_target.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

CDCD = str(Path(sys.executable).with_name("cdcd"))


@pytest.mark.parametrize(("argv", "option"), [
    (["spark", "run", "--landing", "s3a://bucket/landing", "--target", "gs://bucket/target", "--once"], "target"),
    (["spark", "run", "--landing", "gs://bucket/landing", "--target", "t", "--once"], "landing"),
    (["spark", "run", "--landing", "landing", "--target", "s3://", "--once"], "target"),
    (["verify", "-c", "cdcd.toml", "--target", "gs://bucket/target"], "target"),
])
def test_a_url_cdcd_cannot_write_is_refused_with_the_reason(tmp_path: Path, argv: list[str], option: str) -> None:
    (tmp_path / "landing").mkdir()
    done = subprocess.run([CDCD, *argv], capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert done.returncode == 2, done.stderr
    url = argv[argv.index(f"--{option}") + 1]
    assert f"argument --{option}: {url!r}: a" in done.stderr
    assert "s3://bucket/prefix" in done.stderr and "docs/spark.md, Object storage" in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["landing"]  # no directory named after the URL


def test_a_parquet_target_on_object_storage_is_refused(tmp_path: Path) -> None:
    (tmp_path / "landing").mkdir()
    done = subprocess.run([CDCD, "spark", "run", "--landing", "landing", "--target", "s3a://bucket/target",
                           "--format", "parquet", "--once", "--log-format", "console"], capture_output=True,
                          text=True, cwd=tmp_path, timeout=60)
    assert done.returncode == 2, done.stderr
    assert "--format parquet cannot write to object storage" in done.stderr and "renames" in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["landing"]
