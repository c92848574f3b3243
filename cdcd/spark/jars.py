"""The one place that names the Spark, Delta Lake, Iceberg and SQLite JDBC versions.

pyproject.toml pins ``pyspark`` to ``SPARK``; ``scripts/bootstrap.sh`` runs
``python -m cdcd.spark.jars`` to print the Maven coordinates and copies
them into the project-local cache ``.jars/`` (``mvn dependency:copy``);
a locally started session passes the cached files as ``spark.jars`` (no
network at run time). Spark 4.1 is the newest line that both Delta Lake
(``delta-spark_4.1_2.13``) and Iceberg (``iceberg-spark-runtime-4.1_2.13``)
publish runtimes for.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

SPARK = "4.1.4"
SPARK_LINE = "4.1"
SCALA = "2.13"
DELTA = "4.4.0"
ICEBERG = "1.12.0"
SQLITE_JDBC = "3.54.1.0"

#: Maven coordinates, group:artifact:version. Delta's jar needs delta-storage next to it.
DELTA_PACKAGES = (f"io.delta:delta-spark_{SPARK_LINE}_{SCALA}:{DELTA}", f"io.delta:delta-storage:{DELTA}")
ICEBERG_PACKAGES = (
    f"org.apache.iceberg:iceberg-spark-runtime-{SPARK_LINE}_{SCALA}:{ICEBERG}",
    f"org.xerial:sqlite-jdbc:{SQLITE_JDBC}",  # the default JDBC catalog's database
)
PACKAGES = (*DELTA_PACKAGES, *ICEBERG_PACKAGES)

#: Where bootstrap puts the jars: CDCD_SPARK_JARS, else .jars/ at the project's root.
ENV = "CDCD_SPARK_JARS"


def cache_dir() -> Path:
    given = os.environ.get(ENV)
    return Path(given) if given else Path(__file__).resolve().parents[2] / ".jars"


def jar_name(coordinate: str) -> str:
    _, artifact, version = coordinate.split(":")
    return f"{artifact}-{version}.jar"


def cached_jars(packages: tuple[str, ...] = PACKAGES) -> list[Path] | None:
    """The cached jar files of ``packages``, None when one of them is missing."""
    paths = [cache_dir() / jar_name(c) for c in packages]
    return paths if all(p.is_file() for p in paths) else None


def packages_line(packages: tuple[str, ...]) -> str:
    return "--packages " + ",".join(packages)


DELTA_EXTENSION = "io.delta.sql.DeltaSparkSessionExtension"
DELTA_CATALOG = "org.apache.spark.sql.delta.catalog.DeltaCatalog"
ICEBERG_EXTENSION = "org.apache.iceberg.spark.extensions.IcebergSparkSessionExtensions"


def local_settings(only: str | None = None) -> dict[str, str]:
    """Settings of a session cdcd starts itself: the cached jars and both formats' extensions, or only the
    extension of format ``only`` (``delta``, ``iceberg``): each extension costs the session's start-up time.

    Empty when the cache is incomplete (``--format parquet`` needs none of it);
    ``--format delta|iceberg`` then says how to get the jars.
    """
    jars = cached_jars()
    if jars is None:
        return {}
    extensions = {"delta": DELTA_EXTENSION, "iceberg": ICEBERG_EXTENSION}
    return {
        "spark.jars": ",".join(str(p) for p in jars),
        # on the JVM's class path too (a local session's driver is its executor): loaded by the application
        # class loader, the classes can be kept in the class-data sharing archive (cdcd.spark.cds)
        "spark.driver.extraClassPath": os.pathsep.join(str(p) for p in jars),
        "spark.sql.extensions": extensions.get(only or "", f"{DELTA_EXTENSION},{ICEBERG_EXTENSION}"),
        **({} if only == "iceberg" else {"spark.sql.catalog.spark_catalog": DELTA_CATALOG}),
        # Delta rebuilds a table's state in this many tasks (default 50): far too many for a local session
        "spark.databricks.delta.snapshotPartitions": "2",
        "spark.ui.showConsoleProgress": "false",
    }


def main(argv: list[str]) -> int:
    """``python -m cdcd.spark.jars``: the coordinates (one a line) for the bootstrap's Maven copy."""
    if argv[1:] == ["--packages"]:
        print(packages_line(PACKAGES))
    else:
        print("\n".join(PACKAGES))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
