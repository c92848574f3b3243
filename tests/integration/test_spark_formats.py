"""One ordering rule in every target format (Delta Lake, Iceberg, Parquet), with the real jars and real Spark.

Batches are landed by the real landing sink and applied by the consumer's
``run`` in one shared local session (the cached Delta/Iceberg jars of
``scripts/bootstrap.sh``).
"""

from __future__ import annotations

import json
from decimal import Decimal
from pathlib import Path

import pyarrow as pa
import pytest
import test_spark_consumer
from test_spark_consumer import FORMATS, V1, V2, ev, land, mirror, row, rows_of

from cdcd.events import ChangeEvent, Column, Mark, MarkKind, Op, TableId, TableSchema
from cdcd.positions import PgPosition
from cdcd.spark.job import MergeFailed

pytestmark = pytest.mark.spark

TABLE = "public.orders"


def big(i: int) -> str:
    return f"<{i}>" + "t" * 3000  # a TOASTed value in PostgreSQL


def values(target: Path, table: str = TABLE) -> dict[object, tuple[Decimal, str | None]]:
    return {k: (r["amount"], r["big"]) for k, r in mirror(target, table).items()}  # type: ignore[misc]


def apply(landing: Path, target: Path, fmt: str) -> None:
    from cdcd.spark.job import run

    assert run(str(landing), str(target), once=True, fmt=fmt) == 0


def snapshot(ids: list[int], lsn: int = 100, schema: TableSchema = V1) -> list[ChangeEvent]:
    return [ev(Op.READ, lsn, 0, schema, after=row(i, amount=Decimal(f"{i}.50"), big=big(i)), snapshot=True)
            for i in ids]


def moved(lsn: int, seq: int, old: int, new: int, amount: str, schema: TableSchema = V1) -> ChangeEvent:
    """A key change whose TOASTed column is unchanged: unavailable in the new image."""
    return ev(Op.UPDATE, lsn, seq, schema, before=row(old), after=row(new, amount=Decimal(amount), big=None),
              unavailable=("big",))


#: The key-change cases share one landing and two consumer runs (issue 32: a run's fixed cost, not its rows, is most
#: of a Spark test's time), each case in a table of its own: ``orders`` applied batch by batch, ``orders_b`` in one
#: merge, ``orders_c`` the key shift. Their positions rise across the landing, as the daemon lands them.
TABLE_B, TABLE_C = "public.orders_b", "public.orders_c"
V1_B = TableSchema(TableId("public", "orders_b"), V1.columns, ("id",), version=1)
V1_C = TableSchema(TableId("public", "orders_c"), V1.columns, ("id",), version=1)


@pytest.mark.parametrize("fmt", FORMATS)
async def test_key_changes_keep_the_unchanged_toast_value_and_every_row(
    spark: object, tmp_path: Path, fmt: str
) -> None:
    """`UPDATE t SET id = 2 WHERE id = 1` with an unchanged TOASTed column: the value moves with the row.

    The old row's last update and the key change land in different batches; applied batch by batch
    (``orders``: the value is in the mirror) or in one merge (``orders_b``: it is in the events).

    ``orders_c``: `UPDATE t SET id = id + 1` over ids 1..3 with a deferrable key (REPLICA IDENTITY FULL).
    PostgreSQL moves row 1 to key 2 while row 2 still holds it, then row 2 to 3, row 3 to 4: the delete
    of old key 2 comes after the row that moved into key 2. Other sequences in one transaction still
    delete: a row moved twice, a row updated then moved, a row inserted then moved.
    """
    landing, target = tmp_path / "landing", tmp_path / "target"

    def toast_case(base: int, schema: TableSchema) -> list[list[ChangeEvent]]:
        return [
            snapshot([1, 5], base + 100, schema),
            [ev(Op.UPDATE, base + 200, 1, schema, before={"id": 1}, after=row(1, amount=Decimal("7.00"), big=None),
                unavailable=("big",))],
            [moved(base + 300, 1, 1, 2, "7.00", schema)],
            [moved(base + 400, 1, 5, 6, "5.50", schema), moved(base + 400, 2, 6, 7, "5.75", schema)],  # moved twice
        ]

    by_batch, together = toast_case(0, V1), toast_case(1000, V1_B)
    shift = [moved(350, 1, 1, 2, "1.50", V1_C), moved(350, 2, 2, 3, "2.50", V1_C), moved(350, 3, 3, 4, "3.50", V1_C)]
    others = [
        moved(410, 1, 10, 11, "10.50", V1_C), moved(410, 2, 11, 12, "10.50", V1_C),
        ev(Op.UPDATE, 420, 1, V1_C, before={"id": 20}, after=row(20, amount=Decimal("9.00"), big=None),
           unavailable=("big",)),
        moved(420, 2, 20, 21, "9.00", V1_C),
        ev(Op.CREATE, 430, 1, V1_C, after=row(30, amount=Decimal("30.50"), big=big(30))),
        moved(430, 2, 30, 31, "30.50", V1_C),
    ]
    # first run: orders' old row and orders_c's rows 1..3 are in the mirror when their key changes come
    await land(landing, [by_batch[0] + snapshot([1, 2, 3, 10, 20], 100, V1_C), by_batch[1]], [1, 2])
    apply(landing, target, fmt)
    # second run: orders' and orders_c's key changes, and every batch of orders_b in one merge
    await land(landing, [by_batch[2] + shift, by_batch[3] + others, *together], [3, 4, 5, 6, 7, 8])
    apply(landing, target, fmt)
    moved_toast = {2: (Decimal("7.00"), big(1)), 7: (Decimal("5.75"), big(5))}
    assert values(target) == moved_toast
    assert values(target, TABLE_B) == moved_toast
    assert values(target, TABLE_C) == {
        2: (Decimal("1.50"), big(1)), 3: (Decimal("2.50"), big(2)), 4: (Decimal("3.50"), big(3)),
        12: (Decimal("10.50"), big(10)), 21: (Decimal("9.00"), big(20)), 31: (Decimal("30.50"), big(30)),
    }


@pytest.mark.parametrize("fmt", ["delta", "iceberg"])
async def test_the_table_records_its_batches_and_a_batch_applied_twice_changes_nothing(
    spark: object, tmp_path: Path, fmt: str
) -> None:
    """Exactly once per batch, recorded in the table's own commits (Delta txn, Iceberg snapshot summary).

    With the consumer's own record gone, every batch is offered again: the tables skip
    what they hold (no new Delta version, no new Iceberg snapshot) and stay as they were.
    """
    from pyspark.sql import SparkSession

    from cdcd.spark.formats import lakehouse_format

    landing, target = tmp_path / "landing", tmp_path / "target"
    h = test_spark_consumer.history()
    await land(landing, h, [1, 2, 3, 4, 5])
    apply(landing, target, fmt)
    session = SparkSession.getActiveSession()
    assert session is not None
    names = lakehouse_format(fmt, target)
    for kind, step in (("tables", "mirror"), ("changelog", "changelog")):
        assert names.applied_seq(session, kind, "public", "orders", step) == 5
    assert names.applied_seq(session, "tables", "public", "log", "mirror") == 4  # the log's last batch

    def commits(kind: str) -> int:
        ref = names.ref(kind, "public", "orders")
        if fmt == "delta":
            return session.sql(f"DESCRIBE HISTORY {ref}").count()
        return session.table(ref + ".`snapshots`").count()

    before = {k: commits(k) for k in ("tables", "changelog")}
    mirror_before = sorted(rows_of(target, TABLE), key=lambda r: r["id"])
    log_before = sorted(rows_of(target, TABLE, "changelog"), key=lambda r: (r["_cdc_pos"], r["_cdc_op"]))
    (target / "state" / "consumer.json").unlink()  # the consumer forgot: batch 1..5 come again
    apply(landing, target, fmt)
    assert {k: commits(k) for k in ("tables", "changelog")} == before
    assert sorted(rows_of(target, TABLE), key=lambda r: r["id"]) == mirror_before
    assert sorted(rows_of(target, TABLE, "changelog"), key=lambda r: (r["_cdc_pos"], r["_cdc_op"])) == log_before


def delta_adds(table: Path) -> dict[str, int]:
    """The data files a Delta table's log adds (path: size), from its JSON commits."""
    out: dict[str, int] = {}
    for commit in sorted((table / "_delta_log").glob("*.json")):
        for line in commit.read_text().splitlines():
            action = json.loads(line)
            if "add" in action:
                out[action["add"]["path"]] = int(action["add"]["size"])
    return out


async def test_new_delta_tables_take_the_landed_files_as_they_are(spark: object, tmp_path: Path) -> None:
    """Inserts into new tables: the landed Parquet files become the change-log's and the mirror's data files.

    Both tables record the batch in the same transaction as a Spark write would (a second
    application adds nothing), read back as the events, and later merges (an update, a
    delete, a new column) work on the adopted files.
    """
    from pyspark.sql import SparkSession

    from cdcd.spark.delta import Delta

    landing, target = tmp_path / "landing", tmp_path / "target"
    await land(landing, [snapshot([1, 2, 3]), snapshot([4, 5])], [1, 2])
    landed = {p.stem: p.stat().st_size for p in (landing / "data").glob("*.parquet")}
    assert len(landed) == 2
    apply(landing, target, "delta")
    session = SparkSession.getActiveSession()
    assert session is not None
    names = Delta(target)
    for kind, step in (("tables", "mirror"), ("changelog", "changelog")):
        adds = delta_adds(names.location(kind, "public", "orders"))
        assert sorted((p.rsplit("-", 1)[0], size) for p, size in adds.items()) == sorted(landed.items()), adds
        assert names.applied_seq(session, kind, "public", "orders", step) == 2
    assert values(target) == {i: (Decimal(f"{i}.50"), big(i)) for i in range(1, 6)}
    assert [r["_cdc_op"] for r in rows_of(target, TABLE, "changelog")] == ["r"] * 5
    assert set(rows_of(target, TABLE)[0]) == {"id", "amount", "at", "big", "blob", "_cdc_op", "_cdc_pos", "_cdc_tx",
                                              "_cdc_commit_ts", "_cdc_batch"}  # not the files' other columns

    (target / "state" / "consumer.json").unlink()  # the consumer forgot: batches 1 and 2 come again
    apply(landing, target, "delta")
    for kind in ("tables", "changelog"):
        assert len(delta_adds(names.location(kind, "public", "orders"))) == 2
    assert len(rows_of(target, TABLE, "changelog")) == 5

    await land(landing, [[ev(Op.UPDATE, 200, 1, schema=V2, before={"id": 1},
                             after=row(1, amount=Decimal("9.00"), big=big(1), note="n")),
                          ev(Op.DELETE, 200, 2, schema=V2, before={"id": 2})]], [3])
    apply(landing, target, "delta")
    assert values(target) == {1: (Decimal("9.00"), big(1)), **{i: (Decimal(f"{i}.50"), big(i)) for i in (3, 4, 5)}}
    assert mirror(target, TABLE)[1]["note"] == "n" and mirror(target, TABLE)[3]["note"] is None
    assert len(rows_of(target, TABLE, "changelog")) == 7

    # a recorded schema change gives the change-log its schema-change column (cdcd.spark.schemalog), which the
    # landed files lack: the files of later batches still join it as they are
    v3 = TableSchema(V2.table, (*V2.columns, Column("more", pa.string(), "text")), V2.key, version=3)
    await land(landing, [[Mark(MarkKind.SCHEMA, PgPosition(300, 0), {"table": "public.orders", "change": v3,
                                                                     "ddl": None}),
                          ev(Op.CREATE, 300, 1, schema=v3, after=row(6, big=big(6), note="n6", more="m6"))]], [4])
    apply(landing, target, "delta")
    before = {p.stem for p in (landing / "data").glob("*.parquet")}
    await land(landing, [[ev(Op.CREATE, 400, 1, schema=v3, after=row(7, big=big(7), note="n7", more="m7"))]], [5])
    apply(landing, target, "delta")
    (fifth,) = {p.stem for p in (landing / "data").glob("*.parquet")} - before
    log = delta_adds(names.location("changelog", "public", "orders"))
    assert any(p.rsplit("-", 1)[0] == fifth for p in log), log
    events = rows_of(target, TABLE, "changelog")
    assert [(r["id"], r["more"], r["_cdc_schema_change"]) for r in events if r["id"] == 7] == [(7, "m7", None)]
    assert [r["_cdc_op"] for r in events].count("s") == 1


async def test_the_record_of_applied_batches_follows_the_consumers_commits_and_a_failure(
    spark: object, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Within one process the consumer asks a table for its record of applied batches once, then keeps it from
    its own commits; after a failed merge (here the mirror's statement fails once the change-log's commit is
    made) it asks the tables again, so the retry skips the change-log and does not add its events twice."""
    from pyspark.sql import SparkSession

    from cdcd.spark.delta import Delta
    from cdcd.spark.job import Consumer

    session = SparkSession.getActiveSession()
    assert session is not None
    reads: list[tuple[str, str]] = []
    read = Delta.applied_seq

    def counted(*args: object) -> int:
        reads.append((str(args[2]), str(args[5])))
        return read(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(Delta, "applied_seq", counted)
    landing, target = tmp_path / "landing", tmp_path / "target"
    consumer = Consumer(session, landing, target, "delta")
    await land(landing, [snapshot([1, 2, 3])], [1])
    consumer.apply_upto(1)
    await land(landing, [[ev(Op.CREATE, 200, 1, after=row(4, amount=Decimal("4.00"), big=big(4)))]], [2])
    consumer.apply_upto(2)
    assert reads == []  # created by this process, then kept from its own commits

    def failing(*args: object, **kwargs: object) -> None:
        raise RuntimeError("the mirror's statement failed")

    await land(landing, [[ev(Op.CREATE, 300, 1, after=row(5, amount=Decimal("5.00"), big=big(5)))]], [3])
    with monkeypatch.context() as m:
        m.setattr(Delta, "apply_mirror", failing)
        # the consumer names the batches and the table of a failed merge (cdcd.spark.job.MergeFailed)
        with pytest.raises(MergeFailed, match=r"batches 3\.\.3 of public\.orders: the mirror's statement failed"):
            consumer.apply_upto(3)
    consumer.apply_upto(3)  # the retry in the same process
    assert sorted(reads) == [("changelog", "changelog"), ("tables", "mirror")]
    assert sorted(r["id"] for r in rows_of(target, TABLE, "changelog")) == [1, 2, 3, 4, 5]
    assert values(target) == {**{i: (Decimal(f"{i}.50"), big(i)) for i in (1, 2, 3)},
                              4: (Decimal("4.00"), big(4)), 5: (Decimal("5.00"), big(5))}


async def test_new_keys_join_an_existing_delta_mirror_as_landed_files_and_known_keys_are_merged(
    spark: object, tmp_path: Path
) -> None:
    """Inserts of keys the mirror does not hold (it has no row in their key range): the landed file joins the
    existing mirror as it is. Not when the mirror holds a row in that range (an insert of a key a resumed
    snapshot already read), when the batch changes the mirror's schema, or when a column was added under
    column mapping (its data files name it otherwise): those merge, and every key is in the mirror once."""
    landing, target = tmp_path / "landing", tmp_path / "target"
    mirror_dir = target / "tables" / TABLE

    def adopted(seq: int) -> bool:
        return any(p.startswith(f"{seq:020d}-") for p in delta_adds(mirror_dir))

    batches = [
        snapshot([1, 2, 3]),
        [ev(Op.CREATE, 200, 1, after=row(10, amount=Decimal("10.00"), big=big(10))),
         ev(Op.CREATE, 200, 2, after=row(11, amount=Decimal("11.00"), big=big(11)))],
        [ev(Op.CREATE, 300, 1, after=row(2, amount=Decimal("2.75"), big=big(2)))],  # the mirror holds 2
        [ev(Op.CREATE, 400, 1, schema=V2, after=row(20, amount=Decimal("20.00"), big=big(20), note="a"))],
        [ev(Op.CREATE, 500, 1, schema=V2, after=row(30, amount=Decimal("30.00"), big=big(30), note="b"))],
    ]
    for seq, batch in enumerate(batches, 1):
        await land(landing, [batch], [seq])
        apply(landing, target, "delta")
    assert [adopted(seq) for seq in range(1, 6)] == [True, True, False, False, False]
    assert values(target) == {1: (Decimal("1.50"), big(1)), 2: (Decimal("2.75"), big(2)),
                              3: (Decimal("3.50"), big(3)), 10: (Decimal("10.00"), big(10)),
                              11: (Decimal("11.00"), big(11)), 20: (Decimal("20.00"), big(20)),
                              30: (Decimal("30.00"), big(30))}
    ids = [r["id"] for r in rows_of(target, TABLE)]
    assert len(ids) == len(set(ids))
    assert {k: r["note"] for k, r in mirror(target, TABLE).items() if k in (20, 30)} == {20: "a", 30: "b"}
