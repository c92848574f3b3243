"""A failed merge as one error line: the table, the batches, the message and the fix where one is known.

The consumer (``cdcd.spark.job``) logs one such line per failure; the Java or Python trace goes to a debug line.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cdcd.landing.manifest import Manifest
from cdcd.landing.objstore import is_object_url
from cdcd.logging import get_logger
from cdcd.spark.formats import lakehouse_format
from cdcd.spark.stopping import GUARD
from cdcd.spark.strategy import FAILED_TABLE

_log = get_logger("cdcd.spark")

#: The first characters of a failure's message in its error line (Spark's can hold a whole query plan).
MESSAGE_MAX = 2000
#: How far down a Java exception's causes the error line looks for the root (a cause may point back up).
CAUSES_MAX = 20


@dataclass(frozen=True, slots=True)
class Failure:
    """A failed merge as its error line tells it."""

    table: str | None
    batches: str
    error: str
    fix: str | None
    trace: str

    def log(self, fmt: str) -> None:
        _log.error("merge failed", table=self.table, batches=self.batches, format=fmt, error=self.error,
                   fix=self.fix)
        _log.debug("merge failed: trace", table=self.table, batches=self.batches, trace=self.trace)


def _message_and_trace(exc: BaseException) -> tuple[str, str]:
    """What went wrong in a line or a few, and the trace (Java's for a JVM error) for the debug line."""
    trace = "".join(traceback.format_exception(exc))
    java = getattr(exc, "java_exception", None)  # py4j's Py4JJavaError
    if java is not None:
        try:
            return _java_message(java), str(exc)
        except Exception:  # the JVM is gone: what py4j kept
            return str(exc).split("\n", 1)[0], trace
    text = str(exc)
    stack = getattr(exc, "_stackTrace", None)  # PySpark's CapturedException (AnalysisException, ...)
    if isinstance(stack, str) and stack:
        text = text.split("\n\nJVM stacktrace:", 1)[0]
        trace = f"{trace}\nJVM stacktrace:\n{stack}"
    return text.strip()[:MESSAGE_MAX] or type(exc).__name__, trace


def _java_message(java: Any) -> str:
    """A Java exception's text, and its root cause's when another: a wrapper such as Scala's "Boxed Exception"
    (an Error inside a future) says nothing of what failed."""
    text = str(java.toString())
    root, seen = java, 0
    while root.getCause() is not None and seen < CAUSES_MAX:
        root, seen = root.getCause(), seen + 1
    return text if root is java else f"{text} (caused by {root.toString()})"


def _missing_files(landing: Path, batches: list[tuple[int, Manifest]]) -> list[tuple[int, str, str]]:
    """(seq, path, table) of every landed file the batches list that is not in the landing zone (not asked of
    an object store: the failure's own message names the missing object there)."""
    if is_object_url(landing):
        return []
    return [(seq, e.path, f"{e.table.schema}.{e.table.name}")
            for seq, manifest in batches for e in manifest.files if not (landing / e.path).is_file()]


def describe(exc: BaseException, landing: Path, target: Path, fmt: str,
             batches: list[tuple[int, Manifest]]) -> Failure:
    """The error line of a failed merge: the table, the batches, the message and the fix where one is known."""
    GUARD.hold()  # the failure may come from a forced stop ending the JVM: then the stop's exit code stands
    message, trace = _message_and_trace(exc)
    table: str | None = getattr(exc, FAILED_TABLE, None)
    span = f"{batches[0][0]}..{batches[-1][0]}" if batches else "-"
    fix: str | None = None
    missing = _missing_files(landing, batches)
    text = f"{message}\n{trace}"
    if missing:
        seq, path, table = missing[0]
        fix = (f"batch {seq} lists {path}, which is not in the landing zone {landing} (removed by hand, or by a "
               "retention shorter than this consumer's lag): the batch cannot be applied. Put the file back, or "
               "rebuild: a new snapshot into a new landing zone and a fresh --target (docs/operations.md, Faults)")
    elif "DELTA_UNSUPPORTED_ALTER_TABLE_CHANGE_COL_OP" in text and table is not None:
        schema, name = table.split(".", 1)
        names = lakehouse_format(fmt, target)
        tables = " and ".join(names.ref(kind, schema, name) for kind in ("changelog", "tables"))
        fix = (f"Delta Lake refused a column type change of {tables} that its type widening does not cover: take "
               "one of the two ways out of docs/spark.md, Schema changes (a new mirror version, or a rewrite approved "
               "with the mirror's table property cdcd.rewrite.<column>), then start the consumer again")
    elif "CodeCache" in text:  # before the heap: "OutOfMemoryError: Out of space in CodeCache ..."
        fix = ("the JVM's code cache is full: keep -XX:ReservedCodeCacheSize=240m (or more) in CDCD_SPARK_JAVA_OPTIONS "
               "for `cdcd spark run`, or in --driver-java-options and spark.executor.extraJavaOptions under "
               "spark-submit, then start the consumer again (docs/spark-internals.md, performance)")
    elif "OutOfMemoryError" in text or "Java heap space" in text:
        fix = ("the JVM ran out of heap: raise CDCD_SPARK_DRIVER_MEMORY (default 2g) for `cdcd spark run`, or "
               "spark.driver.memory / spark.executor.memory under spark-submit (docs/spark.md, memory)")
    elif "No space left on device" in text:
        fix = (f"a file system is full: free space where {target}, {landing} (its consumed markers) or Spark's "
               "temporary directories live (the error names the file), then start the consumer again; what was "
               "committed is kept")
    elif "Permission denied" in text:
        fix = f"the consumer's user may not write or read a file it needs: check the ownership of {target} and " \
              f"{landing}"
    return Failure(table, span, message, fix, trace)

