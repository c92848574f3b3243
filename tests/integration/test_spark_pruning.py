"""A small batch against a large mirror reads and rewrites only the files that may hold its keys.

The mirror (200,000 rows in 40 files of 5,000 consecutive keys, built by the consumer from
40 landed batches) takes a batch of 100 updates and 1 delete of neighbouring keys. The
MERGE's condition bounds the target's key (``lakehouse_sql.key_range``), so the format's
file statistics skip every file outside the batch's key range. What the MERGE read is
taken from the SQL metrics Spark keeps of the statement (Delta's files after skipping,
Iceberg's skipped data files), what it rewrote from the table's own commit (Delta's
``DESCRIBE HISTORY`` operationMetrics, Iceberg's snapshot summary). Without the bound,
Delta reads every file (checked: 40 of 40 after skipping). Iceberg prunes with or without it:
Spark filters the target of a row-level command at run time by the source's keys.

A mirror built from a snapshot (a truncate first, so the landed files cannot be its files) is written
range-partitioned by key (``lakehouse.in_key_ranges``): its files hold disjoint key ranges whatever
Spark's task layout, which the pruning needs.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from test_spark_consumer import ev, land

from cdcd.events import ChangeEvent, Column, Op, TableId, TableSchema

pytestmark = pytest.mark.spark

ITEMS = TableSchema(TableId("public", "items"),
                    (Column("id", pa.int64(), "bigint", nullable=False), Column("v", pa.string(), "text")), ("id",))
FILES, PER_FILE = 40, 5_000
ROWS = FILES * PER_FILE


def batches() -> list[list[ChangeEvent]]:
    return [[ev(Op.CREATE, 100 + b, i, schema=ITEMS, after={"id": b * PER_FILE + i, "v": "first"})
             for i in range(1, PER_FILE + 1)] for b in range(FILES)]


def small_batch() -> list[ChangeEvent]:
    """100 updates and a delete of keys in the middle of the mirror (one or two of its files)."""
    lo = ROWS // 2
    out = [ev(Op.UPDATE, 10_000, i, schema=ITEMS, before={"id": lo + i}, after={"id": lo + i, "v": "second"})
           for i in range(100)]
    return [*out, ev(Op.DELETE, 10_000, 100, schema=ITEMS, before={"id": lo + 100})]


def apply(landing: Path, target: Path, fmt: str) -> None:
    from cdcd.spark.consumer import run

    assert run(str(landing), str(target), once=True, fmt=fmt) == 0


async def apply_small_batch(spark: Any, landing: Path, target: Path, fmt: str, ref: str) -> None:
    """Land and apply ``small_batch`` after the 40 batches; the mirror then holds its changes."""
    await land(landing, [small_batch()], [FILES + 1])
    apply(landing, target, fmt)
    assert spark.table(ref).count() == ROWS - 1
    assert spark.table(ref).where("v = 'second'").count() == 100


def sql_metrics(spark: Any, node: str) -> dict[str, int]:
    """The SQL metrics of plan node ``node`` in the last execution that has one, by metric name.

    Spark keeps them in its status store whether or not the UI runs.
    """
    store = spark._jsparkSession.sharedState().statusStore()
    executions = store.executionsList()
    for i in reversed(range(executions.size())):
        execution = executions.apply(i).executionId()
        nodes = store.planGraph(execution).allNodes()
        found = [nodes.apply(j) for j in range(nodes.size()) if nodes.apply(j).name() == node]
        if not found:
            continue
        values = store.executionMetrics(execution)
        out: dict[str, int] = {}
        metrics = found[0].metrics()
        for j in range(metrics.size()):
            m = metrics.apply(j)
            value = values.get(m.accumulatorId())
            text = str(value.get()).split("\n")[0].replace(",", "") if value.isDefined() else ""
            if text.isdigit():
                out[m.name()] = int(text)
        return out
    raise AssertionError(f"no SQL execution with a {node!r} node")


@pytest.mark.parametrize("fmt", ["delta", "iceberg"])
async def test_a_small_batch_reads_and_rewrites_a_small_part_of_a_large_mirror(
    spark: Any, tmp_path: Path, fmt: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from cdcd.spark import lakehouse
    from cdcd.spark.formats import lakehouse_format

    # a mirror file per landed batch: Delta adopts the landed files, Iceberg writes the rows in key ranges
    monkeypatch.setattr(lakehouse, "ROWS_PER_MIRROR_FILE", PER_FILE)
    landing, target = tmp_path / "landing", tmp_path / "target"
    await land(landing, batches(), list(range(1, FILES + 1)))
    apply(landing, target, fmt)
    ref = lakehouse_format(fmt, target).mirror("public", "items")
    files = spark.sql(f"SELECT input_file_name() AS f FROM {ref}").distinct().count()
    assert files >= FILES // 2, f"the mirror should span many files, it has {files}"
    assert spark.table(ref).count() == ROWS

    await apply_small_batch(spark, landing, target, fmt, ref)
    if fmt == "delta":
        merge = sql_metrics(spark, "Execute MergeIntoCommand")
        assert merge["number of target files before skipping"] >= FILES // 2, merge
        # the files whose key range meets the batch's: without the bound, every file
        assert merge["number of target files after skipping"] <= 2, merge
        last = spark.sql(f"DESCRIBE HISTORY {ref} LIMIT 1").first()
        assert last["operation"] == "MERGE"
        m = {k: int(v) for k, v in last["operationMetrics"].items()}
        assert m["numTargetRowsUpdated"] == 100 and m["numTargetRowsDeleted"] == 1, m
        assert m["numTargetRowsCopied"] == 0 and m["numTargetFilesRemoved"] == 0, m  # deletion vectors
    else:
        scan = sql_metrics(spark, "BatchScan cdcd.tables.public.items")
        assert scan["number of skipped data files"] >= FILES - 2, scan
        assert scan["number of result data files"] <= 2, scan
        snap = spark.sql(f"SELECT summary FROM {ref}.`snapshots` ORDER BY committed_at DESC LIMIT 1").first()
        summary = snap["summary"]
        # merge-on-read: position deletes and the new row versions, no data file of the mirror rewritten
        assert int(summary.get("deleted-data-files", "0")) == 0, summary
        assert int(summary.get("added-delete-files", "0")) <= 2, summary
        assert int(summary.get("added-data-files", "0")) <= 2, summary


def snapshot_batches() -> list[list[ChangeEvent]]:
    """What the daemon lands for a table's initial snapshot (``events.snapshot_truncates``): a truncate at the
    snapshot's position, then every row at that position, in key order, in batches of PER_FILE rows."""
    reads = [ev(Op.READ, 100, 0, schema=ITEMS, after={"id": i, "v": "first"}, snapshot=True)
             for i in range(1, ROWS + 1)]
    truncate = ChangeEvent(Op.TRUNCATE, ITEMS, reads[0].position, snapshot=True)
    return [([truncate] if b == 0 else []) + reads[b * PER_FILE:(b + 1) * PER_FILE] for b in range(FILES)]


@pytest.mark.parametrize(("fmt", "merges"), [("delta", 1), ("iceberg", 1), ("delta", 4)])
async def test_a_mirror_built_from_a_snapshot_is_written_in_key_ranges(
    spark: Any, tmp_path: Path, fmt: str, merges: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A new mirror's files hold disjoint key ranges whatever Spark's task layout (default settings here), so the
    MERGE of a small batch reads one or two of them. Written as they came, the snapshot's rows went through the
    per-key collapse (its truncate rules out the one-event-per-key shortcut) and every file spanned every key.
    A snapshot applied in several merges (``MAX_SEGMENT_EVENTS``) appends each later part in key ranges too:
    a MERGE laid its inserted rows out by a hash of the key (files each spanning the part's keys)."""
    from cdcd.spark import job, lakehouse
    from cdcd.spark.formats import lakehouse_format

    monkeypatch.setattr(lakehouse, "ROWS_PER_MIRROR_FILE", ROWS // 8 // merges)
    monkeypatch.setattr(job, "MAX_SEGMENT_EVENTS", ROWS // merges)
    landing, target = tmp_path / "landing", tmp_path / "target"
    await land(landing, snapshot_batches(), list(range(1, FILES + 1)))
    apply(landing, target, fmt)
    ref = lakehouse_format(fmt, target).mirror("public", "items")
    ranges = sorted((r["lo"], r["hi"]) for r in spark.sql(
        f"SELECT input_file_name() AS f, min(id) AS lo, max(id) AS hi FROM {ref} GROUP BY f").collect())
    assert len(ranges) >= 8, ranges
    assert all(hi < lo for (_, hi), (lo, _) in itertools.pairwise(ranges)), f"file key ranges overlap: {ranges}"
    assert spark.table(ref).count() == ROWS

    await apply_small_batch(spark, landing, target, fmt, ref)
    if fmt == "delta":
        merge = sql_metrics(spark, "Execute MergeIntoCommand")
        assert merge["number of target files before skipping"] >= 8, merge
        assert merge["number of target files after skipping"] <= 2, merge
    else:
        scan = sql_metrics(spark, "BatchScan cdcd.tables.public.items")
        assert scan["number of result data files"] <= 2, scan


NOKEY = TableSchema(TableId("public", "nokey"),
                    (Column("a", pa.int64(), "bigint"), Column("b", pa.string(), "text")), ())


@pytest.mark.parametrize("fmt", ["delta", "iceberg"])
async def test_the_key_bound_keeps_rows_whose_first_key_column_is_null(spark: Any, tmp_path: Path, fmt: str) -> None:
    """A table without a primary key merges on all its columns, NULLs included: the bound lets them through."""
    from test_spark_consumer import rows_of

    landing, target = tmp_path / "landing", tmp_path / "target"
    first = [ev(Op.CREATE, 100, i, schema=NOKEY, after={"a": a, "b": b})
             for i, (a, b) in enumerate([(None, "x"), (1, "y"), (5, "z")])]
    await land(landing, [first], [1])
    apply(landing, target, fmt)
    # only NULL in the first column, then NULL next to a range
    await land(landing, [[ev(Op.DELETE, 200, 1, schema=NOKEY, before={"a": None, "b": "x"})]], [2])
    apply(landing, target, fmt)
    assert sorted((r["a"], r["b"]) for r in rows_of(target, "public.nokey")) == [(1, "y"), (5, "z")]
    await land(landing, [[ev(Op.CREATE, 300, 1, schema=NOKEY, after={"a": None, "b": "w"}),
                          ev(Op.DELETE, 300, 2, schema=NOKEY, before={"a": 5, "b": "z"})]], [3])
    apply(landing, target, fmt)
    await land(landing, [[ev(Op.DELETE, 400, 1, schema=NOKEY, before={"a": None, "b": "w"}),
                          ev(Op.DELETE, 400, 2, schema=NOKEY, before={"a": 1, "b": "y"})]], [4])
    apply(landing, target, fmt)
    assert rows_of(target, "public.nokey") == []
