"""The Iceberg target (``--format iceberg``): tables in a catalog, the batch in the snapshot summary.

What Iceberg does otherwise than Delta Lake on top of ``cdcd.spark.lakehouse``: tables live in a catalog
(by default JDBC on an embedded SQLite file under TARGET, registered by the job; a catalog given with
``--conf`` is used as it is) under the namespaces ``tables.<schema>`` and ``changelog.<schema>``; tinyint and
smallint are stored as int; changes are written merge-on-read; and each commit records its statement and
batch as snapshot summary properties (``cdcd.step``, ``cdcd.batch``), read back from the table's
``snapshots`` metadata table.
"""

from __future__ import annotations

import json
import sqlite3
from contextlib import closing
from pathlib import Path

from pyspark.sql import SparkSession
from pyspark.sql.types import ByteType, DataType, DecimalType, ShortType

from cdcd.landing.objstore import is_object_url
from cdcd.spark import jars
from cdcd.spark import lakehouse_sql as sql
from cdcd.spark.commitrecord import CommitRecord
from cdcd.spark.lakehouse import Lakehouse
from cdcd.spark.strategy import Applied

ICEBERG_CATALOG = "cdcd"
ICEBERG_PROPERTY = "spark.sql.iceberg.snapshot-property."
BATCH_PROPERTY = "cdcd.batch"  # Iceberg snapshot summary: the last landed batch seq this commit applied
STEP_PROPERTY = "cdcd.step"  # Iceberg snapshot summary: which statement (changelog, truncate, mirror)

#: The catalog settings this process registered itself (a catalog the user configured is left alone).
_REGISTERED: dict[str, str] = {}


def iceberg_settings(target: Path) -> dict[str, str]:
    """The default Iceberg catalog: JDBC on an embedded SQLite file under TARGET, warehouse TARGET."""
    prefix = f"spark.sql.catalog.{ICEBERG_CATALOG}"
    root = target.resolve()
    return {prefix: "org.apache.iceberg.spark.SparkCatalog", f"{prefix}.type": "jdbc",
            f"{prefix}.uri": f"jdbc:sqlite:{root / 'state' / 'iceberg-catalog.db'}",
            f"{prefix}.jdbc.schema-version": "V1", f"{prefix}.warehouse": root.as_uri()}


class Iceberg(Lakehouse):
    """``--format iceberg``."""

    name = "iceberg"
    marker_class = "org.apache.iceberg.spark.SparkCatalog"
    packages = jars.packages_line(jars.ICEBERG_PACKAGES)
    #: A small batch must not rewrite the data files of a large mirror: position deletes (merge-on-read).
    mirror_props = {"format-version": "2", "write.merge.mode": "merge-on-read", "write.delete.mode": "merge-on-read",
                    "write.update.mode": "merge-on-read"}
    log_props = {"format-version": "2"}

    def check_target(self, spark: SparkSession) -> str | None:
        """Also refuses a catalog ``cdcd`` given as Iceberg's Hadoop catalog: its commit is a rename of the
        metadata file, not atomic on object storage and unsafe on a local file system per Iceberg's own docs, so
        two commits could both succeed and one be lost (docs/spark.md, Iceberg catalogs)."""
        prefix = f"spark.sql.catalog.{ICEBERG_CATALOG}"
        kind = (spark.conf.get(f"{prefix}.type", None) or "").lower()
        impl = spark.conf.get(f"{prefix}.catalog-impl", None) or ""
        ours = bool(_REGISTERED) and all(spark.conf.get(k, None) == v for k, v in _REGISTERED.items())
        if is_object_url(self.target) and (spark.conf.get(prefix, None) is None or ours):
            return (f"--format iceberg: the target {self.target} is on object storage, where the job's own catalog "
                    f"(a SQLite file under the target, for one host) cannot be: give the catalog {ICEBERG_CATALOG} "
                    f"with --conf or spark-defaults.conf, a JDBC catalog on PostgreSQL ({prefix}.type=jdbc, "
                    f"{prefix}.uri=jdbc:postgresql://...) or a REST catalog ({prefix}.type=rest), its warehouse "
                    f"on the store ({prefix}.warehouse=s3a://...; docs/spark.md, Iceberg catalogs)")
        if spark.conf.get(prefix, None) is not None and (kind == "hadoop" or impl.endswith(".HadoopCatalog")):
            given = f"{prefix}.type=hadoop" if kind == "hadoop" else f"{prefix}.catalog-impl={impl}"
            return (f"--format iceberg: the catalog {ICEBERG_CATALOG} is Iceberg's Hadoop catalog ({given}), whose "
                    "commits are not atomic: give it a catalog with atomic commits (type=jdbc on PostgreSQL, or "
                    "type=rest; docs/spark.md, Iceberg catalogs), or leave it out for the job's own (a SQLite file "
                    "under the target, for one host)")
        return super().check_target(spark)

    def register(self, spark: SparkSession) -> None:
        """The job's default catalog for TARGET, unless a catalog was given with --conf (JDBC on PostgreSQL, REST,
        ...): that one is used as it is."""
        target = self.target
        prefix = f"spark.sql.catalog.{ICEBERG_CATALOG}"
        ours = bool(_REGISTERED) and all(spark.conf.get(k, None) == v for k, v in _REGISTERED.items())
        if spark.conf.get(prefix, None) is not None and not ours:
            return
        wanted = iceberg_settings(target)
        if any(spark.conf.get(k, None) != v for k, v in wanted.items()):
            (target / "state").mkdir(parents=True, exist_ok=True)
            for k, v in wanted.items():
                spark.conf.set(k, v)
                _REGISTERED[k] = v
            jsession = spark._jsparkSession
            jsession.sessionState().catalogManager().reset()  # another target before, in this process

    def namespaces(self, schema: str) -> list[str]:
        return [sql.catalog_table(ICEBERG_CATALOG, kind, schema) for kind in ("tables", "changelog")]

    def ref(self, kind: str, schema: str, table: str) -> str:
        return sql.catalog_table(ICEBERG_CATALOG, kind, schema, table)

    def exists(self, spark: SparkSession, kind: str, schema: str, table: str) -> bool:
        return bool(spark.catalog.tableExists(self.ref(kind, schema, table)))

    def stored_leaf(self, dt: DataType) -> str:
        """Iceberg keeps tinyint and smallint as int."""
        return "int" if isinstance(dt, ByteType | ShortType) else dt.simpleString()

    def widens_in_place(self, old: DataType, new: DataType) -> bool:
        """Iceberg's type promotions: int to long (tinyint and smallint are stored as int), float to double, a
        decimal's precision up at the same scale."""
        if isinstance(old, DecimalType) and isinstance(new, DecimalType):
            return old.scale == new.scale and new.precision >= old.precision
        o, n = self.stored_leaf(old), new.simpleString()
        return (o, n) in {("int", "bigint"), ("float", "double")}

    # -- the commit record: snapshot summary properties

    def commit_settings(self, record: CommitRecord) -> dict[str, str]:
        return {ICEBERG_PROPERTY + STEP_PROPERTY: record.step, ICEBERG_PROPERTY + BATCH_PROPERTY: str(record.seq)}

    def applied_seq(self, spark: SparkSession, kind: str, schema: str, table: str, step: str) -> int:
        snapshots = self.ref(kind, schema, table) + ".`snapshots`"
        row = spark.sql(f"SELECT max(CAST(summary[{sql.literal(BATCH_PROPERTY)}] AS BIGINT)) FROM {snapshots} "
                        f"WHERE summary[{sql.literal(STEP_PROPERTY)}] = {sql.literal(step)}").first()
        return int(row[0]) if row is not None and row[0] is not None else 0

    def files_after(self, applied: Applied, tables: list[tuple[str, str]],
                    since: float) -> tuple[int | None, int | None]:
        """In the job's default catalog: the summaries of the snapshots made since the merge started, from the
        table's current metadata (the catalog's SQLite file says which). None: not known (a catalog given with
        --conf)."""
        catalog = self.target / "state" / "iceberg-catalog.db"
        if not catalog.is_file():
            return None, None
        added = rewritten = 0
        with closing(sqlite3.connect(f"{catalog.resolve().as_uri()}?mode=ro", uri=True, timeout=10)) as db:
            for schema, table in tables:
                for kind in ("changelog", "tables"):
                    row = db.execute("SELECT metadata_location FROM iceberg_tables WHERE table_namespace = ? AND "
                                     "table_name = ?", (f"{kind}.{schema}", table)).fetchone()
                    if row is None:
                        return None, None
                    metadata = json.loads(Path(str(row[0]).removeprefix("file:").replace("///", "/", 1))
                                          .read_text())
                    for snap in metadata.get("snapshots", []):
                        if snap.get("timestamp-ms", 0) >= since * 1000:
                            summary = snap.get("summary", {})
                            added += int(summary.get("added-data-files", 0)) + int(summary.get("added-delete-files", 0))
                            rewritten += (int(summary.get("deleted-data-files", 0))
                                          + int(summary.get("removed-delete-files", 0)))
        return added, rewritten
