"""The consumer's record in each commit of a Delta Lake or Iceberg table: which statement, which batch.

Each format writes it into the commit its own way (``Lakehouse.commit_settings``): Delta's idempotent-write
transaction, Iceberg's snapshot summary. It is what makes a batch apply once (docs/spark.md, Exactly once), on a
file system and on object storage alike.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from pyspark.sql import SparkSession


@dataclass(frozen=True, slots=True)
class CommitRecord:
    """What a commit records of the consumer: the statement (``step``: changelog, truncate, mirror, covered) and
    the last landed batch seq it applied. Each format writes it into the commit its own way
    (``Lakehouse.commit_settings``; a DataFrame write of Delta takes it as write options, ``Delta.append``)."""

    step: str
    seq: int


@contextmanager
def recorded(spark: SparkSession, settings: dict[str, str]) -> Iterator[None]:
    """Run a SQL statement whose commit records ``settings`` (``Lakehouse.commit_settings`` of a ``CommitRecord``).

    The one place the consumer sets session settings for a commit: a SQL statement (MERGE INTO, DELETE, INSERT)
    takes no per-statement options in Spark, and both formats read their commit metadata for SQL statements
    from the session only (Delta's idempotent-write transaction, Iceberg's snapshot properties). A DataFrame
    write takes them as its own options instead (``Delta.append``).
    """
    for k, v in settings.items():
        spark.conf.set(k, v)
    try:
        yield
    finally:
        for k in settings:
            spark.conf.unset(k)
