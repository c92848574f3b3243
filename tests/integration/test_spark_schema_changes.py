"""Schema changes by column identity into Delta Lake, Iceberg and Parquet (docs/spark.md, "Schema changes").

Batches landed by the real landing sink under four schema versions of one table whose columns carry their
ids and fills (landing format 4), applied one batch at a time or in one merge, with the real jars and
Spark: widenings in place (int -> bigint, a decimal's precision) and by a rewrite where the format cannot
(a decimal's scale on Iceberg), a rename, a column added with a constant default, a column dropped and
added again under its name with another type. Then a change that would lose values (text -> bigint):
refused before anything of the merge is applied, then applied once the operator approves the rewrite
(Delta and Iceberg; on Parquet the mirror only). Batch by batch, the consumer before the second batch is
"killed" right after its ADD COLUMNS of the column with a fill: the rerun still fills the rows.
"""

from __future__ import annotations

import json
from decimal import Decimal
from pathlib import Path

import pyarrow as pa
import pytest
import structlog.testing
from pyspark.sql import SparkSession
from test_spark_consumer import TS, land, mirror, rows_of

from cdcd.events import ChangeEvent, Column, Fill, Mark, MarkKind, Op, TableId, TableSchema
from cdcd.positions import PgPosition
from cdcd.verify.mirror import read_table

pytestmark = pytest.mark.spark

T = TableId("public", "items")
OTHER = TableSchema(TableId("public", "other"), (Column("k", pa.int64(), "bigint", False, id=1),), ("k",))
ID = Column("id", pa.int64(), "bigint", False, id=1)
QTY = Column("qty", pa.int32(), "integer", id=2)
AMOUNT = Column("amount", pa.decimal128(10, 2), "numeric(10,2)", id=3)
PRICE = Column("price", pa.decimal128(8, 2), "numeric(8,2)", id=4)
LABEL = Column("label", pa.string(), "text", id=5)
EXTRA = Column("extra", pa.string(), "text", id=6)
WIDE = (ID, Column("qty", pa.int64(), "bigint", id=2), Column("amount", pa.decimal128(14, 2), "numeric(14,2)", id=3),
        Column("price", pa.decimal128(12, 4), "numeric(12,4)", id=4), Column("title", pa.string(), "text", id=5))
FLAG = Column("flag", pa.string(), "text", id=7, fill=Fill("new"))
V1 = TableSchema(T, (ID, QTY, AMOUNT, PRICE, LABEL, EXTRA), ("id",), version=1)
V2 = TableSchema(T, (*WIDE, EXTRA, FLAG), ("id",), version=2)  # widened, label renamed title, flag added
FLAG_LATER = Column("flag", pa.string(), "text", id=7)  # the fill is on the version that added it only
V3 = TableSchema(T, (*WIDE, FLAG_LATER), ("id",), version=3)  # extra dropped
V4 = TableSchema(T, (*WIDE, FLAG_LATER, Column("extra", pa.int64(), "bigint", id=8)), ("id",),
                 version=4)  # extra added again: another column


def ev(op: Op, lsn: int, seq: int, schema: TableSchema, **kw: object) -> ChangeEvent:
    return ChangeEvent(op, schema, PgPosition(lsn, seq), tx_id=str(lsn), commit_ts=TS, **kw)  # type: ignore[arg-type]


def v1(i: int, **over: object) -> dict[str, object]:
    return {"id": i, "qty": i, "amount": Decimal(f"{i}.50"), "price": Decimal(f"{i}.25"), "label": f"l{i}",
            "extra": f"x{i}", **over}


def wide(i: int, **over: object) -> dict[str, object]:
    return {"id": i, "qty": 2**40 + i, "amount": Decimal("123456789.12"), "price": Decimal("12345678.1234"),
            "title": f"t{i}", **over}


def changed(lsn: int, new: TableSchema, ddl: str | None = None) -> Mark:
    """The source's schema-change mark (landed as a ``schema_changes`` record, a change-log row of its own)."""
    return Mark(MarkKind.SCHEMA, PgPosition(lsn, 0), {"table": str(new.table), "change": new, "ddl": ddl})


BATCHES: list[list[ChangeEvent | Mark]] = [
    [ev(Op.READ, 100, 0, V1, after=v1(i), snapshot=True) for i in (1, 2, 3, 6)],
    [ev(Op.UPDATE, 200, 1, V1, before={"id": 3}, after=v1(3, label="l3b")),  # before the ALTERs, same merge
     changed(300, V2, "ALTER TABLE items RENAME label TO title"),
     ev(Op.UPDATE, 300, 1, V2, before={"id": 2}, after=wide(2, extra="x2b", flag="f2")),
     ev(Op.CREATE, 300, 2, V2, after=wide(4, extra="x4", flag="f4"))],
    [changed(400, V3), ev(Op.UPDATE, 400, 1, V3, before={"id": 6}, after={
        **wide(6), "qty": 6, "amount": Decimal("6.50"), "price": Decimal("6.25"), "title": "t6", "flag": "f6"})],
    [changed(500, V4), ev(Op.CREATE, 500, 1, V4, after=wide(5, flag="f5", extra=55))],
]
EXPECTED = {  # id: (qty, amount, price, title, flag, extra)
    1: (1, Decimal("1.50"), Decimal("1.2500"), "l1", "new", None),
    2: (2**40 + 2, Decimal("123456789.12"), Decimal("12345678.1234"), "t2", "f2", None),
    3: (3, Decimal("3.50"), Decimal("3.2500"), "l3b", "new", None),
    4: (2**40 + 4, Decimal("123456789.12"), Decimal("12345678.1234"), "t4", "f4", None),
    5: (2**40 + 5, Decimal("123456789.12"), Decimal("12345678.1234"), "t5", "f5", 55),
    6: (6, Decimal("6.50"), Decimal("6.2500"), "t6", "f6", None),
}
COLUMNS = ("qty", "amount", "price", "title", "flag", "extra")


def apply(landing: Path, target: Path, fmt: str) -> int:
    from cdcd.spark.job import run

    return run(str(landing), str(target), once=True, fmt=fmt)


def killed_after_the_add(spark: SparkSession, landing: Path, target: Path, fmt: str, seq: int) -> None:
    """The mirror as a consumer killed right after its ADD COLUMNS of batch ``seq`` leaves it: the statements the
    consumer plans for the batch, run up to that one."""
    from cdcd.landing.reader import read_manifest, table_files
    from cdcd.spark.collapse import prepare, release
    from cdcd.spark.formats import lakehouse_format
    from cdcd.spark.lakehouse import statements, table_schema

    names = lakehouse_format(fmt, target)
    names.register(spark)
    files = table_files(landing, [(seq, read_manifest(landing, seq))])[("public", "items")]
    have = [table_schema(spark, names, kind, "public", "items") for kind in ("changelog", "tables")]
    p = prepare(spark, files, "", spark.table(names.mirror("public", "items")))
    plan = statements(p, names, "public", "items", have[0], have[1], ("v1", "v2"), ("", ""))
    upto = next(i for i, s in enumerate(plan.mirror_ddl) if "ADD COLUMNS" in s)
    for statement in plan.mirror_ddl[:upto + 1]:
        spark.sql(statement)
    release(p)
    assert "fill_below" in str(spark.table(names.mirror("public", "items")).schema["flag"].metadata)


def items(target: Path) -> dict[object, tuple[object, ...]]:
    return {k: tuple(r[c] for c in COLUMNS) for k, r in mirror(target, "public.items").items()}


@pytest.mark.parametrize("fmt", ["delta", "iceberg", "parquet"])
@pytest.mark.parametrize("together", [False, True], ids=["batch-by-batch", "one-merge"])
async def test_schema_changes_by_column_identity(
    spark: SparkSession, tmp_path: Path, fmt: str, together: bool
) -> None:
    landing, target = tmp_path / "landing", tmp_path / "target"
    await land(landing, [BATCHES[0]], [1])
    assert apply(landing, target, fmt) == 0  # the mirror exists, with rows, before the changes
    for seq, batch in enumerate(BATCHES[1:], 2):
        await land(landing, [batch], [seq])
        if not together and seq == 2 and fmt != "parquet":
            killed_after_the_add(spark, landing, target, fmt, seq)  # the rerun must still fill the rows
        if not together:
            assert apply(landing, target, fmt) == 0
    assert apply(landing, target, fmt) == 0
    assert items(target) == EXPECTED
    kept = rows_of(target, "public.items")
    assert "label" not in kept[0] and "_cdc_old_extra_6" not in kept[0]
    assert isinstance(kept[0]["qty"], int)
    if fmt == "parquet":  # its change-log keeps each merge's files as written (docs/spark.md); no refusal
        def marks() -> list[tuple[str, int]]:  # each merge's files as written: read with one schema of our own
            import pyarrow.dataset as ds

            cdc = pa.schema([("_cdc_op", pa.string()), ("_cdc_pos", pa.string()), ("_cdc_schema_version", pa.int64())])
            log = ds.dataset(target / "changelog" / "public.items", schema=cdc).to_table().to_pylist()
            return sorted((r["_cdc_pos"], r["_cdc_schema_version"]) for r in log if r["_cdc_op"] == "s")

        want = [(PgPosition(300, 0).encoded, 2), (PgPosition(400, 0).encoded, 3), (PgPosition(500, 0).encoded, 4)]
        assert marks() == want
        await land(landing, [[changed(500, V4)]], [5])  # landed again (a daemon's crash): not logged twice
        assert apply(landing, target, fmt) == 0
        assert marks() == want
        return
    log = sorted((r["id"], r["title"], r["_cdc_old_extra_6"], r["flag"], r["extra"])
                 for r in rows_of(target, "public.items", "changelog") if r["_cdc_op"] != "s")
    # every event keeps what was landed: a renamed column's older values under its new name, the dropped
    # column's aside, no fill in events landed before their column existed
    assert log == [(1, "l1", "x1", None, None), (2, "l2", "x2", None, None), (2, "t2", "x2b", "f2", None),
                   (3, "l3", "x3", None, None), (3, "l3b", "x3", None, None), (4, "t4", "x4", "f4", None),
                   (5, "t5", None, "f5", 55), (6, "l6", "x6", None, None), (6, "t6", None, "f6", None)]
    # each schema change is one change-log row ('s'), kept once when its batches are applied again
    from cdcd.landing.reader import read_manifest
    from cdcd.spark import schemalog
    from cdcd.spark.formats import lakehouse_format

    tables = lakehouse_format(fmt, target)
    tables.register(spark)
    schemalog.apply_segment(spark, tables, [(n, read_manifest(landing, n)) for n in (2, 3, 4)], {})
    marked = sorted((r["_cdc_pos"], r["_cdc_schema_version"], r["id"], json.loads(r["_cdc_schema_change"]))
                    for r in rows_of(target, "public.items", "changelog") if r["_cdc_op"] == "s")
    assert [(pos, version, key, c["statement"]) for pos, version, key, c in marked] == [
        (PgPosition(300, 0).encoded, 2, None, "ALTER TABLE items RENAME label TO title"),
        (PgPosition(400, 0).encoded, 3, None, None), (PgPosition(500, 0).encoded, 4, None, None)]
    assert [c["name"] for c in marked[0][3]["old_columns"]] == ["id", "qty", "amount", "price", "label", "extra"]
    assert [c["name"] for c in marked[1][3]["columns"]] == ["id", "qty", "amount", "price", "title", "flag"]
    assert marked[1][3]["old_columns"] is not None and marked[2][3]["columns"][-1]["id"] == 8

    # text -> bigint loses values: refused before anything of the merge (another table's row included)
    v5 = TableSchema(T, (*WIDE[:4], Column("title", pa.int64(), "bigint", id=5), *V4.columns[5:]), ("id",),
                     version=5)
    await land(landing, [[ev(Op.CREATE, 600, 1, OTHER, after={"k": 1}),
                          ev(Op.UPDATE, 600, 2, v5, before={"id": 4}, after={**wide(4, flag="f4"), "title": 44})]],
               [6])
    with structlog.testing.capture_logs() as logged:
        assert apply(landing, target, fmt) == 1
    said = [str(e) for e in logged if e["log_level"] == "error"]
    assert len(said) == 1, said  # one error line (the trace only at debug)
    assert "table public.items, column title: the source changed its type from string to bigint" in said[0]
    assert "cdcd.rewrite.title" in said[0] and "cdcd snapshot public.items" in said[0]
    assert "Traceback" not in said[0] and "org.apache" not in said[0]
    assert read_table(target, "public.other") is None
    assert apply(landing, target, fmt) == 1  # stuck the same way, nothing applied

    from cdcd.spark.formats import lakehouse_format

    names = lakehouse_format(fmt, target)
    names.register(spark)
    spark.sql(
        f"ALTER TABLE {names.mirror('public', 'items')} SET TBLPROPERTIES ('cdcd.rewrite.title' = 'bigint')")
    assert apply(landing, target, fmt) == 0  # the approved rewrite: titles that are no number become NULL
    assert {k: r["title"] for k, r in mirror(target, "public.items").items()} == {
        1: None, 2: None, 3: None, 4: 44, 5: None, 6: None}
    log_of_4 = [(r["title"], r["_cdc_old_title_string"]) for r in rows_of(target, "public.items", "changelog")
                if r["id"] == 4]
    assert sorted(log_of_4, key=str) == sorted([(None, "t4"), (44, None)], key=str)
    assert set(mirror(target, "public.other")) == {1}


PAIRS = TableId("public", "pairs")
P1 = TableSchema(PAIRS, (Column("id", pa.int64(), "bigint", False, id=1), Column("a", pa.string(), "text", id=2),
                         Column("b", pa.string(), "text", id=3)), ("id",), version=1)
P2 = TableSchema(PAIRS, (Column("item_id", pa.int64(), "bigint", False, id=1),  # the key renamed
                         Column("b", pa.string(), "text", id=2), Column("a", pa.string(), "text", id=3)),  # a <-> b
                 ("item_id",), version=2)


@pytest.mark.parametrize("fmt", ["delta", "iceberg", "parquet"])
async def test_a_renamed_key_and_two_columns_that_swap_names(spark: SparkSession, tmp_path: Path, fmt: str) -> None:
    """In one merge: a key change landed before the key column's rename (its old key under the old name) and two
    columns that swap names. The old key's row goes; every value stays with its column's identity."""
    landing, target = tmp_path / "landing", tmp_path / "target"
    await land(landing, [[ev(Op.READ, 100, 0, P1, after={"id": i, "a": f"a{i}", "b": f"b{i}"}, snapshot=True)
                          for i in (1, 2, 3)]], [1])
    assert apply(landing, target, fmt) == 0
    await land(landing, [[
        ev(Op.UPDATE, 200, 1, P1, before={"id": 2}, after={"id": 20, "a": "a2", "b": "b2"}),  # the key changes
        changed(300, P2, "ALTER TABLE pairs RENAME id TO item_id, RENAME a TO t, RENAME b TO a, RENAME t TO b"),
        ev(Op.UPDATE, 300, 1, P2, before={"item_id": 3}, after={"item_id": 3, "b": "a3x", "a": "b3"}),
        ev(Op.CREATE, 300, 2, P2, after={"item_id": 4, "b": "a4", "a": "b4"})]], [2])
    assert apply(landing, target, fmt) == 0
    rows = rows_of(target, "public.pairs")
    assert {r["item_id"]: (r["b"], r["a"]) for r in rows} == {
        1: ("a1", "b1"), 20: ("a2", "b2"), 3: ("a3x", "b3"), 4: ("a4", "b4")}, rows
    assert len(rows) == 4 and "id" not in rows[0]


def test_which_type_changes_each_format_makes_in_place() -> None:
    """The widenings each format makes with ALTER COLUMN TYPE, those rewritten, and those that lose values."""
    from pyspark.sql.types import (
        DateType,
        DecimalType,
        DoubleType,
        FloatType,
        IntegerType,
        LongType,
        ShortType,
        StringType,
        TimestampNTZType,
    )

    from cdcd.spark.formats import lakehouse_format
    from cdcd.spark.widening import lossless

    delta, iceberg = (lakehouse_format(f, Path("target")) for f in ("delta", "iceberg"))
    changes = {  # (old, new): (lossless, Delta in place, Iceberg in place)
        (IntegerType(), LongType()): (True, True, True),
        (ShortType(), IntegerType()): (True, True, False),  # Iceberg stores both as int: no change at all
        (FloatType(), DoubleType()): (True, True, True),
        (DecimalType(10, 2), DecimalType(14, 2)): (True, True, True),
        (DecimalType(10, 2), DecimalType(14, 4)): (True, True, False),
        (IntegerType(), DecimalType(12, 2)): (True, True, False),
        (DateType(), TimestampNTZType()): (True, True, False),
        (IntegerType(), StringType()): (True, False, False),
        (StringType(), LongType()): (False, False, False),
        (DecimalType(14, 4), DecimalType(14, 2)): (False, False, False),
        (LongType(), DoubleType()): (False, False, False),
    }
    for (old, new), want in changes.items():
        assert (lossless(old, new), delta.widens_in_place(old, new), iceberg.widens_in_place(old, new)) == want, (
            old, new)
