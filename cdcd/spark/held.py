"""The batch seqs a target's tables record, kept per process (``Held``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from pyspark.sql import SparkSession


class AppliedSeq(Protocol):
    def applied_seq(self, spark: SparkSession, kind: str, schema: str, table: str, step: str) -> int: ...


@dataclass(slots=True)
class Held:
    """Per table and step, the highest batch seq the table's commits record: read from the table the first
    time (``Lakehouse.applied_seq``, a Spark job over its log), then kept from this process's own commits. Exact
    because one consumer applies to a target (``state.lock_target``); forgotten after a failed merge,
    whose commits are not known."""

    seqs: dict[tuple[str, str, str], int] = field(default_factory=dict)  # (kind, "schema.table", step)

    def seq(self, spark: SparkSession, fmt: AppliedSeq, kind: str, schema: str, table: str, step: str) -> int:
        key = (kind, f"{schema}.{table}", step)
        if key not in self.seqs:
            self.seqs[key] = fmt.applied_seq(spark, kind, schema, table, step)
        return self.seqs[key]

    def applied(self, kind: str, schema: str, table: str, step: str, seq: int) -> None:
        """Record that the table's commits now record ``seq`` (or a later batch) for ``step``."""
        key = (kind, f"{schema}.{table}", step)
        self.seqs[key] = max(self.seqs.get(key, 0), seq)
