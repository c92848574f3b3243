"""One consumer per target: a second `cdcd spark run` on a target in use is refused before Spark starts."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("pyspark")

from cdcd.logging import configure_logging
from cdcd.spark.job import run
from cdcd.spark.state import CONSUMER_LOCK, STATE_DIR, TargetLocked, lock_target

HOLD = "import sys, time; from pathlib import Path; from cdcd.spark.state import lock_target; " \
       "lock_target(Path(sys.argv[1])); print('held', flush=True); time.sleep(120)"


def test_a_second_consumer_on_a_target_in_use_is_refused_naming_the_first(tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    landing, target = tmp_path / "landing", tmp_path / "target"
    landing.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(target)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        # logging as `cdcd spark run` sets it up (an earlier in-process test of this worker may have set up another)
        configure_logging("info", "json", stream="stderr")
        assert run(str(landing), str(target), once=True, fmt="parquet") == 2
        err = capsys.readouterr().err
        assert f"pid {holder.pid}" in err and "one consumer per target" in err
        with pytest.raises(TargetLocked):
            lock_target(target)
    finally:
        holder.kill()
        holder.wait(30)
    # the holder is gone: the lock is free again (a crashed consumer leaves nothing to clean up)
    deadline = time.monotonic() + 30
    while True:
        try:
            fd = lock_target(target)
            break
        except TargetLocked:
            assert time.monotonic() < deadline
            time.sleep(0.1)
    assert (target / STATE_DIR / CONSUMER_LOCK).read_text().strip().isdigit()
    os.close(fd)
    fd = lock_target(target)  # closing the descriptor releases it within one process too
    os.close(fd)
