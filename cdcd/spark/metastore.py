"""Tables by name (``cdcd spark run --register-tables``, docs/spark.md "Tables by name").

A Delta target's mirror and change-log of ``<schema>.<table>`` are registered in the session catalog as
``<schema>.<table>`` and ``<schema>.<table>_changelog``: the source's database/schema becomes the catalog's
database, as Debezium's and Flink CDC's sinks into Hive, Iceberg or Paimon name them, so a reader's
``spark.table("public.orders")`` is the name it knows from the source. Each is an external table over the
directory the consumer writes (``CREATE TABLE IF NOT EXISTS ... USING DELTA LOCATION``): dropping it removes
the name only. A name that exists over another location is refused, never re-pointed or dropped.

The catalog is the session's: a Hive metastore. A local session (``cdcd spark run`` without spark-submit)
gets an embedded Derby metastore under ``TARGET/state/metastore/`` (``local_settings``), which one JVM at a
time may open; under spark-submit the cluster's metastore (``hive-site.xml``, ``spark.hadoop.hive.metastore.
uris``, Glue, Dataproc Metastore) stands. Iceberg's tables are in its catalog ``cdcd`` already.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path
from urllib.parse import unquote, urlparse

from pyspark.sql import SparkSession

from cdcd.errors import ConfigError
from cdcd.logging import get_logger
from cdcd.spark.lakehouse import Lakehouse
from cdcd.spark.objtarget import table_uri

_log = get_logger("cdcd.spark")

#: Under TARGET/state: the embedded metastore's Derby database, its log and the warehouse of its databases.
METASTORE_DIR = "metastore"
CHANGELOG_SUFFIX = "_changelog"
#: The names a Hive metastore takes (it stores them in lower case).
_HIVE_NAME = re.compile(r"^[A-Za-z0-9_]+$")


class CatalogRefused(ConfigError):
    """The catalog cannot take the target's tables by name: a name it holds over another location (cdcd never
    re-points or drops an operator's table), or it is not a Hive metastore."""


def metastore_dir(target: Path) -> Path:
    return target.resolve() / "state" / METASTORE_DIR


def local_settings(target: Path) -> dict[str, str]:
    """A local session's settings for an embedded Derby metastore under the target; every reader of it starts
    its session with the same ones (static: they must be set before the session starts)."""
    root = metastore_dir(target)
    return {"spark.sql.catalogImplementation": "hive",
            "spark.hadoop.javax.jdo.option.ConnectionURL":
                f"jdbc:derby:;databaseName={root / 'metastore_db'};create=true",
            # the databases' default location: under the target, not a temporary or the working directory
            "spark.sql.warehouse.dir": str(root / "warehouse")}


def java_options(target: Path) -> str:
    """Derby writes its derby.log under ``derby.system.home`` (default: the working directory)."""
    return f"-Dderby.system.home={metastore_dir(target)}"


def names(schema: str, table: str) -> dict[str, str]:
    """The catalog's ``database.table`` of each kind of ``schema.table`` (``tables``, ``changelog``)."""
    db, t = schema.lower(), table.lower()
    return {"tables": f"{db}.{t}", "changelog": f"{db}.{t}{CHANGELOG_SUFFIX}"}


def _plain(location: str) -> str:
    """A location as compared: ``file:/x``, ``file:///x/`` and ``/x`` alike."""
    if location.startswith("file:"):
        return unquote(urlparse(location).path).rstrip("/")
    return location.rstrip("/")


def location_of(spark: SparkSession, name: str) -> str | None:
    """The catalog's location of ``database.table`` (None: it has none, e.g. a view)."""
    db, t = name.split(".", 1)
    for row in spark.sql(f"DESCRIBE TABLE EXTENDED `{db}`.`{t}`").collect():
        if row["col_name"] == "Location":
            return str(row["data_type"])
    return None


class Registrar:
    """Registers a Delta target's tables by name, once per table and process (``register``)."""

    def __init__(self, spark: SparkSession, fmt: Lakehouse) -> None:
        self.spark = spark
        self.fmt = fmt
        self.done: set[str] = set()

    def register(self, tables: Iterable[str]) -> None:
        """Register the mirror and change-log of each ``schema.table`` not registered by this process yet;
        raises ``CatalogRefused`` for a name the catalog holds over another location."""
        for name in sorted(set(tables) - self.done):
            schema, table = name.split(".", 1)
            if not (_HIVE_NAME.match(schema) and _HIVE_NAME.match(table)):
                # a Hive metastore refuses such a name: the table stays readable by its path
                _log.warning("table not registered by name: a Hive metastore takes letters, digits and _ only",
                             table=name, location=table_uri(self.fmt.location("tables", schema, table)))
                self.done.add(name)
                continue
            for kind, by_name in names(schema, table).items():
                if self.fmt.exists(self.spark, kind, schema, table):
                    self._one(by_name, table_uri(self.fmt.location(kind, schema, table)), kind, name)
            self.done.add(name)

    def _one(self, by_name: str, location: str, kind: str, source: str) -> None:
        db, t = by_name.split(".", 1)
        self.spark.sql(f"CREATE DATABASE IF NOT EXISTS `{db}`")
        quoted = location.replace("\\", "\\\\").replace("'", "\\'")
        self.spark.sql(f"CREATE TABLE IF NOT EXISTS `{db}`.`{t}` USING DELTA LOCATION '{quoted}'")
        have = location_of(self.spark, by_name)
        if have is None or _plain(have) != _plain(location):
            what = "mirror" if kind == "tables" else "change-log"
            raise CatalogRefused(
                f"--register-tables: the session catalog's table {by_name} is at {have or 'no location (a view)'}, "
                f"not at {location}, the {what} of {source}; cdcd never re-points or drops a table it did not "
                f"register. Rename that table (ALTER TABLE {by_name} RENAME TO ...), or run without "
                "--register-tables and read this one by its path (docs/spark.md, Tables by name)")
        _log.debug("table registered by name", table=by_name, location=location)
