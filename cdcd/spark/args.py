"""The Spark consumer's arguments: one definition for ``cdcd spark run``, ``python -m cdcd.spark.consumer`` and
``spark-submit cdcd/spark/consumer.py``.

Imports nothing of Spark: ``cdcd``'s command line builds its parser from it without loading pyspark.
"""

from __future__ import annotations

import argparse
import os

FORMATS = ("parquet", "delta", "iceberg")
DEFAULT_BUCKETS = 16
#: After SIGTERM/SIGINT the consumer exits within this (``--stop-timeout``; ``cdcd.spark.stopping``).
DEFAULT_STOP_TIMEOUT_S = 45.0
LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("auto", "json", "console")
DESCRIPTION = "merge landed batches into change-log tables and current-state mirrors (docs/spark.md)"


def listen_address(value: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:PORT`` for IPv6) as (host, port); argparse reports a ValueError as a usage error."""
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"{value!r} is not HOST:PORT (e.g. 127.0.0.1:9190, or 0.0.0.0:9190 to "
                                         "listen on every interface)")
    return host.strip("[]") or "0.0.0.0", int(port)


def landing_path(value: str) -> str:
    """The landing zone: a path, or the daemon's ``s3://bucket/prefix`` (``s3a://`` too)."""
    return value if value.startswith(("s3://", "s3a://")) else local_path(value)


def local_path(value: str) -> str:
    """A target given as a path: an object-store URL is refused (exit 2) rather than taken for a local directory
    named ``s3a:``. The consumer's state and its lock need a POSIX file system today (docs/spark.md, Object
    storage)."""
    if "://" in value:
        scheme = value.split("://", 1)[0]
        raise argparse.ArgumentTypeError(
            f"{value!r} is a {scheme}:// URL: the consumer's target, its state and lock, and cdcd verify's target "
            "are a POSIX path only (local, or a shared file system mounted at the same path on every Spark node); "
            "on object storage only the landing zone (s3://) is supported yet (docs/spark.md, Object storage). "
            "Give the path of a target directory")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The consumer's options, added to ``p``."""
    p.add_argument("--landing", required=True, type=landing_path, metavar="PATH",
                   help="the daemon's landing.path (a directory, or s3://bucket/prefix)")
    p.add_argument("--target", required=True, type=local_path, metavar="PATH",
                   help="where the change-log and mirror tables go")
    p.add_argument("--once", action="store_true", help="apply what is landed now (and what lands meanwhile), exit")
    p.add_argument("--format", default="delta", choices=FORMATS,
                   help="table format of the target (default delta; docs/spark.md)")
    p.add_argument("--checkpoint", metavar="PATH", default=None,
                   help="Spark's checkpoint location (default TARGET/checkpoint)")
    p.add_argument("--buckets", type=int, default=DEFAULT_BUCKETS, metavar="N",
                   help=f"hash buckets of a new Parquet mirror table (default {DEFAULT_BUCKETS})")
    p.add_argument("--delta-readers", choices=("spark", "any"), default=os.environ.get("CDCD_DELTA_READERS", "spark"),
                   help="Delta mirrors for Spark readers (deletion vectors, column mapping; default) or for any "
                        "reader (delta-rs, pandas, DuckDB; each merge rewrites the files it changes); env "
                        "CDCD_DELTA_READERS; docs/spark.md, Readers")
    p.add_argument("--metrics-listen", type=listen_address, default=None, metavar="HOST:PORT",
                   help="serve Prometheus /metrics and /healthz there (default: off; docs/metrics.md)")
    p.add_argument("--stop-timeout", type=float, default=DEFAULT_STOP_TIMEOUT_S, metavar="S",
                   help="after SIGTERM/SIGINT, the merge in progress may finish within this many seconds; past "
                        "it (or at a second signal) it is abandoned, exit 3 (default 45; docs/spark.md, Stopping)")
    p.add_argument("--log-level", default="info", choices=LOG_LEVELS,
                   help="cdcd's lines at this level and up; Spark's and py4j's own lines show from ERROR, "
                        "at debug from WARN (and Java traces)")
    p.add_argument("--log-format", default="auto", choices=LOG_FORMATS,
                   help="JSON lines, or a console renderer; auto: console on a TTY, else JSON (as the daemon)")


def parser(prog: str = "cdcd spark run") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=DESCRIPTION)
    add_arguments(p)
    return p
