"""A completed re-snapshot's covered record removes the mirror rows it did not see, in every target format.

Batches are landed by the real landing sink (the record comes from a SNAPSHOT_COVERED
mark, as the incremental snapshot emits it) and applied by the consumer's ``run`` in one
shared local Spark session with the real Delta/Iceberg jars.
"""

from __future__ import annotations

from decimal import Decimal
from pathlib import Path

import pytest
from test_spark_consumer import FORMATS, LOG, T, ev, mirror, row, rows_of

from cdcd.events import Item, Mark, MarkKind, Op, TableId
from cdcd.positions import PgPosition
from cdcd.runtime.interfaces import Batch
from cdcd.sinks.landing import LandingSink

pytestmark = pytest.mark.spark

BELOW = PgPosition(300, 0)  # the re-snapshot's first low watermark


def covered(lsn: int, table: TableId, key_range: dict[str, object] | None = None) -> Mark:
    detail: dict[str, object] = {"table": table, "below": BELOW}
    if key_range is not None:
        detail["range"] = key_range
    return Mark(MarkKind.SNAPSHOT_COVERED, PgPosition(lsn, 0), detail)


async def land(path: Path, batches: dict[int, list[Item]]) -> None:
    sink = LandingSink(path)
    await sink.open()
    for seq, items in batches.items():
        await sink.deliver(Batch(seq, items))
    await sink.close()


def apply(landing: Path, target: Path, fmt: str) -> None:
    from cdcd.spark.job import run

    assert run(str(landing), str(target), once=True, fmt=fmt) == 0


def amounts(target: Path) -> dict[object, Decimal]:
    return {k: r["amount"] for k, r in mirror(target, "public.orders").items()}  # type: ignore[misc]


def mirror_commits(target: Path, fmt: str) -> int | None:
    """Commits of the orders mirror (Delta versions, Iceberg snapshots); None for Parquet."""
    from pyspark.sql import SparkSession

    from cdcd.spark.formats import lakehouse_format

    if fmt == "parquet":
        return None
    session = SparkSession.getActiveSession()
    assert session is not None
    ref = lakehouse_format(fmt, target).ref("tables", "public", "orders")
    if fmt == "delta":
        return session.sql(f"DESCRIBE HISTORY {ref}").count()
    return session.table(ref + ".`snapshots`").count()


@pytest.mark.parametrize("fmt", FORMATS)
async def test_a_resnapshot_removes_the_rows_deleted_behind_cdcds_back(spark: object, tmp_path: Path,
                                                                       fmt: str) -> None:
    """Rows 3 and 4 were deleted while replication was off; the re-snapshot re-sends 1, 2, 5, 6.

    ``orders``' record arrives in a batch with its rows (one merge with the events); ``log``'s
    alone in a batch of marks (a segment without events of the table). Rows below the
    threshold go, rows at or above it stay; applying everything again changes nothing.
    """
    landing, target = tmp_path / "landing", tmp_path / "target"
    await land(landing, {
        1: [*(ev(Op.READ, 100, 0, after=row(i), snapshot=True) for i in range(1, 7)),
            *(ev(Op.READ, 100, 0, schema=LOG, after={"k": k, "v": "old"}, snapshot=True) for k in (1, 2))],
        2: [ev(Op.UPDATE, 200, 1, before=row(2), after=row(2, amount=Decimal("2.75")))],
    })
    apply(landing, target, fmt)
    assert sorted(amounts(target)) == [1, 2, 3, 4, 5, 6]
    # the re-snapshot: a row created exactly at the threshold and one after it, the chunk at its high watermark
    await land(landing, {
        3: [ev(Op.CREATE, 300, 0, after=row(8)), ev(Op.CREATE, 310, 1, after=row(7)),
            *(ev(Op.READ, 320, 0, after=row(i, amount=Decimal(f"{i}.25")), snapshot=True) for i in (1, 2, 5, 6)),
            ev(Op.READ, 320, 0, schema=LOG, after={"k": 1, "v": "new"}, snapshot=True),
            covered(340, T)],
        4: [ev(Op.UPDATE, 350, 1, before=row(5), after=row(5, amount=Decimal("5.99")))],
    })
    apply(landing, target, fmt)
    assert amounts(target) == {1: Decimal("1.25"), 2: Decimal("2.25"), 5: Decimal("5.99"), 6: Decimal("6.25"),
                               7: Decimal("7.50"), 8: Decimal("8.50")}
    assert sorted(r["k"] for r in rows_of(target, "public.log")) == [1, 2]  # its record has not come yet
    await land(landing, {5: [Mark(MarkKind.HEARTBEAT, PgPosition(390, 0)), covered(400, LOG.table)]})
    apply(landing, target, fmt)
    assert [(r["k"], r["v"]) for r in rows_of(target, "public.log")] == [(1, "new")]
    # nothing appended to the change-log: it holds what the source sent (no delete of 3 or 4)
    assert sorted(r["_cdc_op"] for r in rows_of(target, "public.orders", "changelog")) == ["c"] * 2 + ["r"] * 10 + [
        "u"] * 2

    before, commits = amounts(target), mirror_commits(target, fmt)
    (target / "state" / "consumer.json").unlink()  # the consumer forgot: batches 1..5 come again, in one merge
    apply(landing, target, fmt)
    assert amounts(target) == before
    assert [(r["k"], r["v"]) for r in rows_of(target, "public.log")] == [(1, "new")]
    if fmt == "delta":  # every statement, the covered delete too, is skipped by its recorded batch seq
        assert mirror_commits(target, fmt) == commits


@pytest.mark.parametrize("fmt", FORMATS)
async def test_a_key_range_resync_removes_only_the_rows_of_its_range(spark: object, tmp_path: Path, fmt: str) -> None:
    """`cdcd snapshot --where "id BETWEEN 3 AND 6"` after 4 and 6 were deleted behind cdcd's back: it re-reads 3
    and 5; its record removes 4 and 6 and keeps 1, 2, 7, 8 (below its bound too, but outside the range). ``log``'s
    key-list record (``k IN (2)``) arrives in a batch without its events: only k = 2 goes."""
    landing, target = tmp_path / "landing", tmp_path / "target"
    await land(landing, {
        1: [*(ev(Op.READ, 100, 0, after=row(i), snapshot=True) for i in range(1, 9)),
            *(ev(Op.READ, 100, 0, schema=LOG, after={"k": k, "v": "old"}, snapshot=True) for k in (1, 2, 3))],
    })
    apply(landing, target, fmt)
    await land(landing, {
        2: [*(ev(Op.READ, 320, 0, after=row(i, amount=Decimal(f"{i}.25")), snapshot=True) for i in (3, 5)),
            covered(340, T, {"column": "id", "lo": 3, "lo_inclusive": True, "hi": 6, "hi_inclusive": True})],
        3: [Mark(MarkKind.HEARTBEAT, PgPosition(390, 0)), covered(400, LOG.table, {"column": "k", "values": [2]})],
    })
    apply(landing, target, fmt)
    assert sorted(amounts(target)) == [1, 2, 3, 5, 7, 8]
    assert amounts(target)[3] == Decimal("3.25")
    assert sorted(r["k"] for r in rows_of(target, "public.log")) == [1, 3]


async def test_a_version_2_zone_still_applies(spark: object, tmp_path: Path) -> None:
    """Manifests written before format 3 (no ``covered`` list) apply as before."""
    import json

    from cdcd.landing.layout import MANIFESTS
    from cdcd.landing.manifest import load_manifest, seal

    landing, target = tmp_path / "landing", tmp_path / "target"
    await land(landing, {
        1: [ev(Op.READ, 100, 0, after=row(i), snapshot=True) for i in range(1, 4)],
        2: [ev(Op.DELETE, 200, 1, before={"id": 2}), ev(Op.UPDATE, 210, 1, before=row(3),
                                                         after=row(3, amount=Decimal("3.99")))],
    })
    for path in sorted((landing / MANIFESTS).iterdir()):
        old = {k: v for k, v in load_manifest(path).items() if k not in ("covered", "checksum")}
        path.write_text(json.dumps(seal({**old, "version": 2})))
    apply(landing, target, "parquet")
    assert amounts(target) == {1: Decimal("1.50"), 3: Decimal("3.99")}
