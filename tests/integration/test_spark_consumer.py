"""The Spark consumer on batches landed by the real landing sink, with a real local Spark."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from cdcd.events import ChangeEvent, Column, Op, TableId, TableSchema
from cdcd.landing.reader import consumed_seqs
from cdcd.positions import PgPosition
from cdcd.runtime.interfaces import Batch
from cdcd.sinks.landing import LandingSink

pytestmark = pytest.mark.spark
FORMATS = ["delta", "iceberg", "parquet"]

T = TableId("public", "orders")
COLS = (
    Column("id", pa.int64(), "bigint", nullable=False),
    Column("amount", pa.decimal128(12, 2), "numeric(12,2)"),
    Column("at", pa.timestamp("us", tz="UTC"), "timestamptz"),
    Column("big", pa.string(), "text"),
    Column("blob", pa.binary(), "bytea"),
)
V1 = TableSchema(T, COLS, ("id",), version=1)
V2 = TableSchema(T, (*COLS, Column("note", pa.string(), "text")), ("id",), version=2)
LOG = TableSchema(TableId("public", "log"), (Column("k", pa.int32(), "int"), Column("v", pa.string(), "text")), ("k",))
TS = datetime(2024, 1, 2, 3, 4, 5, 678901, tzinfo=UTC)


def row(i: int, **over: object) -> dict[str, object]:
    return {"id": i, "amount": Decimal(f"{i}.50"), "at": TS, "big": "x" * 3000, "blob": bytes([i]), **over}


def ev(op: Op, lsn: int, seq: int, schema: TableSchema = V1, **kw: object) -> ChangeEvent:
    return ChangeEvent(op, schema, PgPosition(lsn, seq), tx_id=str(lsn), commit_ts=TS, **kw)  # type: ignore[arg-type]


def history() -> list[list[ChangeEvent]]:
    snap = [ev(Op.READ, 100, 0, after=row(i), snapshot=True) for i in range(1, 6)]
    snap += [ev(Op.READ, 100, 0, schema=LOG, after={"k": k, "v": "old"}, snapshot=True) for k in (1, 2)]
    stream = [
        ev(Op.CREATE, 200, 1, after=row(6)),
        ev(Op.UPDATE, 200, 2, before=row(2), after=row(2, amount=Decimal("99.99"))),
        ev(Op.UPDATE, 300, 1, before={"id": 3}, after=row(3, big=None, amount=Decimal("7.00")), unavailable=("big",)),
        ev(Op.UPDATE, 300, 2, before=row(4), after=row(40)),  # key change 4 -> 40
        ev(Op.DELETE, 300, 3, before={"id": 5}),
        ev(Op.CREATE, 300, 4, schema=LOG, after={"k": 3, "v": "gone"}),
        ev(Op.TRUNCATE, 400, 1, schema=LOG),
        ev(Op.CREATE, 400, 2, schema=LOG, after={"k": 1, "v": "new"}),
    ]
    later = [
        ev(Op.UPDATE, 500, 1, schema=V2, before={"id": 1}, after=row(1, big=None, note="n"), unavailable=("big",)),
        ev(Op.DELETE, 500, 2, schema=V2, before={"id": 6}),
    ]
    return [snap[:4], snap[4:], stream[:3], stream[3:], later]


EXPECTED_ORDERS = {
    1: {"amount": Decimal("1.50"), "big": "x" * 3000, "note": "n"},
    2: {"amount": Decimal("99.99"), "big": "x" * 3000, "note": None},
    3: {"amount": Decimal("7.00"), "big": "x" * 3000, "note": None},
    40: {"amount": Decimal("40.50"), "big": "x" * 3000, "note": None},
}


async def land(path: Path, batches: list[list[ChangeEvent]], seqs: list[int]) -> None:
    sink = LandingSink(path)
    await sink.open()
    for seq, events in zip(seqs, batches, strict=True):
        await sink.deliver(Batch(seq, list(events)))
    await sink.close()


def rows_of(target: Path, table: str, kind: str = "tables") -> list[dict[str, Any]]:
    """A mirror or change-log of any format (Parquet, Delta Lake, Iceberg), as verify reads it."""
    from cdcd.verify.mirror import read_table

    found = read_table(target, table, kind)
    assert found is not None, f"no {kind} table {table} under {target}"
    return found.to_pylist()  # type: ignore[no-any-return]


def mirror(target: Path, table: str) -> dict[object, dict[str, object]]:
    rows = rows_of(target, table)
    out = {r.get("id", r.get("k")): r for r in rows}
    assert len(out) == len(rows), "a key is in the mirror twice"
    return out


def changelog_positions(target: Path, table: str) -> list[dict[str, Any]]:
    return sorted(({"_cdc_pos": r["_cdc_pos"], "_cdc_op": r["_cdc_op"]} for r in rows_of(target, table, "changelog")),
                  key=lambda r: (r["_cdc_pos"], r["_cdc_op"]))


@pytest.mark.parametrize("fmt", FORMATS)
async def test_consumer_applies_every_kind_of_change_exactly_once(spark: object, tmp_path: Path, fmt: str) -> None:
    from cdcd.spark.job import run

    landing, target = tmp_path / "landing", tmp_path / "target"
    h = history()
    await land(landing, h[:4], [1, 2, 5, 6])  # seqs with gaps, as the runtime makes them
    assert run(str(landing), str(target), once=True, fmt=fmt) == 0
    assert consumed_seqs(landing) == [1, 2, 5, 6]
    orders = mirror(target, "public.orders")
    assert set(orders) == {1, 2, 3, 6, 40}
    assert orders[3]["big"] == "x" * 3000 and orders[3]["amount"] == Decimal("7.00")  # TOAST kept
    assert orders[6]["at"] == TS and orders[6]["blob"] == bytes([6]) and orders[6]["_cdc_op"] == "c"
    assert {k: v["v"] for k, v in mirror(target, "public.log").items()} == {1: "new"}  # truncate
    if fmt == "parquet":
        assert all(p.is_dir() and p.name.startswith("cdc_bucket=")
                   for p in (target / "tables" / "public.orders").iterdir())

    await land(landing, h[4:], [7])  # an added column, TOAST again, a delete
    assert run(str(landing), str(target), once=True, fmt=fmt) == 0
    orders = mirror(target, "public.orders")
    assert {k: {c: v[c] for c in ("amount", "big", "note")} for k, v in orders.items()} == EXPECTED_ORDERS
    log_before = changelog_positions(target, "public.orders")
    assert len(log_before) == 5 + 5 + 2

    # the daemon crashed and re-delivers the stream under new seqs (a new landing run), plus one new event
    again = [*h[2], *h[3], *h[4], ev(Op.CREATE, 600, 1, schema=V2, after=row(7, note="z"))]
    await land(landing, [again], [9])
    assert run(str(landing), str(target), once=True, fmt=fmt) == 0
    orders = mirror(target, "public.orders")
    assert {k: {c: v[c] for c in ("amount", "big", "note")} for k, v in orders.items() if k != 7} == EXPECTED_ORDERS
    assert orders[7]["note"] == "z"
    assert {k: v["v"] for k, v in mirror(target, "public.log").items()} == {1: "new"}
    assert changelog_positions(target, "public.orders") == sorted(
        [*log_before, {"_cdc_pos": PgPosition(600, 1).encoded, "_cdc_op": "c"}],
        key=lambda r: (r["_cdc_pos"], r["_cdc_op"]),
    )
    state = json.loads((target / "state" / "consumer.json").read_text())
    assert state["applied_seq"] == 9


async def test_crash_inside_a_micro_batch_is_rolled_back_or_forward(spark: object, tmp_path: Path) -> None:
    from cdcd.spark.job import Consumer, run
    from cdcd.spark.state import TargetStore

    landing, target = tmp_path / "landing", tmp_path / "target"
    h = history()
    await land(landing, h[:4], [1, 2, 3, 4])
    assert run(str(landing), str(target), once=True, fmt="parquet") == 0
    expected = mirror(target, "public.orders")
    await land(landing, h[4:], [5])

    class CrashAfterJournal(TargetStore):
        def roll_forward(self) -> object:  # the process dies after the commit record, before the moves
            raise SystemExit("crash")

    consumer = Consumer(spark, landing, target)  # type: ignore[arg-type]
    consumer.store.__class__ = CrashAfterJournal
    with pytest.raises(SystemExit):
        consumer.apply_upto(5)
    assert (target / "state" / "journal.json").exists()
    assert 5 not in consumed_seqs(landing)
    assert mirror(target, "public.orders") == expected  # nothing moved yet
    assert run(str(landing), str(target), once=True, fmt="parquet") == 0  # recovery rolls the journal forward
    orders = mirror(target, "public.orders")
    assert {k: {c: v[c] for c in ("amount", "big", "note")} for k, v in orders.items()} == EXPECTED_ORDERS
    assert 5 in consumed_seqs(landing)
    assert len(changelog_positions(target, "public.orders")) == 12
    assert not any((target / "work").iterdir())


def bucket_files(target: Path, table: str) -> dict[int, list[str]]:
    root = target / "tables" / table
    return {int(d.name.split("=")[1]): sorted(f.name for f in d.iterdir()) for d in root.iterdir()}


async def test_buckets_sized_from_rows_and_small_batches_rewrite_only_their_buckets(
    spark: object, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pyspark.sql import SparkSession
    from pyspark.sql import functions as F

    import cdcd.spark.parquet as parquet
    from cdcd.spark.job import Consumer

    monkeypatch.setattr(parquet, "ROWS_PER_BUCKET", 8)  # tiny buckets: the sizing shows on 100 rows
    landing, target = tmp_path / "landing", tmp_path / "target"
    table = "public.log"

    def state() -> dict[str, object]:
        return json.loads((target / "state" / "consumer.json").read_text())["tables"][table]  # type: ignore[no-any-return]

    def apply(seq: int) -> None:
        Consumer(spark, landing, target, buckets=4).apply_upto(seq)  # type: ignore[arg-type]

    await land(landing, [[ev(Op.READ, 100, 0, schema=LOG, after={"k": k, "v": "s"}, snapshot=True)
                          for k in range(1, 101)]], [1])
    apply(1)
    assert (state()["buckets"], state()["rows"]) == (16, 100)  # 100 rows / 8 per bucket -> 16, not the 4 asked
    before = bucket_files(target, table)
    assert set(before) <= set(range(16))

    await land(landing, [[ev(Op.UPDATE, 200, 1, schema=LOG, before={"k": 5}, after={"k": 5, "v": "new"})]], [2])
    apply(2)
    after = bucket_files(target, table)
    changed = {b for b in set(before) | set(after) if before.get(b) != after.get(b)}
    assert len(changed) == 1  # the bucket holding key 5, and no other
    assert (state()["buckets"], state()["rows"]) == (16, 100)

    # a batch that rewrites every bucket anyway re-buckets the grown table: 400 rows / 8 -> 64
    await land(landing, [[ev(Op.CREATE, 300, i, schema=LOG, after={"k": k, "v": "c"})
                          for i, k in enumerate(range(101, 401), 1)]], [3])
    apply(3)
    assert (state()["buckets"], state()["rows"]) == (64, 400)
    rows = mirror(target, table)
    assert set(rows) == set(range(1, 401)) and rows[5]["v"] == "new" and rows[7]["v"] == "s"
    assert isinstance(spark, SparkSession)
    placed = spark.read.parquet(str(target / "tables" / table))
    assert placed.filter(F.col("cdc_bucket") != F.pmod(F.xxhash64("k"), F.lit(64))).count() == 0

    before = bucket_files(target, table)
    await land(landing, [[ev(Op.DELETE, 400, 1, schema=LOG, before={"k": 7})]], [4])
    apply(4)
    after = bucket_files(target, table)
    assert len({b for b in set(before) | set(after) if before.get(b) != after.get(b)}) == 1
    assert state()["rows"] == 399 and 7 not in mirror(target, table)
