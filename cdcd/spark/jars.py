"""The one place that names the Spark, Delta Lake, Iceberg, SQLite JDBC and PostgreSQL JDBC versions.

pyproject.toml pins ``pyspark`` to ``SPARK``; ``scripts/bootstrap.sh`` runs
``python -m cdcd.spark.jars`` to print the Maven coordinates and copies
them into the project-local cache ``.jars/`` (``mvn dependency:copy``);
the container image's ``spark`` stage runs ``python -m cdcd.spark.jars --fetch
/opt/cdcd/jars`` (``fetch``: the same files from Maven Central without Maven) and
sets ``CDCD_SPARK_JARS`` to that directory. A locally started session passes the
cached files as ``spark.jars`` (no network at run time). Spark 4.1 is the newest line that both Delta Lake
(``delta-spark_4.1_2.13``) and Iceberg (``iceberg-spark-runtime-4.1_2.13``)
publish runtimes for. The 4.0 line (pyspark 4.0.x and the Delta Lake and Iceberg releases built for it) is
supported too: where the installed pyspark is 4.0.x, the coordinates below are that line's (``LINES``), and
``scripts/compat.sh`` runs the Spark integration tests on it (docs/spark.md, "Supported Spark lines").
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import sys
import urllib.request
from pathlib import Path

SPARK = "4.1.4"  # the version pyproject.toml pins
SCALA = "2.13"
#: Per supported Spark line: Delta Lake's jar name and version, Iceberg's version, the Hadoop inside that line's
#: pyspark (its jars/hadoop-client-api-*.jar: hadoop-aws must be this very version) and the AWS SDK bundle that
#: Hadoop release was built with (hadoop-project's aws-java-sdk-v2.version). Delta 4.0.x, built for Spark 4.0,
#: has no Spark line in its jar's name; later Delta releases do.
LINES = {
    "4.1": (f"delta-spark_4.1_{SCALA}", "4.4.0", "1.12.0", "3.4.2", "2.29.52"),
    "4.0": (f"delta-spark_{SCALA}", "4.0.1", "1.11.0", "3.4.1", "2.24.6"),
}


def installed_line() -> str:
    """The line of the installed pyspark when it is one of ``LINES``, else the pinned one (also without pyspark:
    the daemon's side needs no Spark). Read from the package's metadata, without importing pyspark."""
    pinned = SPARK.rsplit(".", 1)[0]
    try:
        line = ".".join(importlib.metadata.version("pyspark").split(".")[:2])
    except importlib.metadata.PackageNotFoundError:
        return pinned
    return line if line in LINES else pinned


SPARK_LINE = installed_line()
DELTA_ARTIFACT, DELTA, ICEBERG, HADOOP, AWS_SDK = LINES[SPARK_LINE]
SQLITE_JDBC = "3.54.1.0"
POSTGRES_JDBC = "42.7.14"

#: Maven coordinates, group:artifact:version. Delta's jar needs delta-storage next to it.
DELTA_PACKAGES = (f"io.delta:{DELTA_ARTIFACT}:{DELTA}", f"io.delta:delta-storage:{DELTA}")
ICEBERG_PACKAGES = (
    f"org.apache.iceberg:iceberg-spark-runtime-{SPARK_LINE}_{SCALA}:{ICEBERG}",
    f"org.xerial:sqlite-jdbc:{SQLITE_JDBC}",  # the default JDBC catalog's database
)
PACKAGES = (*DELTA_PACKAGES, *ICEBERG_PACKAGES)
#: The driver of an Iceberg JDBC catalog on PostgreSQL, which a target on object storage needs (a SQLite file
#: cannot be there): on a local session's class path with S3A's jars only (the others' class path, and with it
#: their class-data sharing archive, stays as it was).
CATALOG_PACKAGES = (f"org.postgresql:postgresql:{POSTGRES_JDBC}",)

#: A Hive metastore database several Spark processes share (the tests' stand-in for a cluster's metastore
#: database: a Derby network server on the Derby release pyspark ships, and its JDBC client for the sessions).
DERBY = "10.16.1.1"
METASTORE_DB_PACKAGES = (f"org.apache.derby:derbynet:{DERBY}", f"org.apache.derby:derbyclient:{DERBY}")

#: S3A (``s3a://`` paths) for Spark: not on a local session's class path unless asked for (the bundle is 640 MB).
OBJECT_STORE_PACKAGES = (f"org.apache.hadoop:hadoop-aws:{HADOOP}", f"software.amazon.awssdk:bundle:{AWS_SDK}")

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


def installed_hadoop() -> str | None:
    """The Hadoop version of the installed pyspark (its ``hadoop-client-api`` jar), None when none is found."""
    import pyspark  # the pyspark extra: only where Spark runs

    found = sorted((Path(pyspark.__file__).parent / "jars").glob("hadoop-client-api-*.jar"))
    return found[-1].name.removeprefix("hadoop-client-api-").removesuffix(".jar") if found else None


def local_settings(only: str | None = None, object_store: bool = False) -> dict[str, str]:
    """Settings of a session cdcd starts itself: the cached jars and both formats' extensions, or only the
    extension of format ``only`` (``delta``, ``iceberg``): each extension costs the session's start-up time.
    ``object_store``: hadoop-aws and the AWS SDK bundle too (``OBJECT_STORE_PACKAGES``), and the PostgreSQL
    JDBC driver (``CATALOG_PACKAGES``).

    Empty when the cache is incomplete (``--format parquet`` needs none of it);
    ``--format delta|iceberg`` then says how to get the jars.
    """
    jars = cached_jars(PACKAGES + CATALOG_PACKAGES + OBJECT_STORE_PACKAGES if object_store else PACKAGES)
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


MAVEN_CENTRAL = "https://repo1.maven.org/maven2"
#: Seconds one jar's download may take.
FETCH_TIMEOUT = 300


def jar_url(coordinate: str, repo: str = MAVEN_CENTRAL) -> str:
    """Where a Maven repository (Maven Central's layout) keeps the jar of ``coordinate``."""
    group, artifact, version = coordinate.split(":")
    return f"{repo.rstrip('/')}/{group.replace('.', '/')}/{artifact}/{version}/{jar_name(coordinate)}"


def fetch(directory: Path, repo: str = MAVEN_CENTRAL, packages: tuple[str, ...] = PACKAGES) -> list[Path]:
    """Download the jars of ``packages`` into ``directory`` (those there already are kept), each checked against
    the SHA-1 the repository publishes next to it; the paths, as ``cached_jars`` finds them there."""
    directory.mkdir(parents=True, exist_ok=True)
    out = []
    for coordinate in packages:
        final = directory / jar_name(coordinate)
        out.append(final)
        if final.is_file():
            continue
        url = jar_url(coordinate, repo)
        try:
            with urllib.request.urlopen(url, timeout=FETCH_TIMEOUT) as r:
                data = r.read()
            with urllib.request.urlopen(f"{url}.sha1", timeout=FETCH_TIMEOUT) as r:
                expected = r.read().decode().split()[0].lower()
        except OSError as exc:
            raise OSError(f"cannot fetch {coordinate} from {url}: {exc}; check this machine's access to {repo} "
                          "(or give --repo a Maven mirror)") from exc
        if hashlib.sha1(data).hexdigest() != expected:
            raise OSError(f"{url}: its SHA-1 is not the {expected} the repository publishes for it: a broken "
                          "download or mirror; try again or give --repo another mirror")
        temp = final.with_name(f".{final.name}.tmp")
        temp.write_bytes(data)
        os.replace(temp, final)
    return out


def main(argv: list[str]) -> int:
    """``python -m cdcd.spark.jars``: the coordinates (one a line, S3A's and the metastore database's too) for the
    bootstrap's Maven copy;
    ``--packages``: the formats' as spark-submit's option, ``--object-store-packages``: S3A's;
    ``--fetch DIR [--repo URL]``: download the formats' into DIR."""
    args = argv[1:]
    if args == ["--packages"]:
        print(packages_line(PACKAGES))
    elif args == ["--object-store-packages"]:
        print(packages_line(OBJECT_STORE_PACKAGES))
    elif args[:1] == ["--fetch"] and len(args) in (2, 4) and (len(args) == 2 or args[2] == "--repo"):
        try:
            paths = fetch(Path(args[1]), args[3] if len(args) == 4 else MAVEN_CENTRAL)
        except OSError as exc:
            print(f"cdcd.spark.jars: {exc}", file=sys.stderr)
            return 1
        print("\n".join(str(p) for p in paths))
    elif args:
        print("usage: python -m cdcd.spark.jars [--packages | --object-store-packages | --fetch DIR [--repo URL]]",
              file=sys.stderr)
        return 2
    else:  # the bootstrap's list: the PostgreSQL driver, S3A's jars and the metastore database's too
        print("\n".join(PACKAGES + CATALOG_PACKAGES + OBJECT_STORE_PACKAGES + METASTORE_DB_PACKAGES))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
