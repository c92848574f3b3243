"""`cdcd verify`: the mirror compared with the source (``command``), row by row.

``source`` reads the source with the source's own connection and TLS code,
``mirror`` reads the target (Parquet, Delta Lake, Iceberg), ``normalize`` and
``compare`` match the two, ``report`` prints the differences. Only a Delta Lake
or Iceberg target needs Spark.
"""

from __future__ import annotations

from cdcd.verify.command import verify

__all__ = ["verify"]
