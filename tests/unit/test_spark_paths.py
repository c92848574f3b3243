"""An object-store URL given to the consumer or to `cdcd verify` is refused with the reason (exit 2), not taken
for a local directory named `s3a:` (issue 30: until the consumer reads and writes object storage)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

CDCD = str(Path(sys.executable).with_name("cdcd"))


@pytest.mark.parametrize("argv", [
    ["spark", "run", "--landing", "s3a://bucket/landing", "--target", "t", "--once"],
    ["spark", "run", "--landing", "landing", "--target", "s3://bucket/target", "--once"],
    ["verify", "-c", "cdcd.toml", "--target", "gs://bucket/target"],
])
def test_an_object_store_url_is_refused_with_the_reason(tmp_path: Path, argv: list[str]) -> None:
    (tmp_path / "landing").mkdir()
    done = subprocess.run([CDCD, *argv], capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert done.returncode == 2, done.stderr
    url = next(a for a in argv if "://" in a)
    assert f"argument --{'landing' if 'landing' in url else 'target'}: {url!r} is a" in done.stderr
    assert "POSIX path only" in done.stderr and "docs/spark.md, Object storage" in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["landing"]  # no directory named after the URL
