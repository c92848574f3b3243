"""The local JVM's output as cdcd log lines (``cdcd.spark.session._jvm_line``): its notices at debug, anything
unexpected shown as a warning; py4j's lines on the root logger at debug only."""

from __future__ import annotations

import logging
import os

import pytest
import structlog

from cdcd.spark import session
from cdcd.spark.session import _jvm_line, quiet_python_loggers


@pytest.mark.parametrize("line", [
    'SLF4J: Failed to load class "org.slf4j.impl.StaticLoggerBinder".',
    "SLF4J: Defaulting to no-operation (NOP) logger implementation",
    "WARNING: Using incubator modules: jdk.incubator.vector",
    'Setting default log level to "WARN".',
])
def test_the_jvms_notices_are_debug(line: str) -> None:
    with structlog.testing.capture_logs() as logs:
        _jvm_line(line)
    assert [(e["event"], e["log_level"]) for e in logs] == [(line, "debug")]


def test_an_unexpected_line_is_shown() -> None:
    with structlog.testing.capture_logs() as logs:
        _jvm_line("Exception in thread main: something broke")
    assert [e["log_level"] for e in logs] == ["warning"]


def test_py4j_lines_on_the_root_logger_show_at_debug_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """py4j calls ``logging.exception("Exception while sending command.")`` (the root logger) when the JVM is gone:
    at info that line was a second error beside the consumer's own report of the failure."""
    quiet_python_loggers()
    quiet_python_loggers()  # once is enough: the filter is not added twice
    root = logging.getLogger()
    assert len([f for f in root.filters if isinstance(f, session._Py4jOnRootLogger)]) == 1

    def record(path: str) -> logging.LogRecord:
        return logging.LogRecord("root", logging.ERROR, path, 1060, "Exception while sending command.", None, None)

    py4j = os.path.join(os.sep, "venv", "site-packages", "py4j", "java_gateway.py")
    ours = os.path.join(os.sep, "src", "cdcd", "spark", "job.py")
    monkeypatch.setattr(session, "_verbose", lambda: False)
    assert not root.filter(record(py4j)) and root.filter(record(ours))
    monkeypatch.setattr(session, "_verbose", lambda: True)
    shown = record(py4j)
    assert root.filter(shown) and shown.levelname == "DEBUG"  # at debug, and as a debug line: not a second error
    mine = record(ours)
    assert root.filter(mine) and mine.levelname == "ERROR"
