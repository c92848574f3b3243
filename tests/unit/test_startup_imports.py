"""What ``cdcd run`` imports before it reads the source: every daemon start pays for it (issue 14)."""

from __future__ import annotations

import json
import subprocess
import sys

# the modules the daemon loads for either source and the landing sink
DAEMON = ("cdcd.cli", "cdcd.daemon.lifecycle", "cdcd.sources.postgres.source", "cdcd.sources.mysql.source",
          "cdcd.sinks.landing")
# console-only and Spark-only packages: imported when a command needs them, never by the daemon's start
NOT_AT_START = ("rich", "pygments", "pyspark", "py4j")


def _run(code: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=120)
    return out.stdout.splitlines()


def test_the_daemon_starts_without_console_or_spark_packages() -> None:
    code = "\n".join(f"import {m}" for m in DAEMON)
    loaded = json.loads(_run(f"{code}\nimport json, sys\nprint(json.dumps([m for m in {NOT_AT_START!r} "
                             "if m in sys.modules]))")[-1])
    assert loaded == []


def test_console_logs_still_carry_tracebacks() -> None:
    lines = _run("import cdcd.cli\nfrom cdcd.logging import configure_logging, get_logger\n"
                 "configure_logging('info', 'console', 'stdout')\n"
                 "try:\n    1 / 0\nexcept ZeroDivisionError:\n    get_logger('t').exception('it failed')")
    text = "\n".join(lines)
    assert "it failed" in text and "Traceback" in text and "ZeroDivisionError" in text
