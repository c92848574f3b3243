"""A smoke run of the bench (``--quick``: the test suite runs one) never replaces the committed results and chart
of a default run (docs/benchmarks.md)."""

from __future__ import annotations

from pathlib import Path

from bench.__main__ import ROOT, destinations


def test_a_default_run_writes_the_committed_results_and_chart() -> None:
    assert destinations(False, None, None) == (ROOT / "bench" / "results", ROOT / "docs" / "benchmarks.png")


def test_a_quick_run_writes_beside_them_under_bench_work() -> None:
    out, chart = destinations(True, None, None)
    assert out == ROOT / "bench" / "work" / "quick" and chart == out / "benchmarks.png"


def test_given_places_stand(tmp_path: Path) -> None:
    assert destinations(True, tmp_path, tmp_path / "c.png") == (tmp_path, tmp_path / "c.png")
    assert destinations(False, tmp_path, None) == (tmp_path, ROOT / "docs" / "benchmarks.png")
