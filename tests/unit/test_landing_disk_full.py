"""The landing sink on a real, small tmpfs that runs full in the middle of a batch."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pytest
from support.disk import fill, tmpfs

from cdcd.errors import SinkError
from cdcd.events import ChangeEvent, Column, Op, TableId, TableSchema
from cdcd.landing.reader import landed_seqs, read_batches
from cdcd.positions import PgPosition
from cdcd.runtime.interfaces import Batch
from cdcd.sinks.landing import LandingSink

SMALL = TableSchema(TableId("public", "small"), (Column("k", pa.string(), "text"),), ("k",))
BIG = TableSchema(TableId("public", "big"), (Column("id", pa.int64(), "bigint", nullable=False),
                                             Column("blob", pa.binary(), "bytea")), ("id",))


@pytest.fixture
def mount(tmp_path: Path) -> Iterator[Path]:
    with tmpfs(tmp_path / "landing", "4m") as path:
        yield path


def batch(seq: int) -> Batch:
    """A small file first, then one of 1 MB that cannot compress."""
    return Batch(seq, [
        ChangeEvent(Op.CREATE, SMALL, PgPosition(100 * seq, 1), tx_id="1", after={"k": "a"}),
        ChangeEvent(Op.CREATE, BIG, PgPosition(100 * seq, 2), tx_id="1", after={"id": 1, "blob": os.urandom(1 << 20)}),
    ])


async def test_disk_full_mid_batch_leaves_nothing_and_the_retry_lands_it(mount: Path) -> None:
    sink = LandingSink(mount)
    await sink.open()
    await sink.deliver(batch(1))
    filler = fill(mount, leave=256 * 1024)  # room for the small file, not for the big one
    with pytest.raises(SinkError) as err:
        await sink.deliver(batch(2))
    # The small file was renamed into data/ before the big one failed: it is gone again, as is every temp file.
    assert sorted(os.listdir(mount / "data")) == [f"{1:020d}-{n:04d}.parquet" for n in (0, 1)]
    assert os.listdir(mount / "manifests") == [f"{1:020d}.json"]
    assert landed_seqs(mount) == [1]
    assert "batch 2 could not be landed" in str(err.value) and "No space left on device" in str(err.value)
    assert f"{mount}/data/" in str(err.value) and "free space" in str(err.value)
    assert sink.status()["failing_since"] is not None and sink.status()["write_failures"] == 1
    filler.unlink()
    await sink.deliver(batch(2))
    assert sink.status()["failing_since"] is None
    assert [b.seq for b in read_batches(mount)] == [1, 2]
    await sink.close()
