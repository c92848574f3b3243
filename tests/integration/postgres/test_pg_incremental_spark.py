"""An incremental snapshot of a TOASTed table updated inside its chunk windows, landed, applied by the Spark job
and compared with the source by `cdcd verify`: the mirror has every TOAST value."""

from __future__ import annotations

import asyncio
import io
from collections.abc import Callable
from pathlib import Path

import asyncpg
import pytest
from pg_helpers import Driver, marks
from test_pg_incremental import TOASTED, catch_up, source_of, unavailable_updates

from cdcd.capture.incremental import SnapshotJob
from cdcd.config import Config
from cdcd.events import Item, MarkKind
from cdcd.runtime.interfaces import Batch
from cdcd.sinks.landing import LandingSink
from cdcd.verify import verify
from cdcd.verify.mirror import read_table
from devtools.servers import PostgresServer

pytestmark = pytest.mark.spark


async def land(path: Path, items: list[Item], per_batch: int = 200) -> None:
    sink = LandingSink(path)
    await sink.open()
    for seq, start in enumerate(range(0, len(items), per_batch), 1):
        await sink.deliver(Batch(seq, items[start:start + per_batch]))
    await sink.close()


def apply_and_verify(landing: Path, target: Path, config: Config) -> tuple[int, str]:
    from cdcd.spark.job import run

    assert run(str(landing), str(target), once=True, fmt="parquet") == 0
    out = io.StringIO()
    return verify(config, str(target), out), out.getvalue()


async def test_the_mirror_of_a_table_snapshotted_under_updates_that_leave_toast_out_equals_the_source(
        spark: object, pg_server: PostgresServer, pg_db: str, make_config: Callable[..., Config],
        sql: Callable[[str], str], tmp_path: Path) -> None:
    sql(TOASTED + "INSERT INTO t SELECT g, 0, repeat(md5(g::text), 700) FROM generate_series(1, 45) g")
    dsn = pg_server.dsn(pg_db)
    cfg = make_config(["public.t"], snapshot={"mode": "never", "chunk_rows": 10})
    async with Driver(cfg, expand_blocks=False) as d:
        src = source_of(d)
        writer = await asyncpg.connect(dsn)

        async def touch(job: SnapshotJob) -> None:  # between the read and its HW: update a row, move another
            after = int(job.last_key[0]) if job.last_key else 0
            ids = [r["id"] for r in await writer.fetch("SELECT id FROM t WHERE id > $1 ORDER BY id LIMIT 2", after)]
            if len(ids) == 2:
                await writer.execute("UPDATE t SET n = n + 1 WHERE id = $1", ids[0])
                await writer.execute("UPDATE t SET id = -id WHERE id = $1", ids[1])

        src._chunks.after_read = touch
        got: list[Item] = []
        await catch_up(d, dsn, got)
        try:
            src.request_snapshot("public.t")
            got += await d.take(lambda items: bool(marks(items, MarkKind.INCREMENTAL_DONE)), timeout=120)
            await catch_up(d, dsn, got)
        finally:
            await writer.close()
    assert len(unavailable_updates(got)) >= 8
    await land(tmp_path / "landing", got)
    code, report = await asyncio.to_thread(apply_and_verify, tmp_path / "landing", tmp_path / "mirror", cfg)
    mirror = read_table(tmp_path / "mirror", "public.t")
    assert mirror is not None
    missing = sorted(r["id"] for r in mirror.to_pylist() if r["big"] is None)
    assert not missing, f"mirror rows without their TOAST value: {missing}"
    assert code == 0, report
