"""The operator's side of the Spark consumer and the command line, without Spark: the consumer's lag over a real
landing zone, one parser for `cdcd spark run` and `python -m cdcd.spark.consumer`, and output into a closed pipe
(`cdcd checkpoint list | head`) ending quietly."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import textwrap
from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa

from cdcd.checkpoint.store import Checkpoint, CheckpointStore
from cdcd.events import ChangeEvent, Column, Op, TableId, TableSchema
from cdcd.landing.reader import read_manifest
from cdcd.positions import PgPosition
from cdcd.runtime.interfaces import Batch
from cdcd.sinks.landing import LandingSink

CDCD = str(Path(sys.executable).with_name("cdcd"))
T = TableSchema(TableId("public", "t"), (Column("id", pa.int64(), "bigint", nullable=False),), ("id",))


def land(landing: Path, seqs: list[int]) -> None:
    async def go() -> None:
        sink = LandingSink(landing)
        await sink.open()
        for seq in seqs:
            await sink.deliver(Batch(seq, [ChangeEvent(Op.CREATE, T, PgPosition(seq * 100, 0), tx_id=str(seq),
                                                       commit_ts=datetime.now(UTC), after={"id": seq})]))
        await sink.close()

    asyncio.run(go())


def test_lag_counts_the_batches_not_applied_and_the_landing_time_between_the_newest_and_the_applied(
        tmp_path: Path) -> None:
    from cdcd.spark.metrics import landing_lag

    landing = tmp_path / "landing"
    land(landing, [1, 2, 5])  # seqs may have gaps
    created = {s: datetime.fromisoformat(read_manifest(landing, s).created_at).timestamp() for s in (1, 2, 5)}
    assert landing_lag(landing, 5, read_manifest(landing, 5).created_at) == (0, 0.0)
    behind, seconds = landing_lag(landing, 1, read_manifest(landing, 1).created_at)
    assert behind == 2 and seconds == created[5] - created[1]
    behind, seconds = landing_lag(landing, 0, None)  # nothing applied yet: from the oldest landed batch
    assert behind == 3 and seconds == created[5] - created[1]


def _options(*argv: str) -> set[str]:
    done = subprocess.run([*argv, "--help"], capture_output=True, text=True, timeout=120, check=True)
    return set(re.findall(r"(--[a-z][a-z-]+)", done.stdout))


def test_cdcd_spark_run_and_the_consumer_module_take_the_same_arguments() -> None:
    cli = _options(CDCD, "spark", "run")
    module = _options(sys.executable, "-m", "cdcd.spark.consumer")
    assert cli == module
    assert {"--landing", "--target", "--once", "--format", "--checkpoint", "--buckets", "--metrics-listen",
            "--log-level", "--log-format"} <= cli


def test_output_into_a_closed_pipe_ends_quietly(tmp_path: Path) -> None:
    cfg = tmp_path / "cdcd.toml"
    cfg.write_text(textwrap.dedent(f"""
        [source]
        kind = "postgres"
        user = "cdc"
        database = "app"
        tables = ["public.orders"]
        [state]
        path = "{tmp_path / 'state'}"
        [landing]
        path = "{tmp_path / 'landing'}"
    """))
    store = CheckpointStore(tmp_path / "state")
    store.path.mkdir()
    for seq in range(1, 6):
        store.save(Checkpoint("postgres", seq, seq * 10, PgPosition(0x1000 + seq, 0), {}))
    for command in (["checkpoint", "list"], ["checkpoint", "list", "--json"], ["checkpoint", "show"]):
        read, write = os.pipe()
        os.close(read)  # `| head` that has read what it wanted, before cdcd writes
        try:
            done = subprocess.run([CDCD, *command, "-c", str(cfg)], stdout=write, stderr=subprocess.PIPE, text=True,
                                  timeout=60)
        finally:
            os.close(write)
        assert "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr, done.stderr
        assert done.stderr == "" and done.returncode == 141, (command, done.returncode, done.stderr)
