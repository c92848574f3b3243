"""Build the class-data sharing archive of the local Spark job (``python -m cdcd.sparkcds``; ``--force`` rebuilds).

The archive's name and the JVM flags that use it are in ``cdcd.spark.cds``. This module
is the build: a training run lands a few batches of every kind of change with the
daemon's landing sink and applies them to Delta with the real job; its JVM writes the
archive at exit. It lives outside ``cdcd.spark`` because the Spark job reads the landing
zone only through ``cdcd.landing`` and never imports the sink.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from cdcd.spark import cds, jars

#: A training run and its archive dump take about a minute on an idle machine with two cores.
BUILD_TIMEOUT = 900


def build(force: bool = False) -> Path | None:
    """Write the archive unless it exists; its path (None: disabled, no JVM, or no Delta jars cached)."""
    target = cds.archive()
    if target is None or jars.cached_jars() is None:
        return None
    if target.is_file() and not force:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=target.name + ".", suffix=".tmp", dir=target.parent)
    os.close(fd)
    os.unlink(tmp)  # the JVM creates it at exit
    env = {**os.environ, cds.DUMP_ENV: tmp}
    began = time.monotonic()
    try:
        proc = subprocess.run([sys.executable, "-m", "cdcd.sparkcds", "--train"], env=env, capture_output=True,
                              text=True, timeout=BUILD_TIMEOUT)
        if proc.returncode != 0 or not Path(tmp).is_file():
            raise RuntimeError(f"the CDS training run failed (exit {proc.returncode}, archive written: "
                               f"{Path(tmp).is_file()}); its output ends with:\n{proc.stderr[-3000:]}")
        os.replace(tmp, target)  # atomic: a JVM starting meanwhile sees no archive or the whole one
    finally:
        Path(tmp).unlink(missing_ok=True)
    for old in target.parent.glob("spark-*.jsa"):  # archives of jar sets or JVMs replaced since
        if old != target:
            old.unlink(missing_ok=True)
    print(f"cdcd-spark: CDS archive {target} ({target.stat().st_size // 2**20} MB) in "
          f"{time.monotonic() - began:.0f}s", file=sys.stderr)
    return target


def train() -> int:
    """The training run: land a few batches of every kind of change, apply them to Delta, stop the JVM.

    The JVM writes the archive when it exits, so this waits for it (the gateway's JVM
    exits when its stdin closes). Uses the landing sink to write the landing zone: only
    this tool does, never the job.
    """
    from cdcd.spark.job import run
    from cdcd.spark.session import session

    with tempfile.TemporaryDirectory(prefix="cdcd-cds-") as tmp:
        landing, target = Path(tmp) / "landing", Path(tmp) / "target"
        asyncio.run(_land(landing))
        for again in (False, True):  # the second run finds the tables: the MERGE path, table logs read
            if again:
                asyncio.run(_land(landing, more=True))
            code = run(str(landing), str(target), once=True, fmt="delta")
            if code != 0:
                return code
        spark = session("delta")
        gateway = spark.sparkContext._gateway
        spark.stop()
        proc = getattr(gateway, "proc", None)
        if proc is None:
            print("cdcd-spark: no JVM process of our own to stop (spark-submit?)", file=sys.stderr)
            return 1
        proc.stdin.close()  # the gateway JVM exits on EOF, writing the archive
        return int(proc.wait(timeout=BUILD_TIMEOUT))


async def _land(landing: Path, more: bool = False) -> None:
    from datetime import UTC, datetime

    import pyarrow as pa

    from cdcd.events import ChangeEvent, Column, Op, TableId, TableSchema
    from cdcd.landing.reader import landed_seqs
    from cdcd.positions import PgPosition
    from cdcd.runtime.interfaces import Batch
    from cdcd.sinks.landing import LandingSink

    cols = (Column("id", pa.int64(), "bigint", nullable=False), Column("v", pa.string(), "text"),
            Column("n", pa.decimal128(12, 2), "numeric(12,2)"),
            Column("at", pa.timestamp("us", tz="UTC"), "timestamptz"))
    schema = TableSchema(TableId("public", "train"), cols, ("id",), version=1)
    at = datetime(2024, 1, 2, tzinfo=UTC)
    base = 1000 if more else 100

    def ev(op: Op, lsn: int, i: int, **kw: object) -> ChangeEvent:
        return ChangeEvent(op, schema, PgPosition(lsn, i), tx_id=str(lsn), commit_ts=at, **kw)  # type: ignore[arg-type]

    def row(i: int, v: str | None = "x") -> dict[str, object]:
        return {"id": i, "v": v, "n": None, "at": at}

    batches = [[ev(Op.CREATE, base, i, after=row(i + (1000 if more else 0))) for i in range(1, 200)]]
    if more:
        batches.append([ev(Op.UPDATE, base + 1, 1, before={"id": 1}, after=row(1, "y")),
                        ev(Op.UPDATE, base + 1, 2, before={"id": 2}, after=row(20, None), unavailable=("v",)),
                        ev(Op.DELETE, base + 1, 3, before={"id": 3}),
                        ev(Op.TRUNCATE, base + 2, 1)])
    sink = LandingSink(landing)
    await sink.open()
    first = max(landed_seqs(landing), default=0) + 1 if landing.is_dir() else 1
    for seq, events in enumerate(batches, start=first):
        await sink.deliver(Batch(seq, list[Any](events)))
    await sink.close()


def main(argv: list[str]) -> int:
    if argv[1:] == ["--train"]:
        return train()
    force = argv[1:] == ["--force"]
    try:
        built = build(force)
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
        print(f"cdcd-spark: no CDS archive: {exc}", file=sys.stderr)
        return 1
    if built is None:
        print("cdcd-spark: no CDS archive (CDCD_SPARK_CDS=off, no java, or the Delta jars are not cached)",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
