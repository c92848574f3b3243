"""The table formats by their ``--format`` name.

``lakehouse_format`` gives the Delta Lake or Iceberg strategy of a target, for what names its tables, their
DDL and their commit record (the job's ``make_strategy``, ``cdcd verify``, the consumer's error lines).
"""

from __future__ import annotations

from pathlib import Path

from cdcd.spark.delta import Delta
from cdcd.spark.iceberg import Iceberg
from cdcd.spark.lakehouse import Lakehouse

LAKEHOUSES: dict[str, type[Lakehouse]] = {"delta": Delta, "iceberg": Iceberg}


def lakehouse_format(fmt: str, target: Path) -> Lakehouse:
    """The strategy of ``--format delta|iceberg`` for TARGET."""
    return LAKEHOUSES[fmt](target)
