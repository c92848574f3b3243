"""An object-store URL given as the consumer's or `cdcd verify`'s target (or as a landing zone on a store other
than S3) is refused with the reason (exit 2), not taken for a local directory named `s3a:` (issue 30: the
target's state and lock are POSIX files until they move to object storage too)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

CDCD = str(Path(sys.executable).with_name("cdcd"))


@pytest.mark.parametrize(("argv", "option"), [
    (["spark", "run", "--landing", "s3a://bucket/landing", "--target", "s3a://bucket/target", "--once"], "target"),
    (["spark", "run", "--landing", "gs://bucket/landing", "--target", "t", "--once"], "landing"),
    (["spark", "run", "--landing", "landing", "--target", "s3://bucket/target", "--once"], "target"),
    (["verify", "-c", "cdcd.toml", "--target", "gs://bucket/target"], "target"),
])
def test_an_object_store_url_is_refused_with_the_reason(tmp_path: Path, argv: list[str], option: str) -> None:
    (tmp_path / "landing").mkdir()
    done = subprocess.run([CDCD, *argv], capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert done.returncode == 2, done.stderr
    url = argv[argv.index(f"--{option}") + 1]
    assert f"argument --{option}: {url!r} is a" in done.stderr
    assert "POSIX path only" in done.stderr and "docs/spark.md, Object storage" in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["landing"]  # no directory named after the URL
