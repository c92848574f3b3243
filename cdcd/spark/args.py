"""The Spark consumer's arguments: one definition for ``cdcd spark run``, ``python -m cdcd.spark.consumer`` and
``spark-submit cdcd/spark/consumer.py``.

Imports nothing of Spark: ``cdcd``'s command line builds its parser from it without loading pyspark.
"""

from __future__ import annotations

import argparse
import os

FORMATS = ("parquet", "delta", "iceberg")
OBJECT_SCHEMES = ("s3://", "s3a://")
#: How long a target's lease on object storage lasts unless renewed (``cdcd.spark.lease``; imports no Spark).
DEFAULT_LEASE_S = 60.0
DEFAULT_BUCKETS = 16
#: After SIGTERM/SIGINT the consumer exits within this (``--stop-timeout``; ``cdcd.spark.stopping``).
DEFAULT_STOP_TIMEOUT_S = 45.0
LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("auto", "json", "console")
REGISTER_ENV = "CDCD_SPARK_REGISTER_TABLES"
DESCRIPTION = "merge landed batches into change-log tables and current-state mirrors (docs/spark.md)"


def env_flag(name: str) -> bool:
    """An on/off environment setting: 1, true, yes or on (any case) turn it on."""
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def listen_address(value: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:PORT`` for IPv6) as (host, port); argparse reports a ValueError as a usage error."""
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"{value!r} is not HOST:PORT (e.g. 127.0.0.1:9190, or 0.0.0.0:9190 to "
                                         "listen on every interface)")
    return host.strip("[]") or "0.0.0.0", int(port)


def landing_path(value: str) -> str:
    """The landing zone: a path, or the daemon's ``s3://bucket/prefix`` (``s3a://`` too)."""
    return target_path(value)


def target_path(value: str) -> str:
    """A target (or landing zone): a path, or ``s3://bucket/prefix`` (``s3a://`` too); another URL scheme is
    refused (exit 2) rather than taken for a local directory named ``gs:``."""
    if value.startswith(OBJECT_SCHEMES) and value.split("://", 1)[1].strip("/"):
        return value
    if "://" in value:
        scheme = value.split("://", 1)[0]
        raise argparse.ArgumentTypeError(
            f"{value!r}: a {scheme}:// URL without a bucket, or a scheme cdcd does not write: a target or a landing "
            "zone is a path (local, or a shared file system mounted at the same path on every Spark node) or "
            "s3://bucket/prefix (s3a:// too; docs/spark.md, Object storage)")
    return value


#: The former name (``cdcd verify`` and ``cdcd repair`` take their --target with it).
local_path = target_path


def seconds(value: str) -> float:
    """A number of seconds above 0."""
    try:
        s = float(value)
    except ValueError:
        s = 0.0
    if not s > 0:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number of seconds above 0")
    return s


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The consumer's options, added to ``p``."""
    p.add_argument("--landing", required=True, type=landing_path, metavar="PATH",
                   help="the daemon's landing.path (a directory, or s3://bucket/prefix)")
    p.add_argument("--target", required=True, type=target_path, metavar="PATH",
                   help="where the change-log and mirror tables go (a directory, or s3://bucket/prefix for Delta "
                        "and Iceberg)")
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
    p.add_argument("--register-tables", action="store_true", default=env_flag(REGISTER_ENV),
                   help="register every Delta mirror and change-log by name in the session catalog (a Hive "
                        "metastore: embedded under TARGET/state/metastore locally, the cluster's under "
                        f"spark-submit) as <schema>.<table> and <schema>.<table>_changelog; env {REGISTER_ENV}; "
                        "docs/spark.md, Tables by name")
    p.add_argument("--metrics-listen", type=listen_address, default=None, metavar="HOST:PORT",
                   help="serve Prometheus /metrics and /healthz there (default: off; docs/metrics.md)")
    p.add_argument("--stop-timeout", type=float, default=DEFAULT_STOP_TIMEOUT_S, metavar="S",
                   help="after SIGTERM/SIGINT, the merge in progress may finish within this many seconds; past "
                        "it (or at a second signal) it is abandoned, exit 3 (default 45; docs/spark.md, Stopping)")
    p.add_argument("--lease-seconds", type=seconds, default=DEFAULT_LEASE_S, metavar="S",
                   help="a target on object storage: this consumer's lease on it lasts this long unless renewed "
                        f"(every third of it); a crashed consumer's target is free after it (default "
                        f"{DEFAULT_LEASE_S:g}; docs/spark.md, Object storage)")
    p.add_argument("--log-level", default="info", choices=LOG_LEVELS,
                   help="cdcd's lines at this level and up; Spark's and py4j's own lines show from ERROR, "
                        "at debug from WARN (and Java traces)")
    p.add_argument("--log-format", default="auto", choices=LOG_FORMATS,
                   help="JSON lines, or a console renderer; auto: console on a TTY, else JSON (as the daemon)")


def parser(prog: str = "cdcd spark run") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=DESCRIPTION)
    add_arguments(p)
    return p
