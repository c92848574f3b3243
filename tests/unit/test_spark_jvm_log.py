"""The local JVM's output as cdcd log lines (``cdcd.spark.session._jvm_line``): its notices at debug, anything
unexpected shown as a warning."""

from __future__ import annotations

import pytest
import structlog

from cdcd.spark.session import _jvm_line


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
