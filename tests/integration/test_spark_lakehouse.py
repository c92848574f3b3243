"""The Delta Lake / Iceberg target (``--format delta|iceberg``): the MERGE source and the generated SQL.

The MERGE source rows are built by real Spark from batches landed by the
real landing sink; the generated SQL is checked by Spark's own parser (and,
for the MERGE/DELETE statements, by its analyzer). The statements run
against the real Delta Lake and Iceberg jars in test_spark_formats.py and
test_spark_consumer.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
import test_spark_consumer
from pyspark.sql import SparkSession
from pyspark.sql.types import (
    ArrayType,
    DecimalType,
    IntegerType,
    LongType,
    ShortType,
    StringType,
    StructField,
    StructType,
)
from test_spark_consumer import LOG, V1, ev, land, row

from cdcd.events import Op
from cdcd.landing.reader import read_batch, table_files
from cdcd.positions import PgPosition
from cdcd.spark import lakehouse_sql as sql
from cdcd.spark.collapse import Prepared, conformed, prepare, release
from cdcd.spark.delta import Delta
from cdcd.spark.formats import lakehouse_format
from cdcd.spark.lakehouse import statements
from cdcd.spark.lakehouse_ddl import schema_changes

pytestmark = pytest.mark.spark

CDCD = str(Path(sys.executable).with_name("cdcd"))
ORDERS = ("public", "orders")


def pos(lsn: int, seq: int) -> str:
    return PgPosition(lsn, seq).encoded


def small(i: int, **over: object) -> dict[str, object]:
    return row(i, **{"big": f"b{i}", **over})


def prepared(landing: Path, seqs: list[int], table: tuple[str, str] = ORDERS, watermark: str = "") -> Prepared:
    from cdcd.spark.session import session

    segment = [(s, read_batch(landing, s, verify=False).manifest) for s in seqs]
    return prepare(session(), table_files(landing, segment)[table], watermark)


def source_rows(p: Prepared, key: str = "id") -> dict[Any, dict[str, Any]]:
    """The collapsed MERGE source by key, without the columns the scenario leaves unchanged."""
    rows = [r.asDict() for r in p.mirror.collect()]
    out = {r[key]: {c: v for c, v in r.items() if c not in ("at", "blob", "_cdc_tx", "_cdc_commit_ts")} for r in rows}
    assert len(out) == len(rows), "the MERGE source must hold one row per key"
    return out


def upsert(i: int, amount: str, big: str | None, op: str, at: str, batch: int, unknown: list[str]) -> dict[str, Any]:
    return {"id": i, "amount": Decimal(amount), "big": big, "_cdc_op": op, "_cdc_pos": at, "_cdc_batch": batch,
            "_cdc_delete": False, "_cdc_unavailable": unknown}


def delete(i: int, op: str, at: str, batch: int) -> dict[str, Any]:
    return {"id": i, "amount": None, "big": None, "_cdc_op": op, "_cdc_pos": at, "_cdc_batch": batch,
            "_cdc_delete": True, "_cdc_unavailable": []}


async def test_collapse_one_action_per_key_from_landed_batches(spark: SparkSession, tmp_path: Path) -> None:
    landing = tmp_path / "landing"
    snap = [ev(Op.READ, 100, 0, after=small(i), snapshot=True) for i in (1, 2, 3)]
    stream = [
        ev(Op.UPDATE, 200, 1, before={"id": 1}, after=small(1, amount=Decimal("11"), big="b1new")),
        ev(Op.UPDATE, 200, 2, before={"id": 1}, after=small(1, amount=Decimal("12"), big=None), unavailable=("big",)),
        ev(Op.UPDATE, 200, 3, before={"id": 2}, after=small(2, amount=Decimal("22"), big=None), unavailable=("big",)),
        ev(Op.UPDATE, 200, 4, before=small(3), after=small(30)),  # key change 3 -> 30
        ev(Op.CREATE, 200, 5, after=small(4)),
        ev(Op.DELETE, 200, 6, before={"id": 4}),
        ev(Op.DELETE, 200, 7, before={"id": 9}),
    ]
    await land(landing, [snap, stream], [1, 2])
    p = prepared(landing, [1, 2])
    try:
        assert p.facts.events == 10 and p.facts.truncate_pos is None and p.keep == ["big"]
        assert source_rows(p) == {
            1: upsert(1, "12.00", "b1new", "u", pos(200, 2), 2, []),  # TOAST: the earlier event of the batch
            2: upsert(2, "22.00", "b2", "u", pos(200, 3), 2, []),  # TOAST: the snapshot row of batch 1
            3: delete(3, "u", pos(200, 4), 2),  # the old key of the key change
            30: upsert(30, "30.50", "b30", "u", pos(200, 4), 2, []),
            4: delete(4, "d", pos(200, 6), 2),  # inserted and deleted in the batch: the MERGE inserts nothing
            9: delete(9, "d", pos(200, 7), 2),
        }
    finally:
        release(p)

    # applied up to 200:7; a TOAST value with no earlier event in the batch stays unknown: the MERGE keeps the mirror's
    await land(landing, [[ev(Op.UPDATE, 300, 1, before={"id": 2}, after=small(2, amount=Decimal("23"), big=None),
                             unavailable=("big",))]], [5])
    p = prepared(landing, [5], watermark=pos(200, 7))
    try:
        assert source_rows(p) == {2: upsert(2, "23.00", None, "u", pos(300, 1), 5, ["big"])}
    finally:
        release(p)


async def test_replayed_and_multi_batch_segments(spark: SparkSession, tmp_path: Path) -> None:
    landing = tmp_path / "landing"
    first = [ev(Op.CREATE, 100, 1, after=small(1)), ev(Op.UPDATE, 100, 2, before={"id": 1},
                                                      after=small(1, amount=Decimal("2")))]
    later = [ev(Op.UPDATE, 200, 1, before={"id": 1}, after=small(1, amount=Decimal("3")))]
    await land(landing, [first, later], [1, 2])
    p = prepared(landing, [1, 2])  # the later batch wins
    try:
        assert source_rows(p) == {1: upsert(1, "3.00", "b1", "u", pos(200, 1), 2, [])}
    finally:
        release(p)

    # the daemon crashed after landing both: a new run re-lands them under new seqs, plus a new event
    await land(landing, [[*first, *later, ev(Op.CREATE, 300, 1, after=small(7))]], [3])
    p = prepared(landing, [3], watermark=pos(200, 1))
    try:
        # below the watermark: dropped; at it: kept, and the MERGE's s._cdc_pos > t._cdc_pos makes it a no-op
        assert source_rows(p) == {
            1: upsert(1, "3.00", "b1", "u", pos(200, 1), 3, []),
            7: upsert(7, "7.50", "b7", "c", pos(300, 1), 3, []),
        }
        log = sorted((r["_cdc_pos"], r["_cdc_batch"]) for r in p.events.select("_cdc_pos", "_cdc_batch").collect())
        assert log == [(pos(200, 1), 3), (pos(300, 1), 3)]  # the change-log MERGE's source
    finally:
        release(p)


async def test_truncate_drops_the_events_before_it(spark: SparkSession, tmp_path: Path) -> None:
    landing = tmp_path / "landing"
    events = [
        ev(Op.CREATE, 500, 1, schema=LOG, after={"k": 1, "v": "a"}),
        ev(Op.TRUNCATE, 500, 2, schema=LOG),
        ev(Op.CREATE, 500, 3, schema=LOG, after={"k": 2, "v": "b"}),
        ev(Op.UPDATE, 500, 4, schema=LOG, before={"k": 2}, after={"k": 2, "v": "c"}),
    ]
    await land(landing, [events], [4])
    p = prepared(landing, [4], table=("public", "log"))
    try:
        assert p.facts.truncate_pos == pos(500, 2) and p.keep == []
        assert [r.asDict() for r in p.mirror.drop("_cdc_tx", "_cdc_commit_ts").collect()] == [
            {"k": 2, "v": "c", "_cdc_op": "u", "_cdc_pos": pos(500, 4), "_cdc_batch": 4, "_cdc_delete": False,
             "_cdc_unavailable": []}
        ]
        names = Delta(tmp_path / "target")
        plan = statements(p, names, "public", "log", None, None, ("log_src", "src"), (pos(500, 1), pos(500, 4)))
        assert plan.truncate == f"DELETE FROM {names.mirror('public', 'log')} WHERE _cdc_pos < '{pos(500, 2)}'"
    finally:
        release(p)


async def test_changelog_source_follows_the_change_log_schema(spark: SparkSession, tmp_path: Path) -> None:
    landing = tmp_path / "landing"
    await land(landing, [[ev(Op.UPDATE, 100, 1, schema=LOG, before={"k": 1}, after={"k": 2, "v": "x"})]], [1])
    p = prepared(landing, [1], table=("public", "log"))
    try:
        # the log has a column since dropped from the source and an old key column no longer in the key struct
        have = StructType([StructField("k", LongType()), StructField("gone", StringType()),
                           StructField("_cdc_pos", StringType()),
                           StructField("_cdc_before_key", StructType([StructField("k", IntegerType()),
                                                                      StructField("old", StringType())]))])
        rows = [r.asDict(recursive=True) for r in conformed(p.events, have).collect()]
        assert rows == [{"k": 2, "gone": None, "_cdc_pos": pos(100, 1), "_cdc_before_key": {"k": 1, "old": None}}]
    finally:
        release(p)


def _plans(p: Prepared, fmt: str, target: Path) -> list[str]:
    """Every statement of one table's micro-batch: first application and after a schema change."""
    names = lakehouse_format(fmt, target)
    fresh = statements(p, names, "public", "orders", None, None, ("cdcd_log_1", "cdcd_src_1"),
                       (pos(100, 0), pos(200, 7)))
    # tables made by an older schema: a dropped column, a missing nested key field, a narrower type, no `note`
    mirror_have = StructType([*[StructField(c, p.types[c]) for c in p.mirror_columns if c != "blob"],
                              StructField("gone", StringType())])
    mirror_have["amount"].dataType = IntegerType()
    log_fields = [f for f in p.events.schema.fields if f.name not in ("blob", "_cdc_before_key")]
    log_have = StructType([*log_fields, StructField("_cdc_before_key", StructType())])
    evolved = statements(p, names, "public", "orders", log_have, mirror_have, ("cdcd_log_2", "cdcd_src_2"),
                         (pos(100, 0), pos(200, 7)))
    out: list[str] = []
    for plan in (fresh, evolved):
        out += [*plan.namespaces, *plan.changelog_ddl, plan.changelog_merge, *plan.mirror_ddl, plan.mirror_merge]
        out += [plan.truncate] if plan.truncate else []
    return out


async def test_generated_sql_parses_with_sparks_parser(spark: SparkSession, tmp_path: Path) -> None:
    """Syntax only: the statements are not executed (no Delta/Iceberg jars here)."""
    landing = tmp_path / "landing"
    await land(landing, [[ev(Op.READ, 100, 0, after=small(1), snapshot=True),
                          ev(Op.UPDATE, 200, 1, before={"id": 1}, after=small(1, big=None), unavailable=("big",)),
                          ev(Op.UPDATE, 200, 2, before=small(1), after=small(2))]], [1])
    p = prepared(landing, [1])
    parser = spark._jsparkSession.sessionState().sqlParser()  # type: ignore[attr-defined]
    try:
        for fmt in ("delta", "iceberg"):
            stmts = _plans(p, fmt, tmp_path / "tar`get")  # a back-quote in the path must be escaped
            kinds = [parser.parsePlan(s).nodeName() for s in stmts]
            expected = ["CreateTable", "MergeIntoTable", "CreateTable", "MergeIntoTable",
                        "AddColumns", "MergeIntoTable", "AddColumns", "AlterColumns", "DropColumns", "MergeIntoTable"]
            if fmt == "iceberg":  # each plan creates the namespaces first
                assert kinds[:2] == kinds[6:8] == ["CreateNamespace"] * 2
                kinds = kinds[2:6] + kinds[8:]
                # int -> decimal is no Iceberg promotion: the column is rewritten (cdcd.spark.evolve)
                expected[7:8] = ["AddColumns", "UpdateTable", "DropColumns", "RenameColumn"]
            else:  # a Delta mirror switches column mapping on after its CREATE and before a drop (Delta.create),
                # and type widening on before a widening
                expected.insert(3, "SetTableProperties")
                expected.insert(8, "SetTableProperties")
                expected.insert(10, "SetTableProperties")
            assert kinds == expected, stmts
            merge = next(s for s in stmts if s.startswith("MERGE") and "cdcd_src_1" in s)
            assert "t.`big` = CASE WHEN array_contains(s.`_cdc_unavailable`, 'big') THEN t.`big` ELSE s.`big` END" \
                in merge
            assert "WHEN MATCHED AND s._cdc_pos > t._cdc_pos AND s.`_cdc_delete` THEN DELETE" in merge
            log_merge = next(s for s in stmts if s.startswith("MERGE") and "cdcd_log_1" in s)
            assert "_cdc_batch" not in log_merge.split(" WHEN ")[0]  # re-landed events get new batch seqs
            assert "t.`id` <=> s.`id`" in log_merge and "t._cdc_op = s._cdc_op" in log_merge
        assert "ADD COLUMNS (`_cdc_before_key`.`id` bigint" in " ".join(stmts)
        assert sql.delta_table("file:/a`b") == "delta.`file:/a``b`"
        with pytest.raises(Exception, match="PARSE_SYNTAX_ERROR"):  # the check can fail
            parser.parsePlan(stmts[-1].replace("WHEN NOT MATCHED", "WHEN NOT NOT MATCHED"))
    finally:
        release(p)


async def test_merge_statements_resolve_against_tables_of_the_same_schema(spark: SparkSession, tmp_path: Path) -> None:
    """Spark's analyzer resolves every column of the MERGE/DELETE before it refuses to run it on Parquet tables."""
    landing = tmp_path / "landing"
    await land(landing, [[ev(Op.READ, 100, 0, after=small(1), snapshot=True),
                          ev(Op.UPDATE, 200, 1, before={"id": 1}, after=small(1, big=None), unavailable=("big",)),
                          ev(Op.TRUNCATE, 200, 2),
                          ev(Op.UPDATE, 200, 3, before=small(1), after=small(2))]], [1])
    p = prepared(landing, [1])
    names = Delta(tmp_path / "target")
    plan = statements(p, names, "public", "orders", None, None, ("cdcd_log_v", "cdcd_src_v"),
                      (pos(100, 0), pos(200, 3)))
    mirror, log = names.mirror("public", "orders"), names.changelog("public", "orders")
    stand_ins = {mirror: "default.cdcd_mirror_standin", log: "default.cdcd_log_standin"}
    try:
        creates = [d for d in (*plan.changelog_ddl, *plan.mirror_ddl) if d.startswith("CREATE TABLE")]
        assert len(creates) == 2
        for ddl_ in creates:  # the real CREATE TABLE column lists, as Parquet
            for ref, name in stand_ins.items():
                ddl_ = ddl_.replace(f"IF NOT EXISTS {ref} ", f"{name} ")
            table = ddl_.split()[2]
            spark.sql(ddl_.split(" USING ")[0] + f" USING parquet LOCATION '{tmp_path / table}'")
        log_schema = spark.table(stand_ins[log]).schema
        conformed(p.events, log_schema).createOrReplaceTempView("cdcd_log_v")
        p.mirror.createOrReplaceTempView("cdcd_src_v")
        assert plan.truncate is not None
        for stmt in (plan.changelog_merge, plan.truncate, plan.mirror_merge):
            for ref, name in stand_ins.items():
                stmt = stmt.replace(ref, name)
            with pytest.raises(Exception, match=r"UNSUPPORTED_FEATURE\.TABLE_OPERATION"):
                spark.sql(stmt)
            broken = stmt.replace("_cdc_pos", "_cdc_posx", 2)
            with pytest.raises(Exception, match="UNRESOLVED_COLUMN"):  # the check can fail
                spark.sql(broken)
    finally:
        for name in stand_ins.values():
            spark.sql(f"DROP TABLE IF EXISTS {name}")
        release(p)


def test_schema_changes_of_the_tables() -> None:
    key = StructType([StructField("id", IntegerType())])
    have = StructType([StructField("id", LongType()), StructField("n", IntegerType()), StructField("amount",
                       DecimalType(12, 2)), StructField("gone", StringType()), StructField("_cdc_before_key", key)])
    want = StructType([StructField("id", IntegerType()),  # narrowed: stays bigint
                       StructField("n", ShortType()),  # Iceberg keeps smallint as int; Delta: narrowed, stays int
                       StructField("amount", DecimalType(14, 2)),  # widened: altered
                       StructField("note", StringType()),
                       StructField("_cdc_before_key", StructType([*key.fields, StructField("k2", StringType())]))])
    for fmt in ("delta", "iceberg"):
        stored = lakehouse_format(fmt, Path("target")).stored_type
        mirror = schema_changes(have, want, stored, drop=True)
        assert mirror.adds == [(["note"], StringType()), (["_cdc_before_key", "k2"], StringType())]
        assert mirror.retypes == [(["amount"], DecimalType(14, 2))]
        assert mirror.drops == [["gone"]]
        assert schema_changes(have, want, stored, drop=False).drops == []  # the change-log keeps old columns
    assert schema_changes(StructType([StructField("a", ArrayType(IntegerType()))]),
                          StructType([StructField("a", ArrayType(ShortType()))]),
                          lakehouse_format("iceberg", Path("target")).stored_type, drop=True).retypes == []


def test_a_parquet_target_is_refused(spark: SparkSession, tmp_path: Path) -> None:
    target = tmp_path / "target"
    (target / "state").mkdir(parents=True)
    (target / "state" / "consumer.json").write_text('{"applied_seq": 3, "tables": {}}')
    problem = Delta(target).check_target(spark)
    assert problem is not None and "Parquet mirror" in problem
    (target / "state" / "format").write_text("iceberg\n")
    problem = Delta(target).check_target(spark)
    assert problem is not None and "holds iceberg tables" in problem


@pytest.mark.parametrize(("fmt", "package"), [("delta", "io.delta:delta-spark_4.1_2.13:4.4.0"),
                                              ("iceberg", "org.apache.iceberg:iceberg-spark-runtime-4.1_2.13")])
async def test_cli_without_the_jars_exits_2(tmp_path: Path, fmt: str, package: str) -> None:
    landing, target = tmp_path / "landing", tmp_path / "target"
    await land(landing, [[ev(Op.CREATE, 100, 1, schema=V1, after=small(1))]], [1])
    (tmp_path / "no-jars").mkdir()
    env = {**os.environ, "CDCD_SPARK_JARS": str(tmp_path / "no-jars")}  # an empty jar cache
    done = subprocess.run([CDCD, "spark", "run", "--landing", str(landing), "--target", str(target), "--once",
                           "--format", fmt], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "is not on Spark's classpath" in done.stderr and package in done.stderr
    # nothing was written but the consumer's lock file (taken before the session starts, so that a second
    # consumer is refused before its JVM)
    assert sorted(p.name for p in target.rglob("*")) == ["consumer.lock", "state"]


async def test_facts_from_the_landed_files_are_the_spark_aggregates(spark: SparkSession, tmp_path: Path) -> None:
    """The driver's pyarrow facts (``facts.landed_facts``) decide the statements: they must be what the Spark
    aggregate gives, for every kind of batch (key changes, unavailable columns, truncates, NULL and repeated
    keys, two schema versions, a watermark inside the files)."""
    from cdcd.spark.collapse import new_events, spark_facts, table_layout
    from cdcd.spark.facts import landed_facts

    keyless = test_spark_consumer.TableSchema(test_spark_consumer.TableId("public", "bag"),
                                              (test_spark_consumer.Column("v", test_spark_consumer.pa.string(), "text"),
                                               test_spark_consumer.Column("n", test_spark_consumer.pa.int32(), "int")),
                                              ())
    landing = tmp_path / "landing"
    batches = test_spark_consumer.history()
    batches.append([ev(Op.CREATE, 600, 1, after=small(7)), ev(Op.CREATE, 600, 2, after=small(7)),  # 7 twice
                    ev(Op.CREATE, 600, 3, schema=keyless, after={"v": "a", "n": 1}),
                    ev(Op.CREATE, 600, 4, schema=keyless, after={"v": None, "n": 2})])
    batches.append([ev(Op.CREATE, 700, 1, after=small(8)), ev(Op.CREATE, 700, 2, after=small(9)),
                    ev(Op.DELETE, 700, 3, before={"id": 8})])
    seqs = list(range(1, len(batches) + 1))
    await land(landing, batches, seqs)
    cases: list[tuple[list[int], tuple[str, str], str]] = [
        (seqs, ORDERS, ""), (seqs, ORDERS, pos(300, 2)), (seqs[:3], ORDERS, ""), (seqs[:2], ORDERS, ""),
        (seqs[2:4], ("public", "log"), ""), (seqs[:2], ("public", "log"), ""), ([6], ORDERS, ""), ([7], ORDERS, ""),
        ([6], ("public", "bag"), ""),
    ]
    seen_unique = set()
    for chosen, table, watermark in cases:
        segment = [(s, read_batch(landing, s, verify=False).manifest) for s in chosen]
        files = table_files(landing, segment)[table]
        _, key = table_layout(files)
        events = new_events(spark, files, watermark)
        mine = landed_facts(files, key, watermark, {f.name: f.dataType for f in events.schema.fields})
        assert mine is not None, (chosen, table)
        assert mine == spark_facts(events, key), (chosen, table, watermark)
        # read beside Spark, before its types are known: the same facts
        assert landed_facts(files, key, watermark) == mine, (chosen, table, watermark)
        seen_unique.add(mine.unique)
    assert seen_unique == {True, False}  # both outcomes of the uniqueness count are compared


def test_arrow_ranged_is_what_spark_reads_as_a_ranged_type(spark: SparkSession, tmp_path: Path) -> None:
    """``facts.arrow_ranged`` tells from a landed column's Arrow type whether Spark reads it as a ``RANGED``
    type (the MERGE's key-range literal is written for those only)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from cdcd.spark.facts import RANGED, arrow_ranged

    kinds = [pa.int8(), pa.int16(), pa.int32(), pa.int64(), pa.uint8(), pa.uint16(), pa.uint32(), pa.uint64(),
             pa.string(), pa.large_string(), pa.date32(), pa.decimal128(10, 2), pa.decimal128(38, 0),
             pa.timestamp("us", tz="UTC"), pa.timestamp("us"), pa.binary(), pa.bool_(), pa.float64(),
             pa.list_(pa.int32())]
    table = pa.table({f"c{i}": pa.nulls(1, type=k) for i, k in enumerate(kinds)})
    pq.write_table(table, tmp_path / "kinds.parquet")
    read = spark.read.parquet(str(tmp_path / "kinds.parquet")).schema
    assert {f"c{i}": arrow_ranged(k) for i, k in enumerate(kinds)} == {
        f.name: isinstance(f.dataType, RANGED) for f in read.fields}


def test_physical_names_are_checked_in_nested_fields_too() -> None:
    """Landed files join an existing Delta mirror only when every field, nested ones too, is stored under its
    own name (a field added under column mapping gets a generated physical name, which landed files lack)."""
    from cdcd.spark.delta import _own_physical_names

    def field(name: str, kind: object, physical: str | None = None) -> dict[str, object]:
        return {"name": name, "type": kind, "nullable": True,
                "metadata": {"delta.columnMapping.physicalName": physical} if physical else {}}

    def struct(*fields: dict[str, object]) -> dict[str, object]:
        return {"type": "struct", "fields": list(fields)}

    assert _own_physical_names(struct(field("id", "long", "id"), field("v", "string")))
    assert not _own_physical_names(struct(field("id", "long", "id"), field("v", "string", "col-9a1")))
    assert not _own_physical_names(struct(field("s", struct(field("x", "int", "col-2b")), "s")))
    listed = {"type": "array", "elementType": struct(field("x", "int", "col-3c")), "containsNull": True}
    assert not _own_physical_names(struct(field("a", listed)))
    keyed = {"type": "map", "keyType": "string", "valueType": struct(field("y", "int")), "valueContainsNull": True}
    assert _own_physical_names(struct(field("m", keyed)))
