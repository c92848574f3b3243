"""The error line of a failed merge names the fix for the failures an operator can act on."""

from __future__ import annotations

from pathlib import Path

from cdcd.spark.job import describe
from cdcd.spark.strategy import FAILED_TABLE


def failed(message: str, table: str | None = "public.items") -> Exception:
    exc = RuntimeError(message)
    if table is not None:
        setattr(exc, FAILED_TABLE, table)
    return exc


def test_a_type_change_delta_refuses_points_at_the_two_ways_out(tmp_path: Path) -> None:
    exc = failed("[DELTA_UNSUPPORTED_ALTER_TABLE_CHANGE_COL_OP] ALTER TABLE CHANGE COLUMN is not supported for "
                 "changing column title from STRING to BIGINT")
    failure = describe(exc, tmp_path / "landing", tmp_path / "target", "delta", [])
    assert failure.table == "public.items" and failure.fix is not None
    assert "type widening does not cover" in failure.fix and "cdcd.rewrite.<column>" in failure.fix
    assert str(tmp_path / "target" / "tables" / "public.items") in failure.fix  # the mirror it names


def test_a_full_disk_names_the_target_and_the_landing_zone(tmp_path: Path) -> None:
    exc = failed("java.io.IOException: No space left on device", table=None)
    failure = describe(exc, tmp_path / "landing", tmp_path / "target", "parquet", [])
    assert failure.fix is not None and "a file system is full" in failure.fix
    assert str(tmp_path / "target") in failure.fix and f"{tmp_path / 'landing'} (its consumed markers)" in failure.fix


def test_a_full_code_cache_is_not_taken_for_a_full_heap(tmp_path: Path) -> None:
    # the JVM reports some code cache failures as an OutOfMemoryError: the fix is the code cache's, not the heap's
    exc = failed("java.lang.OutOfMemoryError: Out of space in CodeCache for method handle intrinsic", table=None)
    failure = describe(exc, tmp_path / "landing", tmp_path / "target", "delta", [])
    assert failure.fix is not None and "code cache is full" in failure.fix and "heap" not in failure.fix
