"""The landing zone on object storage, against a real S3 server (versitygw): batches land and read back as on a
file system; a failure before the manifest leaves nothing visible and its orphans go at the next start; two
writers never both publish a seq; the store unreachable is retried, rejected credentials are fatal."""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path

import pyarrow as pa
import pytest
from faultproxy import FaultProxy
from support import s3

from cdcd.errors import SinkError, SinkFatal
from cdcd.events import ChangeEvent, Column, Op, TableId, TableSchema
from cdcd.landing import objstore, reader
from cdcd.positions import PgPosition
from cdcd.runtime.interfaces import Batch
from cdcd.sinks.landing import LandingSink
from devtools.s3server import S3Server

ZONE = "zone/one"
ORDERS = TableSchema(TableId("public", "orders"), (Column("id", pa.int64(), "bigint", nullable=False),
                                                   Column("amount", pa.decimal128(12, 2), "numeric(12,2)"),
                                                   Column("at", pa.timestamp("us", tz="UTC"), "timestamptz")),
                     ("id",), version=1)
ITEMS = TableSchema(TableId("public", "items"), (Column("k", pa.string(), "text"),), ("k",))
TS = datetime(2024, 5, 1, 12, 0, tzinfo=UTC)


def ev(op: Op, lsn: int, seq: int, schema: TableSchema = ORDERS, **kw: object) -> ChangeEvent:
    return ChangeEvent(op, schema, PgPosition(lsn, seq), tx_id=str(lsn), commit_ts=TS, **kw)  # type: ignore[arg-type]


def row(i: int) -> dict[str, object]:
    return {"id": i, "amount": Decimal("12.30"), "at": TS}


def mixed_batch(seq: int) -> Batch:
    """Every op, two tables, snapshot rows: the landed columns compared with a file-system zone's."""
    lsn = 1000 * seq
    return Batch(seq, [ev(Op.READ, lsn, 0, after=row(1), snapshot=True), ev(Op.CREATE, lsn + 1, 0, after=row(2)),
                       ev(Op.UPDATE, lsn + 2, 0, before=row(2), after=row(3)),
                       ev(Op.CREATE, lsn + 2, 1, schema=ITEMS, after={"k": "a"}),
                       ev(Op.DELETE, lsn + 3, 0, before={"id": 1}), ev(Op.TRUNCATE, lsn + 4, 0)])


def settings(server: S3Server, port: int | None = None, secret: str | None = None) -> objstore.Settings:
    return objstore.Settings(endpoint=f"http://127.0.0.1:{port or server.port}", region=server.region,
                             access_key_id=server.access_key, secret_access_key=secret or server.secret_key,
                             timeout_s=5)


def zone(server: S3Server, bucket: str) -> str:
    url = f"s3://{bucket}/{ZONE}"
    reader.use_store(url, settings(server))  # the reader reaches the same store
    return url


def small_batch(seq: int) -> Batch:
    return Batch(seq, [ev(Op.CREATE, 1000 + seq, 0, after=row(seq)), ev(Op.CREATE, 1000 + seq, 1, schema=ITEMS,
                                                                        after={"k": f"k{seq}"})])


async def test_batches_land_read_back_and_expire(s3_server: S3Server, s3_bucket: str, tmp_path: Path) -> None:
    url = zone(s3_server, s3_bucket)
    sink = LandingSink(url, retention_s=0, source_kind="postgres", s3=settings(s3_server))
    local = LandingSink(tmp_path, source_kind="postgres")
    assert await sink.open() == 0 and await local.open() == 0
    for seq in (1, 2):
        await sink.deliver(mixed_batch(seq))
        await local.deliver(mixed_batch(seq))
    acks = sink.acks()
    assert [await anext(acks), await anext(acks)] == [1, 2]  # landed: acked once the manifest is in place
    assert reader.landed_seqs(url) == [1, 2]
    on_s3, on_disk = reader.read_batches(url), reader.read_batches(tmp_path)
    for a, b in zip(on_s3, on_disk, strict=True):
        assert a.tables == b.tables  # the same rows, types and metadata columns as on a file system
        assert a.manifest.zone_id != b.manifest.zone_id and a.manifest.event_count == b.manifest.event_count
    keys = s3.keys(s3_server, s3_bucket)
    data = [k for k in keys if "/data/" in k]
    assert len(data) == 4 and all(k.count("-") == 2 for k in data)  # <seq>-<n>-<attempt>.parquet
    assert f"{ZONE}/zone.json" in keys and sink.status()["path"] == url
    [orders_file] = [f for f in reader.table_files(url, [(1, on_s3[0].manifest)])[("public", "orders")]]
    assert orders_file.path.startswith(f"s3://{s3_bucket}/{ZONE}/data/00000000000000000001-")
    # consumed markers and retention work as on a file system
    reader.mark_consumed(url, 1)
    assert reader.consumed_seqs(url) == [1] and reader.is_consumed(url, 1)
    await sink.committed(2)
    assert reader.landed_seqs(url) == [2]
    assert not [k for k in s3.keys(s3_server, s3_bucket) if "00000000000000000001" in k]
    await sink.close()
    again = LandingSink(url, s3=settings(s3_server))
    assert await again.open() == 2 and again._writer.zone_id == on_s3[1].manifest.zone_id
    with pytest.raises(SinkFatal, match="not above the last landed batch"):
        await again.deliver(small_batch(2))
    await again.close()
    await local.close()


async def test_failure_before_the_manifest_shows_nothing_and_orphans_go_at_start(
        s3_server: S3Server, s3_bucket: str) -> None:
    url = zone(s3_server, s3_bucket)
    sink = LandingSink(url, s3=settings(s3_server))
    await sink.open()
    # The server cannot create the manifest (a file holds its parent's name: 409 ObjectParentIsFile), the data
    # files go in
    blocker = s3_server.bucket_dir(s3_bucket) / ZONE / "manifests"
    assert not blocker.exists()
    blocker.write_bytes(b"")
    with pytest.raises(SinkError) as failed:
        await sink.deliver(small_batch(1))
    assert not failed.value.fatal and "manifests/00000000000000000001.json" in str(failed.value), failed.value
    assert "checkpoint did not move" in sink.status()["last_write_error"]
    orphans = [k for k in s3.keys(s3_server, s3_bucket) if "/data/" in k]
    assert len(orphans) == 2 and reader.landed_seqs(url) == []  # readers never see them
    await sink.close()
    blocker.unlink()
    restarted = LandingSink(url, s3=settings(s3_server))
    assert await restarted.open() == 0
    assert not [k for k in s3.keys(s3_server, s3_bucket) if "/data/" in k]  # removed on start
    await restarted.deliver(small_batch(1))
    assert reader.landed_seqs(url) == [1] and len(reader.read_batch(url, 1).files) == 2
    await restarted.close()


async def test_two_writers_never_both_publish_a_seq(s3_server: S3Server, s3_bucket: str) -> None:
    url = zone(s3_server, s3_bucket)
    first, second = LandingSink(url, s3=settings(s3_server)), LandingSink(url, s3=settings(s3_server))
    assert await first.open() == 0 and await second.open() == 0
    await first.deliver(small_batch(1))
    with pytest.raises(SinkFatal, match="published by another writer"):
        await second.deliver(small_batch(1))
    assert reader.read_manifest(url, 1).run_id == first.run_id
    assert len([k for k in s3.keys(s3_server, s3_bucket) if "/data/" in k]) == 2  # the loser's files are gone
    await first.close()
    await second.close()


async def test_unreachable_store_is_retried_and_rejected_keys_are_fatal(s3_server: S3Server, s3_bucket: str) -> None:
    url = zone(s3_server, s3_bucket)
    with FaultProxy(s3_server.port) as proxy:
        proxy.refuse(3600)  # unreachable at start: open() waits for it, within its budget
        gives_up = LandingSink(url, s3=settings(s3_server, port=proxy.port), open_retry_s=1, open_retry_max_s=0.2)
        with pytest.raises(SinkFatal, match="did not answer for"):
            await gives_up.open()
        sink = LandingSink(url, s3=settings(s3_server, port=proxy.port), open_retry_max_s=0.2)
        opening = asyncio.create_task(sink.open())
        deadline = time.monotonic() + 60
        while not sink.write_failures and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert not opening.done() and "reachable" in str(sink.last_write_error)
        proxy.refuse(0)
        assert await asyncio.wait_for(opening, 60) == 0 and sink.failing_since is None
        sink.write_failures = 0
        proxy.refuse(600)  # the store goes away: no new connections, the open ones cut
        proxy.reset()
        with pytest.raises(SinkError) as failed:
            await sink.deliver(small_batch(1))
        assert not failed.value.fatal and "reachable" in str(failed.value) and sink.write_failures == 1
        assert reader.landed_seqs(url) == []
        proxy.refuse(0)  # it is back: the same batch lands
        deadline = time.monotonic() + 30
        while True:
            try:
                await sink.deliver(small_batch(1))
                break
            except SinkError:
                if time.monotonic() > deadline:
                    raise
        assert reader.landed_seqs(url) == [1] and sink.status()["failing_since"] is None
        await sink.close()
    wrong = LandingSink(url, s3=settings(s3_server, secret="not-the-secret"))
    with pytest.raises(SinkFatal) as refused:
        await wrong.open()
    text = str(refused.value)
    assert f"bucket {s3_bucket}" in text and "landing.s3.access_key_id" in text
    assert "not-the-secret" not in text and s3_server.secret_key not in text


async def test_a_retry_after_a_lost_answer_finds_its_own_manifest(s3_server: S3Server, s3_bucket: str) -> None:
    """The manifest PUT went through but its answer was lost: the runtime retries the batch, the conditional PUT is
    refused, and the manifest is this run's own, so the batch counts as landed and the retry's files go."""
    url = zone(s3_server, s3_bucket)
    sink = LandingSink(url, s3=settings(s3_server))
    await sink.open()
    writer = sink._writer
    first = await asyncio.to_thread(writer.land, small_batch(1))
    again = await asyncio.to_thread(writer.land, small_batch(1))  # the retry of the same batch by the same run
    assert again.to_json() == first.to_json() and reader.landed_seqs(url) == [1]
    data = [k.rsplit("/", 1)[1] for k in s3.keys(s3_server, s3_bucket) if "/data/" in k]
    assert sorted(data) == sorted(f.path.rsplit("/", 1)[1] for f in first.files)  # only the published attempt's
    await sink.close()
