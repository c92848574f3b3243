"""The Spark job's entry point: ``spark-submit cdcd/spark/consumer.py --landing L --target T [--once]``.

Also ``python -m cdcd.spark.consumer`` and ``cdcd spark run``: one parser (``cdcd.spark.args``), the
same arguments. The job itself is ``cdcd.spark.job``.
"""

from __future__ import annotations

import sys

from cdcd.spark.job import main, run

__all__ = ["main", "run"]

if __name__ == "__main__":
    sys.exit(main())
