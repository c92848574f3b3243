"""The jars cdcd resolves follow the installed Spark line (cdcd.spark.jars LINES): 4.1, the pinned line, and 4.0,
which scripts/compat.sh runs the Spark integration tests on (docs/spark.md, "Supported Spark lines")."""

from __future__ import annotations

import importlib.metadata

import pytest

from cdcd.spark import jars


def test_the_coordinates_are_those_of_the_installed_line() -> None:
    installed = importlib.metadata.version("pyspark")
    assert ".".join(installed.split(".")[:2]) == jars.SPARK_LINE  # both supported lines are known by name
    delta, storage = jars.DELTA_PACKAGES
    assert f":iceberg-spark-runtime-{jars.SPARK_LINE}_{jars.SCALA}:" in jars.ICEBERG_PACKAGES[0]
    # Delta Lake 4.0.x is Spark 4.0's (its jar name has no line); later releases name the line in the jar
    assert delta.endswith(f":delta-spark_{jars.SCALA}:4.0.1") if jars.SPARK_LINE == "4.0" else \
        f":delta-spark_{jars.SPARK_LINE}_{jars.SCALA}:" in delta
    assert storage == f"io.delta:delta-storage:{delta.rsplit(':', 1)[1]}"


@pytest.mark.parametrize(("version", "line"), [("4.0.5", "4.0"), ("4.1.4", "4.1"), ("3.5.6", "4.1"), (None, "4.1")])
def test_a_line_outside_the_supported_ones_gets_the_pinned_coordinates(
        monkeypatch: pytest.MonkeyPatch, version: str | None, line: str) -> None:
    def installed(name: str) -> str:
        if version is None:  # no pyspark at all: the daemon's side
            raise importlib.metadata.PackageNotFoundError(name)
        return version

    monkeypatch.setattr(importlib.metadata, "version", installed)
    assert jars.installed_line() == line
    assert line in jars.LINES
